"""The model an Offloader trains (``Offloader.watch``): its modules, which name each saved
tensor's site for ``lossy_exclude``, and its blocks, which run recomputed once chosen (by the
planner, or by hand), or run plainly and timed on a measured step."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from ..config import CSwapConfig
from .learning import Learning
from .module_names import ModuleTracker
from .recompute import BlockTimer, Recompute
from .step import Step


class Watched:
    """The watched model's module names (``modules``, with ``lossy_exclude`` patterns) and
    recomputed blocks (``recomputer``); None of each before :meth:`watch`."""

    def __init__(self, config: CSwapConfig, learning: Learning) -> None:
        self.config = config
        self.learning = learning
        self.modules: ModuleTracker | None = None
        self.recomputer: Recompute | None = None

    def watch(self, model: torch.nn.Module) -> None:
        """See ``Offloader.watch``."""
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

    def choose(self, names: list[str], weights: Mapping[str, float] | None = None
               ) -> dict[str, str]:
        """See ``Offloader.recompute``: its checks of the config and of the model."""
        if names and self.config.recompute == "off":
            raise ValueError(f"cswap: CSwapConfig.recompute is 'off', so no block is "
                             f"recomputed (asked for {names}); set recompute='auto' to allow it")
        if self.recomputer is None:
            if not names:
                return {}
            raise ValueError("cswap: no model to recompute blocks of: call "
                             "Offloader.watch(model) first (the integrations do)")
        before = set(self.recomputer.chosen), dict(self.recomputer.weights)
        skipped = self.recomputer.choose(names, weights)
        if (set(self.recomputer.chosen), self.recomputer.weights) != before:
            self.learning.recheck()
        return skipped

    @property
    def chosen(self) -> frozenset[str]:
        return frozenset(self.recomputer.chosen if self.recomputer is not None else ())

    def drop_unfit(self) -> None:
        """Run plainly from now on the chosen blocks found unfit since they were chosen (by
        a measured step, or for hooks added inside them), and say so."""
        recomputer = self.recomputer
        unfit = recomputer.unfit_chosen() if recomputer is not None else {}
        if not unfit:
            return
        whys = (next(iter(unfit.values())) if len(unfit) == 1
                else "; ".join(f"{name}: {why}" for name, why in unfit.items()))
        warnings.warn(f"cswap: no longer recomputing {', '.join(map(repr, unfit))} ({whys}); "
                      f"{'it runs' if len(unfit) == 1 else 'they run'} plainly from this step "
                      "on", RuntimeWarning, stacklevel=3)
        self.choose([name for name in recomputer.chosen if name not in unfit])

    def arm(self, step: Step) -> None:
        """After the step's hooks are in place: its blocks armed, then its modules named."""
        self._arm_blocks(step)
        if self.modules is not None:
            self.modules.__enter__()

    def _arm_blocks(self, step: Step) -> None:
        """Recompute the chosen blocks on a step that is not measured; on a measured one,
        time each block (``block_calls``). Recomputed blocks save other tensors, so the steps
        number their sites otherwise: which sites are held elsewhere is measured again when
        the numbering changes."""
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

    def disarm(self, step: Step, exc_type, exc, tb) -> None:
        """At the end of the step's forward: the modules no longer named, no block armed."""
        if self.modules is not None:
            self.modules.__exit__(exc_type, exc, tb)
        if self.recomputer is not None:
            self.recomputer.disarm()
        if step.blocks is not None:
            step.blocks.remove()

    def close(self) -> None:
        if self.modules is not None:
            self.modules.close()
        if self.recomputer is not None:
            self.recomputer.release()
