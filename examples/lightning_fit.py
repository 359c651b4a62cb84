"""Train a LightningModule with its saved activations offloaded by cswap: one strategy.

A ReLU MLP learns to classify points labelled by a random teacher network, generated in code
(nothing is downloaded); it runs on the CPU in seconds, and on a GPU if there is one::

    python examples/lightning_fit.py [--epochs 3] [--output-dir lightning-example]

``Trainer(strategy="cswap")`` takes the default config; ``"cswap_ddp"``, ``"cswap_fsdp"`` and
``"cswap_model_parallel"`` are the multi-device ones. At the end the strategy prints the
measured peak of saved tensors beside what keeping them all holds, and writes a per-site
summary and the memory timeline to the log directory.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cswap_lightning import CSwapConfig, CSwapStrategy

FEATURES, CLASSES = 64, 4


class Classifier(pl.LightningModule):
    """A plain LightningModule: nothing in it knows about cswap."""

    def __init__(self, width: int = 1024, depth: int = 6) -> None:
        super().__init__()
        layers = [nn.Linear(FEATURES, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, CLASSES))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def teacher_data(samples: int = 4096, seed: int = 0) -> TensorDataset:
    """Points labelled by a random linear teacher: learnable, generated in code."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output-dir", default="lightning-example")
    args = parser.parse_args()

    pl.seed_everything(0)
    model, data = Classifier(), teacher_data()
    before = loss_on(model, data)
    # budget=None moves every saved tensor it can, to show the engine at work on a model
    # this small; the default, budget="auto", moves only what the device cannot hold.
    strategy = CSwapStrategy(CSwapConfig(budget=None, min_bytes=64 * 1024))
    trainer = pl.Trainer(strategy=strategy, max_epochs=args.epochs,
                         default_root_dir=args.output_dir, enable_checkpointing=False,
                         enable_progress_bar=False)
    trainer.fit(model, DataLoader(data, batch_size=256, shuffle=True))
    print(f"loss on the training data: {before:.3f} before, {loss_on(model, data):.3f} after")


@torch.no_grad()
def loss_on(model: Classifier, data: TensorDataset) -> float:
    x, y = data.tensors
    return F.cross_entropy(model.net(x.to(model.device)), y.to(model.device)).item()

if __name__ == "__main__":
    main()
