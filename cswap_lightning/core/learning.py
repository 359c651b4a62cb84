"""What the engine learns across steps, and the plan its steps run.

A closed step's figures go in (:meth:`Learning.finished`): a measured step's profile (then
the planner's plan from them, ``planning/planner.py``), the check of a new plan on the first
step that runs it (a peak over the budget makes the next plan tighter; an allocator peak
under its prediction, once, looser), the order backward needs sites in, the sites whose
moving freed nothing, a graph or sizes other than the plan's (measured or planned again).
Each new step then asks what it runs: measured or not, under the checked plan, without hooks
(:meth:`watched`). The engine (``engine.py``) keeps the hooks' life cycle and hands each
step to a ``Step``; this keeps what lasts across them.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from ..allocator import peak_allocated_bytes
from ..codecs import get_codec
from ..config import CSwapConfig
from ..planning import live, mix
from ..planning.plan import HELD_ELSEWHERE, Plan
from ..planning.planner import OVER_BUDGET, TIGHTENINGS, Measured, Planner, room_to_keep
from ..planning.predictor import CodecTimeModel
from ..planning.profiler import Link, Profiler, StepTimer
from ..records import Recomputed, StepStats, fmt_bytes
from .recompute import BlockCall, Recompute, left_out_rows
from .step import Checked, Move, Step

if TYPE_CHECKING:
    from .transfer import Transfer

# Re-measuring because the saved tensors changed this many times says something is off.
_REPLANS_BEFORE_WARNING = 3
# A run whose steps run without hooks is measured again once the allocator's peak of a step
# comes this close to the plan's budget.
_NEAR_BUDGET = 0.95
# On the CPU, where no allocator says so, steps run without hooks only if the checking step
# held at most this fraction of the budget.
_CPU_HEADROOM = 0.5
_log = logging.getLogger("cswap_lightning.core.engine")


class Owner(Protocol):
    """What learning needs of the engine: its settings and copies, the watched model's
    blocks (and choosing which run recomputed), the sites the accuracy guard reverted."""

    config: CSwapConfig
    transfer: Transfer
    recomputer: Recompute | None
    reverted: set[int]

    def recompute(self, names: Iterable[str]) -> dict[str, str]: ...

    def lossy_allowed(self, site: int, dtype: str, module: str) -> bool: ...


class Learning:
    """What one engine learned: the planner and its plan (``plan``: the planner's, for
    ``plan="auto"``; ``unchecked`` until a step ran it; ``checked``: what later steps repeat
    without tracking each site), the profiler's measurements, the measured steps left."""

    def __init__(self, owner: Owner, link: Link | None = None,
                 time_model: CodecTimeModel | None = None) -> None:
        self.owner = owner
        self.config = config = owner.config
        self.planner = Planner(config, link, time_model,
                               lambda p: owner.lossy_allowed(p.site, p.dtype, p.module))
        self.plan: Plan | None = None
        self.unchecked: Plan | None = None  # a plan no step has run yet
        # Later steps keep the sites a checked plan kept untracked, and measure again (or, for
        # a fixed plan, track again) if what they save changes.
        self.checked: Checked | None = None
        self.profiler = Profiler()
        self.measure_left = config.profile_steps
        # Measured steps keep every saved tensor where the device has room for them (CUDA):
        # their times have no copies in them and their allocator peak is keeping all's.
        self.measure_keeping = self.measured_keeping = False
        # On CUDA the measured steps' hooks (and the blocks' observers) leave the device idle
        # between kernels, so their windows and block times are the host's: one step with room
        # for every tensor runs without hooks, its forward timed (``plain_forward_s``), and
        # the measured times are scaled to it (``_scales``); its backward too, from the
        # first unpack to the end (``plain_backward_s``). The host's own windows (what the
        # replay's host clock runs on: a forward whose host falls behind the device sets the
        # pace) leave the hooks' time out as measured, with or without that step; its host's
        # time in forward (``plain_host_forward_s``) is kept to check them against.
        self.plain_forward_s: float | None = None
        self.plain_backward_s: float | None = None
        self.plain_host_forward_s: float | None = None
        self.plain_peak: int | None = None  # its allocator peak (CUDA)
        self.timing_plain = False  # that step runs, or its figures are owed
        self.measure_device: torch.device | None = None
        self.order: list[int] | None = None  # backward's order of sites, learned
        self.held_elsewhere: set[int] = set()  # sites whose moving freed nothing (measured)
        # each block call of the latest measured step that ran them plainly (what it saved,
        # its forward's time), and that step
        self.block_calls: list[BlockCall] = []
        self.plain_stats: StepStats | None = None
        # the planner chooses the blocks to recompute once, from the plain measured steps
        self.recompute_planned = False
        self.measure_recomputed = False  # measured steps run the planner's choice
        self.numbering: frozenset[str] = frozenset()  # the blocks the last step recomputed
        self.budget_bytes: int | None = None  # the budget as configured, once planned for
        self.epoch = 0  # new_epoch() calls: a step measured before one says nothing after
        self.replans = 0
        # The count of saved tensors and the sites of weights among them of the graph measured
        # since new_epoch() (its first tracked step's), per numbering of the sites (recomputed
        # blocks save other tensors): a step of the same count with weights elsewhere is
        # another model's (_other_graph).
        self.graphs: dict[frozenset[str], tuple[int, frozenset[int]]] = {}
        self.said: set[str] = set()  # the warnings given (each once)
        self.warned_compiled = False

    def recheck(self) -> None:
        """The next step checks the plan again (it saves other tensors, or moves others)."""
        self.checked, self.unchecked = None, self.plan

    def renumbered(self, numbering: frozenset[str]) -> None:
        """A step recomputes these blocks: where others than the last step's, its sites are
        others, and what was measured of them (held elsewhere) is not theirs."""
        if numbering != self.numbering:
            self.held_elsewhere = set()
            self.numbering = numbering

    def finished(self, step: Step) -> None:
        """What a closed step teaches: the plan it checked, backward's order, its
        measurements (a plan from them), the host arena planned from its payloads."""
        if step.timed_plainly:
            self.timing_plain = False  # one without a backward is timed again
            if step.epoch == self.epoch and step.backward_begun:
                self.plain_forward_s = step.timer.forward_s()
                self.plain_backward_s = step.timer.backward_s()
                self.plain_host_forward_s = step.timer.host_forward_s()
                self.plain_peak = step.backward_peak
            return
        if step.device is not None:
            self.owner.transfer.poll()  # its compressed payloads settled
            step.close()
        scale, back, host = self._scales(step)
        if step.blocks is not None:
            self.block_calls = [_scaled(call, scale) for call in step.blocks.calls()]
            self.plain_stats = step.stats
        if not step.sizes:  # it saved nothing: it says nothing of the graph
            return
        if step.epoch == self.epoch and self._other_graph(step):
            self.plan = self.unchecked = None  # made by position for the other graph
            self._replanning()
            return
        if not step.backward_begun:  # its graph went first (a step skipped): measured again
            _log.info("cswap: step %d's backward had not begun when the next step did: it "
                      "neither measures nor checks a plan", step.stats.step)
            self.owner.transfer.step_closed(step.stats, step.device, plan=False)
            return
        auto = self.config.plan == "auto"
        if step.checked is not None:
            if step.stats.resized:  # it saved other sizes than the checking step
                if auto and not self.plan.covers(step.counted()):
                    self._outgrown(step)  # its larger tensors were tracked
                    return
                if not auto:  # the next step tracks every site, and checks the plan again
                    self.checked = None
            elif step.idle:
                return
        elif (self.unchecked is not None and step.probe is None
              and self.unchecked.covers(step.counted())):
            self.check(self.unchecked, step.stats)
            self._checked_by(step)
        elif (not step.measure and step.probe is None and step.stats.sites and (
                not auto or (self.plan is not None and self.plan.covers(step.counted())))):
            self._checked_by(step)
        self.unchecked = None
        if step.checked is None:  # steps running a checked plan see only some first unpacks
            self.order = step.unpack_order or self.order
        if not self.warned_compiled and step.restored_all_at_once():
            self.warned_compiled = True
            warnings.warn(
                f"cswap: backward asked for {fmt_bytes(step.region_peak)} of the "
                f"{fmt_bytes(step.moved_bytes())} moved off the device at once, as the backward "
                "of a torch.compile'd region does (pytorch/pytorch#148222), so offloading "
                "lowered little at the peak. Compile per block instead of the whole model: "
                "cswap_lightning.compile_blocks(model).", RuntimeWarning, stacklevel=5)
        # plans the host arena from it, where it tracked every site it moved
        self.owner.transfer.step_closed(step.stats, step.device, plan=not step.untracked_moves)
        if step.epoch != self.epoch:  # measured before new_epoch(): says nothing now
            return
        if step.measure and step.device is not None:
            self.measure_left -= 1
        if self.config.plan != "auto" or step.device is None:
            return
        if step.measure:
            timer = step.timer
            windows = timer.windows() if timer else {}
            self.profiler.observe(
                step.stats,
                {site: (f * scale, b * back, h * host) for site, (f, b, h) in windows.items()},
                timer.unpack_order() if timer else None, timer.together() if timer else None)
            self.measured_keeping |= step.keeping
            self.measure_device = step.device
            if not self.measure_keeping:
                self.measure_keeping = room_to_keep(step.stats, step.device)
            if self.measure_left == 0 and self.measure_keeping and not self.measured_keeping:
                self.measure_left = 1  # one more, keeping every tensor, then the plan
                return
            if self.measure_left == 0:
                if not self._plan_recompute(step):
                    self._use(self._advise(step))
            elif self.plan is None:
                plan = self._advise(step)
                if plan.fits and all(d.decision == "keep" for d in plan.decisions.values()):
                    self._use(plan)  # nothing needs to move: the next measured steps keep all
        elif (step.checked is None and self.plan is not None
              and not self.plan.covers(step.counted())):
            self._outgrown(step)


    def watched(self, checked: Checked) -> bool:
        """Whether steps may run without hooks (autograd keeps every saved tensor) under a
        checked plan that moves nothing: never under a forced plan other than ``"keep"`` (it
        moves what it can: a step that found nothing to move says nothing of the next graph);
        under the advisor's, on CUDA, where the allocator's peak says when a step nears the
        budget (a longer batch, say); on the CPU, where nothing does, only if the checking step
        held at most half the budget; always where no budget applies."""
        plan = self.plan
        if self.config.plan != "auto":
            return self.config.plan == "keep"
        if plan is None or plan.budget_bytes is None:
            return True
        if checked.device is not None and checked.device.type == "cuda":
            return True
        return checked.stats.peak_resident_bytes <= _CPU_HEADROOM * plan.budget_bytes


    def new_step(self, index: int, measured_owed: int, probe_next: bool) -> Step:
        """The next step, as what was learned says it runs: measured (the closed steps whose
        measurements are still owed, ``measured_owed``, count as measured), or under the
        checked plan (not on a guard's probe, nor before a new plan has run), or tracking
        every site. A plan that moves nothing is measured again once the allocator's peak of
        a step without hooks nears the budget."""
        if self.checked is not None and self.checked.moves_nothing and self.near_budget():
            _log.info("cswap: the allocator's peak neared the budget on a step without hooks: "
                      "measuring again")
            self.new_epoch()
        measure = self.measure_left > measured_owed
        checked = (self.checked if not measure and not probe_next and self.unchecked is None
                   else None)
        auto = self.config.plan == "auto"
        limits = self.plan.site_bytes if checked is not None and auto else None
        if measure and self._time_plain():
            return self._plain_step(index)
        step = Step(self.owner, index, self.order, measure, checked, limits)
        step.epoch = self.epoch
        if measure and self.measure_device is not None:  # timed from its start, as plain
            step.timer = StepTimer(self.measure_device)
            step.timer.begin()
        if auto:
            step.stats.budget_bytes = self.budget_bytes
        step.keeping = measure and self.measure_keeping
        return step

    def _time_plain(self) -> bool:
        """Whether the next step runs without hooks, its forward timed: while measuring for
        the advisor's plan on CUDA, once a measured step showed room for every saved tensor,
        and no such step was timed since ``new_epoch``."""
        device = self.measure_device
        return (self.config.plan == "auto" and self.measure_keeping and device is not None
                and hooks_idle(device) and self.plain_forward_s is None
                and not self.timing_plain)

    def _plain_step(self, index: int) -> Step:
        """A step that keeps every saved tensor as autograd does (``Step.plain_hooks``), its
        forward timed and its allocator peak read."""
        step = Step(self.owner, index, self.order, False)
        step.epoch = self.epoch
        self.timing_plain = step.dormant = step.stats.hooks_off = True
        step.device = device = self.measure_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step.timer = StepTimer(device)
        step.timer.begin()
        return step

    def failed(self, step: Step) -> None:
        """A step whose forward raised teaches nothing; where it was the plain step being
        timed, the next measured step is timed plainly instead."""
        if step.timed_plainly:
            self.timing_plain = False

    def _scales(self, step: Step) -> tuple[float, float, float]:
        """What a measured step's forward, backward and host's forward times are scaled by:
        the plain step's seconds over its own, at most 1, where both were timed, else 1; the
        host's windows, which leave the hooks out, 1 where the step's windows are the
        device's, and 0 on the CPU, whose windows are the host's already (the replay then
        leaves the host out)."""
        timer = step.timer if step.measure else None

        def scale(plain: float | None, measured: float) -> float:
            return min(1.0, plain / measured) if plain and measured > 0 else 1.0

        if timer is None:
            return 1.0, 1.0, 0.0
        return (scale(self.plain_forward_s, timer.forward_s()),
                scale(self.plain_backward_s, timer.backward_s()),
                1.0 if hooks_idle(timer.clock.device) else 0.0)

    def near_budget(self) -> bool:
        """On CUDA, whether the allocator's peak since the last step came near the plan's
        budget (read without waiting for the device; the peak starts again from here)."""
        device = self.checked.device
        if (device is None or device.type != "cuda" or self.config.plan != "auto"
                or self.plan is None or self.plan.budget_bytes is None):
            return False
        peak = peak_allocated_bytes(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak >= _NEAR_BUDGET * self.plan.budget_bytes


    def _use(self, plan: Plan) -> None:
        choice = self.planner.recomputation
        tables = []
        if choice is not None and choice.names:
            tables.append(mix.table(choice.mix, choice.workload))
        if self.owner.recomputer is not None and self.config.recompute != "off":
            tables.append(left_out_rows(self.owner.recomputer.left_out()))
        plan.recompute_table = "\n".join(table for table in tables if table)
        self.plan = self.unchecked = plan
        self.checked = None
        if plan.budget_bytes is not None:  # made for the configured one, less the tightenings
            self.budget_bytes = (plan.budget_bytes + self.planner.tightened
                                 - self.planner.loosened)
        moved = [d for d in plan.decisions.values() if d.decision != "keep"]
        if plan.budget_bytes is not None and (moved or not plan.fits):
            self._say_unwatched()
        budget = "none" if plan.budget_bytes is None else fmt_bytes(plan.budget_bytes)
        _log.info("cswap: planned to move %d of %d sites (%s); saved tensors on the device at "
                  "once: predicted %s, budget %s%s", len(moved), len(plan.decisions),
                  fmt_bytes(sum(d.nbytes for d in moved)), fmt_bytes(plan.predicted_peak),
                  budget, "" if plan.fits else " (does not fit)")
        host = ("" if self.config.host_budget is None else
                f" that host_budget={fmt_bytes(self.config.host_budget)} can hold")
        if choice is not None and not choice.mix.fits:
            self._say_over_budget(choice.mix.prediction.peak_bytes, (
                f"whatever it recomputes and moves{host}, the replay of the measured step "
                "predicts a peak of at least"))
        elif not plan.fits:
            beside = (f" ({fmt_bytes(plan.base_bytes)} of it what the step holds beside its "
                      "saved tensors)" if plan.base_bytes else "")
            self._say_over_budget(plan.predicted_peak + plan.base_bytes,
                                  f"whatever it moves{host}, the planner predicts a peak of",
                                  after=beside)


    def _checked_by(self, step: Step) -> None:
        """Later steps keep the sites ``step`` kept, and move those it moved, without tracking
        them; unless it moved some with a compressing codec, whose payloads' sizes drift
        with the data: then every moved site stays tracked (the host arena is planned from
        the rows of those steps)."""
        sites = step.stats.sites
        kept = frozenset(s.site for s in sites if s.decision == "keep") | step.same_bytes
        codecs = {s.site: get_codec(s.decision) for s in sites
                  if s.decision not in ("keep", "dedup")}
        moves = {}
        if all(codec.exact_size for codec in codecs.values()):
            moves = {s.site: Move(codecs[s.site], getattr(torch, s.dtype), s.nbytes,
                                  s.site in step.shared)
                     for s in sites if s.site in codecs and s.site not in self.held_elsewhere}
        self.checked = Checked(step.counted(), kept, moves, step.stats, step.device,
                                step.leaf_sites(), frozenset(step.same_bytes))


    def _other_graph(self, step: Step) -> bool:
        """Whether ``step`` ran another graph than the one measured: as many saved tensors, of
        the same sizes maybe, but with weights at other sites (two models under one shared
        ``offload(config)``). What was learned by position (the plan, the sites held
        elsewhere) is not its own. A step that ran a checked plan says so itself (another
        count is the next step's to handle, as for any plan)."""
        if step.checked is not None:
            return step.other_graph and len(step.counted()) == len(step.checked.counted)
        if not step.stats.sites:
            return False
        graph = (len(step.counted()), step.leaf_sites())
        known = self.graphs.setdefault(step.numbering, graph)
        return graph[0] == known[0] and graph[1] != known[1]


    def check(self, plan: Plan, stats: StepStats) -> None:
        """Measure the plan on the first step that ran it: the prediction, checked (and its
        payloads' sizes kept for the next plan, ``Profiler.payloads``). Where the
        plan was predicted to fit and the step's peak (on CUDA the allocator's, on the CPU the
        ledger's with what the plan counts beside it) passed the budget, the next plan is made
        for a budget that much tighter (three times at most)."""
        plan.measured_peak = stats.peak_resident_bytes
        plan.measured_allocated = stats.peak_allocated_bytes
        self.profiler.payloads(stats)
        _log.info("cswap: step %d ran the plan: saved tensors on the device at once: measured "
                  "%s, predicted %s%s", stats.step, fmt_bytes(plan.measured_peak),
                  fmt_bytes(plan.predicted_peak), "" if stats.peak_allocated_bytes is None
                  else f"; allocator's peak {fmt_bytes(stats.peak_allocated_bytes)}")
        peak = (stats.peak_allocated_bytes if stats.peak_allocated_bytes is not None
                else stats.peak_resident_bytes + plan.base_bytes)
        over = self.planner.over_budget(plan, peak)
        under = self.planner.over_predicted(plan, stats.peak_allocated_bytes)
        if over:
            self._tighten(over)
        elif under:
            _log.info("cswap: the allocator's peak came %s under the plan's prediction of it: "
                      "planning once for a budget that much looser", fmt_bytes(under))
            self._replan(self.planner.looser(under))
        elif self.planner.tightenings >= TIGHTENINGS and peak > (1 + OVER_BUDGET) * (
                self.budget_bytes or peak):
            self._say_over_budget(peak, (f"after {TIGHTENINGS} plans made tighter, step "
                                         f"{stats.step} measured a peak of"), measured=True)


    def _tighten(self, over: int) -> None:
        """Plan again for a budget ``over`` bytes tighter: choose the recomputed blocks again
        from the plain step replayed (no plain step is run again), and measure with them."""
        _log.info("cswap: the measured peak passed the budget by %s: planning for a budget "
                  "that much tighter", fmt_bytes(over))
        self._replan(self.planner.tighter(over))

    def _replan(self, choice: live.Recomputation | None) -> None:
        """Recompute the blocks of a choice made again, and measure with them."""
        if choice is not None and self.owner.recomputer is not None:
            self.owner.transfer.inflight_limit = self.planner.inflight_bytes
            self.owner.recompute(choice.names, choice.weights)
            self.measure_recomputed = bool(choice.names)
        self.new_epoch()


    def _plan_recompute(self, step: Step) -> bool:
        """Once, after the plain measured steps: the blocks to recompute, chosen by replaying
        the measured step under candidate mixes of keep, swap and recompute
        (``planning.planner``); True where some are, and the next steps measure again with
        them (the plan of the swaps is made for what those steps save)."""
        if (self.recompute_planned or self.config.recompute == "off"
                or self.owner.recomputer is None or not self.block_calls):
            return False
        self.recompute_planned = True
        left_out = self.owner.recomputer.left_out()
        started = time.perf_counter()
        choice = self.planner.choose_recompute(
            self._measured(step, [c for c in self.block_calls if c.name not in left_out]))
        if choice is None:
            return False
        _log.info("cswap: the planner replayed the measured step under its candidate mixes in "
                  "%.1f s: %s", time.perf_counter() - started, choice.mix.how)
        if self.planner.inflight_bytes != self.owner.transfer.inflight_limit:
            _log.info("cswap: up to %s in flight off the device (was %s): the replayed step "
                      "waits less and its memory with the copies in flight fits the budget",
                      fmt_bytes(self.planner.inflight_bytes),
                      fmt_bytes(self.owner.transfer.inflight_limit))
            self.owner.transfer.inflight_limit = self.planner.inflight_bytes
        if not choice.names:
            return False
        skipped = self.owner.recompute(choice.names, choice.weights)
        self.measure_recomputed = True
        _log.info("cswap: recomputing %d blocks (%s)%s; measuring again with them",
                  len(choice.names), choice.mix.how, f", skipped: {skipped}" if skipped else "")
        self.new_epoch()
        return True


    def say_once(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


    def _say_over_budget(self, peak: int, how: str, measured: bool = False,
                         after: str = "") -> None:
        """Warn (once) that the budget is not met: by how much, and what would fit."""
        budget = self.budget_bytes
        if budget is None or peak <= budget:
            return
        fits = (f"a budget of {fmt_bytes(peak)} or more would be met, as measured" if measured
                else f"a budget of about {fmt_bytes(peak)} or more would be met (predicted)")
        self.say_once("budget", (
            f"cswap: the budget of {fmt_bytes(budget)} is not met: {how} {fmt_bytes(peak)}"
            f"{after}, {fmt_bytes(peak - budget)} over it; {fits}. Raise the budget or lower "
            "the batch size. offloader.plan.table() shows the plan, and logging at INFO "
            "(logging.getLogger('cswap_lightning').setLevel('INFO')) the planner's decisions"))


    def _say_unwatched(self) -> None:
        """A plan that must move tensors to meet the budget, or cannot meet it, where no
        model is watched whose blocks could be recomputed instead."""
        cfg = self.config
        if self.owner.recomputer is None and cfg.recompute == "auto":
            self.say_once("unwatched", (
                f"cswap: budget={cfg.budget!r} with recompute='auto', but no model is "
                "watched, so no block can be recomputed to meet it (only moved): call "
                "offloader.watch(model) once before training (the Lightning strategies and "
                "CSwapCallback do), or set recompute='off'"))


    def _replanning(self) -> None:
        """The sites changed in number or kind (a data-dependent branch, several models under
        one Offloader): measure them and plan again, and say so once if it keeps happening."""
        self.replans += 1
        if self.replans == _REPLANS_BEFORE_WARNING:
            warnings.warn(
                f"cswap: the tensors saved under this Offloader changed {self.replans} times "
                "between steps (in number, dtype, dimensions or where the weights are), and "
                "each time they are measured again (profile_steps steps swapping raw). If "
                "several models share it, give each its own Offloader(config).",
                RuntimeWarning, stacklevel=7)
        self.new_epoch()


    def _outgrown(self, step: Step) -> None:
        """A step saved larger tensors than the plan was made for (a longer sequence, a
        larger batch): plan again for them from its rows (a step that ran a checked plan
        tracked those), without measuring again, with the link and codec times measured for
        the plan. A step whose tensors are of other kinds (count, dtypes, dimensions) is
        measured again."""
        if (len(step.counted()) != len(self.plan.signature)
                or not self.plan.same_kinds(step.stats.sites)):
            self._replanning()
            return
        self.profiler.observe(step.stats, {})
        self._use(self._advise(step, measure=False))


    def _advise(self, step: Step, measure: bool = True) -> Plan:
        """The planner's plan from what the profiler measured (``measure``: with the link and
        codec times measured now, else those of the latest plan)."""
        return self.planner.plan(self._measured(step), fresh=measure)


    def _measured(self, step: Step, calls: Iterable[BlockCall] = ()) -> Measured:
        """What the measured steps taught, for the planner: the sites found held elsewhere
        kept, with the blocks ``calls`` that may be recomputed, planned on ``step``."""
        profiles = [replace(p, offloadable=False, reason=HELD_ELSEWHERE)
                    if p.site in self.held_elsewhere else p for p in self.profiler.profile()]
        return Measured(profiles, list(calls), self.profiler.order or None, step.stats,
                        step.device, self.plain_peak if step.keeping else None,
                        self.profiler.together)



    def new_epoch(self) -> None:
        """Re-measure the next ``profile_steps`` steps (sparsity; with ``plan="auto"``, the
        windows too, then plan again), and which sites' moving frees nothing."""
        self.profiler = Profiler()
        self.measure_left = self.config.profile_steps
        self.measure_keeping = self.measured_keeping = False
        self.plain_forward_s = self.plain_backward_s = self.plain_host_forward_s = None
        self.plain_peak = None
        self.timing_plain = False  # one that failed is owed nothing; a late one is ignored
        self.held_elsewhere = set()
        self.checked = None
        self.graphs = {}
        self.epoch += 1


    def state_dict(self) -> dict:
        """What was learned (plan, backward order), JSON-able, for checkpoints."""
        return {
            "version": 1,
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "order": self.order,
            "reverted": sorted(self.owner.reverted),
        }


    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; the plan applies from the next step.

        Everything is checked before anything is taken: bad state raises ``ValueError``."""
        if not isinstance(state, dict) or state.get("version") != 1:
            version = state.get("version") if isinstance(state, dict) else state
            raise ValueError(f"unknown cswap state version {version!r}; expected 1")
        plan = Plan.from_dict(state["plan"]) if state.get("plan") is not None else None
        order = state.get("order")
        if order is not None and not _site_list(order):
            raise ValueError(f"cswap state 'order' must be None or a list of site numbers "
                             f"(ints >= 0), got {order!r}")
        reverted = state.get("reverted", [])
        if not _site_list(reverted):
            raise ValueError(f"cswap state 'reverted' must be a list of site numbers (ints "
                             f">= 0), got {reverted!r}")
        self.plan, self.order, self.owner.reverted = plan, order, set(reverted)
        self.unchecked, self.checked = plan, None
        if self.plan is not None:
            self.measure_left = 0


    def recomputed(self, blocks: tuple[str, ...]) -> Recomputed:
        """The blocks a step recomputes, with what the latest step that ran them plainly
        measured: its keep-all, and their forward's time (spent again in backward)."""
        plain = self.plain_stats
        if plain is None:
            return Recomputed(blocks)
        forward_s = sum(call.forward_s for call in self.block_calls if call.name in blocks)
        return Recomputed(blocks, plain.step, plain.keep_all_bytes, forward_s)


def _scaled(call: BlockCall, scale: float) -> BlockCall:
    """A measured block call with its forward scaled to a plain step's (``scale``). Its
    recomputation below the layer keeps what it measured: it runs under dispatch modes as the
    measured step did (on an H100 host-bound alike: Llama-3-8B's layers took 1.86x the plain
    step below the layer, 1.28x recomputed whole), and its forward under them runs longer
    than a plain one by what the scale takes off."""
    return replace(call, forward_s=call.forward_s * scale,
                   below=tuple(replace(way, seconds=way.seconds + call.forward_s * (1 - scale))
                               for way in call.below))


def hooks_idle(device: torch.device) -> bool:
    """Whether a step with hooks leaves ``device`` idle between its kernels, so that its
    times are the host's: a GPU's (on the CPU the host's time is the step's)."""
    return device.type == "cuda"


def _site_list(value: object) -> bool:
    return isinstance(value, list) and all(
        type(v) is int and v >= 0 for v in value)
