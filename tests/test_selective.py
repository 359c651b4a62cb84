"""Recomputation below the layer (``core/selective.py``): a block's elementwise work runs again
in backward, its matrix products, attention and convolutions do not. Training with it is
bitwise plain training (Llama, Qwen2, GPT-2 with its dropout); what it keeps goes through the
engine's hooks (kept or swapped, counted by the ledger), as the block timer measured it
beforehand; the replay and the planner weigh it beside whole blocks."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
from collections.abc import Iterator
from dataclasses import replace

import pytest
import test_conformance as conformance
import test_recompute
import torch
from conftest import model_shapes
from test_conformance import LLAMAISH, Built, causal_lm, differences, train
from test_dataflow import below as below_through
from test_lean import under_autocast
from test_recompute import GPT2, STEPS, outermost, recomputing
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F

import cswap_lightning as cswap
from cswap_lightning.core import recompute, selective, tensors
from cswap_lightning.core.recompute import BlockCall, below, units
from cswap_lightning.core.selective import Region
from cswap_lightning.planning import live, mix, ops, replay
from cswap_lightning.planning.dataflow import WEIGHTS
from cswap_lightning.planning.profiler import SiteProfile
from cswap_lightning.planning.workload import BELOW, Below, Block, Op, Saved, Workload

BUILDERS = {
    "llama": lambda: causal_lm("LlamaConfig", **LLAMAISH)("sdpa"),  # attention dropout 0.1
    "qwen2": lambda: causal_lm("Qwen2Config", **LLAMAISH)("sdpa"),
    "gpt2": lambda: causal_lm("GPT2Config", **GPT2)("sdpa"),  # dropout 0.1 everywhere
    "gpt2_eager": lambda: causal_lm("GPT2Config", **GPT2)("eager"),
    # BatchNorm: its running statistics put back around the recomputation, whose own
    # operators are not the block's
    "resnet50": test_recompute.BUILDERS["resnet50"],
}


@functools.cache
def case(name: str) -> tuple[Built, list]:
    torch.manual_seed(0)
    built = BUILDERS[name]()
    return built, train(built, STEPS)


def every_layer_below(model: torch.nn.Module) -> list[str]:
    return list(below(units(model)))


def below_layers(built: Built, plan: str, steps: int = STEPS, weight: float = 0.0,
                 verdicts: dict[str, str] | None = None, lean: bool = True):
    """Train ``built`` under ``plan`` with every layer recomputed below the layer (the cut
    made with ``weight``) after the measured first step; the steps and the measured step's
    block calls (``verdicts``: filled with whether each layer's first runs went without
    autograd; ``lean``: whether they may)."""
    offloader = cswap.Offloader(cswap.CSwapConfig(plan=plan, min_bytes=0, profile_steps=1,
                                                  budget=None))

    def prepare(model: torch.nn.Module) -> None:
        names = every_layer_below(model)
        assert not offloader.watch(model).recompute(names, dict.fromkeys(names, weight))
        offloader.recomputer.verdicts.on = lean

    try:
        return train(built, steps, offloader, prepare), offloader.block_calls
    finally:
        if verdicts is not None:
            verdicts.update(offloader.recomputer.verdicts.why)
        offloader.close()


# bitwise training ----------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["keep", "raw", "zvc"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet50"
                                  else n for n in BUILDERS])
def test_training_with_layers_recomputed_below_the_layer_is_bitwise_plain_training(name, plan):
    built, plain = case(name)
    steps, calls = below_layers(built, plan)
    assert not differences(plain, steps)  # loss, gradients, the RNG state after backward
    measured, recomputed = steps[0].stats, steps[1].stats
    assert len(recomputed.sites) < len(measured.sites) / 2
    if plan != "keep":  # what the layers kept went through the engine's hooks, and moved
        kept = sum(len(c.below[0].kept) - 1 for c in calls if c.below)  # but the input
        assert kept > 0
        assert sum(s.decision == plan for s in recomputed.sites) >= kept


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_choice_made_on_the_measured_step_holds_for_every_recomputed_one(name, monkeypatch):
    """Each layer's choice of what to keep is made from its forward observed on the measured
    step, where the step's pack hook counted zeros and copied what was saved (zvc): none of
    those operators is the layer's, so every recomputed forward runs the operators the
    choice was made from, and none makes it choose again."""
    made, again = [], []
    real_make, real_check = selective.Choice.make, selective.Choice.check

    def make(self, *args):
        made.append(self)
        return real_make(self, *args)

    def check(self, flow):
        real_check(self, flow)
        again.extend([self] if self.kept is None else [])

    monkeypatch.setattr(selective.Choice, "make", make)
    monkeypatch.setattr(selective.Choice, "check", check)
    built, plain = case(name)
    steps, _ = below_layers(built, "zvc")
    assert not differences(plain, steps)
    assert len(made) >= 2 and len({id(c) for c in made}) == len(made)  # once a layer
    assert all(c.kept for c in made) and not again


@pytest.mark.parametrize("way", range(len(WEIGHTS)))
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_the_ledger_holds_what_the_block_timer_said_recomputation_below_keeps(
        name, way, monkeypatch):
    """On the measured step the block timer saw what each layer recomputed below the layer
    would keep each way (its inputs and the outputs of its matmuls and attention, or what
    spares work at the way's weight); recomputed that way, the next step saves exactly
    those, as sites of the engine's, the ledger's peak falls, and training is bitwise. No
    kept output is found held outside its layer (the key-value cache's keys and values,
    which eager attention does not all save, are left out when the choice is made)."""
    built, plain_steps = case(name)
    found = held(monkeypatch)
    steps, calls = below_layers(built, "keep", weight=WEIGHTS[way])
    assert found and not any(found)
    assert not differences(plain_steps, steps)
    measured, recomputed = steps[0].stats, steps[1].stats
    layers = [c for c in calls if c.below]
    assert len(layers) >= 2 and all(len(c.below[way].kept) > 1 and c.below[way].seconds > 0
                                    for c in layers)
    inside = sum(c.stop_site - c.first_site for c in layers)
    sites = sum(c.input_tensors + len(c.below[way].kept) - 1 for c in layers)
    assert len(recomputed.sites) == len(measured.sites) - inside + sites
    kept = sum(sum(c.below[way].kept) for c in layers)
    plain = sum(s.nbytes for c in layers for s in measured.sites[c.first_site:c.stop_site]
                if s.decision != "dedup" and s.reason in ("", "plan", "small"))
    assert kept < (0.75 if way == 0 else 1.0) * plain
    if way:  # a way of its own: more kept, less run again
        assert all(sum(c.below[way].kept) > sum(c.below[0].kept)
                   and c.below[way].seconds < c.below[0].seconds for c in layers)
    freed = measured.peak_resident_bytes - recomputed.peak_resident_bytes
    assert freed >= 0.9 * (plain - kept) / len(layers)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_lossy_on_layers_below_the_layer_is_checked_by_the_guard_and_held_within_it(name):
    """Issue 29's third goal, lossy: every site int8, the layers recomputed below the layer
    (what they keep, lossy too). The guard's check covers most of the step's sites, the
    kept outputs among them; once it reverted what it had to (not all), the error of the
    sites left lossy is within its tolerance."""
    from cswap_lightning.core.guard import AccuracyGuard

    built, _ = case(name)
    model = built.model
    off = cswap.Offloader(cswap.CSwapConfig(plan="int8", min_bytes=0, profile_steps=1,
                                            budget=None)).watch(model)
    assert not off.recompute(every_layer_below(model))
    for _ in range(2):  # measured, then the layers recomputed below the layer
        model.zero_grad()
        with off:
            loss = built.loss(model, built.inputs)
        loss.backward()
    below_sites = len(off.last_step().sites)
    guard = AccuracyGuard(off)
    model.zero_grad()
    report = guard.probe(model, lambda: built.loss(model, built.inputs))
    off.close()
    assert len(report.site_errors) >= below_sites // 2  # lossy: most sites, the kept among them
    after = report.worst_rel_error if report.error_after is None else report.error_after
    assert after <= guard.tolerance
    assert len(report.reverted) < len(report.site_errors)


def llama_below_the_layer(device: str = "cpu") -> tuple[Built, cswap.Offloader]:
    """A Llama (on ``device``) with every layer recomputed below the layer, every tensor
    swapped."""
    built, _ = case("llama")
    built = Built(built.model.to(device), {k: v.to(device) for k, v in built.inputs.items()},
                  built.loss)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None)).watch(built.model)
    offloader.recompute(every_layer_below(built.model))
    return built, offloader


@pytest.mark.parametrize("where", ["global", "inside"])
def test_forward_hooks_around_one_forward_train_as_plainly_below_the_layer(where):
    """Hooks that steer each layer's MLP during one forward only (registered by the loss,
    removed before backward): a global one runs again in the recomputation as forward ran it;
    one on a module inside a layer keeps the layer from being recomputed from that call on."""
    built, _ = case("llama")

    def steered(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        def steer(module, args, out):
            return out * 1.5 if type(module).__name__ == "LlamaMLP" else None

        handles = ([torch.nn.modules.module.register_module_forward_hook(steer)]
                   if where == "global" else
                   [layer.mlp.register_forward_hook(steer) for layer in model.model.layers])
        try:
            return built.loss(model, inputs)
        finally:
            for handle in handles:
                handle.remove()

    steering = Built(built.model, built.inputs, steered)
    want = train(steering, STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = below_layers(steering, "raw")
    assert not differences(want, got)
    given_back = [str(w.message) for w in caught if "no longer recomputing" in str(w.message)]
    assert given_back if where == "inside" else not given_back


def test_a_second_backward_recomputes_again_from_the_same_kept_outputs():
    built, offloader = llama_below_the_layer()
    model = built.model
    grads = []
    # the second is the first recomputed, the third the first without autograd
    for engine in (None, offloader, offloader, offloader):
        model.zero_grad()
        torch.manual_seed(0)
        if engine is None:
            loss = built.loss(model, built.inputs)
        else:
            with engine:
                loss = built.loss(model, built.inputs)
        loss.backward(retain_graph=True)
        loss.backward()  # twice the gradients, from a second recomputation
        grads.append([p.grad.clone() for p in model.parameters()])
    offloader.close()
    for grads_of_step in grads[2:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads_of_step, strict=True))


def test_a_block_run_first_without_autograd_lets_go_of_what_it_kept_as_its_backward_ends():
    """Its kept outputs' handles (their payloads in host memory: on the CPU, the restored
    copies the ledger counts) go once its recomputation is done, not with the step's graph,
    which holds the block's region until the loss goes (so a plan's checked steps measured
    them beside the next layers' restores); kept where the graph is kept for another
    backward."""
    built, offloader = llama_below_the_layer()
    model = built.model
    settled = []
    for retain in (False, False, False, True):  # the third is the first without autograd
        with offloader:
            loss = built.loss(model, built.inputs)
        loss.backward(retain_graph=retain)
        settled.append(len(offloader._step.live_entries()))
        del loss
    offloader.close()
    assert settled[:3] == [0, 0, 0] and settled[3] > 0, settled


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_host_arena_serves_the_next_step_while_the_last_ones_loss_lives(device):
    """A usual loop keeps the loss (and so its graph) until the next forward has made a new
    one: the kept outputs' payloads of the layers run first without autograd are given back
    as each layer's backward ends, so the next step's payloads find their arena regions free
    (they were busy, and went to memory of their own: on CUDA, pinned anew)."""
    from cswap_lightning.commands.bench_measure import Method, _engine_summary

    built, offloader = llama_below_the_layer(device)
    offloader.transfer.arena_everywhere = True  # the CPU's payloads too (CUDA's always)
    model, reports = built.model, []
    for _ in range(6):
        with offloader:
            loss = built.loss(model, built.inputs)  # the last step's loss lives until here
        loss.backward()
        offloader.transfer.drain()
        reports.append(offloader.transfer.host_memory.report())
    # what the benchmarks' rows say of it (on CUDA, each payload on its own is pinned anew)
    arena = _engine_summary(Method("cswap", model, offloader=offloader))["host_arena"]
    offloader.close()
    settled = reports[3:]  # planned, and run first without autograd
    assert all(r.hits and not r.fallbacks for r in settled), [str(r) for r in settled]
    assert arena == {"hits": reports[-1].hits, "own_memory": 0, "why": {},
                     "bytes": reports[-1].arena_bytes}


# the first run without autograd (lean.py) -----------------------------------------------------
def leaning(monkeypatch) -> list[bool]:
    """Whether each first run without autograd below the layer was settled (its kept outputs
    given back in backward), as it happens."""
    settled = []
    real = selective.Region.close_lean

    def close_lean(self, output):
        real(self, output)
        settled.append(not self.whole)

    monkeypatch.setattr(selective.Region, "close_lean", close_lean)
    return settled


def held(monkeypatch) -> list[bool]:
    """Whether each kept call was found held outside its block (``_Kept.held_elsewhere``):
    never, in a model that hands nothing out but what autograd saves (a false finding only
    costs time: the call runs again)."""
    found = []
    real = selective._Kept.held_elsewhere

    def held_elsewhere(self):
        found.append(real(self))
        return found[-1]

    monkeypatch.setattr(selective._Kept, "held_elsewhere", held_elsewhere)
    return found


def packing(monkeypatch) -> list[tuple[bool, int]]:
    """For each call of a layer below the layer, whether it ran without autograd, and how
    many kept outputs it passed through the step's pack hook."""
    packed = []
    real_pack, real_lean = selective.Region._pack, selective.Region.lean

    def lean(self):
        self.ran_lean = True
        return real_lean(self)

    def pack(self):
        real_pack(self)
        if self.hooks is not None:
            packed.append((getattr(self, "ran_lean", False),
                           sum(len(k.tensors()) for k in self.made)))

    monkeypatch.setattr(selective.Region, "lean", lean)
    monkeypatch.setattr(selective.Region, "_pack", pack)
    return packed


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_layers_below_the_layer_run_first_without_autograd_once_settled(name, monkeypatch):
    """Measured plainly, then under checkpoint (watched, the choice settled), then without
    autograd: bitwise plain training throughout (dropout and attention's included), the same
    outputs kept, through the step's hooks."""
    settled, packed, verdicts = leaning(monkeypatch), packing(monkeypatch), {}
    torch.manual_seed(0)
    built = BUILDERS[name]()
    plain = train(built, STEPS + 1)
    steps, _ = below_layers(built, "raw", STEPS + 1, verdicts=verdicts)
    assert not differences(plain, steps)
    layers = every_layer_below(built.model)
    assert verdicts == dict.fromkeys(layers, "")
    assert settled == [True] * 2 * len(layers)
    assert [lean for lean, _ in packed] == [False] * len(layers) + [True] * 2 * len(layers)
    kept = [n for _, n in packed]
    assert kept == kept[:len(layers)] * 3 and min(kept) > 0


@pytest.mark.parametrize("weight", WEIGHTS)
def test_a_bfloat16_layers_casts_are_kept_or_run_again_like_its_other_operators(weight,
                                                                              monkeypatch):
    """A bfloat16 Llama's norms take their input to float32 and back: those casts are the
    layer's own operators (``ops.uncounted``), so a way that weighs the work run again may
    keep a norm's bfloat16 output and run only the casts again, where every cast used to run
    again, and with it the norm. Measured, watched under checkpoint, then without autograd:
    bitwise plain training, every layer settled."""
    made = []
    real = selective.Choice.make

    def make(self, *args):
        made.append(self)
        return real(self, *args)

    monkeypatch.setattr(selective.Choice, "make", make)
    torch.manual_seed(0)
    built = in_bfloat16(BUILDERS["llama"]())
    plain = train(built, STEPS + 1)
    verdicts: dict[str, str] = {}
    steps, _ = below_layers(built, "raw", STEPS + 1, weight=weight, verdicts=verdicts)
    assert not differences(plain, steps)
    assert verdicts == dict.fromkeys(every_layer_below(built.model), "")
    casts = [n for c in made if c.weight == weight for func, n in c.kept
             if func is torch.ops.aten._to_copy.default]
    assert bool(casts) == (weight > 0)


class Sliced(torch.nn.Module):
    """A layer called on a slice of the first one's output, then on all of it (a head shared
    by feature maps): a linear layer runs other operators on the strided slice."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.layers[0](x)
        part = y[:, :3] + self.layers[1](y[:, :3])
        return part.sum(1, keepdim=True) + y + self.layers[1](y)


def test_a_layer_called_on_a_slice_and_whole_has_a_choice_for_each(monkeypatch):
    """Its two calls run other operators: one choice for both was made again at every step
    (and never ran without autograd); each kind of call (``selective.signature``) has its
    own, made once. Nor is the engine's own work in the hooks around a unit inside a layer
    one of the layer's operators (the first version probe's empty tensor was)."""
    again = choosing_again(monkeypatch)
    monkeypatch.setattr(tensors, "_EMPTY", {})
    bitwise_below(Sliced())
    assert not again


class Changing(torch.nn.Module):
    """Two layers that run one more operator from the third step on."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Extra() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).sin()
        return (h.exp().log() if self.extra else h) * x


def test_a_layer_that_runs_other_operators_without_autograd_is_recomputed_whole(monkeypatch):
    """Its kept outputs could not be matched in backward: it runs everything again there
    (bitwise still), and stays under checkpoint from then on, choosing again."""
    settled, verdicts = leaning(monkeypatch), {}
    steps_run = []

    def loss(model, inputs):
        steps_run.append(None)
        for layer in model.layers:
            layer.extra = len(steps_run) % (STEPS + 2) >= 3  # from each run's third step
        return model(inputs["x"]).square().mean()

    torch.manual_seed(0)
    built = Built(Changing(), {"x": torch.randn(2, 6, 32, requires_grad=True)}, loss)
    plain = train(built, STEPS + 2)
    steps, _ = below_layers(built, "raw", STEPS + 2, verdicts=verdicts)
    assert not differences(plain, steps)
    assert settled == [False, False]  # the third step's; then under checkpoint
    assert verdicts == dict.fromkeys(every_layer_below(built.model), recompute.UNSETTLED)


# An attention-like operator that, without autograd, leaves out what its backward reads (as
# CUDA's efficient attention leaves out its log-sum-exp): kept below the layer.
@torch.library.custom_op("cswap_test::attend", mutates_args=())
def attend(x: torch.Tensor, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.logsumexp(-1) if with_lse else x.new_empty(0)


def _attend_saves(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _attend_backward(ctx, grad, _):
    (lse,) = ctx.saved_tensors  # empty without autograd: broadcasting it fails
    return grad * 2 * (lse.unsqueeze(-1) * 0 + 1), None


torch.library.register_autograd("cswap_test::attend", _attend_backward, setup_context=_attend_saves)


class Attend(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = torch.ops.cswap_test.attend(self.linear(x), torch.is_grad_enabled())
        return h.sin() * x


class Attending(Changing):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Attend() for _ in range(2))


@pytest.fixture
def attending(monkeypatch) -> Iterator[Built]:
    """Two layers that attend, their operator's outputs kept below the layer."""
    monkeypatch.setitem(ops.KINDS, torch.ops.cswap_test.attend, "attention")
    ops.facts.cache_clear()
    yield Built(Attending(), {"x": torch.randn(2, 6, 32, requires_grad=True)},
                lambda model, inputs: model(inputs["x"]).square().mean())
    ops.facts.cache_clear()


def test_the_attention_kernels_asked_for_their_log_sum_exp_take_it_where_asked():
    """The position each is asked at is its schema's ``compute_log_sumexp`` (a torch that
    moved it would be asked something else)."""
    for func, at in selective._WITH_AUTOGRAD.items():
        assert func._schema.arguments[at].name == "compute_log_sumexp", func


@pytest.mark.parametrize("asked", [True, False])
def test_an_operator_that_makes_other_outputs_without_autograd_is_asked_as_autograd_asks(
        attending, asked, monkeypatch):
    """Run first without autograd, an operator known to leave out what backward reads is
    called as autograd's run calls it (kept, bitwise); one not known makes outputs of other
    shapes than the settled call's: the layer is recomputed whole (bitwise), then stays under
    checkpoint."""
    if asked:
        monkeypatch.setitem(selective._WITH_AUTOGRAD, torch.ops.cswap_test.attend.default, 1)
    settled, verdicts = leaning(monkeypatch), {}
    torch.manual_seed(0)
    plain = train(attending, STEPS + 1)
    steps, _ = below_layers(attending, "raw", STEPS + 1, verdicts=verdicts)
    assert not differences(plain, steps)
    layers = every_layer_below(attending.model)
    if asked:
        assert settled == [True] * 2 * len(layers)
        assert verdicts == dict.fromkeys(layers, "")
    else:
        assert settled == [False] * len(layers)
        assert verdicts == dict.fromkeys(layers, recompute.UNSETTLED)



@contextlib.contextmanager
def left_to_the_collector() -> Iterator[list[torch.Tensor]]:
    """The tensors and storages only reference cycles held once the block ran: Python's cycle
    collector frees them whenever it runs; until then the device's memory stays taken (on the
    H200, the allocator's peak of layers recomputed below the layer rose above plain
    training's)."""
    found: list[torch.Tensor] = []
    gc.collect()
    gc.disable()
    try:
        yield found
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        # not a compiled graph's fake tensors (an earlier test's, let go of meanwhile): no
        # memory of a device
        found += [o for o in gc.garbage if isinstance(o, (torch.Tensor, torch.UntypedStorage))
                  and not isinstance(o, FakeTensor) and o.device.type != "meta"]
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("way", ["below", "below, under checkpoint", "whole",
                                 "whole, under checkpoint", "swapped"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_no_tensor_of_a_step_waits_for_the_cycle_collector(name, way):
    """Every way a layer runs leaves no tensor in a reference cycle (a mode's hook held the
    mode, its region and the kept outputs: freed only when the collector ran)."""
    torch.manual_seed(0)
    built = BUILDERS[name]()
    lean = "checkpoint" not in way
    with left_to_the_collector() as found:
        if way.startswith("below"):
            below_layers(built, "keep", STEPS + 1, lean=lean)
        elif way.startswith("whole"):
            test_recompute.recomputing(built, "keep", steps=STEPS + 1, lean=lean)
        else:
            train(built, STEPS, cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0)))
    assert not found, f"{len(found)} tensors in reference cycles"

# layers the watch finds fit, every other architecture of the conformance suite
BELOW_LEAN = {"bert", "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma2", "falcon",
              "mamba", "vit", "resnet", "wav2vec2"}


def in_bfloat16(built: Built) -> Built:
    """``built`` with its weights and floating inputs in bfloat16 (no autocast: its norms'
    own casts to float32 and back are operators like any other)."""
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
              for k, v in built.inputs.items()}
    return replace(built, model=copy.deepcopy(built.model).to(torch.bfloat16), inputs=inputs)


@pytest.mark.parametrize("precision", ["float32", "autocast", "bfloat16"])
@pytest.mark.parametrize("name", list(conformance.HF))
def test_every_conformance_architecture_below_the_layer_trains_bitwise(name, precision):
    """Every Hugging Face architecture of the conformance suite, every layer below the layer:
    measured, watched under checkpoint (its choice settled), then without autograd where
    found fit; in float32, under CPU autocast, and in bfloat16 weights. Falcon's eager
    attention divides its scores in place through the view its matmul returns
    (``test_an_output_changed_in_place_through_an_unsafe_view...``)."""
    built = conformance.build_hf(name, conformance.HF[name][1][0])
    built = {"float32": lambda b: b, "autocast": under_autocast,
             "bfloat16": in_bfloat16}[precision](built)
    plain = train(built, STEPS + 2)
    run = recomputing(built, "raw", lambda names: [n + BELOW for n in outermost(names)],
                      STEPS + 2)
    assert not differences(plain, run.steps)
    assert run.recomputed and all(n.endswith(BELOW) for n in run.recomputed)
    if name in BELOW_LEAN:
        assert set(run.verdicts.values()) == {""}


# the mechanism, on a function ----------------------------------------------------------------
W1, W2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
X = torch.randn(8, 16, requires_grad=True)


def grads_of(f, keep=None, hooks=None) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """``f(X)``'s gradients (seeded alike) plainly, or with ``keep`` below the layer; and the
    shapes the saved-tensor hooks saw."""
    torch.manual_seed(1)
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if keep is None:
            y = f(X)
        else:
            y = below_through(f, Region((pack, lambda t: t), keep), X)
    y.square().sum().backward()
    out = [t.grad.clone() for t in (W1, W2, X)]
    for t in (W1, W2, X):
        t.grad = None
    return out, model_shapes(shapes)


def dropout_between(x: torch.Tensor) -> torch.Tensor:
    h = torch.native_dropout(x @ W1, 0.5, True)[0]  # a random operator, kept by a test policy
    return (F.dropout(h.sin(), 0.3, True) @ W2).tanh() + x


def test_only_the_kept_outputs_and_the_input_go_through_the_hooks():
    plain, saved = grads_of(dropout_between)
    got, kept = grads_of(dropout_between, ops.kept)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert kept == [(8, 16), (8, 32), (8, 16)]  # the input, the two matmuls' outputs
    assert len(saved) > 2 * len(kept)


A, B = torch.randn(16, 2, requires_grad=True), torch.randn(2, 32, requires_grad=True)


def adapted(x: torch.Tensor) -> torch.Tensor:
    """A LoRA-adapted matmul (the adapter's second product far cheaper than the base's) and
    an activation that saves its input: the adapter's sum."""
    return (F.silu(x @ W1 + (x @ A) @ B * 0.5) @ W2).tanh()


def test_a_choice_keeps_the_adapters_sum_and_runs_no_matmul_again(monkeypatch):
    """Made from the first forward, the choice keeps the adapted sum (as many bytes as the
    base's output it replaces): the second recomputation runs neither the adapter's scaling
    nor the sum again, the first (which kept the products) did; both give the plain
    gradients bit for bit."""
    weights = (W1, W2, X, A, B)

    def gradients(region: Region | None) -> list[torch.Tensor]:
        y = adapted(X) if region is None else below_through(adapted, region, X)
        y.square().sum().backward()
        out = [t.grad.clone() for t in weights]
        for t in weights:
            t.grad = None
        return out

    plain = gradients(None)
    choice = selective.Choice()
    ran: list[list[str]] = []
    real = selective.Recomputing._run

    def run(self, func, args, kwargs):
        ran[-1].append(func.overloadpacket.__name__)
        return real(self, func, args, kwargs)

    monkeypatch.setattr(selective.Recomputing, "_run", run)
    for _ in range(2):
        ran.append([])
        got = gradients(Region(None, choice=choice))
        assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
        assert choice.kept is not None
    assert "add" in ran[0] and "mul" in ran[0]  # the sum made again from the products
    assert not {"mm", "mul", "add"} & set(ran[1]) and "silu" in ran[1]


def test_a_kept_random_operator_leaves_the_generator_as_its_first_run_did(monkeypatch):
    """A kept operator that draws random numbers is not run again: the generator's state
    after it is put back, so the dropout after it draws the same mask. Without that, the
    gradients differ (the negative control)."""
    plain, _ = grads_of(dropout_between)

    def keep(func) -> bool:
        return ops.kept(func) or func.overloadpacket is torch.ops.aten.native_dropout

    got, _ = grads_of(dropout_between, keep)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    monkeypatch.setattr(selective, "_rng_states", lambda *args: [])
    worse, _ = grads_of(dropout_between, keep)
    assert not all(torch.equal(a, b) for a, b in zip(plain, worse, strict=True))


def changed_in_place(x: torch.Tensor) -> torch.Tensor:
    h = x @ W1
    h.mul_(2)  # the matmul's output, changed: recomputed instead of kept
    return (h.relu() @ W2).tanh() @ W2.t()  # returned: recomputed too


def divided_in_place(x: torch.Tensor) -> torch.Tensor:
    h = x.view(2, 4, 16) @ W1  # mm, then the _unsafe_view matmul returns: no shared version
    h /= 2.0  # as Falcon's eager attention scales its scores
    return (h.softmax(-1) @ W2).sum(1)


@pytest.mark.parametrize("seen", [True, False])
def test_an_output_changed_in_place_through_an_unsafe_view_is_recomputed_not_kept(
        seen, monkeypatch):
    """Its version does not move, its storage is written: kept, the recomputation would
    divide it twice."""
    if not seen:  # the calls whose storage a later call wrote stay kept
        real = selective.staying
        monkeypatch.setattr(selective, "staying",
                            lambda calls, returned, changed: real(calls, returned, ()))
    plain, _ = grads_of(divided_in_place)
    got, kept = grads_of(divided_in_place, ops.kept)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True)) is seen
    assert ((8, 32) in kept) is not seen  # the product's output, through the hooks


def test_outputs_changed_in_place_or_returned_are_recomputed_not_kept():
    plain, _ = grads_of(changed_in_place)
    got, kept = grads_of(changed_in_place, ops.kept)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    assert kept == [(8, 16), (8, 16)]  # the input, and the second matmul's output alone


def choosing_again(monkeypatch) -> list[selective.Choice]:
    """The choices a recomputed forward made choose again (it ran other operators), as
    they do."""
    again = []
    real = selective.Choice.check

    def check(self, flow):
        real(self, flow)
        again.extend([self] if self.kept is None else [])

    monkeypatch.setattr(selective.Choice, "check", check)
    return again


def bitwise_below(model: torch.nn.Module) -> list[BlockCall]:
    """Train ``model`` (on one input, its output's mean square the loss) with every layer
    below the layer, what they keep kept and swapped raw, bitwise as plainly; the measured
    step's block calls."""
    torch.manual_seed(0)
    built = Built(model, {"x": torch.randn(2, 6, 32, requires_grad=True)},
                  lambda model, inputs: model(inputs["x"]).square().mean())
    plain = train(built, STEPS)
    for plan in ("keep", "raw"):
        steps, calls = below_layers(built, plan)
        assert not differences(plain, steps), plan
    return calls


class Projected:
    """A layer's output of a class of the model's own, which pytree does not know."""

    def __init__(self, h: torch.Tensor, y: torch.Tensor) -> None:
        self.h, self.y = h, y


class Projecting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> Projected:
        h = self.linear(x)
        return Projected(h, (h * 2.0).sin())  # sin saves its input, made from h


class Returning(torch.nn.Module):
    """Two layers, each returning its matmul's output in a ``Projected``, which the caller
    changes in place; each layer's recomputation needs that output as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Projecting() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            out = layer(x)
            out.h.add_(1.0)
            x = out.h * out.y
        return x


def test_an_output_returned_in_an_object_of_the_models_own_is_recomputed_not_kept():
    """A tensor found only in the attributes of what a block returned is returned too (kept,
    the caller changed it before the recomputation needed it: the engine's version check
    raised where plain training runs)."""
    calls = bitwise_below(Returning())
    layers = [c for c in calls if c.below]
    assert layers and not any(c.below[0].kept[1:] for c in layers)  # the returned matmul output


class Twice(torch.nn.Module):
    """Two layers, the first called again after the second (weight sharing), under CPU
    autocast: the second call finds its weights' bf16 casts cached by the first, its
    recomputation (a fresh autocast) casts them again."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in (*self.layers, self.layers[0]):
                x = x + layer(x)
        return x.float()


def test_a_layer_called_twice_under_autocast_is_bitwise_plain_training(monkeypatch):
    """Only the kept operators are matched between the forward and its recomputation: the
    weight casts the recomputation of the second call runs again (not cached there) were
    counted as operators its forward never ran. Nor do the casts count between the two
    calls' forwards: the layer's choice holds for both."""
    again = choosing_again(monkeypatch)
    calls = bitwise_below(Twice())
    assert sum(len(c.below[0].kept) - 1 for c in calls if c.below) > 0
    assert not again


MOE = dict(LLAMAISH, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
           output_router_logits=True, router_aux_loss_coef=0.5)


@pytest.mark.parametrize("how", ["below", "whole"])
def test_hugging_faces_output_capturing_hooks_leave_its_layers_recomputable(how):
    """A Mixtral trained with its router's auxiliary loss: Hugging Face collects the router
    logits with forward hooks on the layers' modules, inert outside the model's forward.
    They were taken for hooks a recomputation would run again with effect, and no layer was
    recomputed, whole or below the layer."""
    torch.manual_seed(0)
    built = causal_lm("MixtralConfig", **MOE)("sdpa")
    plain = train(built, STEPS)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    chosen: list[str] = []

    def prepare(model: torch.nn.Module) -> None:
        names = every_layer_below(model)
        chosen.extend(names if how == "below" else [n.removesuffix(BELOW) for n in names])
        assert not offloader.watch(model).recompute(chosen)

    steps = train(built, STEPS, offloader, prepare)
    recomputed = offloader.recomputed
    offloader.close()
    assert not differences(plain, steps)
    assert recomputed == set(chosen)
    assert len(steps[1].stats.sites) < len(steps[0].stats.sites)


# which blocks ---------------------------------------------------------------------------------
def test_a_block_below_the_layer_is_named_after_it_and_never_beside_it_whole():
    model = case("gpt2")[0].model
    assert list(below(units(model))) == [f"transformer.h.{i}{BELOW}" for i in range(3)]
    offloader = cswap.Offloader().watch(model)
    skipped = offloader.recompute(["transformer.h.0:elementwise", "transformer.h.0",
                                   "transformer.h.1:elementwise", "transformer.h.1.mlp.act"])
    assert skipped == {
        "transformer.h.0:elementwise": "inside transformer.h.0, recomputed as a whole",
        "transformer.h.1.mlp.act": "inside transformer.h.1:elementwise, recomputed below the "
                                   "layer"}
    assert offloader.recomputed == {"transformer.h.0", "transformer.h.1:elementwise"}
    with pytest.raises(ValueError, match="':elementwise'"):
        offloader.recompute(["transformer.h.0.mlp.act:elementwise"])
    with pytest.raises(ValueError, match="'transformer.h.0', which is not chosen below"):
        offloader.recompute(["transformer.h.0"], {"transformer.h.0": 0.2})
    with pytest.raises(ValueError, match="at least 0.*-1"):
        offloader.recompute(["transformer.h.1:elementwise"], {"transformer.h.1:elementwise": -1})
    assert offloader.recomputed == {"transformer.h.0", "transformer.h.1:elementwise"}
    offloader.close()


def test_a_compiled_block_is_recomputed_whole_not_below_the_layer():
    """Its operators run inside a compiled graph, out of the dispatch modes' reach."""
    model = BUILDERS["gpt2"]().model
    cswap.compile_blocks(model, backend="aot_eager")
    offloader = cswap.Offloader().watch(model)
    skipped = offloader.recompute(["transformer.h.0:elementwise", "transformer.h.1"])
    assert list(skipped) == ["transformer.h.0:elementwise"]
    assert "compiled" in skipped["transformer.h.0:elementwise"]
    assert offloader.recomputed == {"transformer.h.1"}
    offloader.close()


# the replay and the planner -------------------------------------------------------------------
MB = 10**6
LINK = replay.Link(d2h=1000 * MB, h2d=1000 * MB)  # 1 MB per millisecond each way
ENGINE = replay.Engine(min_bytes=1, prefetch_bytes=10**12, inflight_bytes=10**12,
                       host_s_per_move=0.0)


def layer_and_head(kept: tuple[int, ...] = (2 * MB, 4 * MB)) -> Workload:
    """A layer saving 2 MB (its input), 10 and 10 MB (elementwise results), 4 ms of forward
    of which 0.5 ms elementwise; below the layer it keeps ``kept``; a head saving 20 MB."""
    saved = (Saved("l.in", "bfloat16", 2 * MB, 2 * MB, 0, False, False),
             Saved("l.act", "bfloat16", 10 * MB, 10 * MB, 1, False, False),
             Saved("l.mul", "bfloat16", 10 * MB, 10 * MB, 2, False, False),
             Saved("head", "bfloat16", 20 * MB, 20 * MB, 3, False, False))
    ops_ = (Op("l", 0, range(3), 0.004, 0.008, 0, 0, 0),
            Op("head", 1, range(3, 4), 0.001, 0.001, 0, 0, 0))
    blocks = (Block("l", range(1), True, below=(Below(kept, 0.0005, "bfloat16"),)),
              Block("head", range(1, 2), False))
    return Workload("test", 1, saved, ops_, blocks, 0, 0, 0)


def test_the_replay_recomputes_below_the_layer_from_what_it_kept():
    w = layer_and_head().with_below()
    assert [b.name for b in w.blocks] == ["l:elementwise", "head"]
    assert w.blocks[0].parent == "l" and w.blocks[0].selective
    plain = replay.predict(w, link=LINK, engine=ENGINE)
    below_ = replay.predict(w, replay.Mix(blocks={"l:elementwise": replay.RECOMPUTE}), LINK,
                            ENGINE)
    whole = replay.predict(w.merged({"l"}), replay.Mix(blocks={"l": replay.RECOMPUTE}), LINK,
                           ENGINE)
    assert plain.peak_bytes == 42 * MB  # at the head: everything
    assert below_.peak_bytes == 26 * MB  # the head beside the 6 MB kept
    assert whole.peak_bytes == 22 * MB  # beside the input alone
    assert below_.recompute_s == pytest.approx(0.0005)
    assert whole.recompute_s == pytest.approx(0.004)
    swapped = replay.predict(w, replay.Mix(blocks={"l:elementwise": replay.BlockDecision(
        "recompute", swap_input=True)}), LINK, ENGINE)
    # what it kept went to host memory: the peak is the layer's own forward, and its 22 MB
    # again in backward
    assert swapped.peak_bytes == 22 * MB and swapped.peak_at == "forward l"
    assert swapped.d2h_bytes == swapped.h2d_bytes == 6 * MB


def test_the_mix_weighs_a_layer_below_beside_it_whole():
    """With room for 26 MB the layer recomputed below (0.5 ms) fits and costs less than
    whole (4 ms); with 22 MB only whole fits."""
    w = layer_and_head().with_below()
    fast = mix.choose(w, 26 * MB, LINK, ENGINE)
    assert [d.action for d in fast.decisions()] == ["recompute", "keep"]
    assert fast.workload.blocks[0].name == "l:elementwise"
    tight = mix.choose(w, 22 * MB, LINK, ENGINE)
    assert [b.name for b in tight.workload.blocks] == ["l", "head"]
    assert tight.fits and tight.prediction.step_s > fast.prediction.step_s
    assert "recompute below" in mix.table(fast)


def test_the_planner_recomputes_a_layer_below_where_that_frees_enough_for_less():
    """The measured step's block calls say what recomputing each layer below would keep and
    cost: with room for all but the elementwise results of one layer, the planner picks
    that layer below the layer, not whole."""
    MiB = 1 << 20
    sizes = [MiB, 8 * MiB, 8 * MiB, MiB, MiB, 8 * MiB, 8 * MiB, MiB]
    profiles = [SiteProfile(k, (n // 4,), "float32", n, True, module=f"m{k}", forward_s=0.005,
                            backward_s=0.005) for k, n in enumerate(sizes)]
    calls = [BlockCall("h.0", 0, 4, 1, MiB, 0.02, (Below((MiB, MiB), 0.001),)),
             BlockCall("h.1", 4, 8, 1, MiB, 0.02, (Below((MiB, MiB), 0.001),))]
    found = live.candidates(profiles, calls)
    assert len(found) == 2 and found[1].blocks[0].name == "h.0:elementwise"
    fast = replay.Link(1e12, 1e12, 1e13)
    choice = live.choose_recompute(found, 24 * MiB, fast, replay.Engine(min_bytes=1 << 30))
    assert choice.names == ("h.0:elementwise",), choice.mix.how
    whole = live.choose_recompute(found, 13 * MiB, fast, replay.Engine(min_bytes=1 << 30))
    assert set(whole.names) == {"h.0", "h.1"}, whole.mix.how


def layers_and_head(layers: int = 2, ways: tuple[Below, ...] = (
        Below((2 * MB, 2 * MB), 0.004), Below((2 * MB, 6 * MB), 0.001, weight=0.2))
        ) -> Workload:
    """Layers saving 2 MB (input), 10 and 10 MB each, 20 ms of forward; below the layer each
    keeps 4 MB for 4 ms, or (weight 0.2) 8 MB for 1 ms (``ways``); a head saving 20 MB."""
    saved, ops_, blocks = [], [], []
    for layer in range(layers):
        first = len(saved)
        for name, n in (("in", 2), ("act", 10), ("mul", 10)):
            saved.append(Saved(f"l{layer}.{name}", "bfloat16", n * MB, n * MB, len(saved),
                               False, False))
        ops_.append(Op(f"l{layer}", layer, range(first, len(saved)), 0.020, 0.040, 0, 0, 0))
        blocks.append(Block(f"l{layer}", range(layer, layer + 1), True, below=ways))
    saved.append(Saved("head", "bfloat16", 20 * MB, 20 * MB, len(saved), False, False))
    ops_.append(Op("head", layers, range(len(saved) - 1, len(saved)), 0.001, 0.001, 0, 0, 0))
    blocks.append(Block("head", range(layers, layers + 1), False))
    return Workload("test", 1, tuple(saved), tuple(ops_), tuple(blocks), 0, 0, 0)


def test_the_mix_takes_a_way_below_the_layer_per_layer():
    """With room for one layer's heavier way beside the other's lighter one (32 MB), but not
    for both heavier: one layer each way beats either way for both, within the budget."""
    w, engine = layers_and_head(), replay.Engine(min_bytes=1 << 40)  # nothing swapped
    ways = w.ways_below()
    assert len(ways) == 2
    alike = [mix.choose(way, 32 * MB, LINK, engine) for way in ways]
    chosen, choice = mix.choose_among((w, *ways), 32 * MB, LINK, engine)
    assert choice.fits and choice.prediction.peak_bytes <= 32 * MB
    assert sorted(b.selective.weight for b in chosen.blocks if b.selective) == [0.0, 0.2]
    fastest_alike = min(c.prediction.step_s for c in alike if c.fits)
    assert choice.prediction.step_s < fastest_alike
    assert "weight 0 (1 blocks), 0.2 (1 blocks)" in choice.how


def test_the_mix_swaps_its_first_layers_whole_and_the_next_below_the_layer():
    """Four layers, a link of 0.5 MB per ms, a budget of the head's 20 MB and 6 more: the
    link carries the first two layers whole inside forward, the third's 4 MB kept below the
    layer, and the fourth is recomputed below the layer: 8 ms of recomputation, where
    swapping every layer one way (whole, or below the layer) needs more."""
    w = layers_and_head(4, ways=(Below((2 * MB, 2 * MB), 0.004),)).with_below()
    link, engine = replay.Link(d2h=500 * MB, h2d=500 * MB), replace(ENGINE, prefetch_bytes=4 * MB)
    keep = replay.predict(w, link=link, engine=engine)
    chosen = mix.choose(w, keep.peak_bytes - 82 * MB, link, engine)
    assert chosen.fits, chosen.how
    assert [(d.action, d.swap_input) for d in chosen.decisions()] == [
        ("swap", False), ("swap", False), ("recompute", True), ("recompute", False),
        ("keep", False)]
    assert chosen.how.startswith("swap the earliest 3 blocks (the first 2 whole, the rest below")
    assert chosen.prediction.recompute_s == pytest.approx(0.008)
    alike = [p.step_s for how, p in chosen.candidates.items() if "whole, the rest" not in how]
    assert chosen.prediction.step_s < min(alike)


@pytest.mark.parametrize("heavier_s, weight", [(0.0002, 0.2), (0.002, 0.0)])
def test_the_planner_takes_the_way_below_the_layer_that_costs_least_at_its_budget(
        heavier_s, weight):
    """Each layer's recomputation below the layer measured two ways: the fewest bytes kept
    (1 MiB beside the input, 1 ms) and, weighed at 0.2, 3 MiB for ``heavier_s``. Both free
    enough at the budget: the planner takes the cheaper, and tells the engine its weight."""
    MiB = 1 << 20
    sizes = [MiB, 8 * MiB, 8 * MiB, MiB, MiB, 8 * MiB, 8 * MiB, MiB]
    profiles = [SiteProfile(k, (n // 4,), "float32", n, True, module=f"m{k}", forward_s=0.005,
                            backward_s=0.005) for k, n in enumerate(sizes)]
    ways = (Below((MiB, MiB), 0.001), Below((MiB, 3 * MiB), heavier_s, weight=0.2))
    calls = [BlockCall("h.0", 0, 4, 1, MiB, 0.02, ways),
             BlockCall("h.1", 4, 8, 1, MiB, 0.02, ways)]
    found = live.candidates(profiles, calls)
    assert [w.blocks[0].name for w in found] == ["h.0", "h.0:elementwise", "h.0:elementwise"]
    fast = replay.Link(1e12, 1e12, 1e13)
    choice = live.choose_recompute(found, 24 * MiB, fast, replay.Engine(min_bytes=1 << 30))
    assert choice.names == ("h.0:elementwise",), choice.mix.how
    assert choice.weights == {"h.0:elementwise": weight}


# on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("weight", [WEIGHTS[0], WEIGHTS[-1]])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_on_cuda_layers_below_the_layer_are_bitwise_plain_training(name, weight, monkeypatch):
    """On CUDA the attention with dropout is one fused kernel, kept: it is not run again, and
    the generator's state after it is put back for the dropout after it; by the fewest bytes
    and by the heaviest way; under checkpoint, then run first without autograd."""
    settled, found = leaning(monkeypatch), held(monkeypatch)
    torch.manual_seed(0)
    built = BUILDERS[name]()
    built = Built(built.model.cuda(), {k: v.cuda() for k, v in built.inputs.items()},
                  built.loss)
    plain = train(built, STEPS + 1)
    steps, _ = below_layers(built, "raw", STEPS + 1, weight=weight)
    assert not differences(plain, steps)
    assert steps[1].stats.offloaded_bytes > 0
    assert settled and all(settled)
    assert found and not any(found)  # CUDA's fused attention's outputs: none held elsewhere


@pytest.mark.gpu
def test_on_cuda_the_allocators_peak_drops_by_what_the_layers_no_longer_keep():
    """The allocator counts what the ledger does not (a layer's recomputed tensors in its
    backward): its peak still drops, by more than half of what the ledger says."""
    from test_recompute import readme_gpt2

    built = readme_gpt2("cuda")
    steps, _ = below_layers(built, "keep", steps=2)
    plain, recomputed = steps[0].stats, steps[1].stats
    freed = plain.peak_resident_bytes - recomputed.peak_resident_bytes
    assert freed > 0
    assert plain.peak_allocated_bytes - recomputed.peak_allocated_bytes > 0.5 * freed


def test_below_scale_prices_below_the_layer_and_leaves_whole_layers_as_profiled():
    """The other bracket (``Engine.below_scale``): below the layer measured dearer than
    estimated on the H200."""
    w = layer_and_head().with_below()
    dearer = replace(ENGINE, below_scale=2.0)
    below_ = replay.Mix(blocks={"l:elementwise": replay.RECOMPUTE})
    assert replay.predict(w, below_, LINK, dearer).recompute_s == pytest.approx(
        2 * replay.predict(w, below_, LINK, ENGINE).recompute_s)
    whole = replay.Mix(blocks={"l": replay.RECOMPUTE})
    merged = w.merged({"l"})
    assert replay.predict(merged, whole, LINK, dearer).recompute_s == pytest.approx(
        replay.predict(merged, whole, LINK, ENGINE).recompute_s)
    with pytest.raises(ValueError, match="below_scale.*0"):
        replay.Engine(below_scale=0.0)


def test_recompute_scale_prices_whole_layers_and_leaves_below_the_layer_as_estimated():
    """The bracket's share (``Engine.recompute_scale``) is what checkpointing whole layers
    measured; below the layer measured dearer than estimated, so it is not scaled."""
    w = layer_and_head().with_below()
    cheaper = replace(ENGINE, recompute_scale=0.5)
    below_ = replay.Mix(blocks={"l:elementwise": replay.RECOMPUTE})
    assert replay.predict(w, below_, LINK, cheaper).recompute_s == pytest.approx(0.0005)
    whole = replay.Mix(blocks={"l": replay.RECOMPUTE})
    assert replay.predict(w.merged({"l"}), whole, LINK, cheaper).recompute_s == pytest.approx(
        0.002)
