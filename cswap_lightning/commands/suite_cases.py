"""What ``cswap bench suite`` runs: its models, and the methods of holding saved activations
it compares, each set up on a model.

Its own module because ``cswap bench measure`` builds the same models and checkpoints them
the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..config import CSwapConfig
from ..core.engine import Offloader
from ..hf_checkpointing import checkpointing_switch, has_offload
from ..planning import ops
from .bench_step import _Counted

if TYPE_CHECKING:
    from transformers import LlamaConfig

NO_OFFLOAD = "no offload"
CHECKPOINTING = "activation checkpointing"
HF_OFFLOAD = "HF built-in offload"
SAVE_ON_CPU = "save_on_cpu"
TORCHTUNE = "torchtune OffloadActivations"
CSWAP = {  # method -> CSwapConfig fields
    "cswap raw": {"plan": "raw"},
    "cswap auto": {"plan": "auto"},
    "cswap auto + int8": {"plan": "auto", "lossy": "int8"},
}
BUDGETED = ("cswap auto", "cswap auto + int8")  # CSwapConfig.budget is for plan="auto" only
METHODS = (NO_OFFLOAD, CHECKPOINTING, HF_OFFLOAD, SAVE_ON_CPU, TORCHTUNE, *CSWAP)
DESCRIPTIONS = {
    NO_OFFLOAD: "autograd keeps every saved tensor on the device (the baseline of every ratio)",
    CHECKPOINTING: "torch.utils.checkpoint (non-reentrant) around each block (ResNet "
    "bottleneck, VGG stage, transformer layer); Hugging Face models through their own "
    "activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers 5.23)",
    HF_OFFLOAD: "transformers' activation_checkpointing_enable(offload=True), what the Trainer "
    "does for activation_checkpointing_kwargs={'offload': True} (transformers 5.17-5.22: "
    "gradient_checkpointing_enable and gradient_checkpointing_kwargs): each checkpointed layer "
    "runs inside save_on_cpu(pin_memory=True), synchronous copies",
    SAVE_ON_CPU: "torch.autograd.graph.save_on_cpu(pin_memory=True) around forward: every "
    "saved tensor copied to host memory, copied back on use",
    TORCHTUNE: "torchtune.training.OffloadActivations: side stream, pinned memory, no "
    "look-ahead prefetch, no compression",
    "cswap raw": "this library, plan='raw': every saved tensor it can move, uncompressed "
    "(no budget: the engine's budget is for plan='auto')",
    "cswap auto": "this library, plan='auto': the advisor picks raw or zvc per tensor",
    "cswap auto + int8": "this library, plan='auto', lossy='int8': int8 allowed for dense tensors",
}
MAX_BATCH_METHODS = (NO_OFFLOAD, CHECKPOINTING, "cswap auto")


# -- models ---------------------------------------------------------------------------------
@dataclass
class ModelCase:
    """A model to build (on the CPU, random weights), its batches and its loss."""

    key: str
    label: str
    shape: str  # sizes in words, for the report
    batch_size: int
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], object]
    loss: Callable[[nn.Module, object], torch.Tensor]
    hf: bool  # a transformers model (has its own checkpointing and offload switches)


MODELS = ("resnet50", "vgg16", "bert-large", "gpt2-medium")
LLAMA = "llama3-8b-4l"  # LLM fine-tuning's shapes: `cswap bench measure` takes it too


def llama_config(small: bool) -> tuple[LlamaConfig, int]:
    """Llama-3-8B's layer shapes with 4 layers (random init, SDPA) and the sequence to train
    them at, 4096; ``small``: a tiny one at 64 for the CPU."""
    from transformers import LlamaConfig

    seq = 64 if small else 4096
    return LlamaConfig(
        hidden_size=64 if small else 4096, intermediate_size=224 if small else 14336,
        num_hidden_layers=2 if small else 4, num_attention_heads=4 if small else 32,
        num_key_value_heads=2 if small else 8, vocab_size=1000 if small else 128256,
        max_position_embeddings=seq, rope_theta=500000.0, use_cache=False,
        attn_implementation="sdpa"), seq


def workload(key: str, small: bool) -> ModelCase:
    """The full-size model, or a CPU-sized one with the same structure (``small``)."""
    if key in ("resnet50", "vgg16"):
        from ..recipes.nets import resnet50, vgg16

        # Small: the same networks, narrow, on small images (VGG's on larger ones: its
        # classifier's weights would outweigh its activations at 32x32).
        width, side, batch, classes = (
            (4, 32 if key == "resnet50" else 64, 16, 10) if small
            else (64, 224, 256 if key == "resnet50" else 128, 1000))
        net = {"resnet50": resnet50, "vgg16": vgg16}[key]
        label = {"resnet50": "ResNet-50", "vgg16": "VGG-16"}[key]

        def images(n: int, dev: torch.device):
            g = torch.Generator().manual_seed(n)
            return (torch.randn(n, 3, side, side, generator=g).to(dev),
                    torch.randint(0, classes, (n,), generator=g).to(dev))

        def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        return ModelCase(key, label, f"width {width}, 3x{side}x{side} images, {classes} classes",
                        batch, partial(net, width, classes), images, cross_entropy, hf=False)
    if key == LLAMA:
        cfg, seq = llama_config(small)

        def llama() -> nn.Module:
            from transformers import LlamaForCausalLM

            return LlamaForCausalLM(cfg)

        def ids(n: int, dev: torch.device):
            tokens = torch.randint(0, cfg.vocab_size, (n, seq),
                                   generator=torch.Generator().manual_seed(n)).to(dev)
            return {"input_ids": tokens, "labels": tokens}

        return ModelCase(key, "Llama-3-8B, 4 layers" + (" (small)" if small else ""),
                         f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, sequence "
                         f"{seq}", 1, llama, ids, _hf_loss, hf=True)
    if key in ("bert-large", "gpt2-medium"):
        bert = key == "bert-large"
        hidden, layers, heads, seq, batch, vocab = (
            (64, 2, 4, 64 if bert else 128, 8 if bert else 4, 1000) if small else
            (1024, 24, 16, 512 if bert else 1024, 16 if bert else 8, 30522 if bert else 50257))

        def build() -> nn.Module:
            if bert:
                from transformers import BertConfig, BertForSequenceClassification

                return BertForSequenceClassification(BertConfig(
                    vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=4 * hidden,
                    max_position_embeddings=seq, num_labels=2, use_cache=False))
            from transformers import GPT2Config, GPT2LMHeadModel

            return GPT2LMHeadModel(GPT2Config(
                vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
                bos_token_id=vocab - 1, eos_token_id=vocab - 1, use_cache=False))

        def tokens(n: int, dev: torch.device):
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(0, vocab, (n, seq), generator=g)
            labels = torch.randint(0, 2, (n,), generator=g) if bert else ids
            return {"input_ids": ids.to(dev), "labels": labels.to(dev)}

        label = "BERT-large" if bert else "GPT-2 medium"
        if small:
            label += " (small)"
        return ModelCase(key, label, f"hidden {hidden}, {layers} layers, {heads} heads, sequence "
                        f"{seq}", batch, build, tokens, _hf_loss, hf=True)
    raise ValueError(f"unknown model {key!r}; choose from {', '.join((*MODELS, LLAMA))}")


def _hf_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(**batch).loss


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant activation checkpointing: recomputed in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def checkpoint_blocks(net: nn.Sequential) -> nn.Sequential:
    """Each ResNet bottleneck, and each VGG stage (the layers up to a max-pool), checkpointed."""
    from ..recipes.nets import Bottleneck

    resnet = any(isinstance(layer, Bottleneck) for layer in net)
    layers: list[nn.Module] = []
    stage: list[nn.Module] = []
    for layer in net:
        if isinstance(layer, Bottleneck):
            layers.append(Checkpointed(layer))
        elif isinstance(layer, nn.Conv2d) and not resnet:
            stage.append(layer)  # in a VGG stage
        elif stage:
            stage.append(layer)
            if isinstance(layer, nn.MaxPool2d):
                layers.append(Checkpointed(nn.Sequential(*stage)))
                stage = []
        else:
            layers.append(layer)
    return nn.Sequential(*layers, *stage)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class Skip(Exception):
    """A method that cannot run here; the message says why."""


def hf_checkpointing(model: nn.Module, offload: bool, selective: bool = False) -> None:
    """Non-reentrant checkpointing of each layer through the model's own switch, with its
    built-in offload where asked; ``selective``: torch's selective checkpointing
    (``selective_context``)."""
    import transformers

    enable = checkpointing_switch(model)
    if offload and not has_offload(enable):
        raise Skip(f"transformers {transformers.__version__} has no built-in activation offload "
                   "(offload=True to gradient_checkpointing_enable, transformers >= 5.17, or "
                   "to activation_checkpointing_enable, >= 5.23)")
    kwargs = {"use_reentrant": False} | ({"context_fn": selective_context} if selective else {})
    enable(kwargs, **({"offload": True} if offload else {}))


def sac_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's choice per operator, as torchtitan's ``op`` mode makes it
    (without its option of saving every other matrix product): the outputs of matrix
    products and attention saved, the rest run again."""
    return CheckpointPolicy.MUST_SAVE if ops.kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple:
    """torch's selective checkpointing contexts under ``sac_policy`` (a checkpoint's
    ``context_fn``)."""
    return create_selective_checkpoint_contexts(sac_policy)


# -- what a method does ---------------------------------------------------------------------
class Method:
    """One method set up on a model: the model to train, the context around forward, and
    the engine (cswap) or hooks object whose bytes are counted (torchtune)."""

    def __init__(self, name: str, wl: ModelCase, model: nn.Module, budget_bytes: int | None,
                 min_bytes: int, prefetch_bytes: int | None = None) -> None:
        self.name, self.model, self.offloader, self.counted = name, model, None, None
        self.context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if name == CHECKPOINTING:
            if wl.hf:
                hf_checkpointing(model, offload=False)
            else:
                self.model = checkpoint_blocks(model)
        elif name == HF_OFFLOAD:
            if not wl.hf:
                raise Skip("not a Hugging Face model (transformers' offload switch belongs to "
                           "its PreTrainedModel layers)")
            hf_checkpointing(model, offload=True)
        elif name == SAVE_ON_CPU:
            self.context = torch.autograd.graph.save_on_cpu(pin_memory=True)
        elif name == TORCHTUNE:
            if importlib.util.find_spec("torchtune") is None:
                raise Skip("torchtune is not installed")
            if model_device(model).type != "cuda":
                raise Skip("needs CUDA: its hooks record CUDA streams and events (not tried "
                           "on this device)")
            from torchtune.training import OffloadActivations

            hooks = OffloadActivations(min_offload_size=min_bytes)
            self.counted = _Counted(hooks, lambda t, p: hooks.tracker.get(p, (None, False))[1])
            self.context = self.counted
        elif name in CSWAP:
            prefetch = {} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
            self.offloader = Offloader(CSwapConfig(**CSWAP[name], budget=budget_bytes,
                                                   min_bytes=min_bytes, **prefetch))
            self.context = self.offloader
        elif name != NO_OFFLOAD:
            raise ValueError(f"unknown method {name!r}")

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()

