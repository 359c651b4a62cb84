"""PyTorch's own activation-checkpointing tests, restated for the engine's recomputed blocks.

Each case is a small model whose ``nn.ModuleList`` elements are blocks, built to show what one
of PyTorch's checkpoint tests checks (named in the case's ``restates``). It trains ``STEPS``
SGD steps plainly and under an Offloader with every block chosen by hand before the first
step (``Offloader.recompute``; transformer-like cases also below the layer,
``"layer:elementwise"``): step 0 is measured (plain), step 1 recomputes under checkpoint and
watches each block (``lean.py``), steps 2 and 3 run each block's first run without autograd
where the watch found that safe, else under checkpoint again. Losses, gradients, buffers and
the RNG state must be bitwise those of plain training (``test_conformance.differences``), a
user's hooks must run as often as plainly, and the engine must either recompute every block
(and the first recomputed step, which tracks each saved tensor as the measured one does,
save fewer: the later ones do not track them) or leave each out, saying why.

Read for this file (repository pytorch/pytorch):
  * ``test/test_utils.py``, class ``TestCheckpoint``, at 0025348e03d0307b815c0043b702e2a64c2ef752
  * ``test/test_autograd.py``, classes ``TestAutograd`` (its ``checkpoint`` tests) and
    ``TestNestedCheckpoint``, at 5c322af10e52e4d236104ceefd542f34e6dcf20a
Not restated: what only concerns ``torch.utils.checkpoint``'s own API (``use_reentrant``'s
warning and errors, ``context_fn``, ``GraphExecGroup``, ``debug=True``, accessing
``grad_fn._saved_*``), DataParallel and the CUDA-only memory tests.

The last cases are what this suite found, each in its smallest model: before their fixes the
engine trained them otherwise than plain PyTorch (a weight's hooks ran twice once its block
ran first without autograd; Python's ``random`` was not put back for a recomputation; a
second derivative seen inside the block was forgotten at its end) or raised where plain
PyTorch does not (a view the block returned changed in place; an output made without
gradient read as NumPy). One difference stays, and the cases say where: a block run first
without autograd hands its parameters their gradients from one node, so their hooks run as
often as plainly but in another order.
"""

from __future__ import annotations

import copy
import random
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from test_conformance import (
    BATCH,
    LR,
    Built,
    LoRALinear,
    Step,
    _gen,
    differences,
    projected,
    seed_all,
)
from test_conformance import train as conformance_train
from test_recompute_safety import stack
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import cswap_lightning as cswap
from cswap_lightning.core.recompute import below, outermost, units
from cswap_lightning.planning.workload import BELOW

STEPS = 4  # measured; recomputed under checkpoint, watched; first runs without autograd (x2)
WIDTH = 16
HEADS = 2

UTILS = "test_utils.py::TestCheckpoint::"
AUTOGRAD = "test_autograd.py::TestAutograd::"
NESTED = "test_autograd.py::TestNestedCheckpoint::"

# What a user's hooks did, in order (plainly and under the engine alike).
HOOK_CALLS: list[str] = []


def rows(grad: bool = False) -> torch.Tensor:
    return torch.randn(BATCH, 6, WIDTH, generator=_gen()).requires_grad_(grad)




def mlp(width: int = WIDTH) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


# arguments and outputs -----------------------------------------------------------------------
class Keywords(nn.Module):
    """Called with keywords only: its input ``data=`` and a tensor ``blah=`` that needs a
    gradient (made from a parameter outside the blocks), and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, data: torch.Tensor, blah: torch.Tensor | None = None,
                note: str = "") -> torch.Tensor:
        assert note == "kept"
        out = torch.tanh(self.lin(data))
        if blah is not None:
            out = out * blah
        return out.sin()


class KeywordStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.layers = nn.ModuleList(Keywords() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blah = self.scale * 1.5
        for layer in self.layers:
            x = layer(data=x, blah=blah, note="kept")
        return x


class OptionalBias(nn.Module):
    """Takes ``None`` for an optional tensor, and then returns what it made unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y if bias is None else y + bias


class OptionalStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.layers = nn.ModuleList(OptionalBias() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, None if i % 2 else self.bias)
        return x


class Parallel(nn.Module):
    """Each block reads the batch itself: no input of any block needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


class Mixed(nn.Module):
    """PyTorch's ``foo``: tensors, a number, a tensor needing no gradient and a function in;
    the number, tensors changed in place inside, None, True, a string and its own first input
    out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor,
                f: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
        t4 = self.lin(t1 + t2 * t3)
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, f(t4), None, True, t5, "bar", t1


class MixedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t2 = nn.Parameter(torch.randn(WIDTH) / 2)
        self.layers = nn.ModuleList(Mixed() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t3 = torch.linspace(0, 1, WIDTH)
        for layer in self.layers:
            scale, t4, none, flag, t5, bar, t1 = layer(x, self.t2, 3, t3, torch.sin)
            assert (scale, none, flag, bar) == (3, None, True, "bar") and t1 is x
            x = torch.tanh(t4 + t5 + t1)
        return x


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, dict_input: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"result": torch.tanh(self.layer(dict_input["tensor"]))}


class DictStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DictBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer({"tensor": x})["result"]
        return x


class Gated(nn.Module):
    """Returns a tuple: two tensors, and its second input (a mask needing no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x))
        return h, torch.sigmoid(self.b(h)), mask


class GatedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gated() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x[..., :1] > 0).float()
        for layer in self.layers:
            h, g, mask = layer(x, mask)
            x = h * g * mask + x
        return x


@dataclass
class Pair:
    """An output of the model's own class (pytree does not know it)."""

    h: torch.Tensor
    g: torch.Tensor


class Pairing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Pair:
        h = self.lin(x)
        return Pair(torch.tanh(h), torch.sigmoid(h))


class PairStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Pairing() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            pair = layer(x)
            x = pair.h * pair.g + x
        return x


class Indexed(nn.Module):
    """Returns a tensor and integer indices made from it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        return h, h.argmax(-1, keepdim=True)


class IndexedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Indexed() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h, index = layer(x)
            x = h + h.gather(-1, index)
        return x


class StopGradient(nn.Module):
    """Returns its output and the output detached (a target no gradient goes through, as in
    BYOL or a distillation teacher's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        return h, h.detach()


class StopGradientStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(StopGradient() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h, target = layer(x)
            x = h * target.sigmoid() + (h - target.flip(-1)).square()
        return x


class ChangedAfter(nn.Module):
    """Changes each block's output in place after it returns (its last layer, a linear one,
    does not save its output; on 2-D rows); ``view``: through a view taken of it."""

    def __init__(self, depth: int = 3, view: bool = False) -> None:
        super().__init__()
        self.view = view
        self.layers = nn.ModuleList(mlp() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(0, 1)
        for layer in self.layers:
            y = layer(x)
            if self.view:
                y = y.view(-1, 2, WIDTH // 2)  # taken here: the block returned no view
            y.mul_(0.5)
            x = y.view_as(x) + x
        return x


class Viewing(nn.Module):
    """Returns a view of the product it made (the last layer of ``ViewStack``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).mm(self.w).view(-1, 2, WIDTH // 2)


class ViewStack(nn.Module):
    """One block returning a view, changed in place after it returns (fine plainly: the
    product it is a view of is saved by nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Viewing()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers[0](x.flatten(0, 1))
        y.mul_(0.5)
        return y


# no gradient inside ---------------------------------------------------------------------------
class NoGrad(nn.Module):
    """PyTorch's ``NoGradModule``: its whole forward under ``torch.no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, bias=False)
        self.lin2 = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lin2(self.linear(x))


class Detached(nn.Module):
    """Blocks whose output needs no gradient, added to in place (PyTorch's ``out += a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)
        self.layers = nn.ModuleList(NoGrad() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w)
        for layer in self.layers:
            out = layer(h)
            out += h
            h = torch.tanh(out)
        return h


class Normalised(nn.Module):
    """Part of its forward under ``torch.no_grad`` (a normaliser taken as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            norm = x.norm(dim=-1, keepdim=True) + 1
        return torch.tanh(self.lin(x) / norm)


class Logged(nn.Module):
    """A block whose output needs no gradient, read as a NumPy array after it returns (to log
    it), then scaled by a trained weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH))
        self.layers = nn.ModuleList([NoGrad()])
        self.logged: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        self.logged.append(out.numpy().sum())
        return out * self.w


# autocast, randomness -------------------------------------------------------------------------
class MmBlock(nn.Module):
    """PyTorch's ``foo`` for autocast: three ``torch.mm``, the last on its weight alone."""

    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.autocast = autocast
        self.y = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)
        self.z = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inside = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else nullcontext()
        with inside:  # around it, else its own
            x = torch.mm(x, self.y)
            y = torch.mm(x, self.z)
            z = torch.mm(self.z, self.z)
            assert z.dtype == torch.bfloat16
            return torch.tanh(y @ z)


class MmStack(nn.Module):
    """``around``: autocast around the blocks' calls, as PyTorch's test has it; else each
    block enters it itself."""

    def __init__(self, around: bool) -> None:
        super().__init__()
        self.around = around
        self.layers = nn.ModuleList(MmBlock(not around) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(0, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.around):
            for layer in self.layers:
                x = x + layer(x)
        return x.float()


class Dropping(nn.Module):
    """Dropout before the blocks (PyTorch's ``phase1``) and inside them (``phase2``), and a
    random scale drawn from the global generator."""

    def __init__(self) -> None:
        super().__init__()
        self.phase1 = nn.Dropout()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(),
                                                  nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.phase1(x)
        for layer in self.layers:
            x = layer(x) * (1 + torch.rand_like(x))
        return x


class Counted(nn.Module):
    """Counts its calls in a Python attribute and scales by it: a second run, unless the
    engine puts the count back, would compute something else."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x) * (1 + 0.1 * self.calls))


class PythonRandom(nn.Module):
    """Scales its output by a number drawn from Python's ``random`` (as LayerDrop was drawn
    in Hugging Face's models before torch.rand), or NumPy's global generator: a second run
    draws another."""

    def __init__(self, numpy: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.numpy = numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drawn = float(np.random.rand()) if self.numpy else random.random()
        return torch.tanh(self.lin(x) * (0.5 + drawn))


# nesting and second derivatives ----------------------------------------------------------------
class InnerCheckpoints(nn.Module):
    """Checkpoints two parts of itself (``c(g)(c(f)(x))``, PyTorch's ``hc``)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.g = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self.f, x, use_reentrant=False).sin().exp()
        return checkpoint(self.g, inner, use_reentrant=False)


class CheckpointedByTheUser(nn.Module):
    """Calls each block under the user's own checkpoint: the engine's would be nested in it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


class Force(nn.Module):
    """Takes a gradient in its forward (``grad(fn)`` of TestNestedCheckpoint): minus the
    gradient of an energy, with a graph, so that training differentiates it again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            energy = torch.tanh(self.lin(x)).sin().sum()
            (g,) = torch.autograd.grad(energy, x, create_graph=True)
        return torch.tanh(x - g)


class Elementwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.b = nn.Parameter(torch.randn(WIDTH) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w + self.b).sin()


def gradient_penalty(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The loss plus the square of its gradient by the input, taken with a graph (a second
    derivative through every block), inside the step, as ``train`` computes losses."""
    x = inputs["x"]
    loss = projected(model(x))
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + g.square().sum()


def retained(model: nn.Module, inputs: dict) -> torch.Tensor:
    """An auxiliary loss's backward through the blocks, its graph retained, inside the step;
    the step's own backward then goes through them again."""
    out = model(inputs["x"])
    projected(out, 3).backward(retain_graph=True)
    return projected(out)


class EarlyStop(nn.Module):
    """Ends in operators that save nothing (checkpoint's early stop skips them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sin().cos().clone().view_as(x) + 1


class EarlyStopOff(nn.Module):
    """The blocks called with checkpoint's early stop turned off."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EarlyStop() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with set_checkpoint_early_stop(False):
            for layer in self.layers:
                x = layer(x)
        return x


class Doubling(torch.autograd.Function):
    """PyTorch's ``MyFunc``: saves its inputs, a product and its output."""

    @staticmethod
    def forward(ctx, x, y, z):
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, y, z, _, _ = ctx.saved_tensors
        return grad_out * 2 * y * z, grad_out * 2 * x * z, grad_out * 2 * x * y


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.z = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return Doubling.apply(x * y, y * y, self.z * self.z)


# weights shared, frozen; buffers --------------------------------------------------------------
class Twice(nn.Module):
    """The first block called again after the others (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (*self.layers, self.layers[0]):
            x = x + layer(x)
        return x


class Tied(nn.Module):
    """The first block's weight read outside it too (PyTorch's ``w * x`` before the
    checkpoint and ``w * x`` inside)."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.layers[0][0].weight
        for layer in self.layers:
            h = layer(h)
        return h


class FrozenFirst(nn.Module):
    """The first block frozen: nothing in it needs a gradient (its input is the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(3))
        self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def lora_block() -> nn.Module:
    """Frozen linear layers with trained low-rank adapters (and dropout before them)."""
    return nn.Sequential(LoRALinear(WIDTH, 2 * WIDTH), nn.GELU(), LoRALinear(2 * WIDTH, WIDTH))


def batch_norm_block() -> nn.Module:
    return nn.Sequential(nn.Conv1d(6, 6, 3, padding=1), nn.BatchNorm1d(6), nn.ReLU())


class ModuleListNet(nn.Module):
    """PyTorch's ``ModuleListNet``: plain layers in an ``nn.ModuleList``, each a block."""

    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList([nn.Linear(WIDTH, 50), nn.ReLU(), nn.Linear(50, 20),
                                          nn.ReLU(), nn.Linear(20, 5), nn.ReLU()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


# hooks ----------------------------------------------------------------------------------------
class HookInside(nn.Module):
    """Registers a hook on a tensor it makes (halving its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return torch.tanh(h)


def halved(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        HOOK_CALLS.append(name)
        return grad * 0.5

    return hook


class OutputHooked(nn.Module):
    """Hooks each block's output tensor, and the node that made it (PyTorch registers one on
    ``out.grad_fn.next_functions[0][0]``: a node of the first run's graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x.register_hook(halved(f"output {i}"))
            x.grad_fn.register_hook(lambda grad_in, grad_out, i=i: HOOK_CALLS.append(f"node {i}"))
            x = torch.tanh(x)
        return x


def full_backward_hooks(model: nn.Module) -> None:
    """A full backward hook on the first layer of each block, halving its input's gradient."""
    for i, layer in enumerate(model.layers):
        def hook(module, grad_input, grad_output, i=i):
            HOOK_CALLS.append(f"layers.{i}.0")
            return tuple(None if g is None else g * 0.5 for g in grad_input)

        layer[0].register_full_backward_hook(hook)


def counted_weight_hook(model: nn.Module) -> None:
    """PyTorch's ``count``: a hook on the weight read inside and outside the first block,
    which plainly runs once per backward (on the weight's whole gradient)."""
    model.layers[0][0].weight.register_hook(lambda grad: HOOK_CALLS.append("weight"))


def halved_weights(model: nn.Module) -> None:
    """A hook on every parameter halving its gradient (as gradient scaling or clipping by
    hooks does)."""
    for name, p in model.named_parameters():
        p.register_hook(halved(name))


# transformer-like -------------------------------------------------------------------------------
class Layer(nn.Module):
    """A pre-norm transformer layer: attention (with dropout) and an MLP; its linear layers
    LoRA-adapted where ``lora``. Takes an attention mask and a scale for its MLP's output as
    keyword arguments."""

    def __init__(self, lora: bool = False) -> None:
        super().__init__()
        linear = LoRALinear if lora else nn.Linear
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = linear(WIDTH, 3 * WIDTH), linear(WIDTH, WIDTH)
        self.up, self.down = linear(WIDTH, 4 * WIDTH), linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, HEADS, -1).transpose(1, 2)
                   for s in self.qkv(self.ln1(x)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))
        h = self.down(F.gelu(self.up(self.ln2(x))))
        return x + self.drop(h if scale is None else h * scale)


class Transformer(nn.Module):
    """Two layers. ``keywords``: called with a causal mask and a scale (from a parameter) as
    keyword arguments; ``twice``: the first layer called again last (ALBERT's sharing);
    ``autocast``: under CPU autocast; ``in_place``: each layer's output halved in place after
    it returns; ``frozen``: the first layer frozen."""

    def __init__(self, lora: bool = False, keywords: bool = False, twice: bool = False,
                 autocast: bool = False, in_place: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(lora) for _ in range(2))
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.keywords, self.twice = keywords, twice
        self.autocast, self.in_place = autocast, in_place
        if frozen:
            self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = (*self.layers, self.layers[0]) if self.twice else self.layers
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            for layer in layers:
                x = layer(x, mask=mask, scale=self.gain * 2) if self.keywords else layer(x)
                if self.in_place:
                    x.mul_(0.5)
        return x.float()



class ViewingLayer(Layer):
    """Returns its output split into two halves of the features (a view)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(*x.shape[:2], 2, -1)


class StatLayer(Layer):
    """Returns its output and a statistic of it made under ``torch.no_grad``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(x)
        with torch.no_grad():
            return out, out.abs().mean()


class Inspected(nn.Module):
    """One layer, its output changed in place through the view it returned (``ViewingLayer``)
    or its statistic logged as a NumPy array (``StatLayer``)."""

    def __init__(self, layer: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer()])
        self.logged: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        if isinstance(out, tuple):
            out, stat = out
            self.logged.append(stat.numpy())
            return out
        out.mul_(0.5)
        return out.flatten(-2)

# the cases ------------------------------------------------------------------------------------
@dataclass
class Case:
    """A model (``build``), the PyTorch tests it restates, and what the engine does with its
    blocks: ``left_out`` "" where it recomputes every one, else the start of why it leaves each
    out. ``x``: the batch; ``loss``: the step's loss (the output projected on fixed random
    weights); ``prepare``: hooks put on each copy trained; ``frees``: the first recomputed
    step saves fewer tensors than the measured one (False: as many or more, where the blocks
    keep nothing a recomputation can spare); ``below``: transformer-like, recomputed below
    the layer too; ``in_order``: a user's hooks run in plain PyTorch's order (False: as
    often, in another order: a block run first without autograd hands its parameters their
    gradients at once, from one node)."""

    build: Callable[[], nn.Module]
    restates: str
    left_out: str = ""
    x: Callable[[], torch.Tensor] = rows
    loss: Callable[[nn.Module, dict], torch.Tensor] = field(
        default=lambda model, inputs: projected(model(inputs["x"])))
    prepare: Callable[[nn.Module], None] | None = None
    frees: bool = True
    below: bool = False
    in_order: bool = True

    def built(self) -> Built:
        torch.manual_seed(0)
        return Built(self.build(), {"x": self.x()}, self.loss)


CASES = {
    # arguments and outputs
    "keyword arguments, the input needing a gradient": Case(
        KeywordStack, f"{AUTOGRAD}test_checkpointing_without_reentrant[input_requires_grad=True]"
        f", {NESTED}test_nested_checkpoint_kwargs", x=lambda: rows(True)),
    "keyword arguments, the input needing none": Case(
        KeywordStack,
        f"{AUTOGRAD}test_checkpointing_without_reentrant[input_requires_grad=False]"),
    "no block's input needs a gradient": Case(
        Parallel, f"{AUTOGRAD}test_checkpointing_without_reentrant[input_requires_grad=False]"),
    "None for a tensor argument": Case(OptionalStack, f"{UTILS}test_checkpoint_non_tensor"),
    "non-tensor inputs and outputs, an input returned": Case(
        MixedStack, f"{UTILS}test_checkpoint_non_tensor_inputs_outputs, "
                    f"{NESTED}test_nested_checkpoint_non_tensor_inputs_and_outputs"),
    "a dict in, a dict out": Case(
        DictStack, f"{AUTOGRAD}test_checkpointing_without_reentrant_arbitrary_input_output"),
    "a tuple out, an input needing no gradient returned": Case(
        GatedStack, f"{UTILS}test_checkpoint_partial_grad"),
    "an output of the model's own class": Case(
        PairStack, f"{AUTOGRAD}test_checkpointing_without_reentrant_arbitrary_input_output"),
    "integer indices among the outputs": Case(
        IndexedStack, f"{UTILS}test_checkpoint_non_tensor_inputs_outputs"),
    "a detached output among the outputs": Case(
        StopGradientStack, f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor"),
    "the output changed in place after the block": Case(
        ChangedAfter, f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor "
                      "(out += a)"),
    "the output changed in place through a view after the block": Case(
        lambda: ChangedAfter(view=True),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor (out += a)"),
    # no gradient inside
    "the whole forward under no_grad, its output added to in place": Case(
        Detached, f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor",
        frees=False),  # plainly the blocks save nothing; recomputed, their inputs
    "part of the forward under no_grad": Case(
        lambda: stack(Normalised),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor"),
    # autocast, randomness
    "autocast around the blocks": Case(
        lambda: MmStack(around=True), f"{AUTOGRAD}test_checkpointing_non_reentrant_autocast_cpu"),
    "autocast inside the blocks": Case(
        lambda: MmStack(around=False), f"{AUTOGRAD}test_checkpointing_non_reentrant_autocast_cpu"),
    "dropout before and inside the blocks": Case(Dropping, f"{UTILS}test_checkpoint_rng_cpu"),
    "a Python counter the forward reads": Case(
        lambda: stack(Counted), f"{AUTOGRAD}test_checkpoint_detects_non_determinism"),
    # nesting, second derivatives, early stop, custom functions
    "checkpoints inside the block": Case(
        lambda: stack(InnerCheckpoints), f"{NESTED}test_nested_checkpoint_two_children, "
                                         f"{NESTED}test_nested_checkpoint"),
    "the block under the user's own checkpoint": Case(
        CheckpointedByTheUser, f"{NESTED}test_nested_checkpoint (c(c(fn)))",
        left_out="runs under saved-tensor hooks other than the step's"),
    "a gradient taken inside the forward": Case(
        lambda: stack(Force), f"{NESTED}test_nested_checkpoint (grad(c(fn)))",
        x=lambda: rows(True),
        frees=False),  # its gradient's graph is saved through the step's hooks either way
    "a second backward through the blocks, the graph retained": Case(
        lambda: stack(mlp), f"{NESTED}test_nested_checkpoint_reentrant_backwards, "
                            f"{UTILS}test_checkpointing_without_reentrant_early_free",
        loss=retained),
    "checkpoint's early stop off": Case(
        EarlyStopOff, f"{NESTED}test_nested_checkpoint_set_early_stop"),
    "a custom autograd Function inside": Case(
        lambda: stack(Custom),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_custom_function_works"),
    # weights shared or frozen, buffers, plain layers
    "a block called twice in one forward": Case(
        Twice, f"{AUTOGRAD}test_checkpointing_without_reentrant_parameter_used_in_an_out"),
    "a block's weight read outside it too": Case(
        Tied, f"{AUTOGRAD}test_checkpointing_without_reentrant_parameter_used_in_an_out"),
    "frozen linear layers with LoRA adapters": Case(
        lambda: stack(lora_block), f"{AUTOGRAD}test_checkpointing_without_reentrant "
                                   "(with only some parameters trained)"),
    "the first block frozen": Case(
        FrozenFirst, f"{UTILS}test_checkpoint_partial_grad (nothing needs a gradient)"),
    "BatchNorm's running statistics in the blocks": Case(
        lambda: stack(batch_norm_block), "none of PyTorch's (buffers a forward updates)",
        x=lambda: torch.randn(BATCH, 6, 8, generator=_gen())),
    "plain layers, each a block": Case(
        ModuleListNet, f"{UTILS}test_checkpoint_module_list"),
    # hooks
    "a hook registered on a tensor inside the block": Case(
        lambda: stack(HookInside), f"{NESTED}test_nested_checkpoint_same_graph"),
    "hooks on the output and on its node": Case(
        OutputHooked, f"{NESTED}test_nested_checkpoint_same_graph"),
    "full backward hooks on a module inside the block": Case(
        lambda: stack(lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                            nn.Linear(WIDTH, WIDTH))),
        f"{NESTED}test_nested_checkpoint_same_graph", prepare=full_backward_hooks),
    # transformer-like: also below the layer
    "a transformer's layers": Case(Transformer, f"{UTILS}test_checkpoint_rng_cpu", below=True),
    "a transformer's layers with keyword arguments": Case(
        lambda: Transformer(keywords=True), f"{NESTED}test_nested_checkpoint_kwargs",
        below=True),
    "a transformer's layers with LoRA adapters": Case(
        lambda: Transformer(lora=True), f"{AUTOGRAD}test_checkpointing_without_reentrant "
                                        "(with only some parameters trained)", below=True),
    "a transformer's layer called twice": Case(
        lambda: Transformer(twice=True),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_parameter_used_in_an_out", below=True),
    "a transformer under autocast": Case(
        lambda: Transformer(autocast=True),
        f"{AUTOGRAD}test_checkpointing_non_reentrant_autocast_cpu", below=True),
    "a transformer's layer output changed in place": Case(
        lambda: Transformer(in_place=True),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor (out += a)",
        below=True),
    "a transformer's first layer frozen": Case(
        lambda: Transformer(frozen=True), f"{UTILS}test_checkpoint_partial_grad", below=True),
    # found by this suite (each differed from plain PyTorch, or raised, before its fix)
    "a hook counting a weight's gradients": Case(
        lambda: Tied(depth=1),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_parameter_used_in_an_out",
        prepare=counted_weight_hook),
    "hooks halving each weight's gradient": Case(
        lambda: stack(Layer, depth=1), f"{NESTED}test_nested_checkpoint_same_graph",
        prepare=halved_weights, below=True, in_order=False),
    "a number drawn from Python's random in forward": Case(
        lambda: stack(PythonRandom, depth=1),
        f"{AUTOGRAD}test_checkpoint_detects_non_determinism"),
    "a number drawn from NumPy's generator in forward": Case(
        lambda: stack(lambda: PythonRandom(numpy=True), depth=1),
        f"{AUTOGRAD}test_checkpoint_detects_non_determinism"),
    "a gradient penalty taken inside the step": Case(
        lambda: stack(Elementwise, depth=1),
        f"{UTILS}test_checkpoint_valid, {NESTED}test_nested_checkpoint (grad(grad(c(fn))))",
        x=lambda: rows(True), loss=gradient_penalty),
    "a view returned, changed in place after the block": Case(
        ViewStack, f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor (out += a)",
        frees=False),
    "an output made without gradient, read as NumPy": Case(
        Logged, f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor",
        frees=False),
    "a layer returning a view, changed in place": Case(
        lambda: Inspected(ViewingLayer),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor (out += a)",
        below=True),
    "a statistic made without gradient, read as NumPy": Case(
        lambda: Inspected(StatLayer),
        f"{AUTOGRAD}test_checkpointing_without_reentrant_detached_tensor", below=True),
}


# training -------------------------------------------------------------------------------------
def train(case: Case, offloader: cswap.Offloader | None = None,
          choose: Callable[[nn.Module], object] | None = None) -> list[Step]:
    """``STEPS`` steps of ``case`` (plainly without ``offloader``), its hooks on the copy
    trained, ``choose`` called with it next."""

    def prepare(model: nn.Module) -> None:
        if case.prepare is not None:
            case.prepare(model)
        if choose is not None:
            choose(model)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cswap: (no longer recomputing|backward ran inside"
                                          "|a second derivative)")
        warnings.filterwarnings("ignore", "Full backward hook is firing")
        return conformance_train(case.built(), STEPS, offloader, prepare)


def blocks(model: nn.Module, below_the_layer: bool) -> list[str]:
    """Every block of the model (each element of its ``nn.ModuleList``), whole or below the
    layer."""
    found = units(model)
    return list(below(found)) if below_the_layer else outermost(found)


@dataclass
class Run:
    steps: list[Step]
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


def by_hand(case: Case, below_the_layer: bool = False) -> Run:
    """Every block chosen by hand before the first (measured) step."""
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    chosen: list[str] = []
    skipped: dict[str, str] = {}

    def choose(model: nn.Module) -> None:
        chosen.extend(blocks(model, below_the_layer))
        skipped.update(offloader.watch(model).recompute(chosen))

    HOOK_CALLS.clear()
    return Run(train(case, offloader, choose), offloader, chosen, skipped)


def plain(case: Case) -> tuple[list[Step], list[str]]:
    """Plain training, and the calls of the hooks it made."""
    HOOK_CALLS.clear()
    steps = train(case)
    calls = list(HOOK_CALLS)
    HOOK_CALLS.clear()
    return steps, calls


def assert_trains_as_plain_pytorch(case: Case, below_the_layer: bool) -> None:
    want, calls = plain(case)
    run = by_hand(case, below_the_layer)
    try:
        assert not differences(want, run.steps)
        # a user's hooks ran as often as plainly, in that order
        assert HOOK_CALLS == calls if case.in_order else Counter(HOOK_CALLS) == Counter(calls)
        left_out = run.left_out()
        if case.left_out:
            assert not run.offloader.recomputed, run.offloader.recomputed
            assert set(left_out) == set(run.chosen), left_out
            assert all(why.startswith(case.left_out) for why in left_out.values()), left_out
        else:
            assert run.offloader.recomputed == set(run.chosen) and not left_out, left_out
            # The later steps run the checked plan without tracking each site (they count a
            # few, recomputed or not): only the first recomputed step counts them all.
            measured, recomputed = run.steps[0].stats, run.steps[1].stats
            assert (len(recomputed.sites) < len(measured.sites)) == case.frees
    finally:
        run.offloader.close()


# the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_blocks_recomputed_whole_train_as_plain_pytorch(name):
    assert_trains_as_plain_pytorch(CASES[name], below_the_layer=False)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.below])
def test_layers_recomputed_below_the_layer_train_as_plain_pytorch(name):
    assert_trains_as_plain_pytorch(CASES[name], below_the_layer=True)


FORWARDS: list[list[int]] = []  # each step's block calls, by block index


class Tallied(nn.Module):
    """PyTorch's ``Net`` of test_checkpoint_trigger: counts its forwards (in a list of the
    test's, which the engine does not put back)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS[-1].append(self.index)
        return torch.tanh(self.lin(x))


class TalliedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Tallied(i) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS.append([])  # a new step
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_recomputed_block_runs_its_forward_once_more_in_backward_the_others_once():
    """test_utils.py::TestCheckpoint::test_checkpoint_trigger: of blocks in two segments, the
    first segment's recomputed, their forward runs twice a step (once in forward, once in
    backward: on the last steps, the first without autograd), the second's once."""
    case = Case(TalliedStack, f"{UTILS}test_checkpoint_trigger")
    FORWARDS.clear()
    want = train(case)
    assert [Counter(calls) for calls in FORWARDS] == [Counter(range(4))] * STEPS
    FORWARDS.clear()
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    got = train(case, offloader, lambda model: offloader.watch(model).recompute(
        ["layers.0", "layers.1"]))
    assert not differences(want, got)
    assert Counter(FORWARDS[0]) == Counter(range(4))  # measured: plainly
    assert Counter(FORWARDS[-1]) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert offloader.recomputer.verdicts.why == {"layers.0": "", "layers.1": ""}  # lean
    offloader.close()


def penalised(case: Case, offloader: cswap.Offloader | None = None) -> list[Step]:
    """``train``'s steps with a gradient penalty taken after forward, outside the Offloader's
    block (as it asks): the projected output plus the square of its gradient by the input,
    with a graph (a second derivative through every block)."""
    built = case.built()
    model = copy.deepcopy(built.model).train()
    if offloader is not None:
        offloader.watch(model).recompute(blocks(model, False))
    x = built.inputs["x"].detach().clone().requires_grad_()
    record = []
    for i in range(STEPS):
        model.zero_grad(set_to_none=True)
        x.grad = None
        seed_all(1000 + i)
        with offloader if offloader is not None else nullcontext():
            out = model(x)
        (g,) = torch.autograd.grad(projected(out), x, create_graph=True)
        loss = projected(out) + g.square().sum()
        loss.backward()
        grads = {f"param {n}": p.grad.clone() for n, p in model.named_parameters()}
        grads["input x"] = x.grad.clone()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
        record.append(Step(loss.detach().clone(), grads, {}, torch.get_rng_state()))
    return record


def test_a_gradient_penalty_taken_after_forward_trains_as_plain_pytorch():
    """test_utils.py::TestCheckpoint::test_checkpoint_valid (create_graph=True), and
    TestNestedCheckpoint's grad(grad(c(fn))): a second derivative through the recomputed
    blocks, taken after the Offloader's block; the engine sees it on the watched step and
    keeps the blocks under checkpoint, which gives it bitwise."""
    case = Case(lambda: stack(Elementwise), f"{UTILS}test_checkpoint_valid", x=lambda: rows(True))
    want = penalised(case)
    offloader = cswap.Offloader(cswap.CSwapConfig(plan="raw", min_bytes=0, profile_steps=1,
                                                  budget=None))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "cswap")  # nor does it warn of a second derivative
        got = penalised(case, offloader)
    assert not differences(want, got)
    assert offloader.recomputed == {"layers.0", "layers.1", "layers.2"}
    assert set(offloader.recomputer.verdicts.why.values()) == {
        "a second derivative is taken through it"}
    offloader.close()
