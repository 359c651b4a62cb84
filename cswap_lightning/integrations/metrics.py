"""What the engine did, as numbers a trainer logs and files a person reads after a run: the
metrics of ``cswap_lightning.metrics`` fed from step statistics, the memory timeline, the
summary files and the line printed when training ends."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from torchmetrics import MetricCollection

from ..config import MiB
from ..metrics import (
    CompressionRatio,
    KeepAllBytes,
    OffloadedBytes,
    PeakPercent,
    PeakResidentBytes,
    RecomputedBlocks,
    RecomputeFreedBytes,
    SwapWait,
)
from ..records import StepStats

if TYPE_CHECKING:
    from ..core.engine import Offloader


def offload_metrics(prefix: str = "cswap/") -> MetricCollection:
    """The metrics a trainer logs after each step; feed them ``**step_values(stats, tracked)``."""
    return MetricCollection(
        {"ratio": CompressionRatio(), "offloaded_bytes": OffloadedBytes(), "wait_s": SwapWait(),
         "peak_resident_bytes": PeakResidentBytes(), "keep_all_bytes": KeepAllBytes(),
         "peak_percent": PeakPercent(), "recomputed_blocks": RecomputedBlocks(),
         "recompute_freed_bytes": RecomputeFreedBytes()},
        prefix=prefix,
        compute_groups=False,
    )


def step_values(stats: StepStats, tracked: StepStats | None = None) -> dict[str, float]:
    """The update arguments of :func:`offload_metrics` for one step. ``tracked``: the step
    that tracked every site whose peak ``stats`` reports (``Offloader.tracked_step()``), for
    what keeping everything holds, the peak with recomputation and what recomputing spared;
    ``stats`` itself by default."""
    measured = stats if stats.tracked_all else (tracked or stats)
    return {
        "offloaded_bytes": stats.offloaded_bytes,
        "stored_bytes": stats.stored_bytes,
        "wait_s": stats.wait_s,
        "peak_resident_bytes": measured.peak_bytes,
        "keep_all_bytes": (tracked or stats).baseline_bytes,
        "recomputed_blocks": len(stats.recomputed.blocks) if stats.recomputed else 0,
        "recompute_freed_bytes": measured.recompute_freed_bytes,
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
    recomputed = stats.recomputed
    ax.step(ms, [b / MiB for b in stats.timeline_bytes], where="post",
            label="saved tensors on the device (measured)" + (
                ", with what recomputed blocks hold again" if recomputed else ""))
    ax.axhline(stats.peak_bytes / MiB, linestyle=":", color="gray",
               label=f"peak {stats.peak_bytes / MiB:.1f} MiB")
    ax.axhline(stats.baseline_bytes / MiB, linestyle="--", color="black",
               label=f"keeping them all {stats.baseline_bytes / MiB:.1f} MiB"
               + (" (without recomputation)" if stats.baseline_bytes != stats.keep_all_bytes
                  else ""))
    if stats.budget_bytes is not None and stats.budget_bytes <= 2 * stats.baseline_bytes:
        ax.axhline(stats.budget_bytes / MiB, linestyle="-.", color="red",
                   label=f"budget {stats.budget_bytes / MiB:.1f} MiB")
    ax.set_xlabel("ms since the step's first saved tensor")
    ax.set_ylabel("MiB")
    title = (f"saved tensors during {label}: moved out {stats.offloaded_bytes / MiB:.1f} "
             f"MiB of {stats.keep_all_bytes / MiB:.1f} MiB of activations")
    if recomputed:
        title += (f";\n{len(recomputed.blocks)} blocks recomputed, sparing "
                  f"{stats.recompute_freed_bytes / MiB:.1f} MiB")
    ax.set_title(title)
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
    """What a trainer prints when training ends: the step's summary (:meth:`StepStats.summary`,
    the lines that end the per-site table, the same a plain loop prints), and where the
    summary files are."""
    lines = stats.summary(label)
    return "\n".join([f"cswap: {lines[0]}", *(f"  {line}" for line in lines[1:]),
                      f"  per-site summary in {table}, memory timeline in {plot}"])
