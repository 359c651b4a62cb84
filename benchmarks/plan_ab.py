"""`cswap plan` from two checkouts of this repository, run in turn (A B A B ...), timed in the
process time of each run, their outputs compared: what a change to the planner or its replay
costs or saves, and whether it changed any figure the command prints.

    .venv/bin/python benchmarks/plan_ab.py --base 5cdc8bd --runs 3 \\
        --out benchmarks/results/plan-ab-cpu-... -- llama-3-8b --seq 8192 --lora

checks ``--base`` out into a temporary worktree (run with this checkout's interpreter, its
``cswap_lightning`` first on the path), runs the command there (B) and here (A), and writes
``OUT.md`` and ``OUT.json``. The last line of the output (the command's own seconds) is left
out of the comparison.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cswap_lightning.commands.bench_step import script_meta, write_results

ROOT = Path(__file__).resolve().parent.parent


def timed(checkout: Path, args: list[str]) -> tuple[float, str]:
    """One run of ``cswap plan ARGS`` with ``checkout``'s package: its process seconds (user
    and system) and its output but the last line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-m", "cswap_lightning", "plan", *args], cwd=checkout,
                         env=env, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, "\n".join(out.rstrip("\n").splitlines()[:-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (B)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("plan", nargs="+", help="cswap plan's arguments (after --)")
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            times: dict[str, list[float]] = {"A": [], "B": []}
            outputs: dict[str, set[str]] = {"A": set(), "B": set()}
            for run in range(args.runs):
                for side, checkout in (("A", ROOT), ("B", base)):
                    seconds, out = timed(checkout, args.plan)
                    times[side].append(seconds)
                    outputs[side].add(out)
                    print(f"run {run + 1}/{args.runs} {side}: {seconds:.1f} s", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=True)
    same = outputs["A"] == outputs["B"] and len(outputs["A"]) == 1
    ratios = [a / b for a, b in zip(times["A"], times["B"], strict=True)]
    rows = [f"| {side} | {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |"
            for side, name, t in (("A", f"this checkout ({head})", times["A"]),
                                  ("B", f"{args.base}", times["B"]))]
    markdown = "\n".join([
        "Process seconds (user and system) of each run of `cswap plan "
        + " ".join(args.plan) + "`, the two run in turn.", "",
        "| | code | median s | min | max |", "|---|---|---:|---:|---:|", *rows, "",
        (f"A / B, run by run: {', '.join(f'{r:.3f}' for r in ratios)} "
         f"(median {statistics.median(ratios):.3f})."),
        ("Outputs (but the line of the command's own seconds): "
         f"{'the same, every run' if same else 'DIFFERENT'}.")])
    meta = script_meta(__file__, argv, kind="measurement (process time on this CPU)",
                       base=args.base, head=head, runs=args.runs)
    write_results(args.out, "cswap plan: one checkout against another", meta,
                  {"seconds": times, "ratios": ratios, "same": same}, markdown)


if __name__ == "__main__":
    main()
