"""A captured profile times each leaf module and the gaps between them, and the workload puts
the gaps' time where the functions that ran in them saved their tensors."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cswap_lightning.planning.capture import capture
from cswap_lightning.planning.replay import (
    KEEP,
    BlockDecision,
    Engine,
    Link,
    Mix,
    checkpoint_all,
    predict,
)
from cswap_lightning.planning.workload import from_profile


class Mixer(nn.Module):
    """Two leaves with functions between them (a tanh and a product, each saving tensors)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h) * h)


def _captured(net: nn.Module, x: torch.Tensor) -> dict:
    return capture(net, lambda: net(x).square().mean(), "mixer-b8", warmup=1, steps=1,
                   log=lambda _: None)


def test_function_saves_name_the_leaf_they_follow_and_the_gaps_fill_each_pass():
    torch.manual_seed(0)
    net = nn.Sequential(Mixer(), Mixer())
    profile = _captured(net, torch.randn(8, 16))
    functions = [r for r in profile["saved"] if not r["module"]]
    # tanh and the product after each block's first leaf; the loss's square after the last
    assert {r["after"] for r in functions} == {"0.a", "1.a", "1.b"}
    assert all("after" not in r for r in profile["saved"] if r["module"])
    modules = profile["modules"]
    assert all(m["forward_after_ms"] >= 0 and m["backward_after_ms"] >= 0 for m in modules)
    # no leaf inside another: the leaves and the gaps between them tile each pass
    for way in ("forward", "backward"):
        tiled = profile[f"{way}_lead_ms"] + sum(m[f"{way}_ms"] + m[f"{way}_after_ms"]
                                                for m in modules)
        assert tiled == pytest.approx(profile[f"{way}_ms"], rel=1e-9)
    assert profile["head_start_ms"] == 0.0  # the CPU's clock is the host's
    assert profile["host_forward_ms"] > 0 and profile["plain_host_forward_ms"] > 0
    # each leaf's host time brackets its marks (the same clock on the CPU), and the host's
    # times of the leaves and of the gaps tile the host's forward
    assert all(m["forward_host_ms"] >= m["forward_ms"] > 0 for m in modules)
    tiled = profile["forward_lead_host_ms"] + sum(m["forward_host_ms"] + m["forward_after_host_ms"]
                                                  for m in modules)
    assert tiled == pytest.approx(profile["host_forward_ms"], rel=1e-9)
    # on the CPU the device's clock is the host's: the replay adds no host clock
    assert all(op.host_s == 0.0 for op in from_profile(profile).ops)


def _row(i: int, module: str, after: str | None = None) -> dict:
    row = {"i": i, "module": module, "shape": [256], "dtype": "float32", "nbytes": 1024,
           "storage_nbytes": 1024, "parameter": False, "allocated": 1024 * (i + 1),
           "first_of_storage": True}
    return row if after is None else row | {"after": after}


def _profile(gaps: bool) -> dict:
    """Leaf a (1 ms), a function saving twice after it, leaf b (1 ms), the loss after it;
    with ``gaps``, the functions' time as ``capture`` measures it: 6 ms after a, 2 after b."""
    after = (lambda leaf: leaf) if gaps else (lambda leaf: None)
    modules = [{"module": name, "forward_ms": 1.0, "backward_ms": 2.0, "calls": 1,
                "backward_allocated": []} for name in ("a", "b")]
    if gaps:
        modules[0] |= {"forward_after_ms": 6.0, "backward_after_ms": 12.0}
        modules[1] |= {"forward_after_ms": 2.0, "backward_after_ms": 4.0}
    return {"name": "synthetic-b1", "plain_forward_ms": 10.0, "plain_backward_ms": 20.0,
            "allocated_before_step": 0, "peak_allocated": 1 << 20,
            "saved": [_row(0, "a"), _row(1, "", after("a")), _row(2, "", after("a")),
                      _row(3, "b"), _row(4, "", after("b"))],
            "modules": modules}


def test_the_gaps_time_goes_to_the_functions_saved_in_them():
    ops = from_profile(_profile(gaps=True)).ops
    assert [op.module for op in ops] == ["a", "", "b", ""]
    assert [round(1e3 * op.forward_s, 9) for op in ops] == [1.0, 6.0, 1.0, 2.0]  # sums to 10
    assert [round(1e3 * op.backward_s, 9) for op in ops] == [2.0, 12.0, 2.0, 4.0]


def test_a_profile_without_gaps_spreads_the_plain_step_over_its_modules_as_before():
    ops = from_profile(_profile(gaps=False)).ops
    assert [round(1e3 * op.forward_s, 9) for op in ops] == [5.0, 0.0, 5.0, 0.0]
    assert [round(1e3 * op.backward_s, 9) for op in ops] == [10.0, 0.0, 10.0, 0.0]


class SlowHost(nn.Linear):
    """A layer whose host work takes 3 ms before its kernel is queued: what the capture's own
    hooks do to small kernels, exaggerated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)
        return super().forward(x)


@pytest.mark.gpu
def test_on_cuda_a_leaf_is_timed_by_its_kernels_not_by_a_slower_host():
    torch.manual_seed(0)
    net = nn.Sequential(*(SlowHost(1024, 1024) for _ in range(6))).cuda()
    x = torch.randn(2048, 1024, device="cuda")
    profile = _captured(net, x)
    assert profile["head_start_ms"] > 0
    # each layer's kernel (4 GFLOP) takes well under a millisecond; its host, 3 ms
    assert max(m["forward_ms"] for m in profile["modules"]) < 1.5
    # the plain step waited for the host: the modules' share of it is what was measured
    assert profile["plain_forward_ms"] > 6 * 3.0


# -- the host's clock, where a profile timed the host -----------------------------------------
MiB = 1 << 20


def _layers(device_ms: float, host_ms: float | None, layers: int = 3) -> dict:
    """``layers`` layers of one leaf each, saving 4 MiB, each taking ``device_ms`` on the
    device and ``host_ms`` on the host to issue (None: a profile that did not time the host);
    the plain forward as those give it."""
    modules = [{"module": f"h.{i}.fc", "forward_ms": device_ms, "backward_ms": 2 * device_ms,
                "calls": 1, "backward_allocated": []} for i in range(layers)]
    rows = [{"i": i, "module": f"h.{i}.fc", "shape": [MiB], "dtype": "float32",
             "nbytes": 4 * MiB, "storage_nbytes": 4 * MiB, "parameter": False,
             "allocated": 4 * MiB * (i + 1), "first_of_storage": True} for i in range(layers)]
    profile = {"name": "layers-b1", "plain_backward_ms": 2 * device_ms * layers,
               "allocated_before_step": 0, "peak_allocated": 64 * MiB, "saved": rows,
               "modules": modules,
               "plain_forward_ms": layers * max(device_ms, host_ms or 0.0)}
    if host_ms is not None:
        for m in modules:
            m["forward_host_ms"] = host_ms
        profile["plain_host_forward_ms"] = layers * host_ms
    return profile


@pytest.mark.parametrize(("device_ms", "host_ms"), [(1.0, 3.0), (3.0, 1.0)])
def test_a_forward_takes_the_longer_of_the_devices_work_and_the_hosts(device_ms, host_ms):
    w = from_profile(_layers(device_ms, host_ms))
    assert [round(1e3 * op.host_s, 9) for op in w.ops] == [host_ms] * 3
    assert [round(1e3 * op.forward_s, 9) for op in w.ops] == [device_ms] * 3  # not scaled up
    forward = predict(w).forward_s
    assert 1e3 * forward == pytest.approx(3 * max(device_ms, host_ms))


def test_without_the_host_timed_the_device_times_hold_what_it_waited():
    w = from_profile(_layers(1.0, None))
    assert all(op.host_s == 0.0 for op in w.ops)
    assert 1e3 * predict(w).forward_s == pytest.approx(3.0)


@pytest.mark.parametrize(("device_ms", "host_ms", "slower_ms"), [(1.0, 3.0, 2 * 0.5),
                                                                   (3.0, 1.0, 0.0)])
def test_moving_tensors_costs_their_host_time_where_the_host_sets_the_pace(device_ms, host_ms,
                                                                          slower_ms):
    """1 ms of host time per moved tensor (half at the copy out, half at the unpack): in a
    forward the host sets the pace of, each copy out delays the next layer by 0.5 ms (the
    last one's comes after forward's last kernel); in one the device sets the pace of, the
    host has the time."""
    w = from_profile(_layers(device_ms, host_ms))
    engine, link = Engine(host_s_per_move=1e-3), Link(1e15, 1e15, 1e15)  # copies take no time
    swap_all = Mix(KEEP, {b.name: BlockDecision("swap") for b in w.blocks})
    kept, moved = predict(w, engine=engine, link=link), predict(w, swap_all, link, engine)
    assert moved.d2h_bytes == 3 * 4 * MiB
    assert 1e3 * (moved.forward_s - kept.forward_s) == pytest.approx(slower_ms)


@pytest.mark.parametrize(("device_ms", "host_ms"), [(1.0, 3.0), (3.0, 1.0), (1.0, None)])
def test_recomputing_a_block_costs_the_longer_of_its_kernels_and_its_hosts(device_ms, host_ms):
    w = from_profile(_layers(device_ms, host_ms))
    recomputed = predict(w, checkpoint_all())
    assert 1e3 * recomputed.recompute_s == pytest.approx(3 * max(device_ms, host_ms or 0.0))
