"""PyTorch's own selective activation checkpointing tests, restated for blocks recomputed
below the layer.

PyTorch's selective activation checkpointing (SAC: ``torch.utils.checkpoint`` with a
``context_fn`` made by ``create_selective_checkpoint_contexts``) saves the outputs of the
operators a policy names (matrix products, attention) and recomputes the rest. A block
recomputed below the layer (``offloader.recompute(["block:elementwise"])``,
``core/selective.py``) is the engine's analogue: its matrix products', attention's and
convolutions' outputs are kept (through the engine's hooks), its elementwise work runs again
in backward. Its promise: training is bitwise plain PyTorch training, and what it cannot
replay exactly it refuses with a reason (the block recomputed whole, or not at all), never
silently differing.

Each case is a small model whose ``nn.ModuleList`` elements are the blocks, built to show
what one of PyTorch's SAC tests checks (named in the case's ``restates``). It trains
``STEPS`` SGD steps plainly and under an Offloader (``plan="raw"``, every block chosen below
the layer by hand before the first step, as ``test_selective.below_layers`` does): step 0 is
measured (plain), step 1 recomputes below the layer under checkpoint and watches each block
(``lean.py``), steps 2 and 3 run each block first without autograd where the watch found that
safe. Losses, gradients, buffers and the RNG state must be bitwise those of plain training
(``test_conformance.differences``), and the engine must either recompute every block below
the layer (and the first recomputed step, which tracks each saved tensor as the measured one
does, save fewer) or leave each out, saying why.

Read for this file (repository pytorch/pytorch):
  * ``test/test_autograd.py``, class ``TestSelectiveActivationCheckpoint``, at
    5c322af10e52e4d236104ceefd542f34e6dcf20a
  * ``test/dynamo/test_activation_checkpointing.py``, class
    ``ActivationCheckpointingViaTagsTests`` (its ``*selective_checkpoint*``/``sac`` tests and
    the eager-meaningful models of the others), at 0069a4184a83906c61f844b32e90e3a87705344a
Not restated: what only concerns SAC's own API (``test_bad_inputs``, policies with state or
``MUST_RECOMPUTE``, ``allow_cache_entry_mutation``, invalid ``context_fn``s, tlparse tags,
partitioners, graph shapes, memory budgets of compiled regions), and the CUDA memory
figures of ``test_flops_and_mem`` (its CPU half, the backward's FLOPs and the bytes saved,
is restated).

Besides the cases, three tests restate one SAC test each:
  * ``test_backward_runs_no_matrix_product_again``: ``test_flops_and_mem``
  * ``test_a_kept_operator_with_a_non_tensor_output_is_not_run_again``:
    ``test_function_with_non_tensor_output``
  * ``test_kept_outputs_go_with_the_graph_or_after_the_last_backward``:
    ``test_storage_lifetime``

Where the engine and SAC differ by design: SAC raises when a saved output is changed in place
(``test_version_counter``) or backward runs twice (``test_can_only_trigger_recompute_once``);
the engine recomputes such an output instead of keeping it, and recomputes again from the same
kept outputs for a second backward (``selective.py``'s docstring).

The last cases are what this suite found, each in its smallest model: before their fixes
an elementwise result read on the host (``.numpy()``, ``.tolist()``: a MoE's split sizes)
was given back as an uninitialised placeholder, NumPy's global generator was not put back
for a recomputation (both silently other gradients), and a tensor subclass input
(``TwoTensor``) made the watched step raise, and a kept product the block leaked (in a
list) and its caller changed in place after it returned was given back changed (through an
alias with a version counter of its own: silently other gradients; the product itself: the
engine's version error where plain PyTorch runs).
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest
import torch
from test_conformance import BATCH, LR, Built, _gen, differences, projected
from test_conformance import train as conformance_train
from test_recompute_safety import stack as stack_of
from torch import nn
from torch.nn import functional as F
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import cswap_lightning as cswap
from cswap_lightning.core import selective
from cswap_lightning.core.recompute import below, outermost, units
from cswap_lightning.planning import ops
from cswap_lightning.planning.workload import BELOW

STEPS = 4  # measured; below the layer under checkpoint, watched; first runs without autograd
WIDTH = 16
HEADS = 2

SAC = "test_autograd.py::TestSelectiveActivationCheckpoint::"
TAGS = "dynamo/test_activation_checkpointing.py::ActivationCheckpointingViaTagsTests::"


def rows(grad: bool = False) -> torch.Tensor:
    return torch.randn(BATCH, 6, WIDTH, generator=_gen()).requires_grad_(grad)


def square() -> torch.Tensor:
    """A square input (the 4x4 matrices of PyTorch's dynamo tests, ``x @ y`` and ``* y``)."""
    return torch.randn(WIDTH, WIDTH, generator=_gen())


def weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[0]))


stack = partial(stack_of, depth=2)  # ``depth`` blocks in an ``nn.ModuleList``


# TestSelectiveActivationCheckpoint (test_autograd.py) ------------------------------------------
class MmCosSin(nn.Module):
    """``test_flops_and_mem``'s ``fn``: ``torch.mm(x.cos(), y).sin()``."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.flatten(0, 1).cos(), self.y).sin().view_as(x)


class IntegerView(nn.Module):
    """``test_output_already_has_autograd_meta``: returns a view of an integer input beside
    ``y.sin().cos()``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ids.view(-1), self.lin(x).sin().cos()


class IntegerViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(IntegerView() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(x.shape[-1]).view(2, -1)
        for layer in self.layers:
            flat, x = layer(x, ids)
            x = x * (1 + flat.float() / WIDTH)
        return x


class ViewsOfAScaled(nn.Module):
    """``test_subclass_dispatching_sizes``'s ``fn``: ``(x * x.sum()).view(-1).view(...)
    .exp()`` (a reduction, views saving their input's shape), on a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h * h.sum() / h.numel()).view(-1).view(-1, WIDTH).exp().view_as(x)


class SinChain(nn.Module):
    """``test_policy_with_state``'s ``fn``: ``x.sin().sin().sin()`` (no matrix product: the
    block keeps nothing but its input), scaled by a trained weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sin().sin().sin()


class ProductChangedInPlace(nn.Module):
    """``test_version_counter``'s ``x.sin().mul_(2).cos().exp()``, on a matrix product's
    output that is itself changed in place (SAC raises: a saved output mutated; the engine
    recomputes that output instead of keeping it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w).mul_(0.5)
        return h.sin().mul_(2).cos().exp()


class VarMean(nn.Module):
    """``test_function_with_more_than_one_output``: ``torch.var_mean`` (two outputs, a
    reduction the block keeps) normalising a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        var, mean = torch.var_mean(h, -1, keepdim=True)
        return self.down((h - mean) * torch.rsqrt(var + 1e-5) * mean.sigmoid())


class Dropped(nn.Module):
    """A linear layer, dropout and tanh (``test_storage_lifetime``'s and
    ``test_can_only_trigger_recompute_once``'s blocks, with a random operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).tanh().cos()


def discarded(model: nn.Module, inputs: dict) -> torch.Tensor:
    """A forward whose graph goes without backward (its loss is never used), then the
    step's."""
    model(inputs["x"])
    return projected(model(inputs["x"]))


def retained(model: nn.Module, inputs: dict) -> torch.Tensor:
    """A backward through the blocks with the graph retained, then the step's own backward
    through them again."""
    out = model(inputs["x"])
    projected(out, 3).backward(retain_graph=True)
    return projected(out)


# ActivationCheckpointingViaTagsTests (dynamo/test_activation_checkpointing.py) -------------------
class Gemm(nn.Module):
    """``test_compile_selective_checkpoint_must_not_recompute_gemm``'s (and
    ``test_sac_with_partial_context_fn``'s) ``torch.sigmoid(torch.matmul(torch.matmul(x, y),
    y)) * y``."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.y
        return torch.sigmoid(torch.matmul(torch.matmul(x, y), y)) * y


class MustRecompute(nn.Module):
    """``test_compile_selective_checkpoint_must_recompute``'s ``torch.cos(torch.sin(
    torch.matmul(x, x) @ x))``: products of the input with itself."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((WIDTH,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w
        return torch.cos(torch.sin(torch.matmul(x, x) @ x))


class AddOne(torch.autograd.Function):
    """``test_compile_selective_checkpoint_triton_kernel``'s ``AddOne`` (its kernel an
    elementwise addition here): its backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class WithAddOne(Gemm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.y
        return torch.sigmoid(torch.matmul(torch.matmul(AddOne.apply(x.sin()), y), y)) * y


class CustomRule(Gemm):
    """``test_compile_selective_checkpoint_custom_rule``'s ``torch.sigmoid(torch.sigmoid(
    torch.matmul(torch.matmul(x, y) * y, y) * y))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.y
        return torch.sigmoid(torch.sigmoid(torch.matmul(torch.matmul(x, y) * y, y) * y))


class OutOfPlace(Gemm):
    """``test_compile_selective_checkpoint_outplace_op``'s ``torch.sigmoid(torch.selu(
    torch.matmul(torch.matmul(x, y), y))).relu()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.y
        return torch.sigmoid(torch.selu(torch.matmul(torch.matmul(x, y), y))).relu()


class InPlace(Gemm):
    """``test_compile_selective_checkpoint_inplace_op``'s ``torch.sigmoid(torch.selu_(
    torch.matmul(torch.matmul(x, y), y))).relu_()``: the product changed in place, and the
    block's output made in place. (PyTorch's own, skipped, changes sigmoid's saved output in
    place, which plain autograd refuses: here relu_ changes a product with ``y``.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.y
        return (torch.sigmoid(torch.selu_(torch.matmul(torch.matmul(x, y), y))) * y).relu_()


class RandomOp(nn.Module):
    """``test_compile_selective_checkpoint_random_op``'s ``torch.sigmoid(torch.dropout(
    torch.sigmoid(x), p=0.5, train=True))``, and ``test_tags_recomputed_rand``'s
    ``torch.sigmoid(torch.rand_like(x) * y) * x`` and a ``torch.randn`` noise: three random
    operators the recomputation must draw alike."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(torch.dropout(torch.sigmoid(x @ self.y), p=0.5, train=True))
        h = torch.sigmoid(torch.rand_like(h) * self.y) * h
        return h + 0.1 * torch.randn(h.shape)


class ListOps(nn.Module):
    """``test_compile_selective_checkpoint_list_ops``'s ``torch.cat([x, y]).sin()`` (an
    operator taking a list), its halves multiplied."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x @ self.y, self.y]).sin()
        return h[:WIDTH] * h[WIDTH:]


class Parametrization(nn.Module):
    """``test_compile_selective_checkpoint_parametrization``'s: ``sigmoid(x * x)`` of the
    weight, itself under SAC inside the block (``inner``) or not."""

    def __init__(self, inner: bool) -> None:
        super().__init__()
        self.inner = inner

    def parametrization(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.mul(x, x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inner:
            return self.parametrization(x)

        def saving_products():
            return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

        return checkpoint(self.parametrization, x, use_reentrant=False,
                          context_fn=saving_products)


def parametrized(inner: bool) -> nn.Module:
    """A linear layer whose weight is parametrized, then tanh."""
    lin = nn.Linear(WIDTH, WIDTH)
    nn.utils.parametrize.register_parametrization(lin, "weight", Parametrization(inner),
                                                  unsafe=True)
    return nn.Sequential(lin, nn.Tanh())


class ManualAttention(nn.Module):
    """``test_pattern_matcher``'s ``dot_prod_attention``: ``torch.matmul(query,
    key.transpose(-2, -1)).mul(1.0 / math.sqrt(key.shape[-1])).softmax(dim=-1)
    .matmul(value)``, the query's ``sin`` before it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, HEADS, -1).transpose(1, 2) for s in self.qkv(x).chunk(3, -1))
        a = (torch.matmul(q.sin(), k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1]))
             .softmax(dim=-1).matmul(v))
        return x + self.out(a.transpose(1, 2).reshape(b, t, -1))


class AutocastAttention(ManualAttention):
    """``test_autocast_flash_attention``: ``scaled_dot_product_attention`` under autocast
    (bfloat16 on the CPU), entered inside the block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = (s.view(b, t, HEADS, -1).transpose(1, 2)
                       for s in self.qkv(x).chunk(3, -1))
            a = F.scaled_dot_product_attention(q, k, v, scale=0.17677669529663687)
            h = self.out(a.transpose(1, 2).reshape(b, t, -1))
        return x + h.float()


class SameTwice(nn.Module):
    """``test_return_same_element_twice``: ``y = torch.sin(x); return y, y``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.sin(self.lin(x))
        return y, y


class SameTwiceStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SameTwice() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            a, b = layer(x)
            x = a * b + a
        return x


class Appending(nn.Module):
    """``test_nonlocal_list_mutation_hidden``: appends ``x.sin()`` to a list it is given (a
    tensor that leaves the block beside its outputs) and returns ``torch.cos(torch.sin(o)),
    torch.sin(x)`` of a product ``o``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, z: list) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.matmul(x, self.w) @ self.w
        z.append(x.sin())
        return torch.cos(torch.sin(o)), torch.sin(x)


class AppendingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Appending() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            z: list = []
            out1, out2 = layer(x, z)
            x = out1 + out2 * z[0]
        return x


@dataclass(frozen=True)
class InputNode:
    x: torch.Tensor


@dataclass(frozen=True)
class OutputNode:
    y: torch.Tensor


class TinyMLP(nn.Module):
    """``test_frozen_dataclass_pytree_output``'s ``TinyMLP``: a frozen dataclass in, one out
    (not registered with pytree here: that is global state)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, inp: InputNode) -> OutputNode:
        return OutputNode(y=self.fc2(F.silu(self.fc1(inp.x))))


class DataclassStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TinyMLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(InputNode(x)).y.tanh()
        return x


class ListIn(nn.Module):
    """``test_list_inputs``' ``MockModule``: ``forward(x, ys)``, an unused ``torch.sin(x)``,
    returns ``(x, [b, c])`` (its own input among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, ys: list) -> tuple[torch.Tensor, list]:
        a = torch.sin(x)  # noqa: F841  (as PyTorch's)
        b = torch.cos(self.lin(ys[0]))
        c = torch.cos(ys[1] * 2)
        return x, [b, c]


class ListInStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ListIn() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = [x.tanh(), x.sigmoid()]
        for layer in self.layers:
            x, ys = layer(x, ys)
        return x + ys[0] * ys[1]


class Squared(nn.Module):
    """``test_tags_must_save_tensor_that_has_backward_hook``'s ``MySubmod``:
    ``y = torch.matmul(x, w); z = y * y``, then a LayerNorm after it outside."""

    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.w)
        return self.inner(y * y)


def backward_hook_on_the_output(where: str) -> Callable[[], nn.Module]:
    """A post-forward hook that registers a backward hook on the output, on each block
    (``"block"``) or on a module inside it (``"inside"``)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        output.register_hook(lambda grad: grad * 0.5)
        return output

    def build() -> nn.Module:
        model = stack(Squared)
        model.norm = nn.LayerNorm(WIDTH)
        for layer in model.layers:
            (layer if where == "block" else layer.inner).register_forward_hook(hook)
        return model

    return build


class Recorded(nn.Module):
    """``test_checkpoint_with_record_function``: ``torch.sigmoid(torch.matmul(x, y))`` inside
    ``torch.profiler.record_function``."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("matmul_region"):
            return torch.sigmoid(torch.matmul(x.sin(), self.y))


CALLS: list[int] = [0]  # a counter outside the blocks (``test_nonlocal_mutation``)


class CountingOutside(nn.Module):
    """``test_nonlocal_mutation``'s ``gn``: counts its calls in a global, returns
    ``torch.sin(x)`` (of a linear layer's output here)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[0] += 1
        return torch.sin(self.lin(x))


class TopK(nn.Module):
    """``test_multi_output_op``: ``torch.topk`` (values and integer indices) of ``x.sin()``,
    the values summed, ``cos`` of it; the indices used to gather."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).sin()
        vals, idxs = torch.topk(h, k=2)
        return h * vals.sum(-1, keepdim=True).cos() + h.gather(-1, idxs).mean(-1, keepdim=True)


class Detaching(nn.Module):
    """``test_pre_mode_decomp_has_sac_ignored_ops``' ``op_with_detach``: ``a = x.sin();
    (a.detach() + a).cos()``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x).sin()
        return (a.detach() + a).cos()


class Silu(nn.Module):
    """``test_post_mode_decomp``'s ``x.sin()``, ``silu``, ``x.cos()``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.lin(x).sin()).cos()


def dropout_module() -> nn.Module:
    """``test_tags_dropout``'s ``MockModule``: ``self.dropout(self.linear(x))``."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2), nn.Tanh())


class Kwargs(nn.Module):
    """``test_kwargs``' ``gn(x, y, z=None)``: ``a = torch.matmul(x, y)``, then ``torch.matmul
    (a, z)`` where ``z`` is given (a keyword argument that needs a gradient), ``cos`` after."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        a = torch.matmul(x, self.y).tanh()
        return torch.cos(torch.matmul(a, z) if z is not None else a)


class KwargsStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.z = weight(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Kwargs() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, z=self.z * 2) if i == 0 else layer(x)
        return x


class DroppedWeight(nn.Module):
    """``test_symints_location``'s ``torch.matmul(x, F.dropout(y, 0.5))``: dropout on the
    weight, before the product."""

    def __init__(self) -> None:
        super().__init__()
        self.y = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, F.dropout(self.y, 0.5)).tanh()


class MyMM(torch.autograd.Function):
    """``test_ac_tags_through_custom_autograd_function``'s (and ``test_sac_tags_through_
    custom_autograd_function``'s) ``MyMM``: a matrix product inside a custom Function."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class CustomMM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MyMM.apply(x.flatten(0, 1).sin(), self.w).tanh().view_as(x)


# what else the brief of a selective policy meets --------------------------------------------------
class Strided(nn.Module):
    """Views of a product: ``as_strided`` over it, a transpose, ``unfold``; then elementwise
    work on each."""

    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(0, 1) @ self.w  # (12, 16)
        halves = h.as_strided((h.shape[0], WIDTH // 2), (WIDTH, 2)).sin()  # even columns
        windows = h.unfold(1, 4, 4).tanh().flatten(1)  # four windows of four
        return (h.t().t().cos() * windows + halves.repeat(1, 2)).view_as(x)


class ChangesItsInput(nn.Module):
    """Changes its input in place before using it (plainly fine: nothing saved it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.lin(x).tanh() + 1  # a sum nothing saves: the next block may change it


class InputChangedAfter(nn.Module):
    """Blocks whose input (which they save nothing of: a product by a number first) is
    changed in place after they return."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(Scaled(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = x + 0  # a fresh tensor nothing saves
            y = layer(h)
            h.add_(1)
            x = y * 2 + h
        return x


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class OutputChangedAfter(nn.Module):
    """Blocks returning a product (which nothing inside saves), changed in place after they
    return, and a product they use inside only."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                  nn.Linear(2 * WIDTH, WIDTH))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
            y.mul_(0.5)
            x = torch.tanh(y) + x
        return x


class Masked(nn.Module):
    """Part of its forward under ``torch.no_grad``: a mask made from a product."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            mask = (h.abs() > h.abs().mean()).to(h.dtype)
        return torch.tanh(h) * mask + h.sigmoid()


class Indexing(nn.Module):
    """Integer and boolean tensors made inside and returned (a mask, ``argmax`` indices),
    ``torch.where``, ``index_select``, ``gather`` and ``scatter``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("perm", torch.randperm(WIDTH))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        mask = h > 0
        idx = h.argmax(-1, keepdim=True)
        picked = h.sin().gather(-1, idx)
        selected = torch.index_select(h.cos(), -1, self.perm)
        spread = torch.zeros_like(h).scatter(-1, idx, picked)
        return torch.where(mask, h.tanh(), selected) + spread, mask, idx


class IndexingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Indexing() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h, mask, idx = layer(x)
            x = h * mask + h.gather(-1, idx)
        return x


class AutocastInside(nn.Module):
    """Enters CPU autocast (bfloat16) itself: its products in bfloat16, its LayerNorm in
    float32 (autocast upcasts it), GELU between."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(2 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.down(F.gelu(self.norm(self.up(x))))
        return x + h.float()


class RMSNormMLP(nn.Module):
    """A bfloat16 block: Llama's RMSNorm (up to float32 for the mean of squares, back down),
    a SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(WIDTH))
        self.gate, self.up = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.norm * h.to(x.dtype)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def bfloat16_rms() -> nn.Module:
    return stack(RMSNormMLP).to(torch.bfloat16)


class Products(nn.Module):
    """Every product kind: ``addmm``, ``bmm``, ``baddbmm``, ``einsum``, ``F.linear``, with
    elementwise work between."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = weight(WIDTH, WIDTH), nn.Parameter(torch.zeros(WIDTH))
        self.w2, self.w3 = weight(BATCH, WIDTH, WIDTH), weight(BATCH, WIDTH, WIDTH)
        self.w4, self.w5 = weight(WIDTH, WIDTH), weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.addmm(self.b1, x.flatten(0, 1), self.w1).view_as(x).sin()
        b = torch.bmm(a, self.w2).tanh()
        c = torch.baddbmm(b, a, self.w3, beta=0.5).cos()
        d = torch.einsum("btd,de->bte", c, self.w4).sigmoid()
        return F.linear(d * a, self.w5).tanh()


class Layer(nn.Module):
    """A pre-norm transformer layer: SDPA (causal, dropout) and an MLP; takes a mask and a
    scale for its MLP's output as keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, HEADS, -1).transpose(1, 2)
                   for s in self.qkv(self.ln1(x)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        h = self.down(F.gelu(self.up(self.ln2(x))))
        return x + self.drop(h if scale is None else h * scale)


class Transformer(nn.Module):
    """Two layers; ``keywords``: called with a mask and a scale (from a parameter) as keyword
    arguments; ``twice``: the first layer called again last."""

    def __init__(self, keywords: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.keywords, self.twice = keywords, twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        for layer in (*self.layers, self.layers[0]) if self.twice else self.layers:
            x = layer(x, mask=mask, scale=self.gain * 2) if self.keywords else layer(x)
        return x


class TwoLengths(nn.Module):
    """Each layer called on two lengths of the batch in one step (``test_symints_location``
    calls its checkpoint on 4x4, then 5x5 inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x, x[:, :4]
        for layer in self.layers:
            a, b = layer(a), layer(b)
        return torch.cat([a, b], 1)


class LearnedBias(nn.Module):
    """SDPA with a trained additive mask (a relative-position bias) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.bias = nn.Parameter(torch.randn(HEADS, 6, 6) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, HEADS, -1).transpose(1, 2) for s in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.1)
        return x + a.transpose(1, 2).reshape(b, t, -1)


# what this suite found (each fails: its case is marked) ------------------------------------------
class HostRead(nn.Module):
    """Reads an elementwise result on the host (``.numpy()``: no ATen operator) and scales
    by it: the read is no operator, so the dataflow finds nothing needs ``sin``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.tanh(h * (1 + float(h.sin().detach().numpy().mean())))


class Experts(nn.Module):
    """A mixture of two experts as MoE layers route in eager PyTorch: tokens sorted by the
    expert their router picks, split by the counts read on the host (``.tolist()``), each
    part through its expert, put back in order."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, 2)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, WIDTH)
        picked = self.router(flat).argmax(-1)
        order = picked.argsort(stable=True)
        counts = torch.bincount(picked, minlength=2).tolist()
        parts = flat[order].split(counts)
        out = torch.cat([torch.tanh(e(part)) for e, part in zip(self.experts, parts)])
        return out[order.argsort()].reshape(x.shape)


class Leaking(nn.Module):
    """Appends its product to a list it is given, and returns elementwise work on it that
    saves twice its bytes. ``flat``: a 2-D ``mm``, whose output itself is leaked; else a 3-D
    ``matmul`` (``mm``, then ``_unsafe_view``: an alias with a version counter of its own)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)
        self.flat = flat

    def forward(self, x: torch.Tensor, z: list) -> torch.Tensor:
        h = (x.flatten(0, -2) if self.flat else x) @ self.w
        z.append(h)
        return torch.cat([h, h], -1).sin().view(*x.shape[:-1], 2 * WIDTH)


class LeakingStack(nn.Module):
    """The caller changes the product the block leaked in place after it returned (plainly
    fine: autograd saved nothing of it)."""

    def __init__(self, flat: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Leaking(flat)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z: list = []
        y = self.layers[0](x, z)
        z[0].mul_(0.5)
        return y[..., :WIDTH] * y[..., WIDTH:] + z[0].view(x.shape)


class Cached(nn.Module):
    """Puts its product in a cache it is given, and returns its sine (which saves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = weight(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, cache: list) -> torch.Tensor:
        h = x.flatten(0, -2) @ self.w
        cache.append(h)
        return h.sin().view(x.shape)


class CachedStack(nn.Module):
    """The caller changes the cached product in place after the block (``change``)."""

    def __init__(self, change: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Cached()])
        self.change = change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache: list = []
        y = self.layers[0](x, cache)
        if self.change:
            cache[0].mul_(0.5)
        return y * 2


class NumpyRandom(nn.Module):
    """Scales elementwise work by a number drawn from NumPy's global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).mul(0.5 + float(np.random.rand())).sin()


def two_tensors() -> torch.Tensor:
    """A ``TwoTensor`` (PyTorch's test subclass) of two square inputs."""
    x = square()
    return TwoTensor(x, x * 2)


# the cases ------------------------------------------------------------------------------------
@dataclass
class Case:
    """A model (``build``), the PyTorch tests it restates, and what the engine does with its
    blocks below the layer: ``refused`` "" where it recomputes every one, else the start of
    why it leaves each out. ``x``: the batch; ``loss``: the step's loss (the output projected
    on fixed random weights); ``frees``: the first recomputed step saves fewer tensors than
    the measured one (False: as many or more, where the block keeps all it saves); ``lean``:
    None, or the start of every block's verdict on its first runs without autograd (``""``:
    they go so)."""

    build: Callable[[], nn.Module]
    restates: str
    refused: str = ""
    x: Callable[[], torch.Tensor] = rows
    loss: Callable[[nn.Module, dict], torch.Tensor] = field(
        default=lambda model, inputs: projected(model(inputs["x"])))
    frees: bool = True
    lean: str | None = None

    def built(self) -> Built:
        torch.manual_seed(0)
        return Built(self.build(), {"x": self.x()}, self.loss)


CASES = {
    # TestSelectiveActivationCheckpoint
    "a product between elementwise work": Case(
        lambda: stack(MmCosSin), f"{SAC}test_flops_and_mem", lean=""),
    "an integer input's view returned": Case(
        IntegerViews, f"{SAC}test_output_already_has_autograd_meta",
        lean="it returns its input or a view of it"),
    "views of a product scaled by its sum": Case(
        lambda: stack(ViewsOfAScaled), f"{SAC}test_subclass_dispatching_sizes (its fn)"),
    "no product at all": Case(lambda: stack(SinChain), f"{SAC}test_policy_with_state (its fn)"),
    "a product and what is made of it changed in place": Case(
        lambda: stack(ProductChangedInPlace), f"{SAC}test_version_counter"),
    "an operator with two outputs kept": Case(
        lambda: stack(VarMean), f"{SAC}test_function_with_more_than_one_output"),
    "a graph that goes without backward": Case(
        lambda: stack(Dropped), f"{SAC}test_storage_lifetime (case 1)", loss=discarded),
    "a second backward, the graph retained": Case(
        lambda: stack(Dropped), f"{SAC}test_can_only_trigger_recompute_once, "
                                f"{SAC}test_storage_lifetime (case 2)", loss=retained),
    # ActivationCheckpointingViaTagsTests
    "products of products, times a weight": Case(
        lambda: stack(Gemm), f"{TAGS}test_compile_selective_checkpoint_must_not_recompute_gemm, "
                             f"{TAGS}test_sac_with_partial_context_fn, "
                             f"{TAGS}test_compile_selective_checkpoint_partial_ctx_fn",
        x=square),
    "a product of the input with itself": Case(
        lambda: stack(MustRecompute), f"{TAGS}test_compile_selective_checkpoint_must_recompute",
        x=square),
    "a custom autograd Function between products": Case(
        lambda: stack(WithAddOne), f"{TAGS}test_compile_selective_checkpoint_triton_kernel",
        x=square),
    "a product inside a custom autograd Function": Case(
        lambda: stack(CustomMM), f"{TAGS}test_ac_tags_through_custom_autograd_function, "
                                 f"{TAGS}test_sac_tags_through_custom_autograd_function"),
    "elementwise work between products": Case(
        lambda: stack(CustomRule), f"{TAGS}test_compile_selective_checkpoint_custom_rule",
        x=square),
    "selu, sigmoid, relu out of place": Case(
        lambda: stack(OutOfPlace), f"{TAGS}test_compile_selective_checkpoint_outplace_op",
        x=square),
    "selu_ on a product, relu_ on the output": Case(
        lambda: stack(InPlace), f"{TAGS}test_compile_selective_checkpoint_inplace_op",
        x=square),
    "dropout, rand_like and randn inside": Case(
        lambda: stack(RandomOp), f"{TAGS}test_compile_selective_checkpoint_random_op, "
                                 f"{TAGS}test_tags_recomputed_rand", x=square),
    "dropout on a weight before its product": Case(
        lambda: stack(DroppedWeight), f"{TAGS}test_symints_location"),
    "dropout after a linear layer": Case(lambda: stack(dropout_module), f"{TAGS}test_tags_dropout"),
    "an operator taking a list": Case(
        lambda: stack(ListOps), f"{TAGS}test_compile_selective_checkpoint_list_ops", x=square),
    "a parametrized weight": Case(
        lambda: stack(lambda: parametrized(False)),
        f"{TAGS}test_compile_selective_checkpoint_parametrization (without its checkpoint)"),
    "a parametrized weight under SAC inside the block": Case(
        lambda: stack(lambda: parametrized(True)),
        f"{TAGS}test_compile_selective_checkpoint_parametrization"),
    "attention by matmul and softmax": Case(
        lambda: stack(ManualAttention), f"{TAGS}test_pattern_matcher"),
    "SDPA under autocast inside the block": Case(
        lambda: stack(AutocastAttention), f"{TAGS}test_autocast_flash_attention"),
    "one tensor returned twice": Case(
        SameTwiceStack, f"{TAGS}test_return_same_element_twice",
        lean="it returns one tensor twice"),
    "a tensor appended to a list it was given": Case(
        AppendingStack, f"{TAGS}test_nonlocal_list_mutation_hidden, "
                        f"{TAGS}test_nonlocal_list_mutation"),
    "a dataclass in, a dataclass out": Case(
        DataclassStack, f"{TAGS}test_frozen_dataclass_pytree_output"),
    "a list in, its own input and a list out": Case(
        ListInStack, f"{TAGS}test_list_inputs"),
    "a hook on the block registering one on its output": Case(
        backward_hook_on_the_output("block"),
        f"{TAGS}test_tags_must_save_tensor_that_has_backward_hook"),
    "a hook inside the block registering one on its output": Case(
        backward_hook_on_the_output("inside"),
        f"{TAGS}test_tags_must_save_tensor_that_has_backward_hook (the hook on a submodule)",
        refused="forward hooks on layers."),
    "record_function inside": Case(
        lambda: stack(Recorded), f"{TAGS}test_checkpoint_with_record_function"),
    "a global counter": Case(lambda: stack(CountingOutside), f"{TAGS}test_nonlocal_mutation"),
    "topk's values and indices": Case(lambda: stack(TopK), f"{TAGS}test_multi_output_op"),
    "a detached alias added to itself": Case(
        lambda: stack(Detaching), f"{TAGS}test_pre_mode_decomp_has_sac_ignored_ops"),
    "silu between sin and cos": Case(lambda: stack(Silu), f"{TAGS}test_post_mode_decomp"),
    "a tensor keyword argument": Case(KwargsStack, f"{TAGS}test_kwargs"),
    # what else a selective policy meets
    "as_strided, unfold and transposes of a product": Case(
        lambda: stack(Strided), f"{SAC}test_subclass_dispatching_sizes (views saving shapes)"),
    "the block changes its input in place": Case(
        lambda: stack(ChangesItsInput), f"{SAC}test_version_counter (an input mutated)",
        refused="changes an input in place"),
    "the block's input changed in place after it returns": Case(
        InputChangedAfter, f"{SAC}test_version_counter (an input mutated after)",
        refused="its input is changed in place after it returns"),
    "the block's output changed in place after it returns": Case(
        OutputChangedAfter, f"{SAC}test_version_counter (a returned product mutated)"),
    "a mask made under no_grad": Case(
        lambda: stack(Masked), f"{SAC}test_output_already_has_autograd_meta (no_grad inside)"),
    "masks, argmax, where, index_select, gather, scatter": Case(
        IndexingStack, f"{TAGS}test_multi_output_op (integer and boolean outputs)"),
    "autocast inside, a LayerNorm upcast": Case(
        lambda: stack(AutocastInside), f"{TAGS}test_autocast_flash_attention (autocast inside)"),
    "RMSNorm's float32 upcast in a bfloat16 block": Case(
        bfloat16_rms, f"{TAGS}test_post_mode_decomp (silu, a norm's upcast)",
        x=lambda: rows().to(torch.bfloat16)),
    "addmm, bmm, baddbmm, einsum, linear": Case(
        lambda: stack(Products), f"{TAGS}test_compile_selective_checkpoint_must_not_recompute_gemm"
                                 " (every product kind)"),
    "SDPA with a causal mask and dropout": Case(
        Transformer, f"{TAGS}test_autocast_flash_attention (SDPA, in float32)"),
    "a transformer layer called twice": Case(
        lambda: Transformer(twice=True), f"{TAGS}test_tags_multiple_checkpoints (one block twice)"),
    "a transformer layer with keyword arguments": Case(
        lambda: Transformer(keywords=True), f"{TAGS}test_kwargs (a layer's mask and scale)"),
    "a transformer layer called on two lengths": Case(
        TwoLengths, f"{TAGS}test_symints_location (two input shapes)"),
    "SDPA with a trained mask and dropout": Case(
        lambda: stack(LearnedBias), f"{TAGS}test_autocast_flash_attention (SDPA, a mask)"),
    # found by this suite (each trained otherwise than plain PyTorch, or raised, before its
    # fix)
    "an elementwise result read on the host": Case(
        lambda: stack(HostRead, depth=1),
        f"{SAC}test_function_with_non_tensor_output (a value leaving the tensors)"),
    "token counts read on the host to split tokens among experts": Case(
        lambda: stack(Experts, depth=1),
        f"{SAC}test_function_with_non_tensor_output (a MoE's split sizes)"),
    "a product leaked in a list, changed in place after the block": Case(
        LeakingStack, f"{TAGS}test_nonlocal_list_mutation (the leaked tensor then mutated)"),
    "a 2-D product leaked in a list, changed in place after the block": Case(
        lambda: LeakingStack(flat=True),
        f"{TAGS}test_nonlocal_list_mutation (the leaked tensor then mutated)"),
    "a number drawn from NumPy's generator": Case(
        lambda: stack(NumpyRandom, depth=1),
        f"{TAGS}test_compile_selective_checkpoint_random_op (a host random number)"),
    "a tensor subclass input": Case(
        lambda: stack(Gemm, depth=1), f"{TAGS}test_compile_selective_checkpoint_tensor_subclass",
        x=two_tensors),  # under checkpoint: its first runs never go without autograd
}


# training -------------------------------------------------------------------------------------
def train(case: Case, offloader: cswap.Offloader | None = None,
          choose: Callable[[nn.Module], object] | None = None, steps: int = STEPS) -> list:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cswap: (no longer recomputing|backward ran inside"
                                          "|a second derivative)")
        return conformance_train(case.built(), steps, offloader, choose)


def layers_below(model: nn.Module) -> list[str]:
    """Every block of the model (each element of its ``nn.ModuleList``) below the layer."""
    return list(below(units(model)))


def engine() -> cswap.Offloader:
    return cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                             budget=None))


@dataclass
class Run:
    steps: list
    offloader: cswap.Offloader
    chosen: list[str]
    skipped: dict[str, str]

    def left_out(self) -> dict[str, str]:
        """The chosen blocks not recomputed, with why (skipped when chosen, or found unfit
        on the measured step)."""
        unfit = self.offloader.recomputer.unfit
        return {name: self.skipped.get(name) or unfit[name.removesuffix(BELOW)]
                for name in self.chosen
                if name in self.skipped or name.removesuffix(BELOW) in unfit}


def below_the_layer(case: Case, offloader: cswap.Offloader) -> Run:
    """Every block chosen below the layer by hand before the first (measured) step."""
    chosen: list[str] = []
    skipped: dict[str, str] = {}

    def choose(model: nn.Module) -> None:
        chosen.extend(layers_below(model))
        skipped.update(offloader.watch(model).recompute(chosen))

    return Run(train(case, offloader, choose), offloader, chosen, skipped)


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_below_the_layer_train_as_plain_pytorch(name):
    case = CASES[name]
    want = train(case)
    offloader = engine()
    try:
        run = below_the_layer(case, offloader)
        assert run.chosen and all(n.endswith(BELOW) for n in run.chosen)
        assert not differences(want, run.steps)
        left_out = run.left_out()
        if case.refused:
            assert not offloader.recomputed, offloader.recomputed
            assert set(left_out) == set(run.chosen), left_out
            assert all(why.startswith(case.refused) for why in left_out.values()), left_out
        else:
            assert offloader.recomputed == set(run.chosen) and not left_out, left_out
            measured, recomputed = run.steps[0].stats, run.steps[1].stats
            assert (len(recomputed.sites) < len(measured.sites)) == case.frees
            if case.lean is not None:
                why = offloader.recomputer.verdicts.why
                assert set(why) == set(run.chosen), why
                assert all(w.startswith(case.lean) for w in why.values()), why
    finally:
        offloader.close()


@pytest.mark.parametrize("change", [False, True])
def test_a_product_saved_and_cached_outside_stays_kept_and_checked_as_plain(change):
    """A kept product the block also puts in a cache, and autograd saved (a key-value cache's
    keys): it stays kept (``_Kept.held_elsewhere`` spares it), training is plain's, and
    changed in place after the block it raises the version error plain PyTorch raises."""
    case = Case(lambda: CachedStack(change), "a cache's tensor changed in place")
    offloader = engine()
    try:
        if change:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                train(case)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                below_the_layer(case, offloader)
        else:
            want = train(case)
            run = below_the_layer(case, offloader)
            assert not differences(want, run.steps)
            assert offloader.recomputed == set(run.chosen)
            measured, recomputed = run.steps[0].stats, run.steps[1].stats
            assert activations(recomputed) == activations(measured)  # the product, kept
    finally:
        offloader.close()


# the backward's work and the bytes kept ----------------------------------------------------------
def activations(stats: cswap.StepStats) -> int:
    """The bytes of the activations a step saved (not its parameters; each storage once)."""
    return sum(s.nbytes for s in stats.sites if s.decision != "dedup" and s.reason != "parameter")


def backward_work(how: str) -> tuple[list[list[torch.Tensor]], list[int], list[int]]:
    """``STEPS`` SGD steps of two ``MmCosSin`` blocks, plainly (``how``: "plain") or with the
    blocks recomputed "below" the layer or "whole": each step's gradients, its backward's
    FLOPs (``FlopCounterMode``, entered before the engine's modes: it sees what they run, not
    what they give back) and the bytes of the activations it saved."""
    torch.manual_seed(0)
    model, x = stack(MmCosSin), rows(grad=True)
    offloader = None if how == "plain" else engine()
    if offloader is not None:
        offloader.watch(model).recompute(
            layers_below(model) if how == "below" else outermost(units(model)))
    grads, flops, saved = [], [], []
    try:
        for i in range(STEPS):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + i)
            with offloader if offloader is not None else contextlib.nullcontext():
                loss = model(x).sum()  # as PyTorch's fn: nothing more saved
            with FlopCounterMode(display=False) as mode:
                loss.backward()
            flops.append(mode.get_total_flops())
            if offloader is not None:
                saved.append(activations(offloader.last_step()))
            grads.append([p.grad.clone() for p in (*model.parameters(), x)])
            x.grad = None
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(LR * p.grad)
    finally:
        if offloader is not None:
            offloader.close()
    return grads, flops, saved


def test_backward_runs_no_matrix_product_again():
    """test_autograd.py::TestSelectiveActivationCheckpoint::test_flops_and_mem, on the CPU:
    ``torch.mm(x.cos(), y).sin()``. SAC's backward does the FLOPs of plain backward (2.0 of
    its units) where checkpoint's does the forward's product again (3.0), and saves the
    product's output (1.0) where plain saves two activations (2.0) and checkpoint none
    (0.0). Below the layer: every backward's FLOPs are plain backward's, bitwise its
    gradients; the first recomputed step saves the product's output beside the block's
    input, plainly also ``cos``'s output, whole only the input."""
    plain, plain_flops, _ = backward_work("plain")
    below_grads, below_flops, below_saved = backward_work("below")
    whole_grads, whole_flops, whole_saved = backward_work("whole")
    for grads in (below_grads, whole_grads):
        assert all(torch.equal(a, b) for want, got in zip(plain, grads, strict=True)
                   for a, b in zip(want, got, strict=True))
    assert len(set(plain_flops)) == 1 and plain_flops[0] > 0
    assert below_flops == plain_flops
    product = 2 * BATCH * 6 * WIDTH * WIDTH  # one block's forward mm
    assert whole_flops == [plain_flops[0]] + [plain_flops[0] + 2 * product] * (STEPS - 1)
    # step 0 is measured plainly; step 1 tracks every saved tensor (the later ones do not)
    one = BATCH * 6 * WIDTH * 4  # one activation's bytes
    assert below_saved[0] == whole_saved[0] == 3 * 2 * one  # per block: x, cos(x), mm
    assert below_saved[1] == 2 * 2 * one  # per block: its input, the product
    assert whole_saved[1] == 2 * one  # per block: its input


# an operator with a non-tensor output, kept ---------------------------------------------------
EXTRA_CALLS: list[bool] = []  # for each call of sin_with_extra, whether backward ran it


@torch.library.custom_op("cswap_sac::sin_with_extra", mutates_args=())
def sin_with_extra(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``test_function_with_non_tensor_output``'s ``mylib::sin_with_extra``."""
    EXTRA_CALLS.append(torch._C._current_graph_task_id() != -1)
    return x.sin(), 2


def _sin_with_extra_saves(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _sin_with_extra_backward(ctx, grad, _unused):
    (x,) = ctx.saved_tensors
    return grad * x.cos()


torch.library.register_autograd("cswap_sac::sin_with_extra", _sin_with_extra_backward,
                                setup_context=_sin_with_extra_saves)


class WithExtra(nn.Module):
    """``(sin_with_extra(x)[0] * x.sin().exp()).sin()``, of a linear layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (torch.ops.cswap_sac.sin_with_extra(h)[0] * h.sin().exp()).sin()


@pytest.fixture
def kept_custom_op(monkeypatch):
    """``sin_with_extra`` kept below the layer, as SAC's op list keeps it (a kind the engine
    keeps, as ``test_selective``'s ``attend`` is made attention)."""
    monkeypatch.setitem(ops.KINDS, torch.ops.cswap_sac.sin_with_extra, "matmul")
    ops.facts.cache_clear()
    yield
    ops.facts.cache_clear()


@pytest.mark.usefixtures("kept_custom_op")
@pytest.mark.parametrize("how", ["below", "whole"])
def test_a_kept_operator_with_a_non_tensor_output_is_not_run_again(how):
    """test_autograd.py::TestSelectiveActivationCheckpoint::test_function_with_non_tensor_
    output: an operator returning a tensor and an int, kept, runs once (its counter is 1),
    and the gradients are plain ones. Below the layer no backward runs it; recomputed whole
    (the control), every recomputing backward does."""
    case = Case(lambda: stack(WithExtra), f"{SAC}test_function_with_non_tensor_output")
    EXTRA_CALLS.clear()
    want = train(case)
    assert len(EXTRA_CALLS) == 2 * STEPS and not any(EXTRA_CALLS)
    EXTRA_CALLS.clear()
    offloader = engine()
    try:
        got = train(case, offloader, lambda model: offloader.watch(model).recompute(
            layers_below(model) if how == "below" else outermost(units(model))))
        assert not differences(want, got)
        assert len(offloader.recomputed) == 2
    finally:
        offloader.close()
    in_backward = sum(EXTRA_CALLS)
    assert in_backward == 0 if how == "below" else in_backward >= 2 * (STEPS - 1)


# what the kept outputs' lifetimes are ----------------------------------------------------------
@pytest.mark.parametrize("lean", [False, True])
def test_kept_outputs_go_with_the_graph_or_after_the_last_backward(lean, monkeypatch):
    """test_autograd.py::TestSelectiveActivationCheckpoint::test_storage_lifetime (what a
    block keeps is held by no reference cycle): a graph that goes without backward lets go
    of what its blocks kept; a backward lets go of it as it ends. Where SAC lets go at a
    backward with ``retain_graph=True`` too (and raises at a second one,
    ``test_can_only_trigger_recompute_once``), the engine holds it for the second backward,
    which recomputes from it again (``selective.py``). ``lean``: the last steps' blocks run
    first without autograd; else every step's under checkpoint."""
    kept: list[weakref.ref] = []
    real = selective._Kept.of.__func__

    def of(cls, *args, **kwargs):
        k = real(cls, *args, **kwargs)
        kept.extend(weakref.ref(v) for v in k.values if isinstance(v, torch.Tensor))
        return k

    monkeypatch.setattr(selective._Kept, "of", classmethod(of))
    torch.manual_seed(0)
    model, x = stack(Dropped), rows()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="keep", min_bytes=0, profile_steps=1,
                                                  budget=None))
    offloader.watch(model).recompute(layers_below(model))
    offloader.recomputer.verdicts.on = lean

    def forward() -> torch.Tensor:
        kept.clear()
        with offloader:
            loss = projected(model(x))
        assert len(kept) >= 2 and all(ref() is not None for ref in kept)
        return loss

    def alive() -> list[bool]:
        return [ref() is not None for ref in kept]

    gc.collect()
    gc.disable()
    try:
        with offloader:  # measured: plain
            loss = projected(model(x))
        loss.backward()
        loss = forward()  # under checkpoint, watched
        loss.backward()
        assert not any(alive())
        loss = forward()  # first runs without autograd where lean
        loss.backward(retain_graph=True)
        assert all(alive())
        loss.backward()
        assert not any(alive())
        del loss
        loss = forward()
        del loss
        assert not any(alive())
        if lean:
            assert set(offloader.recomputer.verdicts.why.values()) == {""}
    finally:
        gc.enable()
        offloader.close()
