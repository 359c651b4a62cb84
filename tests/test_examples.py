"""The examples run as a user runs them (`python examples/NAME.py`) and train: their loss
falls, and cswap says what it saved and writes its summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, output_dir: Path, *args: str) -> str:
    """Its stdout and stderr, after it succeeded."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), "--output-dir", str(output_dir), *args],
        cwd=output_dir.parent, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def said_saving(output: str) -> re.Match:
    """cswap's closing line: the measured peak, as a percentage of keeping everything."""
    line = re.search(r"cswap: global step \d+.*\n(  .*\n)*  saved tensors resident at once: "
                     r".* at the peak \(measured\), (\d+)% of the .* that keeping them all "
                     r"holds", output)
    assert line, output[-3000:]
    return line


@pytest.mark.slow
def test_the_lightning_example_trains_and_lowers_the_peak(tmp_path):
    output = run_example("lightning_fit.py", tmp_path / "run", "--epochs", "2")
    before, after = map(float, re.search(r"loss on the training data: ([\d.]+) before, "
                                         r"([\d.]+) after", output).groups())
    assert after < 0.5 * before
    assert int(said_saving(output)[2]) < 80  # moving lowered the measured peak
    assert len(list((tmp_path / "run").rglob("cswap_summary.txt"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tuning", ["--lora", "--qlora"])
def test_the_hugging_face_example_fine_tunes_lora_adapters(tmp_path, tuning):
    output = run_example("hf_trainer.py", tmp_path / "run", "--steps", "10", tuning)
    first, last = map(float, re.search(r"loss: first logged ([\d.]+), last ([\d.]+)",
                                       output).groups())
    assert last < first
    assert "trainable params" in output  # peft's adapters, not the whole model
    assert int(said_saving(output)[2]) < 80
    assert (tmp_path / "run" / "cswap_summary.txt").is_file()
