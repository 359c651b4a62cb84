"""`cswap bench suite`: four models, every way of holding saved activations, three memory levels.

ResNet-50 and VGG-16 (bf16 autocast, 224x224, large batch), BERT-large (sequence 512) and GPT-2
medium (sequence 1024), random weights, generated data, one process. Methods: no offload,
activation checkpointing per block, Hugging Face's built-in offload (checkpointed layers
whose saved inputs go through a synchronous ``save_on_cpu``), ``torch.autograd.graph.
save_on_cpu(pin_memory=True)``, torchtune's ``OffloadActivations``, and cswap raw, auto and
auto with ``lossy="int8"``; the two auto ones at a device-memory budget of 100%, 50% and 35%
of no offload's measured peak (the engine's ``budget`` applies to ``plan="auto"``; every
other method runs once and is placed by its own measured peak). Then, per model, the largest
batch that fits (no offload, activation checkpointing, cswap auto), goals computed from the
figures, and a verdict per memory level.

``--small`` runs the same code at CPU sizes. Peak memory is measured, never modelled: on CUDA
the allocator's peak (``max_memory_allocated``) over each step; on the CPU, where there is no
separate device, a ledger of live tensor storages (see :class:`.suite_ledger.DeviceLedger`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import time
from pathlib import Path

import torch

from .args import number
from .bench_step import result_meta, write_results
from .suite_cases import MODELS, workload
from .suite_report import markdown, peak_meaning, plot
from .suite_runs import run_model

LEVELS = (1.0, 0.5, 0.35)


# -- the command ------------------------------------------------------------------------------
def add_parser(bench_kinds) -> argparse.ArgumentParser:
    """Register ``cswap bench suite`` under the ``bench`` subcommands."""
    from .args import whole as _whole

    suite = bench_kinds.add_parser(
        "suite", help="ResNet-50, VGG-16, BERT-large, GPT-2 medium: every offload method at "
        "100/50/35%% of no offload's memory, largest batch, goals; report, JSON and plots")
    suite.add_argument("--out", default=None, help="folder for suite.md, suite.json and PNGs")
    suite.add_argument("--small", action="store_true",
                       help="CPU-sized models (what CI runs); every method that runs there")
    suite.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    suite.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    suite.add_argument("--steps", type=_whole(1), default=None,
                       help="timed steps per run (default: 4, --small 2)")
    suite.add_argument("--warmup", type=_whole(0), default=1,
                       help="untimed steps first (cswap: at least its profiled steps + 1)")
    suite.add_argument("--levels", nargs="+", type=_level, default=list(LEVELS),
                       help="memory levels, fractions of no offload's peak (default: 1 0.5 0.35)")
    suite.add_argument("--min-bytes", type=_whole(0), default=None,
                       help="smaller saved tensors stay (cswap, torchtune); default 64 KiB, "
                       "--small 4 KiB")
    suite.add_argument("--prefetch-bytes", type=_whole(0), default=None,
                       help="cswap's prefetch_bytes (default: the engine's, 'auto': what "
                       "hides the measured link)")
    suite.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=True,
                       help="search the largest batch that fits")
    suite.add_argument("--max-factor", type=_whole(2), default=8,
                       help="search other methods up to this multiple of no offload's batch")
    suite.add_argument("--memory-cap", type=_whole(1), default=None,
                       help="bytes a batch may peak at in the search (default: device memory; "
                       "CPU: no offload's peak at the suite's batch)")
    suite.add_argument("--time-budget", type=_seconds, default=None,
                       help="seconds for the whole suite, shared by the models; runs left when "
                       "a model's share is spent are reported as skipped")
    suite.add_argument("--threads", type=_whole(1), default=None,
                       help="intra-op CPU threads while it runs (default: unchanged; --small "
                       "on the CPU: 1, as tiny ops on a busy machine only lose by more)")
    return suite


_level = number(lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1]")
_seconds = number(lambda v: v > 0.0, "a number of seconds > 0")


def run_suite(opts: argparse.Namespace, command: list[str] | None = None) -> list[dict]:
    """Run the suite; print progress and the report; write it under ``opts.out``."""
    device = opts.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    opts.steps = opts.steps or (2 if opts.small else 4)
    opts.min_bytes = opts.min_bytes if opts.min_bytes is not None else (
        4096 if opts.small else 64 * 1024)
    opts.search_steps = 1 if dev.type == "cpu" else 2
    opts.bisections = 0 if opts.small else 1
    threads = opts.threads or (1 if opts.small and dev.type == "cpu" else None)
    if threads:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _run_suite(opts, dev, command)
        finally:
            torch.set_num_threads(previous)
    return _run_suite(opts, dev, command)


def _run_suite(opts: argparse.Namespace, dev: torch.device, command: list[str] | None
               ) -> list[dict]:
    out = Path(opts.out) if opts.out else None
    meta = result_meta(dev, size="small (CPU sizes)" if opts.small else "full",
                       models=list(opts.models), steps=opts.steps, warmup=opts.warmup,
                       levels=list(opts.levels), precision="bf16 autocast" if dev.type == "cuda"
                       else "float32", optimizer="SGD, no momentum (no optimizer state)",
                       threads=torch.get_num_threads(), time_budget_s=opts.time_budget)
    if command is not None:
        meta["command"] = " ".join(["cswap", *command])
    print(f"cswap bench suite: {', '.join(opts.models)} on {meta['device']}, "
          f"{'small' if opts.small else 'full'} sizes, {opts.steps} timed steps per run"
          + (f", time budget {opts.time_budget:.0f} s" if opts.time_budget else ""), flush=True)
    results: list[dict] = []
    began = time.monotonic()
    total = opts.time_budget

    def save(current: dict | None = None) -> None:
        """Write what is measured so far (after every run: a cut-off run keeps its results)."""
        if out is None:
            return
        done = results + [current] if current is not None else results
        meta["models_done"] = f"{sum(r['complete'] for r in done)} of {len(opts.models)}"
        quiet = contextlib.redirect_stdout(io.StringIO()) if current is not None else (
            contextlib.nullcontext())
        with quiet:
            write_results(str(out / "suite"), "cswap bench suite", meta,
                          {"peak": peak_meaning(dev), "models": done}, markdown(done, dev, opts))

    for i, key in enumerate(opts.models):
        deadline = math.inf if total is None else began + total * (i + 1) / len(opts.models)
        wl = workload(key, opts.small)
        print(f"{wl.label}: {wl.shape}, batch {wl.batch_size}", flush=True)
        result = run_model(wl, dev, opts, deadline, save)
        if out is not None and plot(result, out / f"suite-{key}.png"):
            result["plot"] = f"suite-{key}.png"
        results.append(result)
        for g in result["goals"]:
            print(f"  {g['status']}: {g['goal']}: {g['measured']}")
        print(f"  Verdict: {result['verdict']}", flush=True)
        save()
    print(markdown(results, dev, opts))
    print(f"cswap bench suite: done in {time.monotonic() - began:.0f} s")
    return results


def main(opts: argparse.Namespace, command: list[str] | None = None) -> int:
    run_suite(opts, command)
    return 0
