"""`cswap bench overhead` runs every method and writes its result files (no timing asserted)."""

import json

import pytest
import torch

from cswap_lightning.commands.bench_overhead import run_overhead_bench


@pytest.mark.slow
def test_the_overhead_bench_reports_every_method_against_no_engine(tmp_path, capsys):
    rows = run_overhead_bench(tensors=50, rounds=1, out=str(tmp_path / "overhead"),
                              steady_steps=2)
    progress = capsys.readouterr().err.splitlines()  # each round is said as it ends
    assert [line.split(" (")[0] for line in progress[-3:]] == [
        "cswap bench overhead: interleaved round 1/1",
        "cswap bench overhead: steady-state round 1/1",
        "cswap bench overhead: one step of cswap plan=raw under cProfile"]
    methods = [r["method"] for r in rows]
    assert methods == ["no engine", "torch save_on_cpu", "copy in a pack hook",
                       "cswap default, run fits", "cswap budget 50% of keep",
                       "cswap plan=keep", "cswap plan=raw"]
    assert rows[0]["cpu_ratio"] == 1.0 and rows[0]["us_per_tensor"] == 0.0
    assert all(r["step_cpu_s"] > 0 and r["steady_step_cpu_s"] > 0 for r in rows)
    assert rows[0]["steady_us_per_tensor"] == 0.0
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert saved["default_hooks_off"]  # the default's plan moves nothing: no hooks
    assert saved["budget_moved_tensors"] > 0 and saved["budget_counted_tensors"] > 0
    assert saved["budget_moved_tensors"] + saved["budget_counted_tensors"] == 50
    assert saved["moved_bytes"] == 49 * 16384  # every tensor the chain saved but its leaf input
    report = (tmp_path / "overhead.md").read_text()
    assert "host time per saved tensor" in report and "collections included" in report
    # where plan=raw's time goes: the engine's own hooks among the functions ranked, each
    # called once per saved tensor
    ranked = {r["function"].rsplit(" ", 1)[-1]: r for r in saved["raw_profile"]}
    assert {"pack", "unpack"} <= set(ranked), sorted(ranked)
    assert ranked["pack"]["calls_per_tensor"] == ranked["unpack"]["calls_per_tensor"] == 1.0
    assert "Where plan=raw's host time goes" in report


@pytest.mark.gpu
def test_the_overhead_bench_runs_on_a_gpu(tmp_path):
    """--device cuda: the same rows, the chain on the GPU, the copy hook through pinned memory."""
    rows = run_overhead_bench(tensors=50, rounds=1, out=str(tmp_path / "overhead"),
                              steady_steps=2, device="cuda")
    assert [r["method"] for r in rows][-1] == "cswap plan=raw"
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert saved["meta"]["device"] == torch.cuda.get_device_name()
    assert saved["moved_bytes"] == 49 * 16384
