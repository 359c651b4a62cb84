"""The saved-tensor hook tests of PyTorch and the offload tests of torchtune, restated for the
engine: each case runs alone under a fresh ``Offloader``, and all of them one after another
through one shared ``offload(config)`` (entered by each case, or once around them all), and
must give what PyTorch gives without the engine, bitwise (gradients, outputs, tensors read
back), or raise the error PyTorch raises.

``budget=None, min_bytes=0``: every tensor that can move moves, so each case's activations
leave and come back. A case runs four times in a row (a measured step, the step that checks
its plan, then steps that run the plan untracked, or without hooks where the plan moves
nothing), so a shared session meets each case under every other case's plan.

Restated from PyTorch's ``test/test_autograd.py`` (``TestAutograd``, as of pytorch/pytorch
5c322af):

- ``test_saved_variable_packing_unpacking_saved_original_with_hooks`` and
  ``..._with_default_hooks``: ``saved_original`` (values and ``grad_fn`` of a saved leaf and
  non-leaf, gradients) and ``double_backward`` (``a ** 3``);
- ``test_saved_variable_packing_unpacking_did_not_save_original_with_hooks`` and
  ``..._with_default_hooks``: ``saved_output``;
- ``test_setting_default_saved_variable_hooks_twice_should_not_fail``: ``nested_sessions``;
- ``test_setting_default_saved_variable_hooks_twice_should_use_inner``: ``inner_hooks_win``
  (the session inside a user's hooks, and a user's hooks inside the session);
- ``test_disabling_saved_tensor_hooks`` and ``..._nested``: ``disabled_hooks``;
- ``test_saved_tensor_hooks_custom_error_propagation``: ``errors_propagate`` (a user's pack
  and unpack hooks raising inside the session, and forward raising inside it);
- ``test_saved_tensor_hooks_custom_function_intermediates``: ``custom_function_*``;
- ``test_unpack_hooks_exec_count``: ``one_saved_tensor``;
- ``test_saved_tensors_hook_version_counter_not_shared``: ``backward_changes_unpacked``;
- ``test_save_on_cpu_and_checkpoint``: ``checkpoint_inside_session`` and
  ``session_inside_checkpoint`` (the session entered again while backward recomputes);
- ``test_pack_hook_with_inplace_modification_should_fail``: ``pack_leaves_inputs_alone``
  (PyTorch raises where a pack hook changes its input: the session's never does);
- ``test_saving_variable_to_disk``: within ``saved_original`` (values read back equal);
- ``test_default_saved_tensors_hooks_double_backward``: ``double_backward`` (the session
  around forward, around the first backward with ``create_graph``, and around both);
- ``test_wrapped_number_saved_tensors_hooks``: ``wrapped_number``;
- ``test_graph_save_on_cpu``: ``dtypes_and_sparse`` (float, double, a sparse COO leaf);
- ``test_no_unnecessary_unwrapping``: ``freed_after_backward``;
- ``test_saved_variable_version_counter``: ``saved_output_changed_in_place``, with
  ``modified_in_place`` (a saved tensor changed after forward: PyTorch's in-place error);
- ``test_saved_variable_saved_original_inplace_detach``: ``detached_after_saving``, its
  second half (a saved output detached in place: backward runs). Its first half is left out:
  plain PyTorch raises "Trying to use a saved tensor that has been detached" for a saved
  input detached in place, but under any saved-tensor hooks (PyTorch's own pass-through ones
  too) it does not, so the session raises it on the steps it runs without hooks (a plan that
  moves nothing) and not on the others, alone as through a shared session.

Restated from torchtune's ``tests/torchtune/training/test_activation_offloading.py`` (as of
pytorch/torchtune bd2a0fc): ``test_offloading_is_same_as_without`` (``three_linears``),
``test_offloading_works_with_view_outputs`` (``view_of_unpacked``) and
``test_offloading_works_with_view_ac_cached_buffers`` (``view_kept_by_checkpoint``), on the
CPU: their ``torch.cuda._sleep`` only gives a freed buffer time to be overwritten on the GPU;
the values they check are checked here.

Beyond the suites, cases of this project's own in the same harness: a reentrant checkpoint,
``retain_graph``, a partial gradient then the whole backward, saved views and transposes,
saved integer indices and masks, complex numbers, bfloat16 autocast, ``no_grad`` and
``inference_mode`` inside the block, a weight changed before backward, dropout.

Left out: the parts of the tests above that check a user's own hooks against PyTorch's rules
(a hook of the wrong arity, an unpack hook returning a non-tensor, a pack hook changing its
input; per-tensor ``register_hooks``): the engine's hooks are its own. ``test_saved_tensor_
hooks_extra_exit_during_bw_no_crash`` and ``..._extra_enter_during_bw_no_leak`` enter and leave
a user's hooks object from its own unpack hook, which the ``with`` blocks of an ``Offloader``
cannot do. ``test_graph_save_on_cpu_cuda`` measures CUDA memory (the engine's memory is
measured in test_engine and the gpu tests). torchao's tests offload parameters and optimizer
state (FSDP's ``CPUOffloadPolicy``, ``CPUOffloadOptimizer``), not saved tensors: nothing of
theirs applies. transformers' tests were not read (its repository was too large to fetch).

Hooks return other tensor objects than the saved ones even in PyTorch (pass-through hooks
too), so identity is not asserted where PyTorch's tests assert it without hooks.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import pytest
import torch
from conftest import spy_on_moves
from torch import nn
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint

from cswap_lightning import CSwapConfig, Offloader, offload
from cswap_lightning.core.saved_hooks import top_hooks

MiB = 1 << 20
# prefetch_bytes only makes the config this module's own (offload() shares one per config)
CONFIG = CSwapConfig(budget=None, min_bytes=0, profile_steps=1, prefetch_bytes=MiB + 11)
# What a case compares (gradients, outputs, tensors read back) and the tensors it saved that
# must stay where they are (leaves that require grad).
Outcome = tuple[list[torch.Tensor], list[torch.Tensor]]
Case = Callable[[AbstractContextManager], Outcome]


def passthrough() -> torch.autograd.graph.saved_tensors_hooks:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _leaf(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = shape or (5,)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()


def unheld(t: torch.Tensor) -> torch.Tensor:
    """``sin`` saves its input, here a tensor only autograd holds: one the session moves."""
    return (t + 0).sin()


# PyTorch: test_autograd.py ------------------------------------------------------------------
def saved_original(hooks) -> Outcome:
    """A leaf and a non-leaf (not an output) saved twice by ``a * a``: read back equal, the
    non-leaf with its ``grad_fn``."""
    leaf, base = _leaf(0), _leaf(1)
    with hooks:
        non_leaf = 1 + base
        y, z = leaf * leaf, non_leaf * non_leaf
        loss = unheld(y).sum() + unheld(z).sum()
    for node, saved in ((y.grad_fn, leaf), (z.grad_fn, non_leaf)):
        assert torch.equal(node._saved_self, saved) and torch.equal(node._saved_other, saved)
    assert z.grad_fn._saved_self.grad_fn is non_leaf.grad_fn
    loss.backward()
    return [leaf.grad, base.grad], [leaf]


def saved_output(hooks) -> Outcome:
    """``exp`` saves its output: read back equal, with the output's ``grad_fn``."""
    a = _leaf(2)
    with hooks:
        y = torch.exp(a)
    assert torch.equal(y.grad_fn._saved_result, y)
    assert y.grad_fn._saved_result.grad_fn is y.grad_fn
    y.sum().backward()
    assert torch.equal(a.grad, y)
    return [a.grad, y], [a]


def _double_backward(around_forward: bool, around_backward: bool, leaf_input: bool) -> Case:
    """``a ** 3``'s gradient with ``create_graph``, then its backward: the session around
    forward, around the first backward (which saves tensors too), or both."""
    def case(hooks) -> Outcome:
        leaf = _leaf(3)
        with hooks if around_forward else nullcontext():
            a = leaf if leaf_input else leaf * 1.5
            y = a ** 3
            s = torch.sum(unheld(y))
        with hooks if around_backward else nullcontext():
            (g,) = torch.autograd.grad(s, (leaf,), create_graph=True)
            g.sum().backward()
        return [g, leaf.grad], [leaf]

    where = {(True, False): "forward", (False, True): "backward", (True, True): "both"}
    case.__name__ = (f"double_backward_{where[around_forward, around_backward]}"
                     f"{'_leaf' if leaf_input else ''}")
    return case


def nested_sessions(hooks) -> Outcome:
    """The session entered inside itself, and inside a user's pass-through hooks."""
    a, b = _leaf(4), _leaf(5)
    with passthrough(), hooks:
        with hooks:
            y = unheld(a * 2)
        z = unheld(b * 2) * y
    z.sum().backward()
    return [a.grad, b.grad], [a, b]


def inner_hooks_win(hooks) -> Outcome:
    """The session inside a user's hooks (which scale by 3), and a user's hooks (by 5)
    inside the session: each tensor goes to the innermost hooks, as in PyTorch."""
    a, b, c = _leaf(6), _leaf(7), _leaf(8)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: 3 * t, lambda t: 3 * t):
        with hooks:
            y = (a + 0) * (a + 0)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: 5 * t, lambda t: 5 * t):
                x = (c + 0) * (c + 0)
            x = unheld(x)
        z = (b + 0) * (b + 0)
    (y.sum() + z.sum() + x.sum()).backward()
    return [a.grad, b.grad, c.grad], []


def disabled_hooks(hooks) -> Outcome:
    """Where saved-tensor hooks are disabled, entering the session raises PyTorch's error
    with the message given; disabling them inside it raises too; enabled again after."""
    with (torch.autograd.graph.disable_saved_tensors_hooks("error message"),
          pytest.raises(RuntimeError, match="error message"), hooks):
        pass
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    a = _leaf(9)
    with hooks:
        y = unheld(a * 2)
        with (pytest.raises(RuntimeError, match="error message"),
              torch.autograd.graph.disable_saved_tensors_hooks("error message")):
            pass
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    y.sum().backward()
    return [a.grad], [a]


class CustomError(Exception):
    pass


def _raise(where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(t: torch.Tensor) -> torch.Tensor:
        raise CustomError(where)
    return hook


def errors_propagate(hooks) -> Outcome:
    """A user's pack hook raising inside the session, forward raising inside it, and a
    user's unpack hook raising in backward: each error reaches the caller unchanged."""
    a = _leaf(10)
    with (pytest.raises(CustomError, match="pack"), hooks,
          torch.autograd.graph.saved_tensors_hooks(_raise("pack"), lambda t: t)):
        torch.sin(a)
    with pytest.raises(CustomError, match="forward"), hooks:
        unheld(a * 2)
        raise CustomError("forward")
    with hooks, torch.autograd.graph.saved_tensors_hooks(lambda t: t, _raise("unpack")):
        out = torch.sin(a)
    with pytest.raises(CustomError, match="unpack"):
        out.backward(torch.ones_like(out))
    with hooks:
        y = unheld(a * 2)
    y.sum().backward()
    return [a.grad], [a]


class _SavesIntermediates(Function):
    """Saves an intermediate made in forward and a leaf that requires grad made there too
    (``leaf_first``: in that order), each ``x``'s size."""

    @staticmethod
    def forward(ctx, x, leaf_first: bool, leaves: list):
        activation = x.exp()
        leaf = activation.clone().detach_().requires_grad_(True)
        leaves.append(leaf)
        ctx.save_for_backward(*((leaf, activation) if leaf_first else (activation, leaf)))
        ctx.leaf_first = leaf_first
        return x.exp()

    @staticmethod
    def backward(ctx, grad_out):
        first, second = ctx.saved_tensors
        activation, leaf = (second, first) if ctx.leaf_first else (first, second)
        return grad_out * activation + grad_out * leaf, None, None


def _custom_function(leaf_first: bool) -> Case:
    def case(hooks) -> Outcome:
        a, saved = _leaf(11), []
        with hooks:
            out = _SavesIntermediates.apply(a, leaf_first, saved)
        out.sum().backward()
        return [a.grad], saved

    case.__name__ = f"custom_function_{'leaf' if leaf_first else 'activation'}_first"
    return case


def one_saved_tensor(hooks) -> Outcome:
    """``x * y`` with only ``x`` requiring grad saves one tensor (``y``), unpacked once."""
    x = _leaf(12)
    y = torch.ones(5)
    own_step = top_hooks() is None  # not nested in a block of the session (or a user's)
    with hooks:
        out = x * y
    if (isinstance(hooks, Offloader) and own_step
            and not hooks.last_step(device=False).hooks_off):
        stats = hooks.last_step(device=False)
        assert len(stats.sites) + stats.untracked_tensors + stats.untracked_moved_tensors == 1
    out.sum().backward()
    return [x.grad], [x]


class _ChangesUnpacked(Function):
    """Its backward changes the tensor it saved in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        x.add_(1)
        return grad_output * x


def backward_changes_unpacked(hooks) -> Outcome:
    """A backward that changes what it unpacked in place: the leaf's version stays."""
    a = _leaf(13)
    before = a._version
    with hooks:
        out = _ChangesUnpacked.apply(a * 2)
    out.sum().backward()
    assert a._version == before
    return [a.grad], [a]


def checkpoint_inside_session(hooks) -> Outcome:
    """A non-reentrant checkpoint inside the session's block."""
    a = _leaf(14, 2, 2)
    with hooks:
        h = a.pow(2)
        h = checkpoint(lambda x: x.pow(2).pow(2), h, use_reentrant=False)
        c = h.pow(2)
    c.sum().backward()
    return [a.grad], [a]


def session_inside_checkpoint(hooks) -> Outcome:
    """The session inside a checkpointed function: entered again while backward recomputes."""
    a = _leaf(15, 2, 2)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x.pow(2)
        with hooks:
            h = h.pow(2).pow(2)
        return h.pow(2)

    d = checkpoint(f, a, use_reentrant=False)
    d.sum().backward()
    return [a.grad], [a]


def pack_leaves_inputs_alone(hooks) -> Outcome:
    """PyTorch raises where a pack hook changes its input in place; the session's change
    nothing (the versions of what it saved stay)."""
    a = _leaf(16)
    with hooks:
        b = a * 2
        y = torch.exp(b)
        z = unheld(y) * b
    assert (a._version, b._version, y._version) == (0, 0, 0)
    z.sum().backward()
    return [a.grad], [a]


def wrapped_number(hooks) -> Outcome:
    """``a * 3`` saves the 3 as a wrapped number, which no hook sees."""
    a = _leaf(17)
    with hooks:
        out = (a * 3).sum()
    return list(torch.autograd.grad(out, (a,))), [a]


def dtypes_and_sparse(hooks) -> Outcome:
    """``a * a`` of float, double and sparse COO leaves: read back equal, dtype and layout
    too (``save_on_cpu``'s test)."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([1.0, 1.0]),
                                     requires_grad=True, check_invariants=True)
    leaves = [_leaf(18), _leaf(19, dtype=torch.float64), sparse]
    grads = []
    for a in leaves:
        with hooks:
            y = a * a
        saved = y.grad_fn._saved_self
        assert (saved.dtype, saved.layout) == (a.dtype, a.layout)
        assert torch.equal(saved.to_dense(), a.to_dense())
        (y.to_dense() if y.is_sparse else y).sum().backward()
        grads.append(a.grad.to_dense())
    return grads, leaves


def freed_after_backward(hooks) -> Outcome:
    """After backward, reading a saved tensor raises PyTorch's error; the leaf is untouched."""
    a = _leaf(20)
    original = a.detach().clone()
    with hooks:
        b = a * a
        c = a * b
        d = torch.exp(a)
    assert torch.equal(c.grad_fn._saved_other, b) and torch.equal(d.grad_fn._saved_result, d)
    c.sum().backward()
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        c.grad_fn._saved_self  # noqa: B018
    assert torch.equal(a, original)
    return [a.grad], [a]


def saved_output_changed_in_place(hooks) -> Outcome:
    """``exp``'s output, read back equal, then changed in place: backward raises PyTorch's
    in-place error."""
    a = _leaf(21)
    with hooks:
        b = torch.exp(a)
    assert torch.equal(b.grad_fn._saved_result, b)
    with torch.no_grad():
        b += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    return [], [a]


def modified_in_place(hooks) -> Outcome:
    """A saved non-leaf changed in place after forward: backward raises PyTorch's error."""
    leaf = _leaf(22)
    with hooks:
        a = leaf * 2
        b = unheld(a.sin())
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    return [], [leaf]


def detached_after_saving(hooks) -> Outcome:
    """A saved output detached in place after forward: backward runs."""
    a = torch.tensor(2.0, requires_grad=True)
    x = a.clone()
    with hooks:
        y = x.exp()
        loss = unheld(y)
    y.detach_()
    loss.backward()
    return [a.grad], [a]


# torchtune: test_activation_offloading.py ---------------------------------------------------
def three_linears(hooks) -> Outcome:
    """Three linears and a ReLU: the gradients of every parameter."""
    torch.manual_seed(2024)
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10), nn.ReLU())
    x = torch.randn(2, 10, generator=torch.Generator().manual_seed(23))
    with hooks:
        loss = model(x).sum()
    loss.backward()
    params = list(model.parameters())
    return [p.grad for p in params], params


class _ViewOfSavedAsGrad(Function):
    """Saves a view of its input and returns it (viewed back) as the input's gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.t())
        return x.new_zeros(2, 4)

    @staticmethod
    def backward(ctx, grad):
        return ctx.saved_tensors[0].t()


class _PassesOn(Function):
    """Saves its input, unused, and passes the gradient on."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018
        return grad


class _OnesWhereOne(Function):
    """Its gradient: ones where the incoming one is 1 (torchtune's GPU work sits here)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad == 1).to(grad.dtype)


class _SavesFives(Function):
    """Saves a tensor of fives; backward checks that the gradient reaching it is all ones
    (not the fives a reused buffer would hold) and returns the fives."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.ones_like(x) * 5)
        return x

    @staticmethod
    def backward(ctx, grad):
        fives = ctx.saved_tensors[0]
        assert torch.all(grad == 1)
        return fives


def view_of_unpacked(hooks) -> Outcome:
    """Backward returns a view of an unpacked tensor, which the next node passes on: it
    must hold its values until used, whatever is unpacked meanwhile."""
    t = torch.ones(64, 256, requires_grad=True)
    with hooks:
        a = _SavesFives.apply(t)
        b = _OnesWhereOne.apply(a)
        c = _PassesOn.apply(b)
        d = _ViewOfSavedAsGrad.apply(c)
        loss = d.sum()
    loss.backward()
    return [t.grad], [t]


class _Checks(Function):
    """Saves fives; backward checks that its gradient is all ones and passes it on."""

    @staticmethod
    def forward(ctx, ones):
        ctx.save_for_backward(ones * 5)
        return ones

    @staticmethod
    def backward(ctx, grad):
        assert torch.all(grad == 1)
        return grad


class _SavesClone(Function):
    @staticmethod
    def forward(ctx, ones):
        ctx.save_for_backward(ones.clone())
        return ones.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018
        return grad.clone()


class _SavesViewGradIsOne(Function):
    """Saves a view of its input; its gradient is whether that view is still all ones."""

    @staticmethod
    def forward(ctx, ones):
        ctx.save_for_backward(ones.t().t())
        return ones.clone()

    @staticmethod
    def backward(ctx, grad):
        return (ctx.saved_tensors[0] == 1).to(grad.dtype)


class _SavesHalves(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.full_like(x, 0.5))
        return x * 0.5

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.saved_tensors[0]


def view_kept_by_checkpoint(hooks) -> Outcome:
    """A checkpointed region that saves a view of its input: the view recomputed in backward
    is the input's, all ones, not a buffer reused meanwhile."""

    def region(b: torch.Tensor) -> torch.Tensor:
        return _SavesHalves.apply(_SavesHalves.apply(_SavesViewGradIsOne.apply(b)))

    t = torch.ones(64, 256, requires_grad=True)
    with hooks:
        b = _SavesClone.apply(_Checks.apply(t))
        e = checkpoint(region, b, use_reentrant=False)
        loss = e.sum()
    loss.backward()
    return [t.grad], [t]


# Beyond the suites: what training loops do that the suites above leave out ---------------
def reentrant_checkpoint(hooks) -> Outcome:
    """A reentrant checkpoint inside the session: its forward saves nothing, its backward
    runs forward again with no session around it."""
    a = _leaf(30, 8, 8)
    with hooks:
        h = a.sin()
        h = checkpoint(lambda x: x.pow(2).exp(), h, use_reentrant=True)
        c = unheld(h)
    c.sum().backward()
    return [a.grad], [a]


def backward_twice(hooks) -> Outcome:
    """``retain_graph``: the moved tensors come back twice."""
    a = _leaf(31, 8, 8)
    with hooks:
        y = unheld(a * 2).exp()
    y.sum().backward(retain_graph=True)
    first = a.grad.clone()
    y.sum().backward()
    return [first, a.grad], [a]


def part_then_all(hooks) -> Outcome:
    """A gradient of one input first (part of the graph unpacked), then backward of all."""
    a, b = _leaf(32, 8), _leaf(33, 8)
    with hooks:
        z = (unheld(a * 2) * unheld(b * 3)).sum()
    (grad_a,) = torch.autograd.grad(z, (a,), retain_graph=True)
    z.backward()
    return [grad_a, a.grad, b.grad], [a, b]


def views_and_transposes(hooks) -> Outcome:
    """Saved views of a larger storage, and a transposed (non-contiguous) one."""
    a = _leaf(34, 16, 8)
    with hooks:
        h = a * 2
        v = h[:, :4]
        out = (v * v).sum() + (h.t() @ h).sum() + unheld(h[3:10]).sum()
    out.backward()
    return [a.grad], [a]


def integers_and_masks(hooks) -> Outcome:
    """Saved int64 indices (``gather``) and a bool mask (``where``)."""
    a = _leaf(35, 10, 4)
    index = torch.tensor([[0, 1, 2, 3]] * 3)
    with hooks:
        h = a * 2
        out = (h.gather(0, index).sum() + torch.where(h > 0, h, h * 0.1).sum()
               + unheld(h).sum())
    out.backward()
    return [a.grad], [a]


def complex_numbers(hooks) -> Outcome:
    """Saved complex tensors (kept where they are)."""
    generator = torch.Generator().manual_seed(36)
    a = torch.randn(6, dtype=torch.cfloat, generator=generator).requires_grad_()
    with hooks:
        out = ((a * 2) * (a * 3)).abs().sum()
    out.backward()
    return [a.grad], [a]


def bfloat16_autocast(hooks) -> Outcome:
    """Autocast to bfloat16 inside the session: the casts' outputs are saved."""
    a, w = _leaf(37, 16, 16), _leaf(38, 16, 16)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        out = unheld((a @ w).relu()).float().sum()
    out.backward()
    return [a.grad, w.grad], [a, w]


def no_grad_inside(hooks) -> Outcome:
    """``no_grad`` and ``inference_mode`` blocks inside the session's."""
    a = _leaf(39, 8)
    with hooks:
        with torch.no_grad():
            c = a * 3
        with torch.inference_mode():
            d = torch.ones(8) * 2
        y = unheld(a * c) * d.clone()
    y.sum().backward()
    return [a.grad], [a]


def weight_changed_after_forward(hooks) -> Outcome:
    """A saved weight changed in place (an optimizer's step) before backward: PyTorch's
    in-place error."""
    w = _leaf(40, 8)
    with hooks:
        y = unheld(w * 2) * w
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    return [], [w]


def layers_with_dropout(hooks) -> Outcome:
    """Four blocks of linear, GELU, dropout and layer norm: dropout's masks saved."""
    torch.manual_seed(7)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1),
                                          nn.LayerNorm(32)) for _ in range(4)))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(41))
    torch.manual_seed(8)
    with hooks:
        loss = model(x).pow(2).mean()
    loss.backward()
    params = list(model.parameters())
    return [p.grad for p in params], params


# What a case runs under without the engine: nothing, or where the session is the innermost
# hooks of a user's, or where PyTorch raises only under hooks, PyTorch's pass-through hooks.
PLAIN: dict[Case, Callable[[], AbstractContextManager]] = {
    inner_hooks_win: passthrough, disabled_hooks: passthrough}
CASES: list[Case] = [
    saved_original, saved_output,
    *(_double_backward(f, b, leaf) for f, b in ((True, False), (False, True), (True, True))
      for leaf in (False, True)),
    nested_sessions, inner_hooks_win, disabled_hooks, errors_propagate,
    _custom_function(leaf_first=False), _custom_function(leaf_first=True), one_saved_tensor,
    backward_changes_unpacked, checkpoint_inside_session, session_inside_checkpoint,
    pack_leaves_inputs_alone, wrapped_number, dtypes_and_sparse, freed_after_backward,
    saved_output_changed_in_place, modified_in_place, detached_after_saving,
    three_linears, view_of_unpacked, view_kept_by_checkpoint,
    reentrant_checkpoint, backward_twice, part_then_all, views_and_transposes,
    integers_and_masks, complex_numbers, bfloat16_autocast, no_grad_inside,
    weight_changed_after_forward, layers_with_dropout]
REPEATS = 4  # measured, checked, then untracked (or without hooks)


def outcome(case: Case, hooks: AbstractContextManager) -> Outcome | RuntimeError:
    """What ``case`` gives under ``hooks``, or PyTorch's error it raises."""
    try:
        return case(hooks)
    except RuntimeError as error:  # compared with PyTorch's, which must raise it too
        return error


def plainly(case: Case) -> Outcome | RuntimeError:
    """What ``case`` gives without the engine."""
    return outcome(case, PLAIN.get(case, nullcontext)())


def check(case: Case, got: Outcome | RuntimeError, want: Outcome | RuntimeError,
          moved: list[int]) -> None:
    """The same tensors as PyTorch's, bitwise (or the same error), and no leaf moved."""
    name = case.__name__
    if isinstance(want, RuntimeError) or isinstance(got, RuntimeError):
        assert (type(got), str(got)) == (type(want), str(want)), name
        return
    (got, stay), (want, _) = got, want
    assert not {t.untyped_storage().data_ptr() for t in stay if not t.is_sparse} & set(moved), (
        f"{name}: a leaf was moved")
    assert len(got) == len(want), name
    for g, w in zip(got, want, strict=True):
        assert (g.dtype, g.layout, g.shape) == (w.dtype, w.layout, w.shape), name
        assert torch.equal(g, w), name


def run(case: Case, session: Offloader, moved: list[int]) -> bool:
    """``case`` under the session, as PyTorch runs it without; whether it moved a tensor."""
    want = plainly(case)
    moved.clear()
    check(case, outcome(case, session), want, moved)
    return bool(moved)


@contextmanager
def quiet() -> Iterator[None]:
    """Without the session's advice that these cases earn on purpose: backward inside its
    block, a block that saved nothing, the graph changing between steps."""
    with warnings.catch_warnings():
        for message in ("cswap: backward ran inside", "cswap: no tensor autograd saved",
                        "cswap: the tensors saved under this Offloader"):
            warnings.filterwarnings("ignore", message)
        yield


# The cases that save only leaves, nothing a hook sees, or complex numbers (kept: "dtype
# complex64" in the table); the others move a tensor.
MOVE_NOTHING = {wrapped_number, dtypes_and_sparse, complex_numbers}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_each_case_alone_under_a_fresh_session(case, monkeypatch):
    """Alone, four steps in a row; the first, measured, moves what can move."""
    session = Offloader(CONFIG)
    moved = spy_on_moves(session, monkeypatch)
    with quiet():
        for repeat in range(REPEATS):
            run(case, session, moved)
            if repeat == 0:
                assert bool(moved) is (case not in MOVE_NOTHING), "what can move moves"
    session.close()


def unmoving(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unheld`` saving nothing: the plans of some cases then move nothing, and their
    later steps run without hooks."""
    monkeypatch.setattr(sys.modules[__name__], "unheld", lambda t: t + 0)


@pytest.mark.parametrize("moving", [True, False], ids=["each moves a tensor", "as they are"])
def test_every_case_through_one_shared_session(moving, monkeypatch):
    """All the cases one after another, and again in reverse order, through one
    ``offload(config)`` entered by each, each case four times in a row, then all of them in
    turn, one step each: as alone. A case whose plan moves nothing runs its later steps
    without hooks; the next case (entered from other code, inside a user's hooks, in
    backward) has them back."""
    if not moving:
        unmoving(monkeypatch)
    session = offload(CONFIG)
    moved = spy_on_moves(session, monkeypatch)
    in_turn = (CASES + CASES[::-1]) * 2
    try:
        with quiet():
            moves = [run(case, session, moved) for case in
                     [case for case in CASES + CASES[::-1] for _ in range(REPEATS)] + in_turn]
        assert any(moves), "the shared session moved tensors"
    finally:
        session.close()


@pytest.mark.parametrize("moving", [True, False], ids=["each moves a tensor", "as they are"])
def test_every_case_inside_one_block_of_a_shared_session(moving, monkeypatch):
    """The session entered once around all the cases (their own blocks nest in it: one step,
    backward inside it), three times: as PyTorch runs them without it; ``disabled_hooks`` as
    inside PyTorch's pass-through hooks, where disabling hooks raises, as inside the session
    (PyTorch's hooks, unlike the session, do not check a saved tensor's version)."""
    if not moving:
        unmoving(monkeypatch)
    want = [plainly(case) for case in CASES]
    with passthrough():
        want[CASES.index(disabled_hooks)] = plainly(disabled_hooks)
    session = offload(CONFIG)
    moved = spy_on_moves(session, monkeypatch)
    session.backward_inside = True
    try:
        with quiet():
            for _ in range(3):
                got, moves = [], []
                with session:
                    for case in CASES:
                        moved.clear()
                        got.append(outcome(case, session))
                        moves.append(list(moved))
                for case, g, w, m in zip(CASES, got, want, moves, strict=True):
                    check(case, g, w, m)
    finally:
        session.close()


def test_a_saved_input_detached_in_place_raises_only_where_no_hooks_run():
    """The half of ``detached_after_saving`` left out above, as the README states it: plain
    PyTorch raises for a saved input detached in place; PyTorch's pass-through hooks and a
    step of the session that moves tensors do not (backward reads the saved values, so the
    gradient is plain PyTorch's of the same forward without the detach); a session whose
    plan moves nothing raises once its steps run without hooks."""

    def forward_then_detach(hooks: AbstractContextManager) -> torch.Tensor:
        leaf = _leaf(0, 64, 64).requires_grad_(True)
        a = leaf * 2
        with hooks:
            out = (a * a).sum()  # saves ``a`` (self and other)
        a.detach_()
        out.backward()
        return leaf.grad

    with pytest.raises(RuntimeError, match="saved tensor that has been detached"):
        forward_then_detach(nullcontext())
    want = _leaf(0, 64, 64).mul(8)  # d/dleaf of sum((2 leaf)^2)
    assert torch.equal(forward_then_detach(passthrough()), want)
    session = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    try:
        for _ in range(2):  # a measured step, then one under the plan
            assert torch.equal(forward_then_detach(session), want)
        assert session.last_step().offloaded_bytes > 0
    finally:
        session.close()
    # A run that fits: measured, checked, then steps without hooks, where PyTorch's check runs.
    session = Offloader(CSwapConfig(min_bytes=0, profile_steps=1))
    try:
        assert torch.equal(forward_then_detach(session), want)  # measured: hooks on
        with pytest.raises(RuntimeError, match="saved tensor that has been detached"):
            for _ in range(3):
                forward_then_detach(session)
    finally:
        session.close()
