"""What putting Hugging Face's key-value cache back costs a recomputed layer
(``core/rerun.CacheStates``), this checkout against another commit's, in one process.

A model run with its cache on (``use_cache=True``: the configs' default; Hugging Face's Trainer
sets it from ``TrainingArguments.use_cache``, False in transformers 5.24, Lightning and plain
loops leave it) hands every layer the whole cache; each recomputed layer's first run saves the
state of all of it, and its recomputation puts that back and then the state after it. Two
figures, old and new code interleaved (the commit's ``rerun.CacheStates`` loaded from ``git
show``, swapped in where the engine reads it):

- per layer: one layer's handling (its first run's state, the state again, put back twice,
  the tensors the cache holds) on a Llama cache of 12, 32 and 80 layers, host microseconds;
- per step: a tiny Llama (hidden 32, sequence 16, batch 2) of ``--layers`` layers with every
  layer recomputed by the engine, first runs without autograd and under checkpoint, in CPU
  time of the thread; the gradients of the two compared bit for bit each round.

    .venv/bin/python benchmarks/cache_states_ab.py --base HEAD --out benchmarks/results/...

writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.core import recompute, rerun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_recompute_cpu import built  # the same models and engine set-up

ROOT = Path(__file__).resolve().parent.parent


def cache_states_at(rev: str) -> type:
    """``CacheStates`` as commit ``rev`` wrote it."""
    source = subprocess.run(["git", "-C", str(ROOT), "show",
                             f"{rev}:cswap_lightning/core/rerun.py"],
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "rerun_base.py")
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("cswap_lightning.core._rerun_base", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module.CacheStates


def llama(layers: int) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128)).train()


def per_layer(impls: dict[str, type], layers: int, rounds: int) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 16))
    cache = llama(layers)(ids, use_cache=True).past_key_values
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in (list(impls) if r % 2 else list(impls)[::-1]):
            states = impls[name]
            begun = time.perf_counter()
            first = states.of([cache])
            now = first.again()
            first.restore()
            now.restore()
            first.tensors()
            times[name].append(time.perf_counter() - begun)
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    return {"layers": layers, "base_us": us["base"], "this_us": us["this"],
            "ratio": us["this"] / us["base"]}


def per_step(impls: dict[str, type], method: str, layers: int, rounds: int,
             warmup: int) -> dict:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {name: built("llama", method, layers) for name in impls}
    times: dict[str, list[float]] = {name: [] for name in impls}
    bitwise = True
    for r in range(warmup + rounds):
        grads = {}
        for name in (list(impls) if r % 2 else list(impls)[::-1]):
            recompute.CacheStates = impls[name]
            model, offloader = runs[name]
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.manual_seed(r)
            begun = time.thread_time()
            with offloader:
                loss = model(input_ids=ids, labels=ids, use_cache=True).loss
            loss.backward()
            if r >= warmup:
                times[name].append(time.thread_time() - begun)
            grads[name] = [p.grad for p in model.parameters()]
        bitwise &= all(torch.equal(a, b) for a, b in zip(*grads.values(), strict=True))
    recompute.CacheStates = rerun.CacheStates
    for _, offloader in runs.values():
        offloader.close()
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"method": method, "layers": layers, "base_ms": ms["base"], "this_ms": ms["this"],
            "ratio": ms["this"] / ms["base"], "bitwise": bitwise}


METHODS = {"cswap": "every layer recomputed, first run without autograd",
           "cswap_checkpoint": "every layer recomputed under checkpoint"}


def markdown(base: str, layer_rows: list[dict], step_rows: list[dict]) -> str:
    lines = [f"| one recomputed layer's cache handling | {base} | this checkout | this / {base} |",
             "|---|---:|---:|---:|"]
    lines += [f"| Llama cache of {r['layers']} layers | {r['base_us']:.0f} us | "
              f"{r['this_us']:.0f} us | {r['ratio']:.2f}x |" for r in layer_rows]
    lines += ["", (f"| step, tiny Llama, cache on | {base} | this checkout | this / {base} "
                   "| gradients bitwise |"), "|---|---:|---:|---:|---|"]
    lines += [f"| {r['layers']} layers, {METHODS[r['method']]} | {r['base_ms']:.1f} ms | "
              f"{r['this_ms']:.1f} ms | {r['ratio']:.3f}x | "
              f"{'yes' if r['bitwise'] else 'NO'} |" for r in step_rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--layers", type=int, default=32, help="the step's model's layers")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*")
    impls = {"base": cache_states_at(args.base), "this": rerun.CacheStates}
    layer_rows = [per_layer(impls, layers, 10 * args.rounds) for layers in (12, 32, 80)]
    step_rows = []
    for method, what in METHODS.items():
        print(f"cache_states_ab: steps, {what}", file=sys.stderr, flush=True)
        step_rows.append(per_step(impls, method, args.layers, args.rounds, args.warmup))
    print(markdown(args.base, layer_rows, step_rows))
    meta = result_meta(torch.device("cpu"), kind="measurement, this CPU (host time)",
                       base=args.base, layers=args.layers, rounds=args.rounds,
                       warmup=args.warmup, transformers=transformers.__version__)
    write_results(args.out, "Putting the key-value cache back for a recomputed layer",
                  meta, {"per_layer": layer_rows, "per_step": step_rows},
                  markdown(args.base, layer_rows, step_rows))


if __name__ == "__main__":
    main()
