"""`benchmarks/plan_ab.py` runs `cswap plan` from this checkout and another in turn: here
against this checkout's own commit, so both sides print the same figures."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark
from test_plan_cli import TINY

pytest.importorskip("transformers")


@pytest.mark.slow
def test_plan_ab_times_both_checkouts_and_compares_their_output(config_file, tmp_path,
                                                                monkeypatch):
    script = load_benchmark("plan_ab", monkeypatch)
    config = config_file("tiny-qwen2", TINY)
    script.main(["--base", "HEAD", "--runs", "2", "--out", str(tmp_path / "ab"), "--",
                 config, "--seq", "256", "--no-search"])
    result = json.loads((tmp_path / "ab.json").read_text())
    assert result["same"] is True and result["meta"]["base"] == "HEAD"
    assert [len(result["seconds"][side]) for side in "AB"] == [2, 2]
    assert all(s > 0 for side in "AB" for s in result["seconds"][side])
    page = (tmp_path / "ab.md").read_text()
    assert "the same, every run" in page and "- kind: measurement" in page
