"""What a recomputed block must find as its first run found it, and leave as that run left it.

A block recomputed in backward runs its forward a second time, after the rest of the step has
run. ``torch.utils.checkpoint`` puts back the global RNG states and autocast for it; all else
it reads is as the step left it, and all it changes it changes twice. So a recomputation runs
with what its first run saw: each module's training flag (``model.eval()`` may have come
between forward and backward), the buffers and plain attributes its forward changes
(measured on the engine's measured steps: a counter, spectral norm's power-iteration vectors,
a Python number, a tensor kept aside), the generators of its own (module attributes, or
arguments), the host's generators it was measured to draw from (Python's ``random``, NumPy's
global one; torch's own are checkpoint's), a Hugging Face cache among its arguments, the
global forward hooks (``register_module_forward_hook``: one removed after forward still runs
in the recomputation, one added after does not); and leaves them all as it found them.
Norms' running statistics are only read in eval mode, where they are not updated: they are
put back after it, not shown as before.

What cannot be put back keeps a block from being recomputed (``Recompute.left_out``): an input,
a parameter or a tensor held in a plain attribute changed in place, and forward hooks on the
modules inside it, which would run again.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

# Hooks that compute a weight from parameters and buffers (which are put back): running them
# again gives the same weight.
_PURE_HOOKS = (SpectralNorm, WeightNorm, BasePruningMethod)
Buffer = tuple[nn.Module, str]  # a module and the name of one of its buffers or attributes
_MISSING = object()  # an attribute a module did not have yet


@dataclass
class Parts:
    """A unit's modules, as a recomputation needs them: all of them (their training flags),
    its norms' running statistics, the generators they hold, those that may checkpoint
    themselves (Hugging Face's ``gradient_checkpointing``), and those whose forward hooks run
    when the unit runs (``called``: a block's own do not, its forward is called directly)."""

    modules: list[nn.Module]
    norms: list[Buffer]
    generators: list[torch.Generator]
    switches: list[nn.Module]
    called: list[nn.Module]

    @classmethod
    def of(cls, tops: list[nn.Module], block: bool = False) -> Parts:
        """The parts of ``tops``: a block's (``block``: one module) or a stage's layers."""
        modules = list(dict.fromkeys(m for top in tops for m in top.modules()))
        generators = [v for m in modules for v in vars(m).values()
                      if isinstance(v, torch.Generator)]
        return cls(modules, norm_buffers(modules), generators,
                   [m for m in modules if hasattr(m, "gradient_checkpointing")],
                   modules[1:] if block else modules)


def plain_state(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """The plain attributes of ``module`` that may hold state its forward changes: tensors
    that are neither parameters nor buffers, and Python numbers (a call counter)."""
    for name, value in vars(module).items():
        if name[0] != "_" and name != "training" and (
                type(value) in (int, float, bool)
                or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter))):
            yield name, value


def _value(module: nn.Module, name: str) -> Any:
    """A buffer's tensor, or a plain attribute's value (``_MISSING`` where it has none)."""
    if name in module._buffers:
        return module._buffers[name]
    return module.__dict__.get(name, _MISSING)


def _put(module: nn.Module, name: str, value: Any) -> None:
    if name in module._buffers:
        module._buffers[name] = value
    elif value is _MISSING:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = value


def norm_buffers(modules: Iterable[nn.Module]) -> list[Buffer]:
    """The running statistics of the norms among ``modules`` (BatchNorm, InstanceNorm)."""
    return [(m, name) for m in modules if isinstance(m, _NormBase)
            for name in ("running_mean", "running_var", "num_batches_tracked")
            if m._buffers.get(name) is not None]


class FirstRun:
    """What a unit's first run started from: the training flags of its ``parts``' modules,
    the values of the buffers (copied) and plain attributes (as they are: a tensor there is
    replaced, never changed in place) its forward changes (``changed``), the states of its
    generators (``generators``: its parts' and those among its arguments), the caches among
    its arguments, the states of the host generators it draws from (``draws``: by name, of
    ``host_generators``), the global forward hooks."""

    def __init__(self, parts: Parts, changed: list[Buffer],
                 generators: list[torch.Generator], caches: CacheStates | None,
                 draws: Iterable[str] = ()) -> None:
        self.parts = parts
        self.flags = [m.training for m in parts.modules]
        self.changed = [(m, n, v.clone() if n in m._buffers else v) for m, n in changed
                        if (v := _value(m, n)) is not None]
        self.generators = [(g, g.get_state()) for g in generators]
        self.host = {name: _HOST[name][0]() for name in draws}
        self.caches = caches
        self.global_hooks = global_hooks()


@contextmanager
def as_first(first: FirstRun) -> Iterator[None]:
    """Run a recomputation as the first run ran (flags, changed buffers and attributes,
    generators, caches and global hooks as they were; norms' running statistics on the
    side), and put back all of it as it is now afterwards. A changed buffer is shown as a
    fresh copy of its first value, swapped in for the buffer: tensors saved before keep the
    buffer's own values."""
    modules = first.parts.modules
    flags = [m.training for m in modules]
    now = [(m, n, _value(m, n)) for m, n, _ in first.changed]
    norms = [(b, b.clone()) for m, n in first.parts.norms
             if (b := m._buffers.get(n)) is not None]
    generators = [(g, g.get_state()) for g, _ in first.generators]
    host = {name: _HOST[name][0]() for name in first.host}
    caches = first.caches.again() if first.caches is not None else None
    hooks = global_hooks()
    hooks_differ = hooks != first.global_hooks
    if hooks_differ:
        _set_global_hooks(first.global_hooks)
    _set_flags(modules, first.flags)
    for module, name, value in first.changed:  # a buffer copied: a second backward
        _put(module, name, value.clone() if name in module._buffers else value)  # reads it
    for generator, state in first.generators:
        generator.set_state(state)
    for name, state in first.host.items():
        _HOST[name][1](state)
    if first.caches is not None:
        first.caches.restore()
    try:
        yield
    finally:
        _set_flags(modules, flags)
        for module, name, value in now:
            _put(module, name, value)
        with torch.no_grad():
            for buffer, value in norms:
                buffer.copy_(value)
        for generator, state in generators:
            generator.set_state(state)
        for name, state in host.items():
            _HOST[name][1](state)
        if caches is not None:
            caches.restore()
        if hooks_differ:
            _set_global_hooks(hooks)


def _numpy_random() -> Any:
    return sys.modules["numpy"].random


# The host's generators a forward may draw from beside torch's: how to get and set each state.
_HOST: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "random": (random.getstate, random.setstate),
    "numpy": (lambda: _numpy_random().get_state(), lambda s: _numpy_random().set_state(s)),
}


def host_generators() -> dict[str, Any]:
    """The states of the host's generators now (NumPy's only where NumPy is loaded)."""
    return {name: get() for name, (get, _) in _HOST.items()
            if name != "numpy" or "numpy" in sys.modules}


def drawn(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The host generators drawn from between the two states."""
    def same(a: Any, b: Any) -> bool:  # NumPy's holds an array
        return type(a) is type(b) and (all(map(same, a, b)) if isinstance(a, tuple)
                                       else bool((a == b).all()) if hasattr(a, "all")
                                       else a == b)
    return {name for name, state in after.items()
            if name in before and not same(before[name], state)}


# The global forward hooks' registries, which ``nn.Module.__call__`` reads on every call.
_GLOBAL_HOOKS = (module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks,
                 module_hooks._global_forward_hooks_always_called,
                 module_hooks._global_forward_hooks_with_kwargs)
GlobalHooks = tuple[tuple[tuple[int, Any], ...], ...] | None


def global_hooks() -> GlobalHooks:
    """The global forward hooks now, by handle id (None: none, as nearly always)."""
    if not (_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]):
        return None
    return tuple(tuple(registry.items()) for registry in _GLOBAL_HOOKS)


def _set_global_hooks(hooks: GlobalHooks) -> None:
    """Make the global forward hooks ``hooks`` (in place: torch reads the registries by name)."""
    for registry, items in zip(_GLOBAL_HOOKS, hooks or ((),) * len(_GLOBAL_HOOKS), strict=True):
        registry.clear()
        registry.update(items)


def _set_flags(modules: list[nn.Module], flags: list[bool]) -> None:
    """Each module's training flag as ``flags`` says, written only where it differs (a
    module's ``__setattr__`` is slow in Python; reading the flag is not)."""
    for module, flag in zip(modules, flags, strict=True):
        if module.training != flag:
            module.training = flag


def generators_among(values: Iterable[Any]) -> list[torch.Generator]:
    return [v for v in values if isinstance(v, torch.Generator)]


def rerun_hooks(tops: list[tuple[str, nn.Module]], whole: bool) -> str:
    """Why a unit (its modules ``tops``, by qualified name; ``whole``: a block, whose own
    hooks run once, outside its recomputation) cannot be recomputed for the forward hooks on
    the modules inside it, which its recomputation would run again; ``""`` where none would."""
    for name, top in tops:
        hooked = next((m for m in top.modules() if reruns(m) and not (whole and m is top)),
                      None)
        if hooked is not None:
            inner = next(n for n, m in top.named_modules() if m is hooked)
            return (f"forward hooks on {'.'.join(p for p in (name, inner) if p)} would run "
                    "again in backward, where plainly they run once")
    return ""


def reruns(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks a recomputation would run again with effect: any
    but the block timer's own (measured steps) and hooks that only compute a weight."""
    if not (module._forward_pre_hooks or module._forward_hooks):
        return False
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(not (isinstance(h, _PURE_HOOKS) or _capturing(h)
                    or getattr(h, "__qualname__", "").startswith("BlockTimer._watch."))
               for h in hooks)


def _capturing(hook: Any) -> bool:
    """A hook Hugging Face installs to collect outputs (``output_hidden_states``,
    ``output_router_logits``...): it does nothing but while the model's forward collects, in a
    context variable set around it, so never in backward."""
    return (getattr(hook, "__module__", "") == "transformers.utils.output_capturing"
            and getattr(hook, "__qualname__", "").endswith(".output_capturing_hook"))


class CacheStates:
    """The state of Hugging Face caches (``transformers.cache_utils``: a cache, the caches and
    layers it holds), copied shallowly: the tensors are shared, the attributes and the lists
    and dicts they are kept in are copied, so the state can be put back after updates. A
    recomputation given the cache as the first run left it would attend to keys and values
    written twice.

    Taken at every recomputed block's first run and recomputation, of every layer's cache: so
    kept quick (``_states``), a few microseconds a layer."""

    def __init__(self, roots: list[Any]) -> None:
        self.roots = roots
        self.states = _states(roots)

    @classmethod
    def of(cls, values: Iterable[Any]) -> CacheStates | None:
        """The state of the caches among ``values``, or None where there are none."""
        cache_utils = sys.modules.get("transformers.cache_utils")
        if cache_utils is None:
            return None
        roots = [v for v in values if isinstance(v, cache_utils.Cache)]
        return cls(roots) if roots else None

    def again(self) -> CacheStates:
        """Their state now."""
        return CacheStates(self.roots)

    def tensors(self) -> set[int]:
        """The ids of the tensors the caches hold now, and of those they hold views of (a
        sliding window's keys are a slice of the keys it was given)."""
        held = [t for _, state, _ in _states(self.roots) for value in state.values()
                for t in (value if isinstance(value, (list, tuple)) else (value,))
                if isinstance(t, torch.Tensor)]
        return {id(t) for t in held} | {id(t._base) for t in held if t._base is not None}

    def restore(self) -> None:
        for obj, state, containers in self.states:
            attributes = obj.__dict__
            attributes.clear()
            attributes.update(state)
            for name in containers:  # the state stays as it is, to be put back again
                attributes[name] = state[name].copy()


# Types a cache's attributes hold that are neither caches nor containers, passed over without
# ``isinstance``: a cache layer is an abstract class, whose check costs a microsecond.
_PLAIN = frozenset({torch.Tensor, nn.Parameter, bool, int, float, str, type(None),
                    torch.device, torch.dtype})


def _states(roots: list[Any]) -> list[tuple[Any, dict[str, Any], tuple[str, ...]]]:
    """Each cache and cache layer ``roots`` hold (``roots`` first) with a copy of its
    attributes, the lists and dicts among them copied too, and the names of those."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    kinds = (Cache, CacheLayerMixin)
    found, todo, seen = [], list(roots), set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        state = obj.__dict__.copy()
        containers = []
        for name, value in obj.__dict__.items():
            if type(value) in _PLAIN:
                continue
            if isinstance(value, (list, tuple)):
                todo += [v for v in value if type(v) not in _PLAIN and isinstance(v, kinds)]
            elif isinstance(value, kinds):
                todo.append(value)
            if isinstance(value, (list, dict)):
                state[name] = value.copy()
                containers.append(name)
        found.append((obj, state, tuple(containers)))
    return found
