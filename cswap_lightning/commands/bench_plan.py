"""`cswap bench plan`: the planner's mix against the peers, predicted for the H100 profiles.

For each model profiled on the first H100 run (``planning/evidence/h100-2026-11-24``) and each
budget (fractions of no offload's peak, and checkpointing's own peak), the planner
(``planning/mix.py``) picks keep, swap or recompute per block; the replay predicts its step
time and peak beside no offload, activation checkpointing of every block and swapping every
tensor raw. No GPU runs here: every figure is a prediction of the replay, which the GPU run
that comes checks against measurements (``cswap bench suite``).
"""

from __future__ import annotations

import torch

from ..config import INFLIGHT_CHOICES
from ..planning import mix
from ..planning import profiled as evidence
from ..planning.replay import checkpoint_all, predict, swap_all
from .bench_step import result_meta, write_results

LEVELS = (0.9, 0.85, 0.7, 0.5)


def run_plan_bench(models: list[str] | None = None, out: str | None = None) -> list[dict]:
    """Predicted rows per model and budget; prints a table, optionally writes result files."""
    rows = []
    for model in models or sorted(evidence.PROFILES):
        w = evidence.workload(model)
        keep, checkpointed, swapped = predict(w), predict(w, checkpoint_all()), predict(w,
                                                                                      swap_all())
        budgets = [(f"{level:.0%} of no offload", int(level * keep.peak_bytes))
                   for level in LEVELS] + [("checkpointing's peak", checkpointed.peak_bytes)]
        for label, budget in budgets:
            units, chosen = mix.choose_among(evidence.candidates(model), budget,
                                             inflight_choices=INFLIGHT_CHOICES)
            p = chosen.prediction
            actions = [d.action for d in chosen.decisions()]
            coarse = {b.name for b in w.blocks}
            recomputed = {b.name for b, d in zip(units.blocks, chosen.decisions(), strict=True)
                          if d.action == "recompute"}
            kinds = [kind for kind, names in (("blocks", recomputed & coarse),
                                              ("activation modules", recomputed - coarse))
                     if names]
            rows.append({
                "model": model, "budget": label, "budget_bytes": budget, "fits": chosen.fits,
                "how": chosen.how, "step_s": p.step_s, "peak_bytes": p.peak_bytes,
                "vs_no_offload_time": p.step_s / keep.step_s,
                "vs_no_offload_peak": p.peak_bytes / keep.peak_bytes,
                "throughput_vs_checkpointing": checkpointed.step_s / p.step_s,
                "throughput_vs_swap_all": swapped.step_s / p.step_s,
                "checkpointing_fits": checkpointed.peak_bytes <= budget,
                "swap_all_fits": swapped.peak_bytes <= budget,
                "held_peak_bytes": p.held_peak_bytes, "inflight_bytes": chosen.inflight_bytes,
                "recomputed_units": " and ".join(kinds) or "blocks",
                "swapped_blocks": actions.count("swap"),
                "recomputed_blocks": actions.count("recompute"), "blocks": len(actions)})
            print(f"  {evidence.LABELS[model]}, {label}: {chosen.how} "
                  f"(predicted {p.step_s / keep.step_s:.3f}x no offload's step)", flush=True)
    head = ("| model | budget | planner's mix | step vs no offload | peak vs no offload | "
            "with copies in flight | in flight at most | throughput vs checkpointing | "
            "vs swapping all raw |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fits = "" if r["fits"] else " (DOES NOT FIT)"
        if r["recomputed_units"] != "blocks":
            fits += f" (units: {r['recomputed_units']})"
        ck = f"{r['throughput_vs_checkpointing']:.2f}x" + (
            "" if r["checkpointing_fits"] else " (ckpt over budget)")
        sw = f"{r['throughput_vs_swap_all']:.2f}x" + (
            "" if r["swap_all_fits"] else " (swap-all over budget)")
        lines.append(f"| {evidence.LABELS[r['model']]} | {r['budget']} | {r['how']}{fits} | "
                     f"{r['vs_no_offload_time']:.3f}x | {r['vs_no_offload_peak']:.0%} | "
                     f"{r['held_peak_bytes'] / r['peak_bytes'] * r['vs_no_offload_peak']:.0%} | "
                     f"{r['inflight_bytes'] >> 30} GiB | {ck} | {sw} |")
    table = ("Every figure is a prediction of the replay of the H100 profiles "
             "(bf16, PCIe 54 GB/s each way), not a measurement. Peaks are the allocator's "
             "(`max_memory_allocated`); \"with copies in flight\" adds the originals whose "
             "copies out are still running (not reusable before they end). The planner may "
             "raise the bound on bytes in flight from 1 GiB to 8 GiB (`inflight_bytes=\"auto\"`) "
             "where that stays within the budget.\n\n" + "\n".join(lines))
    print(table)
    if out:
        meta = result_meta(torch.device("cpu"), kind="prediction (replay of H100 profiles)",
                           evidence="planning/evidence/h100-2026-11-24", levels=list(LEVELS))
        write_results(out, "cswap bench plan (predicted)", meta, {"rows": rows}, table)
    return rows
