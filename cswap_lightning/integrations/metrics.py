"""What the engine did, as numbers a trainer logs and files a person reads after a run.

The metrics are torchmetrics ``Metric``s, so Lightning's ``self.log`` gives per-step values,
epoch aggregates and the sum across ranks. Their states are float64 tensors updated with
plain Python numbers or device tensors, and ``compute`` is tensor arithmetic only: neither
reads a value back to the host. Under a process group, torchmetrics' ``compute`` first gathers
every rank's states for the sum across ranks, which synchronises: in Lightning at epoch ends
(its per-step values are computed without it), in the Hugging Face callback at each log line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from matplotlib.figure import Figure
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from ..config import MiB
from ..core.stats import StepStats

if TYPE_CHECKING:
    from ..core.engine import Offloader


class _Total(Metric):
    """A running sum (float64: byte counts stay exact)."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def compute(self) -> Tensor:
        return self.total


class OffloadedBytes(_Total):
    """Bytes of saved tensors moved off the device."""

    higher_is_better = True

    def update(self, offloaded_bytes: float | Tensor) -> None:
        self.total = self.total + offloaded_bytes


class SwapWait(_Total):
    """Seconds backward waited for offloaded tensors to come back: the swap time training saw."""

    higher_is_better = False

    def update(self, wait_s: float | Tensor) -> None:
        self.total = self.total + wait_s


class PeakResidentBytes(Metric):
    """The most bytes of a step's saved tensors that were on the device at once, measured
    (``StepStats.peak_resident_bytes``): the highest over the steps seen, and across ranks."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("peak", torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")

    def update(self, peak_resident_bytes: float | Tensor) -> None:
        self.peak = torch.clamp(self.peak, min=peak_resident_bytes)

    def compute(self) -> Tensor:
        return self.peak


class CompressionRatio(Metric):
    """Bytes offloaded per byte held off the device, over every step seen (a ratio of sums,
    not a mean of per-step ratios); 0 while nothing has been offloaded."""

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
        return torch.where(self.stored > 0, self.offloaded / self.stored, 0.0)


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
    """The metrics a trainer logs after each step; feed them ``**step_values(stats)``."""
    return MetricCollection(
        {"ratio": CompressionRatio(), "offloaded_bytes": OffloadedBytes(), "wait_s": SwapWait(),
         "peak_resident_bytes": PeakResidentBytes()},
        prefix=prefix,
        compute_groups=False,
    )


def step_values(stats: StepStats) -> dict[str, float]:
    """The update arguments of :func:`offload_metrics` for one step."""
    return {
        "offloaded_bytes": stats.offloaded_bytes,
        "stored_bytes": stats.stored_bytes,
        "wait_s": stats.wait_s,
        "peak_resident_bytes": stats.peak_resident_bytes,
    }


def plan_values(offloader: Offloader) -> dict[str, float]:
    """What the advisor predicted for the plan in use, to log beside the measured peak
    (``cswap/peak_resident_bytes``): ``cswap/predicted_peak_bytes``. Empty without a plan."""
    plan = offloader.plan if offloader.config.plan == "auto" else None
    return {} if plan is None else {"cswap/predicted_peak_bytes": float(plan.predicted_peak)}


def memory_timeline(stats: StepStats) -> Figure:
    """The measured bytes of the step's saved tensors on the compute device, over the step's
    time (``StepStats.timeline_bytes``): what the engine kept, originals not yet copied out
    or held elsewhere, and what backward brought back."""
    figure = Figure(figsize=(8, 4), layout="constrained")
    ax = figure.add_subplot()
    untracked = stats.untracked_tensors + stats.untracked_moved_tensors
    if untracked:
        ax.set_title(f"step {stats.step}: {untracked} saved tensors "
                     f"({(stats.untracked_bytes + stats.untracked_moved_bytes) / MiB:.1f} MiB) "
                     "kept or moved as the plan says, not tracked one by one: no curve measured")
        return figure
    ms = [1e3 * t for t in stats.timeline_s]
    ax.step(ms, [b / MiB for b in stats.timeline_bytes], where="post",
            label="saved tensors on the device (measured)")
    ax.axhline(stats.peak_resident_bytes / MiB, linestyle=":", color="gray",
               label=f"peak {stats.peak_resident_bytes / MiB:.1f} MiB")
    ax.set_xlabel("ms since the step's first saved tensor")
    ax.set_ylabel("MiB")
    ax.set_title(f"saved tensors during step {stats.step}: offloaded "
                 f"{stats.offloaded_bytes / MiB:.1f} MiB of {stats.saved_bytes / MiB:.1f} MiB")
    ax.legend()
    return figure


def write_summary(stats: StepStats, directory: str | Path) -> tuple[Path, Path]:
    """Write the per-site table (decision, ratio, times) and the memory timeline of a step."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    table = directory / "cswap_summary.txt"
    table.write_text(stats.table() + "\n")
    plot = directory / "cswap_memory.png"
    memory_timeline(stats).savefig(plot)
    return table, plot
