"""A training step traced on the meta device: what a GPU would save and allocate, without one.

Autograd decides what to save from the ops and their arguments' shapes and dtypes, never from
their values, so forward and backward run on meta tensors (shapes, no data) save the tensors
they would save on a GPU: shapes, dtypes, which storage each is a view of, which are
parameters. Two ops take another path on a CPU build than on CUDA and are routed as CUDA
routes them (``_CudaRoutes``): dropout (CUDA's fused kernel saves a bool mask) and
scaled-dot-product attention (a fused kernel: cuDNN's on Hopper, flash elsewhere).

Beside the saved tensors (the rows of ``planning/capture.py``'s schema), the trace keeps:

- **a ledger of the allocator's bytes**: every storage an op creates, from its creation until
  Python drops it (each rounded up to 512 bytes, as CUDA's caching allocator counts
  ``memory_allocated``), from the step's start (weights, the batch) to its peak;
- **each kernel's work**: its floating-point operations (``torch.utils.flop_counter``'s
  formulas; a causal attention does half) and the bytes it reads and writes, with the leaf
  module it ran in, and in a layer's forward whether recomputing the layer below the layer
  runs it again (its dataflow, ``dataflow.py``: not what it keeps, nor what nothing saved
  needs). In backward, an op belongs to the module whose saved tensor autograd
  unpacked last (a node unpacks its saved tensors before it runs), which needs no backward
  hooks (those break modules that change their input in place).

Nothing here is measured: ``devices.py`` turns the work into times.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .dataflow import WEIGHTS, Dataflow
from .storages import FirstSaves
from .workload import layer_of

ALLOCATOR_ROUND = 512  # CUDA's caching allocator hands out multiples of 512 bytes
ATTENTION_KERNELS = ("cudnn", "flash")

aten = torch.ops.aten
# ops that allocate or relabel memory without a kernel that reads or writes it
_NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
              aten.new_empty_strided, aten.detach, aten.alias, aten.lift_fresh,
              aten._unsafe_view, aten.resolve_conj, aten.resolve_neg}


@dataclass(frozen=True)
class Kernel:
    """One op's work: ``kind`` is ``matmul``, ``attention``, ``conv`` (tensor cores where the
    dtype has them) or ``memory`` (everything else)."""

    module: str  # the leaf module it ran in ("" outside any)
    backward: bool
    kind: str
    flops: float
    bytes: int  # read and written
    dtype: torch.dtype
    layer: str = ""  # the layer (``workload.layer_of``) it ran in, in forward
    # per weight of ``dataflow.WEIGHTS``, whether recomputing its layer below the layer
    # that way runs it again
    again: tuple[bool, ...] = ()


@dataclass
class Layer:
    """What recomputing a layer below the layer (``core/selective.py``) would keep: its
    tensor inputs' bytes, and per weight of ``dataflow.WEIGHTS`` the bytes of each output its
    recomputation keeps (``Dataflow.cut``: in place of its matrix products', attention's and
    reductions' outputs, the fewest bytes that make what autograd saved, its work again
    weighed in), in the dtype of the largest."""

    input_bytes: int = 0
    kept: list[list[int]] = field(default_factory=lambda: [[] for _ in WEIGHTS])
    dtype: list[str] = field(default_factory=lambda: [""] * len(WEIGHTS))

    def kept_bytes(self, way: int = 0) -> list[int]:
        """The bytes of what its recomputation the ``way``-th way keeps."""
        return [n for n in self.kept[way] if n]


@dataclass
class _Forward:
    """A layer's forward as it runs: its dataflow, per call the kernel it ran (None: no
    kernel), and the work per byte of the calls whose outputs may be kept."""

    flow: Dataflow = field(default_factory=Dataflow)
    kernels: list[int | None] = field(default_factory=list)
    kept: dict[int, float] = field(default_factory=dict)


@dataclass
class Trace:
    """A traced step: the saved tensors (capture's rows), each kernel's work, every leaf
    module and its forward calls, the ledger when each module's backward began, at the
    step's start and its peak."""

    saved: list[dict] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)  # forward calls per leaf module
    backward_allocated: dict[str, list[int]] = field(default_factory=dict)
    layers: dict[str, Layer] = field(default_factory=dict)
    # the outermost modules with weights no op of the step read (a multimodal model's vision
    # tower under a batch of text), and their weights' elements
    unread: dict[str, int] = field(default_factory=dict)
    start_bytes: int = 0
    peak_bytes: int = 0


def rounded(nbytes: int) -> int:
    """The bytes CUDA's caching allocator counts for a tensor of ``nbytes``."""
    return -(-nbytes // ALLOCATOR_ROUND) * ALLOCATOR_ROUND


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


class _CudaRoutes(TorchFunctionMode):
    """Dropout and attention as CUDA runs them (module docstring)."""

    def __init__(self, attention: str) -> None:
        super().__init__()
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if inplace or not (training and 0 < p < 1):
            return F.dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]  # CUDA's fused kernel: a bool mask

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        del enable_gqa  # the fused kernels take fewer key/value heads as they are
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        logsumexp = torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value))
        # cuDNN's kernel takes no gradient for its mask (T5's learned position bias): there
        # the GPU's dispatcher takes the efficient kernel, which does
        if self.attention == "cudnn" and not (attn_mask is not None and attn_mask.requires_grad):
            return aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, logsumexp, dropout_p, is_causal, False,
                scale=scale)[0]
        if attn_mask is None:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(  # flash takes no mask
            query, key, value, attn_mask, logsumexp, dropout_p, is_causal, scale=scale)[0]


def _call(func, args: tuple, kwargs: dict):
    """``func`` on meta tensors. torch's meta kernel of a grouped matrix product (a mixture
    of experts' experts) takes bfloat16 only, where CUDA's and the CPU's kernels take any
    float dtype: the product of other dtypes runs as bfloat16 and returns in its own."""
    if func is not aten._grouped_mm.default:
        return func(*args, **kwargs)
    dtypes = {t.dtype for t in _tensors(list(args)) if t.is_floating_point()}
    if dtypes <= {torch.bfloat16}:
        return func(*args, **kwargs)
    dtype = kwargs.get("out_dtype") or next(iter(dtypes))
    as_bf16 = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
               else a for a in args]
    out = func(*as_bf16, **{**kwargs, "out_dtype": None})
    return out.to(dtype)


class _Ledger(TorchDispatchMode):
    """Below autograd: the storages ops create (freed when Python drops them: the storage
    object of a meta tensor lives as long as its memory would), and each kernel's work."""

    def __init__(self, trace: Trace, where: Callable[[], tuple[str, bool]],
                 layer: Callable[[], str], present: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.trace = trace
        self.where = where  # the leaf module running now, and whether in backward
        self.layer = layer  # the layer running now in forward ("" outside any)
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in present}
        self.alive = set(storages)
        self.now = trace.start_bytes = trace.peak_bytes = sum(
            rounded(s.nbytes()) for s in storages.values())
        self.forwards: dict[str, _Forward] = {}  # the layers running their forward
        self.read: set[int] = set()  # the storages ops read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)
        inputs = list(_tensors(list(args) + list(kwargs.values())))
        self.read.update(t.untyped_storage()._cdata for t in inputs)
        for t in _tensors(out):
            self._allocated(t.untyped_storage())
        kernel = None
        if not (func.is_view or func.overloadpacket in _NO_KERNEL):
            scratch = ops.dequantized_bytes(func, args, out)
            if scratch:  # made, read and freed inside the call
                self.trace.peak_bytes = max(self.trace.peak_bytes, self.now + rounded(scratch))
                self._dequantize(inputs, scratch)
            kernel = self._work(func, args, kwargs, inputs, out, scratch)
        layer = self.layer()
        if layer:
            forward = self.forwards.setdefault(layer, _Forward())
            kept = ops.kept(func) or ops.reduces(func, args, kwargs, out)
            index = forward.flow.call(func, args, kwargs, out, kept)
            forward.kernels.append(kernel)
            if kept:
                forward.kept[index] = ops.work_per_byte(func, args, kwargs, out)
        return out

    def saved(self, t: torch.Tensor) -> None:
        """Autograd saved ``t``: the layer running now (in forward) needs what wrote it."""
        layer = self.layer()
        if layer:
            self.forwards.setdefault(layer, _Forward()).flow.saved(t)

    def returned(self, layer: str, output) -> None:
        """A layer returned ``output``: its recomputation keeps the outputs of the calls
        ``Dataflow.cut`` chooses, given those of its matrix products, attention and
        reductions it needs, none of what it returns nor what is far cheaper to make than
        the rest (``ops.dear``), at each weight of ``WEIGHTS``; the kernels it runs again are
        marked (``Kernel.again``)."""
        kept = self.trace.layers[layer]
        forward = self.forwards.pop(layer, _Forward())
        flow = forward.flow
        returned = list(_tensors(output))
        made = flow.makers(returned)
        calls = [(i, cost) for i, cost in forward.kept.items() if i not in made]
        dear = ops.dear([cost for _, cost in calls])
        given = {i for (i, _), ok in zip(calls, dear, strict=True) if ok}
        need = flow.needed(given)
        given = {i for i in given if need[i]}
        runs = []
        for way, weight in enumerate(WEIGHTS):
            chosen = flow.cut(given, returned, weight)
            sizes, dtype = flow.keeps(chosen)
            if sizes and max(sizes) >= max(kept.kept[way], default=0):  # of the layer's calls
                kept.dtype[way] = str(dtype).removeprefix("torch.")
            kept.kept[way].extend(sizes)
            runs.append(flow.runs(chosen))
        for kernel, again in zip(forward.kernels, zip(*runs, strict=True), strict=True):
            if kernel is not None and any(again):
                self.trace.kernels[kernel] = replace(self.trace.kernels[kernel], again=again)

    def _allocated(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.alive:
            return
        size = rounded(storage.nbytes())
        self.alive.add(key)
        self.now += size
        self.trace.peak_bytes = max(self.trace.peak_bytes, self.now)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.alive.discard(key)
        self.now -= size

    def _dequantize(self, inputs: list[torch.Tensor], scratch: int) -> None:
        """Record the kernel a 4-bit product runs first (``ops.DEQUANTIZING``): it reads the
        packed weight and its statistics (every tensor argument but the input) and writes
        ``scratch`` bytes."""
        module, backward = self.where()
        packed = sum(t.nbytes for t in inputs[1:])
        self.trace.kernels.append(Kernel(module, backward, "memory", 0.0, packed + scratch,
                                         inputs[0].dtype, "" if backward else self.layer()))

    def _work(self, func, args: tuple, kwargs: dict, inputs: list[torch.Tensor], out,
              scratch: int = 0) -> int:
        """Record the kernel of a call (``inputs``: its tensor arguments; ``scratch``: the
        bytes of a dequantized weight it reads beside them); its index."""
        kind = ops.kind(func)
        flops = ops.flops(func, args, kwargs, out) or 0.0
        if kind == "attention":
            named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
            if named.get("is_causal"):
                flops /= 2  # the fused kernels skip the masked half
        read = inputs[:1] if scratch else inputs  # a dequantized weight in place of its own
        touched = scratch + sum(t.numel() * t.element_size() for t in (*read, *_tensors(out)))
        dtype = inputs[0].dtype if inputs else torch.float32
        module, backward = self.where()
        self.trace.kernels.append(Kernel(module, backward, kind, flops, touched, dtype,
                                         "" if backward else self.layer()))
        return len(self.trace.kernels) - 1


@dataclass
class _Backward:
    """Where backward is: the module whose saved tensor it unpacked last (None before
    backward begins), and the modules whose backward has begun."""

    module: str | None = None
    begun: set[str] = field(default_factory=set)


@contextmanager
def _no_packed_sequences() -> Iterator[None]:
    """transformers looks for packed sequences in the position ids (a data-dependent branch a
    trace cannot take): the traced batch holds one sequence per row."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def trace(model: nn.Module, step: Callable[[], torch.Tensor], batch: Sequence[torch.Tensor],
          attention: str = "cudnn") -> Trace:
    """Trace one training step of ``model`` (on the meta device): ``step`` runs forward and
    returns the loss; ``batch`` are the tensors it reads, held before the step as a training
    loop holds them. ``attention``: the fused attention kernel the GPU runs."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("trace needs the model on the meta device (build it under "
                         "`with torch.device('meta'):`)")
    out = Trace()
    leaves = [(name, m) for name, m in model.named_modules() if name and not any(m.children())]
    out.modules = [name for name, _ in leaves]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    firsts = FirstSaves()
    running: list[str] = []  # leaf modules inside one another's forward (rarely nested)
    backward = _Backward()

    def where() -> tuple[str, bool]:
        if backward.module is not None:
            return backward.module, True
        return (running[-1] if running else ""), False

    layers = [(name, m) for name, m in model.named_modules() if layer_of(name) == name]
    inside: list[str] = []  # the layers running (one, unless they nest)

    def layer() -> str:
        return "" if backward.module is not None or not inside else inside[-1]

    present = [*held(model), *batch]
    ledger = _Ledger(out, where, layer, present)

    def pack(t: torch.Tensor) -> tuple[int, torch.Tensor]:
        storage = t.untyped_storage()
        key = storage._cdata
        out.saved.append({
            "i": len(out.saved), "module": running[-1] if running else "",
            "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "nbytes": t.numel() * t.element_size(), "storage_nbytes": storage.nbytes(),
            "parameter": key in params, "requires_grad": t.requires_grad,
            "allocated": ledger.now, "first_of_storage": firsts.first(storage)})
        ledger.saved(t)
        return len(out.saved) - 1, t

    def unpack(packed: tuple[int, torch.Tensor]) -> torch.Tensor:
        i, t = packed
        backward.module = out.saved[i]["module"]
        if backward.module not in backward.begun:
            backward.begun.add(backward.module)
            out.backward_allocated.setdefault(backward.module, []).append(ledger.now)
        return t

    with ExitStack() as stack:
        for name, module in leaves:
            def pre(_m, _args, name=name):
                running.append(name)
                out.calls[name] = out.calls.get(name, 0) + 1

            def post(_m, _args, _out):
                running.pop()

            stack.callback(module.register_forward_pre_hook(pre).remove)
            stack.callback(module.register_forward_hook(post).remove)
        for name, module in layers:
            def enter(_m, args, kwargs, name=name):
                inside.append(name)
                kept = out.layers.setdefault(name, Layer())
                kept.input_bytes += sum(t.nbytes for t in (*args, *kwargs.values())
                                        if isinstance(t, torch.Tensor))  # what checkpoint saves

            def leave(_m, _args, output, name=name):
                ledger.returned(name, output)
                inside.pop()

            stack.callback(module.register_forward_pre_hook(enter, with_kwargs=True).remove)
            stack.callback(module.register_forward_hook(leave).remove)
        stack.enter_context(_no_packed_sequences())
        stack.enter_context(_CudaRoutes(attention))
        stack.enter_context(ledger)
        model.zero_grad(set_to_none=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = step()
            loss.backward()
        # a ValueError: the model given cannot be estimated (NotImplementedError: an operator
        # whose output's shape follows from the data, T5's unique_consecutive)
        except (RuntimeError, NotImplementedError) as err:
            if "meta" not in str(err).lower():
                raise
            raise ValueError(f"the model's step reads a tensor's values ({err}); a trace "
                             "without data cannot: estimate a model whose forward branches "
                             "on shapes only") from err
        del loss
    out.unread = _unread(model, ledger.read)
    return out


def held(model: nn.Module) -> list[torch.Tensor]:
    """What a model holds on its device: its parameters and buffers, and the statistics a
    quantized weight keeps beside it, which are neither (bitsandbytes' ``quant_state``: its
    scales, their own nested scales, the code books)."""
    out = [*model.parameters(), *model.buffers()]
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return out


def _unread(model: nn.Module, read: set[int]) -> dict[str, int]:
    """The outermost modules of ``model`` with weights none of whose storages is in ``read``,
    and their weights' elements."""
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        params = list(module.parameters())
        if (name and params and not any(name.startswith(f"{done}.") for done in out)
                and not any(p.untyped_storage()._cdata in read for p in params)):
            out[name] = sum(p.numel() for p in params)
    return out
