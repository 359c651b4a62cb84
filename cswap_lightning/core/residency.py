"""Measured residency: the bytes of one step's saved tensors on the compute device, over time.

A storage counts from the moment autograd saves a tensor of it until it is freed, which a
weak reference to the storage tells: PyTorch keeps one Python object per storage, and drops
it when the storage goes. A restored copy, fresh memory of its own, counts from its restore
until the tensor holding it goes (views of it hold it too). So kept tensors, originals not
yet copied out (or still held by the user's code), restored tensors autograd still holds and
prefetched ones are all counted, each storage once, whatever the device. The storages counted,
summed (``StepStats.keep_all_bytes``), are what keeping every saved tensor holds at the end of
forward: the peak the engine's is compared with.

Storages are freed on any thread. Rather than take a lock for every change on the hot path,
each change is appended to a deque (atomic) and the changes are summed, in order, when the
figures are read (:meth:`Residency.fold`).
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from .stats import StepStats


class Held(weakref.ref):
    """A weak reference to a counted storage (``key``: its address) or restored copy
    (``key`` None), with what it counts for."""

    __slots__ = ("key", "nbytes")


class Residency:
    """The ledger of one step: its changes, summed into ``stats`` (peak and timeline)."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self.now = 0  # bytes resident after the changes folded so far
        self.start = time.perf_counter()
        self._held: dict[int, Held] = {}  # storage address -> its reference
        # A weak reference's callback runs only while the reference lives: the ledger holds
        # those to restored copies (which the entries hold too) until the copies go.
        self._copies: set[Held] = set()
        # (seconds, change of resident bytes)
        self._changes: deque[tuple[float, int]] = deque()
        self._append = self._changes.append
        self._freed_callback = self._freed  # one bound method for every reference
        # whether the storages held are summed into ``keep_all_bytes`` (not on a step that
        # runs a checked plan: it reports the checking step's)
        self.sums_keep_all = True

    def hold(self, storage: torch.UntypedStorage) -> Held:
        """Count ``storage`` until it is freed (once, however often it is held); the weak
        reference that counts it."""
        key = storage._cdata
        ref = self._held.get(key)
        if ref is None:
            ref = self._held[key] = Held(storage, self._freed_callback)
            nbytes = ref.nbytes = storage.nbytes()
            ref.key = key
            self._append((time.perf_counter(), nbytes))
            if self.sums_keep_all:
                self.stats.keep_all_bytes += nbytes
        return ref

    def restored(self, copy: torch.Tensor, nbytes: int) -> Held:
        """Count a restored copy of ``nbytes`` until it is freed; the weak reference to it,
        which gives it back while it lives."""
        ref = Held(copy, self._freed_callback)
        ref.key, ref.nbytes = None, nbytes
        self._copies.add(ref)
        self._append((time.perf_counter(), nbytes))
        return ref

    def _freed(self, ref: Held) -> None:
        # A storage's address is reused only after this callback: the key is still ref's.
        if ref.key is None:
            self._copies.discard(ref)
        elif self._held.get(ref.key) is ref:
            del self._held[ref.key]
        else:
            return
        self._append((time.perf_counter(), -ref.nbytes))

    def fold(self) -> None:
        """Sum the changes so far into ``stats``: the peak and the timeline."""
        stats, changes = self.stats, self._changes
        for _ in range(len(changes)):  # those appended meanwhile are the next fold's
            at, resident = changes.popleft()
            self.now += resident
            stats.peak_resident_bytes = max(stats.peak_resident_bytes, self.now)
            stats.timeline_s.append(at - self.start)
            stats.timeline_bytes.append(self.now)
