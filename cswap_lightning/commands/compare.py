"""`cswap compare`: one recipe trained twice from the same seed, lossless and lossy.

The two runs differ only in the CSwap plan: the lossless run keeps the recipe's plan (lossy
codecs turned off), the lossy run forces a lossy codec on every floating saved tensor it
offloads. The report gives the validation metric after each epoch, the lossy run's delta,
and what the lossy codec saved: bytes held on the host (and so sent over the link) per step,
on the lossy sites and in all, and peak device memory on a GPU. The accuracy guard is off in
both runs, so the delta is the codec's own effect.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..config import LOSSY_CODECS, CSwapConfig
from ..integrations.lightning import _CSwapMixin
from ..records import StepStats, fmt_bytes
from .bench_step import result_meta, write_results
from .fit import cli_args, cswap_cli


class MetricMissing(ValueError):
    """The validation metric to compare is not one the model logs."""


@dataclass
class RunResult:
    """What one training run of the comparison measured."""

    label: str
    plan: str
    device: str
    metric: list[float] = field(default_factory=list)  # after each epoch
    step_s: list[float] = field(default_factory=list)  # wall time of each training step
    offloaded_bytes: int = 0  # per step (the last one): bytes that left the device
    stored_bytes: int = 0  # ... and the bytes held for them on the host (sent over the link)
    lossy_bytes: int = 0  # per step: bytes of the sites a lossy codec compressed
    lossy_stored_bytes: int = 0  # ... and their compressed size
    link_bytes: int = 0  # over the whole run: bytes sent to the host
    peak_device_bytes: int | None = None  # CUDA only

    @property
    def median_step_s(self) -> float:
        steps = sorted(self.step_s[1:] or self.step_s)  # the first step also builds things
        return steps[len(steps) // 2] if steps else float("nan")


class _Recorder(Callback):
    """Records the engine's statistics per training step and the metric after validation."""

    def __init__(self, strategy: _CSwapMixin, metric: str, result: RunResult) -> None:
        self.strategy, self.metric, self.result = strategy, metric, result
        self._started = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.result.step_s.append(time.perf_counter() - self._started)
        step = self.strategy.offloader.tracked_step(device=False)
        self.result.link_bytes += step.stored_bytes
        _record_step(self.result, step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After each epoch's validation, and first after the sanity check, which runs
        before any training step: a metric the model does not log fails there."""
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            raise MetricMissing(
                f"cswap compare: the model logs no {self.metric!r} in validation (it logs "
                f"{sorted(trainer.callback_metrics)}); choose one with --metric"
            )
        if not trainer.sanity_checking:
            self.result.metric.append(float(value))


def _record_step(result: RunResult, step: StepStats) -> None:
    lossy = [s for s in step.sites if s.decision in LOSSY_CODECS]
    result.offloaded_bytes, result.stored_bytes = step.offloaded_bytes, step.stored_bytes
    result.lossy_bytes = sum(s.nbytes for s in lossy)
    result.lossy_stored_bytes = sum(s.stored_bytes for s in lossy)


def train_once(args: list[str], label: str, change: Callable[[CSwapConfig], CSwapConfig],
               metric: str) -> RunResult:
    """Build the recipe from LightningCLI ``args``, ``change`` its CSwap config, train, measure."""
    # ``args`` are the command line's: LightningCLI would warn of a command line beside them
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = cswap_cli(args, "cswap compare", run=False, save_config_callback=None)
    finally:
        sys.argv = argv
    strategy = cli.trainer.strategy
    if not isinstance(strategy, _CSwapMixin):
        raise TypeError(
            f"cswap compare: the recipe trains with {type(strategy).__name__}, not a CSwap "
            "strategy; set trainer.strategy to cswap_lightning.CSwapStrategy (or its DDP/FSDP "
            "variant)"
        )
    strategy.cswap_config = change(strategy.cswap_config)
    result = RunResult(label, strategy.cswap_config.plan, str(strategy.root_device))
    cli.trainer.callbacks.append(_Recorder(strategy, metric, result))
    # The sanity check validates before training (under its own random state): the metric
    # is checked there, not after a whole epoch.
    cli.trainer.num_sanity_val_steps = cli.trainer.num_sanity_val_steps or 1
    cuda = strategy.root_device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(strategy.root_device)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cuda:
        result.peak_device_bytes = torch.cuda.max_memory_allocated(strategy.root_device)
    return result


def compare(args: list[str], lossy: str = "int8", metric: str = "val_acc",
            out: str | None = None) -> tuple[RunResult, RunResult]:
    """Train the recipe lossless, then lossy with codec ``lossy``; print and return both."""
    if lossy not in LOSSY_CODECS:
        raise ValueError(f"cswap compare: lossy codec {lossy!r} is not one of {LOSSY_CODECS}")
    args = cli_args(args)
    lossless = train_once(args, "lossless", _lossless, metric)
    meta = result_meta(torch.device(lossless.device), lossy=lossy, metric=metric)
    try:
        runs = (lossless,
                train_once(args, "lossy", lambda c: replace(c, plan=lossy, guard_every=0), metric))
    except BaseException:  # interrupted too: the finished run is kept
        if out:
            write_results(out, "cswap compare (lossy run did not finish)", meta,
                          {"runs": [asdict(lossless)]}, "Only the lossless run finished.")
        raise
    report = format_report(runs, metric)
    print(report)
    if out:
        write_results(out, "cswap compare", meta, {"runs": [asdict(r) for r in runs]},
                      f"```\n{report}\n```")
    return runs


def _lossless(config: CSwapConfig) -> CSwapConfig:
    """The recipe's config without lossy codecs (a lossy plan becomes ``"auto"``)."""
    plan = "auto" if config.plan in LOSSY_CODECS else config.plan
    return replace(config, plan=plan, lossy="off", guard_every=0)


def format_report(runs: tuple[RunResult, RunResult], metric: str) -> str:
    """The per-epoch metric of both runs with the delta, then what the lossy plan saved."""
    lossless, lossy = runs
    head = (f"{metric} after epoch", f"{lossless.label} ({lossless.plan})",
            f"{lossy.label} ({lossy.plan})", "delta")
    lines = [_row(*head)]
    for epoch, (a, b) in enumerate(zip(lossless.metric, lossy.metric), start=1):
        lines.append(_row(str(epoch), f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}"))
    if not lossless.metric:
        lines.append("(no validation ran: raise trainer.max_epochs or limit_val_batches)")
    lines += ["", _row("per training step", lossless.label, lossy.label)]
    for name, attr in (("offloaded", "offloaded_bytes"), ("held on the host", "stored_bytes"),
                       ("link bytes, whole run", "link_bytes"),
                       ("peak device memory", "peak_device_bytes")):
        a, b = getattr(lossless, attr), getattr(lossy, attr)
        if a is not None and b is not None:
            lines.append(_row(name, fmt_bytes(a), fmt_bytes(b)))
    lines.append(_row("step time (median)", f"{lossless.median_step_s * 1e3:.1f} ms",
                      f"{lossy.median_step_s * 1e3:.1f} ms"))
    if lossy.lossy_stored_bytes:
        ratio = lossy.lossy_bytes / lossy.lossy_stored_bytes
        lines.append(f"\nlossy sites: {fmt_bytes(lossy.lossy_bytes)} held as "
                     f"{fmt_bytes(lossy.lossy_stored_bytes)} ({ratio:.2f}x smaller)")
    else:
        lines.append("\nno site was compressed lossily")
    return "\n".join(lines)


def _row(first: str, *cells: str) -> str:
    return f"{first:<22}" + "".join(f"{cell:>18}" for cell in cells)
