"""Where each host buffer of a repeating step goes in one arena: lifetime-aware best fit.

Pure arithmetic on buffers (a key, a size, a lifetime in ticks of the step clock); no torch.
Two buffers may share bytes only if their lifetimes are disjoint. Buffers are placed largest
first, each in the smallest gap left by the already placed buffers whose lifetimes overlap
its own (lowest offset on ties), or past the last of them.

Two figures to judge a placement by:

- ``lower_bound``: the most bytes live at one tick. No placement needs less.
- ``per_tensor_bytes``: what allocating each buffer on its own in PyTorch's pinned-memory
  allocator holds at least. ``CachingHostAllocatorImpl::allocate`` in
  aten/src/ATen/core/CachingHostAllocator.h rounds every request up to a power of two
  (``roundSize = c10::llvm::PowerOf2Ceil(size)``) and never splits a cached block, so at
  the busiest tick it holds at least the live sizes rounded up that way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Buffer:
    """A buffer of ``size`` bytes needed from tick ``start`` to tick ``end``, both included."""

    key: int
    size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"buffer {self.key}: size must be >= 0 bytes, got {self.size}")
        if self.end < self.start:
            raise ValueError(
                f"buffer {self.key}: lifetime ends (tick {self.end}) before it starts "
                f"(tick {self.start})"
            )

    def lives_with(self, other: Buffer) -> bool:
        """Whether both buffers are needed at some common tick."""
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class Layout:
    """Where each buffer lies in an arena of ``arena_bytes``: key -> ``(offset, size)``."""

    regions: dict[int, tuple[int, int]]
    arena_bytes: int
    alignment: int


def plan(buffers: Iterable[Buffer], alignment: int = 512) -> Layout:
    """Place ``buffers`` so that no two with overlapping lifetimes overlap in memory.

    Every offset is a multiple of ``alignment`` (a power of two)."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {alignment}")
    buffers = tuple(buffers)
    keys = [b.key for b in buffers]
    if len(set(keys)) != len(keys):
        raise ValueError(f"buffer keys must be unique, got {sorted(keys)}")
    # (offset, stop, start tick, end tick, buffer), kept sorted by offset
    placed: list[tuple[int, int, int, int, Buffer]] = []
    for buffer in sorted(buffers, key=lambda b: (-b.size, b.start, b.key)):
        start, end = buffer.start, buffer.end
        taken = [
            (at, stop) for at, stop, first, last, _ in placed if first <= end and start <= last
        ]
        at = _best_fit(taken, buffer.size, alignment)
        bisect.insort(placed, (at, at + buffer.size, start, end, buffer), key=_offset)
    regions = {b.key: (at, b.size) for at, _, _, _, b in placed}
    return Layout(regions, max((stop for _, stop, *_ in placed), default=0), alignment)


def lower_bound(buffers: Iterable[Buffer]) -> int:
    """The most bytes live at one tick: no placement of ``buffers`` fits in less."""
    return _peak_live(buffers, lambda b: b.size)


def per_tensor_bytes(buffers: Iterable[Buffer]) -> int:
    """The most bytes live at one tick once each size is rounded up to a power of two, as
    PyTorch's pinned-memory allocator does: a lower bound for what it holds."""
    return _peak_live(buffers, lambda b: power_of_two_ceil(b.size))


def power_of_two_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), like ``c10::llvm::PowerOf2Ceil``."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _best_fit(taken: list[tuple[int, int]], size: int, alignment: int) -> int:
    """The aligned offset of the smallest gap between ``taken`` ranges (sorted by start, may
    overlap one another) that holds ``size`` bytes; past the last range if none does."""
    best: tuple[int, int] | None = None  # (gap, offset)
    frontier = 0  # end of the taken bytes seen so far
    for start, stop in taken:
        at = align_up(frontier, alignment)
        gap = start - at
        if gap >= size and (best is None or gap < best[0]):
            best = (gap, at)
        frontier = max(frontier, stop)
    return best[1] if best is not None else align_up(frontier, alignment)


def _offset(placed: tuple) -> int:
    return placed[0]


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def _peak_live(buffers: Iterable[Buffer], size_of: Callable[[Buffer], int]) -> int:
    """Sweep the ticks: each buffer adds its size at ``start`` and removes it after ``end``."""
    events: list[tuple[int, int]] = []
    for b in buffers:
        events += [(b.start, size_of(b)), (b.end + 1, -size_of(b))]
    peak = live = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1] > 0)):  # frees first at a tick
        live += delta
        peak = max(peak, live)
    return peak
