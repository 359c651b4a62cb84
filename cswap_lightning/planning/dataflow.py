"""Which operators a recomputation below the layer needs: dead code, found in the forward.

A block recomputed below the layer runs its forward again only for what backward unpacks:
the tensors autograd saved. An operator none of whose outputs reaches one of them, except
through an output that is kept (given back, not computed again), need not run: Hugging Face's
RMSNorm squares its input only to take the mean, which is kept (one value a row), and the
square is never saved; a layer's last residual sum is what it returns, which checkpoint throws
away. A kept output nothing needs is not kept at all (a layer's last projection).

Dependencies go by storage: an operator reads every storage its tensor arguments view and
depends on every operator that wrote it since it was made, so views and in-place updates are
followed. Some operators always run: views and other aliases (no kernel), and casts (autocast
may cast a weight again in a recomputation that found it cached in forward, so their count can
differ); they need what they read only where their output is needed. Some are needed whatever
reads them (roots): those that draw random numbers (the generator must advance as it did),
change a tensor in place, give no tensor back, or move one to another device (the host may
read it without an operator).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import ops


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(slots=True)
class Call:
    """One operator call of a block's forward: the calls it depends on, and how it runs again
    (``always``: whatever is needed; ``root``: needed whatever reads it; ``kept``: given back)."""

    func: torch._ops.OpOverload
    deps: frozenset[int]
    always: bool
    root: bool
    kept: bool


class Dataflow:
    """A block's forward, one operator call at a time (:meth:`call`), and the tensors autograd
    saved from it (:meth:`saved`): :meth:`needed` says which calls its recomputation runs."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._writers: dict[int, tuple[int, ...]] = {}  # storage -> calls that wrote it
        self._saved: set[int] = set()  # calls whose outputs autograd saved
        self.blind = False  # some saves were not seen: every call is needed

    def call(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out,
             kept: bool = False) -> int:
        """Record one call (made in this order); its index."""
        return self.record(func, ops.arguments(args, kwargs), ops.leaves(out), kept)

    def record(self, func: torch._ops.OpOverload, inputs: list[torch.Tensor],
               values: list, kept: bool = False) -> int:
        """:meth:`call`, given the tensors among its arguments and its outputs' ``leaves``
        (a dispatch mode has them already)."""
        f = ops.facts(func)
        writers = self._writers
        read = {t.untyped_storage()._cdata for t in inputs}  # storage_key, inlined: hot
        deps: set[int] = set()
        for key in read:
            if key in writers:
                deps.update(writers[key])
        index = len(self.calls)
        outputs = [v for v in values if isinstance(v, torch.Tensor)]
        made = [t.untyped_storage()._cdata for t in outputs]
        aliases = bool(made) and read.issuperset(made)
        moved = False
        if inputs and outputs:
            devices = {t.device for t in inputs}
            devices.update(t.device for t in outputs)
            moved = len(devices) > 1
        others = len(outputs) < len(values) and any(  # values beside its tensors
            v is not None and not isinstance(v, torch.Tensor) for v in values)
        root = f.mutable or f.random or moved or not outputs or others
        always = not root and (f.view or aliases or f.cast)
        for key in made:
            if key not in read:
                writers[key] = (index,)
            elif f.mutable:
                writers[key] = (*writers.get(key, ()), index)
        self.calls.append(Call(func, frozenset(deps), always, root, kept))
        return index

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t``: whatever wrote it is needed."""
        self._saved.update(self._writers.get(storage_key(t), ()))

    def needed(self, dropped: Iterable[int] = ()) -> list[bool]:
        """Per call, whether the recomputation needs it (runs it, or gives its output back
        where kept); ``dropped``: kept calls that are run again after all."""
        dropped = set(dropped)
        if self.blind:
            return [True] * len(self.calls)
        need = [c.root for c in self.calls]
        for i in self._saved:
            need[i] = True
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            if need[i] and not (c.kept and i not in dropped):
                for d in c.deps:
                    need[d] = True
        return need
