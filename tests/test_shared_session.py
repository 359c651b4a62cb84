"""One ``offload(config)`` shared by several graphs (two models, or PyTorch's own saved-tensor
hook tests run one after another): a plan is made by position (site k keeps, site k moves), so
a graph saving as many tensors of the same sizes, with weights at other sites, must be
measured anew, never run under the other graph's plan: its weights moved, its activations
kept. Each step's gradients are bitwise those of PyTorch without the engine."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from cswap_lightning import CSwapConfig, Offloader, offload

# Every tensor that can move moves (budget=None, min_bytes=0), so each graph's plan moves its
# activations and keeps its weights; prefetch_bytes only makes these configs this module's own.
MiB = 1 << 20


def spy_on_moves(session: Offloader, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The addresses of the storages the session moves off the device, as it moves them."""
    moved: list[int] = []
    offload_one = session.transfer.offload

    def recording(entry, flat, *args, **kwargs):
        moved.append(flat.untyped_storage().data_ptr())
        return offload_one(entry, flat, *args, **kwargs)

    monkeypatch.setattr(session.transfer, "offload", recording)
    return moved


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


# PyTorch's own saved-tensor hook tests (test/test_autograd.py: the saved-variable packing and
# unpacking tests, double backward through saved tensors, a custom Function's saved
# intermediates, nested hooks, the in-place check), restated for the engine. Each case runs
# its graph under ``hooks`` (the shared session, or nothing: plain PyTorch), returns the
# leaves whose gradients it checks and the tensors it saved that must stay where they are
# (leaves that require grad), and asserts what saved-tensor hooks preserve: values, the
# gradient function of a saved non-leaf, gradients. Hooks return other tensor objects than the
# saved ones even in PyTorch (identity hooks too), so identity is not asserted. Each case also
# saves a tensor that nothing else holds (``unheld``): one the session moves for good; run
# without it, some cases' plans move nothing, and their later steps run without hooks, which
# the next case (entered from other code) must turn back on.
Case = Callable[[object], tuple[list[torch.Tensor], list[torch.Tensor]]]


def _leaf(seed: int) -> torch.Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def unheld(t: torch.Tensor) -> torch.Tensor:
    """``sin`` saves its input, here a tensor only autograd holds."""
    return (t + 0).sin()


def saved_non_leaf(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A non-leaf, not an output, saved twice: it comes back equal, with its grad_fn."""
    leaf = _leaf(0)
    with hooks:
        a = 1 + leaf
        y = a * a
        loss = unheld(y).sum()
    assert torch.equal(y.grad_fn._saved_self, a) and torch.equal(y.grad_fn._saved_other, a)
    assert y.grad_fn._saved_self.grad_fn is a.grad_fn
    loss.backward()
    return [leaf], []


def leaves_and_non_leaves(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A leaf saved three times beside a product and an output (``exp``)."""
    a = _leaf(1)
    with hooks:
        b = a * a
        c = a * b
        d = torch.exp(a)
        loss = unheld(c).sum() + d.sum()
    assert torch.equal(b.grad_fn._saved_self, a) and torch.equal(c.grad_fn._saved_other, b)
    assert torch.equal(d.grad_fn._saved_result, d)
    loss.backward()
    return [a], [a]


def double_backward(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A gradient with create_graph through a saved non-leaf, then its own backward."""
    leaf = _leaf(2)
    with hooks:
        a = leaf * 1.5
        y = unheld(a**3)
    (g,) = torch.autograd.grad(y.sum(), (leaf,), create_graph=True)
    g.sum().backward()
    return [leaf], []


class _SavesIntermediates(torch.autograd.Function):
    """Saves an intermediate made in forward and a leaf that requires grad made there too
    (``leaf_first``: in that order), each ``x``'s size."""

    @staticmethod
    def forward(ctx, x, leaf_first: bool, leaves: list):
        activation = x.exp()
        leaf = x.detach().clone().requires_grad_(True)
        leaves.append(leaf)
        ctx.save_for_backward(*((leaf, activation) if leaf_first else (activation, leaf)))
        ctx.leaf_first = leaf_first
        return x.exp()

    @staticmethod
    def backward(ctx, grad_out):
        first, second = ctx.saved_tensors
        activation, leaf = (second, first) if ctx.leaf_first else (first, second)
        return grad_out * activation + 0 * leaf, None, None


def _custom_function(leaf_first: bool) -> Case:
    def case(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a, saved = _leaf(3), []
        with hooks:
            out = _SavesIntermediates.apply(a, leaf_first, saved)
        out.sum().backward()
        return [a], saved

    case.__name__ = f"custom_function_{'leaf' if leaf_first else 'activation'}_first"
    return case


def inner_hooks_win(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The session inside a user's own hooks: tensors saved inside it are the session's,
    those saved after it the user's (which scale them by 3 twice)."""
    a, b = _leaf(4), _leaf(5)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: 3 * t, lambda t: 3 * t):
        with hooks:
            y = (a + 0) * (a + 0)
        z = (b + 0) * (b + 0)
    y.sum().backward()
    z.sum().backward()
    return [a, b], []


def modified_in_place(hooks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A saved tensor modified in place after forward: backward raises PyTorch's error."""
    leaf = _leaf(6)
    with hooks:
        a = leaf * 2
        b = unheld(a.sin())
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    return [], []


# What a case runs under without the engine: nothing, or, where the session is nested inside
# the user's hooks, PyTorch's pass-through hooks in its place (the innermost hooks win).
PLAIN = {inner_hooks_win: lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                          lambda t: t)}
CASES: list[Case] = [saved_non_leaf, leaves_and_non_leaves, double_backward,
                     _custom_function(leaf_first=False), _custom_function(leaf_first=True),
                     inner_hooks_win, modified_in_place]


@pytest.mark.parametrize("moving", [True, False], ids=["each moves a tensor", "as they are"])
def test_pytorchs_saved_tensor_hook_tests_through_one_shared_session(moving, monkeypatch):
    """Each case four times in a row (measured, checked, then run untracked or without
    hooks), all of them one after another and again in reverse order, through one
    ``offload(config)``: as in plain PyTorch, and no leaf is ever moved. The two custom
    Functions save as many tensors of one size with the leaf at the other site: under the
    other's checked plan, the leaf moved. Without ``unheld``, a case whose plan moves nothing
    runs without hooks: the next one (inside a user's hooks, too) has them back."""
    if not moving:
        monkeypatch.setattr(sys.modules[__name__], "unheld", lambda t: t + 0)  # saves nothing
    config = CSwapConfig(budget=None, min_bytes=0, profile_steps=1,
                         prefetch_bytes=MiB + 2 + moving)
    session = offload(config)
    moved = spy_on_moves(session, monkeypatch)
    with warnings.catch_warnings():
        # the cases do change what is saved between steps, and the session says so
        warnings.filterwarnings("ignore", "cswap: the tensors saved under this Offloader")
        for case in CASES + CASES[::-1]:
            for _ in range(4):
                want, _ = case(PLAIN.get(case, nullcontext)())
                moved.clear()
                got, stay = case(session)
                assert not {t.untyped_storage().data_ptr() for t in stay} & set(moved), (
                    f"{case.__name__}: a leaf was moved")
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g.grad, w.grad), case.__name__
            assert moved or not moving, f"{case.__name__}: its own plan moves its activations"
    session.close()
