"""Steady steps: once a step has checked a plan, later steps move the sites it moved with a
codec of exact size without tracking them one by one, bitwise as before, and track them
again wherever what is saved stops matching the checked step."""

import copy
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import pytest
import torch
from torch import nn

from cswap_lightning import CSwapConfig, Offloader


class Split(nn.Module):
    """Two saved views of one storage: the second site shares the first's entry."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x).chunk(2, dim=-1)
        return (a.sin() * b.cos()).sum()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8))


def steps_beside_plain(off: Offloader, model: nn.Module, inputs: list[torch.Tensor]) -> list:
    """One step per input under ``off`` and on a plain copy; gradients bitwise equal at each.
    Each step's statistics."""
    plain, stats = copy.deepcopy(model), []
    for x in inputs:
        for net, offloaded in ((model, True), (plain, False)):
            net.zero_grad()
            if offloaded:
                with off:
                    loss = net(x).square().mean()
            else:
                loss = net(x).square().mean()
            loss.backward()
        stats.append(off.last_step())
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    return stats


def steps_with_plain_gradients(
        off: Offloader, steps: list[tuple[Callable[[], torch.Tensor], torch.Tensor]]) -> None:
    """One step per (loss function, leaf) under ``off``; the leaf's gradient bitwise equal to
    plain autograd's."""
    for loss_of, leaf in steps:
        with off:
            loss = loss_of()
        loss.backward()
        expected, = torch.autograd.grad(loss_of(), leaf)
        assert torch.equal(leaf.grad, expected)
        leaf.grad = None


def test_a_checked_raw_plan_moves_untracked_with_the_checked_steps_totals():
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    x = torch.randn(32, 64)
    measured, checked, *steady = steps_beside_plain(off, mlp(), [x] * 5)
    moved = [s for s in checked.sites if s.decision == "raw"]
    assert moved and measured.sites and checked.untracked_moved_tensors == 0
    for step in steady:
        assert not step.sites and step.untracked_moved_tensors == len(moved)
        assert step.offloaded_tensors == checked.offloaded_tensors
        assert step.offloaded_bytes == checked.offloaded_bytes > 0
        assert step.stored_bytes == checked.stored_bytes
        assert step.saved_bytes == checked.saved_bytes
        assert step.kept_bytes == checked.kept_bytes
        assert step.peak_resident_bytes == checked.peak_resident_bytes
        assert "moved as the plan says, not tracked one by one" in step.table()
    assert off.tracked_step() is checked
    assert off.live_entries() == 0  # nothing left behind once backward has run
    off.close()


def test_an_in_place_write_after_the_save_is_still_caught_on_a_steady_step():
    lin = nn.Linear(64, 64)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    for _ in range(3):
        with off:
            loss = lin(torch.randn(16, 64)).sin().sum()
        loss.backward()
    assert off.last_step().untracked_moved_tensors == 2  # the input and y, untracked
    with off:
        y = lin(torch.randn(16, 64))
        loss = y.sin().sum()  # saves y
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    off.close()


def test_views_of_one_storage_move_once_on_steady_steps():
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    x = torch.randn(16, 64)
    _, checked, *steady = steps_beside_plain(off, Split(), [x] * 4)
    shared = [s for s in checked.sites if s.decision == "dedup"]
    assert shared
    for step in steady:
        assert step.untracked_moved_tensors > 0
        assert [s.site for s in step.sites] == [s.site for s in shared]  # tracked, shared
        assert all(s.decision == "dedup" for s in step.sites)
        assert step.offloaded_bytes == checked.offloaded_bytes
    off.close()


def test_a_compressing_plan_stays_tracked_site_by_site():
    """zvc payloads' sizes follow the data: such steps keep their rows (the host arena is
    planned from them)."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0, profile_steps=1))
    stats = steps_beside_plain(off, model, [torch.randn(32, 64)] * 4)
    assert all(s.sites and s.untracked_moved_tensors == 0 for s in stats)
    assert any(s.decision == "zvc" for s in stats[-1].sites)
    off.close()


def test_a_reverted_lossy_site_is_tracked_and_checked_again():
    off = Offloader(CSwapConfig(plan="int8", lossy="int8", min_bytes=0, profile_steps=1))
    model, x = mlp(), torch.randn(32, 64)
    for _ in range(3):
        with off:
            loss = model(x).square().mean()
        loss.backward()
    assert off.last_step().untracked_moved_tensors > 0
    lossy = off.tracked_step().sites
    site = next(s.site for s in lossy if s.decision == "int8")
    off.revert([site])
    decisions = []
    for _ in range(2):
        with off:
            loss = model(x).square().mean()
        loss.backward()
        decisions.append({s.site: s.decision for s in off.last_step().sites})
    assert decisions[0][site] == "raw"  # tracked again, the reverted site lossless
    assert not decisions[1] and off.last_step().untracked_moved_tensors > 0  # checked again
    assert off.tracked_step().sites[site].decision == "raw"
    off.close()


def test_a_tensor_of_another_dtype_at_a_moved_site_is_tracked():
    """A lossy or compressing codec must never meet a dtype the checked step did not give
    it: a site whose dtype changed (the same bytes) is tracked, not moved as planned."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        return (y * y).sum()  # saves y twice: moved, then shared

    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    xs = [torch.randn(4096, requires_grad=True)] * 3 + [
        torch.randn(2048, dtype=torch.float64, requires_grad=True)]
    steps_with_plain_gradients(off, [(partial(forward, x), x) for x in xs])
    last = off.last_step()
    assert [s.dtype for s in last.sites] == ["float64", "float64"]
    assert last.untracked_moved_tensors == 0
    off.close()


def test_a_sparse_tensor_at_a_moved_site_is_kept():
    """A sparse tensor has no storage to move: where the checked step moved a dense one, it
    is tracked (and kept), not moved as planned."""
    w = torch.randn(8, 4, requires_grad=True)

    def forward(sparse: bool) -> torch.Tensor:
        x = torch.eye(8)[:6].relu()  # an op's output, freed after forward: moved as planned
        return torch.sparse.mm(x.to_sparse(), w).sum() if sparse else torch.mm(x, w).sum()

    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    steps_with_plain_gradients(off, [(partial(forward, sparse), w)
                                     for sparse in (False, False, False, True)])
    assert off.tracked_step().sites[0].decision == "raw"
    last = off.last_step()
    assert [(s.site, s.decision, s.reason) for s in last.sites] == [(0, "keep", "sparse/nested")]
    off.close()


class SaveAsIs(torch.autograd.Function):
    """Saves its input; backward records the shape, strides and offset it got back."""

    seen: ClassVar[list[tuple]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, = ctx.saved_tensors
        SaveAsIs.seen.append((x.shape, x.stride(), x.storage_offset(), x.clone()))
        return grad * 2


def odd_views(a: torch.Tensor) -> list[torch.Tensor]:
    """Views a step saves: all of a storage with odd strides on its size-1 dims (contiguous),
    channels-last (all of it, not contiguous), and a slice at an offset."""
    return [a.sin().as_strided((8, 1, 32), (32, 5, 1)),
            a.cos().view(4, 4, 4, 4).contiguous(memory_format=torch.channels_last),
            a.exp()[16:]]


@pytest.mark.parametrize("codec", ["raw", "int8", "zvc"])
@pytest.mark.parametrize("arena", [False, True])
def test_saved_views_come_back_in_their_shape_strides_and_offset(codec, arena, monkeypatch):
    """Tracked and steady steps, raw, lossy and compressed, with and without an arena region
    for the payload: backward gets every saved tensor in the geometry it was saved in (values
    exact where lossless)."""
    from cswap_lightning.core.transfer import Transfer

    monkeypatch.setattr(Transfer, "arena_everywhere", arena)
    off = Offloader(CSwapConfig(plan=codec, min_bytes=0, profile_steps=1))
    a = torch.randn(256, requires_grad=True)
    for step in range(4):
        SaveAsIs.seen = []
        with off:
            views = odd_views(a)
            loss = sum(SaveAsIs.apply(v).sum() for v in views)
        expected = [(v.shape, v.stride(), v.storage_offset(), v.detach().clone()) for v in views]
        del views  # else they are held elsewhere, and kept
        loss.backward()
        got = SaveAsIs.seen[::-1]  # backward runs the last op first
        assert [g[:3] for g in got] == [e[:3] for e in expected], step
        for (*_, value), (*_, want) in zip(got, expected, strict=True):
            if codec == "int8":
                assert (value - want).abs().max() <= want.abs().max() / 100  # 8 bits
            else:
                assert torch.equal(value, want)
    moved = off.last_step().untracked_moved_tensors
    assert moved == (0 if codec == "zvc" else 3)  # zvc steps stay tracked
    off.close()
