"""Recompute chosen blocks of a model in backward instead of keeping what they save.

A chosen block runs under non-reentrant ``torch.utils.checkpoint``: autograd keeps only the
block's tensor inputs, saved through the saved-tensor hooks around it (the engine's, so they
are kept or swapped like any saved tensor); everything the block itself saves goes to the
checkpoint's own hooks, is dropped, and is computed again, with the block's RNG state, when
backward first needs it. Nothing in the user's code changes: each chosen block's ``forward``
(for a stage, its ``nn.Sequential``'s) is replaced on the instance, as ``compile_blocks`` does,
so module names, ``state_dict`` keys and hooks stay as they are.

The units that can be recomputed are the blocks ``compile_blocks`` finds (``compile.blocks``: a
transformer's layers, the children of an ``nn.Sequential``) and, where an ``nn.Sequential``
holds plain layers (a VGG), its stages: the layers up to and including each max-pool. A single
convolution would gain nothing: it saves its input anyway. Inside a block, its activation
modules are units too, cheap to run again: one made of several elementwise operations (GPT-2's
``gelu_new`` saves four tensors) keeps only its input when recomputed; one of a single
operation gains nothing, as the block timer's counts show.

A block can also be recomputed *below the layer* (``selective.py``), named
``"block:elementwise"``: its matrix products', attention's and convolutions' outputs are kept,
through the engine's hooks like its inputs, and only its elementwise work runs again (or, a
way weighed by the planner, less of it: ``Recompute.weights``).

The engine arms the chosen blocks only for the steps it does not measure (the planner measures
the plain blocks), and on measured steps a :class:`BlockTimer` records what each unit saved and
how long its forward took, and for each block what recomputing it below the layer would keep
and cost, each way (``selective.Observer``).
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.pooling import _AdaptiveMaxPoolNd, _MaxPoolNd
from torch.utils.checkpoint import checkpoint

from ..planning.dataflow import WEIGHTS
from ..planning.profiler import Clock
from ..planning.workload import BELOW, Below
from .compile import containers, is_compiled
from .lean import SUBCLASS, WHOLE_ELSEWHERE, Verdicts, Watch, rerun
from .lean import parameters as lean_parameters
from .rerun import (
    Buffer,
    CacheStates,
    FirstRun,
    Parts,
    as_first,
    drawn,
    generators_among,
    host_generators,
    norm_buffers,
    plain_state,
    rerun_hooks,
    reruns,
)
from .saved_hooks import in_transform, top_hooks
from .selective import Choice, Observer, Region, signature
from .tensors import of_a_leaf, version_probe

_STAGE_ENDS = (_MaxPoolNd, _AdaptiveMaxPoolNd)  # as the replay cuts a Sequential's stages


@dataclass(frozen=True)
class Unit:
    """What runs under one checkpoint: a block (``module``), or the stage ``span`` of the
    children of the ``nn.Sequential`` ``module``, named ``"seq[i:j]"`` (``"[i:j]"`` at the
    root); ``below``: a block recomputed below the layer (its elementwise work only), named
    ``"block:elementwise"``."""

    name: str
    module: nn.Module
    span: range | None = None
    below: bool = False

    @property
    def key(self) -> str:
        """The unit's name as the block timer knows it: the block's, for either way."""
        return self.name.removesuffix(BELOW)

    def modules(self) -> list[nn.Module]:
        """The block, or the stage's layers."""
        if self.span is None:
            return [self.module]
        children = list(self.module.children())
        return children[self.span.start:self.span.stop]


def units(model: nn.Module) -> dict[str, Unit]:
    """The units of ``model`` that can be recomputed, by name: each element of its outermost
    ``nn.ModuleList``s; or, without one, each child of its outermost ``nn.Sequential``s that
    has children of its own (a ResNet bottleneck), and each stage of their plain layers (a
    VGG stage, ending at a max-pool; the layers after the last max-pool are no unit); and the
    activation modules inside those blocks (not in place). None inside a compiled module:
    ``torch.compile`` traces them (a block ``compile_blocks`` compiled is a unit, its
    activations are not)."""
    names = {id(m): name for name, m in model.named_modules()}
    found: dict[str, Unit] = {}
    for container in containers(model):
        prefix = names[id(container)]
        children = list(container.children())
        stages = (isinstance(container, nn.Sequential)
                  and type(container).forward is nn.Sequential.forward)
        start = 0
        for i, child in enumerate(children):
            composite = next(child.children(), None) is not None
            if not stages or composite:
                found.setdefault(names[id(child)], Unit(names[id(child)], child))
                start = i + 1
            elif isinstance(child, _STAGE_ENDS):
                name = f"{prefix}[{start}:{i + 1}]"
                found[name] = Unit(name, container, range(start, i + 1))
                start = i + 1
    for block in [u for u in found.values() if u.span is None]:
        for name, module in block.module.named_modules(prefix=block.name):
            if module is not block.module and _activation(module):
                found.setdefault(name, Unit(name, module))
    traced = _traced(model)
    return {name: unit for name, unit in found.items()
            if not any(id(m) in traced for m in unit.modules())}


def outermost(names: Iterable[str]) -> list[str]:
    """The units among ``names`` inside no other: the blocks and stages, not their
    activations."""
    names = list(names)
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names)]


def below(found: dict[str, Unit]) -> dict[str, Unit]:
    """Each block among ``found`` (not a stage, not inside another unit) recomputed below the
    layer, by name (``"block:elementwise"``)."""
    return {f"{name}{BELOW}": Unit(f"{name}{BELOW}", found[name].module, None, True)
            for name in outermost(found) if found[name].span is None}


def _traced(model: nn.Module) -> set[int]:
    """The modules of ``model`` inside a compiled one (none where Dynamo was never loaded:
    nothing is compiled, and loading it costs a second)."""
    if "torch._dynamo" not in sys.modules:
        return set()
    return {id(m) for c in model.modules() if is_compiled(c) for m in c.modules() if m is not c}


def _activation(module: nn.Module) -> bool:
    """An activation module of torch's or Hugging Face's, not in place (checkpoint keeps its
    input, which it would change)."""
    kind = type(module).__module__
    return ((kind == "torch.nn.modules.activation" or kind.startswith("transformers.activations"))
            and next(module.children(), None) is None and not getattr(module, "inplace", False))



class Recompute:
    """Which units of a model run under checkpoint: the chosen ones, while :meth:`arm`\\ ed.

    :meth:`choose` wraps the chosen units' ``forward`` (idempotently) and gives back the others'.
    A wrapped unit runs plainly unless the Recompute is armed, gradients are on, the step's
    saved-tensor hooks are the innermost ones, and the model's own gradient checkpointing
    (Hugging Face's ``gradient_checkpointing``) is off for it. It holds the model weakly.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.chosen: dict[str, Unit] = {}
        self._inside: dict[str, list[nn.Module]] = {}  # a chosen unit's modules, but a block
        # Units measured not to be recomputable, with why (``BlockTimer``).
        self.unfit: dict[str, str] = {}
        # The buffers and plain attributes each unit's forward was measured to change, or
        # found changed after it returned, named within its module (a stage's: within its
        # nn.Sequential): its recomputation is shown their values from before its first run.
        self.changed: dict[str, set[str]] = {}
        # The host generators (``rerun.host_generators``) each unit's forward was measured to
        # draw from: its recomputation gets their states back as its first run found them.
        self.draws: dict[str, set[str]] = {}
        # what each block's recomputations below the layer keep, each way (by the block's
        # name, the way's weight and its calls' ``selective.signature``), and the weight each
        # block is recomputed with
        self.choices: dict[tuple[str, float, tuple], Choice] = {}
        self.weights: dict[str, float] = {}
        # whether each unit's first run goes without autograd (``lean.py``)
        self.verdicts = Verdicts(self._model)
        self.armed = False
        self.hooks: tuple[Callable, Callable] | None = None  # the step's, when armed
        self.witness: Witness | None = None  # the step's, when armed

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    def choice(self, block: str, weight: float | None = None, kind: tuple = ()) -> Choice:
        """What the block's recomputations below the layer keep (``selective.Choice``) with
        ``weight`` (None: the one it is recomputed with), for its calls of ``kind`` (their
        arguments' ``selective.signature``)."""
        if weight is None:
            weight = self.weights.get(block, 0.0)
        return self.choices.setdefault((block, weight, kind), Choice(weight))

    def units(self) -> dict[str, Unit]:
        """The model's units (none once the model is gone)."""
        model = self.model
        return units(model) if model is not None else {}

    def choose(self, names: Iterable[str], weights: Mapping[str, float] | None = None
               ) -> dict[str, str]:
        """Recompute these units (and no others) whenever armed (a block's name with
        ``":elementwise"``: that block below the layer, kept as ``Dataflow.cut`` chooses with
        the weight ``weights`` gives it, else 0: the fewest bytes); returns the names skipped,
        with why. Raises ``ValueError`` for a name that is no unit of the model, or a weight
        for a name not chosen below the layer."""
        found = self.units()
        found |= below(found)
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in found]
        if unknown:
            raise ValueError(
                f"cswap: {', '.join(map(repr, unknown))} is not a block this model can recompute; "
                f"its blocks are {_listed(found)} (a block's name with {BELOW!r}: its "
                "elementwise work only)")
        weights = dict(weights or {})
        stray = [n for n in weights if n not in names or not found[n].below]
        if stray:
            raise ValueError(f"cswap: weights given for {', '.join(map(repr, stray))}, which "
                             f"{'is' if len(stray) == 1 else 'are'} not chosen below the layer; "
                             f"name a chosen block with {BELOW!r}")
        bad = {n: w for n, w in weights.items() if not w >= 0}
        if bad:
            raise ValueError(f"cswap: a weight is at least 0 (0: the fewest bytes kept), got "
                             f"{bad}")
        self.weights = {n.removesuffix(BELOW): float(w) for n, w in weights.items()}
        skipped = {n: reason for n in names if (reason := self._unfit(found[n]))}
        outer = [n for n in names if n not in skipped and found[n].span is None]
        for name in names:
            key, below_ = found[name].key, found[name].below
            within = next((o for o in outer if key.startswith(f"{found[o].key}.")
                           or (key == found[o].key and below_ and not found[o].below)), None)
            if within is not None and name not in skipped:
                skipped[name] = (f"inside {within}, "
                                 + ("recomputed below the layer" if found[within].below
                                    else "recomputed as a whole"))
        chosen = {n: found[n] for n in names if n not in skipped}
        if chosen.keys() != self.chosen.keys():
            self.verdicts.forget()  # the chosen units are watched together
        for name in self.chosen.keys() - chosen.keys():
            self._release(self.chosen[name])
        self.chosen = chosen
        self._inside = {name: [m for top in unit.modules() for m in top.modules()
                               if unit.span is not None or m is not top]
                        for name, unit in chosen.items()}
        for unit in chosen.values():
            self._wrap(unit)
        return skipped

    def left_out(self) -> dict[str, str]:
        """Every unit of the model that is not recomputed, whatever is chosen, with why."""
        return {name: why for name, unit in self.units().items() if (why := self._unfit(unit))}

    def unfit_chosen(self) -> dict[str, str]:
        """The chosen units found unfit since they were chosen (on a measured step, or hooks
        added inside them), with why."""
        return {name: why for name, unit in self.chosen.items()
                if (why := self.unfit.get(unit.key) or _compiled_below(unit)
                    or (any(map(reruns, self._inside[name])) and _rerun_hooks(unit)))}

    def hooked(self, unit: Unit, parts: Parts) -> bool:
        """Whether forward hooks on the modules inside ``unit`` (its ``parts``) would run
        again in its recomputation, looked for at each call: hooks added since it was chosen,
        around one forward, say, and gone by backward, whose effect its recomputation would
        lose. It is unfit from now on (the next step gives it back), this call runs plainly."""
        if not any(m._forward_pre_hooks or m._forward_hooks for m in parts.called):
            return False
        why = _rerun_hooks(unit)
        if why:
            self.unfit[unit.key] = why
        return bool(why)

    def _unfit(self, unit: Unit) -> str:
        if unit.key in self.unfit:
            return self.unfit[unit.key]
        hooks = _rerun_hooks(unit) or _compiled_below(unit)
        if hooks:
            return hooks
        if _self_checkpointed([m for top in unit.modules() for m in top.modules()]):
            return "checkpointed by the model's own gradient checkpointing"
        owner = _wrapper(unit)
        if owner is not None and owner.recompute not in (None, self):
            return "recomputed by another Offloader watching this model"
        if unit.span is not None and owner is None and "forward" in unit.module.__dict__:
            return "its nn.Sequential's forward was replaced by something else"
        return ""

    def _wrap(self, unit: Unit) -> None:
        """Put the unit's wrapper in place (again, where something replaced it since)."""
        module = unit.module
        wrapper = _wrapper(unit)
        if wrapper is None:
            wrapper = (RecomputedForward(module, module.__dict__.get("forward"), self)
                       if unit.span is None else StagedForward(module, self))
            module.forward = wrapper
        wrapper.recompute = self
        if unit.span is None:
            wrapper.name, wrapper.below = unit.name, unit.below
        else:
            wrapper.spans[unit.span.start] = unit

    def _release(self, unit: Unit) -> None:
        """Give the unit its forward back (where its wrapper is still in place)."""
        wrapper = _wrapper(unit)
        if wrapper is None:
            return
        if unit.span is not None:
            wrapper.spans.pop(unit.span.start, None)
            if wrapper.spans:
                return
        if wrapper.inner_forward is None:
            del unit.module.forward
        else:
            unit.module.forward = wrapper.inner_forward

    def release(self) -> None:
        """Give every chosen unit its forward back, and choose none."""
        self.choose(())

    def unwrap(self) -> None:
        """Give every chosen unit its forward back until :meth:`arm` (the end of training:
        the model is then saved, copied or compiled as it was), still chosen."""
        for unit in self.chosen.values():
            self._release(unit)

    def arm(self, witness: Witness | None = None) -> None:
        """Recompute the chosen units from now on, where the saves would go where they go
        now (the step's hooks, or none in a step without hooks); ``witness`` (the step's
        residency ledger) is told of each recomputation backward runs and what it saves."""
        for unit in self.chosen.values():
            if _wrapper(unit) is None:  # replaced since (compile_blocks, say): wrap that
                self._wrap(unit)
        self.armed, self.hooks, self.witness = True, top_hooks(), witness
        self.verdicts.begin(self.chosen)

    def disarm(self) -> None:
        self.armed, self.hooks, self.witness = False, None, None
        self.verdicts.end()

    def on(self) -> bool:
        """Whether a wrapped unit called now runs under checkpoint: not inside a region
        ``torch.compile`` traces (a model compiled whole; Dynamo would break its graph here),
        nor inside a ``torch.func`` transform (``no_offload``)."""
        return (not torch.compiler.is_compiling() and self.armed and torch.is_grad_enabled()
                and top_hooks() == self.hooks and not in_transform())

    def changed_state(self, name: str, root: nn.Module) -> list[Buffer]:
        """The buffers and plain attributes unit ``name`` (its module, or its stage's
        ``nn.Sequential``: ``root``) was measured to change."""
        return [_state(root, where) for where in self.changed.get(name, ())]


def _state(root: nn.Module, where: str) -> Buffer:
    path, _, name = where.rpartition(".")
    return root.get_submodule(path), name


def _compiled_below(unit: Unit) -> str:
    """Why a block compiled cannot be recomputed below the layer (its operators run inside a
    compiled graph, out of the dispatch modes' reach), or ""."""
    if unit.below and is_compiled(unit.module):
        return "compiled: below the layer needs its operators run eagerly; recompute it whole"
    return ""


def _rerun_hooks(unit: Unit) -> str:
    if unit.span is None:
        return rerun_hooks([(unit.key, unit.module)], True)
    prefix = unit.name.rsplit("[", 1)[0]
    return rerun_hooks([(".".join(p for p in (prefix, str(i)) if p), layer)
                        for i, layer in zip(unit.span, unit.modules(), strict=True)], False)


class RecomputedForward:
    """A block's ``forward`` that runs it under checkpoint while its :class:`Recompute` is on.
    ``inner_forward``: the instance ``forward`` it replaced (a compiled one), or None for the
    class's. A copy or a pickle of the block gets a wrapper that never recomputes."""

    def __init__(self, block: nn.Module, inner_forward: Callable | None,
                 recompute: Recompute | None, name: str = "") -> None:
        self.block = block
        self.inner_forward = inner_forward
        self.recompute = recompute
        self.name = name  # the unit's
        self.below = False  # recomputed below the layer (``selective.py``)
        # the block's modules as a recomputation needs them: found at the first call
        # recomputed (a block being copied has no modules yet)
        self._parts: Parts | None = None

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner_forward is not None:
            return self.inner_forward(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        recompute = self.recompute
        if recompute is None or not recompute.on():
            return self.run(*args, **kwargs)
        if self._parts is None:
            self._parts = Parts.of([self.block], block=True)
        unit = recompute.chosen.get(self.name)
        if (unit is None or _self_checkpointed(self._parts.switches)
                or recompute.hooked(unit, self._parts)):
            return self.run(*args, **kwargs)
        return checkpointed(self.run, self._parts,
                            recompute.changed_state(self.name.removesuffix(BELOW), self.block),
                            args, kwargs, recompute.witness,
                            Region(recompute.hooks,
                                   choice=recompute.choice(self.name.removesuffix(BELOW),
                                                           kind=signature(args, kwargs)))
                            if self.below else None, recompute.verdicts, self.name,
                            recompute.draws.get(unit.key, ()))

    def __deepcopy__(self, memo: dict) -> RecomputedForward:
        from copy import deepcopy

        return RecomputedForward(deepcopy(self.block, memo),
                                 deepcopy(self.inner_forward, memo), None, self.name)

    def __reduce__(self) -> tuple:
        return RecomputedForward, (self.block, self.inner_forward, None, self.name)


class StagedForward:
    """An ``nn.Sequential``'s ``forward`` that runs some stages of its children (``spans``,
    by first child) under checkpoint while its :class:`Recompute` is on; each child is still
    called as a module, so its hooks run. A copy or a pickle never recomputes."""

    inner_forward = None  # only an nn.Sequential's own forward has stages

    def __init__(self, sequential: nn.Sequential, recompute: Recompute | None) -> None:
        self.sequential = sequential
        self.recompute = recompute
        self.spans: dict[int, Unit] = {}  # the stages recomputed, by first child
        self._parts: dict[int, Parts] = {}  # theirs, as a recomputation needs them

    def __call__(self, input: Any) -> Any:
        recompute = self.recompute
        if not self.spans or recompute is None or not recompute.on():
            return nn.Sequential.forward(self.sequential, input)
        children = list(self.sequential.children())
        i = 0
        while i < len(children):
            unit = self.spans.get(i)
            if unit is None:
                input = children[i](input)
                i += 1
                continue
            layers = children[unit.span.start:unit.span.stop]
            parts = self._parts.get(i)
            if parts is None or parts.modules[0] is not layers[0]:
                parts = self._parts[i] = Parts.of(layers)
            if recompute.hooked(unit, parts):
                input = _in_turn(layers, input)
                i = unit.span.stop
                continue
            input = checkpointed(partial(_in_turn, layers), parts,
                                 recompute.changed_state(unit.name, self.sequential),
                                 (input,), {}, recompute.witness, None, recompute.verdicts,
                                 unit.name, recompute.draws.get(unit.key, ()))
            i = unit.span.stop
        return input

    def __deepcopy__(self, memo: dict) -> StagedForward:
        from copy import deepcopy

        return StagedForward(deepcopy(self.sequential, memo), None)

    def __reduce__(self) -> tuple:
        return StagedForward, (self.sequential, None)


def _in_turn(layers: list[nn.Module], input: Any) -> Any:
    for layer in layers:
        input = layer(input)
    return input


def _wrapper(unit: Unit) -> RecomputedForward | StagedForward | None:
    forward = unit.module.__dict__.get("forward")
    kind = RecomputedForward if unit.span is None else StagedForward
    return forward if isinstance(forward, kind) else None


@functools.cache  # once a process
def _say_cache_on() -> None:
    warnings.warn(
        "cswap: a recomputed layer was handed a Hugging Face key-value cache in training (the "
        "model runs with use_cache=True): the cache holds every layer's keys and values until "
        "the model's output is dropped, which recomputing the layer cannot free, and each "
        "recomputation puts the cache back as it was. Hugging Face's checkpointing turns the "
        "cache off in training, as its Trainer does by default (TrainingArguments.use_cache): "
        "pass use_cache=False to the model (or set model.config.use_cache = False)",
        RuntimeWarning, stacklevel=1)


def checkpointed(run: Callable, parts: Parts, changed: list[Buffer], args: tuple,
                 kwargs: dict[str, Any], witness: Witness | None = None,
                 region: Region | None = None, verdicts: Verdicts | None = None,
                 name: str = "", draws: Iterable[str] = ()) -> Any:
    """``run(*args, **kwargs)`` recomputed in backward: its first run without autograd where
    the unit ``name``'s verdict (``verdicts``) says so (``lean.py``), else under non-reentrant
    checkpoint, watched for that verdict on its first call. Tensor keyword arguments are
    passed positionally, so that they too are saved through the hooks around it (the engine
    sees them; checkpoint would hold keyword arguments itself). A recomputation runs as the
    first run did, and changes nothing the first run changed (``rerun.as_first``: the
    ``parts``' training flags, norms and generators, the ``changed`` buffers, the generators
    and Hugging Face caches among the arguments). ``witness`` counts each recomputation and
    the storages it saves (``_witnessed``). With a ``region``, only below the layer, under
    checkpoint: the outputs of its matrix products, attention and convolutions are kept,
    through the region's hooks (``selective.py``); where its verdict and its choice of what
    to keep are made, its first run too goes without autograd (``selective.Lean``)."""
    tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    others = {k: v for k, v in kwargs.items() if k not in tensors}
    count = len(args)
    values = (*args, *kwargs.values())
    inputs = (*args, *(kwargs[k] for k in tensors))
    caches = CacheStates.of(values)
    if caches is not None:
        _say_cache_on()
    first_run = FirstRun(parts, changed, parts.generators + generators_among(values), caches,
                         draws)
    if verdicts is None or (region is not None and region.choice is None):
        verdict: str | None = "not watched"
    elif region is None and _device_type(inputs) not in verdicts.whole:
        verdict = WHOLE_ELSEWHERE
    elif any(type(t) not in (torch.Tensor, nn.Parameter) for t in inputs
             if isinstance(t, torch.Tensor)):
        verdict = SUBCLASS  # its storage and its autograd are the subclass's own
    else:
        verdict = verdicts.of(name, parts.modules)
    if verdict == "" and (region is None or region.choice.settled is not None):
        out = rerun(run, inputs, count, tensors, others, first_run, parts.modules,
                    partial(_witnessed, witness, own=True, below=region is not None),
                    partial(verdicts.second, name),
                    region, verdicts.constants.get(name, (0, ())))
        if region is not None and region.whole:
            verdicts.give(name, UNSETTLED)
        return out
    watch = None
    if verdict is None:
        watch = Watch([t for t in inputs if isinstance(t, torch.Tensor)],
                      lean_parameters(parts.modules), first_run, parts.called)
    first = True

    def body(*inputs: Any) -> Any:
        nonlocal first
        named = others | dict(zip(tensors, inputs[count:]))
        if first:
            first = False
            with watch or nullcontext():
                return run(*inputs[:count], **named)
        with (as_first(first_run), _witnessed(witness, inputs),
              nullcontext() if region is None else region.recomputing()):
            return run(*inputs[:count], **named)

    if region is None:
        out = checkpoint(body, *inputs, use_reentrant=False)
    else:
        out = checkpoint(body, *inputs, use_reentrant=False, context_fn=region.contexts)
        region.close(out)
    if watch is not None:  # outside the region's mode: the call once more is not the block's
        verdicts.watched(name, watch, out, partial(run, *args, **kwargs))
        watch = None  # ``body`` keeps the block's inputs alive through it until backward
    return out


def _device_type(inputs: tuple) -> str:
    """The device type of a unit's first tensor input (``"cpu"`` without one)."""
    return next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")


UNSETTLED = ("run without autograd, it runs other operators than its choice of what to keep "
             "below the layer was made from, or changes what it keeps")


class Witness(Protocol):
    """What is told of recomputations in backward (the step's ``Residency``)."""

    def recomputing(self) -> None: ...

    def again(self, storage: torch.UntypedStorage) -> None: ...


@contextmanager
def _witnessed(witness: Witness | None, inputs: tuple, own: bool = False,
               below: bool = False) -> Iterator[None]:
    """Tell ``witness`` of a recomputation and of each storage it saves (to checkpoint's own
    hooks, which these pass every tensor on to, unchanged; ``own``: a first run without
    autograd's recomputation, which keeps what it saves itself, whatever hooks are around
    backward, and ``below`` the layer sees what it saves through them): held until the
    block's backward uses them. The block's inputs, and weights, are the step's saved
    tensors or the model's, counted already or never."""
    hooks = top_hooks()
    if own and (hooks is not None or witness is not None or below):
        hooks = (_itself, _itself)
    elif witness is None:
        hooks = None
    if hooks is None:
        yield
        return
    pack, unpack = hooks
    if witness is None:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        return
    witness.recomputing()
    inputs_held = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}

    def counted(t: torch.Tensor) -> Any:
        if type(t) is torch.Tensor and not of_a_leaf(t):
            storage = t.untyped_storage()
            if storage._cdata not in inputs_held:
                witness.again(storage)
        return pack(t)

    with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
        yield


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _self_checkpointed(modules: Iterable[nn.Module]) -> bool:
    """Some of these modules checkpoint themselves: Hugging Face's gradient checkpointing,
    on in training."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training
               for m in modules)


def left_out_rows(left_out: dict[str, str]) -> str:
    """A row per unit not recomputed whatever is chosen (``Recompute.left_out``), with why."""
    return "\n".join(f"{name:<28} not recomputed: {why}" for name, why in left_out.items())


def _listed(found: dict[str, Unit], most: int = 8) -> str:
    names = list(found)
    if not names:
        return "none (no nn.ModuleList of layers, no nn.Sequential with blocks or max-pools)"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(map(repr, names[:most])) + more


@dataclass
class BlockCall:
    """One call of a unit on a measured step (run plainly): the sites it saved
    (``first_site`` to ``stop_site``, the step's site numbers), its tensor inputs (how many,
    their bytes: what recomputing it saves instead, as sites of their own where it starts),
    and its forward's seconds (CUDA events, or the host clock). For a block that can be
    recomputed below the layer (``selective.Observer``): what that recomputation keeps
    (its inputs, as one tensor, and the outputs kept) and costs, each way of
    ``dataflow.WEIGHTS`` (none for the other units)."""

    name: str
    first_site: int
    stop_site: int
    input_tensors: int
    input_bytes: int
    forward_s: float
    below: tuple[Below, ...] = ()


def renumbered(calls: list[BlockCall], chosen: Iterable[str], sites: int) -> dict[int, int]:
    """Where each site of a measured step (``sites`` in all, ``calls`` its block calls) is
    saved once the ``chosen`` units are recomputed: the sites inside a recomputed call are gone
    (it saves its inputs instead, new sites where it starts), the others move up or down."""
    chosen = set(chosen)
    recomputed = sorted((c.first_site, c.stop_site, c.input_tensors) for c in calls
                        if c.name in chosen)
    where: dict[int, int] = {}
    shift, site = 0, 0
    for first, stop, inputs in recomputed:
        if first < site:  # inside a unit recomputed as a whole
            continue
        where.update((s, s + shift) for s in range(site, first))
        shift += inputs - (stop - first)
        site = stop
    where.update((s, s + shift) for s in range(site, sites))
    return where


class BlockTimer:
    """Hooks around each unit of a model for one measured step: where its saves begin and end
    in the step's sites (``next_site()``), and clock stamps. It also learns what a unit's
    recomputation could not replay exactly. Some of it makes the unit unfit to recompute
    (``Recompute.unfit``): it changes an input or a parameter in place, in forward or after it
    returns (checkpoint keeps the inputs, and backward would find them changed; a
    recomputation would read the parameter changed), or it runs under saved-tensor hooks other
    than the step's (an outer checkpoint, ``save_on_cpu``). The rest is put back for its
    recomputation (``Recompute.changed``): the buffers its forward changes, or that change
    after it returns (norms' running statistics apart, put back in any case). What changes
    after a unit returns is looked for at the end of forward and as backward starts."""

    def __init__(self, recompute: Recompute, next_site: Callable[[], int]) -> None:
        self.recompute = recompute
        self.next_site = next_site
        self.hooks = top_hooks()
        self.clock: Clock | None = None
        self.stamps: list[tuple] = []  # each call's BlockCall fields, clock stamps for times
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        # each unit call returned, with its inputs' version probes and its state
        self.returned: list[tuple[str, list[tuple[torch.Tensor, int]], _State]] = []
        self.observing: list[Observer] = []  # the blocks' observers running now
        found = recompute.units()
        blocks = {unit.key for unit in below(found).values() if not is_compiled(unit.module)}
        for unit in found.values():
            self._watch(unit, unit.name in blocks)

    def _watch(self, unit: Unit, observe: bool) -> None:
        """Hooks around the unit's calls (``observe``: a block, whose recomputation below the
        layer is measured too)."""
        name = unit.name
        modules = unit.modules()
        root = unit.module
        open_calls: list[tuple[int, list[tuple[torch.Tensor, int]], _State, Any,
                               Observer | None, dict[str, Any]]] = []
        named = _named_within(root, unit)
        norms = {(id(m), n) for m, n in norm_buffers(m for _, m in named)}
        buffers = [(where, m, n) for where, m in named
                   for n in m._buffers if (id(m), n) not in norms]
        parameters = [(f"{where}.{n}".lstrip("."), p) for where, m in named
                      for n, p in m._parameters.items() if p is not None]

        # Inside a region torch.compile traces (a model compiled whole) the hooks do nothing:
        # its saves all come at its end, and Dynamo would break its graph here. Nor inside a
        # torch.func transform (``no_offload``), where none of its saves come to the step.
        def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch.compiler.is_compiling() or in_transform():
                return
            inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if self.clock is None:
                self.clock = Clock(inputs[0].device if inputs else torch.device("cpu"))
            if top_hooks() != self.hooks:
                self.recompute.unfit[name] = ("runs under saved-tensor hooks other than the "
                                              "step's (an outer checkpoint, save_on_cpu)")
            versions = [(t, t._version) for t in inputs]
            observer = None
            if observe:
                kind = signature(args, kwargs)
                observer = Observer(self.clock, self.clock.device,
                                    choices=[self.recompute.choice(name, weight, kind)
                                             for weight in WEIGHTS])
                self.observing.append(observer.__enter__())
            generators = host_generators()  # before the clock: not the unit's time
            open_calls.append((self.next_site(), versions, _State(buffers, parameters, named),
                               self.clock.now(), observer, generators))

        def after(module: nn.Module, args: tuple, output: Any) -> None:
            if torch.compiler.is_compiling() or in_transform() or not open_calls:
                return
            first_site, versions, state, start, observer, generators = open_calls.pop()
            ways, timed, began = [], [], None
            if observer is not None:
                ways, timed, began = observer.finish(output)
                self._stop(observer)
            if any(t._version != v for t, v in versions):
                self.recompute.unfit[name] = "changes an input in place"
            self._learn(name, state, "")
            probes = self.outside(lambda: [(version_probe(t.detach()), t._version)
                                           for t, _ in versions])  # not an outer block's
            self.returned.append((name, probes, _State(buffers, parameters, named)))
            nbytes = sum(t.numel() * t.element_size() for t, _ in versions)
            self.stamps.append((name, first_site, self.next_site(), len(versions), nbytes,
                                start, self.clock.now(), ways, timed, began))
            found = drawn(generators, host_generators())  # after the clock, as before it
            if found:
                self.recompute.draws.setdefault(name, set()).update(found)

        self.handles.append(modules[0].register_forward_pre_hook(before, with_kwargs=True))
        self.handles.append(modules[-1].register_forward_hook(after))

    def _learn(self, name: str, state: _State, when: str) -> None:
        """What changed of a unit's ``state`` since it was taken."""
        changed, parameter, attribute = state.changes()
        if changed:
            self.recompute.changed.setdefault(name, set()).update(changed)
        if parameter:
            self.recompute.unfit.setdefault(name, f"changes its parameter {parameter} in "
                                                  f"place{when}")
        if attribute:
            self.recompute.unfit.setdefault(
                name, f"changes the tensor of its attribute {attribute} in place{when}, which "
                      "cannot be put back (register it as a buffer, and it will be)")

    def look_back(self) -> None:
        """What changed after each unit call returned (at the end of forward, as backward
        starts): an input changed in place makes the unit unfit."""
        for name, probes, state in self.returned:
            if any(p._version != v for p, v in probes):
                self.recompute.unfit.setdefault(name, "its input is changed in place after "
                                                      "it returns (checkpoint keeps it)")
            self._learn(name, state, " after it returns")

    def saw(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` (the step's pack hook): the blocks observed now are told."""
        for observer in self.observing:
            observer.saw(t)

    def outside(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with the blocks observed now paused: the step's own work (its pack
        hook's copies and counts) is not theirs."""
        observing = list(self.observing)
        for observer in observing:
            observer.paused += 1
        try:
            return fn(*args)
        finally:
            for observer in observing:
                observer.paused -= 1

    def _stop(self, observer: Observer) -> None:
        """Take an observer off, and those entered after it (a call that raised)."""
        while self.observing:
            last = self.observing.pop()
            last.__exit__(None, None, None)
            if last is observer:
                return

    def remove(self) -> None:
        """Take the hooks off (at the end of forward)."""
        if self.observing:
            self._stop(self.observing[0])
        for handle in self.handles:
            handle.remove()
        self.handles, self.next_site = [], None  # the step's: no cycle through it
        self.look_back()

    def backward_started(self) -> None:
        """A first unpack of a site (the step's ``_time_unpack``): the first after forward
        looks back once more, then lets the unit calls go (their states hold the weights)."""
        if self.returned and not self.handles:
            self.look_back()
            self.returned = []

    def calls(self) -> list[BlockCall]:
        """Every unit call of the step, in order (read once the step's device work is done:
        on CUDA this waits for the stamps' events)."""
        self.returned = []
        if not self.stamps:
            return []
        seconds = self.clock.seconds
        calls = []
        for *call, start, end, ways, timed, began in self.stamps:
            below = ()
            if began is not None:
                untimed = max(seconds(began, end) - sum(seconds(*t) for t in timed), 0.0)
                below = tuple(
                    Below((call[-1], *way.kept),
                          way.share * untimed + sum(seconds(*t) for t in way.stamps),
                          way.dtype or "float32", weight)
                    for weight, way in zip(WEIGHTS, ways, strict=True))
            calls.append(BlockCall(*call, seconds(start, end), below))
        return calls


def _named_within(root: nn.Module, unit: Unit) -> list[tuple[str, nn.Module]]:
    """The unit's modules, named within ``root`` (its block, or its stage's Sequential)."""
    if unit.span is None:
        return list(root.named_modules())
    return [(f"{i}.{where}".rstrip("."), m) for i in unit.span
            for where, m in unit.modules()[i - unit.span.start].named_modules()]


class _State:
    """The buffers (each a name within the unit, its module and its name there), the
    parameters (each a name within the unit and itself) and the plain attributes that may
    hold state (``rerun.plain_state`` of each of its ``modules``, named within it) of a unit,
    as they are now: which tensor or value each holds, and every tensor's version."""

    def __init__(self, buffers: list[tuple[str, nn.Module, str]],
                 parameters: list[tuple[str, nn.Parameter]],
                 modules: list[tuple[str, nn.Module]]) -> None:
        self.buffers = [(f"{where}.{n}".lstrip("."), m, n, t, t._version)
                        for where, m, n in buffers if (t := m._buffers.get(n)) is not None]
        self.parameters = [(where, p, p._version) for where, p in parameters]
        self.modules = modules
        self.attributes = _attributes(modules)

    def changes(self) -> tuple[list[str], str, str]:
        """The buffers and plain attributes changed since (a buffer in place or replaced, an
        attribute replaced, added or removed), the first parameter changed in place, and
        the first attribute whose tensor was changed in place (``""``: none)."""
        changed = [where for where, m, n, t, v in self.buffers
                   if m._buffers.get(n) is not t or t._version != v]
        parameter = next((where for where, p, v in self.parameters if p._version != v), "")
        now = _attributes(self.modules)
        in_place = ""
        for key in self.attributes.keys() | now.keys():
            (value, version), (then, before) = now.get(key, _NONE), self.attributes.get(key, _NONE)
            if value is then and version != before:
                in_place = in_place or key[0]
            elif value is not then and (isinstance(value, torch.Tensor)
                                        or type(value) is not type(then) or value != then):
                changed.append(key[0])
        return changed, parameter, in_place


_NONE = (None, None)  # an attribute a module does not have


def _attributes(modules: list[tuple[str, nn.Module]]) -> dict[tuple, tuple[Any, int | None]]:
    """Each plain attribute that may hold state, by (name within the unit, module, name):
    its value, and a tensor's version."""
    return {(f"{where}.{n}".lstrip("."), m, n):
            (v, v._version if isinstance(v, torch.Tensor) else None)
            for where, m in modules for n, v in plain_state(m)}
