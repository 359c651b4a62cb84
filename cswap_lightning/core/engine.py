"""The offload session: one ``Offloader`` per training loop, entered around each forward.

It owns what lasts across steps (the plan, backward's order of sites, what the profiler
measured, the sites whose moving freed nothing) and hands each step to a ``Step``
(``step.py``), whose hooks do the per-tensor work.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from fnmatch import fnmatch

import torch
from typing_extensions import Self

from ..codecs import get_codec
from ..codecs.cuda import enable_cuda_codecs_if_requested
from ..codecs.lossy import LOSSY_DTYPES as _LOSSY_TORCH_DTYPES
from ..codecs.lossy import seed_of
from ..config import LOSSY_CODECS, CSwapConfig, as_config
from ..planning import live, mix
from ..planning.advisor import HELD_ELSEWHERE, FixedPlan, Plan
from ..planning.planner import OVER_BUDGET, TIGHTENINGS, Measured, Planner, room_to_keep
from ..planning.predictor import CodecTimeModel
from ..planning.profiler import Link, Profiler
from .module_names import ModuleTracker
from .recompute import BlockCall, BlockTimer, Recompute, left_out_rows, top_hooks
from .stats import Recomputed, SiteStats, StepStats, fmt_bytes
from .step import Checked, Move, Probe, Step, hide_from_dynamo
from .transfer import Transfer

LOSSY_DTYPES = tuple(str(d).removeprefix("torch.") for d in _LOSSY_TORCH_DTYPES)
# Re-measuring because the saved tensors changed this many times says something is off.
_REPLANS_BEFORE_WARNING = 3
# A run whose steps run without hooks is measured again once the allocator's peak of a step
# comes this close to the plan's budget.
_NEAR_BUDGET = 0.95
# On the CPU, where no allocator says so, steps run without hooks only if the checking step
# held at most this fraction of the budget.
_CPU_HEADROOM = 0.5
# Steps without hooks see nothing of what they save: at least one step in this many runs with
# them, counting, so that a graph that changed (another model entered from the same loop) is
# seen.
DORMANT_STEPS = 20
_log = logging.getLogger(__name__)


class Offloader:
    """Offloads autograd's saved tensors during each ``with`` block (one training step).

    Create it once and enter it around every forward pass; what it learns on one step
    (per-site sparsity, the order backward needs tensors in) plans the next. With
    ``plan="auto"`` the first ``profile_steps`` steps are measured, then the advisor plans
    every site; call :meth:`new_epoch` at each epoch start to re-measure (sparsity drifts
    during training), under the plan already made. The first measured step swaps every site
    raw: nothing says yet whether the step fits the budget, and one that does not must not
    run out of memory. Once a measured step shows that the budget holds every saved tensor,
    the remaining measured steps move nothing::

        offloader = Offloader(CSwapConfig())
        for batch in loader:
            with offloader:
                loss = model(batch)
            loss.backward()
        print(offloader.last_step().table())

    Entering it again inside its own block continues the same step (the blocks nest, as
    PyTorch's saved-tensor hooks do). One thread uses it at a time.
    """

    def __init__(self, config: CSwapConfig | None = None, *, link: Link | None = None,
                 time_model: CodecTimeModel | None = None) -> None:
        """``link`` and ``time_model`` replace the measured bandwidths and the calibrated codec
        times the advisor uses (e.g. to plan for a link other than the one measured)."""
        enable_cuda_codecs_if_requested()
        self.config = as_config(config, "Offloader")
        self.planner = Planner(self.config, link, time_model,
                               lambda p: self.lossy_allowed(p.site, p.dtype, p.module))
        self.transfer = Transfer(pin_memory=self.config.pin_memory,
                                 inflight_bytes=self.planner.inflight_bytes)
        self._plan: Plan | None = None  # the planner's, for plan="auto"
        self._unchecked: Plan | None = None  # a plan no step has run yet
        self.profiler = Profiler()
        self._measure_left = self.config.profile_steps
        # Measured steps keep every saved tensor where the device has room for them (CUDA):
        # their times have no copies in them and their allocator peak is keeping all's.
        self._measure_keeping = self._measured_keeping = False
        self._order: list[int] | None = None  # backward's order of sites, learned
        self.modules: ModuleTracker | None = None  # names sites by module, after watch()
        # the watched model's blocks run recomputed, after watch(); and each block call of
        # the latest measured step finished (what it saved, its forward's time)
        self.recomputer: Recompute | None = None
        self.block_calls: list[BlockCall] = []
        self._plain_stats: StepStats | None = None  # the step block_calls come from
        # the planner chooses the blocks to recompute once, from the plain measured steps
        self._recompute_planned = False
        self._measure_recomputed = False  # measured steps run the planner's choice
        self.budget_bytes: int | None = None  # the budget as configured, once planned for
        # Backward runs inside the block by design (Lightning's manual optimisation): not
        # a misplaced block (_say_misplaced). Each warning below is given once.
        self.backward_inside = False
        self._said: set[str] = set()
        self._numbering: frozenset[str] = frozenset()  # the blocks the last step recomputed
        self.reverted: set[int] = set()  # lossy sites the accuracy guard moved back
        self.held_elsewhere: set[int] = set()  # sites whose moving freed nothing (measured)
        self._next_probe: Probe | None = None  # the next step's, from probe_next_step()
        # The lossy codecs' rounding: seeded by torch's seed when the Offloader is built, the
        # count of training steps (a guard's probe rounds as the training step after it) and
        # the site, so a run rounds the same way whatever ran before it in the process.
        self.seed = seed_of(torch.initial_seed(), torch.initial_seed() >> 32)
        self._trained = 0  # training steps (not probes) entered
        self._latest_trained: Step | None = None
        # Later steps keep the sites a checked plan kept untracked, and measure again (or, for
        # a fixed plan, track again) if what they save changes.
        self._checked: Checked | None = None
        self._steps_alive: weakref.WeakSet[Step] = weakref.WeakSet()  # autograd holds them
        self._step: Step | None = None
        # Closed steps whose figures the device still owes, with the events after their work.
        self._closing: deque[tuple[Step, list[torch.cuda.Event]]] = deque()
        self._epoch = 0  # new_epoch() calls: a step measured before one says nothing after
        # nested blocks' hooks (None: a step without hooks)
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        self._owner: int | None = None  # the thread inside the block
        # where the latest step was entered from (code, line), and the steps without hooks in
        # a row since one with them
        self._entered_from: tuple | None = None
        self._dormant = 0
        self._steps = 0
        self._replans = 0
        # The count of saved tensors and the sites of weights among them of the graph measured
        # since new_epoch() (its first tracked step's), per numbering of the sites (recomputed
        # blocks save other tensors): a step of the same count with weights elsewhere is
        # another model's (_other_graph).
        self._graphs: dict[frozenset[str], tuple[int, frozenset[int]]] = {}
        self._warned_compiled = False
        self._closed = False
        self._registry: dict[CSwapConfig, Offloader] | None = None  # offload()'s, if from it

    def __enter__(self) -> Self:
        if self._closed:
            raise RuntimeError("this Offloader was closed; create a new one (or call "
                               "cswap_lightning.offload(config) again for the shared one)")
        if self.config.lossy_exclude and self.modules is None and self.config.lossy_possible:
            raise ValueError(
                f"cswap: lossy_exclude={self.config.lossy_exclude!r} names modules, but this "
                "Offloader was given no model to name them in, so every site could be "
                "compressed lossily: call offloader.watch(model) before the first step (the "
                "Lightning strategies and the Hugging Face callback do), or drop lossy_exclude")
        if self._hooks and self._owner != threading.get_ident():
            raise RuntimeError(
                "this Offloader is in use by another thread; give each thread its own "
                "Offloader (cswap_lightning.offload(config) gives each thread its own)")
        if self._hooks:  # nested: the same step goes on
            self._push_hooks(self._step)
            return self
        self._close_step()
        self._drop_unfit()
        if self._checked is not None and self._checked.moves_nothing and self._near_budget():
            _log.info("cswap: the allocator's peak neared the budget on a step without hooks: "
                      "measuring again")
            self.new_epoch()
        # closed steps whose measurements are still to be read count as measured
        measure = self._measure_left > sum(step.measure for step, _ in self._closing)
        checked = (self._checked if not measure and self._next_probe is None
                   and self._unchecked is None else None)
        limits = (self._plan.site_bytes if checked is not None and self.config.plan == "auto"
                  else None)
        step = Step(self, self._steps, self._order, measure, checked, limits)
        step.epoch = self._epoch
        if self.config.plan == "auto":
            step.stats.budget_bytes = self.budget_bytes
        step.keeping = measure and self._measure_keeping
        caller = sys._getframe(1)
        entered_from, self._entered_from = self._entered_from, (caller.f_code, caller.f_lineno)
        if (checked is not None and checked.moves_nothing and self._watched(checked)
                and self._same_graph(entered_from)):
            step.dormant = step.stats.hooks_off = True
            step.device = checked.device
        self._dormant = self._dormant + 1 if step.dormant else 0
        self._push_hooks(step)  # raises where saved-tensor hooks are disabled: nothing changed
        step.probe, self._next_probe = self._next_probe, None
        step.seed = seed_of(self.seed, self._trained)
        if step.probe is None:
            self._trained += 1
            self._latest_trained = step
        self._step, self._owner = step, threading.get_ident()
        self._steps_alive.add(step)
        self._steps += 1
        self._arm_recompute(step)
        if self.modules is not None:
            self.modules.__enter__()
        return self

    @property
    def link(self) -> Link | None:
        """The link's bandwidths the planner uses in place of measuring them (None: measured)."""
        return self.planner.link

    @link.setter
    def link(self, link: Link | None) -> None:
        self.planner.link = link

    @property
    def recomputation(self) -> live.Recomputation | None:
        """The planner's choice of blocks to recompute, and the replayed step it was made on."""
        return self.planner.recomputation

    def _push_hooks(self, step: Step) -> None:
        if step.dormant:
            self._hooks.append(None)
            return
        hide_from_dynamo()
        hooks = torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._hooks or self._owner != threading.get_ident():
            raise RuntimeError("this Offloader's block was left without being entered (in "
                               "this thread); use it as `with offloader: ...`")
        hooks = self._hooks.pop()
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)
        if self._hooks:
            return
        self._owner = None
        if self.modules is not None:
            self.modules.__exit__(exc_type, exc, tb)
        self._disarm_recompute(self._step)
        self._step.end_forward()
        self._step.failed = exc_type is not None
        if exc_type is None:
            self._say_misplaced(self._step)

    def watch(self, model: torch.nn.Module) -> Self:
        """Train ``model`` under this Offloader: its blocks can then be recomputed
        (:meth:`recompute`; it is held weakly), and with ``lossy_exclude`` patterns each site
        is named by the module that saved it. The global module hooks naming takes slow every
        module call in the process (1.2x on a small model's forward on the CPU) until
        :meth:`close`; without patterns none are taken."""
        if self.modules is not None:
            self.modules.close()
            self.modules = None
        if self.config.lossy_exclude:
            self.modules = ModuleTracker(model)
        if self.recomputer is None or self.recomputer.model is not model:
            if self.recomputer is not None:
                self.recomputer.release()
            self.recomputer = Recompute(model)
            self._checked = None  # a new model: the next step tracks and checks the plan
        return self

    def recompute(self, names: Iterable[str]) -> dict[str, str]:
        """Run these blocks of the watched model (names from ``recomputer.units()``: a layer's
        or an activation module's qualified name, ``"features[0:5]"`` for a stage of an
        ``nn.Sequential``) under checkpoint from the next step on, and no others; the
        planner's call. Measured steps run them plainly and time every block
        (``block_calls``; ``recompute.renumbered`` says where their sites go). Returns the
        blocks skipped, with why (checkpointed by the model itself, measured changing an
        input in place, inside another block chosen). A changed set makes the next step
        check the plan again: the step saves other tensors.

        Raises ``ValueError`` with ``recompute="off"`` (for any block), for a block the model
        does not have, or without a watched model; ``RuntimeError`` during a forward."""
        if isinstance(names, str):
            raise TypeError(f"recompute takes a collection of block names, got the string "
                            f"{names!r}; write recompute([{names!r}])")
        names = list(names)
        if names and self.config.recompute == "off":
            raise ValueError(f"cswap: CSwapConfig.recompute is 'off', so no block is "
                             f"recomputed (asked for {names}); set recompute='auto' to allow it")
        if self._hooks:
            raise RuntimeError("cswap: change the recomputed blocks between steps, not inside "
                               "the Offloader's block")
        if self.recomputer is None:
            if not names:
                return {}
            raise ValueError("cswap: no model to recompute blocks of: call "
                             "Offloader.watch(model) first (the integrations do)")
        before = set(self.recomputer.chosen)
        skipped = self.recomputer.choose(names)
        if set(self.recomputer.chosen) != before:
            self._checked, self._unchecked = None, self._plan
        return skipped

    @property
    def recomputed(self) -> frozenset[str]:
        """The blocks in force: recomputed on every step that is not measured."""
        return frozenset(self.recomputer.chosen if self.recomputer is not None else ())

    def _arm_recompute(self, step: Step) -> None:
        """After the step's hooks are in place: recompute the chosen blocks on a step that is
        not measured; on a measured one, time each block (``block_calls``). Recomputed blocks
        save other tensors, so the steps number their sites otherwise: which sites are held
        elsewhere is measured again when the numbering changes."""
        recomputer = self.recomputer
        if recomputer is None or self.config.recompute == "off":
            return
        # Measured steps run plainly, timing each block, until the planner has chosen; then
        # they run its choice, which the plan after them is made for.
        armed = not step.measure or self._measure_recomputed
        numbering = step.numbering = frozenset(recomputer.chosen) if armed else frozenset()
        if numbering != self._numbering:  # other sites: what was measured of them is not theirs
            self.held_elsewhere = set()
            self._numbering = numbering
        if armed:
            tracked = step.checked is None and not step.dormant
            recomputer.arm(step.residency if tracked else None)  # what they hold, measured
            if recomputer.chosen:
                step.stats.recomputed = self._recomputed(tuple(sorted(recomputer.chosen)))
        elif recomputer.model is not None:
            step.blocks = BlockTimer(recomputer, lambda: len(step.sizes))

    def _drop_unfit(self) -> None:
        """Run plainly from now on the chosen blocks found unfit since they were chosen (by
        a measured step, or for hooks added inside them), and say so."""
        recomputer = self.recomputer
        unfit = recomputer.unfit_chosen() if recomputer is not None else {}
        if not unfit:
            return
        warnings.warn(f"cswap: no longer recomputing {', '.join(map(repr, unfit))}: "
                      + "; ".join(f"{name} {why}" for name, why in unfit.items()),
                      RuntimeWarning, stacklevel=3)
        self.recompute([name for name in recomputer.chosen if name not in unfit])

    def _recomputed(self, blocks: tuple[str, ...]) -> Recomputed:
        """The blocks a step recomputes, with what the latest step that ran them plainly
        measured: its keep-all, and their forward's time (spent again in backward)."""
        plain = self._plain_stats
        if plain is None:
            return Recomputed(blocks)
        forward_s = sum(call.forward_s for call in self.block_calls if call.name in blocks)
        return Recomputed(blocks, plain.step, plain.keep_all_bytes, forward_s)

    def _disarm_recompute(self, step: Step) -> None:
        if self.recomputer is not None:
            self.recomputer.disarm()
        if step.blocks is not None:
            step.blocks.remove()

    def codec_for(self, site: int, stats: SiteStats) -> str:
        """The plan's decision for a site: a codec name or ``"keep"``."""
        if site in self.held_elsewhere:
            stats.reason = "held elsewhere"
            return "keep"
        if self._step.keeping:  # a measured step with room to keep them all (room_to_keep)
            return "keep"
        if self.config.plan != "auto":
            codec = self.config.plan
        elif self._plan is None:
            codec = "raw"  # not profiled yet: swap uncompressed
        else:
            codec = self._plan.codec(site, stats.shape, stats.dtype)
        if codec in LOSSY_CODECS and not self._lossy_ok(codec, site, stats):
            return "raw"
        return codec

    def _lossy_ok(self, codec: str, site: int, stats: SiteStats) -> bool:
        """The config always wins: a lossy codec only where it names that codec (a loaded
        plan cannot bring one in); on a guard's probe, only where the probe says."""
        cfg, probe = self.config, self._step.probe
        named = codec in (cfg.plan, cfg.lossy) or (cfg.lossy == "auto" and codec == "int8")
        return (named and (probe is None or probe.lossy and (probe.sites is None
                                                             or site in probe.sites))
                and self.lossy_allowed(site, stats.dtype, stats.module))

    def lossy_sites(self) -> frozenset[int] | None:
        """The sites the latest training step (not a guard's probe) compressed lossily, as
        the step that checked its plan tracked them; None before any training step."""
        step = self._latest_trained
        if step is None:
            return None
        stats = step.checked.stats if step.checked is not None else step.stats
        return frozenset(s.site for s in stats.sites if s.decision in LOSSY_CODECS)

    def prefetch_window(self) -> int | None:
        """Bytes backward may bring back ahead of use: ``prefetch_bytes`` (for ``"auto"``, what
        hides the link measured for the plan), or less where the plan needed a smaller window
        to fit its budget; None where nothing is measured yet, for the step to choose
        (``prefetch.resident_window``: two of its largest moved tensors but the largest)."""
        window = self.config.prefetch_bytes
        if window == "auto":
            window = self._plan.prefetch_bytes if self._plan is not None else None
        elif self._plan is not None and self.config.plan == "auto":
            window = min(window, self._plan.prefetch_bytes)
        return window

    def probe_next_step(self, kind: str, sites: Iterable[int] | None = None,
                        restored: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
                        ) -> Self:
        """Make the next step an accuracy guard's probe: ``"lossless"`` swaps lossy sites raw
        instead; ``"measure errors"`` keeps the lossy ``sites`` (None: all) lossy, swaps the
        others raw, measures each one's round-trip error (its row's ``error``) and hands its
        original and restored tensors to ``restored(site, original, restored)``. A probe
        rounds as the next training step will, and runs no checked plan."""
        if kind not in ("lossless", "measure errors"):
            raise ValueError(f"probe kind must be 'lossless' or 'measure errors', got {kind!r}")
        self._next_probe = Probe(kind == "measure errors",
                                 None if sites is None else frozenset(sites), restored)
        return self

    def lossy_allowed(self, site: int, dtype: str, module: str) -> bool:
        """Floating tensors only, outside excluded modules, unless the guard moved them back."""
        return (dtype in LOSSY_DTYPES and site not in self.reverted
                and not any(fnmatch(module, p) for p in self.config.lossy_exclude))

    def revert(self, sites: Iterable[int]) -> None:
        """Move these lossy sites back to lossless from the next step on (the accuracy
        guard's call); a checked plan is checked again with them."""
        self.reverted.update(sites)
        self._checked, self._unchecked = None, self._plan

    def new_epoch(self) -> None:
        """Re-measure the next ``profile_steps`` steps (sparsity; with ``plan="auto"``, the
        windows too, then plan again), and which sites' moving frees nothing."""
        self.profiler = Profiler()
        self._measure_left = self.config.profile_steps
        self._measure_keeping = self._measured_keeping = False
        self.held_elsewhere = set()
        self._checked = None
        self._graphs = {}
        self._epoch += 1

    def state_dict(self) -> dict:
        """What was learned (plan, backward order), JSON-able, for checkpoints."""
        return {
            "version": 1,
            "plan": self._plan.as_dict() if self._plan is not None else None,
            "order": self._order,
            "reverted": sorted(self.reverted),
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
        self._plan, self._order, self.reverted = plan, order, set(reverted)
        self._unchecked, self._checked = plan, None
        if self._plan is not None:
            self._measure_left = 0

    def last_step(self, device: bool = True) -> StepStats:
        """Statistics of the most recent step, once its offload work has finished.

        ``device=False`` waits for the host side only, never synchronising with the device
        (for trainers that log every step): sizes, decisions and waits are final, but
        sparsities and the allocator's peak may still be missing.
        """
        if self._step is None:
            raise RuntimeError("no step has run yet: enter the Offloader around a forward pass")
        self.transfer.drain(device=device)
        self._step.residency.fold()
        if device:
            self._step.close()
        self._step.stats.host_held_bytes = self.transfer.held_bytes()
        return self._step.stats

    @property
    def plan(self) -> Plan | FixedPlan | None:
        """The plan the steps run: the advisor's for ``plan="auto"`` (None until made); for
        a fixed plan (``"raw"``, ``"zvc"``, ...), what the last step that tracked every site
        did with each (None before any step). Either way ``.table()`` shows it."""
        if self.config.plan == "auto":
            return self._plan
        return None if self._step is None else FixedPlan(self.config.plan, self.tracked_step())

    def tracked_step(self, device: bool = True) -> StepStats:
        """Statistics of the most recent step that tracked every site (a row per saved
        tensor, the measured memory curve): the last step, or, where it ran a checked plan
        without tracking each site, the step that checked the plan."""
        last = self.last_step(device)
        checked = self._step.checked
        return last if checked is None else checked.stats

    def live_host_bytes(self) -> int:
        """Host bytes held for tensors autograd still references (once the compressions
        under way, which hold their tensors, are done)."""
        self.transfer.drain(device=False)
        return sum(entry.stored_bytes for step in list(self._steps_alive)
                   for entry in step.live_entries())

    def live_entries(self) -> int:
        """Storages moved off the device that autograd still references (once the
        compressions under way are done)."""
        self.transfer.drain(device=False)
        return sum(len(step.live_entries()) for step in list(self._steps_alive))

    def close(self) -> None:
        """Finish the background work and free the host arena. Backward of a step already
        run still works; entering the Offloader again does not."""
        self._closed = True
        self._finish_closed(wait=True)
        self.transfer.close()
        if self.modules is not None:
            self.modules.close()
        if self.recomputer is not None:
            self.recomputer.release()
        if self._registry is not None and self._registry.get(self.config) is self:
            del self._registry[self.config]

    def _close_step(self) -> None:
        """Close the step that ran last: at once where its figures are known on the host (a
        step that ran a checked plan), else once the device is past its work, which each
        later step's start checks without waiting: a measured step's sparsities and windows,
        the lengths of compressed payloads the arena is planned from, the allocator's peak
        of a step that outgrew its plan. Forward never waits for the device here."""
        step = self._step
        if step is None or step.closed:
            return
        step.closed = True
        step.residency.fold()
        if step.dormant or step.failed:
            return
        owed = step.device is not None and (step.measure or step.checked is None
                                            or step.stats.resized)
        self._closing.append((step, self.transfer.marks(step.device) if owed else []))
        self._finish_closed(wait=False)

    def _finish_closed(self, wait: bool) -> None:
        """Finish the closed steps whose device work is done, oldest first (``wait``: all)."""
        while self._closing:
            step, marks = self._closing[0]
            if not wait and not all(event.query() for event in marks):
                return
            for event in marks:
                event.synchronize()  # done already, unless waiting
            self._closing.popleft()
            self._finish(step)

    def _finish(self, step: Step) -> None:
        """What a closed step teaches: the plan it checked, backward's order, its
        measurements (a plan from them), the host arena planned from its payloads."""
        if step.device is not None:
            self.transfer.poll()  # its compressed payloads settled
            step.close()
        if step.blocks is not None:
            self.block_calls = step.blocks.calls()
            self._plain_stats = step.stats
        if not step.sizes:  # it saved nothing: it says nothing of the graph
            return
        if step.epoch == self._epoch and self._other_graph(step):
            self._plan = self._unchecked = None  # made by position for the other graph
            self._replanning()
            return
        auto = self.config.plan == "auto"
        if step.checked is not None:
            if step.stats.resized:  # it saved other sizes than the checking step
                if auto and not self._plan.covers(step.counted()):
                    self._outgrown(step)  # its larger tensors were tracked
                    return
                if not auto:  # the next step tracks every site, and checks the plan again
                    self._checked = None
            elif step.idle:
                return
        elif (self._unchecked is not None and step.probe is None
              and self._unchecked.covers(step.counted())):
            self._check(self._unchecked, step.stats)
            self._checked_by(step)
        elif (not step.measure and step.probe is None and step.stats.sites and (
                not auto or (self._plan is not None and self._plan.covers(step.counted())))):
            self._checked_by(step)
        self._unchecked = None
        if step.checked is None:  # steps running a checked plan see only some first unpacks
            self._order = step.unpack_order or self._order
        if not self._warned_compiled and step.restored_all_at_once():
            self._warned_compiled = True
            warnings.warn(
                f"cswap: backward asked for {fmt_bytes(step.region_peak)} of the "
                f"{fmt_bytes(step.moved_bytes())} moved off the device at once, as the backward "
                "of a torch.compile'd region does (pytorch/pytorch#148222), so offloading "
                "lowered little at the peak. Compile per block instead of the whole model: "
                "cswap_lightning.compile_blocks(model).", RuntimeWarning, stacklevel=5)
        # plans the host arena from it, where it tracked every site it moved
        self.transfer.step_closed(step.stats, step.device, plan=not step.untracked_moves)
        if step.epoch != self._epoch:  # measured before new_epoch(): says nothing now
            return
        if step.measure and step.device is not None:
            self._measure_left -= 1
        if self.config.plan != "auto" or step.device is None:
            return
        if step.measure:
            timer = step.timer
            self.profiler.observe(step.stats, timer.windows() if timer else {},
                                  timer.unpack_order() if timer else None)
            self._measured_keeping |= step.keeping
            if not self._measure_keeping:
                self._measure_keeping = room_to_keep(step.stats, step.device)
            if self._measure_left == 0 and self._measure_keeping and not self._measured_keeping:
                self._measure_left = 1  # one more, keeping every tensor, then the plan
                return
            if self._measure_left == 0:
                if not self._plan_recompute(step):
                    self._use(self._advise(step))
            elif self._plan is None:
                plan = self._advise(step)
                if plan.fits and all(d.decision == "keep" for d in plan.decisions.values()):
                    self._use(plan)  # nothing needs to move: the next measured steps keep all
        elif (step.checked is None and self._plan is not None
              and not self._plan.covers(step.counted())):
            self._outgrown(step)

    def _watched(self, checked: Checked) -> bool:
        """Whether steps may run without hooks (autograd keeps every saved tensor) under a
        checked plan that moves nothing: never under a forced plan other than ``"keep"`` (it
        moves what it can: a step that found nothing to move says nothing of the next graph);
        under the advisor's, on CUDA, where the allocator's peak says when a step nears the
        budget (a longer batch, say); on the CPU, where nothing does, only if the checking step
        held at most half the budget; always where no budget applies."""
        plan = self._plan
        if self.config.plan != "auto":
            return self.config.plan == "keep"
        if plan is None or plan.budget_bytes is None:
            return True
        if checked.device is not None and checked.device.type == "cuda":
            return True
        return checked.stats.peak_resident_bytes <= _CPU_HEADROOM * plan.budget_bytes

    def _same_graph(self, entered_from: tuple | None) -> bool:
        """Whether a step without hooks would run the graph the plan was checked on, as far as
        can be seen without hooks: entered from where the step before it was (a new graph
        comes from other code), not inside saved-tensor hooks of the user's (which would take
        its tensors), and not the ``DORMANT_STEPS``-th step in a row without hooks."""
        return (entered_from == self._entered_from and top_hooks() is None
                and self._dormant < DORMANT_STEPS - 1)

    def _near_budget(self) -> bool:
        """On CUDA, whether the allocator's peak since the last step came near the plan's
        budget (read without waiting for the device; the peak starts again from here)."""
        device = self._checked.device
        if (device is None or device.type != "cuda" or self.config.plan != "auto"
                or self._plan is None or self._plan.budget_bytes is None):
            return False
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak >= _NEAR_BUDGET * self._plan.budget_bytes

    def _use(self, plan: Plan) -> None:
        choice = self.recomputation
        tables = []
        if choice is not None and choice.names:
            tables.append(mix.table(choice.mix, choice.workload))
        if self.recomputer is not None and self.config.recompute != "off":
            tables.append(left_out_rows(self.recomputer.left_out()))
        plan.recompute_table = "\n".join(table for table in tables if table)
        self._plan = self._unchecked = plan
        self._checked = None
        if plan.budget_bytes is not None:  # made for the configured one, less the tightenings
            self.budget_bytes = plan.budget_bytes + self.planner.tightened
        moved = [d for d in plan.decisions.values() if d.decision != "keep"]
        if plan.budget_bytes is not None and (moved or not plan.fits):
            self._say_unwatched()
        budget = "none" if plan.budget_bytes is None else fmt_bytes(plan.budget_bytes)
        _log.info("cswap: planned to move %d of %d sites (%s); saved tensors on the device at "
                  "once: predicted %s, budget %s%s", len(moved), len(plan.decisions),
                  fmt_bytes(sum(d.nbytes for d in moved)), fmt_bytes(plan.predicted_peak),
                  budget, "" if plan.fits else " (does not fit)")
        if choice is not None and not choice.mix.fits:
            self._say_over_budget(choice.mix.prediction.peak_bytes, (
                "whatever it recomputes and moves, the replay of the measured step predicts "
                "a peak of at least"))
        elif not plan.fits:
            beside = (f" ({fmt_bytes(plan.base_bytes)} of it what the step holds beside its "
                      "saved tensors)" if plan.base_bytes else "")
            self._say_over_budget(plan.predicted_peak + plan.base_bytes,
                                  "whatever it moves, the planner predicts a peak of",
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
        self._checked = Checked(step.counted(), kept, moves, step.stats, step.device,
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
        known = self._graphs.setdefault(step.numbering, graph)
        return graph[0] == known[0] and graph[1] != known[1]

    def _check(self, plan: Plan, stats: StepStats) -> None:
        """Measure the plan on the first step that ran it: the prediction, checked. Where the
        plan was predicted to fit and the step's peak (on CUDA the allocator's, on the CPU the
        ledger's with what the plan counts beside it) passed the budget, the next plan is made
        for a budget that much tighter (three times at most)."""
        plan.measured_peak = stats.peak_resident_bytes
        plan.measured_allocated = stats.peak_allocated_bytes
        _log.info("cswap: step %d ran the plan: saved tensors on the device at once: measured "
                  "%s, predicted %s%s", stats.step, fmt_bytes(plan.measured_peak),
                  fmt_bytes(plan.predicted_peak), "" if stats.peak_allocated_bytes is None
                  else f"; allocator's peak {fmt_bytes(stats.peak_allocated_bytes)}")
        peak = (stats.peak_allocated_bytes if stats.peak_allocated_bytes is not None
                else stats.peak_resident_bytes + plan.base_bytes)
        over = self.planner.over_budget(plan, peak)
        if over:
            self._tighten(over)
        elif self.planner.tightenings >= TIGHTENINGS and peak > (1 + OVER_BUDGET) * (
                self.budget_bytes or peak):
            self._say_over_budget(peak, (f"after {TIGHTENINGS} plans made tighter, step "
                                         f"{stats.step} measured a peak of"), measured=True)

    def _tighten(self, over: int) -> None:
        """Plan again for a budget ``over`` bytes tighter: choose the recomputed blocks again
        from the plain step replayed (no plain step is run again), and measure with them."""
        _log.info("cswap: the measured peak passed the budget by %s: planning for a budget "
                  "that much tighter", fmt_bytes(over))
        choice = self.planner.tighter(over)
        if choice is not None and self.recomputer is not None:
            self.transfer.inflight_limit = self.planner.inflight_bytes
            self.recompute(choice.names)
            self._measure_recomputed = bool(choice.names)
        self.new_epoch()

    def _plan_recompute(self, step: Step) -> bool:
        """Once, after the plain measured steps: the blocks to recompute, chosen by replaying
        the measured step under candidate mixes of keep, swap and recompute
        (``planning.planner``); True where some are, and the next steps measure again with
        them (the plan of the swaps is made for what those steps save)."""
        if (self._recompute_planned or self.config.recompute == "off"
                or self.recomputer is None or not self.block_calls):
            return False
        self._recompute_planned = True
        left_out = self.recomputer.left_out()
        started = time.perf_counter()
        choice = self.planner.choose_recompute(
            self._measured(step, [c for c in self.block_calls if c.name not in left_out]))
        if choice is None:
            return False
        _log.info("cswap: the planner replayed the measured step under its candidate mixes in "
                  "%.1f s: %s", time.perf_counter() - started, choice.mix.how)
        if self.planner.inflight_bytes != self.transfer.inflight_limit:
            _log.info("cswap: up to %s in flight off the device (was %s): the replayed step "
                      "waits less and its memory with the copies in flight fits the budget",
                      fmt_bytes(self.planner.inflight_bytes),
                      fmt_bytes(self.transfer.inflight_limit))
            self.transfer.inflight_limit = self.planner.inflight_bytes
        if not choice.names:
            return False
        skipped = self.recompute(choice.names)
        self._measure_recomputed = True
        _log.info("cswap: recomputing %d blocks (%s)%s; measuring again with them",
                  len(choice.names), choice.mix.how, f", skipped: {skipped}" if skipped else "")
        self.new_epoch()
        return True

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _say_over_budget(self, peak: int, how: str, measured: bool = False,
                         after: str = "") -> None:
        """Warn (once) that the budget is not met: by how much, and what would fit."""
        budget = self.budget_bytes
        if budget is None or peak <= budget:
            return
        fits = (f"a budget of {fmt_bytes(peak)} or more would be met, as measured" if measured
                else f"a budget of about {fmt_bytes(peak)} or more would be met (predicted)")
        self._say_once("budget", (
            f"cswap: the budget of {fmt_bytes(budget)} is not met: {how} {fmt_bytes(peak)}"
            f"{after}, {fmt_bytes(peak - budget)} over it; {fits}. Raise the budget or lower "
            "the batch size. offloader.plan.table() shows the plan, and logging at INFO "
            "(logging.getLogger('cswap_lightning').setLevel('INFO')) the planner's decisions"))

    def _say_unwatched(self) -> None:
        """A plan that must move tensors to meet the budget, or cannot meet it, where no
        model is watched whose blocks could be recomputed instead."""
        cfg = self.config
        if self.recomputer is None and cfg.recompute == "auto":
            self._say_once("unwatched", (
                f"cswap: budget={cfg.budget!r} with recompute='auto', but no model is "
                "watched, so no block can be recomputed to meet it (only moved): call "
                "offloader.watch(model) once before training (the Lightning strategies and "
                "CSwapCallback do), or set recompute='off'"))

    def _say_misplaced(self, step: Step) -> None:
        """Say (once) that the block was entered around backward, where it does nothing
        useful: tensors saved in forward are offloaded only if forward runs inside it."""
        if self.backward_inside or step.dormant:
            return
        if step._backward_begun:
            what = "cswap: backward ran inside the Offloader's block"
        elif not step.sizes and torch.is_grad_enabled():
            what = "cswap: no tensor autograd saved passed through the Offloader's block"
        else:
            return
        self._say_once("misplaced", (
            f"{what}: enter it around forward alone, and call backward after it: "
            "`with offloader: loss = loss_fn(model(x), y)` then `loss.backward()`"))

    def _replanning(self) -> None:
        """The sites changed in number or kind (a data-dependent branch, several models under
        one Offloader): measure them and plan again, and say so once if it keeps happening."""
        self._replans += 1
        if self._replans == _REPLANS_BEFORE_WARNING:
            warnings.warn(
                f"cswap: the tensors saved under this Offloader changed {self._replans} times "
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
        if (len(step.counted()) != len(self._plan.signature)
                or not self._plan.same_kinds(step.stats.sites)):
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
                        step.device)


def _site_list(value: object) -> bool:
    return isinstance(value, list) and all(
        type(v) is int and v >= 0 for v in value)


_SHARED = threading.local()


def _shared() -> dict[CSwapConfig, Offloader]:
    if not hasattr(_SHARED, "by_config"):
        _SHARED.by_config = {}
    return _SHARED.by_config


def offload(config: CSwapConfig | None = None) -> Offloader:
    """This thread's :class:`Offloader` for ``config`` (one per distinct config and thread),
    so that ``with offload(config):`` written inside a training loop learns across steps."""
    config = as_config(config, "offload")
    shared = _shared()
    if config not in shared:
        shared[config] = Offloader(config)
        shared[config]._registry = shared
    return shared[config]
