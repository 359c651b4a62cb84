"""`cswap tune`: tune this GPU's codec kernels anew, print and cache the result."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from ..planning.tuner import Settings, TuningResult, cache_path, tune_cuda
from .bench_step import write_results


def markdown(result: TuningResult) -> str:
    """One row per kernel: each search's best launch and what it cost, then the totals."""
    columns = ["best (grid, block)", "kernel time", "runs", "wall time"]
    header = ["kernel"] + [f"{name} {c}" for name in ("TPE", "grid search") for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---|---:|---:|---:" * 2 + "|"]
    for t in result.kernels:
        cells = []
        for search in (t.tpe, t.grid):
            if search is None:
                cells.append("not run | | |")
                continue
            grid, block, seconds = search.best
            cells.append(f"({grid}, {block}) | {seconds * 1e3:.3f} ms | {search.evaluations} | "
                         f"{search.wall_seconds:.1f} s")
        lines.append(f"| {t.kernel.name} | {' | '.join(cells)} |")
    for name in ("tpe", "grid"):
        searches = [getattr(t, name) for t in result.kernels if getattr(t, name) is not None]
        if searches:
            lines.append(f"\n{'TPE' if name == 'tpe' else 'Grid search'} in total: "
                         f"{sum(s.evaluations for s in searches)} runs, "
                         f"{sum(s.wall_seconds for s in searches):.1f} s.")
    return "\n".join(lines)


def write_report(result: TuningResult, stem: str) -> None:
    """``<stem>.md`` and ``<stem>.json``: the table and every timed run, with date and device."""
    meta = {"date": datetime.date.today().isoformat(), "device": result.key.device,
            "capability": ".".join(map(str, result.key.capability)), "build": result.key.build,
            "torch": torch.__version__, "command": " ".join(["cswap", *sys.argv[1:]]),
            **asdict(result.settings)}
    write_results(stem, "cswap tune", meta, {"result": result.to_json()}, markdown(result))


def run_tune(settings: Settings, dtypes: Sequence[str], out: str | None) -> TuningResult:
    """``cswap tune``: tune every kernel anew, print progress and the table, cache the result."""
    result = tune_cuda(settings, dtypes, force=True, log=print)
    print(markdown(result))
    print(f"cached in {cache_path(result.key)}")
    if out:
        write_report(result, out)
    return result
