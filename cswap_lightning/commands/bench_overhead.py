"""`cswap bench overhead`: the engine's host time per saved tensor, on a workload of tiny ops.

Every tensor autograd saves goes through the engine's pack and unpack hooks, on the thread
that launches the kernels; this measures what they cost. The workload is a chain of ``sin``
ops on a small vector (each saves its 16 KiB input), so a step is mostly hook time. Methods
run interleaved (one step of each per round, each after a garbage collection, so that none
pays for collecting what another left) and the median step of each is taken; the
figure is (median step - median step without the engine) / tensors saved, in CPU time of
the thread running the step (torch runs on that one thread here), which other processes on
the machine disturb far less than wall time; wall time is shown beside it.

A training loop does not collect before each step: the Python objects a method keeps per
saved tensor until backward make the garbage collector run, and its full collections walk
every object of the process. "Steady state" runs ``steady_steps`` steps of each method in a
row (interleaved by blocks) and takes the mean step, collections included: what a training
loop pays.

Beside torch's ``save_on_cpu`` (on the CPU it moves nothing: a CPU tensor is already there),
"copy in a pack hook" copies every saved tensor and does nothing else (on a GPU, into pinned
host memory and back, without side streams): the floor of any engine that moves bytes here,
which the engine's raw plan pays too. ``--device cuda`` runs the chain on a GPU, where the
host time is what the thread that launches the kernels spends. "cswap default, run
fits" is the default configuration on a run that fits: once its plan (move nothing) is
checked, the steps run without the engine's hooks; "cswap budget 50% of keep" moves what half
of keeping everything needs and counts the rest; ``plan=keep`` and ``plan=raw`` are fixed
plans. Every engine runs its measured steps and the step that checks its plan before the
timed ones: the rows are what the steps after those cost, which keep and move what the
checked plan says without tracking each tensor (the measured and checking steps track every
tensor and cost more). Last, one step of ``plan=raw`` runs under cProfile, and the functions
with the most time of their own are listed per saved tensor: on a GPU, which of the stream,
event and copy calls the host time goes to; and a read of the allocator's bytes in use is
timed both ways (``allocator_reads``).
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from ..allocator import allocated_bytes
from ..config import CSwapConfig
from ..core.engine import Offloader
from .bench_step import result_meta, write_results
from .progress import Progress


def _chain(x: torch.Tensor, length: int) -> torch.Tensor:
    for _ in range(length):
        x = x.sin()
    return x.sum()


def _copy(t: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
    """Copy a saved tensor: on the CPU where it is, from a GPU into pinned host memory."""
    if not t.is_cuda:
        return t.detach().clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return t.device, host.copy_(t, non_blocking=True)


def _copy_back(saved: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    device, host = saved
    return host.to(device, non_blocking=True)


def _steps(engine: Offloader, x: torch.Tensor, tensors: int, steps: int) -> None:
    for _ in range(steps):
        with engine:
            loss = _chain(x, tensors)
        loss.backward()
    x.grad = None


def _timed_step(context: Callable[[], contextlib.AbstractContextManager], x: torch.Tensor,
                tensors: int) -> tuple[float, float]:
    """CPU and wall seconds of one forward and backward of the chain under ``context``."""
    start_cpu, start_wall = time.thread_time(), time.perf_counter()
    with context():
        loss = _chain(x, tensors)
    loss.backward()
    x.grad = None
    seconds = time.thread_time() - start_cpu, time.perf_counter() - start_wall
    if x.is_cuda:  # the next step starts with the device idle (not timed)
        torch.cuda.synchronize(x.device)
    return seconds


def where_the_time_goes(engine: Offloader, x: torch.Tensor, tensors: int,
                        top: int = 15) -> list[dict]:
    """One step of ``engine`` under cProfile: the functions that spend the most time of their
    own, per saved tensor (calls and microseconds). cProfile slows Python calls more than the
    calls into torch's C++ (each CUDA stream, event and copy call shows as one of those), so
    it ranks, it does not time."""
    profile = cProfile.Profile()
    gc.collect()
    profile.enable()
    _timed_step(lambda: engine, x, tensors)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, ..., own seconds, ...)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": _function_name(where), "calls_per_tensor": calls / tensors,
             "us_per_tensor": 1e6 * own / tensors}
            for where, (_, calls, own, _, _) in rows]


def _function_name(where: tuple[str, int, str]) -> str:
    file, line, name = where
    if file == "~":  # a built-in: the name says it (``<method 'copy_' of ...>``)
        return name
    return f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line} {name}"


def allocator_reads(device: torch.device, calls: int = 200) -> dict[str, float]:
    """On CUDA, the host's microseconds per read of the allocator's bytes in use: torch's
    ``memory_allocated`` (every statistic flattened first) and ``allocator.allocated_bytes``,
    the engine's and the capture's; nothing on the CPU."""
    if device.type != "cuda":
        return {}
    reads = {"torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(device),
             "allocator.allocated_bytes": lambda: allocated_bytes(device)}
    out = {}
    for name, read in reads.items():
        read()
        start = time.perf_counter()
        for _ in range(calls):
            read()
        out[name] = 1e6 * (time.perf_counter() - start) / calls
    return out


def run_overhead_bench(tensors: int = 2000, numel: int = 4096, rounds: int = 7,
                       out: str | None = None, steady_steps: int = 8,
                       device: str = "cpu") -> list[dict]:
    """Median step time of each method on a ``tensors``-long sin chain on ``device``, and
    host time per saved tensor over no engine, after a collection and in steady state
    (``steady_steps`` steps in a row); prints a table, optionally writes result files."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cswap bench overhead: --device cuda needs a CUDA device; none is "
                         "available (use --device cpu)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(numel, device=dev, requires_grad=True)
    engines = {plan: Offloader(CSwapConfig(plan=plan, min_bytes=0)) for plan in ("keep", "raw")}
    engines["default"] = Offloader(CSwapConfig(min_bytes=0))  # budget "auto": this run fits
    _steps(engines["keep"], x, tensors, 1)
    half = engines["keep"].last_step().peak_resident_bytes // 2
    engines["budget"] = Offloader(CSwapConfig(min_bytes=0, budget=half, profile_steps=1))
    methods: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "no engine": contextlib.nullcontext,
        "torch save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=x.is_cuda),
        "copy in a pack hook": lambda: torch.autograd.graph.saved_tensors_hooks(_copy,
                                                                                _copy_back),
        "cswap default, run fits": lambda: engines["default"],
        "cswap budget 50% of keep": lambda: engines["budget"],
        "cswap plan=keep": lambda: engines["keep"],
        "cswap plan=raw": lambda: engines["raw"],
    }
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    wall: dict[str, list[float]] = {name: [] for name in methods}
    steady: dict[str, list[float]] = {name: [] for name in methods}
    print(f"cswap bench overhead on {dev}: {tensors} saved tensors of {numel * 4 // 1024} KiB "
          f"per step, {rounds} interleaved rounds (+1 warm-up), then {rounds} rounds of "
          f"{steady_steps} "
          "steps in a row; torch on 1 thread")
    progress = Progress("cswap bench overhead")
    progress("each engine's measured steps and the step that checks its plan")
    try:
        for engine in engines.values():  # the measured steps, then one that checks the plan
            _steps(engine, x, tensors, engine.config.profile_steps + 1)
        for round_ in range(rounds + 1):
            for name, context in methods.items():
                gc.collect()  # what the previous method left is not this one's to collect
                step_cpu, step_wall = _timed_step(context, x, tensors)
                if round_:
                    cpu[name].append(step_cpu)
                    wall[name].append(step_wall)
            progress(f"interleaved round {round_}/{rounds}" if round_ else "warm-up round")
        for round_ in range(1, rounds + 1):
            for name, context in methods.items():
                gc.collect()
                steady[name].append(statistics.mean(
                    _timed_step(context, x, tensors)[0] for _ in range(steady_steps)))
            progress(f"steady-state round {round_}/{rounds}")
        progress("one step of cswap plan=raw under cProfile")
        profile = where_the_time_goes(engines["raw"], x, tensors)
        moved = engines["raw"].last_step().offloaded_bytes
        hooks_off = engines["default"].last_step().hooks_off
        budgeted = engines["budget"].last_step()
    finally:
        torch.set_num_threads(threads)
        for engine in engines.values():
            engine.close()
    base_cpu, base_wall = statistics.median(cpu["no engine"]), statistics.median(wall["no engine"])
    base_steady = statistics.median(steady["no engine"])
    rows = []
    for name in methods:
        step_cpu, step_wall = statistics.median(cpu[name]), statistics.median(wall[name])
        step_steady = statistics.median(steady[name])
        rows.append({"method": name, "step_cpu_s": step_cpu, "step_wall_s": step_wall,
                     "cpu_ratio": step_cpu / base_cpu,
                     "us_per_tensor": 1e6 * (step_cpu - base_cpu) / tensors,
                     "wall_us_per_tensor": 1e6 * (step_wall - base_wall) / tensors,
                     "steady_step_cpu_s": step_steady,
                     "steady_us_per_tensor": 1e6 * (step_steady - base_steady) / tensors})
    head = ("| method | median step (CPU) | vs no engine | host time per saved tensor "
            "| same, wall time | steady state, collections included |")
    table = "\n".join(
        [head, "|---|---:|---:|---:|---:|---:|"]
        + [f"| {r['method']} | {1e3 * r['step_cpu_s']:.1f} ms | {r['cpu_ratio']:.2f}x | "
           f"{r['us_per_tensor']:.1f} us | {r['wall_us_per_tensor']:.1f} us | "
           f"{r['steady_us_per_tensor']:.1f} us |" for r in rows])
    head = "| function (cswap plan=raw, one step under cProfile) | calls per tensor | own us |"
    where = "\n".join(
        [head, "|---|---:|---:|"]
        + [f"| `{r['function']}` | {r['calls_per_tensor']:.2f} | {r['us_per_tensor']:.1f} |"
           for r in profile])
    table += ("\n\nWhere plan=raw's host time goes: the functions with the most time of their "
              "own in one step under cProfile, which slows Python calls more than calls into "
              "torch's C++ (it ranks, it does not time).\n\n" + where)
    reads = allocator_reads(dev)
    if reads:
        table += ("\n\nReading the allocator's bytes in use, host time per call: "
                  + ", ".join(f"{name} {us:.1f} us" for name, us in reads.items()) + ".")
    print(table)
    print(f"cswap plan=raw moved {moved / 2**20:.1f} MiB off the device per step; the default's "
          f"plan moved nothing and its steps ran {'without' if hooks_off else 'with'} hooks; "
          f"the budget's moved {budgeted.offloaded_tensors} and counted "
          f"{budgeted.untracked_tensors}")
    if out:
        meta = result_meta(dev, tensors=tensors, tensor_bytes=numel * 4,
                           rounds=rounds, steady_steps=steady_steps,
                           python_objects=len(gc.get_objects()))
        results = {"rows": rows, "raw_profile": profile, "moved_bytes": moved,
                   "default_hooks_off": hooks_off,
                   "budget_moved_tensors": budgeted.offloaded_tensors,
                   "budget_counted_tensors": budgeted.untracked_tensors,
                   "allocator_read_us": reads}
        write_results(out, "cswap bench overhead", meta, results, table)
    return rows
