"""What `Offloader.watch(model)` costs a forward pass outside the engine (evaluation, say).

    .venv/bin/python benchmarks/watch_overhead_cpu.py benchmarks/results/watch-overhead-cpu-DATE

Its global module hooks take every module call in the process off PyTorch's fast path. A small
BERT (4 layers, hidden 64, batch 2 x 16 tokens: 82 module calls a forward) under
no_grad, timed unwatched and watched, interleaved five times; the ratio of the medians.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import BertConfig, BertForSequenceClassification

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.commands.bench_step import result_meta, write_results


def seconds_per_forward(model: torch.nn.Module, x: torch.Tensor, n: int = 300) -> float:
    with torch.no_grad():
        for _ in range(20):
            model(x)
        start = time.perf_counter()
        for _ in range(n):
            model(x)
    return (time.perf_counter() - start) / n


def main(out: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=32)
    model = BertForSequenceClassification(config).eval()
    x = torch.randint(0, 100, (2, 16))
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append(m))
    model(x)
    hook.remove()
    unwatched, watched = [], []
    for _ in range(5):
        unwatched.append(seconds_per_forward(model, x))
        offloader = Offloader(CSwapConfig(lossy_exclude=("classifier",))).watch(model)
        watched.append(seconds_per_forward(model, x))
        offloader.close()
    a, b = statistics.median(unwatched), statistics.median(watched)
    table = ("| forward outside the engine | median time | ratio |\n|---|---:|---:|\n"
             f"| unwatched | {a * 1e3:.3f} ms | 1.00x |\n"
             f"| watched | {b * 1e3:.3f} ms | {b / a:.2f}x |\n\n"
             f"{len(calls)} module calls per forward: {(b - a) / len(calls) * 1e6:.1f} us each.")
    print(table)
    meta = result_meta(torch.device("cpu"), command=" ".join(["python", *sys.argv]))
    write_results(out, "Offloader.watch overhead", meta,
                  {"unwatched_s": unwatched, "watched_s": watched, "module_calls": len(calls)},
                  table)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "watch-overhead")
