"""What a user can check on the CPU: the process's peak RSS beside the engine's summary.

    .venv/bin/python benchmarks/rss_cpu.py > benchmarks/results/rss-cpu-DATE.md

The README's GPT-2 (4 layers, hidden 256, batch 4 x 256 tokens), 8 steps, each configuration
in a process of its own (peak RSS is per process): no engine, the engine with
``budget="auto"`` (a run that fits: the plan moves nothing), with ``budget=None`` (every
tensor moved raw) and with a budget of 40% of the plain step's saved tensors (layers
recomputed). Step cost is the process's CPU time per step, less sensitive to the load of a
shared machine than wall time; the summary line is the engine's own, of its last tracked step.
"""

from __future__ import annotations

import datetime
import resource
import subprocess
import sys
import time

RUNS = {"no engine": "plain", 'budget="auto"': "auto", "budget=None": "none",
        "budget 40% of the saved tensors": "forty"}


def run(mode: str) -> str:
    """One configuration: a markdown row's cells, and the engine's RAM line."""
    import torch
    import transformers

    import cswap_lightning as cswap

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000,
                                     n_positions=256)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (4, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    budget = {"auto": "auto", "none": None, "forty": int(0.4 * 175 * 2**20)}.get(mode)
    off = None if mode == "plain" else cswap.Offloader(cswap.CSwapConfig(budget=budget))
    if off is not None:
        off.watch(model)
    costs = []
    for _ in range(8):
        start = time.process_time()
        if off is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with off:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del loss
        costs.append(time.process_time() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps = " ".join(f"{c:.2f}" for c in costs)
    ram = "-"
    if off is not None:
        summary = off.tracked_step().summary()
        ram = next((line for line in summary if line.startswith("on the CPU")), "-")
        off.close()
    return f"{rss:.0f} | {steps} | {ram}"


def main() -> None:
    if len(sys.argv) > 1:
        print(run(sys.argv[1]))
        return
    print(f"# Peak RSS on the CPU beside the engine's summary\n\n- date: {datetime.date.today()}"
          f"\n- command: `.venv/bin/python benchmarks/rss_cpu.py`\n\n"
          "| run | peak RSS MiB | CPU seconds per step, steps 1-8 | the summary's RAM line |\n"
          "|---|---|---|---|")
    for name, mode in RUNS.items():
        done = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True,
                              check=True)
        print(f"| {name} | {done.stdout.strip()} |")


if __name__ == "__main__":
    main()
