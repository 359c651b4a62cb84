"""The planned host arena at run time: one buffer for a step's payloads, checked as it is used.

The step repeats, so the host payloads of a closed step (their sizes and lifetimes) plan the
next one: ``memplan`` places them in one buffer, pinned on CUDA. At run time nothing is
trusted: a payload takes its site's region only if it fits and no live payload holds bytes
of that region (the next step may differ, two forwards may be alive at once, and
``retain_graph`` keeps payloads); anything else gets memory of its own, as without the arena.

A region is given back when the payload tensor viewing it is garbage collected. On CUDA its
next writer's stream first waits, on the device, for the last copy that touched it.
"""

from __future__ import annotations

import mmap
import queue
import threading
import warnings
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ..codecs import get_codec
from ..config import COMPRESSORS
from ..planning import memplan
from ..planning.memplan import Buffer, Layout
from ..records import SiteStats, StepStats, fmt_bytes

ALIGNMENT = 512  # bytes; every region starts at a multiple of it


@dataclass(eq=False)
class Lease:
    """A region held by one payload, and the device work the region is ordered after."""

    key: int
    wait_for: list[torch.cuda.Event]  # for the writer: the last copies of earlier holders
    last_use: torch.cuda.Event | None = None  # the last device copy that touched it


class HostArena:
    """One host buffer laid out by a :class:`~cswap_lightning.planning.memplan.Layout`.

    ``acquire`` runs in one thread only (the offload worker); payloads are released from
    any thread, through a queue that ``acquire`` empties."""

    def __init__(
        self, layout: Layout, signature: tuple, pin: bool, device: torch.device | None = None
    ) -> None:
        """``pin``: page-locked, registered with the CUDA context of ``device``."""
        self.layout = layout
        self.signature = signature  # the sites it was planned for
        self.slot_bytes = sum(size for _, size in layout.regions.values())
        self._sharing = _sharing(layout)
        self._busy: set[int] = set()
        self._last_use: dict[int, torch.cuda.Event] = {}
        self._released: deque[Lease] = deque()  # appended to by any thread (_region_free)
        self._unpin: weakref.finalize | None = None
        # a whole number of 8-byte elements, so that it can be viewed as any dtype
        self.buffer = self._allocate(memplan.align_up(max(layout.arena_bytes, 1), 8), pin,
                                     device)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed as each dtype

    def acquire(self, key: int, nbytes: int, dtype: torch.dtype = torch.uint8,
                like: torch.Tensor | None = None) -> tuple[torch.Tensor, Lease] | str:
        """A view (as ``dtype``, 1-D or in the shape and strides of ``like``, a dense tensor of
        ``nbytes``: the region goes back when this very view is collected) of ``nbytes`` at
        the start of buffer ``key``'s region and its lease, or the reason it cannot be
        had."""
        released = self._released
        while released:
            lease = released.popleft()
            self._busy.discard(lease.key)
            if lease.last_use is not None:
                self._last_use[lease.key] = lease.last_use
        region = self.layout.regions.get(key)
        if region is None:
            return "unplanned"
        at, size = region
        if nbytes > size:
            return "too big"
        sharing = self._sharing[key]
        if not self._busy.isdisjoint(sharing):
            return "busy"
        self._busy.add(key)
        last_use = self._last_use
        lease = Lease(key, [last_use[k] for k in sharing if k in last_use])
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.buffer.view(dtype)
        itemsize = dtype.itemsize  # regions start at multiples of ALIGNMENT: whole elements
        if like is None:
            view = typed.as_strided((nbytes // itemsize,), (1,), at // itemsize)
        else:
            view = typed.as_strided(like.shape, like.stride(), at // itemsize)
        held = weakref.ref(view, partial(_region_free, self, lease))
        _HELD[id(held)] = held
        return view, lease

    def in_use(self) -> int:
        """Regions held by live payloads."""
        return len(self._busy) - len(self._released)

    def _allocate(self, nbytes: int, pin: bool, device: torch.device | None) -> torch.Tensor:
        if not pin:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Page-locked in place, not taken from PyTorch's pinned allocator, which would round
        # the arena up to a power of two: the waste the arena exists to avoid. Whole pages of
        # its own (an anonymous mapping), so that no other registered range shares a page with
        # it and its storage starts where the registered range does (``is_pinned`` asks about
        # the storage's start). Registered under ``device``: this thread's own current device
        # (0) would get a CUDA context of its own.
        size = memplan.align_up(nbytes, mmap.PAGESIZE)
        base = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        with torch.cuda.device(device):
            status = int(torch.cuda.cudart().cudaHostRegister(base.data_ptr(), size, 1))
        if status != 0:
            raise RuntimeError(f"cudaHostRegister of {fmt_bytes(size)} failed with error {status}")
        _start_unpinner()
        unpin = partial(_unregister, base, device, self._last_use, self._released)
        self._unpin = weakref.finalize(self, _UNPINS.put, unpin)
        self._unpin.atexit = False  # not once CUDA is gone
        return base[:nbytes]

    def unpin_now(self) -> None:
        """Unpin it in this thread (once the copies that touched it are done), rather than
        when it is collected: payloads still viewing it stay valid, in pageable memory."""
        if self._unpin is not None and self._unpin.alive:
            _, _, (unpin,), _ = self._unpin.detach()
            unpin()


_HELD: dict[int, weakref.ref] = {}  # the weak reference to each live view, by its id


def _region_free(arena: HostArena, lease: Lease, view: weakref.ref) -> None:
    """A payload's view of an arena region was collected (in whichever thread dropped it):
    its lease goes to the arena's released queue. The reference's callback holds the arena,
    and ``_HELD`` the reference, so an arena (and its pinning) lives while any view of it
    does. Cheaper than ``weakref.finalize``, on every moved tensor's pack on CUDA."""
    del _HELD[id(view)]
    arena._released.append(lease)


# Whichever thread drops an arena's last payload (the forward thread, even) must not wait for
# its copies to finish and for the driver to unpin it: a thread of its own does. A SimpleQueue
# because its put() is safe in a weakref callback, which may run inside any other code.
_UNPINS: queue.SimpleQueue = queue.SimpleQueue()
_unpinner_started = threading.Lock()


_unpinner: threading.Thread | None = None


def _start_unpinner() -> None:
    global _unpinner
    if _unpinner_started.acquire(blocking=False):  # once per process
        _unpinner = threading.Thread(target=_unpin_forever, name="cswap-unpin", daemon=True)
        _unpinner.start()


def stop_unpinner() -> None:
    """End the unpinning thread once the unpinning queued so far is done (at interpreter
    exit: a thread inside a CUDA call when the interpreter goes aborts the process)."""
    if _unpinner is not None and _unpinner.is_alive():
        _UNPINS.put(None)
        _unpinner.join(timeout=30)


def _unpin_forever() -> None:
    while True:
        job = _UNPINS.get()
        if job is None:
            return
        try:
            job()
        except Exception as err:  # noqa: BLE001 - the thread must go on for the next arena
            warnings.warn(f"cswap: could not unpin a host arena: {err}", RuntimeWarning,
                          stacklevel=1)


def _unregister(
    base: torch.Tensor,
    device: torch.device | None,
    last_use: dict[int, torch.cuda.Event],
    released: deque[Lease],
) -> None:
    """Unpin an arena, once the copies that touched it are done (under the device it was
    registered with)."""
    with torch.cuda.device(device):
        for event in [*last_use.values(), *(lease.last_use for lease in released)]:
            if event is not None:
                event.synchronize()
        torch.cuda.cudart().cudaHostUnregister(base.data_ptr())


def _sharing(layout: Layout) -> dict[int, tuple[int, ...]]:
    """For each buffer, the buffers whose regions share bytes with its own (itself included)."""
    regions = sorted((at, at + size, key) for key, (at, size) in layout.regions.items())
    sharing: dict[int, list[int]] = {key: [key] for key in layout.regions}
    for i, (_, stop, key) in enumerate(regions):
        for at, _, other in regions[i + 1 :]:
            if at >= stop:
                break
            sharing[key].append(other)
            sharing[other].append(key)
    return {key: tuple(keys) for key, keys in sharing.items()}


def payload_buffers(step: StepStats) -> list[Buffer]:
    """One buffer per host payload of ``step``: the most its payload can take (its stored
    size; a zvc or rle one's capacity), from its pack to its first unpack (or to the step's
    last tick if backward never needed it, yet)."""
    last = max((max(s.packed_at, s.unpacked_at or 0) for s in step.sites), default=0)
    return [
        Buffer(s.site, _slot_bytes(s), s.packed_at,
               last if s.unpacked_at is None else s.unpacked_at)
        for s in step.sites
        if s.stored_bytes > 0
    ]


def _slot_bytes(site: SiteStats) -> int:
    if site.decision not in COMPRESSORS:
        return site.stored_bytes
    itemsize = getattr(torch, site.dtype).itemsize
    return get_codec(site.decision).capacity(site.nbytes // itemsize, itemsize)


@dataclass(frozen=True)
class ArenaReport:
    """Host memory for the payloads of one closed step."""

    step: int
    payloads: int
    lower_bound: int  # most payload bytes live at once: no placement needs less
    per_tensor_bytes: int  # at least what PyTorch's pinned allocator holds for them one by one
    arena_bytes: int  # the arena planned for the following steps (0: none)
    hits: int  # payloads of this step that went into the arena
    fallbacks: dict[str, int] = field(default_factory=dict)  # allocated on their own, by reason
    replanned: bool = False

    def __str__(self) -> str:
        def vs_bound(n: int) -> str:
            return f"{fmt_bytes(n)} ({n / self.lower_bound:.2f}x)" if self.lower_bound else "-"

        fallbacks = ", ".join(f"{n} {why}" for why, n in sorted(self.fallbacks.items()))
        return (
            f"step {self.step}: {self.payloads} host payloads, lower bound "
            f"{fmt_bytes(self.lower_bound)}; arena {vs_bound(self.arena_bytes)}"
            f"{' (re-planned)' if self.replanned else ''}; per-tensor pinned >= "
            f"{vs_bound(self.per_tensor_bytes)}; {self.hits} in the arena, "
            f"{sum(self.fallbacks.values())} on their own{f' ({fallbacks})' if fallbacks else ''}"
        )


class HostMemory:
    """Host slots for payloads: the planned arena when it can serve, per-tensor otherwise.

    Each closed step is accounted for, and re-planned from if its sites changed, a payload
    did not fit, or the arena is larger than its slots need, in the transfer's background
    thread: allocating and pinning a large arena must not hold up forward, which uses
    per-tensor memory until the new arena is ready. A slot is as large as its payload can be:
    a raw or lossy payload's size, a zvc or rle payload's capacity (its length is known only
    once it is in host memory)."""

    def __init__(self, pin: bool, alignment: int = ALIGNMENT) -> None:
        self.pin = pin
        self.alignment = alignment
        self.arena: HostArena | None = None
        self._lock = threading.Lock()
        self._hits = 0
        self._fallbacks: Counter[str] = Counter()
        self._failed: tuple | None = None  # signature whose arena could not be allocated
        self._warned = False
        self._report: ArenaReport | None = None

    def acquire(self, site: int, nbytes: int, dtype: torch.dtype = torch.uint8,
                like: torch.Tensor | None = None) -> tuple[torch.Tensor, Lease] | None:
        """The planned region for ``site`` (as ``dtype``, 1-D or in ``like``'s shape and
        strides), or None: allocate one."""
        with self._lock:  # the planning thread takes the counts
            arena = self.arena
            taken = (arena.acquire(site, nbytes, dtype, like) if arena is not None
                     else "no arena")
            if isinstance(taken, str):
                self._fallbacks[taken] += 1
                return None
            self._hits += 1
        return taken

    def step_closed(self, step: StepStats, device: torch.device | None = None,
                    plan: bool = True) -> None:
        """Account for ``step`` (its offload work finished) and, with ``plan``, plan from it
        (call it off the forward thread); ``device``: where its tensors were (the arena is
        pinned for a CUDA device only). A step that moved sites untracked has no rows for
        them to plan from: its report keeps the payload figures of the step planned from."""
        with self._lock:
            hits, fallbacks = self._hits, dict(self._fallbacks)
            self._hits, self._fallbacks = 0, Counter()
        if plan or self._report is None:
            self._plan_from(step, device, hits, fallbacks)
        else:
            self._report = replace(self._report, step=step.step, hits=hits,
                                   fallbacks=fallbacks, replanned=False)

    def report(self) -> ArenaReport | None:
        """The last closed step's report."""
        return self._report

    def held_bytes(self) -> int:
        """Host memory held between steps: the arena."""
        arena = self.arena
        return 0 if arena is None else arena.buffer.numel()

    def close(self) -> None:
        """Unpin the arena now (in this thread) and let it go."""
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.unpin_now()

    def _plan_from(self, step: StepStats, device: torch.device | None, hits: int,
                   fallbacks: dict[str, int]) -> None:
        payloads = payload_buffers(step)
        slots = [replace(b, size=memplan.align_up(b.size, self.alignment)) for b in payloads]
        signature = tuple((s.site, s.nbytes, s.decision) for s in step.sites if s.stored_bytes)
        # A step that stored nothing (e.g. a forward under no_grad) says nothing about the next.
        replan = bool(slots) and self._should_replan(signature, slots, fallbacks)
        if replan:
            self.arena = None  # an arena no payload holds is freed before the next is made
            self.arena = self._allocate(slots, signature, device)
        self._report = ArenaReport(
            step.step,
            len(payloads),
            memplan.lower_bound(payloads),
            memplan.per_tensor_bytes(payloads),
            self.arena.layout.arena_bytes if self.arena is not None else 0,
            hits,
            fallbacks,
            replan,
        )

    def _should_replan(self, signature: tuple, slots: list[Buffer], fallbacks: dict) -> bool:
        arena = self.arena
        if arena is None:
            return signature != self._failed
        return (signature != arena.signature or "too big" in fallbacks
                or arena.slot_bytes > sum(b.size for b in slots))

    def _allocate(
        self, slots: list[Buffer], signature: tuple, device: torch.device | None
    ) -> HostArena | None:
        layout = memplan.plan(slots, self.alignment)
        pin = self.pin and device is not None and device.type == "cuda"
        try:
            return HostArena(layout, signature, pin, device)
        except RuntimeError as err:
            self._failed = signature
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"cswap: could not allocate the planned host arena of "
                    f"{fmt_bytes(layout.arena_bytes)} ({err}); payloads get host memory of "
                    "their own, one by one. Further failures are not reported.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
