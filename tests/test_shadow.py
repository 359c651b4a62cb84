"""The lossless shadow and the figures the integrations log at each guard check: the shadow
trains bitwise as the model where nothing is lost, and lossy runs log their validation
metrics' deltas against it, with the guard's and the reconstruction errors."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import Faithful
from lightning.pytorch.loggers import Logger
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from cswap_lightning import CSwapCallback, CSwapConfig
from cswap_lightning.core.shadow import Shadow
from cswap_lightning.integrations.lightning import CSwapStrategy
from cswap_lightning.recipes.models import BertClassifier
from cswap_lightning.recipes.tokens import TokenDataModule


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the Trainer writes (default_root_dir) by default


class Recorder(Logger):
    """Every metrics line Lightning logs, with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.lines.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def checks(self) -> list[dict[str, float]]:
        """The lines of the guard's checks, ``cswap/`` metrics only. Lightning logs the latest
        value of each metric on every step line after it was first logged: a check's line is
        the first of its figures (told apart by ``cswap/guard_seconds``)."""
        checks, seen = [], set()
        for _, metrics in self.lines:
            seconds = metrics.get("cswap/guard_seconds")
            if seconds is not None and seconds not in seen:
                seen.add(seconds)
                checks.append({k: v for k, v in metrics.items() if k.startswith("cswap/")})
        return checks


class DropoutNet(pl.LightningModule):
    """Dropout (random numbers the shadow must draw alike), a momentum optimizer, a scheduler
    stepping each step, and validation metrics: a torchmetrics accuracy and a plain loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        self.accuracy = MulticlassAccuracy(4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.accuracy(logits, y)
        self.log("val_acc", self.accuracy)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def loader(batches: int, seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 8, 16, generator=generator)
    y = torch.randint(0, 4, (batches * 8,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8,
                                       shuffle=True)


def fit(config: CSwapConfig, module: type[pl.LightningModule] = DropoutNet,
        **options: Any) -> tuple[pl.Trainer, pl.LightningModule, Recorder]:
    torch.manual_seed(0)
    model, recorder = module(), Recorder()
    trainer = pl.Trainer(**{"strategy": CSwapStrategy(config), "accelerator": "cpu",
                            "max_steps": 8, "logger": recorder, "log_every_n_steps": 1,
                            "enable_checkpointing": False, "enable_progress_bar": False,
                            "enable_model_summary": False, "num_sanity_val_steps": 0,
                            "accumulate_grad_batches": 2, "gradient_clip_val": 0.5} | options)
    trainer.fit(model, loader(16, 0), loader(3, 1))
    return trainer, model, recorder


def test_the_shadow_trains_bitwise_as_the_model_where_nothing_is_lost(as_int8):
    """The Faithful codec is "lossy" but exact: the shadow's weights must equal the model's,
    through dropout, accumulation, clipping and a scheduler, and every delta be zero."""
    as_int8(Faithful())
    config = CSwapConfig(plan="int8", min_bytes=0, guard_every=3, guard_shadow=True)
    trainer, model, recorder = fit(config)
    shadow = trainer.strategy.shadow
    # the learning rate of the scheduled optimizer, copied at each of the 8 optimizer steps
    assert shadow.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7**7)
    for p in model.parameters():
        assert torch.equal(shadow.copies[p], p)
    checks = recorder.checks()
    assert len(checks) == len(trainer.strategy.guard.reports) == 6  # every third micro-batch
    for line in checks:
        assert line["cswap/shadow_delta/val_loss"] == line["cswap/shadow_delta/val_acc"] == 0.0
        assert 0 < line["cswap/shadow/val_acc"] <= 1 and line["cswap/shadow/val_loss"] > 0
        assert line["cswap/guard_worst_rel_error"] == line["cswap/reconstruction_error"] == 0.0
        assert line["cswap/reconstruction_error/net.1/1"] == 0.0  # the ReLU's output
    # The shadow and the checks leave no trace: the same weights without them.
    _, plain, _ = fit(CSwapConfig(plan="int8", min_bytes=0, guard_every=0))
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_no_shadow_without_lossy_sites_or_unless_asked():
    for config in (CSwapConfig(plan="raw", min_bytes=0, guard_shadow=True),
                   CSwapConfig(plan="int8", min_bytes=0, guard_every=3)):
        trainer, _, recorder = fit(config, max_steps=2)
        assert trainer.strategy.shadow is None
        assert not any(k.startswith("cswap/shadow") for _, line in recorder.lines for k in line)


class TinyBert(BertClassifier):
    def __init__(self) -> None:
        super().__init__(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2,
                         max_positions=64, num_labels=4)


@pytest.mark.slow  # a minute on two loaded cores
def test_a_tiny_bert_at_int8_logs_its_accuracy_delta_at_every_check():
    """The issue's goal: default settings but the cadence (every 16 steps here, not 100); no
    site reverted; at every check the guard's figures, the reconstruction error of each lossy
    site and the validation accuracy's delta against the lossless shadow, within 0.01."""
    torch.manual_seed(0)
    model, recorder = TinyBert(), Recorder()
    data = TokenDataModule(vocab_size=128, seq_len=64, num_labels=4, num_samples=1024,
                           batch_size=8)
    config = CSwapConfig(plan="int8", guard_every=16, guard_shadow=True)
    trainer = pl.Trainer(strategy=CSwapStrategy(config), accelerator="cpu", max_steps=64,
                         logger=recorder, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    reports = trainer.strategy.guard.reports
    assert len(reports) == 4 and not any(r.reverted for r in reports)
    assert all(len(r.site_errors) >= 10 for r in reports)
    checks = recorder.checks()
    assert len(checks) == 4
    for line in checks:
        assert line["cswap/guard_worst_rel_error"] <= config.guard_tolerance
        assert 0 < line["cswap/reconstruction_error"] < 0.02
        assert sum(k.startswith("cswap/reconstruction_error/model.bert.") for k in line) >= 10
        assert abs(line["cswap/shadow_delta/val_acc"]) <= 0.01
        assert "cswap/shadow_delta/val_loss" in line
    assert checks[-1]["cswap/shadow/val_acc"] > 0.5  # it learned something meanwhile


class Trainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        return self.lin(self.frozen(x))


def test_a_shadow_copies_trained_weights_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model, x = Trainable(), torch.randn(8, 4)
    optimizer = torch.optim.Adam(model.lin.parameters(), lr=0.1)
    shadow = Shadow(model, optimizer)
    assert set(shadow.copies) == set(model.lin.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    shadow.accumulate(lambda: model(x).square().sum())
    shadow.step(optimizer)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    trained = shadow.copies[model.lin.weight].detach().clone()
    assert not torch.equal(trained, model.lin.weight)
    with shadow.swapped():  # the model runs with the shadow's weights, then its own again
        assert torch.equal(model.lin.weight, trained)
    assert torch.equal(model.lin.weight, before[0])
    values = shadow.compare(lambda: {"loss": model(x).square().sum().item()})
    assert values["cswap/shadow_delta/loss"] > 0  # the shadow took a step down the loss


def test_the_hugging_face_shadow_trains_bitwise_as_the_model_where_nothing_is_lost(
        as_int8, tmp_path):
    from test_hf import bert_trainer

    as_int8(Faithful())
    config = CSwapConfig(plan="int8", min_bytes=0, guard_every=2, guard_shadow=True)
    cswap = CSwapCallback(config)
    trainer = bert_trainer(tmp_path, [cswap], max_steps=3, max_grad_norm=0.1,
                           lr_scheduler_type="linear")
    trainer.train()
    for p in trainer.model.parameters():
        if p.requires_grad:
            assert torch.equal(cswap.shadow.copies[p], p)
    lines = [h for h in trainer.state.log_history if "cswap/shadow_delta/eval_loss" in h]
    assert lines and all(h["cswap/shadow_delta/eval_loss"] == 0.0 for h in lines)
    assert all("cswap/reconstruction_error" in h for h in lines)
