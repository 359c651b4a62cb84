"""Token data for the BERT and GPT-2 recipes, generated in code so nothing is downloaded.

The sequences carry a pattern a model can learn, so the loss falls when training works:
each sequence is an arithmetic progression of token ids (modulo the vocabulary) from a random
start with a random step from 1 to 7. For ``"classification"`` a sequence's class is the range
of the vocabulary (one of ``num_labels`` equal ranges) its first token falls in; for the harder
``"step_classification"`` it is the step (one of ``num_labels`` equal ranges of 1..7), which
only relations between tokens reveal.
"""

from __future__ import annotations

from typing import Literal

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

Task = Literal["classification", "step_classification", "causal_lm"]
MAX_STEP = 7


class TokenSequences(Dataset):
    """``num_samples`` progressions of ``seq_len`` ids, as Hugging Face model inputs."""

    def __init__(
        self, task: Task, num_samples: int, seq_len: int, vocab_size: int, num_labels: int,
        seed: int,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
        step = torch.randint(1, MAX_STEP + 1, (num_samples, 1), generator=generator)
        self.input_ids = (start + step * torch.arange(seq_len)) % vocab_size
        # Hugging Face models shift causal-LM labels themselves.
        if task == "causal_lm":
            self.labels = self.input_ids
        elif task == "step_classification":
            self.labels = (step.squeeze(1) - 1) * num_labels // MAX_STEP
        else:
            self.labels = start.squeeze(1) * num_labels // vocab_size

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class TokenDataModule(LightningDataModule):
    """Generated token sequences for sequence classification or causal language modelling.

    Args:
        task: ``"classification"`` or ``"step_classification"`` (one label per sequence, see
            above) or ``"causal_lm"`` (next token).
        vocab_size: token ids are drawn from ``[0, vocab_size)``; match the model's.
        seq_len: tokens per sequence.
        num_labels: classes of the classification task.
        num_samples: training sequences; validation gets a fifth as many more.
        batch_size: sequences per batch and rank.
        seed: seeds the generated sequences.
    """

    def __init__(
        self,
        task: Task = "classification",
        vocab_size: PositiveInt = 30522,
        seq_len: PositiveInt = 128,
        num_labels: PositiveInt = 2,
        num_samples: PositiveInt = 4096,
        batch_size: PositiveInt = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.task = task
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_labels = num_labels
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        sizes = {"train": self.num_samples, "val": max(1, self.num_samples // 5)}
        self.splits = {
            split: TokenSequences(
                self.task, size, self.seq_len, self.vocab_size, self.num_labels,
                self.seed + index,
            )
            for index, (split, size) in enumerate(sizes.items())
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)
