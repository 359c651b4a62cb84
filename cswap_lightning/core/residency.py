"""Measured residency: the bytes of one step's saved tensors on the compute device, over time.

A storage counts from the moment autograd saves a tensor of it until it is freed, which a
weak reference to the storage tells: PyTorch keeps one Python object per storage, and drops
it when the storage goes. A restored copy, fresh memory of its own, counts from its restore
until its storage goes (views and aliases of it hold it too). So kept tensors, originals not
yet copied out (or still held by the user's code), restored tensors autograd still holds and
prefetched ones are all counted, each storage once, whatever the device. The storages counted,
summed (``StepStats.keep_all_bytes``), are what keeping every saved tensor holds at the end of
forward: the peak the engine's is compared with.

A block the engine recomputes keeps only its inputs through forward; while backward runs it
again, what it saves is held once more (by ``torch.utils.checkpoint``, until the block's own
backward uses it). Those storages are counted too, from the recomputation until they are
freed (:meth:`Residency.again`), beside the saved tensors: ``peak_resident_bytes`` stays the
peak of the step's saved tensors (what the planner checks its plan against), and
``peak_with_recompute_bytes`` is the peak with what the recomputed blocks held, the memory a
user sees.

Storages are freed on any thread. Rather than take a lock for every change on the hot path,
each change is appended to a deque (atomic) and the changes are summed, in order, when the
figures are read (:meth:`Residency.fold`).
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from ..records import StepStats


class Held(weakref.ref):
    """A weak reference to a counted storage (``key``: its address) or restored copy
    (``key`` None), with what it counts for."""

    __slots__ = ("key", "nbytes")


class HeldAgain(Held):
    """A weak reference to a storage a recomputed block saved in backward."""

    __slots__ = ()


class Residency:
    """The ledger of one step: its changes, summed into ``stats`` (peak and timeline)."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self.now = 0  # bytes resident after the changes folded so far
        self.start = time.perf_counter()
        self._held: dict[int, Held] = {}  # storage address -> its reference
        self._again: dict[int, HeldAgain] = {}  # the same, for recomputed blocks' saves
        self.again_now = 0  # of ``now``, the bytes recomputed blocks hold
        # A weak reference's callback runs only while the reference lives: the ledger holds
        # those to restored copies (which the entries hold too) until the copies go.
        self._copies: set[Held] = set()
        # (seconds, change of resident bytes), and a third item (True) for the bytes a
        # recomputed block holds
        self._changes: deque[tuple[float, int] | tuple[float, int, bool]] = deque()
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

    def restored(self, copy: torch.Tensor, nbytes: int) -> weakref.ref:
        """Count a restored copy of ``nbytes`` until its memory is freed (what aliases it
        holds it too: an output a recomputation gave back, detached); a weak reference to the
        copy, which gives it back while it lives."""
        ref = Held(copy.untyped_storage(), self._freed_callback)
        ref.key, ref.nbytes = None, nbytes
        self._copies.add(ref)
        self._append((time.perf_counter(), nbytes))
        return weakref.ref(copy)

    def recomputing(self) -> None:
        """A recomputed block is run again by backward (``StepStats.recomputations``)."""
        self.stats.recomputations += 1

    def again(self, storage: torch.UntypedStorage) -> None:
        """Count a storage a recomputed block saves while backward runs it again, until it is
        freed; once, and not where the step's saved tensors hold it already (an input)."""
        key = storage._cdata
        if key in self._held or key in self._again:
            return
        ref = self._again[key] = HeldAgain(storage, self._freed_callback)
        ref.key, ref.nbytes = key, storage.nbytes()
        self._append((time.perf_counter(), ref.nbytes, True))

    def _freed(self, ref: Held) -> None:
        # A storage's address is reused only after this callback: the key is still ref's.
        if type(ref) is HeldAgain:
            if self._again.get(ref.key) is ref:
                del self._again[ref.key]
                self._append((time.perf_counter(), -ref.nbytes, True))
            return
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
            change = changes.popleft()
            at, resident = change[0], change[1]
            self.now += resident
            if len(change) == 3:
                self.again_now += resident
            else:
                stats.peak_resident_bytes = max(stats.peak_resident_bytes,
                                                self.now - self.again_now)
            stats.peak_with_recompute_bytes = max(stats.peak_with_recompute_bytes, self.now)
            stats.timeline_s.append(at - self.start)
            stats.timeline_bytes.append(self.now)
