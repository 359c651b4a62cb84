"""The host-side shortcuts of recomputation below the layer (``planning/ops.py``) find what
pytree and flop_counter's formulas find; and the benchmark of its host time per operator
(``benchmarks/below_host.py``) runs on the CPU and writes every method's row, the engine's
first runs without autograd measured once they are settled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark
from torch.utils._pytree import tree_flatten

from cswap_lightning.planning import ops

aten = torch.ops.aten


def test_leaves_and_arguments_are_what_pytree_finds():
    t, u = torch.ones(2), torch.zeros(3)
    args = (t, [u, None, 2], (1.5, [t]), "x")
    kwargs = {"out": u, "dims": [0, 1]}
    flat = tree_flatten((args, kwargs))[0]
    assert ops.leaves((args, kwargs)) == flat
    assert [id(v) for v in ops.arguments(args, kwargs)] == [
        id(v) for v in flat if isinstance(v, torch.Tensor)]
    assert ops.arguments((t,), {}) == [t] and ops.tensors(u) == [u]


def test_work_per_byte_is_remembered_by_shape_and_dtype():
    def cost(k: int, dtype: torch.dtype) -> float:
        a, b = torch.ones(4, k, dtype=dtype), torch.ones(k, 16, dtype=dtype)
        return ops.work_per_byte(aten.mm.default, (a, b), {}, a @ b)

    ops._COSTS.clear()
    first = [cost(8, torch.float32), cost(64, torch.float32), cost(8, torch.bfloat16)]
    assert first == [2 * 8 / 4, 2 * 64 / 4, 2 * 8 / 2]  # 2k flops per output element
    assert [cost(8, torch.float32), cost(64, torch.float32), cost(8, torch.bfloat16)] == first
    assert len(ops._COSTS) == 3


def test_the_benchmark_measures_every_method_bitwise(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    script = load_benchmark("below_host", monkeypatch)
    script.main(["--layers", "2", "--rounds", "2", "--warmup", "2", "--out",
                 str(tmp_path / "b")])
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["method"] for r in rows] == list(script.METHODS)
    assert all(r["bitwise"] and r["forward_ops"] > 0 and r["backward_ops"] > 0 for r in rows)
    # watched, settled, then measured without autograd: below the layer and whole
    assert [r["layers_without_autograd"] for r in rows if r["method"].startswith("lean")] == [
        2, 2]
    sac = next(r for r in rows if r["method"] == "sac")
    assert sac["forward_us_per_op_vs_sac"] == 1.0
    assert "| below |" in (tmp_path / "b.md").read_text()


def test_the_readmes_figures_are_the_committed_measurement():
    root = Path(__file__).resolve().parents[1]
    rows = {r["method"]: r for r in json.loads(
        (root / "benchmarks/results/below-host-cpu-2026-11-27-lean.json").read_text())["rows"]}
    assert all(r["bitwise"] for r in rows.values())
    assert rows["lean"]["layers_without_autograd"] == 4

    def ms(method: str, phase: str) -> str:
        return f"{rows[method][f'{phase}_us'] / 1e3:.1f}"

    def step(method: str) -> float:
        return rows[method]["forward_us"] + rows[method]["backward_us"]

    forward = rows["lean"]["forward_us"] / rows["below"]["forward_us"]
    readme = " ".join((root / "README.md").read_text().split())
    assert (f"the forward took {ms('lean', 'forward')} ms against {ms('below', 'forward')} "
            f"under checkpoint ({forward:.2f}x) and {ms('sac', 'forward')} with torch's "
            f"selective checkpointing, as little as a dispatch mode that does nothing under "
            f"checkpoint; backward {ms('lean', 'backward')} against {ms('below', 'backward')} "
            f"and {ms('sac', 'backward')}; the step's host time "
            f"{step('lean') / step('below'):.2f}x what it was and "
            f"{step('lean') / step('sac'):.2f}x selective checkpointing's") in readme
    assert rows["lean"]["forward_us"] <= 1.05 * rows["floor"]["forward_us"]  # "as little as"
