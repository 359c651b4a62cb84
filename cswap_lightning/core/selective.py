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
  ``addmm``, ``bmm``, the fused attention kernels, ``convolution``), each once, in order;
  everything else the block saves goes to checkpoint's own hooks and is dropped. When the
  block returns, its kept outputs go through the step's saved-tensor hooks, one site each
  (torch's policy keeps them in a cache of its own, out of any hook's reach): the planner can
  swap them like any saved tensor, and the engine's ledger counts them;
- in backward, ``Recomputing`` runs the block's forward again and, for each kept operator,
  gives back its output through the step's unpack hook instead of running it.

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
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..planning import ops

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def _detached(x: Any) -> Any:
    """A tensor as a new alias autograd can give a history of its own (sharing the version
    counter), as checkpoint's selective policy detaches what it caches: views made beneath
    autograd need the ADInplaceOrView key to share the counter."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


@dataclass
class _Kept:
    """One kept operator call: its outputs (flattened: tensors, then their handles once
    packed) and their structure, each tensor's version when made (None where no tensor), and
    the RNG states after it (where it draws random numbers)."""

    values: list[Any]
    spec: Any
    versions: list[int | None]
    rng: list[tuple[torch.Generator, torch.Tensor]] | None
    cost: float  # its operator's work per byte of output (``ops.work_per_byte``)

    def tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Its output tensors, each with its version when made."""
        return [(v, version) for v, version in zip(self.values, self.versions, strict=True)
                if version is not None]


def staying(calls: Sequence[tuple[Iterable[tuple[torch.Tensor, int]], float]], output: Any
            ) -> list[bool]:
    """Which kept calls (each: its output tensors with their versions when made, and its
    operator's work per byte) stay kept once the block returned ``output``: those none of
    whose outputs was changed in place since or is (a view of) what the block returns, and
    not far cheaper to make than the rest (``ops.dear``)."""
    returned = {t.untyped_storage()._cdata for t in _returned(output)}
    fresh = [not any(t._version != v or t.untyped_storage()._cdata in returned
                     for t, v in tensors) for tensors, _ in calls]
    dear = iter(ops.dear([cost for (_, cost), ok in zip(calls, fresh, strict=True) if ok]))
    return [ok and next(dear) for ok in fresh]


class Region:
    """One call of a block recomputed below the layer: what its forward kept, by kept operator
    and call count (``None``: run again). ``hooks``: the step's saved-tensor hooks the kept
    outputs go through (None: a step without hooks; they are held as they are)."""

    def __init__(self, hooks: Hooks | None, keep: Callable[[Any], bool] = ops.kept) -> None:
        self.hooks = hooks
        self.keep = keep  # which operators' outputs are kept (tests choose others)
        self.calls: dict[Any, list[_Kept | None]] = defaultdict(list)
        self.made: list[_Kept] = []  # in the order made

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
        (``ops.dear``); pass the rest through the step's pack hook, in the order made."""
        keep = staying([(k.tensors(), k.cost) for k in self.made], output)
        dropped = {id(k) for k, ok in zip(self.made, keep, strict=True) if not ok}
        for calls in self.calls.values():
            calls[:] = [None if k is None or id(k) in dropped else k for k in calls]
        self.made = [k for k in self.made if id(k) not in dropped]
        if self.hooks is not None:
            pack = self.hooks[0]
            for k in self.made:
                k.values = [v if version is None else pack(v)
                            for v, version in zip(k.values, k.versions, strict=True)]

    def given_back(self, k: _Kept) -> Any:
        """A kept call's outputs for its recomputation: unpacked, each a new alias."""
        values = k.values
        if self.hooks is not None:
            unpack = self.hooks[1]
            values = [v if version is None else unpack(v)
                      for v, version in zip(values, k.versions, strict=True)]
        return tree_unflatten([_detached(v) for v in values], k.spec)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


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
    device = next((t.device for t in _tensors((args, kwargs)) if t.device.type != "cpu"), None)
    if device is not None and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        generators.append(torch.cuda.default_generators[index])
    return [(g, g.get_state()) for g in generators]


class Keeping(TorchDispatchMode):
    """The forward of a block recomputed below the layer: keeps the kept operators'
    outputs (module docstring)."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS or not self.region.keep(func):
            return out
        flat, spec = tree_flatten(out)
        rng = (_rng_states(func, args, kwargs)
               if torch.Tag.nondeterministic_seeded in func.tags else None)
        values = [_detached(v) for v in flat]
        k = _Kept(values, spec, [v._version if isinstance(v, torch.Tensor) else None
                                 for v in values], rng,
                  ops.work_per_byte(func, args, kwargs, out))
        self.region.calls[func].append(k)
        self.region.made.append(k)
        return out


class Recomputing(TorchDispatchMode):
    """The recomputation of a block below the layer: runs what was not kept, gives back what
    was (module docstring)."""

    def __init__(self, region: Region) -> None:
        super().__init__()
        self.region = region
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Only the kept operators are matched, by call count: the others may run more often
        # than the first time (autocast casts a weight again that its first run found cached
        # by an earlier call of the block, in the same forward).
        if func in SAC_IGNORED_OPS or not self.region.keep(func):
            return func(*args, **kwargs)
        i = self.counts[func]
        self.counts[func] += 1
        calls = self.region.calls.get(func)
        if calls is None or i >= len(calls):
            raise RuntimeError(
                f"cswap: recomputing a block below the layer ran {func} more often than its "
                "forward did: the block's forward is not deterministic in the matrix products, "
                "attention and convolutions it runs; recompute it whole instead")
        k = calls[i]
        if k is None:
            return func(*args, **kwargs)
        out = self.region.given_back(k)
        for generator, state in k.rng or ():
            generator.set_state(state)
        return out


class Observer(TorchDispatchMode):
    """What recomputing a block below the layer would keep and cost, seen while it runs
    plainly (the engine's measured steps): each kept operator's outputs (held until
    :meth:`finish`, so that no storage is counted twice at a reused address), its work per
    byte, and clock stamps before and after it; the rest of the block's time is what its
    recomputation costs. Operators on another device than the block's (the engine's copies
    to host memory) are not the block's."""

    def __init__(self, clock: Any, device: torch.device,
                 keep: Callable[[Any], bool] = ops.kept) -> None:
        super().__init__()
        self.clock, self.device, self.keep = clock, device, keep
        self.start = clock.now()
        # each kept operator: its outputs with their versions, work per byte, stamps
        self.calls: list[tuple[list[tuple[torch.Tensor, int]], float, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in SAC_IGNORED_OPS or not self.keep(func)
                or any(t.device != self.device for t in _tensors((args, kwargs)))):
            return func(*args, **kwargs)
        before = self.clock.now()
        out = func(*args, **kwargs)
        self.calls.append(([(t, t._version) for t in _tensors(out)],
                           ops.work_per_byte(func, args, kwargs, out), before,
                           self.clock.now()))
        return out

    def finish(self, output: Any) -> tuple[tuple[int, ...], str, list[tuple[Any, Any]], Any]:
        """After the block returned ``output``: the bytes of each storage its recomputation
        would keep (each once; not what it returns, changed in place, or was far cheaper to
        make, as ``Region.close``), the dtype of the largest, the (start, end) stamps of the
        operators kept, and the block's start stamp: its recomputation costs its time but
        theirs."""
        calls = [c for c, ok in zip(self.calls, staying([c[:2] for c in self.calls], output),
                                    strict=True) if ok]
        self.calls = []
        kept: dict[int, torch.Tensor] = {}
        for outputs, *_ in calls:
            for t, _ in outputs:
                kept.setdefault(t.untyped_storage()._cdata, t)
        largest = max(kept.values(), key=lambda t: t.untyped_storage().nbytes(), default=None)
        dtype = "" if largest is None else str(largest.dtype).removeprefix("torch.")
        return (tuple(t.untyped_storage().nbytes() for t in kept.values()), dtype,
                [(before, after) for *_, before, after in calls], self.start)
