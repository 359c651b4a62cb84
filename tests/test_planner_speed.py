"""`benchmarks/planner_speed.py` runs and writes what it measured: each planning call made
again with and without skipping what cannot win, the same mix both ways."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

pytest.importorskip("peft")


def test_the_planner_speed_benchmark_times_both_searches(tmp_path, monkeypatch):
    script = load_benchmark("planner_speed", monkeypatch)
    assert script.main(["--quick", "--out", str(tmp_path / "speed")]) == 0
    cases = json.loads((tmp_path / "speed.json").read_text())["cases"]
    assert len(cases) == 2 and all(case["calls"] for case in cases)
    for call in (c for case in cases for c in case["calls"]):
        assert call["replays"] <= call["replays_searching_everything"]
    assert "- kind: measurement" in (tmp_path / "speed.md").read_text()
