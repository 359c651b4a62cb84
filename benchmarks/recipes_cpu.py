"""Every recipe in recipes/ trained for a few steps at a CPU size, with what CSwap did.

    .venv/bin/python benchmarks/recipes_cpu.py > benchmarks/results/recipes-cpu-DATE.md

The CNN recipe runs as shipped; the GPU-sized ones are shrunk from the command line, the way
a user would try them on a laptop.
"""

from __future__ import annotations

import datetime
import platform
import sys
import tempfile
import time
from collections import Counter

import torch

from cswap_lightning.commands.fit import main as fit

SMALL_IMAGES = ["--model.width", "8", "--data.image_size", "32", "--data.num_samples", "256",
                "--data.batch_size", "32", "--trainer.max_steps", "8"]
SMALL_TOKENS = ["--model.vocab_size", "128", "--data.vocab_size", "128", "--model.hidden_size",
                "64", "--model.num_layers", "2", "--model.num_heads", "2", "--data.seq_len",
                "32", "--data.num_samples", "256", "--data.batch_size", "16",
                "--trainer.max_steps", "16", "--trainer.precision", "32-true"]
RECIPES = {
    "cnn": [],
    "vgg16": SMALL_IMAGES,
    "resnet50": SMALL_IMAGES,
    "bert": SMALL_TOKENS,
    "gpt2": SMALL_TOKENS,
}


def run(name: str, overrides: list[str], root: str) -> str:
    args = ["--config", f"recipes/{name}.yaml", *overrides,
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", root,
            "--trainer.strategy.init_args.config.min_bytes", "65536"]
    start = time.perf_counter()
    cli = fit(args)
    seconds = time.perf_counter() - start
    metrics = {k: round(float(v), 4) for k, v in sorted(cli.trainer.callback_metrics.items())
               if not k.startswith("cswap/")}
    step = cli.trainer.strategy.offloader.last_step()
    plan = cli.trainer.strategy.offloader.plan
    lines = [
        f"## {name}",
        "",
        (f"`cswap fit --config recipes/{name}.yaml {' '.join(overrides)}` (CPU, "
        f"{cli.trainer.global_step} steps, {seconds:.1f} s)"),
        "",
        f"- metrics: {metrics}",
        f"- last step: {step.table().splitlines()[-1]}",
        f"- sites by decision: {dict(Counter(s.decision for s in step.sites))}",
    ]
    if plan is not None:
        lines += ["", "```", plan.table(), "```"]
    return "\n".join(lines)


def main() -> None:
    print(f"# Recipes on the CPU\n\n- date: {datetime.date.today()}\n- torch: {torch.__version__}"
          f"\n- machine: {platform.machine()}, {torch.get_num_threads()} threads\n")
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in RECIPES.items():
            print(run(name, overrides, root), "\n", flush=True)


if __name__ == "__main__":
    sys.argv = sys.argv[:1]
    main()
