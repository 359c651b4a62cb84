"""What the advisor needs to know, measured: per-site size, sparsity and hiding windows, and
the link's bandwidth.

A site's *forward window* is the compute between its pack and the next pack: the time its
copy out can hide behind. Its *backward window* is the compute between the unpack before it
(in backward order) and its own unpack: the time a prefetch can hide behind. On CUDA the
clock is a device event per pack and unpack, read once when the step is closed; on the CPU
it is the host clock. Only profiled steps are timed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from ..records import HOST_BUDGET, StepStats
from .replay import Link

_LINKS: dict[torch.device, Link] = {}


def measure_link(device: torch.device, nbytes: int = 64 << 20, repeats: int = 3,
                 barrier: Callable[[], object] | None = None) -> Link:
    """Copy bandwidths for ``device`` (pinned host memory on CUDA; on the CPU every direction
    is a memory copy), measured once per process.

    ``barrier`` is for processes that share this host's memory bandwidth and PCIe switches,
    the ranks of a node under DDP: each calls it before its timed copies, so all of them copy
    at once and each measures the bandwidth it gets while the others copy too, as in training.
    Such a figure is measured on every call (a rank that returned a cached one would leave the
    others waiting at the barrier).
    """
    device = torch.device(device)
    if barrier is None and device in _LINKS:
        return _LINKS[device]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = partial(_seconds, device=device, repeats=repeats, barrier=barrier)
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = seconds(lambda: host.copy_(src, non_blocking=True))
        h2d = seconds(lambda: src.copy_(host, non_blocking=True))
        dst = torch.empty_like(src)
        d2d = seconds(lambda: dst.copy_(src))
        link = Link(nbytes / d2h, nbytes / h2d, nbytes / d2d)
    else:  # offloading clones into new memory, page faults included: time that;
        # restoring a raw payload on the CPU takes it as it is, no copy
        copy = nbytes / seconds(src.clone)
        link = Link(copy, math.inf, copy)
    if barrier is None:
        _LINKS[device] = link
    return link


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int,
             barrier: Callable[[], object] | None) -> float:
    """Seconds one ``fn()`` takes: alone, the best of ``repeats`` (the least disturbed);
    after a ``barrier``, the mean of ``repeats`` back to back, a window long enough that the
    other processes' copies overlap it."""
    fn()  # warm-up
    clock = Clock(device)
    if barrier is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the warm-up is done before the barrier
        barrier()
        start = clock.now()
        for _ in range(repeats):
            fn()
        return max(clock.seconds(start, clock.now()) / repeats, 1e-9)
    best = float("inf")
    for _ in range(repeats):
        start = clock.now()
        fn()
        best = min(best, clock.seconds(start, clock.now()))
    return max(best, 1e-9)


class Clock:
    """Time stamps from the host clock, or from events on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # not the current device's
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        # Only when a profiled step is closed, never in forward. Both: they may be on two streams.
        start.synchronize()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int,
                   repeats: int) -> float:
    """Median time of ``fn`` after ``warmup`` calls: CUDA events on a GPU, the host clock
    else."""
    for _ in range(warmup):
        fn()
    clock, times = Clock(device), []
    for _ in range(repeats):
        start = clock.now()
        fn()
        times.append(clock.seconds(start, clock.now()))
    return max(statistics.median(times), 1e-9)


class StepTimer:
    """Time stamps of one step's packs, end of forward and first unpacks, per site; and which
    first unpacks one autograd node asked for (``together``). The host's clock is read beside
    them in forward, as each pack hook begins and as it is done with its site (each pack's
    third and fourth elements): on CUDA the stamps are the device's, and where the host falls
    behind the device, the step waits for it; the host's time from one hook's end to the
    next one's start is the forward's own, which a step without hooks takes too."""

    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self.began: object | None = None  # a step without hooks: when its forward began
        # site, stamp, the host's clock as its hook began and as it was done with the site
        self.packs: list[tuple[int, object, float, float]] = []
        self.unpacks: list[tuple[int, object]] = []
        self.forward_end: object | None = None
        self.groups: list[list[int]] = []  # first unpacks, by the node that asked for them
        self._node: tuple | None = None  # the node that asked last: its type and number
        self.host_began: float | None = None  # the host's clock at forward's start and end
        self.host_forward_end: float | None = None
        # backward's first unpack and its end (stamped where autograd calls back)
        self.backward_began: object | None = None
        self.backward_end: object | None = None

    def begin(self) -> None:
        self.began = self.clock.now()
        self.host_began = time.perf_counter()

    def packed(self, site: int) -> None:
        stamp, now = self.clock.now(), time.perf_counter()
        self.packs.append((site, stamp, now, now))

    def placed(self) -> None:
        """The pack hook is done with the latest site: the host's time from here to the next
        pack is the forward's own."""
        site, stamp, began, _ = self.packs[-1]
        self.packs[-1] = (site, stamp, began, time.perf_counter())

    def forward_done(self) -> None:
        self.forward_end = self.clock.now()
        self.host_forward_end = time.perf_counter()

    def backward_begin(self) -> None:
        self.backward_began = self.clock.now()

    def backward_done(self) -> None:
        self.backward_end = self.clock.now()

    def unpacked(self, site: int) -> None:
        self.unpacks.append((site, self.clock.now()))
        node = torch._C._current_autograd_node()
        # by kind and number, not held: a recomputation's node holds what it runs from
        key = None if node is None else (type(node), node._sequence_nr())
        if key is None or key != self._node:
            self.groups.append([])
        self._node = key
        self.groups[-1].append(site)

    def forward_s(self) -> float:
        """Seconds from the forward's start (its first pack where not stamped) to its end."""
        start = self.began if self.began is not None else (
            self.packs[0][1] if self.packs else None)
        if start is None or self.forward_end is None:
            return 0.0
        return self.clock.seconds(start, self.forward_end)

    def host_forward_s(self) -> float:
        """The host's seconds in forward, as ``forward_s``."""
        start = self.host_began if self.host_began is not None else (
            self.packs[0][2] if self.packs else None)
        if start is None or self.host_forward_end is None:
            return 0.0
        return self.host_forward_end - start

    def backward_s(self) -> float:
        """Seconds from backward's first unpack to its end (0 where either is missing)."""
        if self.backward_began is None or self.backward_end is None:
            return 0.0
        return self.clock.seconds(self.backward_began, self.backward_end)

    def unpack_order(self) -> list[int]:
        """The sites in the order backward first needed them, kept ones included."""
        return [site for site, _ in self.unpacks]

    def together(self) -> list[tuple[int, ...]]:
        """The sites first unpacked together, by one autograd node as its backward began (an
        op that saved several, a block's recomputation asking for all it kept), where more
        than one: they are all held from then until the node is done."""
        return [tuple(group) for group in self.groups if len(group) > 1]

    def windows(self) -> dict[int, tuple[float, float, float]]:
        """site -> (forward window, backward window, the host's forward window) in seconds;
        the host's is its time outside the pack hooks, from this site's hook's end to the
        next one's start."""
        if self.forward_end is None or not self.packs:
            return {}
        seconds = self.clock.seconds
        out = {}
        ends = [(stamp, began) for _, stamp, began, _ in self.packs[1:]]
        ends.append((self.forward_end, self.host_forward_end))
        for (site, start, _, done), (end, next_began) in zip(self.packs, ends, strict=True):
            out[site] = (seconds(start, end), 0.0, max(0.0, next_began - done))
        # The first site backward needs has nothing to hide behind: its prefetch starts late.
        for (_, before), (site, stamp) in zip(self.unpacks, self.unpacks[1:]):
            if site in out:
                out[site] = (out[site][0], seconds(before, stamp), out[site][2])
        return out


@dataclass
class SiteProfile:
    """Everything the cost model needs to know about one site."""

    site: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # bytes that would leave the device (its whole storage)
    offloadable: bool  # False for parameters, small tensors, unsupported kinds, dedup views
    reason: str = ""  # why it cannot be offloaded
    module: str = ""  # qualified name of the module that saved it, when known
    sparsity: float = 0.0
    forward_s: float = 0.0  # forward window
    backward_s: float = 0.0  # backward window
    host_s: float = 0.0  # the host's forward window, where the device may wait for it (CUDA)
    stored: dict[str, int] = field(default_factory=dict)  # codec -> measured payload bytes


class Profiler:
    """Collects the profiled steps of one plan and summarises them per site."""

    def __init__(self) -> None:
        self.sites: dict[int, SiteProfile] = {}
        self.order: list[int] = []  # backward's order of first unpacks, last profiled step
        self.together: list[tuple[int, ...]] = []  # and those one node asked for at once
        self._windows: dict[int, list[tuple[float, float, float]]] = {}
        # windows of steps that moved nothing: no copies in them, preferred where there are
        self._plain: dict[int, list[tuple[float, float, float]]] = {}

    def observe(self, step: StepStats, windows: dict[int, tuple[float, float, float]],
                order: list[int] | None = None,
                together: list[tuple[int, ...]] | None = None) -> None:
        """Fold one profiled step in (call after the step's statistics are closed), with
        the order backward first needed its sites (``StepTimer.unpack_order``) and those
        first needed together (``StepTimer.together``); ``windows``: each site's forward,
        backward and host's forward windows (``StepTimer.windows``). A site's windows are
        those of the steps that moved nothing, where there are any: the copies of a step that
        swapped stretch them.

        A site keeps the largest size seen of its kind (dtype and dimensions), so that a
        plan made from the profile serves every step no larger (shorter sequences); a site
        of another kind starts afresh."""
        if order:
            self.order = order
            self.together = together or []
        plain = all(s.decision in ("keep", "dedup") for s in step.sites)
        for s in step.sites:
            kept = s.reason in ("plan", HOST_BUDGET)  # movable, kept as the step decided
            offloadable = not s.reason or kept
            profile = self.sites.get(s.site)
            new = (profile is None or profile.dtype != s.dtype
                   or len(profile.shape) != len(s.shape))
            if new:
                profile = SiteProfile(s.site, s.shape, s.dtype, s.nbytes, offloadable)
                self.sites[s.site] = profile
                self._windows[s.site], self._plain[s.site] = [], []
            elif (numel := math.prod(s.shape)) > (old := math.prod(profile.shape)):
                # grown: its bytes in proportion
                profile.nbytes = profile.nbytes * numel // old if old else s.nbytes
                profile.shape = s.shape
            # A site the plan kept tells only its view's size, and not whether it shares its
            # storage with an earlier site: what a swap of it measured stands.
            if new or not kept:
                profile.nbytes = s.nbytes if new else max(profile.nbytes, s.nbytes)
                profile.offloadable = offloadable
                profile.reason = "" if offloadable else s.reason
            profile.module = s.module
            if s.sparsity is not None:
                profile.sparsity = s.sparsity
            if s.site in windows:
                (self._plain if plain else self._windows)[s.site].append(windows[s.site])
        self.payloads(step)
        for site, swapping in self._windows.items():
            measured = self._plain[site] or swapping
            if measured:
                self.sites[site].forward_s = statistics.median(w[0] for w in measured)
                self.sites[site].backward_s = statistics.median(w[1] for w in measured)
                self.sites[site].host_s = statistics.median(w[2] for w in measured)

    def payloads(self, step: StepStats) -> None:
        """Keep what a step's compressed payloads measured (a profiled step's, or one that
        ran a plan), for the next plan: rle's and exponent's sizes are no function of a
        site's sparsity."""
        for s in step.sites:
            if s.stored_bytes and s.decision not in ("raw", "keep", "dedup") and (
                    profile := self.sites.get(s.site)) is not None and profile.dtype == s.dtype:
                profile.stored[s.decision] = s.stored_bytes

    def profile(self) -> list[SiteProfile]:
        return [self.sites[k] for k in sorted(self.sites)]

