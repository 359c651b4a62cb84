"""One ``offload(config)`` shared by several graphs (two models here; PyTorch's and the peers'
saved-tensor hook tests one after another in test_peer_suites): a plan is made by position
(site k keeps, site k moves), so a graph saving as many tensors of the same sizes, with
weights at other sites, must be measured anew, never run under the other graph's plan: its
weights moved, its activations kept. Each step's gradients are bitwise those of PyTorch
without the engine."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import spy_on_moves
from torch import nn

from cswap_lightning import CSwapConfig, offload

# Every tensor that can move moves (budget=None, min_bytes=0), so each graph's plan moves its
# activations and keeps its weights; prefetch_bytes only makes these configs this module's own.
MiB = 1 << 20


class WeightSecond(nn.Module):
    """Saves, in order: x.exp() (for w1's gradient), w2 then h (``h * w2``: other, then self),
    the product (for ``square``): four 256 KiB tensors, the second a weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(256, 256))
        self.w2 = nn.Parameter(torch.randn(256, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.exp() * self.w1 + 1
        return (h * self.w2).square().sum()


class WeightThird(WeightSecond):
    """The same sizes in the same count, but ``w2 * h``: the weight is the third."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.exp() * self.w1 + 1
        return (self.w2 * h).square().sum()


@pytest.mark.parametrize("first_steps", [1, 3, 5],
                         ids=["while measuring", "at the checking step", "once checked"])
def test_a_second_model_of_the_same_sizes_gets_its_own_plan(first_steps, monkeypatch):
    """The first model's plan, checked, moved the second's weight (its site) and kept one of
    its activations; arriving at the first's checking step, the second checked the first's
    plan with one activation kept for good."""
    config = CSwapConfig(budget=None, min_bytes=0, profile_steps=2, prefetch_bytes=MiB + 1)
    session = offload(config)
    moved = spy_on_moves(session, monkeypatch)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    for model, steps in ((WeightSecond(), first_steps), (WeightThird(), 6)):
        plain = copy.deepcopy(model)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
            plain(x).backward()
            moved.clear()
            with offload(config):
                loss = model(x)
            loss.backward()
            assert not weights & set(moved), "a weight was moved"
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad)
    last = session.last_step()
    # its own plan: the weight kept, the three activations moved, without tracking them
    assert (last.untracked_tensors, last.untracked_moved_tensors) == (1, 3)
    assert not last.sites and not last.hooks_off
    session.close()
