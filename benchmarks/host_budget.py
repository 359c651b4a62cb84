"""What host memory buys, predicted with `cswap plan`'s machinery (no GPU): Llama-3-8B's
shapes (32 layers, batch 1, bf16) fine-tuned with LoRA on an H100 PCIe at 8192 and 16384
tokens (full fine-tuning's AdamW state alone passes its 80 GB), at checkpointing's peak and
at half the peak without help, planned with each host budget
(``CSwapConfig.host_budget``, ``cswap plan --host-memory``). Every figure is a prediction
(the meta-device trace, the calibrated roofline, the replay), per GPU process.

    .venv/bin/python benchmarks/host_budget.py --out benchmarks/results/host-budget-predicted-...

writes ``OUT.md`` and ``OUT.json`` (``--quick``: 4 layers at 2048 and 4096 tokens, to see it
run).
"""

from __future__ import annotations

import argparse
import sys
import time

from cswap_lightning.commands.bench_step import PREDICTED, report, script_meta
from cswap_lightning.planning import mix, models, sizing
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import Setup, estimate

GiB = 1 << 30
TITLE = "What host memory buys (predicted)"
HOSTS_GIB = (None, 32, 16, 8, 4, 0)


def rows(model: str, sequence: int, layers: int | None, dev: str, log=print) -> list[dict]:
    """Each budget's mix under each host budget, as a row of figures (LoRA)."""
    setup = Setup(model, sequence, 1, lora=models.LoRA(), layers=layers)
    est = estimate(setup, device(dev))
    keep, checkpointing = sizing.baselines(est)
    budgets = [("half the peak without help", keep.prediction.peak_bytes // 2),
               ("checkpointing's peak", checkpointing.prediction.peak_bytes)]
    replays, out = mix.Replays(), []  # the same step's replays, shared by every host budget
    for host in HOSTS_GIB:
        began = time.monotonic()
        ways = sizing.mixes(est, budgets, replays=replays,
                            host=None if host is None else host * GiB)
        for (label, _), way in zip(budgets, ways, strict=True):
            p = way.prediction
            out.append({"sequence": sequence, "budget": label,
                        "host_budget_gib": host, "plan": way.how, "fits": way.fits,
                        "host_gib": p.host_bytes / GiB, "peak_gib": p.peak_bytes / GiB,
                        "step_ms": 1e3 * way.step_s,
                        "vs_checkpointing": checkpointing.step_s / way.step_s})
        log(f"host_budget: sequence {sequence}, host {host} GiB "
            f"({time.monotonic() - began:.0f} s)")
    return out


def table(found: list[dict]) -> str:
    lines = [("| sequence | budget | host budget GiB | plan | host GiB | peak GiB | step ms | "
              "vs checkpointing |"), "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in found:
        host = "none" if r["host_budget_gib"] is None else f"{r['host_budget_gib']:g}"
        over = "" if r["fits"] or r["plan"].startswith("does not fit") else " (does not fit)"
        lines.append(f"| {r['sequence']} | {r['budget']} | {host} | {r['plan']}{over} | "
                     f"{r['host_gib']:.2f} | {r['peak_gib']:.2f} | {r['step_ms']:.1f} | "
                     f"{r['vs_checkpointing']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    p.add_argument("--quick", action="store_true", help="4 layers at 2048 and 4096 tokens")
    p.add_argument("--device", default="h100-pcie")
    args = p.parse_args(argv)
    sequences, layers = ((2048, 4096), 4) if args.quick else ((8192, 16384), None)
    found = []
    for sequence in sequences:
        found += rows("llama-3-8b", sequence, layers, args.device,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    intro = (f"Llama-3-8B's shapes{f', {layers} layers' if layers else ''}, LoRA (rank 16, "
             f"every linear layer but the head), batch 1, bfloat16, on "
             f"{device(args.device).name}: the planner's mix at two budgets under each host "
             "budget (per GPU process), replayed on the estimated step. host GiB: what the "
             "mix's swapped blocks hold in pinned host memory at the end of forward.")
    report(intro + "\n\n" + table(found), args.out, TITLE,
           script_meta(__file__, argv, kind=PREDICTED), {"rows": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
