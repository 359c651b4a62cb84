"""The LightningModules the recipes name: image classifiers, BERT and GPT-2 from configs.

Every size is a constructor argument, so LightningCLI can shrink a recipe from the command
line (``--model.width 8``, ``--model.num_layers 2``); models start from random weights.
"""

from __future__ import annotations

from typing import Literal

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from ..extras import require
from ..hf_checkpointing import checkpointing_switch
from .nets import build_cnn, resnet50, vgg16

Arch = Literal["cnn", "vgg16", "resnet50"]


class RecipeModule(LightningModule):
    """What the recipes' modules share: an optimizer given as a callable, one loss per step.

    Subclasses implement ``loss(batch, split)``, which logs under ``split`` and returns the loss.
    """

    def __init__(self, optimizer: OptimizerCallable = torch.optim.AdamW) -> None:
        super().__init__()
        self.optimizer = optimizer

    def loss(self, batch, split: str) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self.loss(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self.loss(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())


def build_network(arch: Arch, width: int, num_classes: int, in_channels: int) -> nn.Module:
    if arch == "cnn":
        if in_channels != 1:
            raise ValueError(
                f"arch 'cnn' (the demo's network) takes 1x8x8 images, got in_channels="
                f"{in_channels!r}: set model.in_channels 1, data.channels 1, data.image_size 8"
            )
        return build_cnn(width, num_classes)
    return {"vgg16": vgg16, "resnet50": resnet50}[arch](width, num_classes, in_channels)


class ImageClassifier(RecipeModule):
    """A ReLU image classifier trained with cross-entropy; logs loss and validation accuracy.

    Args:
        arch: ``"cnn"`` (the demo's small CNN, 1x8x8 inputs), ``"vgg16"`` or ``"resnet50"``.
        width: channels of the first convolution (64 for the published VGG-16 / ResNet-50).
        num_classes: output classes.
        in_channels: image channels (3 for RGB, 1 for grayscale).
        optimizer: builds the optimizer from the parameters.
    """

    def __init__(
        self,
        arch: Arch = "resnet50",
        width: PositiveInt = 64,
        num_classes: PositiveInt = 10,
        in_channels: PositiveInt = 3,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__(optimizer)
        self.net = build_network(arch, width, num_classes, in_channels)
        self.val_accuracy = MulticlassAccuracy(num_classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def loss(self, batch: tuple[Tensor, Tensor], split: str) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.log(f"{split}_loss", loss, prog_bar=True, sync_dist=split == "val")
        if split == "val":
            self.val_accuracy(logits, labels)
            self.log("val_acc", self.val_accuracy, prog_bar=True)
        return loss


class HFModule(RecipeModule):
    """A Hugging Face model whose forward takes the batch's inputs and labels and returns a loss."""

    model: nn.Module

    def loss(self, batch: dict[str, Tensor], split: str) -> Tensor:
        output = self.model(**batch)
        self.log(f"{split}_loss", output.loss, prog_bar=True, sync_dist=split == "val")
        if split == "val":
            self.score(output.logits, batch["labels"])
        return output.loss

    def score(self, logits: Tensor, labels: Tensor) -> None:
        """Log validation metrics beyond the loss (none by default)."""


class BertClassifier(HFModule):
    """``BertForSequenceClassification`` from a ``BertConfig`` (defaults: BERT-base sizes);
    logs validation accuracy as ``val_acc``.

    The feed-forward size is 4 x ``hidden_size``, as in BERT-base.
    """

    def __init__(
        self,
        vocab_size: PositiveInt = 30522,
        hidden_size: PositiveInt = 768,
        num_layers: PositiveInt = 12,
        num_heads: PositiveInt = 12,
        max_positions: PositiveInt = 512,
        num_labels: PositiveInt = 2,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        transformers = require("transformers", "the BERT recipe")
        super().__init__(optimizer)
        config = transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, intermediate_size=4 * hidden_size,
            max_position_embeddings=max_positions, num_labels=num_labels,
        )
        self.model = transformers.BertForSequenceClassification(config)
        self.val_accuracy = MulticlassAccuracy(num_labels)

    def score(self, logits: Tensor, labels: Tensor) -> None:
        self.val_accuracy(logits, labels)
        self.log("val_acc", self.val_accuracy, prog_bar=True)


class GPT2LM(HFModule):
    """``GPT2LMHeadModel`` from a ``GPT2Config`` (defaults: GPT-2 small sizes).

    The last token id marks begin and end of text, as GPT-2's 50256 does in its vocabulary.
    ``activation_checkpointing`` recomputes each transformer block in backward (Hugging Face's
    checkpointing, without its offload): a block then saves only its input, which the engine
    moves off the device (and compresses, where the plan says so).
    """

    def __init__(
        self,
        vocab_size: PositiveInt = 50257,
        hidden_size: PositiveInt = 768,
        num_layers: PositiveInt = 12,
        num_heads: PositiveInt = 12,
        max_positions: PositiveInt = 1024,
        activation_checkpointing: bool = False,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        transformers = require("transformers", "the GPT-2 recipes")
        super().__init__(optimizer)
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
            n_positions=max_positions, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
        )
        self.model = transformers.GPT2LMHeadModel(config)
        if activation_checkpointing:
            checkpointing_switch(self.model)({"use_reentrant": False})
