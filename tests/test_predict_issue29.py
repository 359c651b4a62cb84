"""The script that predicts issue 29's goals (``benchmarks/predict_issue29.py``) runs and
labels what it writes predictions, each goal with its figure and met or not (``--quick``: two
layers at a short sequence, not the goals' shapes)."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_goals_are_predicted_labelled_and_judged(tmp_path, monkeypatch):
    script = load_benchmark("predict_issue29", monkeypatch)
    assert script.main(["--quick", "--out", str(tmp_path / "p")]) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["meta"]["kind"].startswith("prediction")
    cases = data["cases"]
    assert list(cases) == ["Llama-3-8B LoRA", "Llama-3-8B full fine-tuning", "GPT-2 medium"]
    for case in cases.values():
        budgets = {(r["budget"], r["codec"]) for r in case["rows"]}
        assert ("checkpointing's peak", "lossless") in budgets
        layer = case["layer"]
        assert layer["whole_kept_kib_per_token"] < layer["below_kept_kib_per_token"] < layer[
            "saved_kib_per_token"]
        if "lower_within_3_percent" in case:  # no planned row frees more within 3%
            assert all(case["lower_within_3_percent"]["fraction"] >= r["saved_lower"]
                       for r in case["rows"] if r["codec"] == "lossless"
                       and r["vs_keep"] <= script.SLOWER)
    goals = script.goals(cases)
    assert len(goals) == 7 and all(isinstance(met, bool) for *_, met in goals)
    text = (tmp_path / "p.md").read_text()
    assert "- kind: prediction" in text and "| goal | predicted | met |" in text
    assert script.KERNELS["own stream"] in text


@pytest.mark.slow
def test_the_codecs_kernels_can_be_put_on_computes_clock(tmp_path, monkeypatch):
    script = load_benchmark("predict_issue29", monkeypatch)
    assert script.main(["--quick", "--codec-kernels", "compute", "--out", str(tmp_path / "p")]) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert {c["codec_kernels"] for c in data["cases"].values()} == {"compute"}
    assert script.KERNELS["compute"] in (tmp_path / "p.md").read_text()
