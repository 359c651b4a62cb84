"""The engine's host cost per saved tensor, this checkout against another commit's.

`cswap bench overhead` times one engine against no engine; a change to the hot path (pack,
unpack, the transfer, the arena) is a few microseconds per tensor, less than this machine's
drift between two runs. Here the other commit's whole package is exported (``git archive``)
and imported under another name (``cswap_base``) beside this one, and the two run the same
chain of ``sin`` ops (each saves its 16 KiB input, 64 x 64: an activation has dimensions,
and a payload that comes back 1-D costs a view):

- ``raw``: ``plan="raw"``, every tensor moved (the steps after the one that checks the plan,
  which move without tracking each tensor);
- ``raw, arena``: the same with the planned host arena used on the CPU too (on CUDA every
  moved tensor takes its region; the CPU path skips it unless asked);
- ``budget``: half of keeping everything moved, the rest counted.

Two measures:

- ``--measure instructions`` (the steady one): one step of each configuration and of no
  engine, each in a process of its own under valgrind's callgrind with instrumentation on
  for that step alone; instructions per saved tensor = (step - no engine's step) / tensors.
  A step counts the same to within about 0.5% from run to run (the background threads, the
  moment the instrumentation turns on), about 2% of the per-tensor figure, whatever the
  machine's load. Instructions are not time (a cache miss costs more than an add), but the
  hot path's cost is Python's and torch's dispatch, which they follow.
- ``--measure time``: the sides interleaved step by step in one process; CPU time of the
  thread (torch on one thread), (fastest step - no engine's fastest step) / tensors (this
  machine's noise only adds time), medians beside.

Gradients of the chain's input are compared bit for bit with no engine's.

    .venv/bin/python benchmarks/engine_ab.py --base HEAD --measure instructions --out ...

writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import cswap_lightning
from cswap_lightning.commands.bench_step import result_meta, write_results

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATIONS = ("raw", "raw, arena", "budget")


def package_at(rev: str, folder: str) -> object:
    """The ``cswap_lightning`` package as commit ``rev`` wrote it, imported as ``cswap_base``
    (its imports inside the package are relative)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cswap_lightning"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    Path(folder, "cswap_lightning").rename(Path(folder, "cswap_base"))
    for name in [name for name in sys.modules if name.split(".")[0] == "cswap_base"]:
        del sys.modules[name]  # another call's, from a folder since removed
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("cswap_base")
    finally:
        sys.path.remove(folder)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def chain(x: torch.Tensor, length: int) -> torch.Tensor:
    for _ in range(length):
        x = x.sin()
    return x.sum()


def step(engine: object | None, x: torch.Tensor, tensors: int,
         collect: bool = True) -> tuple[float, torch.Tensor]:
    """CPU seconds of one forward and backward, and the input's gradient; with ``collect``,
    after a garbage collection (what the step before left is not this one's to collect)."""
    if collect:
        gc.collect()
    start = time.thread_time()
    if engine is None:
        loss = chain(x, tensors)
    else:
        with engine:
            loss = chain(x, tensors)
    loss.backward()
    seconds = time.thread_time() - start
    grad, x.grad = x.grad, None
    return seconds, grad


def engine_for(package: object, name: str, x: torch.Tensor, tensors: int) -> object:
    """Configuration ``name``'s engine, past its measured steps and the step checking its
    plan."""
    config, offloader = package.CSwapConfig, package.Offloader
    if name == "budget":
        keep = offloader(config(plan="keep", min_bytes=0))
        step(keep, x, tensors)
        engine = offloader(config(min_bytes=0, budget=keep.last_step().peak_resident_bytes // 2,
                                  profile_steps=1))
        keep.close()
    else:
        engine = offloader(config(plan="raw", min_bytes=0))
        engine.transfer.arena_everywhere = name == "raw, arena"
    for _ in range(engine.config.profile_steps + 2):
        step(engine, x, tensors)
    return engine


def setup() -> torch.Tensor:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "cswap: budget", RuntimeWarning)  # no model to recompute
    return torch.randn(64, 64, requires_grad=True, generator=torch.Generator().manual_seed(0))


def by_time(base: str, tensors: int, rounds: int) -> dict:
    x = setup()
    with tempfile.TemporaryDirectory() as folder:
        packages = {"base": package_at(base, folder), "this": cswap_lightning}
        sides = {side: {name: engine_for(package, name, x, tensors) for name in CONFIGURATIONS}
                 for side, package in packages.items()}
        times = {(side, name): [] for side in sides for name in CONFIGURATIONS}
        plain_times: list[float] = []
        for r in range(rounds):
            plain, expected = step(None, x, tensors)
            plain_times.append(plain)
            for name in CONFIGURATIONS:
                for side in (list(sides) if r % 2 else list(sides)[::-1]):
                    seconds, grad = step(sides[side][name], x, tensors)
                    check(grad, expected, side, name)
                    times[side, name].append(seconds)
            if (r + 1) % 5 == 0:
                print(f"round {r + 1}/{rounds}", flush=True)
    plain = min(plain_times)
    rows = []
    for name in CONFIGURATIONS:
        us = {side: 1e6 * (min(times[side, name]) - plain) / tensors for side in sides}
        median = {side: 1e6 * (statistics.median(times[side, name])
                               - statistics.median(plain_times)) / tensors for side in sides}
        rows.append({"configuration": name, "base": us["base"], "this": us["this"],
                     "ratio": us["this"] / us["base"], "base_median": median["base"],
                     "this_median": median["this"]})
    return {"no_engine_step": 1e6 * plain / tensors, "rows": rows}


def check(grad: torch.Tensor, expected: torch.Tensor, side: str, name: str) -> None:
    if not torch.equal(grad.view(torch.int32), expected.view(torch.int32)):
        raise SystemExit(f"{side} {name}: the gradient differs from no engine's")


def one_step(base: str, side: str, name: str, tensors: int) -> None:
    """Under callgrind: set up, then one step with instrumentation on for it alone. Both
    packages are loaded whichever runs: a collection during the step walks every object."""
    x = setup()
    expected = step(None, x, tensors)[1]
    with tempfile.TemporaryDirectory() as folder:
        packages = {"base": package_at(base, folder), "this": cswap_lightning}
        engine = None if name == "no engine" else engine_for(packages[side], name, x, tensors)
        step(engine, x, tensors)
        gc.collect()
        with instrumented():
            grad = step(engine, x, tensors, collect=False)[1]
        check(grad, expected, side, name)


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Callgrind's instrumentation on for the block alone (this process runs under
    ``callgrind``'s ``--instr-atstart=no``)."""
    toggle = ["callgrind_control", "--instr=on", str(os.getpid())]
    subprocess.run(toggle, capture_output=True, check=True)
    try:
        yield
    finally:
        subprocess.run([toggle[0], "--instr=off", toggle[2]], capture_output=True, check=True)


def callgrind(script: str, args: list[str], what: str) -> int:
    """The instructions ``script`` run with ``args`` under callgrind counts where it turns
    the instrumentation on (``instrumented``); ``what`` names the run in an error."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={folder}/out", sys.executable, script, *args],
            check=False, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"callgrind run of {what} failed:\n{done.stderr[-3000:]}")
    return int(found.group(1))


def instructions(base: str, side: str, name: str, tensors: int) -> int:
    return callgrind(__file__, ["--one-step", json.dumps([side, name]), "--base", base,
                                "--tensors", str(tensors)], f"{side} {name}")


def by_instructions(base: str, tensors: int) -> dict:
    runs = [("this", "no engine")] + [(side, name) for name in CONFIGURATIONS
                                      for side in ("base", "this")]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one valgrind process per run
        counts = dict(zip(runs, pool.map(lambda run: instructions(base, *run, tensors), runs),
                          strict=True))
    plain = counts["this", "no engine"]
    print(f"no engine: {plain / tensors:.0f} instructions per op", flush=True)
    rows = []
    for name in CONFIGURATIONS:
        per = {side: (counts[side, name] - plain) / tensors for side in ("base", "this")}
        rows.append({"configuration": name, **per, "ratio": per["this"] / per["base"]})
        print(f"{name}: base {per['base']:.0f}, this {per['this']:.0f} instructions per tensor",
              flush=True)
    return {"no_engine_step": plain / tensors, "rows": rows}


def markdown(result: dict, args: argparse.Namespace, head: str) -> str:
    if args.measure == "time":
        what, unit = ("CPU time of the thread, fastest of the interleaved rounds (medians "
                      "beside)"), "us"
        columns = " medians: base / this (us) |"
    else:
        what, unit = "instructions (valgrind's callgrind), one step each", "instructions"
        columns = ""
    lines = [(f"The engine's host cost per saved tensor on the CPU: this checkout ({head} and "
              f"its working tree) against {args.base}; {args.tensors} tensors of 16 KiB a step; "
              f"{what}; no engine {result['no_engine_step']:.1f} {unit} per op."), "",
             (f"| configuration | base ({unit} per tensor) | this ({unit} per tensor) | "
              f"this / base |{columns}"), "|---|---:|---:|---:|" + ("---:|" if columns else "")]
    for row in result["rows"]:
        line = (f"| {row['configuration']} | {row['base']:.1f} | {row['this']:.1f} | "
                f"{row['ratio']:.3f}x |")
        if columns:
            line += f" {row['base_median']:.1f} / {row['this_median']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with")
    parser.add_argument("--measure", choices=("time", "instructions"), default="time")
    parser.add_argument("--tensors", type=int, default=None,
                        help="saved tensors a step (2000 by time, 200 by instructions)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (time)")
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    parser.add_argument("--one-step", help=argparse.SUPPRESS)  # [side, configuration]
    args = parser.parse_args(argv)
    args.base = git("rev-parse", "--short", args.base)  # a name that stays what it was
    if args.tensors is None:
        args.tensors = 2000 if args.measure == "time" else 200
    if args.one_step:
        one_step(args.base, *json.loads(args.one_step), args.tensors)
        return
    result = (by_time(args.base, args.tensors, args.rounds) if args.measure == "time"
              else by_instructions(args.base, args.tensors))
    head = git("rev-parse", "--short", "HEAD")
    text = markdown(result, args, head)
    print(text)
    if args.out:
        meta = result_meta(torch.device("cpu"), kind="measurement, this CPU (host cost)",
                           base=args.base, head=head, measure=args.measure,
                           tensors=args.tensors)
        meta["command"] = " ".join(["benchmarks/engine_ab.py", *(argv or sys.argv[1:])])
        write_results(args.out, "The engine's host cost per saved tensor, against a base "
                      "commit", meta, result, text)


if __name__ == "__main__":
    main()
