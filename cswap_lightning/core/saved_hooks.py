"""The stack of saved-tensor hooks autograd runs: its top, and a region without any.

torch's functional transforms (``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian`` and
``vmap`` over them) refuse to run while any saved-tensor hooks are in force: inside the
Offloader's block (a Lightning strategy's training step, the Hugging Face callback's model
forward) they raise "torch.func... don't yet support saved tensor hooks". ``no_offload()``
takes every hook off the stack for its region and puts them back as they were, so that
autograd keeps what the region saves, as it would without this library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
    _top_saved_tensors_default_hooks,
)

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def top_hooks() -> Hooks | None:
    """The innermost saved-tensor hooks (pack, unpack), or None."""
    return _top_saved_tensors_default_hooks(False)


def in_transform() -> bool:
    """Whether a ``torch.func`` transform is running: module hooks see its wrapped tensors
    then, which take neither ``.data`` nor checkpoint (its saved-tensor hooks)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


@contextmanager
def no_offload() -> Iterator[None]:
    """A region where no saved-tensor hooks run: the Offloader's, checkpoint's and the
    user's are off, and what autograd saves inside stays where it is, as without them.

    For code torch cannot run under saved-tensor hooks, ``torch.func``'s transforms::

        with cswap_lightning.no_offload():
            slopes = torch.func.vmap(torch.func.grad(f))(x)

    Gradients are those of a run without the library (the region's saved tensors are simply
    kept); the hooks in force before are back on leaving, also on an exception."""
    stack: list[Hooks] = []
    while (hooks := top_hooks()) is not None:
        stack.append(hooks)
        _pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            _push_saved_tensors_default_hooks(pack, unpack)
