"""The offload session: autograd's saved-tensor hooks, sites, filters, de-duplication, prefetch.

A *step* is one forward under ``with offloader:`` and the backward that consumes it. The k-th
tensor autograd saves in a step is *site* k; steps repeat, so site ids are stable and what was
learned about site k (its sparsity, when backward needed it) plans the next step.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from typing_extensions import Self

from .codecs import DTYPES, get_codec
from .config import CSwapConfig
from .stats import SiteStats, StepStats
from .transfer import Stored, Transfer

# A view whose storage is this many times larger than itself is kept: offloading it would
# move (and free) nothing but the whole storage.
MAX_STORAGE_TO_VIEW_RATIO = 4
_SUPPORTED_DTYPES = frozenset(DTYPES)


def skip_reason(t: torch.Tensor, min_bytes: int) -> str:
    """Why ``t`` must stay where it is, or ``""`` if it can be offloaded."""
    if isinstance(t, torch.nn.Parameter):
        return "parameter"
    if type(t) is not torch.Tensor:
        return f"subclass {type(t).__name__}"
    if t.layout != torch.strided or t.is_nested:
        return "sparse/nested"
    if t.is_quantized or t.is_complex() or t.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {str(t.dtype).removeprefix('torch.')}"
    if t.device.type not in ("cuda", "cpu"):
        return f"device {t.device.type}"
    base = t if t._base is None else t._base
    if base.is_leaf and base.requires_grad:  # held outside autograd: moving it frees nothing
        return "leaf" if base is t else "view of a leaf"
    nbytes = t.numel() * t.element_size()
    if nbytes < max(min_bytes, 1):
        return "small"
    if t.untyped_storage().nbytes() > MAX_STORAGE_TO_VIEW_RATIO * nbytes:
        return "view of larger storage"
    return ""


class _Entry:
    """One storage moved off the device, shared by every site that saved a view of it."""

    __slots__ = (
        "__weakref__",
        "consumed",
        "id",
        "nbytes",
        "restored",
        "restoring",
        "stats",
        "stored",
    )

    def __init__(self, site: SiteStats, stored: Future[Stored | torch.Tensor]) -> None:
        self.id = site.site
        self.nbytes = site.nbytes
        self.stats = site
        self.stored = stored
        self.restoring: Future | None = None  # restore in flight (prefetched or on demand)
        self.restored: weakref.ref | None = None  # the device copy, while autograd holds it
        self.consumed = False  # unpacked at least once

    def host_bytes(self) -> int:
        if not self.stored.done() or self.stored.exception() is not None:
            return 0
        result = self.stored.result()
        return result.nbytes if isinstance(result, Stored) else 0


def version_probe(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor sharing ``t``'s version counter: it sees later in-place writes to ``t``
    (or any view of its storage) without keeping ``t``'s memory alive."""
    version = t._version
    probe = t.detach()
    with torch.no_grad():
        probe.set_()  # drops the storage, and bumps the shared counter: undo that
    _set_version(probe, version)
    return probe


def _set_version(t: torch.Tensor, version: int) -> None:
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


try:  # chosen once here, not on every pack: older torch releases take one tensor, one version
    _set_version(torch.empty(0), 0)
except TypeError:
    def _set_version(t: torch.Tensor, version: int) -> None:
        torch._C._autograd._unsafe_set_version_counter(t, version)


def check_version(current: int, saved: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """PyTorch skips this check for tensors that pass through saved-tensor hooks; we do it."""
    if current != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{dtype} {list(shape)}] is at version {current}; expected "
            f"version {saved} instead. (cswap keeps PyTorch's check for saved tensors.)"
        )


@dataclass(frozen=True)
class _Kept:
    """A saved tensor left in place, with the version it had when autograd saved it."""

    tensor: torch.Tensor
    version: int


@dataclass(frozen=True)
class _Saved:
    """What autograd holds instead of an offloaded tensor: the entry, the view to rebuild,
    and what is needed to catch in-place writes made after the save."""

    entry: _Entry
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    probe: torch.Tensor
    version: int


class _Step:
    """Packs and unpacks of one forward and its backward."""

    def __init__(self, offloader: Offloader, index: int, order: list[int] | None) -> None:
        self.offloader = offloader
        self.stats = StepStats(index)
        self.failed = False
        self._by_storage: dict[int, tuple[StorageWeakRef, int, _Entry]] = {}
        self._entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
        self._prev_order = order  # unpack order learned on an earlier step
        self._order: list[int] | None = None
        self._position: dict[int, int] = {}
        self._cursor = 0
        self._inflight = 0
        self.unpack_order: list[int] = []
        self._counts: list[tuple[SiteStats, int, torch.Tensor]] = []

    # forward ----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Kept | _Saved:
        site = len(self.stats.sites)
        nbytes = t.numel() * t.element_size()
        stats = SiteStats(site, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes, "keep")
        self.stats.sites.append(stats)
        stats.reason = skip_reason(t, self.offloader.config.min_bytes)
        if stats.reason:
            return _Kept(t, t._version)
        storage = t.untyped_storage()
        hit = self._by_storage.get(storage._cdata)
        if hit is not None and hit[1] == t._version and hit[2].stats.dtype == stats.dtype:
            stats.decision, stats.reason = "dedup", f"shares storage with site {hit[2].id}"
            return self._saved(hit[2], t)
        codec = self.offloader.codec_for(site, stats)
        if codec == "keep":
            stats.reason = "plan"
            return _Kept(t, t._version)
        stats.decision = codec
        elem = t.element_size()
        flat = t.detach().as_strided((storage.nbytes() // elem,), (1,), 0)
        stats.nbytes = flat.numel() * elem
        future = self.offloader.transfer.offload(flat, get_codec(codec))
        future.add_done_callback(lambda f: self._record(stats, f))
        entry = _Entry(stats, future)
        self._entries[entry.id] = entry
        self.offloader._live.add(entry)
        # Holding a weak reference pins the storage's address, so it cannot be mistaken for
        # a new storage that happens to reuse it later in this step.
        self._by_storage[storage._cdata] = (StorageWeakRef(storage), t._version, entry)
        return self._saved(entry, t)

    @staticmethod
    def _saved(entry: _Entry, t: torch.Tensor) -> _Saved:
        size, stride, offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        return _Saved(entry, size, stride, offset, version_probe(t), t._version)

    def end_forward(self) -> None:
        self._by_storage.clear()

    # backward ---------------------------------------------------------------------------
    def unpack(self, saved: _Kept | _Saved) -> torch.Tensor:
        if isinstance(saved, _Kept):
            t = saved.tensor
            check_version(t._version, saved.version, t.dtype, tuple(t.shape))
            return saved.tensor
        check_version(saved.probe._version, saved.version, saved.probe.dtype, saved.size)
        entry = saved.entry
        start = time.perf_counter()
        base = self._take(entry)
        entry.stats.wait_s += time.perf_counter() - start
        self._prefetch_after(entry)
        return base.as_strided(saved.size, saved.stride, saved.offset)

    def _take(self, entry: _Entry) -> torch.Tensor:
        base = entry.restored() if entry.restored is not None else None
        if base is not None:
            return base
        if entry.restoring is None:
            entry.restoring = self.offloader.transfer.restore(entry.stored)
        elif not entry.consumed:
            self._inflight -= entry.nbytes
        base, ready = entry.restoring.result()
        if ready is not None:
            stream = torch.cuda.current_stream(base.device)
            stream.wait_event(ready)
            base.record_stream(stream)
        entry.restoring = None
        entry.restored = weakref.ref(base)
        if not entry.consumed:
            entry.consumed = True
            self.unpack_order.append(entry.id)
        return base

    def _prefetch_after(self, entry: _Entry) -> None:
        """Bring back the sites expected next, within the bytes-in-flight budget."""
        budget = self.offloader.config.prefetch_bytes
        if budget == 0:
            return
        if self._order is None:
            self._order = self._prev_order or sorted(self._entries.keys(), reverse=True)
            self._position = {site: i for i, site in enumerate(self._order)}
        if entry.id in self._position:
            self._cursor = max(self._cursor, self._position[entry.id] + 1)
        while self._cursor < len(self._order):
            nxt = self._entries.get(self._order[self._cursor])
            if nxt is not None and not nxt.consumed and nxt.restoring is None:
                if self._inflight and self._inflight + nxt.nbytes > budget:
                    return
                nxt.restoring = self.offloader.transfer.restore(nxt.stored)
                nxt.stats.prefetched = True
                self._inflight += nxt.nbytes
            self._cursor += 1

    # statistics -------------------------------------------------------------------------
    def _record(self, stats: SiteStats, future: Future[Stored | torch.Tensor]) -> None:
        """Runs in the offload worker when a site's job ends (the entry may be gone by then)."""
        stored = future.result()
        if isinstance(stored, Stored):
            stats.stored_bytes, stats.offload_s = stored.nbytes, stored.seconds
            self._counts.append((stats, stored.packed.header.numel, stored.nonzero))
        else:
            stats.decision, stats.reason = "keep", "offload failed"

    def close(self) -> None:
        """Turn the zero counts of finished jobs into sparsities (call after a drain)."""
        counts, self._counts = self._counts, []
        for stats, numel, nonzero in counts:
            stats.sparsity = 1.0 - nonzero.item() / numel if numel else 0.0


class Offloader:
    """Offloads autograd's saved tensors during each ``with`` block (one training step).

    Create it once and enter it around every forward pass; what it learns on one step
    (per-site sparsity, the order backward needs tensors in) plans the next::

        offloader = Offloader(CSwapConfig())
        for batch in loader:
            with offloader:
                loss = model(batch)
            loss.backward()
        print(offloader.last_step().table())
    """

    def __init__(self, config: CSwapConfig | None = None) -> None:
        self.config = config if config is not None else CSwapConfig()
        self.transfer = Transfer(pin_memory=self.config.pin_memory)
        self.plan: dict[int, tuple[tuple, str]] = {}  # site -> ((shape, dtype), codec)
        self._live: weakref.WeakSet[_Entry] = weakref.WeakSet()
        self._step: _Step | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._closed: _Step | None = None
        self._steps = 0

    def __enter__(self) -> Self:
        if self._hooks is not None:
            raise RuntimeError("this Offloader is already active; enter it once per forward pass")
        self._close_step()
        order = self._closed.unpack_order if self._closed is not None else None
        self._step = _Step(self, self._steps, order or None)
        self._steps += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._step.pack, self._step.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._hooks is not None and self._step is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        self._step.end_forward()
        self._step.failed = exc_type is not None

    def codec_for(self, site: int, stats: SiteStats) -> str:
        """The plan's decision for a site: a codec name or ``"keep"``."""
        if self.config.plan != "auto":
            return self.config.plan
        planned = self.plan.get(site)
        if planned is not None and planned[0] == (stats.shape, stats.dtype):
            return planned[1]
        return "raw"  # not profiled yet, or the step changed shape: swap uncompressed

    def last_step(self) -> StepStats:
        """Statistics of the most recent step (waits for its offload work to finish)."""
        if self._step is None:
            raise RuntimeError("no step has run yet: enter the Offloader around a forward pass")
        self.transfer.drain()
        self._step.close()
        return self._step.stats

    def live_host_bytes(self) -> int:
        """Host bytes held right now for tensors autograd still references."""
        return sum(entry.host_bytes() for entry in list(self._live))

    def live_entries(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Stop the worker threads (the Offloader cannot be used afterwards)."""
        self.transfer.close()
        if _SHARED.get(self.config) is self:
            del _SHARED[self.config]

    def _close_step(self) -> None:
        step = self._step
        if step is None:
            return
        self.last_step()
        if step.failed:
            return
        self._closed = step
        if self.config.plan == "auto":
            self._replan(step.stats)

    def _replan(self, stats: StepStats) -> None:
        """Compress the sites whose measured sparsity pays, swap the others raw."""
        cfg = self.config
        for s in stats.sites:
            if s.sparsity is not None:
                codec = cfg.compressor if s.sparsity >= cfg.sparsity_threshold else "raw"
                self.plan[s.site] = ((s.shape, s.dtype), codec)


_SHARED: dict[CSwapConfig, Offloader] = {}


def offload(config: CSwapConfig | None = None) -> Offloader:
    """The process's :class:`Offloader` for ``config`` (one per distinct config), so that
    ``with offload(config):`` written inside a training loop learns across steps."""
    config = config if config is not None else CSwapConfig()
    if config not in _SHARED:
        _SHARED[config] = Offloader(config)
    return _SHARED[config]
