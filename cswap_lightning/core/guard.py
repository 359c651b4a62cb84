"""The accuracy guard: lossy sites must not bend the gradients more than the user allows.

Every ``guard_every`` steps a probe computes one micro-batch's gradients twice, with the
lossy sites swapped raw instead (bitwise what training without the library gives, and with
the same memory savings) and with the current lossy plan, and compares them per parameter.
If the worst relative error exceeds ``guard_tolerance`` (a NaN or inf gradient always does),
the lossy sites whose round trip lost the most (measured on the probe itself) are moved back
to lossless.
The probe leaves no trace: parameter gradients, buffers (BatchNorm statistics) and random
number generators are as they were before it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torchmetrics import MaxMetric, MinMetric, SumMetric

from ..config import LOSSY_CODECS
from .engine import Offloader


@dataclass
class GuardReport:
    """What one probe measured and did."""

    step: int
    cosine: dict[str, float]  # per parameter: cosine similarity of lossy and exact gradients
    rel_error: dict[str, float]  # per parameter: |g_lossy - g| / |g|
    site_errors: dict[int, float]  # per lossy site: relative error of its round trip
    seconds: float
    reverted: list[int] = field(default_factory=list)

    @property
    def worst_cosine(self) -> float:
        """The lowest cosine; a NaN counts as -1 (``min`` would drop it or not, by order)."""
        return min((_unless_nan(c, -1.0) for c in self.cosine.values()), default=1.0)

    @property
    def worst_rel_error(self) -> float:
        """The largest error; a NaN counts as inf (``max`` would drop it or not, by order)."""
        return max((_unless_nan(e, math.inf) for e in self.rel_error.values()), default=0.0)

    def log_values(self, prefix: str = "cswap/guard_") -> dict[str, float]:
        """The figures the integrations log after a probe."""
        return {f"{prefix}worst_cosine": self.worst_cosine,
                f"{prefix}worst_rel_error": self.worst_rel_error,
                f"{prefix}reverted_sites": float(len(self.reverted)),
                f"{prefix}seconds": self.seconds}


class AccuracyGuard:
    """Probes an :class:`Offloader`'s lossy plan and reverts the sites that hurt.

    ``probe(model, compute_loss)`` needs a closure that runs one micro-batch's forward and
    returns its loss; the integrations build it from the training step.
    """

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader
        self.every = offloader.config.guard_every
        self.tolerance = offloader.config.guard_tolerance
        self.reports: list[GuardReport] = []
        # By default these drop a NaN, hiding the probe that went worst.
        self.worst_cosine = MinMetric(nan_strategy=-1.0)
        self.worst_rel_error = MaxMetric(nan_strategy=math.inf)
        self.reverted_sites = SumMetric()
        self.probe_seconds = SumMetric()
        self._steps_seen = 0
        self._handed_out = 0  # reports new_report() has returned

    def lossy_in_use(self) -> bool:
        config = self.offloader.config
        if config.plan != "auto":
            return config.plan in LOSSY_CODECS
        plan = self.offloader.plan
        return plan is not None and any(d.decision in LOSSY_CODECS
                                        for d in plan.decisions.values())

    def new_report(self) -> GuardReport | None:
        """The latest report if a probe ran since the last call (so a trainer logs it once)."""
        if len(self.reports) == self._handed_out:
            return None
        self._handed_out = len(self.reports)
        return self.reports[-1]

    def due(self) -> bool:
        """Count a training step; True when a probe should run before it."""
        self._steps_seen += 1
        return (self.every > 0 and self.lossy_in_use()
                and (self._steps_seen - 1) % self.every == 0)

    def probe(self, model: nn.Module, compute_loss: Callable[[], torch.Tensor]) -> GuardReport:
        """Compare gradients with and without the lossy plan on one micro-batch."""
        start = time.perf_counter()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        snapshot, off = _Snapshot(model), self.offloader
        exact = self._gradients(off.probe_next_step("lossless"), compute_loss, params)
        snapshot.restore()
        lossy = self._gradients(off.probe_next_step("measure errors"), compute_loss, params)
        snapshot.restore()
        cosine, rel_error = {}, {}
        for (name, _), g, h in zip(named, exact, lossy):
            if g is None or h is None:
                continue
            rel_error[name], cosine[name] = compare_gradients(g, h)
        site_errors = {s.site: _unless_nan(s.error, math.inf)
                       for s in off.last_step().sites if s.error is not None}
        report = GuardReport(off.last_step().step, cosine, rel_error, site_errors,
                             time.perf_counter() - start)
        if report.worst_rel_error > self.tolerance:
            report.reverted = self._revert(site_errors)
        self._record(report)
        return report

    @staticmethod
    def _gradients(off: Offloader, compute_loss: Callable[[], torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        with off:
            loss = compute_loss()
        return torch.autograd.grad(loss, params, allow_unused=True)

    def _revert(self, site_errors: dict[int, float]) -> list[int]:
        """Move the worse half (at least one) of the lossy sites back to lossless."""
        worst = sorted(site_errors, key=site_errors.get, reverse=True)
        reverted = worst[: max(1, len(worst) // 2)]
        self.offloader.revert(reverted)
        return reverted

    def _record(self, report: GuardReport) -> None:
        self.reports.append(report)
        self.worst_cosine.update(report.worst_cosine)
        self.worst_rel_error.update(report.worst_rel_error)
        self.reverted_sites.update(len(report.reverted))
        self.probe_seconds.update(report.seconds)


def compare_gradients(exact: torch.Tensor, lossy: torch.Tensor) -> tuple[float, float]:
    """Relative error ``|lossy - exact| / |exact|`` and cosine similarity of two gradients.

    Where floating point gives 0 or NaN, the result says what the case means for the guard:
    both zero is no error (0.0, 1.0); an exact zero with a lossy non-zero is an error
    infinitely large relative to it (inf, 0.0); a NaN or inf in either gradient is the
    worst of both (inf, -1.0), so it trips any tolerance, even when the exact gradient is the
    one at fault: the probe cannot vouch for the lossy sites then.
    """
    g, h = exact.detach().double().flatten(), lossy.detach().double().flatten()
    finite, norm, error, cosine = torch.stack([  # one read back to the host, not four
        (torch.isfinite(g).all() & torch.isfinite(h).all()).double(),
        torch.linalg.vector_norm(g),
        torch.linalg.vector_norm(h - g),
        torch.nn.functional.cosine_similarity(g, h, dim=0, eps=1e-30),
    ]).tolist()
    if not finite:
        return math.inf, -1.0
    if norm == 0.0:
        return (0.0, 1.0) if error == 0.0 else (math.inf, 0.0)
    return error / norm, cosine


def _unless_nan(value: float, worst: float) -> float:
    return worst if math.isnan(value) else value


class _Snapshot:
    """Buffers and random number generator states, to undo a probe's side effects."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
