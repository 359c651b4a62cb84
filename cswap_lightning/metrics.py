"""The torchmetrics ``Metric``s of what the engine did and of what lossy codecs lose.

Lightning's ``self.log`` gives per-step values and epoch aggregates of them, over every rank.
Byte counts and waits aggregate as means per step (of one rank), as the step values read;
peaks as the highest seen; ratios as ratios of sums. Their states are float64 tensors updated
with plain Python numbers or device tensors, and ``compute`` is tensor arithmetic only: neither
reads a value back to the host. Under a process group, torchmetrics' ``compute`` first gathers
every rank's states, which synchronises: in Lightning at epoch ends (its per-step values are
computed without it), in the Hugging Face callback at each log line.

The integrations (``integrations.metrics``) feed them from the engine's step statistics; the
accuracy guard keeps a ``ReconstructionError`` of the lossy sites it measures.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from .codecs.lossy import relative, squared_errors


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


class RecomputedBlocks(_MeanPerStep):
    """Blocks run recomputed, per step (``StepStats.recomputed``)."""

    higher_is_better = False

    def update(self, recomputed_blocks: float | Tensor) -> None:
        self._add(recomputed_blocks)


class RecomputeFreedBytes(_MeanPerStep):
    """Bytes of saved tensors that recomputing blocks spared, per step (measured against the
    step that ran them plainly: ``StepStats.recompute_freed_bytes``)."""

    higher_is_better = True

    def update(self, recompute_freed_bytes: float | Tensor) -> None:
        self._add(recompute_freed_bytes)


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
    """The most bytes of a step's saved tensors that were on the device at once, with what
    recomputed blocks held again while backward ran them, measured (``StepStats.peak_bytes``)."""

    def update(self, peak_resident_bytes: float | Tensor) -> None:
        self._raise(peak_resident_bytes)


class KeepAllBytes(_Highest):
    """What keeping every saved tensor holds at the end of forward without the engine
    (``StepStats.baseline_bytes``: where blocks are recomputed, as the step that ran them
    plainly measured it)."""

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
    over every tensor seen and over the finite elements of the originals (the lossy codecs
    keep NaN and inf exactly): 0 for lossless codecs, inf where the originals are all zero
    and the decoded ones are not, or where a finite value came back as NaN or inf."""

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
        error_sq, norm_sq = squared_errors(original, decoded)
        self.error_sq = self.error_sq + error_sq
        self.norm_sq = self.norm_sq + norm_sq

    def compute(self) -> Tensor:
        return relative(self.error_sq, self.norm_sq)
