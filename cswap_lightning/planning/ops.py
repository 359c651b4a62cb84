"""What an ATen operator is, by the work its kernel does: a matrix product, attention, a
convolution (tensor cores where the dtype has them), batch norm, or memory traffic (every
elementwise operation, reduction, copy).

Two readers: the meta-device trace times each kernel by its kind (``trace.py``), and
recomputation below the layer (``core/selective.py``) keeps the outputs of the kinds that cost
compute (``KEPT_KINDS``), but those far cheaper per byte than the block's dearest (``dear``),
and runs everything else again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

KINDS: dict[torch._ops.OpOverloadPacket, str] = {op: "attention" for op in (
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_fused_attention_overrideable,
    aten._flash_attention_forward, aten._efficient_attention_forward)}
KINDS |= {op: "matmul" for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm,
                                  aten._addmm_activation, aten._grouped_mm, aten._scaled_mm,
                                  aten._int_mm)}
KINDS |= {op: "conv" for op in (aten.convolution, aten.convolution_backward)}
KINDS |= {op: "norm" for op in (
    aten.native_batch_norm, aten.native_batch_norm_backward, aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional, aten._batch_norm_with_update,
    aten.batch_norm_backward)}
# Matrix products of libraries that register their operators on import, by name: those of
# bitsandbytes' 4-bit and 8-bit linear layers (QLoRA's base weights). Each takes its input
# first and returns its product first ([..., K] by a [N, K] weight: [..., N]).
NAMED_PRODUCTS = frozenset({
    "bitsandbytes::gemm_4bit", "bitsandbytes::gemv_4bit", "bitsandbytes::int8_linear_matmul",
    "bitsandbytes::int8_scaled_mm", "bitsandbytes::int8_mixed_scaled_mm"})
# Those that dequantize their whole weight into a temporary in the input's dtype first
# (bitsandbytes' 4-bit product on CUDA: a kernel of its own, then cuBLAS's product).
DEQUANTIZING = frozenset({"bitsandbytes::gemm_4bit"})
# What recomputation below the layer keeps: the outputs of the operators that cost compute.
KEPT_KINDS = ("matmul", "attention", "conv")


# Casts: under autocast, a recomputation may cast a weight again that its forward found cached
# (``uncounted``).
CASTS = {aten._to_copy}


class Facts(NamedTuple):
    """What a dispatch mode asks of an operator on every call, looked up once (``facts``)."""

    kind: str
    kept: bool  # recomputation below the layer keeps its outputs
    view: bool
    mutable: bool  # changes an argument in place
    random: bool  # draws random numbers
    cast: bool
    ignored: bool  # checkpoint's selective policy ignores it (``SAC_IGNORED_OPS``)


@functools.cache
def facts(func: torch._ops.OpOverload) -> Facts:
    """An operator's ``Facts``: dispatch modes run on every operator call, where asking its
    schema, tags and packet again each time costs more than many kernels do."""
    kind_ = KINDS.get(func.overloadpacket) or (
        "matmul" if func._schema.name in NAMED_PRODUCTS else "memory")
    return Facts(kind_, kind_ in KEPT_KINDS, func.is_view, func._schema.is_mutable,
                 torch.Tag.nondeterministic_seeded in func.tags, func.overloadpacket in CASTS,
                 func in SAC_IGNORED_OPS)


def uncounted(f: Facts, args: Sequence[Any]) -> bool:
    """Whether a call of an operator with facts ``f`` on ``args`` (its positional arguments,
    or its tensor arguments) may run more or fewer times in a recomputation than in its
    forward, so that calls are matched without it: a cast of what autocast caches the casts
    of, a leaf that requires grad and is no view (a weight; autocast casts it again in a
    recomputation that found it cached in forward; a dispatch mode cannot see whether
    autocast is on: its keys are off while the cast runs). Other casts (a bfloat16 model's
    norm taking its input to float32, autocast's of an activation) run as often each time:
    operators like any other, their outputs kept or run again. Whether grad mode is on does
    not change the answer (a view of a weight is a leaf without it)."""
    return f.cast and args[0].is_leaf and args[0].requires_grad and not args[0]._is_view()


def dequantized_bytes(func: torch._ops.OpOverload, args: tuple, out) -> int:
    """The bytes of the temporary weight a call of a ``DEQUANTIZING`` product makes (its
    output's last dimension by its input's, in the input's dtype); 0 for other operators."""
    if func._schema.name not in DEQUANTIZING:
        return 0
    a = args[0]
    return tensors(out)[0].shape[-1] * a.shape[-1] * a.element_size()


def kind(func: torch._ops.OpOverload) -> str:
    """The kind of an operator's kernel (module docstring)."""
    return facts(func).kind


def kept(func: torch._ops.OpOverload) -> bool:
    """Whether recomputation below the layer keeps this operator's outputs."""
    return facts(func).kept


def leaves(value: Any) -> list[Any]:
    """The values in an operator's arguments (a tuple, keyword arguments: a dict) or outputs,
    in order, as ``tree_flatten`` finds them: ATen nests them in tuples and lists only, and
    walking those is many times faster than pytree, on every operator call."""
    if type(value) is not tuple and type(value) is not list and type(value) is not dict:
        return [value]
    found: list[Any] = []
    _gather(value, found)
    return found


def _gather(value: tuple | list | dict, found: list[Any]) -> None:
    for v in value.values() if type(value) is dict else value:
        if type(v) is tuple or type(v) is list or type(v) is dict:
            _gather(v, found)
        else:
            found.append(v)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among ``leaves(value)``."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in leaves(value) if isinstance(v, torch.Tensor)]


def arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """``tensors((args, kwargs))``: the tensors among an operator's arguments, on every call."""
    found = []
    for values in (args, kwargs.values()) if kwargs else (args,):
        for v in values:
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif type(v) is tuple or type(v) is list:
                found.extend(tensors(v))
    return found


@functools.cache
def _written(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument an operator changes in place."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call of a ``mutable`` operator changes in place (``add_``'s first
    argument, an ``out=`` tensor, a list of them)."""
    found: list[torch.Tensor] = []
    for i, name in _written(func):
        found += tensors(args[i] if i < len(args) else kwargs.get(name))
    return found


# An output whose operator did less than this fraction of the work per byte of the dearest
# kept output of its block is recomputed, not kept: a LoRA adapter's up-projection (rank 16)
# does 16 multiply-adds per output element where the layer's own projection does 4096.
CHEAPER = 32


def flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> float | None:
    """Floating-point operations of a call by ``torch.utils.flop_counter``'s formulas (None
    for an operator without one). Grouped-query attention (fewer key and value heads than
    query heads, as Llama's on CUDA) counts as attention with the query's heads: the formulas
    reject it, and its kernels do that work. A product of ``NAMED_PRODUCTS`` counts two
    operations per multiply-add of its output and its input's last dimension."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        if func._schema.name in NAMED_PRODUCTS:
            return 2.0 * tensors(out)[0].numel() * args[0].shape[-1]
        return None
    if kind(func) == "attention":
        args = _query_heads(args)
    return float(formula(*args, **kwargs, out_val=out))


def _query_heads(args: tuple) -> tuple:
    """Key and value (and in backward the query) shaped with the heads of the first argument
    (the query, or in backward the output's gradient), as meta tensors: the formulas read
    shapes only."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        return args
    heads = first.shape[1]

    def widened(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] == heads:
            return t
        return torch.empty((t.shape[0], heads, *t.shape[2:]), dtype=t.dtype, device="meta")

    return tuple(widened(a) if i < 4 else a for i, a in enumerate(args))


def work_per_byte(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> float:
    """Floating-point operations per byte of output (``flops``; infinite for an operator
    without a formula: it is kept). Remembered by operator and by the shapes, dtypes and
    other values of its arguments and outputs, all a formula reads: the formulas walk their
    arguments with pytree, which costs more than the host time of a matrix product."""
    if flop_registry.get(func.overloadpacket) is None:
        return math.inf  # kept (and a named product is kept by its kind anyway)
    key = (func, _signature(args), _signature(kwargs), _signature(out))
    try:
        cost = _COSTS.get(key)
    except TypeError:  # symbolic shapes: not hashable
        return _work_per_byte(func, args, kwargs, out)
    if cost is None:
        if len(_COSTS) >= _COSTS_HELD:
            _COSTS.clear()
        cost = _COSTS[key] = _work_per_byte(func, args, kwargs, out)
    return cost


_COSTS: dict[tuple, float] = {}
_COSTS_HELD = 4096  # calls of different shapes remembered, at most


def _work_per_byte(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> float:
    outputs = sum(t.nbytes for t in tensors(out))
    work = flops(func, args, kwargs, out)
    if work is None or not outputs:
        return math.inf
    return work / outputs


def _signature(value: Any) -> Any:
    """``value`` with each tensor as its shape and dtype, in tuples (hashable)."""
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.shape, value.dtype)
    if type(value) is tuple or type(value) is list:
        return tuple(_signature(v) for v in value)
    if type(value) is dict:
        return tuple((k, _signature(v)) for k, v in value.items())
    return value


def dear(costs: Sequence[float]) -> list[bool]:
    """Which of a block's kept outputs, of these ``work_per_byte``, stay kept: those within
    ``CHEAPER`` of the dearest (module docstring)."""
    finite = [c for c in costs if c != math.inf]
    top = max(finite, default=0.0)
    return [c == math.inf or c * CHEAPER >= top for c in costs]


# A memory operator whose output has at most this fraction of its largest input's elements
# (a reduction: RMSNorm's mean of squares) is kept too: it costs almost nothing to hold, and
# what made it need not run again (``dataflow.py``).
REDUCES = 64


def reduces(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> bool:
    """Whether this call is a reduction whose output recomputation below the layer keeps."""
    return reduction(func, arguments(args, kwargs), out)


def reduction(func: torch._ops.OpOverload, inputs: list[torch.Tensor], out) -> bool:
    """``reduces``, given the tensors among the call's arguments."""
    f = facts(func)
    if f.kind != "memory" or f.view or not isinstance(out, torch.Tensor) or not inputs:
        return False
    return 0 < out.numel() * REDUCES <= max(t.numel() for t in inputs)
