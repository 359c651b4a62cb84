"""Recomputation as safe as keeping (issue 28): each way a block recomputed in backward could
run otherwise than its first run did, or change what its first run already changed, trains
bitwise as plain PyTorch does, with the blocks chosen by hand (``Offloader.recompute``) or by
the planner under a budget it cannot meet without recomputing. What the engine cannot replay
exactly it never recomputes, and the plan's table names each block it left out, and why."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from test_conformance import BATCH, Built, _gen, differences, torch_case, train
from torch import nn

import cswap_lightning as cswap
from cswap_lightning.config import MIN_BUDGET
from cswap_lightning.core.recompute import units
from cswap_lightning.planning.profiler import Link

STEPS = 4  # measured (plain), then recomputed; under the planner: measured again, checked
WIDTH = 16
# As slow beside the CPU as PCIe beside an H100: the planner recomputes rather than swaps.
SLOW_LINK = Link(2e7, 2e7, 1e10)


def stack(block: Callable[[], nn.Module], depth: int = 3) -> nn.Module:
    """Blocks in an ``nn.ModuleList``, each a unit of recomputation."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(block() for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack()


def rows(x: torch.Tensor | None = None) -> torch.Tensor:
    return torch.randn(BATCH, 6, WIDTH, generator=_gen()) if x is None else x


# the classes of issue 28 ----------------------------------------------------------------------
class Residual(nn.Module):
    """``h += layer(h)``, each layer starting with dropout: plainly nothing saves ``h`` itself,
    so changing it in place after the layer returns is fine; a checkpoint keeps its input."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Dropout(0.1), nn.Linear(WIDTH, WIDTH), nn.Tanh())
            for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        for layer in self.layers:
            h += layer(h)
        return h


def instance_norms() -> nn.Module:
    """InstanceNorm with running statistics: updated in training, read in eval."""
    return stack(lambda: nn.Sequential(
        nn.Conv1d(6, 6, 3, padding=1), nn.InstanceNorm1d(6, track_running_stats=True),
        nn.ReLU()))


class InPlace(nn.Module):
    """Changes its input in place (fine plainly: nothing saved it before)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mul_(2))


class Clamped(nn.Module):
    """Clamps its weight in place before using it (a constraint kept in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.2, 0.2)
        return torch.tanh(self.lin(x))


class Scaled(nn.Module):
    """Scales by a buffer ``calls`` (a call counter), which forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + 0.1 * self.calls)


class Counting(Scaled):
    """Bumps its own counter in forward, then scales by it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x)


class CountingInAttributes(nn.Module):
    """Counts its calls in plain attributes, a Python number and a tensor that is no buffer
    (replaced, or with ``in_place`` changed in place), and scales by both: plainly each
    forward counts once. It keeps its last input aside too, made on its first call."""

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.calls, self.in_place = 0, in_place
        self.seen = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.in_place:
            self.seen += 1
        else:
            self.seen = self.seen + 1
        scale = 1 if getattr(self, "last", None) is None else 1 + 0.01 * self.last.mean()
        self.last = x.detach()
        return x * (1 + 0.1 * self.calls) * (1 + 0.01 * self.seen) * scale


def bump(module: nn.Module, args: tuple) -> None:
    module.calls += 1


def bumped_by_a_pre_hook() -> nn.Module:
    def block() -> nn.Module:
        scaled = Scaled()
        scaled.register_forward_pre_hook(bump)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), scaled, nn.Tanh())

    return stack(block)


def spectral(norm: Callable[[nn.Module], nn.Module]) -> Callable[[], nn.Module]:
    """Blocks whose first linear layer is normalised by its spectral norm, estimated by a power
    iteration each forward in training (its vectors are buffers)."""
    return lambda: stack(lambda: nn.Sequential(norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh(),
                                               nn.Linear(WIDTH, WIDTH)))


def old_spectral_norm(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.spectral_norm(module)


class OwnNoise(nn.Module):
    """Masks with noise drawn from a generator of its own (checkpoint restores only the global
    ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(3)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.generator) > 0.3
        return torch.tanh(self.lin(x * keep))


def dropout_blocks() -> nn.Module:
    return stack(lambda: nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(0.2),
                                       nn.Linear(4 * WIDTH, WIDTH)))


HOOK_CALLS: list[int] = []


def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    HOOK_CALLS.append(output.numel())  # as a user's hook gathering activation statistics


def inner_forward_hooks() -> nn.Module:
    def block() -> nn.Module:
        inner = nn.Linear(WIDTH, WIDTH)
        inner.register_forward_hook(record)
        return nn.Sequential(inner, nn.GELU(), nn.Linear(WIDTH, WIDTH))

    return stack(block)


def steer(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 1.5  # as activation steering does, hooked around one forward


class SteeredForward(nn.Module):
    """Blocks whose forward hooks exist during its own forward only: registered on entry,
    removed before it returns, so backward never sees them. ``inside``: on each block's
    first layer (a user's hook that also records its calls); else one global forward hook
    (``register_module_forward_hook``) on every linear layer."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.inside = inside
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
            for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inside:
            handles = [layer[0].register_forward_hook(steered_and_recorded)
                       for layer in self.layers]
        else:
            handles = [torch.nn.modules.module.register_module_forward_hook(
                lambda m, args, out: steer(m, args, out) if isinstance(m, nn.Linear) else None)]
        try:
            for layer in self.layers:
                x = layer(x)
            return x
        finally:
            for handle in handles:
                handle.remove()


def steered_and_recorded(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    record(module, args, output)
    return steer(module, args, output)


class Case:
    """A model of one class, and how it trains: ``modes``, its training flag in forward and in
    backward; ``recomputed``: whether the engine may still recompute its blocks (it restores
    what they change) or must leave them out, saying ``why``."""

    def __init__(self, build: Callable[[], nn.Module], recomputed: bool, why: str = "",
                 modes: tuple[bool, bool] = (True, True), x: torch.Tensor | None = None
                 ) -> None:
        self.build, self.recomputed, self.why, self.modes = build, recomputed, why, modes
        self.x = x

    def built(self) -> Built:
        torch.manual_seed(0)
        return torch_case(self.build(), rows(self.x))


CASES = {
    "input changed in place after the block": Case(
        Residual, False, "its input is changed in place after it returns"),
    "instance norm's running statistics": Case(
        instance_norms, True, x=torch.randn(BATCH, 6, 8, generator=_gen())),
    "input changed in place inside the block": Case(
        lambda: stack(InPlace), False, "changes an input in place"),
    "parameter changed in place in forward": Case(
        lambda: stack(Clamped), False, "changes its parameter lin.weight in place"),
    "buffer bumped in forward": Case(
        lambda: stack(lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), Counting(), nn.Tanh())),
        True),
    "state in plain attributes changed in forward": Case(
        lambda: stack(lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), CountingInAttributes(),
                                            nn.Tanh())), True),
    "a plain attribute's tensor changed in place in forward": Case(
        lambda: stack(lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH),
                                            CountingInAttributes(in_place=True), nn.Tanh())),
        False, "changes the tensor of its attribute 1.seen in place"),
    "buffer bumped by a forward pre-hook": Case(
        bumped_by_a_pre_hook, False, "forward hooks on layers.0.1 would run again"),
    "spectral norm (parametrization)": Case(
        spectral(torch.nn.utils.parametrizations.spectral_norm), True),
    "spectral norm (old hook)": Case(spectral(old_spectral_norm), True),
    "a generator of its own": Case(lambda: stack(OwnNoise), True),
    "eval() between forward and backward": Case(dropout_blocks, True, modes=(True, False)),
    "train() between forward and backward": Case(dropout_blocks, True, modes=(False, True)),
    "forward hooks inside the block": Case(
        inner_forward_hooks, False, "forward hooks on layers.0.0 would run again"),
    # gone by backward: seen at the call, not when the blocks were chosen
    "forward hooks inside the block around one forward": Case(
        lambda: SteeredForward(inside=True), False, "forward hooks on layers.0.0 would run again"),
    # run again in the recomputation as forward ran them
    "a global forward hook around one forward": Case(lambda: SteeredForward(inside=False), True),
}


def blocks(model: nn.Module) -> list[str]:
    return [n for n in units(model) if n.count(".") == 1]  # layers.i


class Run:
    """Training under an Offloader: the steps, the model trained (the Offloader holds it
    weakly), the blocks skipped when chosen by hand."""

    def __init__(self, case: Case, offloader: cswap.Offloader, by_hand: bool) -> None:
        self.offloader, self.skipped = offloader, {}
        self.model: nn.Module | None = None

        def prepare(model: nn.Module) -> None:
            self.model = model
            offloader.watch(model)
            if by_hand:
                self.skipped = offloader.recompute(blocks(model))

        self.steps = train(case.built(), STEPS, offloader, prepare, case.modes)

    def left_out(self) -> dict[str, str]:
        return {**self.skipped, **self.offloader.recomputer.unfit}


def by_hand(case: Case) -> Run:
    """Every block chosen by hand before the first (measured) step."""
    return Run(case, cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0,
                                                       profile_steps=1, budget=None)), True)


def planned(case: Case) -> Run:
    """The planner's choice under the smallest budget (1 KiB): every block it may recompute."""
    return Run(case, cswap.Offloader(cswap.CSwapConfig(budget=MIN_BUDGET, min_bytes=0,
                                                       profile_steps=1), link=SLOW_LINK), False)


def plain(case: Case) -> tuple[list, list[int]]:
    """Plain training, and the calls of the hooks it made."""
    HOOK_CALLS.clear()
    steps = train(case.built(), STEPS, modes=case.modes)
    calls = list(HOOK_CALLS)
    HOOK_CALLS.clear()
    return steps, calls


def why(case: Case, block: str) -> str:
    return case.why.replace("layers.0", block)


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_chosen_by_hand_train_as_plain_pytorch(name):
    case = CASES[name]
    want, calls = plain(case)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cswap: no longer recomputing")
        run = by_hand(case)
    assert not differences(want, run.steps)
    assert HOOK_CALLS == calls  # a user's hooks ran as often as plainly
    chosen = blocks(run.model)
    if case.recomputed:
        assert run.offloader.recomputed == set(chosen) and not run.left_out()
        # recomputed: the first recomputed step tracks every site, as the measured one
        # does (the later ones, running the checked plan, track none)
        assert len(run.steps[1].stats.sites) < len(run.steps[0].stats.sites)
    else:
        assert not run.offloader.recomputed
        left_out = run.left_out()
        assert all(left_out[block].startswith(why(case, block)) for block in chosen), left_out
    run.offloader.close()


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_the_planner_chose_train_as_plain_pytorch(name):
    case = CASES[name]
    want, calls = plain(case)
    run = planned(case)
    assert not differences(want, run.steps)
    assert HOOK_CALLS == calls
    chosen, table = blocks(run.model), run.offloader.plan.table()
    if case.recomputed:
        assert run.offloader.recomputed >= set(chosen), table
    else:
        assert not run.offloader.recomputed & set(chosen), table
        for block in chosen:  # each block left out is named, and why
            assert any(line.split()[:1] == [block] and why(case, block) in line
                       for line in table.splitlines()), table
    run.offloader.close()


def test_a_block_found_unfit_after_it_was_chosen_is_given_back_with_a_warning():
    """Chosen by hand before the measured step showed it changes its input in place: the next
    step runs it plainly, and says so once."""
    built = CASES["input changed in place inside the block"].built()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    model = built.model
    assert offloader.watch(model).recompute(["layers.0", "layers.1"]) == {}

    def step() -> None:
        with offloader:
            loss = built.loss(model, built.inputs)
        loss.backward()

    step()  # measured: the blocks run plainly
    with pytest.warns(RuntimeWarning, match=r"no longer recomputing 'layers.0'.*in place"):
        step()
    step()  # plainly: it would crash recomputed
    assert offloader.recomputed == frozenset()
    offloader.close()


def stages() -> nn.Sequential:
    """Plain layers in stages to each max-pool: the first counts its calls in a buffer, the
    second has a user's forward hook on its convolution."""
    model = nn.Sequential(nn.Conv1d(6, 6, 3, padding=1), Counting(), nn.ReLU(), nn.MaxPool1d(2),
                          nn.Conv1d(6, 6, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2),
                          nn.Flatten(), nn.Linear(12, 4))
    model[4].register_forward_hook(record)
    return model


def test_stages_of_a_sequential_put_back_their_buffers_and_leave_out_hooked_layers():
    case = Case(stages, True, x=torch.randn(BATCH, 6, 8, generator=_gen()))
    want, calls = plain(case)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    skipped = {}

    def prepare(model: nn.Module) -> None:
        assert list(units(model)) == ["[0:4]", "[4:7]"]
        skipped.update(offloader.watch(model).recompute(["[0:4]", "[4:7]"]))

    got = train(case.built(), STEPS, offloader, prepare)
    assert not differences(want, got) and HOOK_CALLS == calls
    assert skipped == {"[4:7]": "forward hooks on 4 would run again in backward, where "
                                "plainly they run once"}
    assert offloader.recomputed == {"[0:4]"}
    assert offloader.recomputer.changed == {"[0:4]": {"1.calls"}}
    offloader.close()


def test_a_recomputation_runs_with_the_first_runs_flags_and_puts_back_every_flag():
    """``as_first`` shows the first run's training flags, and afterwards every module's flag
    is what it was before, also one the recomputation itself changed."""
    from cswap_lightning.core.rerun import FirstRun, Parts, as_first

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
    first = FirstRun(Parts.of([model]), [], [], None)  # forward ran in training mode
    model.eval()  # between forward and backward
    with as_first(first):
        assert all(m.training for m in model.modules())
        model[0].training = False  # the recomputation changes a flag that matched
    assert not any(m.training for m in model.modules())
    model.train()
    with as_first(first):
        model[1].training = False
    assert all(m.training for m in model.modules())
