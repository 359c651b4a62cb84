"""The engine with lossy codecs: what a view is compressed on, the rounding seeds, the
exclusion of modules, and the guard's probe steps beside the plan."""

import pytest
import torch
from conftest import grads, model_and_batch
from torch import nn

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.codecs import get_codec, reconstruction_error
from cswap_lightning.planning.predictor import CodecTimeModel, KernelRun
from cswap_lightning.planning.profiler import Link


class SplitProjection(nn.Module):
    """q, k and v split from one projection; k's part of the weight ``k_scale`` times larger."""

    def __init__(self, k_scale: float = 1e4) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)
        with torch.no_grad():
            self.qkv.weight[64:128] *= k_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(64, dim=-1)
        return q.sin().sum() + k.sin().sum() + v.sin().sum()  # each sin saves its view


def test_a_view_is_compressed_on_its_own_elements():
    torch.manual_seed(0)
    net, x = SplitProjection(), torch.randn(32, 64)
    q = net.qkv(x).split(64, dim=-1)[0].detach()
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))
    with off.probe_next_step("measure errors"), off:
        loss = net(x)
    loss.backward()
    x_site, *views = [s for s in off.last_step().sites if s.error is not None]
    assert x_site.site == 0 and len(views) == 3  # none shares another's entry
    assert {s.decision for s in views} == {"int8"} and {s.shape for s in views} == {(32, 64)}
    assert all(s.nbytes == 32 * 64 * 4 for s in views)  # its own bytes, not the storage's
    # Over the storage, the scale of k's blocks would swamp q's: about 1.7 then, 0.01 now.
    alone = reconstruction_error(get_codec("int8"), q).item()
    assert views[0].error < 2 * alone < 0.05
    assert max(s.error for s in views) < 0.05
    off.close()


def test_a_view_comes_back_in_its_shape_and_gradients_stay_close():
    torch.manual_seed(0)
    net, x = SplitProjection(k_scale=1.0), torch.randn(32, 64)
    plain = torch.autograd.grad(net(x), list(net.parameters()))
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))
    with off:
        loss = net(x)
    lossy = torch.autograd.grad(loss, list(net.parameters()))
    for g, h in zip(plain, lossy):
        assert h.shape == g.shape and (h - g).norm() <= 0.05 * g.norm()
    off.close()


def int8_gradients(steps: int = 3, **config) -> list[torch.Tensor]:
    """The gradients of a few int8 steps of the same MLP and batch, from torch's seed 0."""
    net, x, y = model_and_batch("mlp")
    torch.manual_seed(0)
    off = Offloader(CSwapConfig(min_bytes=0, **config))
    out = [g for _ in range(steps) for g in grads(net, x, y, off)]
    off.close()
    return out


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_two_runs_in_one_process_round_alike(codec):
    first = int8_gradients(plan=codec)
    get_codec(codec).encode(torch.randn(1000))  # whatever ran between them
    Offloader(CSwapConfig(plan=codec, min_bytes=0))  # another session, never used
    second = int8_gradients(plan=codec)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_rounding_follows_torch_seed_and_changes_each_step():
    net, x, y = model_and_batch("mlp")
    seeds = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        seeds.append(Offloader(CSwapConfig(plan="int8")).lossy.seed)
    assert seeds[0] == seeds[1] != seeds[2]
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))
    first, second = grads(net, x, y, off), grads(net, x, y, off)  # same batch, next step
    assert not all(torch.equal(a, b) for a, b in zip(first, second))
    off.close()


def test_a_probe_rounds_as_the_training_step_after_it():
    """So the guard measures the rounding training will use, and a run with checks that
    revert nothing trains exactly as one without them."""
    checked = int8_gradients(plan="int8")
    net, x, y = model_and_batch("mlp")
    torch.manual_seed(0)
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))
    with_probes = []
    for _ in range(3):
        for kind in ("lossless", "measure errors"):
            grads(net, x, y, off.probe_next_step(kind))
        with_probes += grads(net, x, y, off)
    assert all(torch.equal(a, b) for a, b in zip(checked, with_probes, strict=True))
    off.close()


def test_lossy_exclude_without_a_watched_model_refuses_the_first_step():
    net, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0, lossy_exclude=("1",)))
    with pytest.raises(ValueError, match=r"lossy_exclude=\('1',\) names modules.*"
                                         r"offloader\.watch\(model\)"), off:
        pass
    off.watch(net)
    grads(net, x, y, off)
    decisions = {s.module: s.decision for s in off.last_step().sites if s.reason == ""}
    assert decisions["1"] == "raw" and decisions["3"] == "int8"  # the two ReLUs' outputs
    off.close()
    # Without a lossy codec the patterns mean nothing: no model is needed.
    lossless = Offloader(CSwapConfig(plan="raw", min_bytes=0, lossy_exclude=("1",)))
    grads(net, x, y, lossless)
    lossless.close()


def test_a_probe_step_never_checks_the_plan():
    """A lossless probe on the first step of a new plan must not become the step whose moves
    later steps repeat: they would swap the plan's lossy sites raw from then on."""
    torch.manual_seed(0)  # GELU's input is dense: int8 pays on this slow link, at these speeds
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    runs = [KernelRun(codec, direction, n, 0.0, 1e-6) for codec in ("zvc", "int8")
            for direction in ("encode", "decode") for n in (1 << 10, 1 << 20)]
    off = Offloader(CSwapConfig(min_bytes=0, profile_steps=1, lossy="int8", budget=None),
                    link=Link(1e6, 1e6, 1e9), time_model=CodecTimeModel().fit(runs))

    def step() -> None:
        with off:
            loss = net(x).square().sum()
        loss.backward()

    step()  # measured: the plan is made after it
    off.probe_next_step("lossless")
    step()
    for _ in range(2):
        step()
    assert off.lossy_sites() and "int8" in {s.decision for s in off.tracked_step().sites}
    off.close()


def test_lossy_sites_are_those_of_the_latest_training_step():
    net, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))
    assert off.lossy_sites() is None
    grads(net, x, y, off)
    sites = off.lossy_sites()
    assert sites and sites == {s.site for s in off.last_step().sites if s.decision == "int8"}
    grads(net, x, y, off.probe_next_step("lossless"))  # a probe does not count
    assert off.lossy_sites() == sites
    off.revert(sites)
    grads(net, x, y, off)
    assert off.lossy_sites() == frozenset()
    off.close()
