"""What the engine did, as numbers a trainer logs and files a person reads after a run.

The metrics are torchmetrics ``Metric``s, so Lightning's ``self.log`` gives per-step values
and epoch aggregates, over every rank. Byte counts and waits aggregate as means per step (of
one rank), as the step values read; peaks as the highest seen; ratios as ratios of sums.
Their states are float64 tensors updated with plain Python numbers or device tensors, and
``compute`` is tensor arithmetic only: neither reads a value back to the host. Under a process
group, torchmetrics' ``compute`` first gathers every rank's states, which synchronises: in
Lightning at epoch ends (its per-step values are computed without it), in the Hugging Face
callback at each log line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from matplotlib.figure import Figure
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from ..config import MiB
from ..core.stats import StepStats, fmt_bytes

if TYPE_CHECKING:
    from ..core.engine import Offloader


class _MeanPerStep(Metric):
    """A mean per step of a per-step figure (float64 sums: byte counts stay exact), over the
    steps seen and, reduced across processes, over every rank's steps; 0 before any step."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("steps", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def _add(self, value: float | Tensor) -> None:
        self.total = self.total + value
        self.steps = self.steps + 1

    def compute(self) -> Tensor:
        return torch.where(self.steps > 0, self.total / self.steps.clamp(min=1), 0.0)


class OffloadedBytes(_MeanPerStep):
    """Bytes of saved tensors moved off the device, per step."""

    higher_is_better = True

    def update(self, offloaded_bytes: float | Tensor) -> None:
        self._add(offloaded_bytes)


class SwapWait(_MeanPerStep):
    """Seconds backward waited for offloaded tensors to come back, per step: the swap time
    training saw."""

    higher_is_better = False

    def update(self, wait_s: float | Tensor) -> None:
        self._add(wait_s)


class _Highest(Metric):
    """The highest of a per-step figure over the steps seen, and across ranks."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("highest", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def _raise(self, value: float | Tensor) -> None:
        self.highest = torch.clamp(self.highest, min=value)

    def compute(self) -> Tensor:
        return self.highest


class PeakResidentBytes(_Highest):
    """The most bytes of a step's saved tensors that were on the device at once, measured
    (``StepStats.peak_resident_bytes``)."""

    def update(self, peak_resident_bytes: float | Tensor) -> None:
        self._raise(peak_resident_bytes)


class KeepAllBytes(_Highest):
    """What keeping every saved tensor holds at the end of forward
    (``StepStats.keep_all_bytes``, of a step that tracked every tensor)."""

    def update(self, keep_all_bytes: float | Tensor) -> None:
        self._raise(keep_all_bytes)


class PeakPercent(Metric):
    """The measured peak as a percentage of what keeping everything holds: of the highest of
    each over the steps seen (and across ranks); NaN while nothing was measured."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("peak", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("keep_all", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, peak_resident_bytes: float | Tensor, keep_all_bytes: float | Tensor) -> None:
        self.peak = torch.clamp(self.peak, min=peak_resident_bytes)
        self.keep_all = torch.clamp(self.keep_all, min=keep_all_bytes)

    def compute(self) -> Tensor:
        return 100 * self.peak / self.keep_all  # 0 / 0: NaN


class CompressionRatio(Metric):
    """Bytes offloaded per byte held off the device, over every step seen (a ratio of sums,
    not a mean of per-step ratios); NaN while nothing has been offloaded (the integrations
    then log none)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("offloaded", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("stored", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, offloaded_bytes: float | Tensor, stored_bytes: float | Tensor) -> None:
        self.offloaded = self.offloaded + offloaded_bytes
        self.stored = self.stored + stored_bytes

    def compute(self) -> Tensor:
        return self.offloaded / self.stored  # 0 / 0: NaN


class ReconstructionError(Metric):
    """Relative L2 error ``||decoded - original|| / ||original||`` of a lossy codec, pooled
    over every tensor seen (0 for lossless codecs, and while the originals are all zero)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("error_sq", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("norm_sq", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, original: Tensor, decoded: Tensor) -> None:
        if original.shape != decoded.shape:
            raise ValueError(
                f"ReconstructionError needs tensors of one shape, got original "
                f"{list(original.shape)} and decoded {list(decoded.shape)}"
            )
        original = original.detach().to(torch.float64)
        decoded = decoded.detach().to(torch.float64)
        self.error_sq = self.error_sq + (decoded - original).square().sum()
        self.norm_sq = self.norm_sq + original.square().sum()

    def compute(self) -> Tensor:
        return torch.where(self.norm_sq > 0, (self.error_sq / self.norm_sq).sqrt(), 0.0)


def offload_metrics(prefix: str = "cswap/") -> MetricCollection:
    """The metrics a trainer logs after each step; feed them ``**step_values(stats, tracked)``."""
    return MetricCollection(
        {"ratio": CompressionRatio(), "offloaded_bytes": OffloadedBytes(), "wait_s": SwapWait(),
         "peak_resident_bytes": PeakResidentBytes(), "keep_all_bytes": KeepAllBytes(),
         "peak_percent": PeakPercent()},
        prefix=prefix,
        compute_groups=False,
    )


def step_values(stats: StepStats, tracked: StepStats | None = None) -> dict[str, float]:
    """The update arguments of :func:`offload_metrics` for one step. ``tracked``: the step
    that tracked every site whose peak ``stats`` reports (``Offloader.tracked_step()``), for
    what keeping everything holds; ``stats`` itself by default."""
    return {
        "offloaded_bytes": stats.offloaded_bytes,
        "stored_bytes": stats.stored_bytes,
        "wait_s": stats.wait_s,
        "peak_resident_bytes": stats.peak_resident_bytes,
        "keep_all_bytes": (tracked or stats).keep_all_bytes,
    }


def undefined(values: dict[str, float]) -> set[str]:
    """The metrics (unprefixed names) whose value for these update arguments is undefined
    (NaN), which a trainer should not log: the ratio where nothing moved, the peak's
    percentage where nothing was measured."""
    return ({"ratio"} if not values["stored_bytes"] else set()) | (
        {"peak_percent"} if not values["keep_all_bytes"] else set())


def plan_values(offloader: Offloader) -> dict[str, float]:
    """What the advisor predicted for the plan in use, to log beside the measured peak
    (``cswap/peak_resident_bytes``): ``cswap/predicted_peak_bytes``. Empty without a plan."""
    plan = offloader.plan if offloader.config.plan == "auto" else None
    return {} if plan is None else {"cswap/predicted_peak_bytes": float(plan.predicted_peak)}


def memory_timeline(stats: StepStats, label: str | None = None) -> Figure:
    """The measured bytes of the step's saved tensors on the compute device, over the step's
    time (``StepStats.timeline_bytes``): what the engine kept, originals not yet copied out
    or held elsewhere, and what backward brought back; ``label`` names the step (default
    ``step N``, the engine's count)."""
    label = label or f"step {stats.step}"
    figure = Figure(figsize=(8, 4), layout="constrained")
    ax = figure.add_subplot()
    untracked = stats.untracked_tensors + stats.untracked_moved_tensors
    if untracked:
        ax.set_title(f"{label}: {untracked} saved tensors "
                     f"({(stats.untracked_bytes + stats.untracked_moved_bytes) / MiB:.1f} MiB) "
                     "kept or moved as the plan says, not tracked one by one: no curve measured")
        return figure
    ms = [1e3 * t for t in stats.timeline_s]
    ax.step(ms, [b / MiB for b in stats.timeline_bytes], where="post",
            label="saved tensors on the device (measured)")
    ax.axhline(stats.peak_resident_bytes / MiB, linestyle=":", color="gray",
               label=f"peak {stats.peak_resident_bytes / MiB:.1f} MiB")
    ax.axhline(stats.keep_all_bytes / MiB, linestyle="--", color="black",
               label=f"keeping them all {stats.keep_all_bytes / MiB:.1f} MiB")
    ax.set_xlabel("ms since the step's first saved tensor")
    ax.set_ylabel("MiB")
    ax.set_title(f"saved tensors during {label}: moved out {stats.offloaded_bytes / MiB:.1f} "
                 f"MiB of {stats.keep_all_bytes / MiB:.1f} MiB of activations")
    ax.legend()
    return figure


def write_summary(stats: StepStats, directory: str | Path,
                  label: str | None = None) -> tuple[Path, Path]:
    """Write the per-site table (decision, ratio, times) and the memory timeline of a step
    (``label`` names it: the trainer's step, where the engine counts micro-batches)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    table = directory / "cswap_summary.txt"
    table.write_text(stats.table(label) + "\n")
    plot = directory / "cswap_memory.png"
    memory_timeline(stats, label).savefig(plot)
    return table, plot


def run_summary(stats: StepStats, label: str, table: Path, plot: Path) -> str:
    """The line a trainer prints when training ends: the peak against keeping everything,
    what moved, what backward waited, and where the summary files are."""
    if stats.peak_share is None:
        peak = f"{fmt_bytes(stats.peak_resident_bytes)} at the peak"
    else:
        peak = (f"{fmt_bytes(stats.peak_resident_bytes)} at the peak, "
                f"{100 * stats.peak_share:.0f}% of the {fmt_bytes(stats.keep_all_bytes)} that "
                f"keeping them all holds "
                f"({fmt_bytes(stats.keep_all_bytes - stats.peak_resident_bytes)} less)")
    return (f"cswap: saved tensors resident at once on {label}, measured: {peak}; "
            f"{fmt_bytes(stats.offloaded_bytes)} moved out, held as "
            f"{fmt_bytes(stats.stored_bytes)} on the host; backward waited "
            f"{1e3 * stats.wait_s:.1f} ms for them. Per-site summary in {table}, memory "
            f"timeline in {plot}")
