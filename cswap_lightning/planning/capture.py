"""A profile of a training step without offload, in the schema ``workload.load`` reads.

The planner predicts a device it has measured: the H100 profiles that ship in
``evidence/h100-2026-11-24`` came from one run, and a profile captured here on another device
(or model) replays the same way (``workload.from_profile``). Three kinds of step are run:

- plain steps (no hook at all), timed with device events: ``plain_forward_ms``,
  ``plain_backward_ms`` and the allocator's peak, the figures the replay scales to;
- one hooked step: every saved tensor in order (the leaf module running when autograd saved
  it, its shape, dtype, bytes, storage bytes, whether its storage is a parameter's or seen
  first, the allocator's bytes at that moment), and each leaf module's forward and backward
  time and the allocator's bytes when its backward began. The hooks leave launch gaps, so
  their totals (``forward_ms``, ``backward_ms``) are reported beside the plain ones.

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

import torch
from torch import nn

StepFn = Callable[[], torch.Tensor]  # runs forward, returns the loss


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
    return torch.cuda.memory_allocated() if cuda else 0


@dataclass
class _Module:
    """One leaf module's marks on the hooked step."""

    name: str
    forward: list[tuple[object, object]] = field(default_factory=list)
    backward: list[tuple[object, object]] = field(default_factory=list)
    backward_allocated: list[int] = field(default_factory=list)
    _open: list[object] = field(default_factory=list)
    _open_backward: list[object] = field(default_factory=list)


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if name and not any(m.children())]


def plain_times(model: nn.Module, step: StepFn, steps: int, cuda: bool
                ) -> tuple[float, float, int, int]:
    """Median forward and backward milliseconds of ``steps`` plain steps, the allocator's bytes
    before a step and its peak during one."""
    clock = _Clock(cuda)
    forward, backward = [], []
    before = peak = 0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        clock.sync()
        before = _allocated(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        begin = clock.mark()
        loss = step()
        middle = clock.mark()
        loss.backward()
        end = clock.mark()
        del loss
        clock.sync()
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated())
        forward.append(clock.ms(begin, middle))
        backward.append(clock.ms(middle, end))
    model.zero_grad(set_to_none=True)
    return statistics.median(forward), statistics.median(backward), before, peak


def _hooked_step(model: nn.Module, step: StepFn, cuda: bool, backward_hooks: bool
                 ) -> tuple[list[dict], list[_Module], float, float]:
    """One step with module and saved-tensor hooks: the saved rows and each leaf's marks."""
    clock = _Clock(cuda)
    leaves = _leaves(model)
    marks = [_Module(name) for name, _ in leaves]
    running: list[str] = []  # the leaf modules inside one another's forward (rarely nested)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    rows: list[dict] = []
    handles = []

    for (_, module), mark in zip(leaves, marks, strict=True):
        def pre(_m, _args, mark=mark):
            running.append(mark.name)
            mark._open.append(clock.mark())

        def post(_m, _args, _out, mark=mark):
            mark.forward.append((mark._open.pop(), clock.mark()))
            running.pop()

        handles += [module.register_forward_pre_hook(pre),
                    module.register_forward_hook(post)]
        if backward_hooks:
            def back_pre(_m, _grad, mark=mark):
                mark.backward_allocated.append(_allocated(cuda))
                mark._open_backward.append(clock.mark())

            def back_post(_m, _gin, _gout, mark=mark):
                if mark._open_backward:
                    mark.backward.append((mark._open_backward.pop(), clock.mark()))

            handles += [module.register_full_backward_pre_hook(back_pre),
                        module.register_full_backward_hook(back_post)]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        rows.append({"i": len(rows), "module": running[-1] if running else "",
                     "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "nbytes": t.numel() * t.element_size(), "storage_nbytes": storage.nbytes(),
                     "parameter": ptr in params, "allocated": _allocated(cuda),
                     "first_of_storage": ptr not in seen})
        seen.add(ptr)
        return t

    model.zero_grad(set_to_none=True)
    clock.sync()
    try:
        begin = clock.mark()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
        middle = clock.mark()
        with warnings.catch_warnings():  # modules whose inputs need no gradient (embeddings)
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss.backward()
        end = clock.mark()
        del loss
        clock.sync()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return rows, marks, clock.ms(begin, middle), clock.ms(middle, end)


def capture(model: nn.Module, step: StepFn, name: str, *, warmup: int = 2, steps: int = 5,
            log: Callable[[str], None] = print) -> dict:
    """The profile of ``model`` trained by ``step`` (forward, returning the loss; this runs
    backward), named ``name`` (``<model>-b<batch>`` lets the replay scale it by batch)."""
    param = next(model.parameters())
    cuda = param.device.type == "cuda"
    clock = _Clock(cuda)
    plain_times(model, step, warmup, cuda)
    forward_ms, backward_ms, before, peak = plain_times(model, step, steps, cuda)
    log(f"capture {name}: plain forward {forward_ms:.1f} ms, backward {backward_ms:.1f} ms, "
        f"peak {peak / 2**30:.2f} GiB")
    try:
        rows, marks, hooked_f, hooked_b = _hooked_step(model, step, cuda, backward_hooks=True)
    except RuntimeError as err:  # full backward hooks and an in-place module (module docstring)
        log(f"capture {name}: backward hooks failed ({str(err)[:100]}); without them")
        rows, marks, hooked_f, hooked_b = _hooked_step(model, step, cuda, backward_hooks=False)
    clock.sync()
    modules = [{"module": m.name,
                "forward_ms": sum(clock.ms(a, b) for a, b in m.forward),
                "backward_ms": sum(clock.ms(a, b) for a, b in m.backward),
                "calls": len(m.forward), "backward_allocated": m.backward_allocated}
               for m in marks]
    log(f"capture {name}: {len(rows)} saved tensors, "
        f"{sum(r['storage_nbytes'] for r in rows if r['first_of_storage']) / 2**30:.2f} GiB "
        f"of storages; hooked forward {hooked_f:.1f} ms, backward {hooked_b:.1f} ms")
    return {"name": name,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "dtype": str(param.dtype).removeprefix("torch."),
            "plain_forward_ms": forward_ms, "plain_backward_ms": backward_ms,
            "forward_ms": hooked_f, "backward_ms": hooked_b,
            "allocated_before_step": before, "peak_allocated": peak,
            "saved": rows, "modules": modules}
