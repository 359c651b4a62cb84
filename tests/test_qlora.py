"""QLoRA as people load it: a Llama saved with random weights, loaded back through
transformers with a ``BitsAndBytesConfig`` (bitsandbytes' 4-bit NF4, double quantization; its
CPU kernels run here), peft's adapters on top. The 4-bit products save nothing through
autograd's hooks (bitsandbytes keeps its weight on the autograd context), the adapters' path
saves as LoRA's does; under the engine the adapters' gradients stay plain training's, and
recomputation below the layer keeps the 4-bit products (``ops.NAMED_PRODUCTS``) instead of
running them again: a 4-bit product is a matrix product and a dequantization, no elementwise
work."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import ops_run_again
from peft import LoraConfig, get_peft_model
from test_peft import adapter_grads as lora_adapter_grads
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.core.recompute import below, units

FOUR_BIT = "bitsandbytes::gemm_4bit"


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> str:
    """A 2-layer Llama's random weights, saved as a checkpoint to load in 4 bits."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def loaded(path: str, bits: int = 4) -> torch.nn.Module:
    """The checkpoint loaded in 4 bits as the QLoRA recipe loads it (``bits=8``: in 8 bits,
    LLM.int8's, in float32)."""
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16) if bits == 4 else (
        BitsAndBytesConfig(load_in_8bit=True))
    return LlamaForCausalLM.from_pretrained(
        path, quantization_config=quantized,
        dtype=torch.bfloat16 if bits == 4 else torch.float32, device_map="cpu")


def adapted(model: torch.nn.Module, targets: list[str] | str = "all-linear") -> torch.nn.Module:
    torch.manual_seed(1)  # the adapters' initialisation
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))


def qlora(path: str, targets: list[str] | str = "all-linear", bits: int = 4) -> torch.nn.Module:
    """``loaded(path, bits)`` with adapters on ``targets``."""
    return adapted(loaded(path, bits), targets)


IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))


def adapter_grads(model: torch.nn.Module, offloader: Offloader | None,
                  steps: int = 3) -> dict[str, torch.Tensor]:
    """``model``'s adapters' gradients after ``steps`` steps on ``IDS``."""
    return lora_adapter_grads(offloader, IDS, steps, model)


def assert_same(plain: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert plain and plain.keys() == got.keys()
    for name, grad in plain.items():
        assert torch.equal(grad, got[name]), name


def test_the_checkpoint_loads_in_four_bits_with_peft_s_qlora_layers(saved_llama):
    model = qlora(saved_llama)
    proj = model.base_model.model.model.layers[0].mlp.gate_proj
    assert type(proj).__module__ == "peft.tuners.lora.bnb"
    assert proj.base_layer.weight.dtype == torch.uint8  # packed: two weights a byte
    assert_same(adapter_grads(qlora(saved_llama), None), adapter_grads(model, None))


@pytest.mark.parametrize("plan", ["raw", "zvc", pytest.param("auto", marks=pytest.mark.slow),
                                  pytest.param("rle", marks=pytest.mark.slow)])
def test_qlora_adapters_get_bitwise_gradients_and_the_four_bit_weights_are_not_saved(
        saved_llama, plan):
    plain = adapter_grads(qlora(saved_llama), None)
    offloader = Offloader(CSwapConfig(plan=plan, min_bytes=0, budget=None))
    swapped = adapter_grads(qlora(saved_llama), offloader)
    step = offloader.tracked_step()
    offloader.close()
    assert_same(plain, swapped)
    assert step.offloaded_bytes > 0
    # autograd saved no packed weight: bitsandbytes keeps it on its context, not as a saved
    # tensor (the weights saved are the adapters' and the norms', in bfloat16)
    assert not any(s.dtype == torch.uint8 for s in step.sites), \
        Counter(str(s.dtype) for s in step.sites)


def test_below_the_layer_keeps_the_four_bit_products_and_runs_the_elementwise_work(
        saved_llama, monkeypatch):
    """Adapters on the attention's query and value only (the QLoRA paper's first recipe): the
    MLP's three projections and the key and output projections are 4-bit products alone.
    Recomputed below the layer, each layer runs its norms and its MLP's activation again and
    none of the products; the adapters' gradients are plain training's."""
    targets = ["q_proj", "v_proj"]
    plain = adapter_grads(qlora(saved_llama, targets), None, steps=4)
    ran = ops_run_again(monkeypatch)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None, profile_steps=1))
    model = qlora(saved_llama, targets)
    chosen = list(below(units(model)))
    assert len(chosen) == 2 and not offloader.watch(model).recompute(chosen)
    swapped = adapter_grads(model, offloader, steps=4)
    offloader.close()
    assert_same(plain, swapped)
    assert "aten::silu" in ran and "aten::rsqrt" in ran, Counter(ran)
    assert FOUR_BIT not in ran and "aten::mm" not in ran, Counter(ran)


def test_an_eight_bit_base_trains_bitwise_swapped_and_below_the_layer(saved_llama,
                                                                      monkeypatch):
    """LoRA on LLM.int8's 8-bit base (bitsandbytes' ``Linear8bitLt``): bitwise with every
    tensor swapped, and recomputed below the layer without its 8-bit products again (each
    returns an empty tensor beside its product, which its autograd context keeps: no bytes
    to change, so no reason to run the product again)."""
    targets = ["q_proj", "v_proj"]
    plain = adapter_grads(qlora(saved_llama, targets, bits=8), None, steps=4)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None))
    assert_same(plain, adapter_grads(qlora(saved_llama, targets, bits=8), offloader, steps=4))
    assert offloader.tracked_step().offloaded_bytes > 0
    offloader.close()
    ran = ops_run_again(monkeypatch)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None, profile_steps=1))
    model = qlora(saved_llama, targets, bits=8)
    assert not offloader.watch(model).recompute(list(below(units(model))))
    assert_same(plain, adapter_grads(model, offloader, steps=4))
    offloader.close()
    assert "aten::silu" in ran, Counter(ran)
    assert not [op for op in ran if op.startswith("bitsandbytes::int8_")
                and op.endswith(("matmul", "_mm"))], Counter(ran)


def test_layers_recomputed_whole_stay_under_checkpoint_and_bitwise(saved_llama):
    """Layers recomputed whole run their 4-bit products again. They stay under checkpoint
    (no first run without autograd, ``core/lean.py``): bitsandbytes' product reads its
    input's ``requires_grad`` (a single token without autograd takes another kernel), which
    the watched step sees; the frozen 4-bit weights themselves do not keep them there."""
    plain = adapter_grads(qlora(saved_llama), None, steps=4)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None, profile_steps=1))
    model = qlora(saved_llama)
    layers = [n for n in units(model) if n.rsplit(".", 1)[-1].isdigit()]
    assert len(layers) == 2 and not offloader.watch(model).recompute(layers)
    swapped = adapter_grads(model, offloader, steps=4)
    assert offloader.recomputer.verdicts.why == dict.fromkeys(
        layers, "its forward reads a tensor's .requires_grad")
    offloader.close()
    assert_same(plain, swapped)


def test_the_estimate_holds_the_base_in_four_bits_and_saves_what_lora_saves():
    """``cswap plan --qlora``'s trace (meta device, bitsandbytes' fake kernels): one
    Llama-3-8B layer saves the activations LoRA's saves, its products count as matrix
    products with LoRA's operations, and its linear layers hold half a byte a weight and
    the scales of double quantization (one 8-bit scale per 64 weights, a float32 one per
    256 of those), against bfloat16's two bytes."""
    from cswap_lightning.planning import models
    from cswap_lightning.planning.devices import device
    from cswap_lightning.planning.estimate import Setup, estimate, saved_bytes, traced

    dev = device("h100-pcie")
    steps = {}
    for quantized in (False, True):
        setup = Setup("llama-3-8b", 64, 1, lora=models.LoRA(quantized=quantized), layers=1)
        step = traced(setup, dev.attention)
        products = {backward: sum(k.flops for k in step[0].kernels
                                  if k.kind == "matmul" and k.backward == backward)
                    for backward in (False, True)}
        steps[quantized] = estimate(setup, dev, step=step), products
    (lora, lora_flops), (four_bit, four_bit_flops) = steps[False], steps[True]
    assert saved_bytes(four_bit.profile) == saved_bytes(lora.profile) > 0
    assert four_bit_flops == lora_flops and lora_flops[False] > 0
    assert four_bit.training.trained_elements == lora.training.trained_elements
    linear = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # the layer's seven
    per_weight = (lora.training.weights - four_bit.training.weights) / linear
    assert per_weight == pytest.approx(2 - 0.5 - 1 / 64 - 4 / (64 * 256), rel=1e-3)
    # the dequantized weights are made and dropped in the step: the peak is higher
    assert (four_bit.profile["peak_allocated"] - four_bit.profile["allocated_before_step"]
            > lora.profile["peak_allocated"] - lora.profile["allocated_before_step"])


class RandomText(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def recipe_trainer(path: str, out, callbacks: list) -> object:
    """The QLoRA recipe in the Hugging Face Trainer: the checkpoint in 4 bits, peft's
    ``prepare_model_for_kbit_training`` (norms and head in float32, the model's gradient
    checkpointing on), adapters on every linear layer."""
    from peft import prepare_model_for_kbit_training
    from transformers import Trainer, TrainingArguments

    model = adapted(prepare_model_for_kbit_training(loaded(path)))
    args = TrainingArguments(output_dir=str(out), use_cpu=True, seed=0, report_to=[],
                             max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True)
    return Trainer(model, args, train_dataset=RandomText(), callbacks=callbacks)


def test_the_qlora_recipe_in_the_trainer_trains_bitwise_with_the_callback(saved_llama,
                                                                          tmp_path):
    from cswap_lightning import CSwapCallback

    offloading = recipe_trainer(saved_llama, tmp_path / "cswap",
                                [CSwapCallback(CSwapConfig(plan="raw", min_bytes=0))])
    offloading.train()
    plain = recipe_trainer(saved_llama, tmp_path / "plain", [])
    plain.train()
    moved = [h["cswap/offloaded_bytes"] for h in offloading.state.log_history
             if "cswap/offloaded_bytes" in h]
    assert len(moved) == 2 and moved[0] > 0
    trained = [(n, p) for n, p in offloading.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    others = dict(plain.model.named_parameters())
    for name, p in trained:
        assert torch.equal(p, others[name]), name


def test_a_plan_of_qlora_leaves_bitsandbytes_able_to_load_a_model(saved_llama, monkeypatch):
    """``cswap plan --qlora`` quantizes on the meta device; bitsandbytes keeps the code book
    of double quantization where it first moved it, so a plan made first in a process (a
    notebook) must not leave it there for the real load that follows."""
    import bitsandbytes

    from cswap_lightning.planning import models

    monkeypatch.setattr(bitsandbytes.functional, "name2qmap", {})  # a fresh process's
    spec = models.model("llama-3-8b", lora=models.LoRA(quantized=True), layers=1)
    planned = models.build(spec, torch.bfloat16)
    gate = planned.base_model.model.model.layers[0].mlp.gate_proj.base_layer.weight
    assert gate.device.type == "meta" and gate.dtype == torch.uint8  # quantized on meta
    assert bitsandbytes.functional.name2qmap["dynamic"].device.type == "cpu"
    grads = adapter_grads(qlora(saved_llama), None, steps=1)  # loads, quantizes, trains
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_qlora_in_lightning_trains_bitwise_under_the_strategy(saved_llama, tmp_path):
    """The same model in a LightningModule: ``CSwapStrategy`` against Lightning's own
    single-device strategy, the adapters' weights after three steps bitwise alike (Lightning
    moves the model to its device: 4-bit weights already there stay quantized)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from cswap_lightning import CSwapStrategy

    class Tuned(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = qlora(saved_llama)

        def training_step(self, batch, _index):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def fit(strategy) -> dict[str, torch.Tensor]:
        module = Tuned()
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS.repeat(3, 1)),
                                           batch_size=2)
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path).fit(module, data)
        return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    strategy = CSwapStrategy(CSwapConfig(plan="raw", min_bytes=0))
    offloaded = fit(strategy)
    assert strategy.offloader.last_step().offloaded_bytes > 0
    assert any(p.abs().sum() > 0 for n, p in offloaded.items() if "lora_B" in n)  # trained
    assert_same(fit(SingleDeviceStrategy("cpu")), offloaded)


def test_the_readmes_qlora_snippet_trains_under_the_callback(saved_llama, tmp_path):
    """The README's QLoRA lines as written, on the saved Llama: they train, and the
    callback moved the step's activations (the CPU fits everything, so ``budget=None``)."""
    from test_readme import python_block
    from transformers import TrainingArguments

    from cswap_lightning import CSwapCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", disable_tqdm=True)
    names = {"checkpoint": saved_llama, "args": args, "data": RandomText(),
             "CSwapCallback": CSwapCallback,
             "CSwapConfig": lambda: CSwapConfig(budget=None, min_bytes=0)}
    exec(python_block("prepare_model_for_kbit_training(model"), names)  # noqa: S102 - as written
    names["trainer"].train()
    moved = [h["cswap/offloaded_bytes"] for h in names["trainer"].state.log_history
             if "cswap/offloaded_bytes" in h]
    assert len(moved) == 2 and moved[0] > 0
