"""Which operators a recomputation below the layer needs: dead code, found in the forward.

A block recomputed below the layer runs its forward again only for what backward unpacks:
the tensors autograd saved. An operator none of whose outputs reaches one of them, except
through an output that is kept (given back, not computed again), need not run: Hugging Face's
RMSNorm squares its input only to take the mean, which is kept (one value a row), and the
square is never saved; a layer's last residual sum is what it returns, which checkpoint throws
away. A kept output nothing needs is not kept at all (a layer's last projection).

Dependencies go by storage: an operator reads every storage its tensor arguments view and
depends on every operator that wrote it since it was made, so views and in-place updates are
followed. Some operators always run: views and other aliases (no kernel), and casts of a
weight (autocast may cast one again in a recomputation that found it cached in forward, so
their count can differ; ``ops.uncounted``); they need what they read only where their output
is needed. Other casts are operators like any other: a bfloat16 model's norm that takes its
input to float32 may keep its bfloat16 output and run the cast again, or keep the cast's
output. Some are needed whatever reads them (roots): those that draw random numbers (the
generator must advance as it did), change a tensor in place, give no tensor back, or move one
to another device (the host may read it without an operator).

What to keep is a minimum cut (``Dataflow.cut``): the matrix products may not run again, what
autograd saved must be made, and each call in between may be kept at the price of its
outputs' bytes. Of the sets of fewest bytes, the one nearest what backward reads is taken
(found from the sink's side of a maximum flow), so equal bytes move past elementwise work:
rotary embedding's outputs are kept, not the projections before it.

The fewest bytes are not always the cheapest: a norm run again reads and writes about three
times the bytes its outputs would keep. A cut may also weigh each call run again at the bytes
it reads and writes times a ``weight``; each weight of ``WEIGHTS`` gives one way of
recomputing a block, from the fewest bytes kept (0) to the least work run again, among which
the planner chooses per block by the memory it has.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import ops

# The weights of a call's traffic against the bytes kept (``Dataflow.cut``): each gives one
# way of recomputing a block below the layer, the first the fewest bytes kept.
WEIGHTS = (0.0, 0.2, 0.35)


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
    sizes: tuple[int, ...] = ()  # the bytes of each storage it made
    dtype: torch.dtype | None = None  # of the largest
    changed: bool = False  # a later call changed one of them in place
    touched: int = 0  # the bytes it reads and writes (none for an alias)
    uncounted: bool = False  # it may run more or fewer times again (``ops.uncounted``)


class Dataflow:
    """A block's forward, one operator call at a time (:meth:`call`), and the tensors autograd
    saved from it (:meth:`saved`): :meth:`needed` says which calls its recomputation runs."""

    def __init__(self, weighing: bool = True, watching: bool = False) -> None:
        self.weighing = weighing  # record each call's traffic (``touched``), for a weighted cut
        # each output tensor made, weakly: which live on after the block (``held``), for a cut
        self._made: list[weakref.ref] | None = [] if watching else None
        self.calls: list[Call] = []
        self._writers: dict[int, tuple[int, ...]] = {}  # storage -> calls that wrote it
        self._saved: set[int] = set()  # calls whose outputs autograd saved
        self.blind = False  # some saves were not seen: every call is needed
        self._graph: _Graph | None = None  # the last cut's graph and flow (``cut``)

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
        keys = [t.untyped_storage()._cdata for t in outputs]
        aliases = bool(keys) and read.issuperset(keys)
        moved = False
        if inputs and outputs:
            devices = {t.device for t in inputs}
            devices.update(t.device for t in outputs)
            moved = len(devices) > 1
        others = len(outputs) < len(values) and any(  # values beside its tensors
            v is not None and not isinstance(v, torch.Tensor) for v in values)
        root = f.mutable or f.random or moved or not outputs or others
        uncounted = ops.uncounted(f, inputs)
        always = not root and (f.view or aliases or uncounted)
        made: dict[int, tuple[int, torch.dtype]] = {}  # each storage it made: bytes, dtype
        for key, t in zip(keys, outputs, strict=True):
            if key not in read:
                writers[key] = (index,)
                if key not in made:
                    made[key] = (t.untyped_storage().nbytes(), t.dtype)
            elif f.mutable:
                first = writers.get(key, ())
                if first:
                    self.calls[first[0]].changed = True
                writers[key] = (*first, index)
        dtype = max(made.values(), key=lambda m: m[0], default=(0, None))[1]
        touched = 0
        if self.weighing and not (f.view or aliases):
            touched = sum(t.nbytes for t in (*inputs, *outputs))
        if self._made is not None:
            self._made.extend(map(weakref.ref, outputs))
        self.calls.append(Call(func, frozenset(deps), always, root, kept,
                               tuple(n for n, _ in made.values()), dtype, touched=touched,
                               uncounted=uncounted))
        return index

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t``: whatever wrote it is needed."""
        self._saved.update(self._writers.get(storage_key(t), ()))

    def held(self) -> list[torch.Tensor]:
        """The tensors the block made (watched) that live on after it and share no storage
        autograd saved a tensor on: returned, or held where the block put them (a list, a
        module's attribute), where the caller may change them in place. A cut keeps none of
        them (``cut``'s ``returned``). (Saved ones are held by the step; a cache's are seen
        changed by plain PyTorch's version check as by the engine's.)"""
        saved, writers = self._saved, self._writers
        return [t for ref in self._made or () if (t := ref()) is not None
                and saved.isdisjoint(writers.get(storage_key(t), ()))]

    def was_saved(self, index: int) -> bool:
        """Whether autograd saved a tensor on a storage the call ``index`` wrote."""
        return index in self._saved

    def needed(self, given: Iterable[int] | None = None) -> list[bool]:
        """Per call, whether the recomputation needs it (runs it, or gives its output back);
        ``given``: the calls whose outputs it gives back (None: those recorded as kept)."""
        given = ({i for i, c in enumerate(self.calls) if c.kept} if given is None
                 else set(given))
        if self.blind:
            return [True] * len(self.calls)
        need = [c.root for c in self.calls]
        for i in self._saved:
            need[i] = True
        for i in range(len(self.calls) - 1, -1, -1):
            if need[i] and i not in given:
                for d in self.calls[i].deps:
                    need[d] = True
        return need

    def runs(self, given: Iterable[int]) -> list[bool]:
        """Per call, whether a recomputation that gives back the outputs of the calls
        ``given`` runs it: needed and not given back, or run in any case."""
        given = set(given)
        need = self.needed(given)
        return [i not in given and (need[i] or c.always) for i, c in enumerate(self.calls)]

    @property
    def saving(self) -> bool:
        """Whether autograd saved anything from the block."""
        return bool(self._saved)

    def makers(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The calls that made (the storages of) these live tensors."""
        writers = self._writers
        return {writers[k][0] for k in map(storage_key, tensors) if k in writers}

    def keeps(self, cut: Iterable[int]) -> tuple[tuple[int, ...], torch.dtype | None]:
        """The bytes of each storage the calls ``cut`` made (what a recomputation keeping
        their outputs holds), and the dtype of the largest (None: no bytes)."""
        kept = [self.calls[i] for i in sorted(cut) if self.calls[i].sizes]
        largest = max(kept, key=lambda c: max(c.sizes), default=None)
        return tuple(n for c in kept for n in c.sizes), largest and largest.dtype

    def cut(self, given: Iterable[int], returned: Iterable[torch.Tensor] = (),
            weight: float = 0.0) -> set[int]:
        """The calls whose outputs a recomputation keeps with the fewest bytes, the latest of
        equally few: a minimum cut between the calls that may not run again (``given``: its
        matrix products, kept) and what it must make (what autograd saved, the roots). Where
        a matrix product's output only feeds elementwise work that ends in a tensor of its
        size (rotary embedding's query, a LoRA adapter's sum), that tensor is kept instead, so
        the elementwise work does not run again. A call cannot be kept that makes no bytes,
        must run anyway (views, a weight's casts, roots), or whose output was changed in
        place later or is (a view of) what the block returned (``returned``); none where
        blind. ``weight``:
        each call run again that need not be costs its ``touched`` bytes times it beside the
        bytes kept (a norm's outputs are kept where running it again reads and writes more
        than ``1 / weight`` times their bytes).

        Cuts of the same ``given`` and ``returned`` at growing weights (the ways, in order)
        go on from the flow of the one before: a larger weight only widens the source's
        edges, so that flow is still one, and the latest minimum cut is the same whichever
        maximum flow it is read from."""
        given = set(given)
        if self.blind:
            return given
        key = (len(self.calls), len(self._saved), frozenset(given),
               frozenset(self.makers(returned)))
        graph = self._graph
        if graph is None or graph.key != key or not graph.weight <= weight <= graph.ceiling:
            graph = self._graph = _Graph(self.calls, self._saved, key, weight)
        graph.weigh(weight)
        return graph.cut()


class _Graph:
    """The node-split graph of a block's calls for ``Dataflow.cut``, with its flow so far: a
    call i is an edge 2i -> 2i + 1 of its outputs' bytes (infinite where it cannot be kept),
    each dependency an infinite edge, the source feeds the given calls (infinitely) and each
    call that would run again (its work: ``touched`` bytes times the weight), the sink drains
    what autograd saved and the roots."""

    def __init__(self, calls: list[Call], saved: set[int],
                 key: tuple[int, int, frozenset[int], frozenset[int]], weight: float) -> None:
        n, (_, _, given, returned) = len(calls), key
        self.key, self.weight, self.n = key, weight, n
        self.source, self.sink = source, sink = 2 * n, 2 * n + 1
        # the calls a weight makes pay for running again, and the work each pays now
        self.touched = {i: c.touched for i, c in enumerate(calls)
                        if c.touched and not (i in given or c.root or c.always)}
        self.work = dict.fromkeys(self.touched, 0)
        # more than any cut of finite edges, up to this weight
        self.ceiling = max(weight, 1.0)
        infinite = (1 + sum(sum(c.sizes) for c in calls)
                    + round(self.ceiling * sum(self.touched.values())))
        capacity: dict[int, dict[int, int]] = {v: {} for v in range(2 * n + 2)}
        self.capacity = capacity

        def edge(u: int, v: int, c: int) -> None:
            capacity[u][v] = capacity[u].get(v, 0) + c
            capacity[v].setdefault(u, 0)

        for i, c in enumerate(calls):
            keepable = i in given or not (
                c.root or c.always or not any(c.sizes) or c.changed or i in returned)
            edge(2 * i, 2 * i + 1, sum(c.sizes) if keepable else infinite)
            if i in given:
                edge(source, 2 * i, infinite)
            else:
                if i in self.touched:  # paid where it runs again: on the sink's side
                    edge(source, 2 * i, 0)
                for d in c.deps:
                    edge(2 * d + 1, 2 * i, infinite)
            if c.root:  # runs again, or is given back
                edge(2 * i + (i in given), sink, infinite)
        for i in saved:
            edge(2 * i + 1, sink, infinite)

    def weigh(self, weight: float) -> None:
        """Widen the source's edges to ``weight``'s work, and push flow while it goes."""
        self.weight = weight
        for i, touched in self.touched.items():
            work = round(weight * touched)
            self.capacity[self.source][2 * i] += work - self.work[i]
            self.work[i] = work
        capacity = self.capacity
        while (path := _augmenting(capacity, self.source, self.sink)) is not None:
            pushed = min(capacity[u][v] for u, v in path)
            for u, v in path:
                capacity[u][v] -= pushed
                capacity[v][u] += pushed

    def cut(self) -> set[int]:
        """The calls kept by the latest minimum cut: those whose edge the sink's side (what
        still reaches the sink) begins at."""
        capacity, reaches = self.capacity, {self.sink}
        todo = deque([self.sink])
        while todo:
            v = todo.popleft()
            for u in capacity[v]:
                if u not in reaches and capacity[u][v] > 0:
                    reaches.add(u)
                    todo.append(u)
        return {i for i in range(self.n) if 2 * i not in reaches and 2 * i + 1 in reaches}


def _augmenting(capacity: dict[int, dict[int, int]], source: int, sink: int
                ) -> list[tuple[int, int]] | None:
    """A shortest path from ``source`` to ``sink`` with room on every edge (its edges)."""
    parent = {source: source}
    todo = deque([source])
    while todo and sink not in parent:
        u = todo.popleft()
        for v, room in capacity[u].items():
            if room > 0 and v not in parent:
                parent[v] = u
                todo.append(v)
    if sink not in parent:
        return None
    path, v = [], sink
    while v != source:
        path.append((parent[v], v))
        v = parent[v]
    return path
