"""The offload session: one ``Offloader`` per training loop, entered around each forward.

It owns the hooks' life cycle: each step is handed to a ``Step`` (``step.py``), whose hooks do
the per-tensor work, and closed once the device is past it; what lasts across steps (the
plan, its checks, the measurements) is ``Learning``'s (``learning.py``), and the blocks of the
watched model that run recomputed are ``Recompute``'s (``recompute.py``).
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from fnmatch import fnmatch

import torch
from typing_extensions import Self

from ..codecs.cuda import enable_cuda_codecs_if_requested
from ..codecs.lossy import LOSSY_DTYPES as _LOSSY_TORCH_DTYPES
from ..codecs.lossy import seed_of
from ..config import LOSSY_CODECS, CSwapConfig, as_config
from ..planning import live
from ..planning.plan import FixedPlan, Plan
from ..planning.predictor import CodecTimeModel
from ..planning.profiler import Link
from ..records import SiteStats, StepStats
from .learning import Learning
from .module_names import ModuleTracker
from .recompute import BlockCall, BlockTimer, Recompute, top_hooks
from .step import Probe, Step, hide_from_dynamo
from .transfer import Transfer

LOSSY_DTYPES = tuple(str(d).removeprefix("torch.") for d in _LOSSY_TORCH_DTYPES)
# Steps without hooks see nothing of what they save: at least one step in this many runs with
# them, counting, so that a graph that changed (another model entered from the same loop) is
# seen.
DORMANT_STEPS = 20
_log = logging.getLogger(__name__)


class Offloader:
    """Offloads autograd's saved tensors during each ``with`` block (one training step).

    Create it once and enter it around every forward pass; what it learns on one step
    (per-site sparsity, the order backward needs tensors in) plans the next. With
    ``plan="auto"`` the first ``profile_steps`` steps are measured, then the planner plans
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
        times the planner uses (e.g. to plan for a link other than the one measured)."""
        enable_cuda_codecs_if_requested()
        self.config = as_config(config, "Offloader")
        self.reverted: set[int] = set()  # lossy sites the accuracy guard moved back
        self.modules: ModuleTracker | None = None  # names sites by module, after watch()
        # the watched model's blocks run recomputed, after watch()
        self.recomputer: Recompute | None = None
        self.learning = Learning(self, link, time_model)  # across steps: the plan, ...
        self.transfer = Transfer(pin_memory=self.config.pin_memory,
                                 inflight_bytes=self.learning.planner.inflight_bytes)
        # Backward runs inside the block by design (Lightning's manual optimisation): not
        # a misplaced block (_say_misplaced).
        self.backward_inside = False
        self._next_probe: Probe | None = None  # the next step's, from probe_next_step()
        # The lossy codecs' rounding: seeded by torch's seed when the Offloader is built, the
        # count of training steps (a guard's probe rounds as the training step after it) and
        # the site, so a run rounds the same way whatever ran before it in the process.
        self.seed = seed_of(torch.initial_seed(), torch.initial_seed() >> 32)
        self._trained = 0  # training steps (not probes) entered
        self._latest_trained: Step | None = None
        self._steps_alive: weakref.WeakSet[Step] = weakref.WeakSet()  # autograd holds them
        self._step: Step | None = None
        # Closed steps whose figures the device still owes, with the events after their work.
        self._closing: deque[tuple[Step, list[torch.cuda.Event]]] = deque()
        # nested blocks' hooks (None: a step without hooks)
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        self._owner: int | None = None  # the thread inside the block
        # where the latest step was entered from (code, line), and the steps without hooks in
        # a row since one with them
        self._entered_from: tuple | None = None
        self._dormant = 0
        self._steps = 0
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
        learned = self.learning
        if learned.checked is not None and learned.checked.moves_nothing and learned.near_budget():
            _log.info("cswap: the allocator's peak neared the budget on a step without hooks: "
                      "measuring again")
            self.new_epoch()
        # closed steps whose measurements are still to be read count as measured
        measure = learned.measure_left > sum(step.measure for step, _ in self._closing)
        checked = (learned.checked if not measure and self._next_probe is None
                   and learned.unchecked is None else None)
        limits = (learned.plan.site_bytes if checked is not None and self.config.plan == "auto"
                  else None)
        step = Step(self, self._steps, learned.order, measure, checked, limits)
        step.epoch = learned.epoch
        if self.config.plan == "auto":
            step.stats.budget_bytes = learned.budget_bytes
        step.keeping = measure and learned.measure_keeping
        caller = sys._getframe(1)
        entered_from, self._entered_from = self._entered_from, (caller.f_code, caller.f_lineno)
        if (checked is not None and checked.moves_nothing and learned.watched(checked)
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
        return self.learning.planner.link

    @link.setter
    def link(self, link: Link | None) -> None:
        self.learning.planner.link = link

    @property
    def recomputation(self) -> live.Recomputation | None:
        """The planner's choice of blocks to recompute, and the replayed step it was made on."""
        return self.learning.planner.recomputation

    @property
    def block_calls(self) -> list[BlockCall]:
        """Each block call of the latest measured step that ran them plainly."""
        return self.learning.block_calls

    @property
    def held_elsewhere(self) -> set[int]:
        """Sites whose moving freed nothing (the training loop holds them too), measured."""
        return self.learning.held_elsewhere

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
            self.learning.checked = None  # a new model: the next step tracks and checks
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
            self.learning.recheck()
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
        armed = not step.measure or self.learning.measure_recomputed
        step.numbering = frozenset(recomputer.chosen) if armed else frozenset()
        self.learning.renumbered(step.numbering)
        if armed:
            tracked = step.checked is None and not step.dormant
            recomputer.arm(step.residency if tracked else None)  # what they hold, measured
            if recomputer.chosen:
                step.stats.recomputed = self.learning.recomputed(
                    tuple(sorted(recomputer.chosen)))
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
        plan = self.learning.plan
        if self.config.plan != "auto":
            codec = self.config.plan
        elif plan is None:
            codec = "raw"  # not profiled yet: swap uncompressed
        else:
            codec = plan.codec(site, stats.shape, stats.dtype)
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
        window, plan = self.config.prefetch_bytes, self.learning.plan
        if window == "auto":
            window = plan.prefetch_bytes if plan is not None else None
        elif plan is not None and self.config.plan == "auto":
            window = min(window, plan.prefetch_bytes)
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
        self.learning.recheck()

    def new_epoch(self) -> None:
        """Re-measure the next ``profile_steps`` steps (sparsity; with ``plan="auto"``, the
        windows too, then plan again), and which sites' moving frees nothing."""
        self.learning.new_epoch()

    def state_dict(self) -> dict:
        """What was learned (plan, backward order), JSON-able, for checkpoints."""
        return self.learning.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; the plan applies from the next step.

        Everything is checked before anything is taken: bad state raises ``ValueError``."""
        self.learning.load_state_dict(state)

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
        """The plan the steps run: the planner's for ``plan="auto"`` (None until made); for
        a fixed plan (``"raw"``, ``"zvc"``, ...), what the last step that tracked every site
        did with each (None before any step). Either way ``.table()`` shows it."""
        if self.config.plan == "auto":
            return self.learning.plan
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
            self.learning.finished(step)

    def _same_graph(self, entered_from: tuple | None) -> bool:
        """Whether a step without hooks would run the graph the plan was checked on, as far as
        can be seen without hooks: entered from where the step before it was (a new graph
        comes from other code), not inside saved-tensor hooks of the user's (which would take
        its tensors), and not the ``DORMANT_STEPS``-th step in a row without hooks."""
        return (entered_from == self._entered_from and top_hooks() is None
                and self._dormant < DORMANT_STEPS - 1)

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
        self.learning.say_once("misplaced", (
            f"{what}: enter it around forward alone, and call backward after it: "
            "`with offloader: loss = loss_fn(model(x), y)` then `loss.backward()`"))

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
