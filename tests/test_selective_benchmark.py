"""The benchmark of recomputation below the layer (``benchmarks/selective.py``) runs on the
CPU at a tiny size and writes what the GPU check reads: each way's ledger peak, its gradients
against plain training's (all bitwise here), and what a layer keeps each way."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

pytest.importorskip("transformers")


@pytest.mark.slow
def test_each_way_is_measured_and_bitwise_with_plain_training(tmp_path, monkeypatch):
    script = load_benchmark("selective", monkeypatch)
    assert script.main(["--layers", "1", "--seq", "16", "--repeats", "1", "--profile",
                        "--narrow", "8", "--out", str(tmp_path / "s")]) == 0
    for kind in ("profile", "host"):  # torch.profiler's table, cProfile's
        assert len(list((tmp_path / "s-profiles").glob(f"{kind}-*.txt"))) == 6
    data = json.loads((tmp_path / "s.json").read_text())
    ways = data["ways"]
    assert list(ways) == ["plain", "below the layer", "below the layer, weight 0.35", "whole",
                          "below the layer, under checkpoint", "whole, under checkpoint"]
    assert all(w["bitwise_with_plain"] and w["allocator_peak_bytes"] is None
               for w in ways.values())
    assert all(0 < w["forward_host_s"] <= w["forward_s"] and w["backward_s"] > 0
               for w in ways.values())
    plain, fewest, heavier, whole, below_under, whole_under = (
        w["peak_resident_bytes"] for w in ways.values())
    assert plain > heavier > fewest > whole == whole_under
    assert plain > below_under > whole
    text = (tmp_path / "s.md").read_text()
    assert "| gradients bitwise |" in text and "NO" not in text
    assert "| forward: host, to its end | backward |" in text


def test_a_narrowing_that_does_not_divide_the_layer_is_refused_with_the_ones_that_do(monkeypatch):
    script = load_benchmark("selective", monkeypatch)
    with pytest.raises(ValueError, match="--narrow 3 does not divide hidden_size.*1, 2, 4 or 8"):
        script.llama(1, 3)
