"""What the engine needs to know of a saved tensor: may it move, and is it still as saved?"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import NoReturn

import torch

from ..codecs import DTYPES
from ..config import MAX_STORAGE_TO_VIEW_RATIO

_SUPPORTED_DTYPES = frozenset(DTYPES)
_STRIDED = torch.strided



def unwrap(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
    """The plain tensor that holds ``t``'s memory, and how to wrap it again: a DTensor (tensor
    or sequence parallelism) moves as its local shard; any other tensor as itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported where DTensors exist
    if dtensor is None or type(t) is not dtensor.DTensor or of_a_leaf(t):
        return t, None
    return t._local_tensor, partial(dtensor.DTensor.from_local, device_mesh=t.device_mesh,
                                    placements=t.placements, shape=t.shape, stride=t.stride())


def of_a_leaf(t: torch.Tensor) -> bool:
    """A weight (trained or frozen) or a leaf that requires grad, or a view of one."""
    base = t if t._base is None else t._base
    return base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter))


def skip_reason(t: torch.Tensor, min_bytes: int) -> str:
    """Why ``t`` must stay where it is, or ``""`` if it can be offloaded (this runs for every
    saved tensor: the common case, a plain strided activation, takes the fewest checks)."""
    plain = type(t) is torch.Tensor
    if plain and t.layout is _STRIDED and not t.is_nested and t.dtype in _SUPPORTED_DTYPES:
        if (t._base is not None or t.is_leaf) and of_a_leaf(t):  # not an op's output
            return "leaf" if t._base is None else "view of a leaf"
        if not (t.is_cuda or t.is_cpu):
            return f"device {t.device.type}"
        nbytes = t.nbytes
        if nbytes < max(min_bytes, 1):
            return "small"
        if t.untyped_storage().nbytes() > MAX_STORAGE_TO_VIEW_RATIO * nbytes:
            return "view of larger storage"
        return ""
    if not plain and isinstance(t, torch.nn.Parameter):
        return "parameter"
    if t.layout != torch.strided or t.is_nested:
        return "sparse/nested"
    if t.dtype not in _SUPPORTED_DTYPES or t.is_quantized:
        return f"dtype {str(t.dtype).removeprefix('torch.')}"
    if not (t.is_cuda or t.is_cpu):
        return f"device {t.device.type}"
    if of_a_leaf(t):
        return "leaf" if t._base is None else "view of a leaf"
    return f"subclass {type(t).__name__}"


def version_probe(detached: torch.Tensor) -> torch.Tensor:
    """``detached``, a ``detach()`` of a saved tensor (which shares its version counter),
    pointed at an empty tensor: it sees later in-place writes to the saved tensor (or any view
    of its storage that shares the counter) without keeping its memory.

    Pointed through ``.data``, which, unlike ``set_()``, does not bump the shared counter:
    another thread saving the tensor at the same moment must not see a version that never was.
    """
    key = (detached.dtype, detached.get_device())
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = torch.empty(0, dtype=detached.dtype, device=detached.device)
    detached.data = empty
    return detached


_EMPTY: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # by dtype and device index


def counter_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter ``t`` uses: its base if it is a view, else itself.
    Two tensors with the same owner count versions together; pieces of ``unsafe_chunk`` or
    ``unsafe_split`` (LSTM and GRU gates) share a storage but each owns its counter, so an
    in-place write to one is invisible to the others."""
    return t if t._base is None else t._base


def unsupported_device(device: torch.device) -> RuntimeError:
    """The error for a step whose saved tensors are on a device the engine does not run on."""
    if device.type == "meta":
        fix = ("a model on the meta device has no data to train: materialise it first (e.g. "
               "model.to_empty(device='cuda') and load or initialise its weights)")
    else:
        fix = f"train on the CPU or a CUDA GPU, or without the engine on {device.type}"
    return RuntimeError(f"cswap: autograd saved a tensor on {device}; the engine runs on the "
                        f"CPU and on CUDA GPUs only: {fix}")


def version_error(current: int, saved: int, dtype: torch.dtype, shape: tuple[int, ...]) -> NoReturn:
    """PyTorch skips its version check for tensors that pass through saved-tensor hooks; the
    engine does it, and raises this where a saved tensor was modified in place."""
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{dtype} {list(shape)}] is at version {current}; expected "
        f"version {saved} instead. (cswap keeps PyTorch's check for saved tensors.)"
    )
