"""compile_blocks on the CPU: which modules are blocks, and that compiling per block gets back
the saving a whole-model compile loses (its backward restores every offloaded tensor at once,
pytorch/pytorch#148222), with gradients as without the engine."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import make_transformer
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

from cswap_lightning import CSwapConfig, Offloader, compile_blocks
from cswap_lightning.core.compile import blocks, compiled_whole, is_compiled

# prefetch_bytes=0: each tensor comes back when backward asks for it, so the peak shows how
# many backward holds at once, not how far ahead prefetching reads.
RAW = CSwapConfig(plan="raw", min_bytes=0, prefetch_bytes=0)
AT_ONCE = "at once, as the backward of a torch.compile'd region does"


def mlp(n: int = 8, width: int = 512) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def batch() -> torch.Tensor:
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(1))


def train(model: nn.Module, offloader: Offloader | None = None, steps: int = 2):
    """Gradients of the last of ``steps`` steps, and the engine's warnings (the first step's
    come when the second one starts)."""
    x = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            if offloader is None:
                loss = model(x).sum()
            else:
                with offloader:
                    loss = model(x).sum()
            loss.backward()
    said = [str(w.message) for w in caught if str(w.message).startswith("cswap")]
    return [p.grad for p in model.parameters()], said


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[torch.Tensor], int, list[str]]]:
    """8 x (Linear(512) + ReLU), batch 256, raw: gradients, the last step's peak of saved
    tensors resident at once, and the engine's warnings, eager and compiled two ways."""
    models = {"eager": mlp(), "whole": torch.compile(mlp(), backend="aot_eager"),
              "blocks": compile_blocks(mlp(), backend="aot_eager")}
    out = {}
    for name, model in models.items():
        offloader = Offloader(RAW)
        grads, said = train(model, offloader)
        out[name] = grads, offloader.last_step().peak_resident_bytes, said
        offloader.close()
    return out


def test_the_engine_warns_for_a_whole_model_compile_only(runs):
    assert any(AT_ONCE in s and "compile_blocks" in s for s in runs["whole"][2])
    assert runs["eager"][2] == [] and runs["blocks"][2] == []


LOSSES = {"sum": lambda out: out.sum(),
          "cross_entropy": lambda out: F.cross_entropy(out, torch.arange(256) % 512),
          "square_mean": lambda out: out.square().mean()}


@pytest.mark.parametrize("compiled", ["whole", "blocks"])
@pytest.mark.parametrize("loss_fn", list(LOSSES.values()), ids=list(LOSSES))
def test_the_whole_model_warning_holds_with_a_loss_that_saves_tensors(compiled, loss_fn):
    """4 x (Linear(512) + ReLU) and a Linear head. A loss that saves a tensor of its own
    (cross-entropy its log-softmax, square its input: 512 KiB, outside the compiled region,
    given back before the region's backward starts) kept the share backward held at once
    under 90% of the moved bytes, and the warning did not fire."""
    torch.manual_seed(0)
    model = nn.Sequential(*mlp(n=4), nn.Linear(512, 512))
    model = (torch.compile(model, backend="aot_eager") if compiled == "whole"
             else compile_blocks(model, backend="aot_eager"))
    offloader = Offloader(RAW)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with offloader:
                loss = loss_fn(model(batch()))
            loss.backward()
        offloader.close()
    said = [str(w.message) for w in caught if str(w.message).startswith("cswap")]
    if compiled == "whole":
        assert len(said) == 1 and AT_ONCE in said[0] and "compile_blocks" in said[0]
    else:
        assert said == []


def test_per_block_compilation_gets_the_saving_back(runs):
    """Measured: eager 1,572,864 B (three 512 KiB activations at once), whole-model compile
    4,718,592 B (all eight offloaded ones back at the start of backward, and more), per block
    1,572,864 B, as eager."""
    eager, whole, per_block = (runs[name][1] for name in ("eager", "whole", "blocks"))
    assert per_block <= 1.25 * eager
    assert whole >= 2.5 * per_block


def test_per_block_gradients_are_bitwise_those_without_engine_or_compile(runs):
    plain, _ = train(mlp(), steps=1)
    for got, want in zip(runs["blocks"][0], plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_inductor_blocks_give_the_gradients_of_inductor_blocks_without_the_engine():
    """Inductor reorders float operations (the bias gradients differ from eager's by up to
    2e-4), so it is compared with itself: the engine changes nothing, bit for bit. Backward
    holds 1,179,648 B at once (inductor saves fewer tensors), no more than eager's 1,572,864."""
    model = compile_blocks(mlp(), backend="inductor")
    reference, _ = train(model, steps=1)
    reference = [g.clone() for g in reference]
    offloader = Offloader(RAW)
    grads, said = train(model, offloader)
    for got, want in zip(grads, reference, strict=True):
        assert torch.equal(got, want)
    assert said == [] and offloader.last_step().peak_resident_bytes <= 1_572_864
    offloader.close()


def test_the_blocks_of_a_transformer_a_sequential_and_a_flat_sequential():
    encoder = make_transformer()  # Sequential(TransformerEncoder(layers), Flatten, Linear)
    assert blocks(encoder) == list(encoder[0].layers)  # ModuleLists first
    nested = mlp(n=3, width=4)
    assert blocks(nested) == list(nested)
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert blocks(flat) == list(flat)
    compile_blocks(flat, backend="aot_eager")
    assert [is_compiled(m) for m in flat] == [True, True, True] and not is_compiled(flat)
    assert list(flat.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_model_that_is_one_block_is_compiled_whole_with_a_note():
    model = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="no nn.ModuleList or nn.Sequential"):
        assert compile_blocks(model, backend="aot_eager") is model
    assert is_compiled(model)


def test_compiling_twice_compiles_nothing_again():
    model = compile_blocks(mlp(n=2, width=4), backend="aot_eager")
    compiled = [block.forward for block in model]
    compile_blocks(model, backend="inductor")
    assert [block.forward for block in model] == compiled


def test_a_copy_or_a_pickle_of_a_compiled_model_runs_its_own_weights():
    """A compiled bound method, copied, went on running the original block (its weights);
    pickling it failed (``ddp_spawn`` pickles the model)."""
    model = compile_blocks(mlp(n=2, width=4), backend="aot_eager")
    x = torch.randn(3, 4)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert torch.equal(twin(x), torch.zeros(3, 4))
    assert model(x).abs().sum() > 0
    back = pickle.loads(pickle.dumps(model))
    assert torch.equal(back(x), model(x))
    assert all(is_compiled(block) for block in back) and back[0].forward.block is back[0]


@pytest.mark.slow
def test_every_block_of_a_deep_model_is_compiled_past_dynamos_recompile_limit():
    """Each GPT-2 block reads its own cache slot, so Dynamo compiles each one again; past its
    limit of 8 the rest ran eagerly, with only a log line to say so."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, inputs):
        graphs.append(gm)
        return gm.forward

    config = GPT2Config(n_layer=12, n_embd=32, n_head=2, n_positions=32, vocab_size=50,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = compile_blocks(GPT2LMHeadModel(config).train(), backend=backend)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(graphs) == 12


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        compile_blocks(lambda x: x)
    with pytest.raises(ValueError, match="the model is already compiled as a whole"):
        compile_blocks(torch.compile(mlp(n=2, width=4)))
    inside = nn.ModuleDict({"body": torch.compile(mlp(n=2, width=4)), "head": nn.Linear(4, 4)})
    with pytest.raises(ValueError, match="^cswap: body is already compiled"):
        compile_blocks(inside)
    itself = mlp(n=2, width=4)
    itself.compile()
    assert compiled_whole(itself) == ["the model"]


def test_a_hugging_face_model_compiles_each_decoder_layer_and_trains_alike():
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    model = compile_blocks(copy.deepcopy(plain), backend="aot_eager")
    layers = list(model.model.layers)
    assert blocks(model) == layers and all(is_compiled(layer) for layer in layers)
    assert not any(is_compiled(m) for m in model.modules() if m not in layers)
    assert list(model.state_dict()) == list(plain.state_dict())

    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    plain(input_ids=ids, labels=ids).loss.backward()
    offloader = Offloader(RAW)
    with offloader:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert offloader.last_step().offloaded_bytes > 0
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    offloader.close()


@pytest.mark.parametrize("config, steps", [
    (CSwapConfig(plan="raw", min_bytes=0), 2),
    # A run that fits: after its plan is checked, the steps run without the engine's hooks.
    (CSwapConfig(budget=1 << 40, profile_steps=1, min_bytes=0), 4),
    # A budget the run fits without room to spare (on the CPU, more than half of it): the kept
    # sites are only counted.
    (CSwapConfig(budget=12000, profile_steps=1, min_bytes=0), 4)],
    ids=["raw", "no hooks", "counted"])
def test_a_module_compiled_with_its_compile_method_trains_under_the_engine(config, steps):
    """``module.compile()`` compiles the module's forward; Dynamo must not trace the engine's
    hooks, which the forward's ops call (it inlined them and failed before), nor the frames
    of a step that only counts."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    swapped = copy.deepcopy(plain)
    for module in (plain, swapped):
        module.compile(backend="aot_eager")
    x = torch.randn(16, 64)
    off = Offloader(config)
    for _ in range(steps):
        for module in (plain, swapped):
            module.zero_grad(set_to_none=True)
        plain(x).sum().backward()
        with off:
            loss = swapped(x).sum()
        loss.backward()
        for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    last = off.last_step()
    if config.plan == "raw":
        assert last.offloaded_bytes > 0
    elif config.budget == 1 << 40:
        assert last.hooks_off and not last.sites
    else:
        assert last.untracked_tensors > 0 and not last.sites and not last.hooks_off
    off.close()
