"""How ``cswap bench suite`` measures peak memory on the CPU, where there is no separate
device memory: a tap on every saved-tensor hook pair, and a ledger of the storages that would
sit in device memory if the host side were a separate memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self


class HookTap:
    """Wraps every saved-tensor hook pair pushed while it is active (``saved_tensors_hooks`` and
    what is built on it: ``save_on_cpu``, checkpointing, torchtune's hooks, the engine), the
    same way for every method: it counts the bytes a pack hook copies out (tensors in what the
    hook returns that do not share the saved tensor's storage), tells a :class:`DeviceLedger`
    which allocations happen inside a pack hook (a method's host tier), and hands it the
    tensors unpack hooks give back (on the device again from then on)."""

    def __init__(self) -> None:
        self.moved = 0
        self.ledger: DeviceLedger | None = None
        self._local = threading.local()
        self._push = None

    def __enter__(self) -> Self:
        autograd = torch._C._autograd
        self._push = push = autograd._push_saved_tensors_default_hooks
        autograd._push_saved_tensors_default_hooks = lambda pack, unpack: push(
            self._pack(pack), self._unpack(unpack))
        return self

    def __exit__(self, *exc) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks = self._push

    def packing(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def take_moved(self) -> int:
        moved, self.moved = self.moved, 0
        return moved

    def _pack(self, pack):
        def tapped(t: torch.Tensor):
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                packed = pack(t)
            finally:
                self._local.depth -= 1
            ptr = t.untyped_storage().data_ptr()
            self.moved += sum(x.numel() * x.element_size() for x in tree_leaves(packed)
                              if isinstance(x, torch.Tensor) and x.numel()
                              and x.untyped_storage().data_ptr() != ptr)
            return packed

        return tapped

    def _unpack(self, unpack):
        def tapped(packed):
            t = unpack(packed)
            if self.ledger is not None and isinstance(t, torch.Tensor):
                self.ledger.hold(t)
            return t

        return tapped


class DeviceLedger(TorchDispatchMode):
    """Peak bytes of live tensor storages on the compute side of a CPU step, measured.

    Counted: the storages of the tensors given at the start (parameters, buffers, optimizer
    state, the batch), every storage an operation on the training thread creates outside a
    saved-tensor pack hook (activations, gradients, temporaries, recomputation), and the
    storage of every tensor an unpack hook hands back, from then on. Each storage counts once,
    with its size, until it is freed (a weak reference to it says when, on whichever thread
    drops it). Not counted: what a pack hook allocates (the copy a method keeps on the host
    side) and what other threads allocate (an offload engine's workers) until it is handed
    back. The rule is the same for every method; it is what would sit in device memory if the
    host side were a separate memory, as it is on a GPU.
    """

    def __init__(self, tap: HookTap, held: Iterator[torch.Tensor]) -> None:
        super().__init__()
        self.tap = tap
        self.now = self.peak = 0
        self._held: dict[int, tuple[weakref.ref, int]] = {}
        self._lock = threading.Lock()
        for t in held:
            self.hold(t)

    def hold(self, t: torch.Tensor) -> None:
        if _storage_key(t) is None:
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self._held:
                counted = self._held[key][1]
                if counted == nbytes:
                    return
                self.now -= counted  # resized in place
            self._held[key] = (weakref.ref(storage, partial(self._freed, key)), nbytes)
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def _freed(self, key: int, _ref) -> None:
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self.now -= held[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tap.packing():
            return out
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            # A view or an in-place result allocates nothing: it counts if its storage does
            # (resized in place by an out= op, it is counted again at its new size).
            if key not in inputs or key in self._held:
                self.hold(t)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (None: no CPU storage of its own to count)."""
    if t.device.type != "cpu" or t.is_meta or t.layout != torch.strided or t.is_nested:
        return None
    return t.untyped_storage()._cdata
