"""The planned host arena against its lower bound and per-tensor pinned allocation.

    .venv/bin/python benchmarks/arena_cpu.py > benchmarks/results/arena-cpu-DATE.md

The demo's CNN (digits-sized batch) and the step benchmark's transformer, four steps each
with the raw and the zvc plan; the figures are the engine's own arena report of the last
closed step. Compressed payloads get the arena's 6% headroom for sparsity drift.
"""

from __future__ import annotations

import datetime
import time

import torch
from torch.nn import functional as F

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.commands.bench_step import build_model
from cswap_lightning.recipes.nets import build_cnn


def demo_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    return build_cnn(32), torch.rand(128, 1, 8, 8), torch.randint(0, 10, (128,))


def main() -> None:
    torch.set_num_threads(1)  # the engine's worker threads get the other core
    print(f"# Host arena on the CPU\n\n- date: {datetime.date.today()}\n- torch: "
          f"{torch.__version__}\n\n| model | plan | arena report of the last closed step |\n"
          "|---|---|---|")
    for name in ("demo", "transformer"):
        for plan in ("raw", "zvc"):
            torch.manual_seed(0)
            net, x, y = demo_model() if name == "demo" else build_model(name, torch.device("cpu"),
                                                                       None)
            offloader = Offloader(CSwapConfig(plan=plan, min_bytes=64 * 1024))
            for _ in range(4):
                with offloader:
                    loss = F.cross_entropy(net(x), y)
                loss.backward()
            time.sleep(0.3)  # the last step's accounting runs in a thread of its own
            print(f"| {name} | {plan} | {offloader.transfer.arena_report()} |")
            offloader.close()


if __name__ == "__main__":
    main()
