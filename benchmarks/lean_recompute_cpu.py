"""Host time of a step with every layer recomputed: the engine's first run without autograd
(``core/lean.py``) beside the engine under checkpoint, Hugging Face's gradient checkpointing
(non-reentrant, its default; and reentrant) and plain training.

Host-bound on purpose: Hugging Face models with tiny shapes (hidden 32, sequence 16, batch 2,
fp32, dropout on, random init) on one CPU thread, so a step is almost all Python and
dispatch: the time a GPU waits for where its kernels are short (BERT-large on an H200 took
2.03x a plain step with Hugging Face's checkpointing). The engine runs ``plan="keep"`` (it
moves nothing) with every layer chosen by hand; its first steps (measured, then watched) are
warm-up. Methods run interleaved, one step of each per round, timed in CPU time of the thread;
medians of forward, backward and the step. Each round's gradients of every method are
compared with plain training's, bit for bit (all seeded alike).

    .venv/bin/python benchmarks/lean_recompute_cpu.py \\
        --out benchmarks/results/lean-recompute-cpu-...

writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import warnings

import torch
import transformers

import cswap_lightning as cswap
from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.core.recompute import outermost, units

METHODS = {
    "plain": "plain training",
    "hf": "Hugging Face checkpointing (non-reentrant, its default)",
    "hf_reentrant": "Hugging Face checkpointing, use_reentrant=True",
    "cswap": "cswap, every layer recomputed, first run without autograd",
    "cswap_checkpoint": "cswap, every layer recomputed under checkpoint (lean off)",
}
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "vocab_size": 128, "max_position_embeddings": 64}
MODELS = {
    "bert": lambda layers: transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=layers, **SHAPE)),
    "llama": lambda layers: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, num_key_value_heads=2, attention_dropout=0.1, **SHAPE)),
    "gpt2": lambda layers: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=128, n_positions=64)),
}


def built(name: str, method: str, layers: int) -> tuple[torch.nn.Module, cswap.Offloader | None]:
    torch.manual_seed(0)
    model = MODELS[name](layers).train()
    if method.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": method == "hf_reentrant"})
    if not method.startswith("cswap"):
        return model, None
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="keep", profile_steps=1, budget=None))
    offloader.watch(model).recompute(outermost(units(model)))
    offloader.recomputer.verdicts.on = method == "cswap"
    return model, offloader


def run_model(name: str, methods: list[str], layers: int, rounds: int, warmup: int) -> dict:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {m: built(name, m, layers) for m in methods}
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    bitwise = dict.fromkeys(methods, True)
    for r in range(warmup + rounds):
        grads = {}
        for m in methods:
            model, offloader = runs[m]
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.manual_seed(r)
            begun = time.thread_time()
            with offloader if offloader is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            forward = time.thread_time() - begun
            begun = time.thread_time()
            loss.backward()
            backward = time.thread_time() - begun
            grads[m] = [p.grad for p in model.parameters()]
            if r >= warmup:
                times[m].append((forward, backward))
        for m in methods:
            bitwise[m] &= all(torch.equal(a, b) for a, b in zip(grads["plain"], grads[m],
                                                                 strict=True))
    rows = []
    for m in methods:
        forward = statistics.median(f for f, _ in times[m])
        backward = statistics.median(b for _, b in times[m])
        step = statistics.median(f + b for f, b in times[m])
        verdicts = runs[m][1].recomputer.verdicts.why if runs[m][1] is not None else {}
        rows.append({"model": name, "method": m, "forward_ms": forward * 1e3,
                     "backward_ms": backward * 1e3, "step_ms": step * 1e3,
                     "bitwise": bitwise[m],
                     "first_runs_without_autograd": sum(v == "" for v in verdicts.values())})
    plain = next(r["step_ms"] for r in rows if r["method"] == "plain")
    hf = next((r["step_ms"] for r in rows if r["method"] == "hf"), None)
    for row in rows:
        row["vs_plain"] = row["step_ms"] / plain
        row["throughput_vs_hf"] = hf / row["step_ms"] if hf else None
    for _, offloader in runs.values():
        if offloader is not None:
            offloader.close()
    return {"model": name, "layers": layers, "rows": rows}


def markdown(results: list[dict]) -> str:
    head = ("| model | method | forward (ms) | backward (ms) | step (ms) | vs plain | "
            "throughput vs HF checkpointing | gradients bitwise plain | layers run first "
            "without autograd |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for result in results:
        for r in result["rows"]:
            vs_hf = f"{r['throughput_vs_hf']:.2f}x" if r["throughput_vs_hf"] else ""
            lines.append(f"| {r['model']} ({result['layers']} layers) | {METHODS[r['method']]} | "
                         f"{r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['step_ms']:.2f} "
                         f"| {r['vs_plain']:.3f}x | {vs_hf} | "
                         f"{'yes' if r['bitwise'] else 'NO'} | "
                         f"{r['first_runs_without_autograd'] or ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--label", default="", help="a note on the code measured")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*")
    methods = ["plain", *(m for m in args.methods.split(",") if m != "plain")]
    results = []
    for name in args.models:
        results.append(run_model(name, methods, args.layers, args.rounds, args.warmup))
        print(markdown(results[-1:]), flush=True)
    meta = result_meta(torch.device("cpu"), kind="measurement, this CPU (host time)",
                       label=args.label, layers=args.layers, rounds=args.rounds,
                       warmup=args.warmup, transformers=transformers.__version__)
    write_results(args.out, "Host time with every layer recomputed: first run without autograd",
                  meta, {"results": results}, markdown(results))


if __name__ == "__main__":
    main()
