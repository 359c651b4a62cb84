"""Measured residency: the bytes of one step's saved tensors on the compute device, over time.

A storage counts from the moment autograd saves a tensor of it (or a restore brings it back)
until it is freed, which a weak reference to the storage tells: PyTorch keeps one Python
object per storage, and drops it when the storage goes. So kept tensors, originals not yet
copied out (or still held by the user's code), restored tensors autograd still holds and
prefetched ones are all counted, each storage once, whatever the device.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from .stats import StepStats


class _Held(weakref.ref):
    """A weak reference to a counted storage, with what it counts for."""

    __slots__ = ("key", "nbytes", "unpacked")


class Residency:
    """The ledger of one step: bytes now, and in ``stats`` their peak and timeline."""

    def __init__(self, stats: StepStats) -> None:
        self.now = 0
        self.unpacked_now = self.unpacked_peak = 0  # restored storages backward asked for
        self.stats = stats
        self.start = time.perf_counter()
        self._held: dict[int, _Held] = {}  # storage address -> its reference
        self._lock = threading.Lock()  # a storage may be freed in any thread
        self._freed_callback = self._freed  # one bound method for every reference

    def hold(self, storage: torch.UntypedStorage) -> _Held:
        """Count ``storage`` until it is freed (once, however often it is held); the weak
        reference that counts it."""
        key = storage._cdata
        ref = self._held.get(key)
        if ref is not None:
            return ref
        ref = _Held(storage, self._freed_callback)
        ref.key, ref.unpacked = key, False
        ref.nbytes = nbytes = storage.nbytes()
        with self._lock:
            self._held[key] = ref
            self.now += nbytes
            self._changed()
        return ref

    def ref(self, storage: torch.UntypedStorage) -> _Held | None:
        """The reference counting ``storage``, if it is counted: a reference to a freed
        storage is gone from here, so one found is to this very storage."""
        return self._held.get(storage._cdata)

    def unpacked(self, storage: torch.UntypedStorage) -> None:
        """Backward asked for this restored storage: count it among those it holds at once
        until it is freed (a compiled region asks for all of its own together)."""
        ref = self._held.get(storage._cdata)
        if ref is not None and not ref.unpacked:
            with self._lock:
                ref.unpacked = True
                self.unpacked_now += ref.nbytes
                self.unpacked_peak = max(self.unpacked_peak, self.unpacked_now)

    def _freed(self, ref: _Held) -> None:
        with self._lock:
            if self._held.get(ref.key) is ref:
                del self._held[ref.key]
                self.now -= ref.nbytes
                if ref.unpacked:
                    self.unpacked_now -= ref.nbytes
                self._changed()

    def _changed(self) -> None:
        stats = self.stats
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, self.now)
        stats.timeline_s.append(time.perf_counter() - self.start)
        stats.timeline_bytes.append(self.now)
