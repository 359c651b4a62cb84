"""Recomputed blocks whose first run goes without autograd (``core/lean.py``): every block of
the test networks is found fit and trains bitwise as plain PyTorch; a block that reads or
keeps what the ``Function`` would not see stays under checkpoint, with why, and still trains
bitwise (and would not, run first without autograd); second derivatives, ``autograd.grad``
and autocast go through; the switch turns it off."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
from pathlib import Path

import pytest
import test_conformance as conformance
import torch
from conftest import load_benchmark
from test_conformance import BATCH, _gen, causal_lm, differences, torch_case, train
from test_recompute import BUILDERS, STEPS, mlp, outermost, recomputing
from torch import nn

import cswap_lightning as cswap
from cswap_lightning.core import lean, recompute

WIDTH = 16


def fresh(name: str, steps: int = STEPS):
    """As ``test_recompute.case``, not cached: the plain reference is made beside the run
    (a test between may change the thread count, and with it the sums' order)."""
    torch.manual_seed(0)
    built = BUILDERS[name]()
    return built, train(built, steps)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_block_of_the_test_networks_runs_first_without_autograd(name, monkeypatch):
    built, plain = fresh(name, STEPS + 1)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return lean.rerun(*args, **kwargs)

    monkeypatch.setattr(recompute, "rerun", counted)
    run = recomputing(built, "raw", steps=STEPS + 1)
    assert not differences(plain, run.steps)
    layers = outermost(list(recompute.units(built.model)))
    assert run.verdicts == dict.fromkeys(layers, "")
    # measured plainly, then watched under checkpoint, then without autograd
    assert len(calls) == 2 * len(layers)


def test_a_whole_block_on_a_device_not_chosen_runs_under_checkpoint(monkeypatch):
    """Where whole blocks were not measured to gain (``Verdicts.whole``: the CPU alone; here
    not even it), they run under checkpoint, unwatched, bitwise."""
    built, plain = fresh("gpt2", STEPS + 1)
    calls = []
    monkeypatch.setattr(recompute, "rerun", lambda *a, **k: calls.append(a) or lean.rerun(*a, **k))
    run = recomputing(built, "raw", steps=STEPS + 1, whole=())
    assert not differences(plain, run.steps)
    assert not calls and run.verdicts == {}
    assert lean.WHOLE_DEVICES == ("cpu",)


class Net(nn.Module):
    """A block under test, then a linear layer; the block's auxiliary loss is added (where
    it keeps one), and a block returning two tensors has them summed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block, nn.Linear(WIDTH, WIDTH)])
        block.other = [self.layers[1]]  # a weight the block reads, not its parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        out = self.layers[0](x)
        if isinstance(out, tuple):
            out = out[0] + out[1]
        if getattr(self.layers[0], "kind", "") == "has its output changed in place":
            out.mul_(2)
        if isinstance(out, dict):  # a structure, with what needs no gradient
            assert out["none"] is None and out["count"] == 3 and out["index"].dtype == torch.int64
            out = out["hidden"] + out["index"].unsqueeze(-1) * out["mask"]
        out = self.layers[1](out)
        aux = getattr(self.layers[0], "aux", None)
        return out if aux is None else out + aux


class Block(nn.Module):
    """A linear layer and a GELU, and one of the things a first run without autograd would
    get wrong (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(WIDTH, WIDTH)
        if kind == "has a weight hook inside":
            self.linear = nn.utils.spectral_norm(self.linear)
        self.other: list[nn.Linear] = []

    def forward(self, x: torch.Tensor):
        y = nn.functional.gelu(self.linear(x))
        if self.kind == "reads another's weight":
            return y @ self.other[0].weight
        if self.kind == "keeps an auxiliary loss":
            self.aux = y.pow(2).mean()
        if self.kind == "hooks a tensor":
            y.register_hook(lambda g: g * 2)
        if self.kind == "branches on requires_grad":
            return y * 2 if x.requires_grad else y
        if self.kind == "branches on grad mode":
            return y * 2 if torch.is_grad_enabled() else y
        if self.kind == "returns its input":
            return y, x
        if self.kind == "returns a structure":
            return {"hidden": y, "index": y.argmax(-1), "mask": (y > 0).float().detach(),
                    "none": None, "count": 3}
        return y


def built_with(kind: str):
    return torch_case(Net(Block(kind)), torch.randn(BATCH, WIDTH, generator=_gen())
                      .requires_grad_())


def lean_first_layer(names: list[str]) -> list[str]:
    return ["layers.0"]


STAY = {
    "reads another's weight": "its forward reads a tensor that needs a gradient and is neither",
    "keeps an auxiliary loss": "it keeps a tensor that needs a gradient beyond its output",
    "hooks a tensor": "its forward calls register_hook on a tensor",
    "branches on requires_grad": "its forward reads a tensor's .requires_grad",
    "branches on grad mode": "its forward gives other bits without autograd",
    "has a weight hook inside": "it keeps a tensor that needs a gradient",  # the weight
    "returns its input": "it returns its input or a view of it",
}


@pytest.mark.parametrize("kind", ["returns a structure", "has its output changed in place"])
def test_a_block_returning_a_structure_or_changed_after_runs_first_without_autograd(kind):
    """A dict of a tensor that needs a gradient, an integer tensor, a detached one, None and
    an int: the ``Function`` returns the tensors, the rest is kept from the first run. An
    output changed in place by the caller: the ``Function`` saves none of its outputs."""
    built = built_with(kind)
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", lean_first_layer, STEPS + 1)
    assert not differences(plain, run.steps)
    assert run.verdicts == {"layers.0": ""}


@pytest.mark.parametrize("kind", list(STAY))
def test_a_block_the_watch_finds_unfit_stays_under_checkpoint_and_trains_bitwise(kind):
    built = built_with(kind)
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", lean_first_layer, STEPS + 1)
    assert not differences(plain, run.steps)
    assert run.recomputed == {"layers.0"}
    assert run.verdicts["layers.0"].startswith(STAY[kind])


@pytest.mark.parametrize("kind", ["reads another's weight", "keeps an auxiliary loss",
                                  "branches on grad mode"])
def test_without_the_watch_those_blocks_would_train_otherwise(kind, monkeypatch):
    built = built_with(kind)
    plain = train(built, STEPS + 1)
    monkeypatch.setattr(lean.Watch, "verdict", lambda self, out, again: "")
    run = recomputing(built, "raw", lean_first_layer, STEPS + 1)
    assert run.verdicts["layers.0"] == ""
    assert differences(plain, run.steps)


def test_a_block_whose_router_hook_collects_a_tensor_without_gradient_stays_under_checkpoint():
    """A Mixtral trained with its router's auxiliary loss, all of its first layer frozen but
    its experts: Hugging Face's hook collects that layer's router logits, which need no
    gradient (nothing kept beyond the output needs one), but the watch's second run would
    collect them twice; the layer stays under checkpoint, and training stays bitwise."""
    from test_selective import MOE

    torch.manual_seed(0)
    built = causal_lm("MixtralConfig", **MOE)("sdpa")
    frozen = ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.input_",
              "model.layers.0.post_", "model.layers.0.mlp.gate"]
    for name, p in built.model.named_parameters():
        p.requires_grad_(not any(name.startswith(f) for f in frozen))
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", steps=STEPS + 1)
    assert not differences(plain, run.steps)
    assert run.verdicts == {"model.layers.0": "forward hooks inside it would run once more to "
                                              "check it",
                            "model.layers.1": "it keeps a tensor that needs a gradient beyond "
                                              "its output (in a hook's or an attribute's hands)"}


def test_the_switch_keeps_every_block_under_checkpoint(monkeypatch):
    built, plain = fresh("gpt2", STEPS + 1)
    monkeypatch.setattr(recompute, "rerun", None)  # never called
    run = recomputing(built, "raw", steps=STEPS + 1, lean=False)
    assert not differences(plain, run.steps)
    assert run.verdicts == {} and run.recomputed


def test_a_parameter_of_another_type_keeps_the_block_under_checkpoint():
    class Special(nn.Parameter):
        pass

    block = nn.Linear(WIDTH, WIDTH)
    block.weight = Special(block.weight.detach().clone())
    assert lean.unfit(None, [block]) == "a parameter of type Special"
    assert lean.unfit(None, [nn.Linear(WIDTH, WIDTH)]) == ""
    block.weight.requires_grad_(False)  # frozen (QLoRA's 4-bit weights): read alike either way
    assert lean.unfit(None, [block]) == ""


def _steps(model: nn.Module, x: torch.Tensor, grads_of, offloader: cswap.Offloader | None,
           steps: int = STEPS + 1, context=None) -> list[list[torch.Tensor]]:
    """Each step's ``grads_of(out, model, x)`` (gradients it takes from the model's output),
    seeded alike, forward inside the offloader where given and under ``context``."""
    grads = []
    for step in range(steps):
        torch.manual_seed(step)
        x_step = x.detach().clone().requires_grad_()
        with (offloader if offloader is not None else contextlib.nullcontext(),
              (context or contextlib.nullcontext)()):
            out = model(x_step)
        grads.append([g.detach().clone() for g in grads_of(out, model, x_step)])
    return grads


def _compared(grads_of, context=None) -> tuple[bool, dict[str, str]]:
    """Plain against every block of an MLP recomputed: whether every step's gradients are
    the same bits, and each block's verdict."""
    torch.manual_seed(0)
    model = mlp(WIDTH)
    x = torch.randn(BATCH, 6, WIDTH, generator=_gen())
    plain = _steps(copy.deepcopy(model), x, grads_of, None, context=context)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    ours = copy.deepcopy(model)
    offloader.watch(ours).recompute(outermost(list(recompute.units(ours))))
    got = _steps(ours, x, grads_of, offloader, context=context)
    verdicts = dict(offloader.recomputer.verdicts.why)
    offloader.close()
    same = all(torch.equal(p, q) for a, b in zip(plain, got, strict=True)
               for p, q in zip(a, b, strict=True))
    return same, verdicts


BLOCKS = ["0", "1", "2", "3"]


def penalised(out: torch.Tensor, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A loss with a gradient penalty: its gradients are second derivatives too."""
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    return torch.autograd.grad(out.sum() + gx.pow(2).sum(), [x, *model.parameters()])


def test_a_second_derivative_seen_on_the_watched_step_keeps_the_blocks_under_checkpoint():
    same, verdicts = _compared(penalised)
    assert verdicts == dict.fromkeys(BLOCKS, lean.SECOND)
    assert same


def test_a_second_derivative_through_a_block_run_without_autograd_is_exact_and_said():
    """Taken later, the first time is exact to rounding (the grads of the block's weights
    add up in another order), with a warning; the block then runs under checkpoint."""
    torch.manual_seed(0)
    model = mlp(WIDTH)
    x = torch.randn(BATCH, 6, WIDTH, generator=_gen())
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    ours = copy.deepcopy(model)
    offloader.watch(ours).recompute(["0"])
    _steps(ours, x, lambda out, model, x: torch.autograd.grad(out.sum(), [*model.parameters()]),
           offloader)  # measured, watched, then without autograd
    assert offloader.recomputer.verdicts.why == {"0": ""}
    with pytest.warns(RuntimeWarning, match="second derivative was taken through '0'"):
        got = _steps(ours, x, penalised, offloader, steps=1)[0]
    assert offloader.recomputer.verdicts.why == {"0": lean.SECOND}
    offloader.close()
    want = _steps(ours, x, penalised, None, steps=1)[0]
    assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(want, got, strict=True))


def test_autograd_grad_and_cpu_autocast_go_through_too():
    def grads(out, model, x):
        return torch.autograd.grad(out.float().pow(2).mean(), [x, *model.parameters()])

    for context in (None, functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)):
        same, verdicts = _compared(grads, context)
        assert verdicts == dict.fromkeys(BLOCKS, "")
        assert same


def test_the_benchmark_compares_every_method_bitwise(tmp_path, monkeypatch):
    script = load_benchmark("lean_recompute_cpu", monkeypatch)
    threads = torch.get_num_threads()
    try:
        script.main(["--models", "bert", "--layers", "2", "--rounds", "2", "--warmup", "2",
                     "--out", str(tmp_path / "b")])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "b.json").read_text())["results"][0]["rows"]
    assert [r["method"] for r in rows] == list(script.METHODS)
    assert all(r["bitwise"] for r in rows)
    counts = {r["method"]: r["first_runs_without_autograd"] for r in rows}
    assert counts["cswap"] == 2 and counts["cswap_checkpoint"] == 0
    hf = next(r for r in rows if r["method"] == "hf")
    assert hf["throughput_vs_hf"] == 1.0
    assert "first run without autograd |" in (tmp_path / "b.md").read_text()


def test_the_readmes_figures_are_the_committed_measurement():
    root = Path(__file__).resolve().parents[1]
    results = json.loads((root / "benchmarks/results/lean-recompute-cpu-2026-11-27.json")
                         .read_text())["results"]
    rows = [r for result in results for r in result["rows"]]
    assert all(r["bitwise"] for r in rows)

    def spread(values) -> str:
        values = sorted(values)
        return f"{values[0]:.2f}-{values[-1]:.2f}x"

    def of(method: str, key: str = "vs_plain") -> str:
        return spread(r[key] for r in rows if r["method"] == method)

    steps = {(r["model"], r["method"]): r["step_ms"] for r in rows}
    reentrant = spread(steps[m, "hf_reentrant"] / steps[m, "cswap"] for m, _ in steps)
    readme = " ".join((root / "README.md").read_text().split())
    assert (f"a step takes {of('cswap')} a plain one, against {of('hf')} with Hugging Face's "
            f"checkpointing and {of('cswap_checkpoint')} with the engine's blocks under "
            f"checkpoint: {of('cswap', 'throughput_vs_hf')} the throughput of Hugging Face's "
            f"default, {reentrant} that of its `use_reentrant=True`") in readme


def test_a_block_of_a_sharded_model_stays_under_checkpoint(monkeypatch):
    """FSDP2 (one process, gloo): the parameters a recomputation would see in backward are
    not those its forward was given."""
    from torch import distributed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = Net(Block("plain"))
        assert lean.unfit(model, list(model.layers[0].modules())) == ""
        fully_shard(model.layers[0], mesh=init_device_mesh("cpu", (1,)))
        assert lean.unfit(model, list(model.layers[0].modules())) == (
            "the model is sharded (FSDP)")
    finally:
        distributed.destroy_process_group()


LEAN_THROUGHOUT = {"bert", "roberta", "albert", "gpt2", "llama", "mistral", "qwen2", "qwen3",
                   "phi3", "gemma", "gemma2", "mixtral", "mamba2", "vit", "swin", "resnet",
                   "wav2vec2"}


def under_autocast(built: conformance.Built) -> conformance.Built:
    """``built`` with its forward and loss under CPU autocast (bfloat16)."""
    def loss(model: nn.Module, inputs: dict, inner=built.loss) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return inner(model, inputs).float()

    return dataclasses.replace(built, loss=loss)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", list(conformance.HF))
def test_every_conformance_architecture_recomputed_trains_bitwise(name, autocast):
    """Every Hugging Face architecture of the conformance suite, every block recomputed: the
    measured step, the watched one, two more. Encoder-decoders' decoder layers read the
    encoder's output, as every other decoder layer does, more than once each (keys and
    values): its gradient summed in each layer, then across them, would add up in another
    order, so they stay under checkpoint (``SHARED``). Under autocast, ALBERT's one layer,
    called for every layer, reads its weights through the casts its first call made
    (``CAST``); and a block's input is recomputed as a leaf only where it was one (autocast
    caches a leaf's cast: BERT's layers, whose input three projections read, differed)."""
    built = conformance.build_hf(name, conformance.HF[name][1][0])
    built = under_autocast(built) if autocast else built
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", steps=STEPS + 1)
    assert not differences(plain, run.steps)
    if autocast and name == "albert":
        assert set(run.verdicts.values()) == {lean.CAST}
    elif name in LEAN_THROUGHOUT:
        assert set(run.verdicts.values()) == {""}
    if name in ("bart", "marian", "whisper"):
        decoder = {n: why for n, why in run.verdicts.items() if ".decoder." in n}
        assert decoder and set(decoder.values()) == {lean.SHARED}


def unchecked(monkeypatch) -> None:
    """The watched step's checks in backward pass whatever they see."""
    def received(self, name, given, why, total):
        given[1].remove()
        self.awaiting[name] -= 1
        if not self.awaiting[name]:
            self.verdicts.settle(name, self.reasons[name])

    monkeypatch.setattr(lean._Watching, "_received", received)


@pytest.mark.parametrize("case", ["bart", "a weight used twice in a block called twice"])
def test_without_the_check_in_backward_gradients_would_sum_in_another_order(case, monkeypatch):
    """BART's decoder layers run first without autograd though each reads the encoder's
    output twice and so does every other; or the block above: the gradients then differ,
    by rounding."""
    unchecked(monkeypatch)
    if case == "bart":
        built, choose = conformance.build_hf("bart", conformance.HF["bart"][1][0]), outermost
    else:
        built = torch_case(Twice(True), torch.randn(BATCH, WIDTH, generator=_gen()))
        choose = lean_first_layer
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", choose, steps=STEPS + 1)
    assert set(run.verdicts.values()) == {""}
    assert differences(plain, run.steps)


def test_a_block_kept_under_checkpoint_is_logged_with_why(caplog):
    built = built_with("keeps an auxiliary loss")
    with caplog.at_level("INFO", logger="cswap_lightning.core.lean"):
        recomputing(built, "raw", lean_first_layer, STEPS + 1)
    why = f"{STAY['keeps an auxiliary loss']} (in a hook's or an attribute's hands)"
    assert [r.getMessage() for r in caplog.records] == [
        f"cswap: layers.0 recomputes under checkpoint: {why}"]


class Reused(nn.Module):
    """A linear layer and a GELU; with ``twice``, the linear layer once more."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.twice = twice
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.gelu(self.linear(x))
        return self.linear(y) if self.twice else y


class Twice(nn.Module):
    """One block called twice per step, as ALBERT's shared layers are."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Reused(twice)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.layers[0](x)
        return x


@pytest.mark.parametrize("twice", [True, False])
def test_a_weight_used_twice_in_a_block_called_twice_keeps_it_under_checkpoint(twice):
    """The weight's gradient summed in each call, then across the calls, would add up in
    another order than plain training's: the watched step's backward sees it."""
    built = torch_case(Twice(twice), torch.randn(BATCH, WIDTH, generator=_gen()))
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", lean_first_layer, STEPS + 1)
    assert not differences(plain, run.steps)
    assert run.verdicts == {"layers.0": lean.SHARED if twice else ""}


@pytest.mark.parametrize("twice", [True, False])
def test_a_watched_step_whose_graph_is_dropped_is_watched_again(twice, caplog):
    """The watched step's graph goes without a backward (a step skipped on a non-finite
    loss, say): its checks in backward never come, so the block is watched again in the
    next step (it used to await them forever, under checkpoint)."""
    built = torch_case(Twice(twice), torch.randn(BATCH, WIDTH, generator=_gen()))
    dropped = frozenset({1})  # the first step after the measured one: the watched one
    plain = train(built, STEPS + 2, dropped=dropped)
    with caplog.at_level("INFO", logger="cswap_lightning.core.lean"):
        run = recomputing(built, "raw", lean_first_layer, STEPS + 2, dropped=dropped)
    assert not differences(plain, run.steps)
    assert run.verdicts == {"layers.0": lean.SHARED if twice else ""}
    assert "cswap: layers.0 is watched again: its watched step's graph was dropped before " \
           "backward" in caplog.messages


class Discarded(nn.Module):
    """A block called twice, the first call's output thrown away in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Reused(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.layers[0](2 * x)
        return self.layers[0](x)


def test_a_block_whose_watched_graph_always_goes_unchecked_stays_under_checkpoint():
    """Its first call's graph goes in every forward, before backward could check it: the
    block is watched again in each of ``REWATCHES`` steps, then stays under checkpoint."""
    built = torch_case(Discarded(), torch.randn(BATCH, WIDTH, generator=_gen()))
    steps = lean.REWATCHES + 2
    plain = train(built, steps)
    run = recomputing(built, "raw", lean_first_layer, steps)
    assert not differences(plain, run.steps)
    assert run.verdicts == {"layers.0": lean.DROPPED}


class CastTwice(Twice):
    """The block called twice under CPU autocast: the second call reads its weight through
    the cast the first made (autocast's cache), one node that sums both calls' gradients in
    bfloat16 before the weight gets them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x).float()


class CastAgain(nn.Module):
    """Under CPU autocast, a block, then its weight read once more by the model's own code:
    through the cast the block made, which autocast cached."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Reused(False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.layers[0](x)
            return nn.functional.linear(y, self.layers[0].linear.weight).float()


@pytest.mark.parametrize("watched", [True, False])
@pytest.mark.parametrize("model", [CastTwice, CastAgain])
def test_a_block_whose_weights_cast_is_read_elsewhere_stays_under_checkpoint(
        model, watched, monkeypatch):
    """A weight's cast autocast cached, read by the block and by other code (the block's
    next call, the model's own): one node sums their gradients in bfloat16. Run first
    without autograd, the block would cast again in backward and its gradient would reach
    the weight apart, summed there in float32."""
    if not watched:
        unchecked(monkeypatch)
    built = torch_case(model(False), torch.randn(BATCH, WIDTH, generator=_gen()))
    plain = train(built, STEPS + 1)
    run = recomputing(built, "raw", lean_first_layer, STEPS + 1)
    assert run.verdicts == {"layers.0": lean.CAST if watched else ""}
    assert bool(differences(plain, run.steps)) is not watched
