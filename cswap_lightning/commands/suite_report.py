"""``cswap bench suite``'s report: the goals judged from the measured figures, a verdict per
memory level, the markdown and the plots.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..planning import profiled
from ..records import fmt_bytes
from .suite_cases import (
    BUDGETED,
    CHECKPOINTING,
    CSWAP,
    DESCRIPTIONS,
    HF_OFFLOAD,
    MAX_BATCH_METHODS,
    METHODS,
    NO_OFFLOAD,
)

GOAL_LEVEL = 0.35  # the goals' memory level: a fraction of no offload's measured peak
GOALS = (
    "at 35% of no offload's memory: >= 0.92x no offload's samples/s",
    "at 35% of no offload's memory: >= 1.2x activation checkpointing's samples/s",
    ">= 1.5x HF's built-in offload's samples/s, in no more memory",
    ("exposed swap time, compressed (cswap auto at the 35% budget) vs raw, per byte "
     "offloaded: -55% or better"),
    ">= 4x the largest batch at <= 15% slowdown",
)


def run_label(row: dict) -> str:
    """A run's name in the report: its method, and its budget where it has one."""
    if row.get("budget") is None:
        return row["method"]
    return f"{row['method']} @{round(100 * row['budget'])}%"


# -- goals and verdict ------------------------------------------------------------------------
def _ran(result: dict) -> list[dict]:
    return [r for r in result["runs"] if "skipped" not in r and "peak_fraction" in r]


def _row(result: dict, label: str) -> dict | None:
    return next((r for r in _ran(result) if r["label"] == label), None)


def _fastest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["samples_per_s"], default=None)


def goals(result: dict) -> list[dict]:
    """Each goal of issue 13 with PASS, FAIL or n/a and the measured figures behind it."""
    low = GOAL_LEVEL
    base = _row(result, NO_OFFLOAD)
    out: list[dict] = []

    def add(goal: str, status: str, measured: str) -> None:
        out.append({"goal": goal, "status": status, "measured": measured})

    if base is None:
        for goal in GOALS:
            add(goal, "n/a", "no offload did not run")
        return out
    cswap_runs = [r for r in _ran(result) if r["method"] in CSWAP]
    in_low = [r for r in cswap_runs if r["peak_fraction"] <= low]
    best = _fastest(in_low)
    lowest = min(cswap_runs, key=lambda r: r["peak_fraction"], default=None)
    nofit = ("no cswap run fits" + (f" (lowest: {lowest['label']} at "
                                    f"{100 * lowest['peak_fraction']:.0f}%)" if lowest else ""))
    if not cswap_runs:
        add(GOALS[0], "n/a", "no cswap run ran")
    elif best is None:
        add(GOALS[0], "FAIL", nofit)
    else:
        ratio = best["vs_no_offload"]
        add(GOALS[0], "PASS" if ratio >= 0.92 else "FAIL",
            f"{best['label']}: {ratio:.2f}x no offload at {100 * best['peak_fraction']:.0f}% of "
            "its memory")
    ckpt = _row(result, CHECKPOINTING)
    if ckpt is None or not cswap_runs:
        add(GOALS[1], "n/a", "activation checkpointing or cswap did not run")
    elif best is None:
        add(GOALS[1], "FAIL", nofit)
    else:
        ratio = best["samples_per_s"] / ckpt["samples_per_s"]
        add(GOALS[1], "PASS" if ratio >= 1.2 else "FAIL",
            f"{best['label']}: {ratio:.2f}x activation checkpointing (which peaks at "
            f"{100 * ckpt['peak_fraction']:.0f}%)")
    hf = _row(result, HF_OFFLOAD)
    if hf is None or not cswap_runs:
        why = next((r.get("skipped") for r in result["runs"] if r["method"] == HF_OFFLOAD), "")
        add(GOALS[2], "n/a", f"HF built-in offload did not run: {why}" if hf is None
            else "cswap did not run")
    else:
        rival = _fastest([r for r in cswap_runs if r["peak_bytes"] <= hf["peak_bytes"]])
        if rival is None:
            add(GOALS[2], "FAIL", f"no cswap run fits in HF offload's "
                f"{100 * hf['peak_fraction']:.0f}%")
        else:
            ratio = rival["samples_per_s"] / hf["samples_per_s"]
            add(GOALS[2], "PASS" if ratio >= 1.5 else "FAIL",
                f"{rival['label']}: {ratio:.2f}x HF built-in offload (which peaks at "
                f"{100 * hf['peak_fraction']:.0f}%)")
    # Per byte offloaded: a run that keeps more on the device exposes less swap time for
    # that reason alone; what the goal asks is what compression does to the same swaps.
    at = f"@{round(100 * low)}%"
    raw = _row(result, "cswap raw")
    auto = [r for r in (_row(result, f"{c} {at}") for c in BUDGETED)
            if r is not None and r.get("offloaded_bytes")]
    compressed = [r for r in auto if set(r.get("decisions", {})) - {"raw", "keep", "dedup"}]
    if raw is None or not auto:
        add(GOALS[3], "n/a", f"cswap raw, or cswap auto {at}, did not run or offloaded nothing")
    elif not compressed:
        add(GOALS[3], "n/a", f"cswap auto {at} compressed no tensor (the advisor swapped all "
            "it offloaded raw): no compression to compare")
    elif raw["exposed_s"] <= 0.0 or not raw.get("offloaded_bytes"):
        add(GOALS[3], "n/a", "cswap raw exposes no swap time")
    else:
        def per_gib(r: dict) -> float:
            return r["exposed_s"] / (r["offloaded_bytes"] / 2**30)

        comp = min(compressed, key=per_gib)
        change = per_gib(comp) / per_gib(raw) - 1.0
        add(GOALS[3], "PASS" if change <= -0.55 else "FAIL",
            f"{comp['label']} {1e3 * comp['exposed_s']:.1f} ms for "
            f"{fmt_bytes(comp['offloaded_bytes'])} offloaded against raw "
            f"{1e3 * raw['exposed_s']:.1f} ms for {fmt_bytes(raw['offloaded_bytes'])}: "
            f"{100 * change:+.0f}% per byte")
    searches = {s["method"]: s for s in result.get("max_batch", [])}
    mine, theirs = searches.get("cswap auto"), searches.get(NO_OFFLOAD)
    if not mine or not theirs or not mine["max_batch"] or not theirs["max_batch"]:
        add(GOALS[4], "n/a", "largest batch not searched (or nothing fit)")
    else:
        factor = mine["max_batch"] / theirs["max_batch"]
        speed = mine["samples_per_s"] / theirs["samples_per_s"]
        more = "at least " if mine["limited_by"] != "memory" else ""
        add(GOALS[4], "PASS" if factor >= 4 and speed >= 0.85 else "FAIL",
            f"cswap auto: batch {mine['max_batch']} ({more}{factor:.1f}x no offload's "
            f"{theirs['max_batch']}) at {speed:.2f}x its samples/s")
    return out


def verdict(result: dict, levels: tuple[float, ...]) -> str:
    """Which run is fastest within each memory level."""
    parts = []
    for level in sorted(levels, reverse=True):
        fit = [r for r in _ran(result) if r["peak_fraction"] <= level + 1e-9]
        best = _fastest(fit)
        where = f"<= {round(100 * level)}% of no offload's memory"
        if best is None:
            parts.append(f"{where}: nothing fits")
        else:
            parts.append(f"{where}: {best['label']} ({best['samples_per_s']:.1f} samples/s, "
                         f"{best['vs_no_offload']:.2f}x)")
    return f"{result['label']}: " + "; ".join(parts)


# -- the report -------------------------------------------------------------------------------
def peak_meaning(dev: torch.device) -> str:
    """What "peak memory" means in this report, on ``dev``."""
    if dev.type == "cuda":
        return ("Peak memory: torch.cuda.max_memory_allocated over a training step (weights, "
                "gradients, the batch, saved tensors, temporaries), reset before each step; the "
                "largest over the timed steps. Host memory, pinned or not, is not counted.")
    return ("Peak memory: the CPU has no separate device memory, so a ledger measures what "
            "would be on one, by the same rule for every method, over one more training step "
            "(forward, backward, optimizer): the storages of the parameters, buffers, optimizer "
            "state and batch, of every tensor an operation on the training thread allocates "
            "outside a saved-tensor pack hook, and of every tensor an unpack hook hands back, "
            "each counted once from then until it is freed. Not counted: what a pack hook copies "
            "a saved tensor into, and what another thread allocates, until it is handed back "
            "(a method's host side). On the CPU host and device are the same RAM and a swap is "
            "a memory copy on the same cores, and a few timed steps on a shared machine are "
            "noisy: the CPU figures check the code, they do not rank the methods.")


def markdown(results: list[dict], dev: torch.device, opts: argparse.Namespace) -> str:
    """The report's body (the header comes from ``write_results``)."""
    within = ("device memory" if dev.type == "cuda" and opts.memory_cap is None
              else "the memory cap given for each model")
    lines = [peak_meaning(dev), "",
             ("Methods (budget: bytes, that fraction of no offload's measured peak; every "
              "other method runs once and is placed by its measured peak):"), ""]
    lines += [f"- {name}: {DESCRIPTIONS[name]}" for name in METHODS]
    lines += [(f"- max batch: the largest batch that fits in {within}, found by doubling (and "
               f"bisecting on a GPU), for {', '.join(MAX_BATCH_METHODS)} (no budget), with its "
               "samples/s"), "",
              ("Figures: samples/s (median step, optimizer included) and its ratio to no "
               "offload's; peak memory and its fraction of no offload's; bytes over the link per "
               "step (what leaves the device, counted twice: out in forward, back in "
               "backward); exposed swap time of cswap runs (CSwap's measure: backward's waits, "
               "StepStats.wait_s, plus forward's stalls, StepStats.forward_wait_s, or forward "
               "time beyond no offload's where the engine does not report them); the engine's "
               "own peak of resident saved-tensor bytes (StepStats.peak_resident_bytes, where "
               "the engine reports it); cswap's sites: how many saved tensors the engine kept "
               "(keep), shared (dedup) or sent through each codec on the last step."), "",
              "Goals (PASS/FAIL/n/a per model below, computed from the measured figures):", ""]
    lines += [f"- {g}" for g in GOALS]
    for result in results:
        lines += ["", *model_markdown(result, opts)]
    return "\n".join(lines)


def _fmt_window(prefetch_bytes: int | None) -> str:
    return "auto (the engine's)" if prefetch_bytes is None else fmt_bytes(prefetch_bytes)


def _predicted(result: dict, row: dict, opts: argparse.Namespace) -> str:
    """The replay's prediction of a run of a full-size model profiled on the first H100 run
    (``planning.profiled``), as ratios to its prediction of no offload; "-" where it has none
    (other sizes, models, methods)."""
    if opts.small:
        return "-"
    predicted = profiled.predict_run(result["model"], row["method"], row.get("budget"),
                                     result["batch"], result.get("prefetch_bytes"))
    if predicted is None:
        return "-"
    run, base = predicted
    return (f"{run.step_s / base.step_s:.2f}x, {run.peak_bytes / base.peak_bytes:.0%} "
            "(H100 profile)")


def model_markdown(result: dict, opts: argparse.Namespace) -> list[str]:
    lines = [f"## {result['label']}", "",
             (f"{result['shape']}, batch {result['batch']}, {result['params'] / 1e6:.1f} M "
              f"parameters; cswap's prefetch_bytes "
              f"{_fmt_window(result.get('prefetch_bytes'))}"
              f"{'' if result['complete'] else ' (PARTIAL: still running, or cut off)'}"),
             "", ("| method | samples/s | vs no offload | peak memory | vs no offload | "
                  "link bytes/step | exposed swap | engine's peak | cswap's sites | "
                  "replay predicts: step, peak vs no offload |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    order = {name: i for i, name in enumerate(METHODS)}
    rows = sorted(result["runs"], key=lambda r: (order[r["method"]], -(r.get("budget") or 0)))
    for r in rows:
        label = run_label(r)
        if "skipped" in r:
            lines.append(f"| {label} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        exposed = f"{1e3 * r['exposed_s']:.1f} ms" if "exposed_s" in r else "-"
        engine = r.get("engine_peak_bytes")
        engine_text = "-" if r["method"] not in CSWAP else (
            fmt_bytes(engine) if engine is not None else "n/a")
        sites = ", ".join(f"{k} {v}" for k, v in sorted(r.get("decisions", {}).items()))
        lines.append(
            f"| {label} | {r['samples_per_s']:.1f} | {r.get('vs_no_offload', math.nan):.2f}x | "
            f"{fmt_bytes(r['peak_bytes'])} | {100 * r.get('peak_fraction', math.nan):.0f}% | "
            f"{fmt_bytes(r['link_bytes'])} | {exposed} | {engine_text} | {sites or '-'} | "
            f"{_predicted(result, r, opts)} |")
    if result.get("max_batch"):
        cap = result.get("memory_cap")
        lines += ["", f"max batch (within {fmt_bytes(cap) if cap else 'device memory'}):", "",
                  "| method | largest batch | samples/s there | peak | stopped by |",
                  "|---|---:|---:|---:|---|"]
        for s in result["max_batch"]:
            if s["max_batch"] is None:
                lines.append(f"| {s['method']} | none fits | | | {s['limited_by']} |")
                continue
            lines.append(f"| {s['method']} | {s['max_batch']} | {s['samples_per_s']:.1f} | "
                         f"{fmt_bytes(s['peak_bytes'])} | {s['limited_by']} |")
    elif opts.max_batch:
        lines += ["", "max batch: not searched (no offload did not run, or out of time)"]
    if "goals" in result:
        lines += ["", "Goals:", ""]
        lines += [f"- {g['status']}: {g['goal']}: {g['measured']}" for g in result["goals"]]
        lines += ["", f"Verdict: {result['verdict']}"]
    if result.get("plot"):
        lines += ["", f"![{result['label']}: samples/s against peak memory]({result['plot']})"]
    return lines


def plot(result: dict, path: Path) -> bool:
    """Samples/s against peak memory, one marker per run, cswap budgets joined by lines."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    ran = _ran(result)
    if not ran:
        return False
    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    unit = 2**30 if max(r["peak_bytes"] for r in ran) >= 2**30 else 2**20
    markers = dict(zip(METHODS, "osDv^ph*", strict=True))
    for method in METHODS:
        rows = sorted((r for r in ran if r["method"] == method), key=lambda r: r["peak_bytes"])
        if not rows:
            continue
        xs = [r["peak_bytes"] / unit for r in rows]
        ys = [r["samples_per_s"] for r in rows]
        ax.plot(xs, ys, marker=markers[method], linestyle="-" if len(rows) > 1 else "",
                label=method)
        for r, x, y in zip(rows, xs, ys, strict=True):
            if r.get("budget") is not None:
                ax.annotate(f"{round(100 * r['budget'])}%", (x, y), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    base = _row(result, NO_OFFLOAD)
    if base is not None:
        for level in result["levels"]:
            ax.axvline(level * base["peak_bytes"] / unit, color="grey", linestyle=":",
                       linewidth=0.8)
    levels = "/".join(f"{round(100 * level)}" for level in result["levels"])
    ax.set_xlabel(f"peak memory ({'GiB' if unit == 2**30 else 'MiB'}); dotted: {levels}% of "
                  "no offload's")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{result['label']}, batch {result['batch']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
