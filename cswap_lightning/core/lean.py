"""A recomputed block's first run without autograd, where that trains as checkpoint would.

Non-reentrant ``torch.utils.checkpoint`` runs a block's forward with autograd on: it builds
the block's graph, and each tensor the block saves passes through a Python hook that drops
it; backward runs the forward again, through the hooks once more. On a GPU the host does not
keep ahead of, that is time the step waits for: BERT-large on an H200 took 2.03x a plain step
checkpointed, a third more than running its forward once more costs
(``benchmarks/results/measure-more-h200-2026-11-27.md``). So, as Megatron's and Unsloth's
checkpointing do, :func:`rerun` runs the first run under ``torch.no_grad`` inside an autograd
``Function`` whose inputs are the block's tensor arguments (saved through the step's hooks,
kept or swapped like any saved tensor) and its parameters; its backward runs the block again
with autograd on and asks autograd for those inputs' gradients. The same operations run in
the same order, with the same random numbers: the gradients are bitwise the same.

That holds only where the block's forward reads nothing the ``Function`` does not pass, and
does not care that autograd is off: it must not read a tensor that needs a gradient other
than its inputs and parameters (that gradient would be lost), read a tensor's autograd state
(``requires_grad``, ``grad_fn``: the first run could take another branch), register a hook on
a tensor, or return an input or a view of one; run once more without autograd it must give
the same bits; and an input or a weight it reads more than once (its gradient summed inside
the ``Function``) must get gradient nowhere else, or that gradient adds up in another order
(the step's backward checks it); nor share a weight's cast with other code (autocast
caches one per forward: a block called twice, or a weight read again after the block; one
node then sums their gradients in bfloat16, where apart they would be summed in the
weight's float32: the step's backward checks that too). The chosen blocks' calls are
watched for these under
checkpoint, all in one step (:class:`Watch`, :class:`Verdicts`); a block found doing any of
them stays under checkpoint. So do the blocks of a sharded model (FSDP), compiled blocks,
and blocks that train parameters other than plain ``nn.Parameter`` (DTensor): their
parameters are not what the ``Function`` would be given in backward (:func:`unfit`). A
block recomputed below the layer runs first without autograd too, once its choice of what
to keep is settled (``selective.Lean``): the ``Function``'s backward then gives back what it
kept.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .compile import is_compiled
from .rerun import FirstRun, as_first
from .selective import Region

_log = logging.getLogger(__name__)
# What a first run without autograd would read otherwise than one with it.
_AUTOGRAD_STATE = frozenset({"requires_grad", "grad_fn", "is_leaf", "grad", "_base"})
_HOOKS = frozenset({"register_hook", "register_post_accumulate_grad_hook", "retain_grad"})
SECOND = "a second derivative is taken through it"
SHARED = ("it reads an input or a weight more than once that gets gradient elsewhere too: "
          "that gradient would be summed in another order")
AWAITING = "its watched step's backward has not checked it yet"
DROPPED = "its watched steps' graphs went before their backward checked it, each time"
CAST = ("a cast of a weight it reads (autocast's cache) is read by other code too: the "
        "gradients would be summed in another order")
_TENSOR = object()  # where a tensor goes among a call's values or an output's leaves


def unfit(model: nn.Module | None, modules: list[nn.Module]) -> str:
    """Why a unit (its ``modules``, in ``model``) must run under checkpoint whatever it does,
    or ``""``: sharded or compiled, or training parameters that are not plain
    ``nn.Parameter`` (a frozen one, QLoRA's 4-bit base weights, is read alike either way)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FullyShardedDataParallel", None),
                              getattr(fsdp, "FSDPModule", None)) if k is not None)
    if kinds and model is not None and any(isinstance(m, kinds) for m in model.modules()):
        return "the model is sharded (FSDP)"
    if "torch._dynamo" in sys.modules and any(map(is_compiled, modules)):
        return "compiled"
    odd = next((p for m in modules for p in m._parameters.values()
                if p is not None and p.requires_grad and type(p) is not nn.Parameter), None)
    if odd is not None:
        return f"a parameter of type {type(odd).__name__}"
    return ""


def parameters(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters the modules train now (each once)."""
    return list({id(p): p for m in modules for p in m._parameters.values()
                 if p is not None and p.requires_grad}.values())


class Watch(TorchFunctionMode):
    """Watches a unit's first run (with autograd on, under checkpoint) for what would make
    a first run without autograd train otherwise: :meth:`verdict` says the first found, or
    ``""``. ``known``: the ids of the tensors it may read that need a gradient (those
    ``given``, its inputs and parameters, then everything it makes); ``made``: what it
    makes that needs one."""

    def __init__(self, inputs: list[torch.Tensor], params: list[torch.Tensor],
                 first_run: FirstRun, called: list[nn.Module]) -> None:
        super().__init__()
        self.first_run, self.called = first_run, called
        self.states = _States(inputs)  # before the first run
        self.inputs, self.params = inputs, params  # while the call runs
        self.held = _addresses(inputs)
        self.given = {id(t) for t in inputs} | {id(p) for p in params}  # alive throughout
        self.uses: Counter[int] = Counter()  # how often each input and parameter is read
        # each input's and parameter's gradient edge, and the nodes (with their edges) that
        # read it
        self.edges = {id(t): get_gradient_edge(t) for t in (*inputs, *params)
                      if t.requires_grad}
        self.reads: dict[int, list] = {i: [] for i in self.edges}
        self.known = set(self.given)
        self.made: list[weakref.ref] = []
        self.why = ""
        # each node the call made of a weight (a cast autocast may cache, for others to read)
        # and the call's nodes that read it, by the node's id
        self.weighed: dict[int, tuple[Any, list]] = {}
        self.weights = {id(p) for p in params}
        # how many tensors it returned, and those that need no gradient, by place
        self.constant: tuple[int, tuple[int, ...]] = (0, ())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.why:
            self.why = self._why(func, args, kwargs)
        out = func(*args, **kwargs)
        read, nodes = _read(args, kwargs, out)
        inputs = [t for t in read if id(t) in self.edges]
        if inputs:  # where the inputs' gradients come from (no view of a leaf made to ask:
            # the block's operators, seen below the layer, would not be those of its runs)
            # held, as the nodes walked are (``_edges_within``): on torch 2.11 a node's
            # Python object goes with its last reference, and its id may name the next one
            made_before = [self.edges[id(a)].node if id(a) in self.edges else a.grad_fn
                           for a in read]
            before = {id(n): n for n in made_before}
            for t in inputs:
                self.uses[id(t)] += 1
                found = _edges_within(nodes, self.edges[id(t)], before)
                self.reads[id(t)] += found
                if id(t) in self.weights:  # what the operation made of it on the way
                    for node, _ in found:
                        if all(node is not n for n in nodes):
                            self.weighed.setdefault(id(node), (node, []))[1].extend(
                                _edges_within(nodes, GradientEdge(node, 0), before))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):  # an id may be a dead tensor's: no test on it
                self.known.add(id(t))
                if t.requires_grad and id(t) not in self.given:
                    self.made.append(weakref.ref(t))
        return out

    def _why(self, func: Callable, args: tuple, kwargs: dict) -> str:
        name = getattr(func, "__name__", "")
        if name in _HOOKS:
            return f"its forward calls {name} on a tensor"
        if name == "__get__":
            attribute = getattr(getattr(func, "__self__", None), "__name__", "")
            if attribute in _AUTOGRAD_STATE:
                return f"its forward reads a tensor's .{attribute}"
        stray = any(isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in self.known
                    for t in tree_leaves((args, kwargs)))
        return ("its forward reads a tensor that needs a gradient and is neither its input "
                "nor its parameter" if stray else "")

    def verdict(self, out: Any, again: Callable[[], Any]) -> str:
        """Why the unit must stay under checkpoint, given what its first run returned (and
        what else it left alive that needs a gradient: kept by a hook or an attribute; a
        Hugging Face cache among its arguments may keep one, as no loss reads it), and what
        ``again`` (the same call) returns run once more as its first run began, without
        autograd: the same bits, or the first run without autograd would differ (a branch on
        ``torch.is_grad_enabled()``, a kernel chosen by it)."""
        if self.why:
            return self.why
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if len({id(t) for t in outs}) < len(outs):
            return "it returns one tensor twice"
        returned = _addresses(outs)
        if returned & self.held:
            return "it returns its input or a view of it"
        # returned by a Function, they would need one where any of its inputs does
        self.constant = (len(outs), tuple(i for i, t in enumerate(outs) if not t.requires_grad
                                          and (t.is_floating_point() or t.is_complex())))
        caches = self.first_run.caches
        cached = caches.tensors() if caches is not None else set()
        if any((t := ref()) is not None and t.untyped_storage().data_ptr() not in returned
               and id(t) not in cached for ref in self.made):
            return ("it keeps a tensor that needs a gradient beyond its output (in a hook's "
                    "or an attribute's hands)")
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.called):
            return "forward hooks inside it would run once more to check it"
        with torch.no_grad(), as_first(self.first_run), self.states.restored():
            repeated = [t for t in tree_leaves(again()) if isinstance(t, torch.Tensor)]
        if len(repeated) != len(outs) or not all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(outs, repeated, strict=True)):
            return "its forward gives other bits without autograd"
        return ""


def _edges_within(nodes: list, edge: Any, before: dict[int, Any]
                  ) -> list[tuple[Any, list[int]]]:
    """The nodes an operation made (from its results' ``nodes`` back to those of what it
    read, ``before`` by id) with inputs that are the gradient edge ``edge``, and which: a
    composite operation (a linear layer on a 3-D input) reaches its input through a few.
    The nodes seen are held while it walks: on torch 2.11 a node's Python object goes with
    its last reference (2.13 keeps it as long as the node), and a node made next may take
    its id, to be skipped as seen (BERT's input, cast by autocast for its projections)."""
    found, todo, seen = [], list(nodes), {}
    while todo:
        node = todo.pop()
        if id(node) in seen or id(node) in before:
            continue
        seen[id(node)] = node
        hit = [i for i, (n, nr) in enumerate(node.next_functions)
               if n is edge.node and nr == edge.output_nr]
        if hit:
            found.append((node, hit))
        todo += [n for n, _ in node.next_functions if n is not None]
    return found


def _addresses(tensors: list[torch.Tensor]) -> set[int]:
    """Where the tensors' storages are (an empty one is nowhere)."""
    return {p for t in tensors if (p := t.untyped_storage().data_ptr())}


class _Call:
    """One call of a unit, as its recomputation needs it: how to run it from its tensor
    inputs (``values``: its positional arguments, ``count`` of them, then its tensor keyword
    arguments ``names``, their tensors given at each run; the ``others`` keywords as they
    were), what its first run started from (``first_run``, the RNG and autocast states), its
    parameters, where it tells of what it saves again (``witnessed``) and of a second
    derivative taken through it (``second``), its output's structure, and (``region``,
    below the layer) what its first run keeps for the recomputation to run no more."""

    def __init__(self, run: Callable, values: tuple, count: int, names: list[str],
                 others: dict[str, Any], first_run: FirstRun, params: list[torch.Tensor],
                 witnessed: Callable[[tuple], Any], second: Callable[[], None],
                 region: Region | None = None,
                 constant: tuple[int, tuple[int, ...]] = (0, ())) -> None:
        self.run, self.count, self.names, self.others = run, count, names, others
        self.first_run, self.params, self.witnessed = first_run, params, witnessed
        self.second, self.region, self.constant = second, region, constant
        self.where = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        self.values = [_TENSOR if isinstance(v, torch.Tensor) else v for v in values]
        self.states = _States([values[i] for i in self.where])
        self.leaf = [values[i].is_leaf for i in self.where]  # each tensor input's, as found
        self.leaves: list[Any] = []
        self.spec: Any = None

    def call(self, tensors: tuple | list) -> Any:
        values = list(self.values)
        for i, t in zip(self.where, tensors, strict=True):
            values[i] = t
        return self.run(*values[:self.count], **self.others,
                        **dict(zip(self.names, values[self.count:], strict=True)))

    def first(self, tensors: tuple) -> tuple[torch.Tensor, ...]:
        """The first run (autograd is off in a ``Function``'s forward): its tensors, none a
        view (a ``Function``'s view output cannot be changed in place: plainly it can)."""
        with nullcontext() if self.region is None else self.region.lean():
            out = self.call(tensors)
        leaves, self.spec = tree_flatten(out)
        self.leaves = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return tuple(v.detach() if v._base is not None else v
                     for v in leaves if isinstance(v, torch.Tensor))

    def output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The first run's output, its tensors those of the ``Function``."""
        given = iter(tensors)
        return tree_unflatten([next(given) if v is _TENSOR else v for v in self.leaves],
                              self.spec)

    def again(self, saved: tuple[torch.Tensor, ...], grads: tuple, wanted: tuple[bool, ...]
              ) -> list[torch.Tensor | None]:
        """The gradients of the inputs and parameters (those ``wanted``) from the outputs'
        ``grads``, through the unit run again with autograd on (with a graph of its own
        where backward makes one: a second derivative)."""
        create_graph = torch.is_grad_enabled()
        if create_graph:
            self.second()
        # With a graph of its own, from the inputs as saved: it leads back through them.
        inputs = [t if w and create_graph else t.detach().requires_grad_(w)
                  for t, w in zip(saved, wanted[:len(saved)], strict=True)]
        targets = [t for t, w in zip([*inputs, *self.params], wanted, strict=True) if w]
        found: tuple = (None,) * len(targets)
        # The gradients are taken before ``as_first`` puts the buffers back (a norm's
        # backward reads its running statistics, saved at the version the run left them).
        with as_first(self.first_run), self.witnessed(tuple(inputs)):
            with torch.enable_grad():
                # a leaf only where the forward found one: autocast caches a cast of a leaf
                # (one node for every read of it, summing their gradients in bfloat16)
                fed = [x.view_as(x) if x.requires_grad and not leaf else x
                       for x, leaf in zip(inputs, self.leaf, strict=True)]
                with self.states.restored(), self._recomputing():
                    out = self.call(fed)
            outs = [v for v in tree_leaves(out) if isinstance(v, torch.Tensor)]
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                     if g is not None and o.requires_grad]
            if pairs and targets:
                with _hooks_held(self.params):
                    found = torch.autograd.grad([o for o, _ in pairs], targets,
                                                [g for _, g in pairs], allow_unused=True,
                                                create_graph=create_graph)
        given = iter(found)
        return [next(given) if w else None for w in wanted]

    def _recomputing(self) -> AbstractContextManager:
        """Below the layer, what gives back what the first run kept (where it kept it)."""
        region = self.region
        return nullcontext() if region is None or region.whole else region.recomputing()


@contextmanager
def _hooks_held(params: list[torch.Tensor]) -> Iterator[None]:
    """The parameters' own gradient hooks (``register_hook``) kept from running: asked for
    their gradients, ``torch.autograd.grad`` would run them, and the ``Function`` hands those
    gradients on to the parameters, where they run (once, as plainly). A leaf's hooks are
    its ``_backward_hooks`` dict, which autograd reads when it calls them."""
    held = [(hooks, list(hooks.items())) for p in params if (hooks := p._backward_hooks)]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)


class _States:
    """The RNG and autocast states a unit's first run began with (as checkpoint keeps them):
    the CPU's and those of the devices its inputs are on."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        devices = {t.device for t in inputs if t.device.type not in ("cpu", "meta")}
        self.kind = next(iter(devices)).type if devices else "cpu"
        self.cpu = torch.get_rng_state()
        module = getattr(torch, self.kind, None) if devices else None
        self.devices = sorted(d.index or 0 for d in devices)
        self.device_states = [module.get_rng_state(i) for i in self.devices] if module else []
        kinds = dict.fromkeys((self.kind, "cpu"))
        self.autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                         for k in kinds if torch.amp.is_autocast_available(k)]
        self.cache = torch.is_autocast_cache_enabled()

    @contextmanager
    def restored(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices,
                                                      device_type=self.kind))
            torch.set_rng_state(self.cpu)
            module = getattr(torch, self.kind, None)
            for index, state in zip(self.devices, self.device_states, strict=True):
                module.set_rng_state(state, index)
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                  cache_enabled=self.cache))
            yield


class _Rerun(torch.autograd.Function):
    """The unit's first run without autograd; its recomputation in backward."""

    @staticmethod
    def forward(ctx, call: _Call, count: int, *tensors: torch.Tensor):
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors[:count])
        out = call.first(tensors[:count])
        returned, constant = call.constant
        if len(out) == returned:  # as the watched calls returned them
            ctx.mark_non_differentiable(*(out[i] for i in constant))
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.call.again(ctx.saved_tensors, grads, ctx.needs_input_grad[2:]))


def rerun(run: Callable, values: tuple, count: int, names: list[str], others: dict[str, Any],
          first_run: FirstRun, modules: list[nn.Module], witnessed: Callable[[tuple], Any],
          second: Callable[[], None], region: Region | None = None,
          constant: tuple[int, tuple[int, ...]] = (0, ())) -> Any:
    """``run`` called without autograd with ``values`` (``count`` positional, then the keyword
    ones ``names``) and ``others``, its output's tensors given a history that recomputes it
    in backward (``as_first(first_run)``, ``witnessed`` around it; ``second`` called where
    that backward makes a graph), but those at the places ``constant`` names (of as many as
    its watched calls returned, which made them needing no gradient); with a ``region``
    whose choice is settled, below the layer (``selective.Lean``)."""
    params = parameters(modules)
    call = _Call(run, values, count, names, others, first_run, params, witnessed, second,
                 region, constant)
    tensors = [values[i] for i in call.where]
    out = call.output(_Rerun.apply(call, len(tensors), *tensors, *params))
    if region is not None:  # what it keeps goes through the step's hooks after its inputs
        region.close_lean(out)
    return out


class _Graph:
    """Held by the watched nodes of one unit call (in their ``metadata``): it goes when its
    graph does, with or without a backward."""


class _Watching:
    """One step's watched calls: the reason found in each unit's calls, and for each input
    or parameter a unit reads more than once (its gradient summed inside the ``Function``) a
    check in the step's backward that nothing else added to that gradient (the sum of what
    the unit's operations gave it, in their order, is all it got: not so for a weight of a
    block called twice, as ALBERT's); ``awaiting``: the checks per unit still to come.

    A graph dropped without its backward (a step skipped on a non-finite loss, a forward
    for a metric) takes its checks with it: they are cancelled, and the unit is watched
    again in a later step, rather than awaiting forever under checkpoint."""

    def __init__(self, verdicts: Verdicts) -> None:
        self.verdicts = verdicts
        self.reasons: dict[str, str] = {}
        self.awaiting: Counter[str] = Counter()
        self.shared: dict[str, str] = {}  # the units whose checks in backward failed: why
        self.lost: set[str] = set()  # the units a call's graph of went before its checks

    def called(self, name: str, why: str, watch: Watch) -> None:
        self.reasons[name] = self.reasons.get(name) or why
        if why:
            return
        checks: list[list] = []  # each: the sum so far, the hook's handle (None once in)
        nodes = []
        for t in (*watch.inputs, *watch.params):
            if t.requires_grad and watch.uses[id(t)] > 1:
                given: list = [None, None]
                for node, edges in watch.reads[id(t)]:
                    node.register_hook(partial(_given, given, edges))
                    nodes.append(node)
                given[1] = t.register_hook(partial(self._received, name, given, SHARED))
                checks.append(given)
        # what the call made of a weight (autocast's cast, cached for whoever casts it next
        # in the step) gets its gradient from the call alone, or it is summed there with
        # others' (in plain training; run first without autograd, apart)
        for node, readers in watch.weighed.values():
            given = [None, None]
            for reader, edges in readers:
                reader.register_hook(partial(_given, given, edges))
                nodes.append(reader)
            given[1] = node.register_prehook(
                lambda grads, given=given: self._received(name, given, CAST, grads[0]))
            checks.append(given)
        if checks:
            self.awaiting[name] += len(checks)
            graph = _Graph()
            for node in nodes:
                node.metadata[_Graph] = graph
            weakref.finalize(graph, self._dropped, name, checks).atexit = False

    def _received(self, name: str, given: list, why: str, total: torch.Tensor | None) -> None:
        """A watched gradient's whole arrived (once: a leaf input may live on): it is the sum
        of what the unit's operations gave, or the unit is not alone in giving it (``why``)."""
        given[1].remove()
        given[1] = None
        if given[0] is None or total is None or not torch.equal(given[0], total):
            self.shared.setdefault(name, why)
        self.awaiting[name] -= 1
        if not self.awaiting[name] and name not in self.lost:
            self.verdicts.settle(name, self.verdict(name))

    def _dropped(self, name: str, checks: list[list]) -> None:
        """A watched call's graph is gone: its checks that did not come never will."""
        waiting = [given for given in checks if given[1] is not None]
        if not waiting:
            return
        for given in waiting:
            given[1].remove()
            given[1] = None
        self.awaiting[name] -= len(waiting)
        if name not in self.lost:
            self.lost.add(name)
            self.verdicts.rewatch(name)

    def verdict(self, name: str) -> str:
        return self.reasons[name] or self.shared.get(name, "")

    def verdicts_now(self) -> dict[str, str]:
        """Each unit's, as far as forward tells: awaiting its checks in backward, or given
        (but those a call's graph of went already: watched again)."""
        return {name: AWAITING if self.awaiting[name] else self.verdict(name)
                for name in self.reasons if name not in self.lost}


def _given(given: list, edges: list[int], grad_inputs: tuple, grad_outputs: tuple) -> None:
    """A node's hook: add what it gives the watched input (along ``edges``) to ``given[0]``,
    in the order the input's own gradient adds them up."""
    for i in edges:
        g = grad_inputs[i]
        if g is not None:
            given[0] = g.clone() if given[0] is None else given[0] + g


def _read(args: tuple, kwargs: dict, out: Any) -> tuple[list[torch.Tensor], list]:
    """The tensors needing a gradient that an operation read into a new result that needs
    one (a graph edge each; ``x.to(x.dtype)`` is ``x``, no new result), and the result's
    nodes."""
    given = [t for t in tree_leaves((args, kwargs))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and not any(t is g for g in given)]  # ``type_as``, ``to``: no new tensor
    if not made:
        return [], []
    return given, list({id(n): n for t in made if (n := t.grad_fn) is not None}.values())


# Where a whole unit's first run without autograd was measured to pay: the CPU (1.23-1.31x
# the throughput of checkpoint, `benchmarks/results/lean-recompute-cpu-2026-11-27.md`). On an
# H200, Llama-3-8B's layers so ran 3-5% slower than under checkpoint
# (`benchmarks/results/selective-h200-2026-11-27-s8192.md`, `measure-llama-h200-2026-11-27.md`):
# the recomputation runs the operators after the unit's last saved tensor too, for its
# output's graph, which checkpoint stops before; the host time it saves hid behind kernels.
WHOLE_DEVICES = ("cpu",)
REWATCHES = 3  # watched steps with a unit's graph gone unchecked before it stays under checkpoint
SUBCLASS = "a tensor subclass among its inputs: it runs under checkpoint"
WHOLE_ELSEWHERE = ("recomputed whole on this device, it runs under checkpoint, which stops "
                   "before the operators after its last saved tensor (``Verdicts.whole``)")


class Verdicts:
    """Whether each unit's first run goes without autograd: ``why`` by unit name, ``""``
    where it does, else why not. The units chosen without one are watched together, every
    call of theirs in one step (:meth:`begin` to :meth:`end`, forward's span): their verdicts
    are given at its end, or, for a unit that reads an input more than once, once that
    step's backward has checked what else gave the input gradient (``AWAITING``, then
    ``SHARED`` or not).
    ``on``: False runs every unit under checkpoint (to compare). ``whole``: the device types
    where a unit recomputed whole may run first without autograd (``WHOLE_DEVICES``; below
    the layer, everywhere). ``model``: the model's weak reference."""

    def __init__(self, model: Callable[[], nn.Module | None]) -> None:
        self.model = model
        self.why: dict[str, str] = {}
        # each unit's watched calls' tensor outputs: how many, and (by place) those that
        # needed no gradient
        self.constants: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.on = True
        self.whole = set(WHOLE_DEVICES)
        self.step: _Watching | None = None  # the step watching, from begin to end
        self.dropped: Counter[str] = Counter()  # watched steps whose graphs went unchecked

    def of(self, name: str, modules: list[nn.Module]) -> str | None:
        """The unit's verdict: ``""``, why not, or None: to be watched (in a watching step;
        in another, it runs under checkpoint)."""
        if not self.on:
            return "first runs without autograd are off"
        why = self.why.get(name)
        if why is None and (reason := unfit(self.model(), modules)):
            why = self.why[name] = reason
        if why is None and self.step is None:
            return "not watched yet"
        return why

    def forget(self) -> None:
        """Watch every unit again (the chosen ones changed: they are watched together)."""
        self.why.clear()
        self.constants.clear()
        self.dropped.clear()

    def begin(self, names: Iterable[str]) -> None:
        """A step's forward begins, the units ``names`` chosen: it watches those without a
        verdict."""
        if self.on and self.step is None and any(n not in self.why for n in names):
            self.step = _Watching(self)

    def watched(self, name: str, watch: Watch, out: Any, again: Callable[[], Any]) -> None:
        """A unit call watched (``watch``, its output ``out``; ``again``: the call once
        more)."""
        why = watch.verdict(out, again)
        if self.constants.setdefault(name, watch.constant) != watch.constant:
            why = why or "its calls return tensors that need no gradient in other places"
        self.step.called(name, why, watch)
        self.watch_backward(name, out)

    def end(self) -> None:
        """The step's forward ended: the verdicts of the units it watched (those awaiting a
        check in its backward run under checkpoint until it comes)."""
        step, self.step = self.step, None
        if step is not None:
            for name, why in step.verdicts_now().items():
                if self.why.get(name) != SECOND:  # seen already (inside the block)
                    self.give(name, why)

    def rewatch(self, name: str) -> None:
        """A graph of the unit's watched step went before its backward checked it: it is
        watched again in the next step that watches; after ``REWATCHES`` such steps (a call
        whose output is always dropped) it stays under checkpoint (``DROPPED``)."""
        self.dropped[name] += 1
        if self.dropped[name] >= REWATCHES:
            self.give(name, DROPPED)
        elif self.why.get(name) == AWAITING:
            del self.why[name]
            _log.info("cswap: %s is watched again: its watched step's graph was dropped "
                      "before backward", name)

    def settle(self, name: str, why: str) -> None:
        """A unit's verdict, once its checks in backward came (a second derivative seen
        there stands)."""
        if self.why.get(name) == AWAITING:
            self.give(name, why)

    def give(self, name: str, why: str) -> None:
        """The unit's verdict: ``""``, or why it runs under checkpoint from its next call on
        (logged)."""
        self.why[name] = why
        if why and why != AWAITING:
            _log.info("cswap: %s recomputes under checkpoint: %s", name, why)

    def watch_backward(self, name: str, out: Any) -> None:
        """Mark the unit (watched, run under checkpoint) as one a second derivative goes
        through if its output's gradient comes with a graph (``create_graph``)."""
        def seen(grad: torch.Tensor) -> None:
            if torch.is_grad_enabled():
                self.why[name] = SECOND

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(seen)

    def second(self, name: str) -> None:
        """A backward made a graph through the unit, run first without autograd: its
        gradients were exact to rounding, not bitwise; from the next call it runs under
        checkpoint."""
        if self.why.get(name) != SECOND:
            warnings.warn(f"cswap: a second derivative was taken through {name!r}, whose first "
                          "run went without autograd: exact to rounding, not bitwise as plain "
                          "PyTorch; it runs under checkpoint from now on", RuntimeWarning,
                          stacklevel=2)
        self.why[name] = SECOND
