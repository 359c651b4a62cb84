"""Models to estimate, built on the meta device: a transformers config (by name from a small
table, or a ``config.json``), or the package's own CNNs under torchvision's module names.

A model here is what one training step needs: the network (random init, shapes only), its
batch for a sequence length and batch size, and its loss. LoRA (peft's) freezes the base
weights and trains low-rank adapters on every linear layer but the head; QLoRA holds those
base layers in 4 bits (bitsandbytes' NF4), as a ``BitsAndBytesConfig`` loads them.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..extras import require

# Published configs (shapes only: what the estimate needs), by name.
KNOWN: dict[str, dict] = {
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "tie_word_embeddings": False},
    "qwen2-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                 "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "vocab_size": 152064, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32768,
                   "max_position_embeddings": 32768, "sliding_window": None,
                   "tie_word_embeddings": False},  # v0.3
    "gpt2-medium": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16,
                    "n_positions": 1024, "vocab_size": 50257},
    "bert-large": {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "intermediate_size": 4096,
                   "max_position_embeddings": 512, "vocab_size": 30522, "num_labels": 2,
                   "architectures": ["BertForSequenceClassification"]},
}
CNNS = ("resnet50", "vgg16")
_DROPOUT_KEYS = ("dropout", "pdrop", "dropout_prob")
IMAGE_SIDE = 224


@dataclass(frozen=True)
class Model:
    """How to build a network on the meta device and train it one step."""

    name: str
    build: Callable[..., nn.Module]  # (dtype=torch.float32): the network, in that dtype
    # (batch, sequence, dtype) -> the batch's tensors on the meta device, as the loss takes
    # them (images in the weights' dtype, as a loop casts them before the step)
    batch: Callable[[int, int, torch.dtype], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    sequence: bool  # whether the sequence length means anything (not for a CNN)
    max_sequence: int | None = None  # the config's positions, where it has a limit
    attention: str = ""  # a transformer's attention: "sdpa", or "eager" where it has none
    # the config's quantization (its quant_method), which the estimate leaves out: "" if none
    quantization: str = ""
    four_bit: bool = False  # the base's linear layers in 4 bits (QLoRA, ``LoRA.quantized``)


@dataclass(frozen=True)
class LoRA:
    """peft's LoRA on every linear layer but the head (``target_modules="all-linear"``)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0  # peft's default; above 0 each adapter saves a mask and a copy
    # QLoRA: the frozen base's linear layers (all but the head) in 4-bit NF4 with double
    # quantization (bitsandbytes, as transformers loads them with a ``BitsAndBytesConfig``)
    quantized: bool = False


def config_dict(name_or_path: str) -> dict:
    """A known model's config, or a ``config.json`` file's (or a folder holding one)."""
    if name_or_path in KNOWN:
        return dict(KNOWN[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: name one of "
                         f"{', '.join([*KNOWN, *CNNS])}, or give a config.json path")
    data = json.loads(path.read_text())
    if "model_type" not in data:
        raise ValueError(f"{path}: no model_type in it; is it a transformers config.json?")
    return data


def model(name_or_path: str, dropout: bool = True, lora: LoRA | None = None,
          layers: int | None = None, overrides: dict | None = None) -> Model:
    """The model of a name (``KNOWN``, ``CNNS``) or config file; ``dropout=False`` sets every
    dropout of the config to 0 (as the H100 transformer profiles ran: no masks saved);
    ``layers``: that many of its layers (a transformer's) instead of the config's;
    ``overrides``: config fields to replace (a tiny model of the same kind, say)."""
    if name_or_path in CNNS:
        if lora is not None or layers is not None or overrides:
            raise ValueError(f"LoRA and a number of layers are for the transformers models, "
                             f"not {name_or_path}")
        return _cnn(name_or_path)
    name = name_or_path
    if name not in KNOWN:  # a file: named by its folder (hub snapshots) or its stem
        path = Path(name)
        name = path.name if path.is_dir() else (
            path.parent.name if path.name == "config.json" and path.parent.name else path.stem)
    data = config_dict(name_or_path) | (overrides or {})
    if layers is not None:
        key = "n_layer" if "n_layer" in data else "num_hidden_layers"
        data[key] = layers
        name += f"-{layers}l"
    return _transformer(name, data, dropout, lora)


def _head(kind: str) -> str:
    """The model class for a config without ``architectures``, by transformers' own tables:
    an encoder's (a ``model_type`` with a masked LM: BERT, RoBERTa) sequence classifier, as
    ``bert-large`` trains here; the others' causal LM, else their sequence classifier; ""
    for neither."""
    from transformers.models.auto import modeling_auto as auto

    classifier = auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(kind, "")
    if kind in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return classifier
    return auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) or classifier


def _transformer(name: str, data: dict, dropout: bool, lora: LoRA | None) -> Model:
    transformers = require("transformers", f"the transformers model {name}")
    with _quiet_bitsandbytes():  # peft imports it where installed
        peft = require("peft", "LoRA") if lora is not None else None  # said before any work
    quantizing = data.get("quantization_config") or {}
    quantization = quantizing.get("quant_method", "")
    if quantization == "bitsandbytes" and quantizing.get("load_in_4bit"):
        if lora is None:
            raise ValueError(f"{name}: its quantization_config loads the base in 4 bits, "
                             "which trains adapters only: plan it with --qlora (or --lora)")
        lora, quantization = replace(lora, quantized=True), ""
    four_bit = lora is not None and lora.quantized
    if four_bit:
        require("bitsandbytes", "QLoRA (4-bit base weights)")
    data = {k: v for k, v in data.items() if k not in ("torch_dtype", "dtype",
                                                         "transformers_version",
                                                         "quantization_config")}
    kind = data.pop("model_type")
    config = transformers.AutoConfig.for_model(kind, **data)
    if not dropout:
        for k, v in config.to_dict().items():
            if k.endswith(_DROPOUT_KEYS) and isinstance(v, float):
                setattr(config, k, 0.0)
    config.use_cache = False
    architecture = (data.get("architectures") or [_head(kind)])[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        what = architecture or f"causal LM nor sequence classifier for model_type {kind!r}"
        raise ValueError(f"{name}: transformers {transformers.__version__} has no {what}")
    classify = architecture.endswith("ForSequenceClassification")
    # SDPA, as the GPU runs it, where the model has it (Gemma-2 and Mamba have not)
    attention = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    config._attn_implementation = attention

    def build(dtype: torch.dtype = torch.float32) -> nn.Module:
        net = cls(config)
        if four_bit:  # the config's own, or QLoRA's: computing in the model's dtype
            net = _four_bit(net.to(dtype), transformers.BitsAndBytesConfig.from_dict(
                quantizing or {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                               "bnb_4bit_use_double_quant": True,
                               "bnb_4bit_compute_dtype": dtype}))
        if lora is not None:
            with warnings.catch_warnings():  # peft reads transformers' deprecated spelling
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                        FutureWarning)
                net = peft.get_peft_model(net, peft.LoraConfig(
                    r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                    target_modules="all-linear"))
        return net

    def batch(size: int, sequence: int, _dtype: torch.dtype) -> dict[str, torch.Tensor]:
        ids = torch.zeros(size, sequence, dtype=torch.long, device="meta")
        labels = torch.zeros(size, dtype=torch.long, device="meta") if classify else ids
        return {"input_ids": ids, "labels": labels}

    def loss(net: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return net(**inputs).loss

    limit = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None)
    # rotary positions extend past the table's length; learned ones (GPT-2, BERT, OPT) cannot
    rotary = any("rope" in key or "rotary" in key for key in config.to_dict())
    return Model(name, build, batch, loss, True, None if rotary else limit, attention,
                 str(quantization or ""), four_bit)


@contextmanager
def _quiet_bitsandbytes() -> Iterator[None]:
    """bitsandbytes' import without the warning its CPU backend logs on CPUs with AVX512-BF16
    where the ``kernels`` package (a download of faster CPU kernels) is missing: a plan runs
    none of its CPU kernels, and downloads nothing."""
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _four_bit(net: nn.Module, config) -> nn.Module:
    """``net`` with its linear layers but the head in 4 bits (transformers' own replacement
    and choice of what stays, bitsandbytes' quantization, where the weights are: the meta
    device, the CPU, a GPU), as transformers' quantizer leaves it (``is_loaded_in_4bit``:
    peft wraps its layers as QLoRA's)."""
    bnb = require("bitsandbytes", "QLoRA (4-bit base weights)")
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("cpu"):
        # bitsandbytes keeps the code book of double quantization where it first moved it,
        # for every later quantization: on the meta device, a real QLoRA model loaded after
        # a plan in the same process would fail. Kept on the CPU, as a CPU load keeps it.
        bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    plain = {name: m for name, m in net.named_modules() if type(m) is nn.Linear}
    net = replace_with_bnb_linear(net, get_keys_to_not_convert(net), config)
    for name, module in net.named_modules():
        if name not in plain or not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = plain[name].weight.detach()
        module.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type=config.bnb_4bit_quant_type,
            compress_statistics=config.bnb_4bit_use_double_quant,
            quant_storage=config.bnb_4bit_quant_storage, module=module)
        module.bias = plain[name].bias
        module.weight = module.weight._quantize(weight.device)
    net.is_loaded_in_4bit = True
    return net


def _cnn(name: str) -> Model:
    from ..recipes.nets import resnet50, vgg16

    def build(_dtype: torch.dtype = torch.float32) -> nn.Module:
        return _torchvision_names(name, resnet50() if name == "resnet50" else vgg16())

    def batch(size: int, _sequence: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {"images": torch.zeros(size, 3, IMAGE_SIDE, IMAGE_SIDE, dtype=dtype,
                                      device="meta"),
                "labels": torch.zeros(size, dtype=torch.long, device="meta")}

    def loss(net: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(net(inputs["images"]), inputs["labels"])

    return Model(name, build, batch, loss, False)


def _torchvision_names(name: str, net: nn.Sequential) -> nn.Sequential:
    """The package's network with torchvision's module names (``layer2.1.conv1``,
    ``features.3``), which the profiles carry and ``workload`` finds blocks by."""
    layers = list(net)
    if name == "vgg16":
        pool = next(i for i, m in enumerate(layers) if isinstance(m, nn.AdaptiveAvgPool2d))
        return nn.Sequential(OrderedDict(
            features=nn.Sequential(*layers[:pool]), avgpool=layers[pool],
            flatten=layers[pool + 1], classifier=nn.Sequential(*layers[pool + 2:])))
    stages, start = [], 4
    for blocks in (3, 4, 6, 3):
        stages.append(nn.Sequential(*layers[start:start + blocks]))
        start += blocks
    rest = OrderedDict(zip(("conv1", "bn1", "relu", "maxpool"), layers[:4], strict=True))
    rest |= {f"layer{k + 1}": stage for k, stage in enumerate(stages)}
    rest |= dict(zip(("avgpool", "flatten", "fc"), layers[start:], strict=True))
    return nn.Sequential(rest)


def build(m: Model, dtype: torch.dtype) -> nn.Module:
    """``m``'s network on the meta device in ``dtype``, in training mode."""
    with torch.device("meta"):
        return m.build(dtype).to(dtype).train()
