"""The offload session: one ``Offloader`` per training loop, entered around each forward.

It owns the hooks' life cycle: each step is handed to a ``Step`` (``step.py``), whose hooks do
the per-tensor work, and closed once the device is past it (``closing.py``); what lasts
across steps (the plan, its checks, the measurements) is ``Learning``'s (``learning.py``),
the watched model's module names and recomputed blocks are ``Watched``'s (``watched.py``),
and where lossy codecs may run, and how they round, is ``LossySites``' (``lossy_sites.py``).
``offload(config)``, one Offloader per config and thread, is in ``shared.py``.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from typing_extensions import Self

from ..codecs import get_codec
from ..codecs.cuda import enable_cuda_codecs_if_requested
from ..config import DENSE_CODECS, LOSSY_CODECS, CSwapConfig, as_config
from ..planning import live
from ..planning.plan import FixedPlan, Plan
from ..planning.predictor import CodecTimeModel
from ..planning.profiler import Link
from ..records import SiteStats, StepStats
from .closing import Closing
from .learning import Learning
from .lossy_sites import LossySites
from .module_names import ModuleTracker
from .recompute import BlockCall, Recompute
from .saved_hooks import top_hooks
from .step import Step, hide_from_dynamo
from .transfer import Transfer
from .watched import Watched

# Steps without hooks see nothing of what they save: at least one step in this many runs with
# them, counting, so that a graph that changed (another model entered from the same loop) is
# seen.
DORMANT_STEPS = 20


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
        self.lossy = LossySites(self.config)
        self.learning = Learning(self, link, time_model)  # across steps: the plan, ...
        self.watched = Watched(self.config, self.learning)  # the model, after watch()
        self.transfer = Transfer(pin_memory=self.config.pin_memory,
                                 inflight_bytes=self.learning.planner.inflight_bytes)
        self.closing = Closing(self.transfer, self.learning)  # steps the device owes figures
        # Backward runs inside the block by design (Lightning's manual optimisation): not
        # a misplaced block (_say_misplaced).
        self.backward_inside = False
        self._steps_alive: weakref.WeakSet[Step] = weakref.WeakSet()  # autograd holds them
        self._step: Step | None = None
        # nested blocks' hooks (None: a step without hooks)
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        self._owner: int | None = None  # the thread inside the block
        # where the latest step was entered from (code, line), and the steps without hooks in
        # a row since one with them
        self._entered_from: tuple | None = None
        self._dormant = 0
        self._steps = 0
        self._saved_any = False  # a step has saved a tensor through the hooks
        self._closed = False
        self._registry: dict[CSwapConfig, Offloader] | None = None  # offload()'s, if from it

    # the hooks' life cycle ----------------------------------------------------------------
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
        self.closing.close(self._step)
        self.watched.drop_unfit()
        step = self.learning.new_step(self._steps, self.closing.measured(),
                                      self.lossy.next_probe is not None)
        caller = sys._getframe(1)
        entered_from, self._entered_from = self._entered_from, (caller.f_code, caller.f_lineno)
        checked = step.checked
        if (checked is not None and checked.moves_nothing and self.learning.watched(checked)
                and self._same_graph(entered_from)):
            step.dormant = step.stats.hooks_off = True
            step.device = checked.device
        self._dormant = self._dormant + 1 if step.dormant else 0
        self._push_hooks(step)  # raises where saved-tensor hooks are disabled: nothing changed
        self.lossy.start(step)
        self._step, self._owner = step, threading.get_ident()
        self._steps_alive.add(step)
        self._steps += 1
        self.watched.arm(step)
        return self

    def _push_hooks(self, step: Step) -> None:
        if step.dormant and not step.timed_plainly:
            self._hooks.append(None)
            return
        hide_from_dynamo()
        hooks = (step.plain_hooks() if step.timed_plainly
                 else torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack))
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
        self.watched.disarm(self._step, exc_type, exc, tb)
        self._step.end_forward()
        self._step.failed = exc_type is not None
        if exc_type is None:
            self._say_misplaced(self._step)
        self._saved_any = self._saved_any or bool(self._step.sizes)

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
        if step.backward_begun:
            if len(step.sizes) > step.saved_before_backward:
                return  # a gradient taken in forward (a gradient penalty) saved its graph
            what = "cswap: backward ran inside the Offloader's block"
        elif not step.sizes and torch.is_grad_enabled() and not self._saved_any:
            # (where earlier steps saved some, this one is an evaluation under no_grad)
            what = "cswap: no tensor autograd saved passed through the Offloader's block"
        else:
            return
        self.learning.say_once("misplaced", (
            f"{what}: enter it around forward alone, and call backward after it: "
            "`with offloader: loss = loss_fn(model(x), y)` then `loss.backward()`"))

    def close(self) -> None:
        """Finish the background work and free the host arena. Backward of a step already
        run still works; entering the Offloader again does not."""
        self._closed = True
        self.closing.finish(wait=True)
        self.transfer.close()
        self.watched.close()
        if self._registry is not None and self._registry.get(self.config) is self:
            del self._registry[self.config]

    # the watched model --------------------------------------------------------------------
    def watch(self, model: torch.nn.Module) -> Self:
        """Train ``model`` under this Offloader: its blocks can then be recomputed
        (:meth:`recompute`; it is held weakly), and with ``lossy_exclude`` patterns each site
        is named by the module that saved it. The global module hooks naming takes slow every
        module call in the process (1.2x on a small model's forward on the CPU) until
        :meth:`close`; without patterns none are taken."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Offloader.watch takes the torch.nn.Module being trained, got "
                            f"{model!r} ({type(model).__name__})")
        self.watched.watch(model)
        return self

    def recompute(self, names: Iterable[str], weights: Mapping[str, float] | None = None
                  ) -> dict[str, str]:
        """Run these blocks of the watched model (names from ``recomputer.units()``: a layer's
        or an activation module's qualified name, ``"features[0:5]"`` for a stage of an
        ``nn.Sequential``, a layer's name with ``":elementwise"`` for it below the layer)
        under checkpoint from the next step on, and no others; the planner's call.
        ``weights``: for a block below the layer, how much the work it runs again weighs
        against the bytes it keeps (``planning.dataflow.WEIGHTS``; 0, the default: the fewest
        bytes). Measured steps run them plainly and time every block
        (``block_calls``; ``recompute.renumbered`` says where their sites go). Returns the
        blocks skipped, with why (checkpointed by the model itself, measured changing an
        input in place, inside another block chosen). A changed set makes the next step
        check the plan again: the step saves other tensors.

        Raises ``ValueError`` with ``recompute="off"`` (for any block), for a block the model
        does not have, or without a watched model; ``RuntimeError`` during a forward."""
        if isinstance(names, str):
            raise TypeError(f"recompute takes a collection of block names, got the string "
                            f"{names!r}; write recompute([{names!r}])")
        if self._hooks:
            raise RuntimeError("cswap: change the recomputed blocks between steps, not inside "
                               "the Offloader's block")
        return self.watched.choose(list(names), weights)

    @property
    def recomputed(self) -> frozenset[str]:
        """The blocks in force: recomputed on every step that is not measured."""
        return self.watched.chosen

    @property
    def recomputer(self) -> Recompute | None:
        """The watched model's blocks, which run recomputed once chosen (None: unwatched)."""
        return self.watched.recomputer

    @property
    def modules(self) -> ModuleTracker | None:
        """Names each site by the module that saved it (None: not named)."""
        return self.watched.modules

    @modules.setter
    def modules(self, tracker: ModuleTracker | None) -> None:
        self.watched.modules = tracker

    # what each site runs ------------------------------------------------------------------
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
        if codec in LOSSY_CODECS and not self.lossy.ok(codec, site, stats, self._step.probe):
            return "raw"
        if codec in DENSE_CODECS and not get_codec(codec).packs(stats.dtype):
            return "raw"  # plan="exponent": bfloat16 sites only
        return codec

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

    # the lossy sites ----------------------------------------------------------------------
    def lossy_sites(self) -> frozenset[int] | None:
        """The sites the latest training step (not a guard's probe) compressed lossily, as
        the step that checked its plan tracked them; None before any training step."""
        return self.lossy.sites()

    def probe_next_step(self, kind: str, sites: Iterable[int] | None = None,
                        restored: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
                        ) -> Self:
        """Make the next step an accuracy guard's probe: ``"lossless"`` swaps lossy sites raw
        instead; ``"measure errors"`` keeps the lossy ``sites`` (None: all) lossy, swaps the
        others raw, measures each one's round-trip error (its row's ``error``) and hands its
        original and restored tensors to ``restored(site, original, restored)``. A probe
        rounds as the next training step will, and runs no checked plan."""
        self.lossy.probe_next(kind, sites, restored)
        return self

    def lossy_allowed(self, site: int, dtype: str, module: str) -> bool:
        """Floating tensors only, outside excluded modules, unless the guard moved them back."""
        return self.lossy.allowed(site, dtype, module)

    @property
    def reverted(self) -> set[int]:
        """The lossy sites the accuracy guard moved back to lossless."""
        return self.lossy.reverted

    @reverted.setter
    def reverted(self, sites: set[int]) -> None:
        self.lossy.reverted = sites

    def revert(self, sites: Iterable[int]) -> None:
        """Move these lossy sites back to lossless from the next step on (the accuracy
        guard's call); a checked plan is checked again with them."""
        self.reverted.update(sites)
        self.learning.recheck()

    # what was learned ---------------------------------------------------------------------
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

    @property
    def plan(self) -> Plan | FixedPlan | None:
        """The plan the steps run: the planner's for ``plan="auto"`` (None until made); for
        a fixed plan (``"raw"``, ``"zvc"``, ...), what the last step that tracked every site
        did with each (None before any step). Either way ``.table()`` shows it."""
        if self.config.plan == "auto":
            return self.learning.plan
        return None if self._step is None else FixedPlan(self.config.plan, self.tracked_step())

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

    # the steps' records -------------------------------------------------------------------
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
