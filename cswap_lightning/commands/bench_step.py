"""`cswap bench step`: one model, every way of holding saved activations, measured in one run.

Methods: no offload (the baseline every ratio is against), ``torch.autograd.graph.save_on_cpu``,
torchtune's ``OffloadActivations`` (needs torchtune and CUDA), and this engine with RAW and
with ZVC plans. Figures per method: step time and its ratio to no offload, memory held for
backward (CUDA: peak allocated during the step above what was allocated before it; CPU: heap
bytes in use at the end of forward above the start, read from glibc's ``mallinfo2``), and
bytes moved off the device per step.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import datetime
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..config import CSwapConfig
from ..core.engine import Offloader
from ..records import fmt_bytes


def build_model(name: str, device: torch.device, batch_size: int | None):
    """The model and one batch of generated data; GPU sizes are larger."""
    gpu = device.type == "cuda"
    if name == "cnn":
        from ..recipes.nets import build_cnn

        batch = batch_size or (256 if gpu else 32)
        side = 64 if gpu else 32
        width = 64 if gpu else 32
        model = nn.Sequential(*list(build_cnn(width))[:-1],
                              nn.Linear(4 * width * (side // 2) ** 2, 10))
        x = torch.randn(batch, 1, side, side)
        y = torch.randint(0, 10, (batch,))
        return model.to(device), x.to(device), y.to(device)
    if name == "mlp":
        batch = batch_size or (4096 if gpu else 512)
        dims = [1024, 4096, 4096, 4096, 1024]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(dims[-1], 10))
        return model.to(device), torch.randn(batch, dims[0], device=device), torch.randint(
            0, 10, (batch,), device=device)
    if name == "transformer":
        batch = batch_size or (32 if gpu else 8)
        d, seq = (768, 512) if gpu else (256, 128)
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
                              nn.Flatten(), nn.Linear(d * seq, 10))
        return model.to(device), torch.randn(batch, seq, d, device=device), torch.randint(
            0, 10, (batch,), device=device)
    raise ValueError(f"unknown model {name!r}; choose one of 'cnn', 'mlp', 'transformer'")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_reader() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return in_use


class _Counted:
    """Wraps a saved_tensors_hooks object to count the bytes its pack hook moves off-device."""

    def __init__(self, hooks, moved: Callable[[torch.Tensor, object], bool]) -> None:
        self.hooks, self.bytes = hooks, 0
        inner = hooks.pack_hook

        def pack(t: torch.Tensor):
            packed = inner(t)
            if moved(t, packed):
                self.bytes += t.numel() * t.element_size()
            return packed

        hooks.pack_hook = pack

    def __enter__(self):
        self.hooks.__enter__()

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def moved_bytes(self) -> int:
        moved, self.bytes = self.bytes, 0
        return moved


def _methods(device: torch.device) -> list[tuple[str, Callable[[], object] | str]]:
    """(name, factory of a reusable context with ``moved_bytes()``) or (name, reason skipped)."""
    small = 64 * 1024
    methods: list[tuple[str, Callable[[], object] | str]] = [
        ("no offload", _NoOffload),
        ("save_on_cpu(pin_memory=True)", lambda: _Counted(
            torch.autograd.graph.save_on_cpu(pin_memory=True), lambda t, p: True)),
    ]
    try:
        from torchtune.training import OffloadActivations
    except ImportError as err:
        methods.append(("torchtune OffloadActivations", f"not installed ({err})"))
    else:
        if device.type != "cuda":
            methods.append(("torchtune OffloadActivations", "needs CUDA"))
        else:
            def torchtune_factory():
                hooks = OffloadActivations(min_offload_size=small)
                return _Counted(hooks, lambda t, p: hooks.tracker.get(p, (None, False))[1])
            methods.append(("torchtune OffloadActivations", torchtune_factory))
    for plan in ("raw", "zvc"):
        methods.append((f"cswap plan={plan}",
                        lambda plan=plan: _Engine(CSwapConfig(plan=plan, min_bytes=small))))
    return methods


class _NoOffload(contextlib.nullcontext):
    def moved_bytes(self) -> int:
        return 0


class _Engine(Offloader):
    def moved_bytes(self) -> int:
        return self.last_step().stored_bytes

    def peak_resident_bytes(self) -> int:
        return self.last_step().peak_resident_bytes


def run_step_bench(model_name: str = "cnn", device: str = "auto", batch_size: int | None = None,
                   steps: int = 10, warmup: int = 3, out: str | None = None) -> list[dict]:
    """Measure every method on the same model and data; print a table, optionally save it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    torch.manual_seed(0)
    model0, x, y = build_model(model_name, dev, batch_size)
    heap = _heap_reader()
    print(f"cswap bench step: model {model_name}, batch {x.shape[0]}, device {dev}, "
          f"{warmup} warm-up + {steps} timed steps per method")
    rows: list[dict] = []
    for name, factory in _methods(dev):
        if isinstance(factory, str):
            rows.append({"method": name, "skipped": factory})
            print(f"  {name}: skipped ({factory})")
            continue
        print(f"  measuring {name} ...", flush=True)
        model = copy.deepcopy(model0)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        ctx = factory()
        times, held, moved = [], [], []
        for i in range(warmup + steps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else heap() if heap else 0
            start = time.perf_counter()
            with ctx:
                loss = F.cross_entropy(model(x), y)
            if dev.type == "cpu" and heap:
                held.append(heap() - base)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                held.append(torch.cuda.max_memory_allocated(dev) - base)
            elapsed = time.perf_counter() - start
            moved.append(ctx.moved_bytes())
            if i >= warmup:
                times.append(elapsed)
        resident = ctx.peak_resident_bytes() if isinstance(ctx, _Engine) else None
        if isinstance(ctx, Offloader):
            ctx.close()
        rows.append({"method": name, "step_s": statistics.median(times),
                     "held_bytes": max(held[warmup:]) if held else None,
                     "moved_bytes": moved[-1], "peak_resident_bytes": resident})
        del model, optimizer, ctx, loss
    base_row = rows[0]
    for row in rows:
        if "step_s" in row:
            row["time_ratio"] = row["step_s"] / base_row["step_s"]
            if row["held_bytes"] is not None and base_row["held_bytes"]:
                row["held_ratio"] = row["held_bytes"] / base_row["held_bytes"]
    table = _markdown(rows, dev)
    print(table)
    if out:
        meta = result_meta(dev, model=model_name, batch_size=int(x.shape[0]), steps=steps,
                           warmup=warmup)
        write_results(out, "cswap bench step", meta, {"rows": rows}, table)
    return rows


def result_meta(dev: torch.device, **details) -> dict:
    """What every result file starts with: date, device, versions, command, then ``details``."""
    return {"date": datetime.date.today().isoformat(), "device": device_name(dev),
            "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["cswap"] + sys.argv[1:]), **details}


# The kind of a result the benchmarks predict with `cswap plan`'s machinery.
PREDICTED = ("prediction (meta-device trace, roofline calibrated on the H100 and H200 "
             "profiles, replay of the step; estimates, not measurements)")


def script_meta(script: str, argv: list[str] | None, **details) -> dict:
    """``result_meta`` of a benchmark script run on the CPU, its command as run (``argv``:
    the arguments given to its ``main``; None: the process's)."""
    return result_meta(torch.device("cpu"), command=" ".join(
        ["python", *sys.argv] if argv is None else ["python", script, *argv]), **details)


def report(text: str, out: str | None, title: str, meta: dict, data: dict) -> None:
    """Print a result's text, and where ``out`` names a stem write it there too
    (``write_results``)."""
    print(text)
    if out:
        write_results(out, title, meta, data, text)


def write_results(out: str, title: str, meta: dict, data: dict, markdown: str,
                  quiet: bool = False) -> None:
    """``out``.json (``meta`` and ``data``) and ``out``.md (``meta`` as a list, then
    ``markdown``); ``quiet``: without saying so (results written again as they grow)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, **data}, indent=2))
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    Path(f"{out}.md").write_text(f"# {title}\n\n{header}\n\n{markdown}\n")
    if not quiet:
        print(f"results written to {out}.md and {out}.json")


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _markdown(rows: list[dict], dev: torch.device) -> str:
    held = "peak allocated in step" if dev.type == "cuda" else "heap held after forward"
    head = (f"| method | step time | vs no offload | {held} | vs no offload | moved off device "
            "| engine's peak resident |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['method']} | skipped: {r['skipped']} | | | | | |")
            continue
        held_b = "n/a" if r["held_bytes"] is None else fmt_bytes(r["held_bytes"])
        resident = "-" if r["peak_resident_bytes"] is None else fmt_bytes(r["peak_resident_bytes"])
        lines.append(
            f"| {r['method']} | {1e3 * r['step_s']:.1f} ms | {r['time_ratio']:.2f}x | {held_b} | "
            f"{r.get('held_ratio', float('nan')):.2f}x | {fmt_bytes(r['moved_bytes'])} | "
            f"{resident} |")
    return "\n".join(lines)
