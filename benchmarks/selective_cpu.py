"""Recomputation below the layer, measured on the CPU with the engine's ledger: what one
Llama-3-8B layer (hidden 4096, MLP 14336, 32 heads, 8 key/value heads; bf16; SDPA; random
init) saves per token, what it keeps recomputed below the layer (its input, the outputs of its
matmuls and attention) and recomputed whole (its input); and the step's time on this CPU each
way, beside the estimate's figures for an H100 PCIe.

    .venv/bin/python benchmarks/selective_cpu.py --out benchmarks/results/selective-cpu-...

writes ``OUT.md`` and ``OUT.json``. The CPU's times say what recomputing costs on this CPU
only (its elementwise kernels are slow beside its matmuls in a different way than a GPU's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers

import cswap_lightning as cswap
from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.core.recompute import below, units
from cswap_lightning.planning import models, sizing
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import Setup, estimate

KiB = 1024


def llama(layers: int) -> transformers.PreTrainedModel:
    config = {k: v for k, v in models.KNOWN["llama-3-8b"].items() if k != "model_type"}
    config |= {"num_hidden_layers": layers, "vocab_size": 1024}  # the head apart
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)


def own_bytes(stats: cswap.StepStats, first: int, stop: int) -> int:
    """The saved activations of sites ``first`` to ``stop``, each storage once."""
    return sum(s.nbytes for s in stats.sites[first:stop]
               if s.decision != "dedup" and s.reason in ("", "plan", "small"))


def measure(layers: int, sequence: int, repeats: int) -> dict:
    model, ids = llama(layers), torch.randint(0, 1024, (1, sequence))
    off = cswap.Offloader(cswap.CSwapConfig(plan="keep", min_bytes=0, profile_steps=1,
                                            budget=None)).watch(model)
    names = [n for n in units(model) if n.count(".") == 2]  # the layers

    def step() -> tuple[cswap.StepStats, float]:
        started = time.perf_counter()
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return off.last_step(), time.perf_counter() - started

    plain, _ = step()  # measured: each layer's call, and what it would keep below the layer
    step()  # its block calls are read as this one starts
    calls = [c for c in off.block_calls if c.name in names]
    ways: dict[str, dict] = {}
    for way, chosen in (("plain", []), ("below the layer", list(below(units(model)))),
                        ("whole", names)):
        off.recompute(chosen)
        stats, _ = step() if chosen else (plain, 0.0)  # (plain: the measured step's rows)
        seconds = statistics.median(step()[1] for _ in range(repeats))
        ways[way] = {"sites": len(stats.sites), "peak_resident_bytes": stats.peak_resident_bytes,
                     "peak_bytes": stats.peak_bytes, "step_s": seconds}
    off.close()
    tokens = sequence
    call = calls[-1]
    per_layer = {
        "saves_kib_per_token": own_bytes(plain, call.first_site, call.stop_site) / tokens / KiB,
        "below_keeps_kib_per_token": (call.input_bytes + sum(call.kept)) / tokens / KiB,
        "whole_keeps_kib_per_token": call.input_bytes / tokens / KiB,
        "kept_outputs_kib_per_token": [round(n / tokens / KiB, 2) for n in call.kept],
        "forward_s": call.forward_s, "elementwise_s": call.elementwise_s}
    freed = (ways["plain"]["peak_resident_bytes"]
             - ways["below the layer"]["peak_resident_bytes"]) / layers / tokens / KiB
    layer = sizing.first_layer(estimate(Setup("llama-3-8b", 8192, 1),
                                        device("h100-pcie")))
    h100 = {"saves_kib_per_token": layer.saved_kib, "below_keeps_kib_per_token": layer.below_kib,
            "below_ms": 1e3 * layer.below_s, "forward_ms": 1e3 * layer.forward_s}
    return {"layers": layers, "sequence": sequence, "per_layer": per_layer,
            "ledger_freed_kib_per_token_per_layer": freed, "ways": ways,
            "estimate_h100_pcie_s8192": h100}


TITLE = "Recomputation below the layer on the CPU: one Llama-3-8B layer"


def markdown(r: dict) -> str:
    p, h = r["per_layer"], r["estimate_h100_pcie_s8192"]
    plain = r["ways"]["plain"]["step_s"]
    lines = [(f"Llama-3-8B's layer shapes, {r['layers']} layers, sequence {r['sequence']}, "
              f"batch 1, bf16, SDPA, random init, transformers {transformers.__version__}, "
              "plan keep (the ledger counts every saved tensor the engine's hooks see)."), "",
             "| per layer, per token | measured (CPU) | estimated (H100 PCIe, s8192) |",
             "|---|---:|---:|",
             (f"| saved plainly | {p['saves_kib_per_token']:.1f} KiB | "
             f"{h['saves_kib_per_token']:.1f} KiB |"),
             (f"| kept below the layer (input + matmul/attention outputs) | "
             f"{p['below_keeps_kib_per_token']:.1f} KiB | {h['below_keeps_kib_per_token']:.1f} "
             "KiB |"),
             f"| kept recomputed whole (input) | {p['whole_keeps_kib_per_token']:.1f} KiB | |",
             (f"| ledger's peak, lower per layer below the layer | "
             f"{r['ledger_freed_kib_per_token_per_layer']:.1f} KiB | |"),
             (f"| recomputation's cost below the layer / whole (share of the forward) | "
             f"{p['elementwise_s'] / p['forward_s']:.0%} (block timer, CPU) | "
             f"{h['below_ms'] / h['forward_ms']:.0%} ({h['below_ms']:.2f} of "
             f"{h['forward_ms']:.2f} ms) |"), "",
             f"Kept outputs, KiB per token: {p['kept_outputs_kib_per_token']}", "",
             ("| way | sites | ledger's peak (saved tensors) | with what backward holds again "
              "| step on this CPU | vs plain |"),
             "|---|---:|---:|---:|---:|---:|"]
    for way, m in r["ways"].items():
        lines.append(f"| {way} | {m['sites']} | {m['peak_resident_bytes'] / 2**20:.1f} MiB | "
                     f"{m['peak_bytes'] / 2**20:.1f} MiB | {m['step_s']:.2f} s | "
                     f"{m['step_s'] / plain:.3f}x |")
    lines += ["", ("The ledger's peak is the step's saved tensors on the device at once "
              "(`StepStats.peak_resident_bytes`); beside it, with what a recomputed layer "
              "saves again while backward runs it (`StepStats.peak_bytes`). The step times are "
              "this shared 2-core CPU's, medians of the repeats, under other load: they say "
              "what recomputing costs here only.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    r = measure(args.layers, args.seq, args.repeats)
    meta = result_meta(torch.device("cpu"), command=" ".join(
        ["python", *sys.argv] if argv is None else ["python", __file__, *argv]),
        kind="measurement (the engine's ledger; this CPU's times) beside an estimate")
    table = markdown(r)
    print(table)
    write_results(args.out, TITLE, meta, r, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
