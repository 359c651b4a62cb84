"""The script that predicts what host memory buys (``benchmarks/host_budget.py``) runs, labels
what it writes predictions, and every plan holds no more on the host than its host budget
(``--quick``: four layers at a short sequence)."""

from __future__ import annotations

import pytest
from conftest import quick_predictions

pytest.importorskip("transformers")


@pytest.mark.slow
def test_each_plan_holds_at_most_its_host_budget(tmp_path, monkeypatch):
    script, data = quick_predictions("host_budget", monkeypatch, tmp_path / "h")
    rows = data["rows"]
    assert len(rows) == 2 * 2 * len(script.HOSTS_GIB)  # two sequences, two budgets each
    for r in rows:
        if r["host_budget_gib"] is not None:
            assert r["host_gib"] <= r["host_budget_gib"]
    unbounded = [r for r in rows if r["host_budget_gib"] is None and r["fits"]]
    assert any(r["host_gib"] > 0 for r in unbounded)  # the bound can bite
    assert all(r["host_gib"] == 0 for r in rows if r["host_budget_gib"] == 0)
    assert "- kind: prediction" in (tmp_path / "h.md").read_text()
