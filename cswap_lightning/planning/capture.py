"""A profile of a training step without offload, in the schema ``workload.load`` reads.

The planner predicts a device it has measured: the H100 profiles that ship in
``evidence/h100-2026-11-24`` came from one run, and a profile captured here on another device
(or model) replays the same way (``workload.from_profile``). Three kinds of step are run:

- plain steps (no hook at all), timed with device events: ``plain_forward_ms``,
  ``plain_backward_ms`` and the allocator's peak, the figures the replay scales to, and the
  host's own time until forward returned (``plain_host_forward_ms``: beside the device's,
  whether the host set the pace);
- one hooked step: every saved tensor in order (the leaf module running when autograd saved
  it, its shape, dtype, bytes, storage bytes, whether its storage is a parameter's or seen
  first, the allocator's bytes at that moment; for a save between leaves, the leaf it
  follows), each leaf module's forward and backward time, the time no leaf ran after its
  forward and before its backward (the functions between leaves: attention, residual adds,
  the loss), and the allocator's bytes when its backward began. The hooks cost the host
  more than many of the kernels they time take: on CUDA the device spins first (a head start
  of twice the plain forward), so that the host queues the hooked forward ahead of it and the
  marks time the device's work. The driver queues a bounded number of launches, so a forward
  of many small kernels may still wait for the host in its later part: the capture says so.
  The hooked totals (``forward_ms``, ``backward_ms``) are reported beside the plain ones, the
  host's own forward beside the head start, and each leaf's host time in its forward, the
  hooks' own included (``forward_host_ms``: what a replay with a host clock would need).

Full backward hooks break modules that change their input in place (ResNet's
``ReLU(inplace=True)``); where the hooked step raises, it is run again without them, and the
profile has no backward times (``workload`` then derives them from the plain ratio).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import nn

from ..allocator import allocated_bytes, peak_allocated_bytes
from .storages import FirstSaves

StepFn = Callable[[], torch.Tensor]  # runs forward, returns the loss
At = tuple[object, float]  # a moment: the clock's mark, and the host's perf_counter then


@dataclass
class _Clock:
    """Marks on the device's timeline (CUDA events), or the host's on the CPU."""

    cuda: bool

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, begin: object, end: object) -> float:
        if self.cuda:
            return begin.elapsed_time(end)
        return 1e3 * (end - begin)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _allocated(cuda: bool) -> int:
    return allocated_bytes() if cuda else 0


@dataclass
class _Module:
    """One leaf module's marks on the hooked step, and the time no leaf ran after its forward
    (and before its backward): the functions it hands its output to."""

    name: str
    forward: list[tuple[object, object]] = field(default_factory=list)
    backward: list[tuple[object, object]] = field(default_factory=list)
    backward_allocated: list[int] = field(default_factory=list)
    forward_after: list[tuple[At, At]] = field(default_factory=list)
    backward_after: list[tuple[At, At]] = field(default_factory=list)
    forward_host_s: float = 0.0  # the host's time inside its forward, hooks included
    _open: list[object] = field(default_factory=list)
    _open_host: list[float] = field(default_factory=list)
    _open_backward: list[object] = field(default_factory=list)


@dataclass
class _Between:
    """The gaps of one pass (forward or backward) where no leaf module runs: attention, the
    residual adds, the loss, any code called between leaves. A forward gap is credited to the
    leaf whose forward it follows, a backward gap to the leaf whose backward it precedes (the
    same functions, run backwards); ``lead`` holds the gaps before every leaf's forward."""

    backward: bool
    lead: list[tuple[At, At]] = field(default_factory=list)
    _depth: int = 0
    _since: tuple[_Module | None, At] | None = None  # who closed the last run, and when

    def start(self, at: At) -> None:
        self._since = (None, at)

    def enter(self, leaf: _Module, at: At) -> None:
        if self._depth == 0 and self._since is not None:
            self._credit(leaf if self.backward else self._since[0], self._since[1], at)
        self._depth += 1

    def leave(self, leaf: _Module, at: At) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self._since = (leaf, at)

    def end(self, at: At) -> None:
        if self._depth == 0 and self._since is not None:
            self._credit(None if self.backward else self._since[0], self._since[1], at)
        self._since = None

    def after(self) -> str | None:
        """The leaf whose forward the running gap follows ("" before the first; None inside
        a leaf)."""
        if self._depth or self._since is None:
            return None
        return "" if self._since[0] is None else self._since[0].name

    def _credit(self, leaf: _Module | None, begin: At, end: At) -> None:
        gaps = self.lead if leaf is None else (
            leaf.backward_after if self.backward else leaf.forward_after)
        gaps.append((begin, end))


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if name and not any(m.children())]


@dataclass(frozen=True)
class _Plain:
    """Plain steps' medians (milliseconds; ``host_forward_ms``: the host's until forward
    returned) and the allocator's bytes before a step and its peak during one."""

    forward_ms: float
    backward_ms: float
    host_forward_ms: float
    before: int
    peak: int


def plain_times(model: nn.Module, step: StepFn, steps: int, cuda: bool) -> _Plain:
    """``steps`` plain steps, timed (``_Plain``)."""
    clock = _Clock(cuda)
    forward, backward, host = [], [], []
    before = peak = 0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        clock.sync()
        before = _allocated(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        begin = clock.mark()
        loss = step()
        middle = clock.mark()
        host.append(1e3 * (time.perf_counter() - began))
        loss.backward()
        end = clock.mark()
        del loss
        clock.sync()
        if cuda:
            peak = max(peak, peak_allocated_bytes())
        forward.append(clock.ms(begin, middle))
        backward.append(clock.ms(middle, end))
    model.zero_grad(set_to_none=True)
    return _Plain(statistics.median(forward), statistics.median(backward),
                  statistics.median(host), before, peak)


@dataclass
class _Hooked:
    """What the hooked step saw: the saved rows, each leaf's marks, each pass's gaps, its
    totals on the clock and the host's own time until forward returned."""

    rows: list[dict]
    marks: list[_Module]
    between: tuple[_Between, _Between]
    forward_ms: float
    backward_ms: float
    host_forward_ms: float


def _hooked_step(model: nn.Module, step: StepFn, cuda: bool, backward_hooks: bool,
                 head_start_ms: float = 0.0) -> _Hooked:
    """One step with module and saved-tensor hooks: the saved rows and each leaf's marks.
    ``head_start_ms``: on CUDA, the device first spins that long (``_keep_busy``)."""
    clock = _Clock(cuda)
    leaves = _leaves(model)
    marks = [_Module(name) for name, _ in leaves]
    running: list[str] = []  # the leaf modules inside one another's forward (rarely nested)
    forward, backward = _Between(backward=False), _Between(backward=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    firsts = FirstSaves()
    rows: list[dict] = []
    handles = []

    for (_, module), mark in zip(leaves, marks, strict=True):
        def pre(_m, _args, mark=mark):
            running.append(mark.name)
            now = time.perf_counter()
            mark._open_host.append(now)
            mark._open.append(clock.mark())
            forward.enter(mark, (mark._open[-1], now))

        def post(_m, _args, _out, mark=mark):
            mark.forward.append((mark._open.pop(), clock.mark()))
            now = time.perf_counter()
            forward.leave(mark, (mark.forward[-1][1], now))
            mark.forward_host_s += now - mark._open_host.pop()
            running.pop()

        handles += [module.register_forward_pre_hook(pre),
                    module.register_forward_hook(post)]
        if backward_hooks:
            def back_pre(_m, _grad, mark=mark):
                mark.backward_allocated.append(_allocated(cuda))
                mark._open_backward.append(clock.mark())
                backward.enter(mark, (mark._open_backward[-1], time.perf_counter()))

            def back_post(_m, _gin, _gout, mark=mark):
                if mark._open_backward:
                    mark.backward.append((mark._open_backward.pop(), clock.mark()))
                    backward.leave(mark, (mark.backward[-1][1], time.perf_counter()))

            handles += [module.register_full_backward_pre_hook(back_pre),
                        module.register_full_backward_hook(back_post)]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        row = {"i": len(rows), "module": running[-1] if running else "",
               "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
               "nbytes": t.numel() * t.element_size(), "storage_nbytes": storage.nbytes(),
               "parameter": ptr in params, "allocated": _allocated(cuda),
               "first_of_storage": firsts.first(storage)}
        if not running and (after := forward.after()) is not None:
            row["after"] = after  # a function's save: the leaf whose output it works on
        rows.append(row)
        return t

    model.zero_grad(set_to_none=True)
    clock.sync()
    try:
        if cuda and head_start_ms > 0:
            _keep_busy(head_start_ms)
        host = time.perf_counter()
        begin = clock.mark()
        forward.start((begin, host))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
        middle = clock.mark()
        returned = time.perf_counter()
        host_forward_ms = 1e3 * (returned - host)
        forward.end((middle, returned))
        if backward_hooks:
            backward.start((middle, returned))
        with warnings.catch_warnings():  # modules whose inputs need no gradient (embeddings)
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss.backward()
        end = clock.mark()
        backward.end((end, time.perf_counter()))
        del loss
        clock.sync()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return _Hooked(rows, marks, (forward, backward), clock.ms(begin, middle),
                   clock.ms(middle, end), host_forward_ms)


def _keep_busy(ms: float) -> None:
    """Queue ``ms`` of spinning on the current stream: while the device spins, the host, slowed
    by the hooks, queues the hooked forward ahead of it, so that its marks time the device's
    work rather than the host's (on an H200 the hooks made GPT-2 medium's forward take 345 ms
    against 35 plain, each module's time mostly the host's)."""
    torch.cuda._sleep(max(1, round(ms * _cycles_per_ms())))


@cache
def _cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s cycles per millisecond on this device, timed once."""
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    cycles = 10_000_000
    torch.cuda._sleep(cycles // 10)  # warm-up
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(begin.elapsed_time(end), 1e-3)


def _hooked(model: nn.Module, step: StepFn, cuda: bool, head_start_ms: float, name: str,
            log: Callable[[str], None]) -> _Hooked:
    try:
        return _hooked_step(model, step, cuda, True, head_start_ms)
    except RuntimeError as err:  # full backward hooks and an in-place module (module docstring)
        log(f"capture {name}: backward hooks failed ({str(err)[:100]}); without them")
        return _hooked_step(model, step, cuda, False, head_start_ms)


def capture(model: nn.Module, step: StepFn, name: str, *, warmup: int = 2, steps: int = 5,
            log: Callable[[str], None] = print) -> dict:
    """The profile of ``model`` trained by ``step`` (forward, returning the loss; this runs
    backward), named ``name`` (``<model>-b<batch>`` lets the replay scale it by batch)."""
    param = next(model.parameters())
    cuda = param.device.type == "cuda"
    clock = _Clock(cuda)
    plain_times(model, step, warmup, cuda)
    plain = plain_times(model, step, steps, cuda)
    forward_ms = plain.forward_ms
    log(f"capture {name}: plain forward {forward_ms:.1f} ms (the host's "
        f"{plain.host_forward_ms:.1f} ms), backward {plain.backward_ms:.1f} ms, "
        f"peak {plain.peak / 2**30:.2f} GiB")
    head_start = 2 * forward_ms + 20 if cuda and hasattr(torch.cuda, "_sleep") else 0.0
    hooked = _hooked(model, step, cuda, head_start, name, log)
    if cuda and hooked.host_forward_ms > head_start and hooked.forward_ms > 1.15 * forward_ms:
        head_start = 1.5 * hooked.host_forward_ms + 20  # the host fell behind: more room
        hooked = _hooked(model, step, cuda, head_start, name, log)
    if cuda and hooked.forward_ms > 1.15 * forward_ms:  # the driver queues so many launches
        log(f"capture {name}: the device still waited for the host in the hooked forward "
            f"({hooked.forward_ms:.1f} ms against {forward_ms:.1f} plain): its later modules' "
            "times are partly the host's")
    clock.sync()

    def ms(pairs: list[tuple[object, object]]) -> float:
        return sum(clock.ms(a, b) for a, b in pairs)

    def gap_ms(gaps: list[tuple[At, At]]) -> float:
        return ms([(a[0], b[0]) for a, b in gaps])

    def host_ms(gaps: list[tuple[At, At]]) -> float:
        return sum(1e3 * (b[1] - a[1]) for a, b in gaps)

    modules = [{"module": m.name, "forward_ms": ms(m.forward), "backward_ms": ms(m.backward),
                "forward_after_ms": gap_ms(m.forward_after),
                "backward_after_ms": gap_ms(m.backward_after),
                "forward_host_ms": 1e3 * m.forward_host_s,
                "forward_after_host_ms": host_ms(m.forward_after),
                "calls": len(m.forward), "backward_allocated": m.backward_allocated}
               for m in hooked.marks]
    rows = hooked.rows
    log(f"capture {name}: {len(rows)} saved tensors, "
        f"{sum(r['storage_nbytes'] for r in rows if r['first_of_storage']) / 2**30:.2f} GiB "
        f"of storages; hooked forward {hooked.forward_ms:.1f} ms (the host's "
        f"{hooked.host_forward_ms:.1f} ms, head start {head_start:.0f} ms), backward "
        f"{hooked.backward_ms:.1f} ms")
    return {"name": name,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "dtype": str(param.dtype).removeprefix("torch."),
            "plain_forward_ms": forward_ms, "plain_backward_ms": plain.backward_ms,
            "plain_host_forward_ms": plain.host_forward_ms,
            "forward_ms": hooked.forward_ms, "backward_ms": hooked.backward_ms,
            "host_forward_ms": hooked.host_forward_ms, "head_start_ms": head_start,
            "forward_lead_ms": gap_ms(hooked.between[0].lead),
            "backward_lead_ms": gap_ms(hooked.between[1].lead),
            "forward_lead_host_ms": host_ms(hooked.between[0].lead),
            "allocated_before_step": plain.before, "peak_allocated": plain.peak,
            "saved": rows, "modules": modules}
