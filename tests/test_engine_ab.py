"""`benchmarks/engine_ab.py` runs this checkout's engine and another commit's side by side in
one process: here against this checkout's own commit (the working tree may differ)."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_engine_ab_runs_both_packages_on_every_configuration(tmp_path, monkeypatch):
    script = load_benchmark("engine_ab", monkeypatch)
    script.main(["--base", "HEAD", "--tensors", "30", "--rounds", "3",
                 "--out", str(tmp_path / "ab")])
    result = json.loads((tmp_path / "ab.json").read_text())
    assert [row["configuration"] for row in result["rows"]] == list(script.CONFIGURATIONS)
    for row in result["rows"]:
        assert row["ratio"] == row["this"] / row["base"]
    raw = result["rows"][0]  # moving every tensor costs about twice the op that saved it
    assert raw["base"] > 0 and raw["this"] > 0
    base = script.sys.modules["cswap_base"]
    assert base.Offloader is not script.cswap_lightning.Offloader  # two packages ran
    page = (tmp_path / "ab.md").read_text()
    assert "- kind: measurement" in page and f"- base: {result['meta']['base']}" in page
