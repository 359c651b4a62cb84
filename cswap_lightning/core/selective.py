"""Recomputation below the layer: a block's elementwise work runs again in backward, its
matrix products, attention and convolutions do not.

Checkpointing a whole layer keeps its input and runs all of its forward again: for a Llama
layer that frees 96% of what it saves for a third more compute. Most of those bytes are
elementwise results (RMSNorm's fp32 copies and outputs, SiLU's output and the gate product:
about 120 of a Llama-3-8B layer's 197 KiB per token), which cost almost nothing to compute
again from the outputs of the layer's matrix products. So a block recomputed *below the
layer* runs under non-reentrant ``torch.utils.checkpoint`` with two dispatch modes of its own
(its ``context_fn``), as ``create_selective_checkpoint_contexts`` does, with one difference
that matters here:

- in forward, ``Keeping`` records the outputs of every operator ``ops.kept`` names (``mm``,
  ``addmm``, ``bmm``, the fused attention kernels, ``convolution``) and of reductions
  (``ops.reduces``), each once, in order, or those of the calls the block's ``Choice``
  names (below);
  everything else the block saves goes to checkpoint's own hooks and is dropped. When the
  block returns, its kept outputs go through the step's saved-tensor hooks, one site each
  (torch's policy keeps them in a cache of its own, out of any hook's reach): the planner can
  swap them like any saved tensor, and the engine's ledger counts them;
- in backward, ``Recomputing`` runs the block's forward again and, for each kept operator,
  gives back its output through the step's unpack hook instead of running it.

Nothing runs again that nothing saved needs (``planning/dataflow.py``): the forward's
dataflow and what autograd saved in it (seen through checkpoint's pack hook, wrapped) say
which calls backward's tensors depend on. Nor is what the kept products make kept as they
are where a later tensor of no more bytes serves: a block's ``Choice`` keeps the fewest bytes
that make what autograd saved, the latest of equally few (``Dataflow.cut``), so rotary
embedding's query and key are kept instead of the projections they are made from, a LoRA
adapter's sum instead of the base product, a norm's input instead of the product and the
residual sum that make it, and the elementwise work between does not run again; a choice
made with a weight (the planner's, where memory is less dear than time) keeps more bytes
where that spares more work run again (a norm's outputs). The choice
is made once per block from a forward the engine observed on a measured step (``Observer``),
else from the block's first recomputed forward (which keeps its products' outputs), and
names each kept call by operator and count. Where a call is not run, its outputs are
placeholders: empty tensors of their shapes and strides. Should a recomputation run
differently than its forward, so that an operator reads a placeholder or a placeholder is
saved, it raises rather than give wrong gradients.

Once a block's choice is settled (a forward made with it gave its recomputation what each
operator's calls are: kept, not run, or run) and the block is found fit to run first without
autograd (``lean.py``), its first run goes so, under ``Lean``: no dataflow, no graph, no hook
per saved tensor, only the settled calls' outputs kept (and the shapes of those not to run);
backward runs the block under ``Recomputing`` with autograd on, which builds the graph from
the kept outputs as the first run's would have been built. A first run that calls other
operators than the settled one, makes outputs of other shapes where it keeps or does not run
them (a composite operator that decides by autograd: attention without its log-sum-exp), or
changes or returns what it keeps, is recomputed whole, and the block stays under checkpoint
from then on. The attention kernels that leave out their log-sum-exp without autograd are
asked for it, as autograd's run asks (``_WITH_AUTOGRAD``).

Bitwise: a kept output is the very value the operator gave; everything recomputed runs on
the same inputs in the same order as the first time (checkpoint puts the RNG state back). An
operator that draws random numbers and is kept (a fused attention kernel with dropout) is
not run again, so the generator's state after it is recorded in forward and put back after
its output is given back. An output changed in place inside the block, or returned by it (the
caller might change it), is recomputed instead of kept. A second backward over the same
graph (``retain_graph=True``) recomputes again from the same kept outputs.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..planning import ops
from ..planning.dataflow import WEIGHTS, Dataflow, storage_key
from .saved_hooks import Hooks, top_hooks


def _detached(x: Any) -> Any:
    """A tensor as a new alias autograd can give a history of its own (sharing the version
    counter), as checkpoint's selective policy detaches what it caches: views made beneath
    autograd need the ADInplaceOrView key to share the counter."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


@dataclass(slots=True)
class _Kept:
    """One kept operator call: its outputs (flattened: tensors, then their handles once
    packed) and their structure (None: one tensor), each tensor's version when made (None
    where no tensor), the RNG states after it (where it draws random numbers), its call
    in the block's ``Dataflow``, how many owners each of its outputs' storages has once
    the tensors the call made are gone, and whether autograd saved a tensor on one of them in
    the forward that chose to keep it (``held_elsewhere``)."""

    values: list[Any]
    spec: Any
    versions: list[int | None]
    rng: list[tuple[torch.Generator, torch.Tensor]] | None
    cost: float  # its operator's work per byte of output (``ops.work_per_byte``)
    index: int
    owners: dict[int, int]
    saved: bool = False

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict, out: Any, random: bool, cost: float,
           index: int) -> _Kept:
        """The call of ``func`` that gave ``out`` (``random``: it drew random numbers)."""
        flat, spec = ([out], None) if isinstance(out, torch.Tensor) else tree_flatten(out)
        values = [_detached(v) for v in flat]
        owners: dict[int, int] = {}
        for v in flat:
            if isinstance(v, torch.Tensor):
                key = storage_key(v)
                owners[key] = owners.get(key, _use_count(key)) - 1
        return cls(values, spec, [v._version if isinstance(v, torch.Tensor) else None
                                  for v in values],
                   _rng_states(func, args, kwargs) if random else None, cost, index, owners)

    def held_elsewhere(self) -> bool:
        """Whether a tensor the block did not return, and autograd did not save, still
        shares an output's storage: one the block leaked (in a list, say), or an alias with a
        version counter of its own (the ``_unsafe_view`` a matmul returns). Its holder could
        change the kept bytes after the block returned, unseen by the version the engine
        checks or seen where plain PyTorch, which saved nothing of them, runs on. (Where
        autograd saved a tensor on them, their holder is likely the block's cache, whose
        changes plain PyTorch's version check sees as the engine's does.) An output of no
        bytes holds nothing to change (bitsandbytes' 8-bit product returns an empty one its
        autograd context keeps)."""
        return not self.saved and any(
            _use_count(key) > self.owners[key]
            for key in {storage_key(t) for t, _ in self.tensors() if _has_bytes(t)})

    def tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Its output tensors, each with its version when made."""
        return [(v, version) for v, version in zip(self.values, self.versions, strict=True)
                if version is not None]


class _Empty(NamedTuple):
    """A tensor's size, strides, dtype and device."""

    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _Empty:
        return cls(t.size(), t.stride(), t.dtype, t.device)

    def tainted(self, tainted: Tainted) -> torch.Tensor:
        """An empty tensor of this shape, tainted."""
        t = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        tainted.add(t)
        return t


def _each(value: Any, kind: type, f: Callable[[Any], Any]) -> Any:
    """``value`` with ``f`` applied to each ``kind`` in it, in the tuples and lists ATen
    returns (one walk costs less than pytree's, made for every operator call)."""
    if isinstance(value, kind):
        return f(value)
    if type(value) is tuple or type(value) is list:
        return type(value)(_each(v, kind, f) for v in value)
    return value


@dataclass(slots=True)
class _Dead:
    """An operator call the recomputation does not run (``dataflow.py``): its outputs, each
    tensor as ``_Empty`` (other values as they were)."""

    outputs: Any

    @classmethod
    def of(cls, out: Any) -> _Dead:
        if isinstance(out, torch.Tensor):  # most calls: no walk
            return cls(_Empty(out.size(), out.stride(), out.dtype, out.device))
        return cls(_each(out, torch.Tensor, _Empty.of))

    def placeholder(self, tainted: Tainted) -> Any:
        """Empty tensors in place of its outputs, tainted."""
        return _each(self.outputs, _Empty, lambda e: e.tainted(tainted))


class Tainted:
    """The storages of a recomputation's placeholders, while they live: an operator that
    computes from one, or a tensor saved from one, means its forward ran differently than
    the first time, and raises rather than give wrong gradients."""

    def __init__(self) -> None:
        self.keys: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.keys:
            self.keys.add(key)
            weakref.finalize(storage, self.keys.discard, key)

    def among(self, tensors: Iterable[torch.Tensor]) -> bool:
        return bool(self.keys) and any(storage_key(t) in self.keys for t in tensors)


def _has_bytes(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def _use_count(key: int) -> int:
    """The owners of a storage (``storage_key``): the tensors on it and its Python object."""
    return torch._C._storage_Use_Count(key)


def staying(made: Sequence[_Kept], returned: Iterable[torch.Tensor], changed: Container[int]
            ) -> list[bool]:
    """Which kept calls stay kept once the block returned the tensors ``returned``: those
    none of whose outputs was changed in place since (its version moved, or a later call
    wrote its storage: its index is among ``changed``, which sees it through an alias that
    shares no version, as the ``_unsafe_view`` a matmul returns), is (a view of) one of them
    or is held elsewhere (``_Kept.held_elsewhere``), and not far cheaper to make than the
    rest (``ops.dear``)."""
    returned = {t.untyped_storage()._cdata for t in returned}
    fresh = [k.index not in changed and not any(
        _has_bytes(t) and (t._version != v or t.untyped_storage()._cdata in returned)
        for t, v in k.tensors()) and not k.held_elsewhere() for k in made]
    dear = iter(ops.dear([k.cost for k, ok in zip(made, fresh, strict=True) if ok]))
    return [ok and next(dear) for ok in fresh]


def settle(flow: Dataflow, made: Sequence[_Kept], returned: Sequence[torch.Tensor]
           ) -> list[bool]:
    """Once a block returned the tensors ``returned``, which of its kept calls ``made`` stay
    kept: ``staying`` (the flow knows which calls' outputs a later call changed in place,
    and which autograd saved), and needed."""
    for k in made:
        k.saved = flow.was_saved(k.index)
    stay = staying(made, returned, {k.index for k in made if flow.calls[k.index].changed})
    need = flow.needed(k.index for k, ok in zip(made, stay, strict=True) if ok)
    return [ok and need[k.index] for k, ok in zip(made, stay, strict=True)]


class Choice:
    """What a block's recomputations below the layer keep (``Dataflow.cut``), each kept
    call by operator and count among the block's calls of that operator (uncounted calls
    apart, ``ops.uncounted``), or None before it is made: from a forward the engine observed
    (``Observer``), else from the first recomputed one, which keeps its matrix products'
    outputs. A recomputed forward that runs other operators than the one it was made from
    makes the next one choose again. ``weight``: the cut's weight of the work run again
    against the bytes kept."""

    def __init__(self, weight: float = 0.0) -> None:
        if not weight >= 0:
            raise ValueError(f"a choice's weight is at least 0 (0: the fewest bytes kept), "
                             f"got {weight!r}")
        self.weight = weight
        self.kept: frozenset[tuple[Any, int]] | None = None
        # the forward's operators it was made from (``_operators``)
        self.funcs: tuple[Any, ...] = ()
        # what a forward made with it gave its recomputation, each operator's calls in order
        # (``Settled``); a first run without autograd follows it (``Lean``)
        self.settled: dict[Any, tuple[Settled, ...]] | None = None

    def make(self, flow: Dataflow, given: set[int], returned: Sequence[torch.Tensor],
             calls: dict[Any, list[int]]) -> set[int]:
        """Choose from a forward (its ``flow``, the calls whose outputs it would keep before
        the cut, the tensors it returned, each operator's calls in the flow but the uncounted
        ones, ``ops.uncounted``): the calls kept."""
        cut = flow.cut(given, returned, self.weight)
        self.settled = None
        if flow.saving and not flow.blind:
            self.kept = frozenset((func, n) for func, indices in calls.items()
                                  for n, i in enumerate(indices) if i in cut)
            self.funcs = _operators(flow)
        return cut

    def check(self, flow: Dataflow) -> None:
        """A forward recomputed by this choice ran ``flow``: where it ran other operators
        than the one the choice was made from, the next one chooses again."""
        if _operators(flow) != self.funcs:
            self.forget()

    def forget(self) -> None:
        """The next forward chooses again."""
        self.kept, self.settled = None, None


def signature(args: tuple, kwargs: dict) -> tuple[tuple[bool, bool], ...]:
    """What, of a block call's tensor arguments (and those in a tuple or list among them),
    may change the operators it runs and counts: whether each is a leaf whose casts autocast
    caches (``ops.uncounted``) and whether it is contiguous (a linear layer runs other
    operators on a strided input). A block's calls of another signature (a shared layer on a
    slice, its first call on the model's leaf input) have choices of their own
    (``Recompute.choice``). Shapes are not in it: a choice holds across lengths."""
    found = []
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                found.append((t.is_leaf and t.requires_grad and not t._is_view(),
                              t.is_contiguous()))
    return tuple(found)


def _operators(flow: Dataflow) -> tuple[Any, ...]:
    """The operators a forward ran, in order, but the uncounted calls (``ops.uncounted``:
    autocast casts a weight in one call of a block and finds it cached in the next)."""
    return tuple(c.func for c in flow.calls if not c.uncounted)


class Region:
    """One call of a block recomputed below the layer: what its forward kept, and what its
    recomputation need not run, by operator and call count (``None``: run again). ``hooks``:
    the step's saved-tensor hooks the kept outputs go through (None: a step without hooks;
    they are held as they are)."""

    def __init__(self, hooks: Hooks | None, keep: Callable[[Any], bool] = ops.kept,
                 choice: Choice | None = None) -> None:
        self.hooks = hooks
        self.keep = keep  # which operators' outputs are kept (tests choose others)
        self.choice = choice  # the block's (None: its matrix products' outputs, every call)
        self.chosen = None if choice is None else choice.kept
        # each call's traffic and outputs are only read by a choice still to be made (its
        # traffic with a weight)
        choosing = choice is not None and self.chosen is None
        self.flow = Dataflow(weighing=choosing and choice.weight > 0, watching=choosing)
        self.made: list[_Kept] = []  # in the order made
        self.whole = False  # a first run without autograd left nothing to give back
        self.mode: Lean | None = None  # that first run's, until it closes
        # each operator's calls, by index in the flow, in order (while the block runs); after
        # it returned, each: kept, not run, or run (None)
        self.calls: dict[Any, list[Any]] = defaultdict(list)
        self.dead: dict[int, _Dead] = {}  # every call's placeholder, until the block returns

    def contexts(self) -> tuple[TorchDispatchMode, contextlib.AbstractContextManager]:
        """checkpoint's ``context_fn``: the forward's mode, and nothing for the
        recomputation, which enters :meth:`recomputing` itself, inside what puts the block's
        state back as its first run found it (whose own operators are not the block's)."""
        return Keeping(self), contextlib.nullcontext()

    def recomputing(self) -> Recomputing:
        """The mode a recomputation of the block runs under."""
        return Recomputing(self)

    def close(self, output: Any) -> None:
        """After the block's forward: recompute what was changed in place since it was kept,
        or is (a view of) what the block returns, or was far cheaper to make than the rest
        (``ops.dear``); do not run again, nor keep, what nothing saved needs
        (``dataflow.py``); pass the rest through the step's pack hook, in the order made.
        The block's first forward makes its ``Choice``."""
        returned = _returned(output) + self.flow.held()
        stay = settle(self.flow, self.made, returned)
        given = {k.index: k for k, ok in zip(self.made, stay, strict=True) if ok}
        if self.choice is not None:
            if self.chosen is None:
                self.choice.make(self.flow, set(given), returned, self.calls)
            else:
                self.choice.check(self.flow)
        runs = self.flow.runs(given)
        for calls in self.calls.values():
            calls[:] = [given.get(i) or (None if runs[i] else self.dead[i]) for i in calls]
        if self.chosen is not None and self.choice.kept is not None:
            self.choice.settled = {func: tuple(map(_mark, calls))
                                   for func, calls in self.calls.items()}
        self.made = [k for k, ok in zip(self.made, stay, strict=True) if ok]
        self.dead = {}
        self._pack()

    def lean(self) -> Lean:
        """The mode a first run without autograd runs under (its choice ``settled``)."""
        self.mode = Lean(self)
        return self.mode

    def close_lean(self, output: Any) -> None:
        """After the block's first run without autograd (under :meth:`lean`): where it ran
        the operators its choice was settled from, and its kept outputs are as they were made
        and not returned, they go through the step's pack hook; else (``whole``) its
        recomputation runs everything again, and the next forward chooses again."""
        mode, self.mode = self.mode, None
        fresh = staying(self.made, _returned(output), mode.changed())
        if tuple(mode.funcs) != self.choice.funcs or mode.unsettled or not all(fresh):
            self.whole = True
            self.made, self.calls = [], defaultdict(list)
            self.choice.forget()
        self._pack()

    def _pack(self) -> None:
        if self.hooks is not None:
            pack = self.hooks[0]
            for k in self.made:
                k.values = [v if version is None else pack(v)
                            for v, version in zip(k.values, k.versions, strict=True)]

    def recomputed(self) -> None:
        """After a recomputation, unless backward keeps the graph for another: let go of the
        kept outputs' handles, so that what they hold (their payloads in host memory) goes
        as the block's backward ends. A block run first without autograd is held by the
        step's graph until that goes, and its region with it."""
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            for k in self.made:
                k.values = [v if version is None else None
                            for v, version in zip(k.values, k.versions, strict=True)]

    def given_back(self, k: _Kept) -> Any:
        """A kept call's outputs for its recomputation: unpacked, each a new alias."""
        values = k.values
        if self.hooks is not None:
            unpack = self.hooks[1]
            values = [v if version is None else unpack(v)
                      for v, version in zip(values, k.versions, strict=True)]
        values = [_detached(v) for v in values]
        return values[0] if k.spec is None else tree_unflatten(values, k.spec)


KEPT, DEAD, RUN = "kept", "dead", "run"


class Settled(NamedTuple):
    """What a recomputation does with one call (``kind``: KEPT, DEAD or RUN), kept or not
    run, the layout of what the call made (``made``: ``_made``), and kept, whether autograd
    saved a tensor on what it made (``_Kept.saved``)."""

    kind: str
    made: Any = None
    saved: bool = False


_RUN = Settled(RUN)


def _mark(entry: Any) -> Settled:
    """One call of ``Region.calls``, settled."""
    if isinstance(entry, _Kept):
        return Settled(KEPT, _made(entry), entry.saved)
    return Settled(DEAD, entry.outputs) if isinstance(entry, _Dead) else _RUN


def _made(kept: _Kept) -> tuple[_Empty, ...]:
    """Each output tensor's layout."""
    return tuple(_Empty.of(t) for t, _ in kept.tensors())


# The attention forwards that, without autograd, leave out the log-sum-exp their backward
# reads (argument ``compute_log_sumexp``, by position): a first run without autograd asks for
# it as autograd's run does (the same kernel; its output the same bits).
_WITH_AUTOGRAD = {torch.ops.aten._scaled_dot_product_efficient_attention.default: 4,
                  torch.ops.aten._scaled_dot_product_cudnn_attention.default: 4}


def _returned(output: Any) -> list[torch.Tensor]:
    """The tensors a block returned: in the containers pytree knows, and in the attributes of
    other objects (an output class of the model's own, which pytree takes for a leaf), but
    modules' (the caller may change any of these in place)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [output]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif hasattr(leaf, "__dict__") and not isinstance(leaf, (type, torch.nn.Module)):
                todo.append(vars(leaf))
    return found


def _rng_states(func: Any, args: tuple, kwargs: dict) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The states of the generators a random operator drew from: the one it was given, else
    the default generators of the CPU and of its device."""
    given = kwargs.get("generator")
    if isinstance(given, torch.Generator):
        return [(given, given.get_state())]
    generators = [torch.default_generator]
    device = next((t.device for t in ops.arguments(args, kwargs) if t.device.type != "cpu"), None)
    if device is not None and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        generators.append(torch.cuda.default_generators[index])
    return [(g, g.get_state()) for g in generators]


# What reads a tensor's values on the host without an operator (``.item()`` and ``bool()``
# run one, which the dataflow sees).
_HOST_READS = frozenset({"tolist", "numpy", "__array__", "__dlpack__"})


class HostReads(TorchFunctionMode):
    """Tells a block's dataflow (``flow``) of each tensor its forward reads on the host
    without an operator (``.tolist()``, ``.numpy()``: a MoE's token counts): needed as what
    autograd saved is, so that its recomputation makes it again (or keeps it), never a
    placeholder read as garbage."""

    def __init__(self, flow: Dataflow) -> None:
        super().__init__()
        self.flow = flow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__name__", "") in _HOST_READS and args
                and isinstance(args[0], torch.Tensor)):
            self.flow.saved(args[0])
        return func(*args, **(kwargs or {}))


class _HearingHostReads:
    """A dispatch mode whose dataflow (``_flow()``) hears of the host's reads too
    (``HostReads``, entered with it)."""

    def _flow(self) -> Dataflow:
        raise NotImplementedError

    def __enter__(self):
        self._reads = HostReads(self._flow()).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._reads.__exit__(*exc)
        return out


class _SeeingSaves(TorchDispatchMode):
    """A dispatch mode that also sees, through the innermost saved-tensor hooks it finds as
    it is entered, each tensor autograd saves, for a ``Dataflow`` (``saw``). Where other hooks
    are pushed inside (a checkpoint within the block), it cannot see what they save, and says
    so (``blind``): then everything runs again."""

    def __init__(self) -> None:
        super().__init__()
        self.blind = False
        self._hooks: contextlib.AbstractContextManager | None = None
        self._ours: Any = None

    def saw(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def __enter__(self):
        found = top_hooks()
        if found is None:
            self.blind = True
        else:
            pack, unpack = found

            def seeing(t: torch.Tensor) -> Any:
                self.saw(t)
                return pack(t)

            self._ours = seeing
            self._hooks = torch.autograd.graph.saved_tensors_hooks(seeing, unpack)
            self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = self._ours = None  # ``seeing`` holds this mode: no cycle left behind
        return out

    def seen(self) -> bool:
        """Whether what autograd saves now goes through :meth:`saw` (else: ``blind``)."""
        found = top_hooks()
        if found is None or found[0] is not self._ours:
            self.blind = True
        return not self.blind


class Keeping(_HearingHostReads, _SeeingSaves):
    """The forward of a block recomputed below the layer: keeps the kept operators'
    outputs, and records its dataflow (module docstring)."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def saw(self, t: torch.Tensor) -> None:
        self.region.flow.saved(t)

    def _flow(self) -> Dataflow:
        return self.region.flow

    def __exit__(self, *exc):
        if self.blind:
            self.region.flow.blind = True
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        facts = ops.facts(func)
        if facts.ignored:
            return out
        region = self.region
        if torch.is_grad_enabled():
            self.seen()
        inputs = ops.arguments(args, kwargs)
        if ops.uncounted(facts, args):  # run again in any case (``dataflow.py``)
            region.flow.record(func, inputs, ops.leaves(out))
            return out
        calls, chosen = region.calls[func], region.chosen
        if chosen is None:
            kept = region.keep(func) or ops.reduction(func, inputs, out)
        else:
            kept = (func, len(calls)) in chosen
        index = region.flow.record(func, inputs, ops.leaves(out), kept)
        calls.append(index)
        region.dead[index] = _Dead.of(out)
        if kept:
            region.made.append(_Kept.of(
                func, args, kwargs, out, facts.random,
                math.inf if chosen is not None else ops.work_per_byte(func, args, kwargs, out),
                index))
        return out


class _Eager:
    """A dispatch mode that never runs while ``torch.compile`` traces (a compiled block is
    recomputed whole, by a unit that is not ``lean``): its ``__torch_dispatch__`` is spared
    the wrapper that keeps Dynamo out of it, a few microseconds on every operator."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class Lean(_Eager, TorchDispatchMode):
    """The first run without autograd of a block recomputed below the layer, its choice
    settled: keeps the outputs of the calls the choice settled as kept and the shapes of
    those its recomputation does not run, and records the operators it runs, to be checked
    against the choice's (``Region.close_lean``). No dataflow: autograd saves nothing."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        # For each settled operator all its calls need, found with one lookup (an operator's
        # hash is a Python call): its marks, the argument autograd's run passes as True, whether
        # it writes in place, the region's list of its calls, and whether it casts (a cast
        # of a weight is uncounted).
        self.settled = {func: (marks, _WITH_AUTOGRAD.get(func), ops.facts(func).mutable,
                               region.calls[func], ops.facts(func).cast)
                        for func, marks in region.choice.settled.items()}
        self.funcs: list[Any] = []
        self.unsettled = False  # an operator called more often than the choice settled
        self.written: dict[int, int] = {}  # each storage changed in place: the latest call's

    def changed(self) -> set[int]:
        """The calls whose kept outputs a later call changed in place (its storage written,
        maybe through an alias that shares no version): ``Dataflow``'s ``changed``, without
        a dataflow."""
        return {k.index for k in self.region.made for t, _ in k.tensors()
                if self.written.get(storage_key(t), k.index) > k.index}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        settled = self.settled.get(func)  # None: ignored, uncounted, or not settled
        if settled is None or (settled[4] and ops.uncounted(ops.facts(func), args)):
            out = func(*args, **kwargs)
            facts = ops.facts(func)
            if not (facts.ignored or ops.uncounted(facts, args)):
                self.funcs.append(func)
                self.unsettled = True
            return out
        marks, at, mutable, calls, _ = settled
        if at is not None:
            args = (*args[:at], True, *args[at + 1:])
        out = func(*args, **kwargs)
        self.funcs.append(func)
        if mutable:
            for t in ops.written(func, args, kwargs):
                self.written[storage_key(t)] = len(self.funcs)
        if len(calls) >= len(marks):
            self.unsettled = True
            return out
        mark = marks[len(calls)]
        if mark is _RUN:
            calls.append(None)
            return out
        if mark.kind is DEAD:
            entry = _Dead.of(out)
            made = entry.outputs
        else:
            entry = _Kept.of(func, args, kwargs, out, ops.facts(func).random, math.inf,
                             len(self.funcs))
            entry.saved = mark.saved
            self.region.made.append(entry)
            made = _made(entry)
        calls.append(entry)
        if made != mark.made:  # its outputs' shapes differ without autograd
            self.unsettled = True
        return out


class Recomputing(_Eager, _SeeingSaves):
    """The recomputation of a block below the layer: runs what was not kept and is needed,
    gives back what was kept, puts placeholders where nothing needs an output (module
    docstring); an operator that reads a placeholder, or a save of one, raises."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        # each operator's facts, its calls in the block's first run and how many ran again
        # (one lookup per call: an operator's hash is a Python call)
        self.seen: dict[Any, list[Any]] = {}
        self.tainted = Tainted()

    def saw(self, t: torch.Tensor) -> None:
        if self.tainted.among((t,)):
            raise RuntimeError(_DIFFERENT)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.region.recomputed()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = self.seen.get(func)
        if seen is None:
            seen = self.seen[func] = [ops.facts(func), self.region.calls.get(func, ()), 0]
        facts, calls, i = seen
        if facts.ignored:
            return func(*args, **kwargs)
        if ops.uncounted(facts, args):
            return self._run(func, args, kwargs)
        # Matched by operator and call count, but a weight's casts: they may run more often
        # than the first time (autocast casts a weight again that its first run found cached
        # by an earlier call of the block, in the same forward).
        seen[2] = i + 1
        if i >= len(calls):
            if self.region.keep(func):
                raise RuntimeError(
                    f"cswap: recomputing a block below the layer ran {func} more often than "
                    "its forward did: the block's forward is not deterministic in the matrix "
                    "products, attention and convolutions it runs; recompute it whole instead")
            return self._run(func, args, kwargs)
        entry = calls[i]
        if entry is None:
            return self._run(func, args, kwargs)
        if isinstance(entry, _Dead):
            return entry.placeholder(self.tainted)
        out = self.region.given_back(entry)
        for generator, state in entry.rng or ():
            generator.set_state(state)
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if self.tainted.keys:
            read = {storage_key(t) for t in ops.arguments(args, kwargs)}
            # a view of a placeholder shares its storage, and so its taint
            if not self.tainted.keys.isdisjoint(read) and any(
                    storage_key(t) not in read for t in ops.tensors(out)):
                raise RuntimeError(_DIFFERENT)
        return out


_DIFFERENT = ("cswap: recomputing a block below the layer, its forward ran differently than "
              "the first time (an operator read an output the first run found nothing needed); "
              "recompute the block whole instead")


class Way(NamedTuple):
    """What recomputing a block below the layer one way (its ``Choice``) keeps and runs
    again, seen by an ``Observer``: the bytes of each storage kept, the dtype of the largest,
    the share of its untimed operators' traffic it runs again, and the (start, end) stamps of
    the timed operators it runs again."""

    kept: tuple[int, ...]
    dtype: str
    share: float
    stamps: list[tuple[Any, Any]]


class Observer(_HearingHostReads, TorchDispatchMode):
    """What recomputing a block below the layer would keep and cost, each way, seen while it
    runs plainly (the engine's measured steps), and the block's ``Choice`` for each way made
    from it: its dataflow (the step's pack hook tells it what autograd saves: :meth:`saw`),
    each matrix product's, attention's, convolution's and reduction's outputs (held until
    :meth:`finish`, to see whether they were changed in place) and work per byte, and clock
    stamps before and after each matrix product, attention and convolution. A way's
    recomputation costs the timed operators it runs again and, of the block's other time, the
    share of their traffic (bytes read and written) it runs again: a stamp around every
    operator would cost more than it tells, and elementwise work takes time by its bytes.
    Operators on another device than the block's (the engine's copies to host memory) are
    not the block's."""

    def __init__(self, clock: Any, device: torch.device,
                 keep: Callable[[Any], bool] = ops.kept,
                 choices: Sequence[Choice] | None = None) -> None:
        super().__init__()
        self.clock, self.device, self.keep = clock, device, keep
        # the block's, one a way, made at :meth:`finish`
        self.choices = choices or [Choice(weight) for weight in WEIGHTS]
        self.paused = 0  # while above 0 (the step's pack hook runs), operators are not the block's
        self.start = clock.now()
        self.flow = Dataflow(watching=True)
        self.calls: dict[Any, list[int]] = defaultdict(list)  # each operator's, but uncounted
        self.kept: list[_Kept] = []  # each kept call, with its work per byte
        # the stamps before and after each kept matrix product, attention or convolution
        self.stamps: dict[int, tuple[Any, Any]] = {}

    def saw(self, t: torch.Tensor) -> None:
        """Autograd saved ``t``."""
        self.flow.saved(t)

    def _flow(self) -> Dataflow:
        return self.flow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        facts = ops.facts(func)
        if facts.ignored or self.paused:
            return func(*args, **kwargs)
        inputs = ops.arguments(args, kwargs)
        device = self.device
        if any(t.device != device for t in inputs):
            return func(*args, **kwargs)
        timed = self.keep(func)
        before = self.clock.now() if timed else None
        out = func(*args, **kwargs)
        kept = timed or ops.reduction(func, inputs, out)
        values = ops.leaves(out)
        index = self.flow.record(func, inputs, values, kept)
        if not self.flow.calls[index].uncounted:
            self.calls[func].append(index)
        if timed:
            self.stamps[index] = (before, self.clock.now())
        if kept:
            self.kept.append(_Kept.of(func, args, kwargs, out, False,
                                      ops.work_per_byte(func, args, kwargs, out), index))
        return out

    def finish(self, output: Any) -> tuple[list[Way], list[tuple[Any, Any]], Any]:
        """After the block returned ``output``: the block's choices made; each one's ``Way``,
        the stamps of every timed operator, and the block's start stamp."""
        flow = self.flow
        returned = _returned(output) + flow.held()
        stay = settle(flow, self.kept, returned)
        given = {k.index for k, ok in zip(self.kept, stay, strict=True) if ok}
        untimed = [i for i, c in enumerate(flow.calls) if i not in self.stamps and c.touched]
        traffic = sum(flow.calls[i].touched for i in untimed)
        ways = []
        for choice in self.choices:
            cut = choice.make(flow, given, returned, self.calls)
            runs = flow.runs(cut)
            kept, dtype = flow.keeps(cut)
            again = sum(flow.calls[i].touched for i in untimed if runs[i])
            ways.append(Way(kept, "" if dtype is None else str(dtype).removeprefix("torch."),
                            again / traffic if traffic else 0.0,
                            [stamp for i, stamp in self.stamps.items() if runs[i]]))
        stamps = list(self.stamps.values())
        self.kept, self.stamps, self.flow = [], {}, Dataflow(watching=True)
        self.calls = defaultdict(list)
        return ways, stamps, self.start
