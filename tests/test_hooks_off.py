"""Steps without the engine's hooks (issue 28): only under a plan that is allowed to move
nothing (``plan="keep"``, or the advisor's plan where it keeps every tensor), never under a
forced plan that happened to find nothing to move; and a session with its hooks off turns
them back on for a new graph (another call site, a user's saved-tensor hooks around it, a
model watched anew, or, at the latest, a step every ``DORMANT_STEPS``). Steps that ran a
checked plan report what keeping everything holds (``keep_all_bytes``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from cswap_lightning import CSwapConfig, Offloader, offload
from cswap_lightning.core.engine import DORMANT_STEPS

LEAF = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()


def leaves_only(session: Offloader) -> torch.Tensor:
    """A graph that saves only a leaf (twice): nothing in it can move."""
    with session:
        loss = (LEAF * LEAF).sum()
    loss.backward()
    return loss


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU())


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def beside_plain(session: Offloader, model: nn.Module, plain: nn.Module):
    """One step of ``model`` under ``session`` and of ``plain`` without it, gradients compared;
    the session's statistics of it."""
    for net in (model, plain):
        net.zero_grad(set_to_none=True)
    plain(X).square().mean().backward()
    with session:
        loss = model(X).square().mean()
    loss.backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    return session.last_step()


def test_a_forced_plan_never_turns_its_hooks_off():
    """plan="raw" whose first steps saved only a leaf: nothing moved, yet a model trained
    afterwards under it moves its activations."""
    session = Offloader(CSwapConfig(plan="raw", budget=None, profile_steps=1, min_bytes=0))
    firsts = []
    for _ in range(4):
        leaves_only(session)
        firsts.append(session.last_step())
    assert not any(s.hooks_off for s in firsts)
    model = mlp()
    plain = copy.deepcopy(model)
    stats = [beside_plain(session, model, plain) for _ in range(3)]
    assert not any(s.hooks_off for s in stats)
    assert stats[-1].offloaded_bytes > 0
    session.close()


def hooks_off_after_leaves(config: CSwapConfig) -> Offloader:
    """A shared session whose checked plan moves nothing (a graph of leaves): hooks off."""
    session = offload(config)
    for _ in range(3):
        leaves_only(session)
    assert session.last_step().hooks_off
    return session


def test_a_new_call_site_turns_the_hooks_back_on():
    session = hooks_off_after_leaves(CSwapConfig(budget=None, profile_steps=1, min_bytes=0))
    model = mlp()
    plain = copy.deepcopy(model)
    stats = [beside_plain(session, model, plain) for _ in range(4)]
    assert not stats[0].hooks_off  # seen: another graph, measured and planned
    assert stats[-1].offloaded_bytes > 0
    session.close()


def test_a_model_watched_anew_turns_the_hooks_back_on():
    session = hooks_off_after_leaves(CSwapConfig(budget=None, profile_steps=1, min_bytes=0,
                                                 prefetch_bytes=1 << 20))
    model = mlp()
    session.watch(model)
    leaves_only(session)  # from the same call site
    assert not session.last_step().hooks_off
    session.close()


def test_the_same_call_site_with_another_model_is_seen_within_the_dormant_steps():
    session = offload(CSwapConfig(budget=None, profile_steps=1, min_bytes=0,
                                  prefetch_bytes=(1 << 20) + 1))
    model = mlp()
    stats = []
    for graph in ["leaves"] * 3 + ["model"] * (DORMANT_STEPS + 4):
        with session:  # one call site for both graphs
            loss = (LEAF * LEAF).sum() if graph == "leaves" else model(X).square().mean()
        loss.backward()
        stats.append(session.last_step())
    assert stats[2].hooks_off and stats[3].hooks_off  # the model's first step: unseen
    assert stats[-1].offloaded_bytes > 0
    session.close()


def test_a_users_saved_tensor_hooks_around_the_session_do_not_reach_inside_it():
    """With its hooks off, the session's tensors would go to the user's hooks around it,
    which are not theirs: the session keeps its own hooks there."""
    session = hooks_off_after_leaves(CSwapConfig(budget=None, profile_steps=1, min_bytes=0,
                                                 prefetch_bytes=(1 << 20) + 2))
    a = LEAF.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: 3 * t, lambda t: 3 * t), session:
        loss = (a * a).sum()
    loss.backward()
    assert torch.equal(a.grad, 2 * a.detach())  # not scaled by the user's hooks
    assert not session.last_step().hooks_off
    session.close()


def test_steps_that_ran_a_checked_plan_report_what_keeping_everything_holds():
    """keep_all_bytes on the steps that ran the checked plan without tracking each tensor,
    and those without hooks: the checking step's, not 0."""
    model = mlp()
    plain = copy.deepcopy(model)
    for config in (CSwapConfig(plan="raw", profile_steps=1, min_bytes=0),
                   CSwapConfig(plan="keep", profile_steps=1, min_bytes=0)):
        session = Offloader(config)
        stats = [beside_plain(session, model, plain) for _ in range(4)]
        checked, untracked = stats[1], stats[3]
        assert checked.tracked_all and not untracked.tracked_all
        assert untracked.keep_all_bytes == checked.keep_all_bytes > 0
        assert untracked.hooks_off == (config.plan == "keep")
        session.close()
