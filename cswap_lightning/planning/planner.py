"""The planner: from what the engine measured, the one decision table its steps run.

One model of the step, the replay of the measured step (``live.py``, ``replay.py``), decides
everything that is planned, against the budget as the allocator counts it (what the step
holds beside its saved tensors, measured on the planning step, held from the start):

1. once, with a watched model: which blocks to recompute (``mix.py``: swaps inside the link's
   window, then the blocks that free the most bytes per second of recomputation) and the
   bound on bytes in flight; the engine then measures again with them;
2. then, with the recomputed blocks in place: the fewest earliest sites to swap for the
   replayed peak to fit, each through the codec the cost model picks for it (``advisor.py``:
   raw, compressed or lossy), under the largest prefetch window that still fits.

A checked step whose allocator peak passed the budget by more than 3% makes the next plan that
much tighter (three times at most). What a measured step may keep and how long the engine's
host spends on a moved tensor are the planner's too. Every figure it gives is a prediction.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..codecs import get_codec
from ..config import AUTO_INFLIGHT_BYTES, INFLIGHT_CHOICES, CSwapConfig
from ..records import HOST_BUDGET, StepStats
from . import live, mix
from . import replay as replayed
from .advisor import LOSSY_MAX_SPARSITY, Advisor, dense_ok, resolve_budget
from .plan import Decision, Plan
from .predictor import CodecTimeModel, calibrate
from .prefetch import lookahead_bytes
from .profiler import Link, SiteProfile, measure_link

# A checked step whose peak passes the budget by more than this makes the next plan tighter,
# at most this many times.
OVER_BUDGET = 0.03
TIGHTENINGS = 3
# Measured steps keep every tensor where the extra bytes take at most this share of what the
# device can still give (``room_to_keep``).
KEEP_ROOM = 0.8
# The engine's host time per moved tensor, as `cswap bench overhead` measured it (plan=raw):
# on CUDA the replay's own figure (the H200's), on the CPU 13.2 us (2026-11-25).
HOST_S_PER_MOVE = {"cuda": replayed.Engine.host_s_per_move, "cpu": 13.2e-6}


@dataclass(frozen=True)
class Measured:
    """What the measured steps taught, for one plan: each site's profile (those found held
    elsewhere already kept), the blocks that can be recomputed and what each saved, the order
    backward needed the sites in, and the step the plan is made on."""

    profiles: list[SiteProfile]
    calls: Sequence[live.BlockCall]
    order: list[int] | None
    stats: StepStats
    device: torch.device
    # the allocator's peak of a step without the engine's hooks that kept what ``stats``'s
    # step kept (all): the measured steps' own peak is not a plain step's
    plain_peak: int | None = None
    # the sites backward first asked for at once (``StepTimer.together``)
    together: Sequence[tuple[int, ...]] = ()

    @property
    def beside_bytes(self) -> int:
        """What the step held beside its saved tensors at its peak (CUDA: the allocator's
        peak less theirs; the CPU knows nothing of it)."""
        stats = self.stats
        peak = self.plain_peak if self.plain_peak is not None else stats.peak_allocated_bytes
        return max((peak or 0) - stats.peak_resident_bytes, 0)


class Planner:
    """Plans for one engine (``CSwapConfig``); ``link`` and ``time_model`` replace the
    measured bandwidths and codec times. ``lossy_ok(profile)``: where a lossy codec may go."""

    def __init__(self, config: CSwapConfig, link: Link | None = None,
                 time_model: CodecTimeModel | None = None,
                 lossy_ok: Callable[[SiteProfile], bool] = lambda p: True) -> None:
        self.config = config
        self.link, self.time_model, self.lossy_ok = link, time_model, lossy_ok
        self.inflight_bytes = (AUTO_INFLIGHT_BYTES if config.inflight_bytes == "auto"
                               else config.inflight_bytes)
        # the blocks chosen to recompute, with the replayed step they were chosen on
        self.recomputation: live.Recomputation | None = None
        self.tightened = self.tightenings = 0
        # what a checked step's allocator peak showed the replay over-predicts it by (once)
        self.loosened = 0
        self._measured: tuple[Link, CodecTimeModel] | None = None

    # -- what is planned -----------------------------------------------------------------
    def choose_recompute(self, m: Measured) -> live.Recomputation | None:
        """The blocks to recompute for the budget, by replaying the measured step under
        candidate mixes of keep, swap and recompute; None without a budget. Sets the bound
        on bytes in flight the chosen mix was replayed with."""
        budget = self.budget(m.device)
        if budget is None or not m.calls:
            return None
        link, model = self.measure(m.device)
        measured = live.candidates(m.profiles, m.calls, m.beside_bytes, m.together)
        self.recomputation = live.choose_recompute(
            measured, budget, link, self._engine(m, link),
            INFLIGHT_CHOICES if self.config.inflight_bytes == "auto" else (),
            self._block_codecs(m, model), self.config.host_budget)
        self.inflight_bytes = self.recomputation.inflight_bytes
        return self.recomputation

    def _block_codecs(self, m: Measured, model: CodecTimeModel) -> list[mix.CodecOf]:
        """How blocks may travel compressed, for the mix to weigh: each movable site through
        the compressor (a dense bfloat16 one through ``dense_compressor``, where on); and
        where ``lossy`` allows, through the lossy codec where the site
        may be lossy (``lossy_ok``, and dense: ``LOSSY_MAX_SPARSITY``), else the compressor."""
        compressor, lossy, dense = self.config.compressor, self._lossy(), self._dense()

        def lossless(p: SiteProfile) -> str:
            return dense if dense is not None and dense_ok(p) else compressor

        codecs = [live.block_codec(m.profiles, lossless, model)]
        if lossy is not None:
            codecs.append(live.block_codec(m.profiles, lambda p: lossy if (
                p.sparsity < LOSSY_MAX_SPARSITY and self.lossy_ok(p)) else lossless(p), model))
        return codecs

    def _dense(self) -> str | None:
        """The dense lossless codec the config allows, or None."""
        return None if self.config.dense_compressor == "off" else self.config.dense_compressor

    def _lossy(self) -> str | None:
        """The lossy codec the config allows (``"auto"``: int8), or None."""
        return {"off": None, "auto": "int8"}.get(self.config.lossy, self.config.lossy)

    def plan(self, m: Measured, fresh: bool = True) -> Plan:
        """Every site's decision: each movable site's codec (``Advisor.decide``), swapped
        only where the replayed peak needs it, the earliest first (``fresh``: with the link
        and codec times measured now, else those of the latest plan)."""
        cfg = self.config
        link, model = self.measure(m.device, fresh)
        advisor = Advisor(cfg.compressor, link, model, self._lossy(), self.lossy_ok,
                          dense=self._dense())
        decisions = {p.site: advisor.decide(p) if p.offloadable else Decision(
            p.site, p.shape, p.dtype, p.nbytes, p.sparsity, "keep",
            p.reason or "not offloadable", 0, 0.0, 0.0) for p in m.profiles}
        budget, beside = self.budget(m.device), m.beside_bytes
        window = self._window(m, link)
        workload = live.by_site(live.workload(m.profiles, (), beside, together=m.together))
        movable = [k for k, p in enumerate(m.profiles) if decisions[p.site].decision != "keep"]
        codecs = {k: _codec(decisions[m.profiles[k].site], model, m.profiles[k])
                  for k in movable}

        def replayed_with(moved: int, prefetch: int) -> replayed.Prediction:
            plan = replayed.Mix(replayed.KEEP, {
                workload.blocks[k].name: replayed.BlockDecision("swap", codecs[k])
                for k in movable[:moved]})
            return replayed.predict(workload, plan, link,
                                    replace(self._engine(m, link), prefetch_bytes=prefetch))

        moved = len(movable)
        if budget is not None:
            moved, window = self._fewest(replayed_with, len(movable), budget, window)
        held = self._on_host(replayed_with, moved, window)
        prediction = replayed_with(held, window)
        fits = budget is None or (prediction.peak_bytes <= budget and held == moved)
        for n, k in enumerate(movable[held:], start=held):
            d = decisions[m.profiles[k].site]
            d.decision, d.stored_bytes, d.chosen_s = "keep", 0, 0.0
            d.reason = (HOST_BUDGET if n < moved else "fits the budget" if fits
                        else "keeps the peak lowest")
        signature = tuple((p.shape, p.dtype) for p in m.profiles)
        return Plan(decisions, signature, budget, beside,
                    max(prediction.peak_bytes - beside, 0), fits, window)

    def _on_host(self, replayed_with: Callable[[int, int], replayed.Prediction], moved: int,
                 window: int) -> int:
        """The most of the ``moved`` earliest sites whose payloads the host budget holds."""
        host = self.config.host_budget
        if host is None or replayed_with(moved, window).host_bytes <= host:
            return moved
        return bisect_left(range(moved + 1), True,
                           key=lambda k: replayed_with(k, window).host_bytes > host) - 1

    @staticmethod
    def _fewest(replayed_with: Callable[[int, int], replayed.Prediction], movable: int,
                budget: int, window: int) -> tuple[int, int]:
        """The fewest earliest sites to move for the replayed peak to fit, under the largest
        prefetch window (``window``, halved) that lets some count fit. Moving one more site
        lowers forward's peak and may raise backward's (one more restore in the window):
        the fewest whose forward fits is the only count that can fit at all. Where none
        does, all of them under ``window`` (the lowest peak forward can have)."""
        tried = window
        while True:
            fewest = bisect_left(range(movable + 1), True, key=lambda k, w=tried: (
                replayed_with(k, w).forward_peak_bytes <= budget))
            if fewest <= movable and replayed_with(fewest, tried).peak_bytes <= budget:
                return fewest, tried
            if tried == 0:
                return movable, window
            tried //= 2

    def tighter(self, over: int) -> live.Recomputation | None:
        """After a checked step passed the budget by ``over`` bytes: plan for a budget that
        much tighter, the recomputed blocks chosen again from the step they were chosen on."""
        self.tightened += over
        self.tightenings += 1
        return self._choose_again(over)

    def looser(self, by: int) -> live.Recomputation | None:
        """After a checked step's allocator peak came ``by`` bytes under the plan's predicted
        one (a model of the peak that counts too much, which only moves more than needed):
        plan once for a budget that much looser, from the same replayed step."""
        self.loosened = by
        return self._choose_again(-by)

    def _choose_again(self, tighter_by: int) -> live.Recomputation | None:
        """The recomputation chosen again for a budget ``tighter_by`` bytes tighter (looser
        where negative), from the step it was chosen on; None where none was chosen."""
        if self.recomputation is None:
            return None
        self.recomputation = self.recomputation.tighter(tighter_by)
        self.inflight_bytes = self.recomputation.inflight_bytes
        return self.recomputation

    def over_budget(self, plan: Plan, peak: int) -> int:
        """Bytes a checked step's peak passed a plan's budget (the configured one, less the
        tightenings) by, where the plan was predicted to fit and that is more than
        ``OVER_BUDGET`` (and tightening is left); else 0."""
        if plan.budget_bytes is None:
            return 0
        budget = plan.budget_bytes - self.loosened
        if (self.config.plan != "auto" or not plan.fits or peak <= (1 + OVER_BUDGET) * budget
                or self.tightenings >= TIGHTENINGS):
            return 0
        return peak - budget

    def over_predicted(self, plan: Plan, allocated: int | None) -> int:
        """Bytes the allocator's peak of the step that checked ``plan`` came under the
        plan's prediction of it, where that is more than ``OVER_BUDGET`` of the budget, the
        plan had to move or recompute to fit, and no plan was made looser yet; else 0."""
        if (self.config.plan != "auto" or plan.budget_bytes is None or allocated is None
                or not plan.fits or self.loosened or self.recomputation is None):
            return 0
        moves = any(d.decision != "keep" for d in plan.decisions.values())
        if not (moves or self.recomputation.names):
            return 0
        error = plan.predicted_peak + plan.base_bytes - allocated
        return error if error > OVER_BUDGET * plan.budget_bytes else 0

    # -- what it plans with --------------------------------------------------------------
    def measure(self, device: torch.device, fresh: bool = True
                ) -> tuple[Link, CodecTimeModel]:
        """The link's bandwidth and the codecs' times (``fresh``: measured now; else those
        of the latest plan, where there is one)."""
        if fresh or self._measured is None:
            cfg = self.config
            codecs = tuple(c for c in (cfg.compressor, self._dense(), self._lossy())
                           if c is not None)
            self._measured = (self.link or measure_link(device),
                              self.time_model or calibrate(device, codecs).model)
        return self._measured

    def budget(self, device: torch.device) -> int | None:
        """The configured budget in bytes, less what checked steps showed it lacked."""
        budget = resolve_budget(self.config.budget, device)
        return None if budget is None else max(budget - self.tightened + self.loosened, 0)

    def _window(self, m: Measured, link: Link) -> int:
        """The prefetch window to plan with: ``prefetch_bytes``, or for ``"auto"`` what hides
        the link, were every movable site moved."""
        window = self.config.prefetch_bytes
        if window == "auto":
            window = lookahead_bytes(
                m.order or [p.site for p in reversed(m.profiles)],
                {p.site: p.nbytes for p in m.profiles if p.offloadable},
                {p.site: p.backward_s for p in m.profiles}, link.h2d)
        return window

    def _engine(self, m: Measured, link: Link) -> replayed.Engine:
        return replayed.Engine(self.config.min_bytes, self._window(m, link), self.inflight_bytes,
                               HOST_S_PER_MOVE.get(m.device.type, 0.0))


def room_to_keep(stats: StepStats, device: torch.device | None,
                 memory: tuple[int, int, int] | None = None) -> bool:
    """Whether a step like ``stats`` (measured swapping its tensors) could keep them all on
    ``device`` instead: its allocator peak above what is allocated now, plus the bytes it
    moved, within four fifths of what the device can still give (free, and reserved by the
    allocator but unused). ``memory``: (free, reserved, allocated) bytes, measured if None.
    CUDA only: the CPU's measured steps swap, as on a device without room."""
    if device is None or device.type != "cuda" or stats.peak_allocated_bytes is None:
        return False
    if memory is None:
        memory = (torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device),
                  torch.cuda.memory_allocated(device))
    free, reserved, allocated = memory
    extra = max(stats.peak_allocated_bytes - allocated, 0) + stats.offloaded_bytes
    return extra <= KEEP_ROOM * (free + reserved - allocated)


def _codec(decision: Decision, model: CodecTimeModel, p: SiteProfile) -> replayed.Codec:
    """How a site travels as its decision says: its stored share, its codec's speeds."""
    if decision.decision == "raw" or not p.nbytes:
        return replayed.RAW
    seconds = [model.predict(decision.decision, way, p.nbytes, p.sparsity)
               for way in ("encode", "decode")]
    encode, decode = (p.nbytes / s if s > 0 else float("inf") for s in seconds)
    return replayed.Codec(decision.decision, max(decision.stored_bytes, 1) / p.nbytes, encode,
                          decode, get_codec(decision.decision).encode_waits)
