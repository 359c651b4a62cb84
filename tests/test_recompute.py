"""Recomputing blocks (``core/recompute.py``, ``Offloader.recompute``): which blocks a model has,
training with some of them recomputed is bitwise plain training, the engine sees a recomputed
block's inputs and nothing it saves inside, the measured steps run plainly and time each block,
and the switch, the integrations and ``compile_blocks`` go along."""

from __future__ import annotations

import copy
import functools
import pickle
from dataclasses import dataclass

import pytest
import torch
from test_conformance import (
    BATCH,
    BERTISH,
    LLAMAISH,
    VOCAB,
    Built,
    _gen,
    causal_lm,
    differences,
    masked_lm,
    torch_case,
    train,
)
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import cswap_lightning as cswap
from cswap_lightning.core.compile import blocks, is_compiled
from cswap_lightning.core.recompute import BlockCall, RecomputedForward, renumbered, units
from cswap_lightning.recipes.nets import build_cnn, resnet50, vgg16

STEPS = 3  # the first is measured (plain), the others recompute


def mlp(width: int = 16, depth: int = 4) -> nn.Sequential:
    """An MLP of blocks (Linear, GELU, Dropout): a block recomputed keeps only its input."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                                         nn.Linear(4 * width, width)) for _ in range(depth)])


def images(channels: int, size: int) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size, generator=_gen())


GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}
BUILDERS = {
    # dropout 0.1; a cache is passed to the layers in training
    "gpt2": lambda: causal_lm("GPT2Config", **GPT2)("sdpa"),
    "gpt2_eager": lambda: causal_lm("GPT2Config", **GPT2)("eager"),
    "bert": lambda: masked_lm("BertConfig", **BERTISH)("sdpa"),
    "llama": lambda: causal_lm("LlamaConfig", **LLAMAISH)("sdpa"),
    "vgg16": lambda: torch_case(vgg16(width=2, num_classes=5), images(3, 32)),
    "resnet50": lambda: torch_case(resnet50(width=2, num_classes=5), images(3, 32)),
    "cnn": lambda: torch_case(build_cnn(width=4), images(1, 8)),
    "mlp": lambda: torch_case(mlp(), torch.randn(BATCH, 6, 16, generator=_gen())),
}


@functools.cache
def case(name: str) -> tuple[Built, list]:
    """The model's initial state and its plain training."""
    torch.manual_seed(0)
    built = BUILDERS[name]()
    return built, train(built, STEPS)


@dataclass
class Run:
    steps: list  # test_conformance.Step, with the offloader's statistics
    recomputed: frozenset[str]
    block_calls: list[BlockCall]  # the measured step's
    unfit: dict[str, str]
    verdicts: dict[str, str]  # whether each unit's first run went without autograd (lean.py)


def outermost(names: list[str]) -> list[str]:
    """The units not inside another: the blocks and stages, not their activations."""
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names)]


def recomputing(built: Built, plan: str, choose=outermost, steps: int = STEPS,
                lean: bool = True, whole: tuple[str, ...] | None = None,
                dropped: frozenset[int] = frozenset()) -> Run:
    """Train ``built`` under ``plan`` for ``steps`` steps, with the units ``choose`` picks
    recomputed from the first step after the measured one (``lean``: their first runs
    without autograd where they are found fit; ``whole``: on these device types, not the
    default ones, ``Verdicts.whole``; ``dropped``: as ``train``'s)."""
    offloader = cswap.Offloader(cswap.CSwapConfig(plan=plan, min_bytes=0, profile_steps=1,
                                                  budget=None))

    def prepare(model: nn.Module) -> None:
        skipped = offloader.watch(model).recompute(choose(list(units(model))))
        assert not skipped
        offloader.recomputer.verdicts.on = lean
        if whole is not None:
            offloader.recomputer.verdicts.whole = set(whole)

    try:
        record = train(built, steps, offloader, prepare, dropped=dropped)
        return Run(record, offloader.recomputed, offloader.block_calls,
                   dict(offloader.recomputer.unfit), dict(offloader.recomputer.verdicts.why))
    finally:
        offloader.close()


# the blocks ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_blocks_of_the_repos_networks_and_of_transformers():
    vgg = units(vgg16(width=2))
    assert list(vgg) == ["[0:5]", "[5:10]", "[10:17]", "[17:24]", "[24:31]"]  # to each max-pool
    assert vgg["[10:17]"].modules()[-1].__class__ is nn.MaxPool2d
    resnet = units(resnet50(width=2))  # the stem to its max-pool, then the 16 bottlenecks
    assert list(resnet) == ["[0:4]"] + [str(i) for i in range(4, 20)]
    assert list(units(build_cnn())) == ["[0:7]"]  # its head after the max-pool is no unit
    assert list(units(mlp(depth=2))) == ["0", "1", "0.1", "1.1"]  # the blocks, their GELUs
    assert units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == {}
    for name, prefix, activation in (
            ("gpt2", "transformer.h", "mlp.act"),
            ("bert", "bert.encoder.layer", "intermediate.intermediate_act_fn"),
            ("llama", "model.layers", "mlp.act_fn")):
        model = case(name)[0].model
        found = units(model)
        layers = outermost(list(found))
        assert layers == [f"{prefix}.{i}" for i in range(len(layers))] and len(layers) >= 2
        assert [found[n].module for n in layers] == blocks(model)  # compile_blocks' blocks
        assert [n for n in found if n not in layers] == [f"{n}.{activation}" for n in layers]


# bitwise training ---------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["raw", "zvc"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_training_with_recomputed_blocks_is_bitwise_plain_training(name, plan):
    built, plain = case(name)
    run = recomputing(built, plan)
    assert not differences(plain, run.steps)  # loss, gradients, buffers (BatchNorm), RNG state
    measured, recomputed = run.steps[0].stats, run.steps[1].stats
    assert run.recomputed == set(outermost(list(units(built.model))))
    # The measured step ran every block plainly; the next ones saved only the blocks' inputs.
    assert len(recomputed.sites) < len(measured.sites) / 2
    assert recomputed.offloaded_bytes > 0 and recomputed.stored_bytes > 0


def test_every_other_block_recomputed_is_bitwise_plain_training():
    built, plain = case("gpt2")
    run = recomputing(built, "zvc", lambda names: outermost(names)[::2])
    assert not differences(plain, run.steps)
    assert run.recomputed == {"transformer.h.0", "transformer.h.2"}


def test_layers_whole_beside_other_layers_activations_is_bitwise_plain_training():
    """The planner may recompute some layers whole and only the activation module of others."""
    built, plain = case("gpt2")

    def mixed(names: list[str]) -> list[str]:
        layers = outermost(names)
        return [layers[0], *(n for n in names if n not in layers and not n.startswith(
            layers[0] + "."))]

    run = recomputing(built, "raw", mixed)
    assert not differences(plain, run.steps)
    assert run.recomputed == {"transformer.h.0", "transformer.h.1.mlp.act",
                              "transformer.h.2.mlp.act"}


@pytest.mark.parametrize(("name", "gain"), [("gpt2", True), ("bert", False)])
def test_recomputed_activations_keep_only_their_input_where_they_save_more(name, gain):
    """GPT-2's gelu_new is four elementwise operations saving four tensors; BERT's GELU is one
    saving its input: recomputing it gains nothing, and the block timer's counts say so."""
    built, plain = case(name)

    def activations(names: list[str]) -> list[str]:
        return [n for n in names if n not in outermost(names)]

    run = recomputing(built, "raw", activations)
    assert not differences(plain, run.steps)
    calls = [c for c in run.block_calls if c.name in run.recomputed]
    assert len(calls) == len(run.recomputed) >= 2
    measured, recomputed = run.steps[0].stats, run.steps[1].stats
    inside = sum(c.stop_site - c.first_site for c in calls)
    assert len(recomputed.sites) == len(measured.sites) - inside + len(calls)
    if gain:
        assert all(c.stop_site - c.first_site > 2 * c.input_tensors for c in calls)
    else:
        assert all(c.stop_site - c.first_site == c.input_tensors == 1 for c in calls)


def test_an_activation_inside_a_recomputed_block_is_skipped():
    model = case("gpt2")[0].model
    offloader = cswap.Offloader().watch(model)
    skipped = offloader.recompute(["transformer.h.0.mlp.act", "transformer.h.0",
                                   "transformer.h.1.mlp.act"])
    assert skipped == {"transformer.h.0.mlp.act": "inside transformer.h.0, recomputed as a whole"}
    assert offloader.recomputed == {"transformer.h.0", "transformer.h.1.mlp.act"}
    offloader.close()


def test_without_putting_the_cache_back_gpt2_would_fail(monkeypatch):
    """The negative control: a recomputation given the cache Hugging Face passes in training
    as the first run left it attends to the keys written twice (24 of them for 12 tokens)."""
    from cswap_lightning.core import rerun

    monkeypatch.setattr(rerun.CacheStates, "restore", lambda self: None)
    with pytest.raises(RuntimeError, match=r"size of tensor a \(24\) must match .* \(12\)"):
        recomputing(case("gpt2_eager")[0], "raw")


def test_a_cache_is_put_back_as_it_was_each_time():
    """``CacheStates`` of a Hugging Face cache: put back after later updates (a layer written
    again, a layer added to its list), as often as a recomputation asks, its own copy intact."""
    from transformers.cache_utils import DynamicCache

    from cswap_lightning.core.rerun import CacheStates

    cache = DynamicCache()
    kv = [torch.randn(1, 2, 3, 4, generator=_gen()) for _ in range(4)]
    cache.update(kv[0], kv[1], 0)
    first = CacheStates.of([torch.ones(1), cache])
    assert first is not None and CacheStates.of([torch.ones(1)]) is None
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert {id(keys), id(values)} <= first.tensors()
    layers = len(cache.layers)
    for _ in range(2):
        cache.update(kv[2], kv[3], 0)  # written twice: six tokens
        cache.update(kv[2], kv[3], 1)
        now = first.again()
        first.restore()
        assert len(cache.layers) == layers and cache.get_seq_length(0) == 3
        assert cache.layers[0].keys is keys and cache.layers[0].values is values
        now.restore()
        assert cache.get_seq_length(0) == 6 and len(cache.layers) >= 2
        first.restore()


def test_a_cache_in_training_is_pointed_out_once(recwarn):
    """A model run with its key-value cache on hands it to every recomputed layer: said once,
    with the fix; without the cache nothing is said."""
    from cswap_lightning.core import recompute

    def said(use_cache: bool) -> list[str]:
        recompute._say_cache_on.cache_clear()
        built, _ = case("gpt2")
        recwarn.clear()
        recomputing(Built(built.model, built.inputs,
                          lambda model, inputs: model(**inputs, use_cache=use_cache).loss), "keep")
        return [str(w.message) for w in recwarn if "key-value cache" in str(w.message)]

    with_cache = said(True)
    assert len(with_cache) == 1 and "pass use_cache=False" in with_cache[0]
    assert said(False) == []


def test_without_putting_the_running_statistics_back_resnet_would_differ(monkeypatch):
    from cswap_lightning.core import rerun

    monkeypatch.setattr(rerun, "norm_buffers", lambda modules: [])
    built, plain = case("resnet50")
    run = recomputing(built, "raw")
    assert any("buffer" in line and "running_" in line for line in differences(plain, run.steps))


# what the engine sees ------------------------------------------------------------------------
class Scaled(nn.Module):
    """A block taking a tensor keyword argument (as Hugging Face layers take masks)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, note: str) -> torch.Tensor:
        assert note == "kept"
        return self.down(F.gelu(self.up(x))) * scale


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.ModuleList(Scaled(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((1, self.width), 0.5)
        for layer in self.layers:
            x = layer(x, scale=scale, note="kept")
        return x


def stack_case() -> Built:
    torch.manual_seed(0)
    return torch_case(Stack(), torch.randn(8, 16, generator=_gen()))


def test_the_engine_sees_a_recomputed_blocks_inputs_and_nothing_it_saves_inside():
    built = stack_case()
    plain = train(built, STEPS)
    run = recomputing(built, "keep", lambda names: outermost(names)[:2])
    assert not differences(plain, run.steps)
    measured, recomputed = run.steps[0].stats, run.steps[1].stats
    calls = {c.name: c for c in run.block_calls}  # the measured step's, plain
    assert list(calls) == ["layers.0", "layers.1", "layers.2"]
    inside = [c.stop_site - c.first_site for c in calls.values()]
    # x, W_up (not in the first block: its input, the batch, needs no gradient), gelu's
    # input, W_down, down's input, scale
    assert inside == [5, 6, 6]
    assert [c.input_tensors for c in calls.values()] == [2, 2, 2]
    assert [c.input_bytes for c in calls.values()] == [(8 * 16 + 16) * 4] * 3
    # Recomputed, a block's sites become its two tensor inputs, x and the keyword `scale`,
    # saved through the engine's hooks; the third block saves as it did.
    assert len(recomputed.sites) == len(measured.sites) - 5 - 6 + 2 * 2
    shapes = [s.shape for s in recomputed.sites]
    assert shapes[:4] == [(8, 16), (1, 16), (8, 16), (1, 16)]
    assert shapes[4:].count((8, 64)) == 2  # only the third block's insides
    # Where the measured step's sites went, as a planner would find them.
    where = renumbered(run.block_calls, ["layers.0", "layers.1"], len(measured.sites))
    assert sorted(where) == list(range(11, len(measured.sites)))  # the first two blocks': gone
    assert all(shapes[where[s]] == measured.sites[s].shape for s in where)
    assert sorted(where.values()) == list(range(4, len(shapes)))  # the rest: new, the inputs
    # The ledger: the saved tensors' peak drops by what the recomputed blocks kept inside.
    assert recomputed.peak_resident_bytes < measured.peak_resident_bytes
    assert measured.peak_resident_bytes - recomputed.peak_resident_bytes >= 2 * 2 * 8 * 64 * 4


def test_renumbering_moves_the_sites_after_a_recomputed_block():
    calls = [BlockCall("a", 1, 5, 2, 0, 0.0), BlockCall("b", 5, 11, 1, 0, 0.0),
             BlockCall("a", 11, 15, 2, 0, 0.0)]  # "a" called twice, 16 sites in all
    where = renumbered(calls, {"b"}, 16)
    assert where == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 11: 6, 12: 7, 13: 8, 14: 9, 15: 10}
    where = renumbered(calls, {"a"}, 16)  # both calls: 4 sites each become 2
    assert where == {0: 0, 5: 3, 6: 4, 7: 5, 8: 6, 9: 7, 10: 8, 15: 11}
    inner = BlockCall("b.act", 7, 10, 1, 0, 0.0)  # inside "b": recomputed with it
    assert renumbered([*calls, inner], {"b", "b.act"}, 16) == renumbered(calls, {"b"}, 16)


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "vgg16"])
def test_the_ledger_shows_a_lower_peak_of_saved_tensors(name):
    run = recomputing(case(name)[0], "keep")
    measured, recomputed = run.steps[0].stats, run.steps[1].stats
    assert recomputed.peak_resident_bytes < 0.6 * measured.peak_resident_bytes


@pytest.mark.parametrize("name", ["gpt2", "vgg16"])
def test_a_recomputing_step_says_what_it_recomputed_spared_and_held_again(name):
    """The step's summary, its metrics and its peak show the recomputation: which blocks, how
    many backward ran again, the saved tensors that spared against the plain step's, what
    the blocks held again while backward ran them (measured), and their forward's time."""
    from cswap_lightning.integrations.metrics import step_values
    from cswap_lightning.records import fmt_bytes

    run = recomputing(case(name)[0], "keep")
    plain, stats = run.steps[0].stats, run.steps[1].stats
    recomputed = stats.recomputed
    assert recomputed.blocks == tuple(sorted(run.recomputed))
    assert stats.recomputations == len(recomputed.blocks)  # each run again once, measured
    assert (recomputed.plain_step, recomputed.plain_keep_all_bytes) == (plain.step,
                                                                        plain.keep_all_bytes)
    assert recomputed.forward_s == sum(c.forward_s for c in run.block_calls
                                       if c.name in run.recomputed) > 0
    freed = stats.recompute_freed_bytes
    assert freed == plain.keep_all_bytes - stats.keep_all_bytes > 0
    assert stats.baseline_bytes == plain.keep_all_bytes
    # what a block saves again while backward runs it counts, one block at a time
    assert stats.peak_resident_bytes < stats.peak_bytes < plain.peak_resident_bytes
    assert stats.peak_share == stats.peak_bytes / plain.keep_all_bytes
    text = "\n".join(stats.summary())
    assert (f"recomputed in backward: {len(recomputed.blocks)} blocks "
            f"({', '.join(recomputed.blocks[:6])}") in text
    assert (f"{len(recomputed.blocks)} run again by this step's backward; keeping only their "
            f"inputs spared {fmt_bytes(freed)} of the {fmt_bytes(plain.keep_all_bytes)} of "
            f"saved tensors step {plain.step} kept, running every block plainly") in text
    assert ("with what the recomputed blocks hold again while backward runs them, "
            f"{fmt_bytes(stats.peak_bytes)} (measured), {100 * stats.peak_share:.0f}% of the "
            f"{fmt_bytes(plain.keep_all_bytes)} that keeping them all holds without "
            "recomputation") in text
    values = step_values(stats)
    assert values["recomputed_blocks"] == len(recomputed.blocks)
    assert values["recompute_freed_bytes"] == freed
    assert values["peak_resident_bytes"] == stats.peak_bytes
    assert values["keep_all_bytes"] == plain.keep_all_bytes


def saved_tensors(stats: cswap.StepStats) -> int:
    """How many tensors the step saved (its sites), tracked one by one or not."""
    return len(stats.sites) + stats.untracked_tensors + stats.untracked_moved_tensors


def readme_gpt2(device: str = "cpu") -> Built:
    """The README's GPT-2: 4 layers, hidden 256, 256 tokens, batch 4."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256)
    ids = torch.randint(0, 1000, (4, 256), generator=_gen()).to(device)
    return Built(GPT2LMHeadModel(config).to(device), {"input_ids": ids, "labels": ids})


@pytest.mark.slow
def test_the_readme_figures_of_a_gpt2_on_the_cpu():
    """README: a 4-layer GPT-2 (hidden 256, 256 tokens, batch 4) holds 175 MiB of saved
    tensors at once plainly; 11 MiB by the ledger with every layer recomputed, plus at most
    one layer's own 42 MiB while its backward runs; 127 MiB with the activations recomputed."""
    built = readme_gpt2()
    layers = recomputing(built, "keep", steps=2)
    activations = recomputing(built, "keep", lambda names: [n for n in names if "act" in n], 2)
    plain, measured = layers.steps[0].stats, activations.steps[0].stats
    own = max(sum(s.nbytes for s in plain.sites[c.first_site:c.stop_site]
                  if s.decision != "dedup" and s.reason in ("", "plan"))
              for c in layers.block_calls if c.name in layers.recomputed)

    def mib(n: int) -> float:
        return round(n / 2**20)

    assert mib(plain.peak_resident_bytes) == mib(measured.peak_resident_bytes) == 175
    assert mib(layers.steps[1].stats.peak_resident_bytes) == 11 and mib(own) == 42
    assert mib(activations.steps[1].stats.peak_resident_bytes) == 127


def test_measured_steps_run_the_blocks_plainly_and_time_them():
    built = stack_case()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    model = copy.deepcopy(built.model)
    offloader.watch(model).recompute(["layers.1"])
    sites, calls = [], []
    for step in range(4):
        if step == 2:
            offloader.new_epoch()  # measured again: plainly
        with offloader:
            loss = built.loss(model, built.inputs)
        loss.backward()
        sites.append(saved_tensors(offloader.last_step()))
        calls.append(offloader.block_calls)
    assert sites[0] == sites[2] and sites[1] == sites[3] == sites[0] - 6 + 2
    # A measured step's block calls are read when the engine finishes it, at the next start.
    assert calls[0] == [] and calls[1] is calls[2] and calls[3] is not calls[2]
    assert [c.name for c in calls[3]] == ["layers.0", "layers.1", "layers.2"]
    assert all(c.forward_s > 0 for c in calls[3])
    first, second, third = calls[3]
    assert first.stop_site == second.first_site and second.stop_site == third.first_site


# wrapping and unwrapping ---------------------------------------------------------------------
def test_taking_the_blocks_back_restores_their_forward_names_keys_and_hooks():
    model = Stack()
    hooked = []
    model.layers[0].register_forward_hook(lambda *args: hooked.append(1))
    names = [n for n, _ in model.named_modules()]
    keys = list(model.state_dict())
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", profile_steps=1))
    offloader.watch(model).recompute(["layers.0", "layers.2"])
    wrapper = model.layers[0].forward
    assert isinstance(wrapper, RecomputedForward)
    offloader.recompute(["layers.2", "layers.0"])  # again: the same wrappers
    assert model.layers[0].forward is wrapper
    assert [n for n, _ in model.named_modules()] == names and list(model.state_dict()) == keys
    offloader.recompute(["layers.2"])
    assert "forward" not in model.layers[0].__dict__  # its class's forward again
    assert offloader.recomputed == {"layers.2"}
    offloader.recomputer.unwrap()  # as the integrations do when training ends
    assert "forward" not in model.layers[2].__dict__ and offloader.recomputed == {"layers.2"}
    with offloader:  # measured: plainly, not wrapped
        out = model(torch.randn(2, 16))
    out.sum().backward()  # a step without it would not count as measured
    assert "forward" not in model.layers[2].__dict__
    with offloader:  # wrapped again where it runs recomputed
        out = model(torch.randn(2, 16))
    out.sum().backward()
    assert isinstance(model.layers[2].forward, RecomputedForward)
    offloader.close()  # gives every block back
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    model(torch.randn(2, 16))
    assert hooked == [1, 1, 1]  # the hook ran on each of the three calls


def test_a_stage_is_taken_back_and_a_copy_or_pickle_never_recomputes():
    model = vgg16(width=2, num_classes=5)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw")).watch(model)
    offloader.recompute(["[0:5]", "[5:10]"])
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.forward.recompute is None and other.forward.sequential is other
    offloader.recompute(["[5:10]"])
    assert list(model.forward.spans) == [5]
    offloader.recompute([])
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("order", ["compile, then recompute", "recompute, then compile"])
def test_compiled_blocks_are_recomputed_too(order):
    built = torch_case(mlp(), torch.randn(BATCH, 6, 16, generator=_gen()))
    plain = train(built, STEPS)

    def choose(names: list[str]) -> list[str]:
        if order.startswith("compile"):
            cswap.compile_blocks(offloader.recomputer.model, backend="aot_eager")
        return names[:2]

    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    trained = []

    def prepare(model: nn.Module) -> None:
        trained.append(model)
        offloader.watch(model).recompute(choose(outermost(list(units(model)))))
        if order.startswith("recompute"):  # replaces the wrappers: the next step wraps again
            cswap.compile_blocks(model, backend="aot_eager")

    got = train(built, STEPS, offloader, prepare)
    model = trained[0]
    assert not differences(plain, got)
    assert all(is_compiled(block) for block in model)
    assert [type(block.forward).__name__ for block in model] == (
        ["RecomputedForward"] * 2 + ["CompiledForward"] * 2)
    assert len(got[1].stats.sites) < len(got[0].stats.sites)
    assert offloader.recomputer.verdicts.why == {"0": "compiled", "1": "compiled"}


# what is not recomputed ----------------------------------------------------------------------
def test_layers_hugging_face_checkpoints_itself_are_skipped():
    from cswap_lightning.hf_checkpointing import checkpointing_switch

    model = copy.deepcopy(case("llama")[0].model).train()
    checkpointing_switch(model)()
    offloader = cswap.Offloader().watch(model)
    skipped = offloader.recompute(["model.layers.0"])
    assert skipped == {"model.layers.0": "checkpointed by the model's own gradient checkpointing"}
    assert offloader.recomputed == frozenset()


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mul_(2))  # fine plainly: nothing saved x before


class Blocks(nn.Module):
    def __init__(self, first: nn.Module, checkpoint_first: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([first, nn.Linear(16, 16)])
        self.checkpoint_first = checkpoint_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # not the batch itself
        first, second = self.layers
        x = checkpoint(first, x, use_reentrant=False) if self.checkpoint_first else first(x)
        return second(x)


@pytest.mark.parametrize(("model", "reason"), [
    (lambda: Blocks(InPlace()), "changes an input in place"),
    (lambda: Blocks(mlp(depth=1), checkpoint_first=True), "runs under saved-tensor hooks other"),
])
def test_blocks_measured_unfit_are_skipped(model, reason):
    model = model()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0)).watch(model)
    with offloader:  # measured
        loss = model(torch.randn(4, 16, requires_grad=True)).sum()
    loss.backward()
    skipped = offloader.recompute(["layers.0", "layers.1"])
    assert list(skipped) == ["layers.0"] and skipped["layers.0"].startswith(reason)
    assert offloader.recomputed == {"layers.1"}


def test_a_block_under_an_outer_checkpoint_is_not_checkpointed_again(monkeypatch):
    from cswap_lightning.core import recompute

    built = torch_case(Blocks(mlp(depth=1), checkpoint_first=True),
                       torch.randn(BATCH, 16, generator=_gen()))
    plain = train(built, STEPS)
    checkpointed = []

    def counted(function, *args, **kwargs):
        checkpointed.append(function)
        return function(*args, **kwargs)

    # under checkpoint (its first call, watched) or its first run without autograd
    monkeypatch.setattr(recompute, "checkpoint", functools.partial(counted, checkpoint))
    monkeypatch.setattr(recompute, "rerun", functools.partial(counted, recompute.rerun))
    # chosen before the measured step saw it: given back after it
    with pytest.warns(RuntimeWarning, match="no longer recomputing 'layers.0'"):
        run = recomputing(built, "raw")
    assert len(checkpointed) == STEPS - 1  # the second layer's, once per recomputed step
    assert run.recomputed == {"layers.1"}
    assert not differences(plain, run.steps)
    assert "layers.0" in run.unfit


# the engine's API ----------------------------------------------------------------------------
def test_the_off_switch_refuses_recomputation_and_times_nothing():
    model = Stack()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", recompute="off")).watch(model)
    with pytest.raises(ValueError, match=r"recompute is 'off'.*recompute='auto'"):
        offloader.recompute(["layers.0"])
    assert offloader.recompute([]) == {}
    with offloader:  # measured
        loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    offloader.last_step()
    assert offloader.block_calls == [] and offloader.recomputed == frozenset()


def test_bad_calls_are_refused_clearly():
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw"))
    with pytest.raises(ValueError, match=r"watch\(model\) first"):
        offloader.recompute(["layers.0"])
    model = Stack()  # watched weakly: held here
    offloader.watch(model)
    with pytest.raises(ValueError, match=r"'layers.9' is not a block .* 'layers.0', 'layers.1'"):
        offloader.recompute(["layers.9"])
    with pytest.raises(TypeError, match=r"recompute\(\['layers.0'\]\)"):
        offloader.recompute("layers.0")
    with offloader, pytest.raises(RuntimeError, match="between steps"):
        offloader.recompute(["layers.0"])


def test_changing_the_set_makes_the_next_step_check_the_plan_again():
    built = stack_case()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    model = copy.deepcopy(built.model)
    offloader.watch(model)
    tracked = []
    for step in range(5):
        if step == 3:
            offloader.recompute(["layers.0"])
        with offloader:
            loss = built.loss(model, built.inputs)
        loss.backward()
        tracked.append(len(offloader.last_step().sites))
    inside = offloader.block_calls[0].stop_site - offloader.block_calls[0].first_site
    # measured; checks the plan; runs it without tracking each site (a few tracked)
    assert tracked[0] == tracked[1] and tracked[2] < tracked[1] / 2
    # recomputed: tracked and checked (the block's sites become its inputs); then untracked
    assert tracked[3] == tracked[0] - inside + 2 and tracked[4] < tracked[3] / 2


class BufferedStack(Stack):
    """Its blocks' scale is a buffer: held by the model, so moving it frees nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((1, self.width), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, scale=self.scale, note="kept")
        return x


def test_what_is_held_elsewhere_is_measured_again_in_the_recomputed_numbering():
    model = BufferedStack()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    offloader.watch(model).recompute(["layers.0"])
    held, scale_sites = [], []
    for _ in range(2):
        with offloader:
            loss = model(torch.randn(8, 16)).sum()
        loss.backward()
        held.append(set(offloader.held_elsewhere))
        scale_sites.append({s.site for s in offloader.last_step().sites
                            if s.shape == (1, 16) and s.decision != "dedup"})
    # The buffer, moved on each step and found alive at backward: plainly saved at the end of
    # the first block, recomputed as its second input; only the step's own numbering counts.
    assert held == scale_sites and held[0] != held[1]
    assert held[1] == {1}


def test_watching_keeps_the_model_weakly_without_global_hooks():
    from torch.nn.modules import module as module_hooks

    before = len(module_hooks._global_forward_pre_hooks)
    model = Stack()
    offloader = cswap.Offloader().watch(model)
    assert offloader.recomputer.model is model and offloader.modules is None
    assert len(module_hooks._global_forward_pre_hooks) == before
    del model
    assert offloader.recomputer.model is None


# the integrations ----------------------------------------------------------------------------
def test_the_lightning_strategy_recomputes_the_blocks_the_planner_chose(tmp_path, monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from test_lightning import (
        LOSSLESS,
        BlockReluNet,
        assert_same_weights,
        assert_the_engine_moves_the_block_inputs,
    )
    from test_lightning import train as fit

    from cswap_lightning import CSwapStrategy

    class Planner(pl.Callback):
        """Stands in for the planner: after the first step, both blocks are recomputed."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                assert not trainer.strategy.offloader.recompute(["net.1", "net.2"])

    monkeypatch.chdir(tmp_path)
    steps = {"model": BlockReluNet, "max_steps": 5}  # 2 measured, 3 recomputed
    trainer, model = fit(CSwapStrategy(LOSSLESS), callbacks=[Planner()], **steps)
    _, plain = fit(SingleDeviceStrategy("cpu"), **steps)
    assert_same_weights(model, plain)
    assert trainer.strategy.offloader.recomputed == {"net.1", "net.2"}
    assert all("forward" not in block.__dict__ for block in model.net)  # given back at the end
    # What the engine saw on the last step: the blocks' inputs, nothing from inside them (and
    # the batch, which Lightning holds, kept: learned again on the first recomputed step).
    assert_the_engine_moves_the_block_inputs(trainer)


@pytest.mark.slow
def test_the_hugging_face_callback_recomputes_the_layers_the_planner_chose(tmp_path):
    from test_hf import ACCUMULATION, bert_trainer
    from transformers import TrainerCallback

    from cswap_lightning.integrations.hf import CSwapCallback

    layers = {"bert.encoder.layer.0", "bert.encoder.layer.1"}

    class Planner(TrainerCallback):
        """Stands in for the planner: after the first optimizer step (its micro-batches
        measured), the layers are recomputed. Records what each micro-batch saved."""

        def __init__(self, cswap: CSwapCallback) -> None:
            self.cswap, self.saved = cswap, []

        def on_substep_end(self, args, state, control, **kwargs):
            self.saved.append(saved_tensors(self.cswap.offloader.last_step()))

        def on_step_end(self, args, state, control, **kwargs):
            self.on_substep_end(args, state, control)
            if state.global_step == 1:
                assert not self.cswap.offloader.recompute(layers)

    callback = CSwapCallback(cswap.CSwapConfig(plan="zvc", min_bytes=0))
    planner = Planner(callback)
    trainer = bert_trainer(tmp_path / "cswap", [callback, planner])
    trainer.train()
    plain = bert_trainer(tmp_path / "plain", [])
    plain.train()
    for (name, p), q in zip(trainer.model.state_dict().items(),
                            plain.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert callback.offloader.recomputed == layers
    assert all("forward" not in layer.__dict__  # given back at the end of training
               for layer in trainer.model.bert.encoder.layer)
    before, after = planner.saved[:ACCUMULATION], planner.saved[ACCUMULATION:]
    assert len(after) == ACCUMULATION and max(after) < min(before) / 2


def test_a_model_compiled_whole_runs_its_blocks_plainly_without_graph_breaks():
    from torch._dynamo.utils import counters

    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    offloader.watch(model).recompute(["0", "1"])
    counters.clear()

    def step() -> int:
        with offloader:
            loss = compiled(torch.randn(4, 16)).sum()
        loss.backward()
        return saved_tensors(offloader.last_step())

    sites = [step()]  # measured: the blocks timed where not traced
    with pytest.warns(RuntimeWarning, match="at once"):  # compiled whole, as the engine says
        sites.append(step())
    sites.append(step())  # recomputed where not traced
    assert not counters["graph_break"]
    assert sites[0] == sites[1] == sites[2]  # one region: its saves come at its end either way


def test_compiled_blocks_time_and_recompute_without_compiling_again():
    """Hooks on a module inside a compiled block would be traced (and guarded on): a compiled
    block is a unit, its activations are not, and timing or recomputing it compiles nothing
    again."""
    model = cswap.compile_blocks(mlp(), backend="aot_eager")
    assert list(units(model)) == ["0", "1", "2", "3"]  # the GELUs inside are traced
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    offloader.watch(model)
    for step in range(5):
        if step == 1:
            offloader.recompute(["0", "2"])
        if step == 3:
            offloader.new_epoch()  # measured again, plainly
        with torch._dynamo.config.patch(error_on_recompile=step > 0), offloader:
            loss = model(torch.randn(4, 16)).sum()
        loss.backward()
    assert [c.name for c in offloader.block_calls] == ["0", "1", "2", "3"]


# on a GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("name", ["gpt2", "llama", "resnet50", "mlp"])
def test_on_cuda_training_with_recomputed_blocks_is_bitwise_plain_training(name):
    """The CUDA RNG state is stashed and restored too (by checkpoint on the watched step,
    by the first run without autograd after it): dropout draws alike."""
    torch.manual_seed(0)
    built = BUILDERS[name]()
    built = Built(built.model.cuda(), {k: v.cuda() for k, v in built.inputs.items()},
                  built.loss)
    plain = train(built, STEPS + 2)
    run = recomputing(built, "raw", steps=STEPS + 2, whole=("cuda",))  # not by default there
    assert not differences(plain, run.steps)
    assert len(run.steps[1].stats.sites) < len(run.steps[0].stats.sites) / 2
    assert set(run.verdicts.values()) == {""}  # the last steps ran first without autograd


@pytest.mark.gpu
def test_on_cuda_the_allocators_peak_drops_with_recomputed_layers():
    """The allocator sees what the ledger does not: a layer's tensors saved again while its
    backward runs. Its peak still drops by most of what the layers kept."""
    run = recomputing(readme_gpt2("cuda"), "keep", steps=2)
    plain, recomputed = run.steps[0].stats, run.steps[1].stats
    saved = plain.peak_resident_bytes - recomputed.peak_resident_bytes
    assert plain.peak_allocated_bytes - recomputed.peak_allocated_bytes > 0.5 * saved
