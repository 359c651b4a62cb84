"""Where Llama-3-8B's LoRA fine-tuning fits, its base in bfloat16 (LoRA) or in 4 bits
(QLoRA, bitsandbytes' NF4), predicted with `cswap plan`'s machinery (no GPU): for each device,
the weights, the peak without help and with checkpointing, the planner's mix at the device's
memory (its step against checkpointing's, the host memory it holds), and the longest
sequence that fits each way. Every figure is a prediction (the meta-device trace, the
calibrated roofline, the replay), per GPU process.

    .venv/bin/python benchmarks/fit_qlora.py --out benchmarks/results/fit-qlora-predicted-...

writes ``OUT.md`` and ``OUT.json`` (``--quick``: 4 layers at 2048 tokens on two devices, to
see it run).
"""

from __future__ import annotations

import argparse
import sys
import time

from cswap_lightning.commands.bench_step import PREDICTED, report, script_meta
from cswap_lightning.planning import models, sizing
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import OPTIMIZERS, Setup, estimate

GiB = 1 << 30
TITLE = "Where LoRA and QLoRA fit (predicted)"
DEVICES = ("rtx-4090", "l40s", "a100-80gb", "h100-pcie")
TUNINGS = {"LoRA": models.LoRA(), "QLoRA": models.LoRA(quantized=True)}
WAYS = {"none": "without help", "checkpointing": "checkpointing", "planner": "the planner"}
CEILING = 65536


def row(tuning: str, setup: Setup, dev: str) -> dict:
    """One tuning on one device: the figures of the table."""
    est = estimate(setup, device(dev), OPTIMIZERS["adamw"])
    keep, checkpointing = sizing.baselines(est)
    offloaded = sizing.peers(est)[0]  # checkpointing with its inputs offloaded (Unsloth's)
    (planned,) = sizing.mixes(est, [("the device", sizing.usable(est.device))])
    longest = {how: sizing.largest(est, how, CEILING) for how in WAYS}
    return {"tuning": tuning, "device": est.device.name, "sequence": setup.sequence,
            "weights_gib": est.training.weights / GiB,
            "keep_peak_gib": keep.prediction.peak_bytes / GiB,
            "checkpointing_peak_gib": checkpointing.prediction.peak_bytes / GiB,
            "checkpointing_ms": 1e3 * checkpointing.step_s,
            "offloaded_checkpointing_peak_gib": offloaded.prediction.peak_bytes / GiB,
            "offloaded_checkpointing_host_gib": offloaded.prediction.host_bytes / GiB,
            "plan": planned.how, "plan_fits": planned.fits,
            "plan_peak_gib": planned.prediction.peak_bytes / GiB,
            "plan_host_gib": planned.prediction.host_bytes / GiB,
            "plan_ms": 1e3 * planned.step_s,
            "plan_vs_checkpointing": checkpointing.step_s / planned.step_s,
            "longest": longest}


def table(found: list[dict]) -> str:
    lines = [("| tuning | device | weights GiB | peak GiB: none / ckpt / offloaded ckpt / "
              "planner | planner vs ckpt | host GiB: offloaded ckpt / planner | longest "
              "sequence: none / ckpt / planner |"),
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in found:
        fits = "" if r["plan_fits"] else " (does not fit)"
        longest = " / ".join("-" if n is None else str(n) for n in r["longest"].values())
        lines.append(f"| {r['tuning']} | {r['device']} | {r['weights_gib']:.1f} | "
                     f"{r['keep_peak_gib']:.1f} / {r['checkpointing_peak_gib']:.1f} / "
                     f"{r['offloaded_checkpointing_peak_gib']:.1f} / "
                     f"{r['plan_peak_gib']:.1f}{fits} | {r['plan_vs_checkpointing']:.2f}x | "
                     f"{r['offloaded_checkpointing_host_gib']:.1f} / {r['plan_host_gib']:.1f} | "
                     f"{longest} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    p.add_argument("--quick", action="store_true", help="4 layers at 2048 tokens, two devices")
    p.add_argument("--seq", type=int, default=8192)
    args = p.parse_args(argv)
    layers, sequence, devices = (4, 2048, DEVICES[:2]) if args.quick else (None, args.seq,
                                                                          DEVICES)
    found = []
    for tuning, lora in TUNINGS.items():
        for dev in devices:
            began = time.monotonic()
            found.append(row(tuning, Setup("llama-3-8b", sequence, 1, lora=lora,
                                           layers=layers), dev))
            print(f"fit_qlora: {tuning} on {dev} ({time.monotonic() - began:.0f} s)",
                  file=sys.stderr, flush=True)
    intro = (f"Llama-3-8B's shapes{f', {layers} layers' if layers else ''}, sequence "
             f"{sequence}, batch 1, bfloat16, adapters of rank 16 on every linear layer but "
             "the head (AdamW), the base in bfloat16 (LoRA) or in 4-bit NF4 with double "
             "quantization (QLoRA, bitsandbytes). The planner's mix is planned at the "
             "device's memory (less 1 GiB for the CUDA context); its step is forward and "
             "backward, against checkpointing every layer (offloaded checkpointing, "
             "Unsloth's, every layer's input swapped, is predicted as fast as it). The "
             f"longest sequences are searched up to {CEILING} tokens in steps of "
             f"{sizing.GRANULE} (-: none fits). "
             "PREDICTIONS: no GPU ran any of it; bitsandbytes' kernels are timed by the "
             "roofline, which they may not reach.")
    report(intro + "\n\n" + table(found), args.out, TITLE,
           script_meta(__file__, argv, kind=PREDICTED), {"rows": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
