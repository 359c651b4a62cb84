"""Workloads from a config without a GPU (``planning/trace.py``, ``estimate.py``,
``devices.py``, ``sizing.py``): the meta-device trace saves what a real run saves, its ledger
counts what the allocator holds, LoRA trains only its adapters, and the sizing search finds
the longest sequence that fits. The estimate against the measured H100 and H200 profiles is
in ``test_calibration.py``."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from cswap_lightning.planning import capture, models, sizing, trace
from cswap_lightning.planning.devices import DEVICES, Rates, device
from cswap_lightning.planning.estimate import OPTIMIZERS, Setup, estimate, saved_bytes
from cswap_lightning.planning.trace import Kernel
from cswap_lightning.planning.workload import from_profile

transformers = pytest.importorskip("transformers")

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 512, "vocab_size": 256, "bos_token_id": 255, "eos_token_id": 255}


@pytest.fixture
def tiny_llama(config_file) -> str:
    return config_file("tiny-llama", TINY_LLAMA)


def _rows(rows: list[dict]) -> list[tuple]:
    """What a saved row says about the tensor (not the allocator's bytes, which the CPU
    does not count)."""
    return [(r["module"], tuple(r["shape"]), r["dtype"], r["nbytes"], r["storage_nbytes"],
             r["parameter"], r["first_of_storage"]) for r in rows]


def test_the_meta_trace_saves_what_a_cpu_step_saves():
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                         if k != "model_type"}, use_cache=False)
    config._attn_implementation = "eager"  # the one attention both devices run alike
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 32))
    measured = capture.capture(real, lambda: real(input_ids=ids, labels=ids).loss, "tiny",
                               warmup=1, steps=1, log=lambda _: None)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config).train()
    meta_ids = ids.to("meta")
    traced = trace.trace(meta, lambda: meta(input_ids=meta_ids, labels=meta_ids).loss,
                         [meta_ids])
    assert len(traced.saved) > 20
    assert _rows(traced.saved) == _rows(measured["saved"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixture_of_experts_is_traced_in_every_dtype(dtype):
    """Its experts run as one grouped matrix product, whose meta kernel in torch takes
    bfloat16 only (float32 failed inside the trace): the trace saves what a CPU step saves in
    each dtype."""
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    real = transformers.MixtralForCausalLM(config).to(dtype).train()
    ids = torch.randint(0, 256, (2, 32))
    measured = capture.capture(real, lambda: real(input_ids=ids, labels=ids).loss, "tiny",
                               warmup=1, steps=1, log=lambda _: None)
    with torch.device("meta"):
        meta = transformers.MixtralForCausalLM(config).to(dtype).train()
    meta_ids = ids.to("meta")
    traced = trace.trace(meta, lambda: meta(input_ids=meta_ids, labels=meta_ids).loss,
                         [meta_ids])
    experts = [r for r in traced.saved if r["parameter"] and len(r["shape"]) == 3]
    assert experts and all(r["dtype"] == str(dtype).removeprefix("torch.") for r in experts)
    assert _rows(traced.saved) == _rows(measured["saved"])


class DeadBranches(nn.Module):
    """Each step of its loop saves a new tensor for ``sin`` and lets every other one die in
    forward: a new storage may take a dead one's address."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.aux, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, kept = self.first(x).relu(), []
        for i in range(12):
            dead = (self.aux(h) * (i + 1.0)).sin()  # saves its input; dies every other time
            if i % 2:
                kept.append(dead)
            del dead
            kept.append((self.head(h) * (i + 1.0)).sin())
        return sum(k.sum() for k in kept)


def test_a_storage_at_a_dead_ones_address_is_its_own_first_save():
    """Every tensor ``sin`` saves here is new: neither the meta trace nor the captured step
    takes one for a save of a storage freed before it (the allocator gives the address, and
    the storage's ``_cdata``, to the next)."""
    torch.manual_seed(0)
    real, x = DeadBranches(), torch.randn(8, 64)
    measured = capture.capture(real, lambda: real(x), "dead", warmup=1, steps=1,
                               log=lambda _: None)
    with torch.device("meta"):
        meta, meta_x = DeadBranches(), torch.randn(8, 64)
    traced = trace.trace(meta, lambda: meta(meta_x), [meta_x])
    for rows in (traced.saved, measured["saved"]):
        by_sin = [r for r in rows if r["module"] == "" and r["shape"] in ([8, 64], [8, 32])]
        assert len(by_sin) == 1 + 24 and all(r["first_of_storage"] for r in by_sin)  # relu's
    assert _rows(traced.saved) == _rows(measured["saved"])


@pytest.mark.parametrize("attention, logsumexp, seeds", [
    ("cudnn", [2, 4, 32, 1], [([], "int64"), ([], "int64")]),
    ("flash", [2, 4, 32], [([2], "uint64"), ([], "uint64")])])
def test_dropout_and_attention_are_traced_as_cuda_runs_them(attention, logsumexp, seeds,
                                                            config_file):
    spec = models.model(config_file("tiny-gpt2", TINY_GPT2))
    net = models.build(spec, torch.bfloat16)
    inputs = spec.batch(2, 32, torch.bfloat16)
    traced = trace.trace(net, lambda: spec.loss(net, inputs), list(inputs.values()), attention)
    masks = [r for r in traced.saved if r["dtype"] == "bool"]
    # CUDA's fused dropout saves a bool mask: after the embeddings, and per layer after the
    # attention and the MLP (the attention probabilities' dropout is the fused kernel's)
    assert len(masks) == 1 + 2 * 2
    assert all(r["shape"] == [2, 32, 64] for r in masks)
    # the fused attention kernel's log-sum-exp and random seeds, one set per layer
    assert [r["shape"] for r in traced.saved
            if r["module"] == "" and r["dtype"] == "float32" and len(r["shape"]) >= 3
            ] == [logsumexp] * 2
    assert [(r["shape"], r["dtype"]) for r in traced.saved
            if r["dtype"].endswith("int64") and r["nbytes"] <= 16] == seeds * 2


def test_without_dropout_no_mask_is_saved(config_file):
    spec = models.model(config_file("tiny-gpt2", TINY_GPT2), dropout=False)
    net = models.build(spec, torch.bfloat16)
    inputs = spec.batch(2, 32, torch.bfloat16)
    traced = trace.trace(net, lambda: spec.loss(net, inputs), list(inputs.values()))
    assert not [r for r in traced.saved if r["dtype"] == "bool"]


def test_the_ledger_counts_each_storage_from_its_creation_to_its_release():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU())
    x = torch.empty(32, 64, device="meta")
    traced = trace.trace(net, lambda: net(x).sum(), [x])
    weight, batch, activation = 64 * 64 * 4, 32 * 64 * 4, 32 * 64 * 4
    assert traced.start_bytes == weight + batch
    saved = {r["module"]: r for r in traced.saved if not r["parameter"]}
    assert saved["0"]["allocated"] == weight + batch  # the linear saves its input
    # ReLU saves its output while the linear's output, its input, still lives
    assert saved["1"]["allocated"] == weight + batch + 2 * activation
    # the peak: the weight's gradient made, beside the loss and its gradient (512 bytes
    # each, the allocator's least) and the ReLU's input gradient; its output released
    assert traced.peak_bytes == weight + batch + activation + weight + 2 * 512
    assert traced.modules == ["0", "1"] and traced.calls == {"0": 1, "1": 1}
    assert [k.kind for k in traced.kernels if k.module == "0" and not k.backward] == ["matmul"]


def test_a_kernel_takes_the_longer_of_its_work_and_its_bytes_plus_its_fixed_time():
    rates = Rates(matmul=0.5, conv=0.25, memory=0.5, norm=0.5, forward_kernel_s=1e-6,
                  backward_kernel_s=2e-6)
    dev = replace(DEVICES["h100-sxm"], tensor_flops=1e12, fp32_flops=1e11, bandwidth=1e9,
                  rates=rates)
    compute = Kernel("m", False, "matmul", 1e9, 1000, torch.bfloat16)
    assert dev.kernel_s(compute) == pytest.approx(1e9 / 0.5e12 + 1e-6)
    assert dev.kernel_s(replace(compute, dtype=torch.float32)) == pytest.approx(
        1e9 / 0.5e11 + 1e-6)
    memory = Kernel("m", True, "memory", 0.0, 10**6, torch.bfloat16)
    assert dev.kernel_s(memory) == pytest.approx(1e6 / 0.5e9 + 2e-6)
    assert dev.kernel_s(replace(memory, kind="norm")) == pytest.approx(1e6 / 0.25e9 + 2e-6)


def test_an_unknown_device_or_model_names_the_choices():
    with pytest.raises(ValueError, match="h100-pcie"):
        device("tpu-v5")
    with pytest.raises(ValueError, match="llama-3-8b"):
        models.model("no-such-model")


def test_lora_trains_only_its_adapters(tiny_llama):
    dev = DEVICES["h100-sxm"]
    lora = estimate(Setup(tiny_llama, 64, 2, lora=models.LoRA(rank=4)), dev)
    full = estimate(Setup(tiny_llama, 64, 2), dev)
    # seven linear layers a layer, each with adapters A (rank x in) and B (out x rank)
    h, i, kv, r = 64, 128, 2 * 16, 4
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # (in, out)
    adapters = 2 * [n for a, b in shapes for n in (r * a, b * r)]
    assert lora.training.trained_elements == sum(adapters)
    assert lora.training.gradients == sum(trace.rounded(2 * n) for n in adapters)
    assert lora.training.optimizer_state == 8 * sum(adapters)  # AdamW, fp32 states
    eight_bit = estimate(Setup(tiny_llama, 64, 2, lora=models.LoRA(rank=4)), dev,
                         OPTIMIZERS["adamw-8bit"]).training
    assert eight_bit.optimizer_state == round(sum(adapters) * (2 + 8 / 256))  # and scales
    assert eight_bit.optimizer_update == 0  # in place
    frozen = [r for r in lora.profile["saved"] if r["parameter"] and not r["requires_grad"]]
    assert frozen, "the frozen base weights are saved (for the input's gradient)"
    # the workload makes gradients for the adapters only
    w = from_profile(lora.profile)
    assert 0 < w.weight_bytes == lora.training.gradients - lora.training.unsaved_gradients
    # full fine-tuning: every weight trains; the embedding's gradient is one the workload
    # cannot place (autograd saves its indices, not its weight)
    embedding = 256 * 64 * 2
    assert full.training.trained_elements > 10 * sum(adapters)
    params = len(list(models.build(models.model(tiny_llama), torch.bfloat16).parameters()))
    slack = full.training.unsaved_gradients - embedding  # the allocator's rounding
    assert 0 <= slack < 512 * params
    assert from_profile(full.profile).weight_bytes == full.training.gradients - embedding - slack


def test_the_estimated_profile_is_labelled_and_read_as_a_measured_one(tiny_llama):
    est = estimate(Setup(tiny_llama, 64, 2), DEVICES["h200"], OPTIMIZERS["sgd"])
    assert est.profile["estimate"] is True and est.profile["device"].endswith("(estimate)")
    w = est.workload()
    assert w.batch == 2 and [b.name for b in w.blocks if b.recomputable] == [
        "model.layers.0", "model.layers.1"]
    assert est.saved_bytes == saved_bytes(est.profile)
    assert est.saved_bytes - w.activation_bytes == 2 * 64 * 8  # the ids, which the loop holds
    assert w.forward_s == pytest.approx(est.profile["plain_forward_ms"] / 1e3)
    assert est.training.optimizer_state == 0
    assert est.optimizer_peak == est.profile["allocated_before_step"] + est.training.gradients


def test_a_learned_position_table_bounds_the_sequence():
    with pytest.raises(ValueError, match="1024 learned positions"):
        estimate(Setup("gpt2-medium", 2048, 1), DEVICES["h100-sxm"])


@pytest.mark.parametrize("name, billions", [
    ("llama-3-8b", 8.03), ("qwen2-7b", 7.62), ("mistral-7b", 7.25),
    ("gpt2-medium", 0.355), ("bert-large", 0.335)])
def test_the_known_configs_have_their_published_sizes(name, billions):
    net = models.build(models.model(name), torch.bfloat16)
    count = sum(p.numel() for p in {p.untyped_storage()._cdata: p
                                    for p in net.parameters()}.values())
    assert count / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("limit, expected", [(0, None), (300, 256), (1000, 768),
                                             (10000, 4096)])
def test_the_search_finds_the_largest_multiple_that_is_ok(limit, expected):
    asked = []

    def ok(n: int) -> bool:
        asked.append(n)
        return n <= limit

    assert sizing._largest(ok, 256, 4096) == expected
    assert len(asked) <= 8
    assert all(n % 256 == 0 and n <= 4096 for n in asked)


def test_the_longest_sequence_fits_and_one_step_more_does_not(tiny_llama):
    dev = DEVICES["h100-sxm"]
    setup = Setup(tiny_llama, 256, 1, layers=8)  # layers that outweigh the head's logits
    est = estimate(setup, dev)
    small = replace(dev, memory_bytes=sizing.CONTEXT_BYTES + est.optimizer_peak + (24 << 20))
    est = estimate(setup, small)
    found = {how: sizing.largest(est, how, 1 << 16) for how in ("none", "checkpointing",
                                                               "planner")}
    assert found["none"] is not None
    # the planner's most frugal plan frees at least what checkpointing does (here the same:
    # the peak is the head's logits, which backward needs first)
    assert found["none"] < found["checkpointing"] <= found["planner"] < 1 << 16
    for how, n in found.items():
        assert sizing.fits(estimate(replace(setup, sequence=n), small), how)
        assert not sizing.fits(estimate(replace(setup, sequence=n + sizing.GRANULE), small), how)


def test_ways_compare_the_mix_with_checkpointing(tiny_llama):
    est = estimate(Setup(tiny_llama, 1024, 1), DEVICES["rtx-4090"])
    base = sizing.baselines(est)
    assert [w.label for w in base] == ["no help", "checkpointing"]
    assert base[1].prediction.peak_bytes < base[0].prediction.peak_bytes
    budget = base[1].prediction.peak_bytes
    (chosen,) = sizing.mixes(est, [("at checkpointing's peak", budget)])
    assert chosen.fits and chosen.prediction.peak_bytes <= budget
    assert chosen.step_s <= base[1].step_s * 1.001  # never slower than checkpointing


def test_a_host_budget_bounds_what_the_mixes_swap(tiny_llama):
    """At checkpointing's peak the mix swaps about 6 MiB to beat checkpointing; half of that
    on the host swaps less, for a slower step; none, checkpointing itself."""
    est = estimate(Setup(tiny_llama, 2048, 1, layers=8), DEVICES["h100-pcie"])
    _, checkpointing = sizing.baselines(est)
    budget = [("checkpointing's peak", checkpointing.prediction.peak_bytes)]
    (free,) = sizing.mixes(est, budget)
    host = free.prediction.host_bytes // 2
    (held,) = sizing.mixes(est, budget, host=host)
    (none,) = sizing.mixes(est, budget, host=0)
    assert free.prediction.host_bytes > 4 << 20
    assert 0 < held.prediction.host_bytes <= host and none.prediction.host_bytes == 0
    assert all(w.fits for w in (free, held, none))
    assert free.step_s < held.step_s < none.step_s == pytest.approx(checkpointing.step_s)


@pytest.mark.slow
def test_the_longest_sequence_the_planner_fits_its_mix_fits_too(tiny_llama):
    """24 layers on a device with 40 MiB for activations: recomputing every layer and
    swapping the earliest inputs lowers the peak, swapping the last ones raises it again
    (backward wants them first): the search finds the longest sequence some count fits, the
    mix at the device's memory fits it too, with no host memory it is checkpointing's, and
    with 4 MiB in between."""
    dev = DEVICES["h100-sxm"]
    setup = Setup(tiny_llama, 2048, 1, layers=24)
    est = estimate(setup, dev)
    small = replace(dev, memory_bytes=sizing.CONTEXT_BYTES + est.optimizer_peak + (40 << 20))
    est = estimate(setup, small)
    found = {host: sizing.largest(est, "planner", 1 << 16, host=host)
             for host in (None, 4 << 20, 0)}
    assert found[0] == sizing.largest(est, "checkpointing", 1 << 16)
    assert found[0] < found[4 << 20] < found[None]
    for n, fit in ((found[None], True), (found[None] + sizing.GRANULE, False)):
        at = estimate(replace(setup, sequence=n), small)
        (way,) = sizing.mixes(at, [("the device", sizing.usable(small))])
        assert way.fits == fit, (n, way.how)


def kept_below(model: torch.nn.Module) -> list[tuple[int, list[list[int]]]]:
    """What the engine's block timer saw each layer of ``model`` recomputed below the layer
    would keep each way, on the CPU (its input's bytes, then each kept output's)."""
    import cswap_lightning as cswap

    ids = torch.randint(0, 256, (2, 32))
    off = cswap.Offloader(cswap.CSwapConfig(plan="keep", budget=None)).watch(model)
    for _ in range(2):  # the first is measured: its block calls are read at the next
        with off:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    seen = [(c.input_bytes, [list(way.kept[1:]) for way in c.below])
            for c in off.block_calls if c.below]
    off.close()
    return seen


def traced_below(est) -> list[tuple[int, list[list[int]]]]:
    """The same, traced on the meta device, but the attention's random-number seeds, which
    only CUDA's fused kernels return."""
    return [(layer["input_bytes"], [[n for n in way["kept"] if n > 16] for way in layer["below"]])
            for layer in est.profile["layers"]]


def tiny_llama_model(kind: str = "llama") -> torch.nn.Module:
    """The tiny Llama's config as a model of ``kind`` (Qwen2: biased q, k and v)."""
    config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in TINY_LLAMA.items()
                                                        if k != "model_type"})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_qwen2_is_traced_below_the_layer_as_the_engine_keeps_it(config_file):
    """Qwen2's biased projections (``addmm``) and rotary: the trace keeps what the engine
    keeps."""
    path = config_file("tiny-qwen2", {**TINY_LLAMA, "model_type": "qwen2"})
    est = estimate(Setup(path, 32, 2, dtype=torch.float32), device("h100-pcie"))
    traced, seen = traced_below(est), kept_below(tiny_llama_model("qwen2"))
    assert traced == seen and len(seen) == 2


def test_the_trace_keeps_below_the_layer_what_the_engine_keeps(tiny_llama):
    """What recomputing each layer below the layer keeps (its input, the fewest bytes that
    make what backward reads: rotary's outputs, attention's, the residual sum, gate and up),
    traced on the meta device, is what the engine's block timer saw on the CPU; and the
    layer's elementwise share of its forward is the estimate's cost of it."""
    est = estimate(Setup(tiny_llama, 32, 2, dtype=torch.float32), device("h100-pcie"))
    traced, seen = traced_below(est), kept_below(tiny_llama_model())
    assert traced == seen and len(seen) == 2
    w = est.workload()
    layers = [b for b in w.blocks if b.below]
    assert [b.name for b in layers] == ["model.layers.0", "model.layers.1"]
    for block, layer in zip(layers, est.profile["layers"], strict=True):
        forward = sum(op.forward_s for op in w.ops[block.ops.start:block.ops.stop])
        assert 0 < block.below[0].seconds < forward
        for below, way in zip(block.below, layer["below"], strict=True):
            assert below.kept == (layer["input_bytes"], *way["kept"])
        # a heavier weight keeps more bytes and runs less again (the cuts are nested)
        for lighter, heavier in itertools.pairwise(block.below):
            assert sum(lighter.kept) <= sum(heavier.kept)
            assert lighter.seconds >= heavier.seconds


def test_with_lora_the_trace_keeps_below_the_layer_what_the_engine_keeps(tiny_llama):
    """peft's LoRA on every linear layer: each adapted projection's sum is kept (not the base
    product), in the trace as by the engine, byte for byte, and no more than without LoRA
    (the adapters' narrow products apart)."""
    from peft import LoraConfig, get_peft_model

    lora = models.LoRA()
    est = estimate(Setup(tiny_llama, 32, 2, dtype=torch.float32, lora=lora),
                   device("h100-pcie"))
    model = get_peft_model(tiny_llama_model(), LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules="all-linear"))
    traced, seen = traced_below(est), kept_below(model)
    assert traced == seen and len(seen) == 2
    plain = traced_below(estimate(Setup(tiny_llama, 32, 2, dtype=torch.float32),
                                  device("h100-pcie")))
    narrow = 2 * 32 * lora.rank * 4  # an adapter's first product (batch, tokens, rank, fp32)
    assert ([sum(n for n in k[0] if n != narrow) for _, k in traced]
            == [sum(k[0]) for _, k in plain])
