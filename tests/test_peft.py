"""LoRA fine-tuning with peft, where activation memory matters most (frozen weights, small
adapters, every layer's activations saved): the engine keeps the adapters' gradients bitwise
and leaves the frozen weights in place. peft comes with the dev extra; it imports only beside
a torchao it accepts (>= 0.16) or none, which is why the benchmarks' torchtune, pinning
torchao below 0.10, has an environment of its own."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import ops_run_again
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from cswap_lightning import CSwapConfig, Offloader

ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama() -> torch.nn.Module:
    """A 2-layer Llama from a config (random weights, no download) with LoRA adapters on every
    projection."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ADAPTED)
    return get_peft_model(LlamaForCausalLM(config), lora)


def adapter_grads(offloader: Offloader | None, ids: torch.Tensor, steps: int = 3,
                  model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The adapters' gradients after the last step (three: measured, checking and checked
    steps) of ``model`` (a new ``lora_llama()`` where None)."""
    model = model if model is not None else lora_llama()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with offloader if offloader is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("plan", ["raw", "zvc", pytest.param("auto", marks=pytest.mark.slow),
                                  pytest.param("rle", marks=pytest.mark.slow)])  # 11 s, 6 s
def test_lora_adapters_get_bitwise_gradients_and_frozen_weights_stay(plan):
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    plain = adapter_grads(None, ids)
    offloader = Offloader(CSwapConfig(plan=plan, min_bytes=0, budget=None))
    swapped = adapter_grads(offloader, ids)
    assert plain and plain.keys() == swapped.keys()
    assert all("lora_" in name for name in plain)  # only the adapters train
    for name, grad in plain.items():
        assert torch.equal(grad, swapped[name]), name
    step = offloader.tracked_step()
    offloader.close()
    assert step.offloaded_bytes > 0  # activations moved
    assert step.weight_bytes > 0  # the frozen base weights autograd saved stayed in place
    assert all(s.decision == "keep" for s in step.sites if s.reason in ("leaf", "view of a leaf",
                                                                        "parameter"))


def test_lora_layers_below_the_layer_keep_the_adapters_sums_and_stay_bitwise(monkeypatch):
    """Every layer of a LoRA Llama recomputed below the layer after the measured step: the
    choice made there keeps each adapted projection's sum and rotary's outputs, so the
    recomputation runs no matrix product, no sum and no rotary embedding again, only the
    norms' and the MLP's elementwise work; the adapters' gradients are plain training's."""
    from cswap_lightning.core import selective
    from cswap_lightning.core.recompute import below, units

    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    plain = adapter_grads(None, ids)
    ran = ops_run_again(monkeypatch)
    lean: list[bool] = []
    close_lean = selective.Region.close_lean

    def closed(self, output):
        close_lean(self, output)
        lean.append(not self.whole)

    monkeypatch.setattr(selective.Region, "close_lean", closed)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None, profile_steps=1))
    model = lora_llama()
    assert not offloader.watch(model).recompute(list(below(units(model))))
    for _ in range(3):  # measured; watched and its choices settled; run first without
        # autograd: the last one's recomputation is seen
        model.zero_grad(set_to_none=True)
        ran.clear()
        with offloader:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert lean == [True, True]  # the last step's layers ran first without autograd
    offloader.close()
    swapped = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert plain.keys() == swapped.keys()
    for name, grad in plain.items():
        assert torch.equal(grad, swapped[name]), name
    assert "aten::silu" in ran and not {f"aten::{op}" for op in (
        "mm", "addmm", "add", "cat", "neg")} & set(ran), ran


def test_lora_layers_recomputed_whole_run_first_without_autograd_bitwise():
    """Every layer of a LoRA Llama recomputed whole: the first layer's input needs no
    gradient (the embedding is frozen), its adapters do; after the watched step the layers
    run first without autograd (``core/lean.py``) and the adapters' gradients stay plain
    training's."""
    from cswap_lightning.core.recompute import units

    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    plain = adapter_grads(None, ids, steps=4)
    offloader = Offloader(CSwapConfig(plan="raw", min_bytes=0, budget=None, profile_steps=1))
    model = lora_llama()
    layers = [n for n in units(model) if n.rsplit(".", 1)[-1].isdigit()]
    assert len(layers) == 2 and not offloader.watch(model).recompute(layers)
    swapped = adapter_grads(offloader, ids, steps=4, model=model)
    assert offloader.recomputer.verdicts.why == dict.fromkeys(layers, "")
    offloader.close()
    for name, grad in plain.items():
        assert torch.equal(grad, swapped[name]), name
