"""The accuracy guard: lossy sites must not bend the gradients more than the user allows.

While some site is lossy, every ``guard_every`` training steps a check computes one
micro-batch's gradients with the lossy sites swapped raw (bitwise what training without the
library gives) and with them lossy, rounded as the next training step will round them. A
parameter's gradient error is ``|g_lossy - g|`` relative to the larger of ``|g|`` and a floor
tied to the gradient's scale: ``FLOOR`` times the norm the parameter's gradient would have at
the model's mean gradient per element (``|G| * sqrt(n / N)``). So a parameter whose exact
gradient is about zero (an attention key's bias, which softmax ignores) is judged against the
model's gradients, not against its own rounding noise. A NaN or inf trips any tolerance.

Past ``guard_tolerance`` the culprits are found by their effect on the gradients: the lossy
sites are halved and each half measured alone lossy (the others raw), descending into every
half that trips alone, or else into the worse one, down to single sites. Those are reverted to
lossless and the rest measured again, until the error is within the tolerance. Finding k
culprits among n sites costs about ``2 k log2(n)`` more forward and backward passes; a check
that passes costs two. Each check and each revert is logged (this module's logger) with the
site's module and its errors.

A check leaves no trace: parameter gradients, buffers (BatchNorm statistics) and random number
generators are as they were before it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torchmetrics import MaxMetric, MinMetric, SumMetric

from ..codecs.lossy import relative
from ..config import LOSSY_CODECS
from ..metrics import ReconstructionError
from .engine import Offloader
from .module_names import ModuleTracker
from .rng import RandomStates

# A parameter's gradient error is measured against at least this fraction of the norm its
# gradient would have at the model's mean gradient per element.
FLOOR = 0.1
_log = logging.getLogger(__name__)


@dataclass
class GuardReport:
    """What one check measured and did."""

    step: int
    cosine: dict[str, float]  # per parameter: cosine similarity of lossy and exact gradients
    rel_error: dict[str, float]  # per parameter: |g_lossy - g| / max(|g|, floor)
    site_errors: dict[int, float]  # per lossy site: relative error of its round trip
    seconds: float
    reverted: list[int] = field(default_factory=list)  # in the order found
    grad_error: float = 0.0  # the whole model's |G_lossy - G| / |G|
    modules: dict[int, str] = field(default_factory=dict)  # per lossy site: who saved it
    # per reverted site: the worst parameter's error with it alone lossy
    culprit_errors: dict[int, float] = field(default_factory=dict)
    error_after: float | None = None  # the worst parameter's error once they were reverted
    passes: int = 0  # forward and backward passes the check ran
    reconstruction_error: float = 0.0  # pooled over the lossy sites (ReconstructionError)

    @property
    def worst_cosine(self) -> float:
        """The lowest cosine; a NaN counts as -1 (``min`` would drop it or not, by order)."""
        return min((_unless_nan(c, -1.0) for c in self.cosine.values()), default=1.0)

    @property
    def worst_rel_error(self) -> float:
        """The largest error; a NaN counts as inf (``max`` would drop it or not, by order)."""
        return _worst_error(self.rel_error)

    def label(self, site: int) -> str:
        """``module/site``, the name a lossy site's figures are logged under."""
        return f"{self.modules.get(site) or 'model'}/{site}"

    def describe(self, site: int) -> str:
        """``site N (module)``, as the log lines name a lossy site."""
        return f"site {site} ({self.modules.get(site) or 'the model itself'})"

    def log_values(self, prefix: str = "cswap/") -> dict[str, float]:
        """The figures the integrations log after a check: the guard's, and the round-trip
        error of the lossy sites, pooled and per site."""
        values = {f"{prefix}guard_worst_cosine": self.worst_cosine,
                  f"{prefix}guard_worst_rel_error": self.worst_rel_error,
                  f"{prefix}guard_grad_error": self.grad_error,
                  f"{prefix}guard_reverted_sites": float(len(self.reverted)),
                  f"{prefix}guard_passes": float(self.passes),
                  f"{prefix}guard_seconds": self.seconds}
        if self.site_errors:
            values[f"{prefix}reconstruction_error"] = self.reconstruction_error
        for site, error in self.site_errors.items():
            values[f"{prefix}reconstruction_error/{self.label(site)}"] = error
        return values


class AccuracyGuard:
    """Checks an :class:`Offloader`'s lossy sites and reverts the ones that hurt.

    ``probe(model, compute_loss)`` needs a closure that runs one micro-batch's forward and
    returns its loss; the integrations build it from the training step.
    """

    def __init__(self, offloader: Offloader) -> None:
        self.offloader = offloader
        self.every = offloader.config.guard_every
        self.tolerance = offloader.config.guard_tolerance
        self.reports: list[GuardReport] = []
        # By default these drop a NaN, hiding the check that went worst.
        self.worst_cosine = MinMetric(nan_strategy=-1.0)
        self.worst_rel_error = MaxMetric(nan_strategy=math.inf)
        self.grad_error = MaxMetric(nan_strategy=math.inf)
        self.reverted_sites = SumMetric()
        self.probe_seconds = SumMetric()
        self.reconstruction = ReconstructionError()  # pooled over every check's lossy sites
        self._steps_seen = 0
        self._handed_out = 0  # reports new_report() has returned

    def lossy_in_use(self) -> bool:
        """Whether some site is lossy: as the latest training step compressed them (none once
        every one was reverted); before any step, whether the config forces a lossy codec."""
        sites = self.offloader.lossy_sites()
        return self.offloader.config.plan in LOSSY_CODECS if sites is None else bool(sites)

    def new_report(self) -> GuardReport | None:
        """The latest report if a check ran since the last call (so a trainer logs it once)."""
        if len(self.reports) == self._handed_out:
            return None
        self._handed_out = len(self.reports)
        return self.reports[-1]

    def due(self) -> bool:
        """Count a training step; True when a check should run before it."""
        self._steps_seen += 1
        return (self.every > 0 and (self._steps_seen - 1) % self.every == 0
                and self.lossy_in_use())

    def probe(self, model: nn.Module, compute_loss: Callable[[], torch.Tensor]) -> GuardReport:
        """Compare gradients with and without the lossy sites on one micro-batch; revert the
        sites that bend them past the tolerance."""
        start = time.perf_counter()
        off = self.offloader
        tracker = None
        if off.modules is None:  # name the sites for the logs, during the check only
            off.modules = tracker = ModuleTracker(model)
        try:
            report = _Check(self, model, compute_loss).run()
        finally:
            if tracker is not None:
                tracker.close()
                off.modules = None
        report.seconds = time.perf_counter() - start
        if report.reverted:
            off.revert(report.reverted)
        self._record(report)
        return report

    def _record(self, report: GuardReport) -> None:
        self.reports.append(report)
        self.worst_cosine.update(report.worst_cosine)
        self.worst_rel_error.update(report.worst_rel_error)
        self.grad_error.update(report.grad_error)
        self.reverted_sites.update(len(report.reverted))
        self.probe_seconds.update(report.seconds)


class _Check:
    """One check: its exact gradients, and the passes that measure sets of lossy sites."""

    def __init__(self, guard: AccuracyGuard, model: nn.Module,
                 compute_loss: Callable[[], torch.Tensor]) -> None:
        self.guard, self.off, self.compute_loss = guard, guard.offloader, compute_loss
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.snapshot = _Snapshot(model)
        self.passes = 0
        self.pooled = ReconstructionError()  # this check's lossy sites

    def run(self) -> GuardReport:
        guard, off = self.guard, self.off
        exact = _Exact(self.names, self._gradients(off.probe_next_step("lossless")))
        lossy = self._gradients(off.probe_next_step("measure errors", restored=self._restored))
        step = off.last_step()
        rows = [s for s in step.sites if s.error is not None]
        sites = [s.site for s in rows]
        rel_error, cosine, grad_error = exact.measure(lossy)
        report = GuardReport(step.step, cosine, rel_error, {s.site: s.error for s in rows}, 0.0,
                             grad_error=grad_error, modules={s.site: s.module for s in rows},
                             reconstruction_error=self.pooled.compute().item() if rows else 0.0)
        error = report.worst_rel_error
        if error <= guard.tolerance:
            _log.info("cswap guard: step %d: worst parameter gradient error %.3g (whole model "
                      "%.3g) within tolerance %g over %d lossy sites", report.step, error,
                      grad_error, guard.tolerance, len(sites))
        while error > guard.tolerance and sites:
            _log.warning("cswap guard: step %d: worst parameter gradient error %.3g (%s) "
                         "above tolerance %g with %d lossy sites: looking for the sites that "
                         "cause it", report.step, error, _worst(report.rel_error),
                         guard.tolerance, len(sites))
            for site, alone in self._culprits(sites, error, exact):
                report.reverted.append(site)
                report.culprit_errors[site] = alone
                _log.warning("cswap guard: reverting %s to lossless: gradient error %.3g "
                             "with it alone lossy, round-trip error %.3g", report.describe(site),
                             alone, report.site_errors.get(site, math.nan))
            sites = [s for s in sites if s not in report.culprit_errors]
            error = self._error(sites, exact) if sites else 0.0
            report.error_after = error
            _log.warning("cswap guard: step %d: gradient error %.3g with the %d lossy sites "
                         "left", report.step, error, len(sites))
        self.snapshot.restore()
        report.passes = self.passes
        return report

    def _culprits(self, sites: list[int], error: float, exact: _Exact
                  ) -> list[tuple[int, float]]:
        """The sites among ``sites`` (lossy together: ``error``, past the tolerance) to revert,
        each with the error it gives alone: from each half that trips alone (both, if both
        do), else from the worse half, down to single sites."""
        if len(sites) == 1:
            return [(sites[0], error)]
        halves = [sites[: len(sites) // 2], sites[len(sites) // 2 :]]
        measured = [(half, self._error(half, exact)) for half in halves]
        tripping = [(half, e) for half, e in measured if e > self.guard.tolerance]
        if not tripping:  # only together: the worse half holds the worst site
            tripping = [max(measured, key=lambda pair: pair[1])]
        return [found for half, e in tripping for found in self._culprits(half, e, exact)]

    def _error(self, sites: list[int], exact: _Exact) -> float:
        """The worst parameter's gradient error with only ``sites`` lossy."""
        rel_error, _, _ = exact.measure(self._gradients(
            self.off.probe_next_step("measure errors", sites)))
        return _worst_error(rel_error)

    def _gradients(self, off: Offloader) -> tuple[torch.Tensor | None, ...]:
        """One pass: the parameters' gradients, everything else put back as it was."""
        self.snapshot.restore()
        self.passes += 1
        with off:
            loss = self.compute_loss()
        return torch.autograd.grad(loss, self.params, allow_unused=True)

    def _restored(self, site: int, original: torch.Tensor, restored: torch.Tensor) -> None:
        self.pooled.update(original, restored)
        self.guard.reconstruction.update(original, restored)


class _Exact:
    """A check's exact gradients, and each parameter's floor: ``FLOOR`` times the norm its
    gradient would have at the model's mean gradient per element."""

    def __init__(self, names: list[str], grads: Sequence[torch.Tensor | None]) -> None:
        self.names, self.grads = names, grads
        present = [g for g in grads if g is not None]
        total = sum(g.numel() for g in present)
        scale = math.sqrt(sum(_norm(g) ** 2 for g in present) / total) if total else 0.0
        self.floors = [0.0 if g is None else FLOOR * scale * math.sqrt(g.numel())
                       for g in grads]

    def measure(self, lossy: Sequence[torch.Tensor | None]
                ) -> tuple[dict[str, float], dict[str, float], float]:
        """Per parameter the relative error (floored) and the cosine of ``lossy`` against the
        exact gradients; and the whole model's relative error."""
        rel_error, cosine, squares = {}, {}, [0.0, 0.0]
        for name, g, h, floor in zip(self.names, self.grads, lossy, self.floors):
            if g is None or h is None:
                continue
            rel_error[name], cosine[name], norm, error = _compare(g, h, floor)
            squares[0] += error**2
            squares[1] += norm**2
        whole = relative(*torch.tensor(squares, dtype=torch.float64)).item()
        return rel_error, cosine, whole


def compare_gradients(exact: torch.Tensor, lossy: torch.Tensor,
                      floor: float = 0.0) -> tuple[float, float]:
    """Relative error ``|lossy - exact| / max(|exact|, floor)`` and cosine similarity of two
    gradients.

    Where floating point gives 0 or NaN, the result says what the case means for the guard:
    both zero is no error (0.0, 1.0); an error relative to nothing (an exact zero and no
    floor) is infinitely large (inf, 0.0); a NaN or inf in either gradient is the worst of
    both (inf, -1.0), so it trips any tolerance, even when the exact gradient is the one at
    fault: the check cannot vouch for the lossy sites then.
    """
    rel_error, cosine, _, _ = _compare(exact, lossy, floor)
    return rel_error, cosine


def _compare(exact: torch.Tensor, lossy: torch.Tensor,
             floor: float) -> tuple[float, float, float, float]:
    """:func:`compare_gradients`, with the norms of the exact gradient and of the error."""
    g, h = exact.detach().double().flatten(), lossy.detach().double().flatten()
    finite, norm, error, cosine = torch.stack([  # one read back to the host, not four
        (torch.isfinite(g).all() & torch.isfinite(h).all()).double(),
        torch.linalg.vector_norm(g),
        torch.linalg.vector_norm(h - g),
        torch.nn.functional.cosine_similarity(g, h, dim=0, eps=1e-30),
    ]).tolist()
    if not finite:
        return math.inf, -1.0, math.inf, math.inf
    against = max(norm, floor)
    if norm == 0.0 and error == 0.0:
        return 0.0, 1.0, norm, error
    if against == 0.0:
        return math.inf, 0.0, norm, error
    return error / against, (cosine if norm else 0.0), norm, error


def _norm(t: torch.Tensor) -> float:
    norm = torch.linalg.vector_norm(t.detach().double()).item()
    return norm if math.isfinite(norm) else 0.0  # a non-finite gradient trips by itself


def _worst(errors: dict[str, float]) -> str:
    """The parameter of the largest error (a NaN counts as inf)."""
    return max(errors, key=lambda k: _unless_nan(errors[k], math.inf), default="")


def _worst_error(errors: dict[str, float]) -> float:
    return max((_unless_nan(e, math.inf) for e in errors.values()), default=0.0)


def _unless_nan(value: float, worst: float) -> float:
    return worst if math.isnan(value) else value


class _Snapshot:
    """Buffers and random number generator states, to undo a check's side effects."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.random = RandomStates()

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        self.random.restore()
