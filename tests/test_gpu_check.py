"""`benchmarks/gpu_check.sh`'s dry run, on any machine: the steps of the one device call, in
order, each with its time limit, and ONLY choosing some (device time is too scarce to find a
broken script on the device)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
STEPS = ["environment", "build-ext", "kernels", "tests", "finetune", "measure", "measure-llama",
         "codec", "selective", "overhead", "exit-codes", "pytest-gpu", "measure-more",
         "finetune-qlora"]


def dry_run(tmp_path: Path, **env: str) -> list[tuple[str, int]]:
    out = subprocess.run(["bash", str(SCRIPT)], check=False, capture_output=True, text=True,
                         timeout=120, env=os.environ | {"DRY": "1", "OUT": str(tmp_path)} | env)
    assert out.returncode == 0, out.stderr
    return [(m[1], int(m[2])) for m in re.finditer(r"^== (\S+) \(limit (\d+)s\)", out.stdout,
                                                   flags=re.MULTILINE)]


def test_the_dry_run_lists_every_step_in_order_within_the_calls_budget(tmp_path):
    steps = [(name, limit) for name, limit in dry_run(tmp_path) if name != "install-wheels"]
    assert [name for name, _ in steps] == STEPS
    assert all(0 < limit <= 300 for _, limit in steps)


def test_only_runs_the_steps_it_names(tmp_path):
    steps = dry_run(tmp_path, ONLY="tests finetune", BUDGET_S="440")
    assert [name for name, _ in steps] == ["tests", "finetune"]
