"""One step's pack and unpack hooks: the engine's hot path, run for every saved tensor.

A *step* is one forward under ``with offloader:`` and the backward that consumes it. The k-th
tensor autograd saves in a step is *site* k; steps repeat, so what was learned about site k
(its sparsity, when backward needed it, whether moving it freed anything) plans the next.

pack: keep the tensor (a weight, too small, planned to stay), or share the entry of a storage
already moved this step, or start moving its whole storage (``Transfer.offload`` returns at
once). unpack: check the version, take the prefetched copy or restore it now, then prefetch
what backward is expected to need next.

Once a plan has been checked on a step, later steps run it without tracking each site: the
sites it keeps are only counted, and the sites it moves with a codec of exact size (raw,
lossy) move without a row in the step's table or a place in its residency ledger, only
summed. Making a row and measuring residency cost about as much as the move itself (16 us a
tensor in Python), and the checking step has measured both. The step's saved tensors are
compared with the checking step's at its end (their count and sizes in order): any change
makes the next step track every site again.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from ..allocator import peak_allocated_bytes
from ..codecs import Codec, get_codec
from ..codecs.lossy import relative_error, seed_of
from ..config import LOSSY_CODECS
from ..planning.prefetch import resident_window
from ..planning.profiler import StepTimer
from ..records import HOST_BUDGET, WEIGHTS, SiteStats, StepStats, fmt_bytes
from .residency import Residency
from .tensors import (
    _STRIDED,
    counter_owner,
    of_a_leaf,
    skip_reason,
    unsupported_device,
    unwrap,
    version_error,
    version_probe,
)
from .transfer import Stored, current_stream

if TYPE_CHECKING:
    from ..config import CSwapConfig
    from .module_names import ModuleTracker
    from .recompute import BlockTimer
    from .transfer import Transfer


class Session(Protocol):
    """What a step reads of the engine that runs it (``engine.Offloader``): its settings,
    copies and module names, the prefetch window and each site's decision; and where it
    records the sites whose moving freed nothing."""

    config: CSwapConfig
    transfer: Transfer
    modules: ModuleTracker | None
    held_elsewhere: set[int]

    def prefetch_window(self) -> int | None: ...

    def codec_for(self, site: int, stats: SiteStats) -> str: ...


class _Entry(Stored):
    """One storage moved off the device: what autograd holds for the site that saved it
    first, with that site's view of it (``shape``, ``stride``, ``offset``; ``shape`` None
    where it comes back in the shape and strides it left in, as ``as_left()``); later sites
    viewing the same bytes hold a ``_View``. The view is kept here, not in objects of its
    own: every object that lives through a step costs the garbage collector time. ``stats``
    is the site's row, None where the step does not track the site; ``held`` and ``owner``,
    which tell a later site of the same storage and version counter, None where no later
    site is expected to share it (then later sites do not find it)."""

    __slots__ = ("__weakref__", "consumed", "held", "id", "nbytes", "offset", "owner",
                 "prefetched", "probe", "rebuild", "restored", "restored_ready", "shape",
                 "stats", "stride", "version")

    def __init__(self, site: int, t: torch.Tensor, held: weakref.ref | None,
                 rebuild: Callable | None, stats: SiteStats | None) -> None:
        Stored.__init__(self, t.device)
        self.id = site
        self.stats = stats
        self.held = held  # a weak reference to the original storage
        # a tensor sharing the saved tensor's version counter: empty, or the tensor kept
        # where the offload failed (set by Step._offload)
        self.probe: torch.Tensor | None = None
        # the tensor owning that counter, while alive
        self.owner = weakref.ref(counter_owner(t)) if held is not None else None
        self.version = t._version  # the counter's value at the save
        self.shape: torch.Size | None = None  # the view, set by Step._offload where needed
        self.stride: tuple[int, ...] | None = None
        self.offset, self.rebuild = 0, rebuild
        self.prefetched: torch.Tensor | None = None  # the device copy, until unpacked
        self.restored: weakref.ref | None = None  # the device copy, while autograd holds it
        self.restored_ready: torch.cuda.Event | None = None  # after which that copy is whole
        self.consumed = False  # unpacked at least once

    def as_left(self) -> torch.Tensor:
        """What it comes back as where no view is kept (``shape`` None): the payload, or the
        tensor kept where the offload failed."""
        return self.payload if self.kept is None else self.kept


class _View(NamedTuple):
    """What autograd holds for a site whose storage an earlier site moved (rare: a tuple
    class of its own so that unpack tells it apart): which view of it, at which version."""

    entry: _Entry
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    version: int
    rebuild: Callable | None


class Probe(NamedTuple):
    """An accuracy-guard probe step (``Offloader.probe_next_step``). ``lossy`` False: every
    lossy site swaps raw (the exact gradients). True: the lossy ``sites`` (None: all of them)
    stay lossy, the others swap raw, and each one's original and restored tensors go to
    ``restored(site, original, restored)`` at its first unpack (besides its row's ``error``)."""

    lossy: bool
    sites: frozenset[int] | None = None
    restored: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None


class Move(NamedTuple):
    """How a checked plan moved a site: the codec, the dtype and storage size it moved (a
    tensor of another dtype, layout or storage size there is tracked), and whether later sites
    shared the storage."""

    codec: Codec
    dtype: torch.dtype
    nbytes: int
    shared: bool


class Checked(NamedTuple):
    """A plan checked on a step: what that step saved (``Step.counted``), the sites it kept,
    those it moved with a codec of exact size, its statistics (a row per site, the
    measured peak), its device, the sites where it saved a weight or a leaf
    (``Step.leaf_sites``), and the kept sites whose bytes an earlier kept site holds
    (``Step.same_bytes``)."""

    counted: list[int]
    kept: frozenset[int]
    moved: dict[int, Move]
    stats: StepStats
    device: torch.device | None = None
    leaves: frozenset[int] = frozenset()
    shares: frozenset[int] = frozenset()

    @property
    def moves_nothing(self) -> bool:
        """Every site kept: later steps need no hooks at all."""
        return len(self.kept) == len(self.counted)


class Step:
    """Packs and unpacks of one forward and its backward."""

    def __init__(self, offloader: Session, index: int, order: list[int] | None,
                 measure: bool, checked: Checked | None = None,
                 limits: tuple[int, ...] | None = None) -> None:
        self.offloader = offloader
        # With a plan checked on an earlier step: the sites it kept, which this step keeps
        # and counts without tracking them one by one (``idle``: every site, a run that
        # fits), and those it moved, which this step moves untracked.
        self.checked = checked
        self.untracked, self.untracked_moves = ((checked.kept, checked.moved)
                                                if checked is not None else (frozenset(), {}))
        self.idle = checked is not None and checked.moves_nothing
        # The checked step's weight sites; ``other_graph``: this step saved a weight where the
        # checked step moved a tensor, or none where it saved one (another model under a
        # shared session, of the same sizes): its plan, made by position, is not this graph's.
        self.leaves = checked.leaves if checked is not None else frozenset()
        self.other_graph = False
        # Kept sites counted without their bytes: an earlier kept site holds the same ones.
        self.shares = checked.shares if checked is not None else frozenset()
        # Without hooks (autograd keeps every saved tensor), as the engine sets it for a plan
        # that moves nothing; ``epoch``: the engine's epoch when the step started.
        self.dormant = False
        self.epoch = 0
        # The plan's size of each site (bytes): a larger tensor at an untracked site is
        # tracked, so that the plan can be made again for it. None: any size.
        self.limits = limits
        # the saved tensors' own sizes, in order (``counted``): as many as were saved, so
        # its length is the next one's site
        self.sizes: list[int] = []
        self.transfer = offloader.transfer
        self.min_bytes = offloader.config.min_bytes
        # the host memory this step's payloads may still take (None: any): a tensor that
        # would pass it stays on the device, whatever the plan
        self.host_left: int | None = offloader.config.host_budget
        self.prefetch_bytes = offloader.prefetch_window()
        self.stats = StepStats(index)
        self.residency = Residency(self.stats)
        if checked is not None:  # as measured on the step that checked the plan
            self.stats.peak_resident_bytes = checked.stats.peak_resident_bytes
            self.stats.peak_with_recompute_bytes = checked.stats.peak_with_recompute_bytes
            self.stats.keep_all_bytes = checked.stats.keep_all_bytes
            self.residency.sums_keep_all = False
        self.measure = measure  # time the windows and count every site's zeros
        self.keeping = False  # a measured step that keeps every tensor (the engine's choice)
        self.timer: StepTimer | None = None
        self.blocks: BlockTimer | None = None  # each block's sites and time, when measured
        self.numbering: frozenset[str] = frozenset()  # the blocks it recomputed (engine's)
        self._unpacked: set[int] = set()
        self.device: torch.device | None = None
        self.failed = self.closed = False
        # The allocator's peak when backward ended (CUDA), read then: what runs before the
        # step closes (the optimizer, a trainer resetting the peak) does not count.
        self.backward_peak: int | None = None
        self.backward_begun = False
        self.saved_before_backward = 0  # the saved tensors counted when backward began
        self.probe: Probe | None = None  # an accuracy-guard probe step
        self.seed = 0  # the lossy codecs' rounding seed of the step (each site mixes in its own)
        # Autograd runs backward on one thread per device: a model split over several GPUs in
        # one process unpacks from several threads at once.
        self._lock = threading.Lock()
        self._originals: dict[int, torch.Tensor] = {}  # lossy sites' originals, on lossy probes
        self._by_storage: dict[int, _Entry] = {}  # storage address -> entry, during forward
        # the bytes of a kept tensor (``_same_bytes``) -> its site and storage, during forward
        self._kept: dict[tuple, tuple[int, weakref.ref]] = {}
        self.same_bytes: set[int] = set()  # tracked kept sites whose bytes an earlier one holds
        self.shared: set[int] = set()  # sites whose storage later sites shared
        self._entries: dict[int, weakref.ref] = {}  # site -> its entry, while autograd has it
        self._prev_order = order  # unpack order learned on an earlier step
        self._order: list[int] | None = None
        self._position: dict[int, int] = {}
        self._cursor = 0
        self._inflight = 0  # prefetched bytes not yet unpacked
        self.unpack_order: list[int] = []
        self._counts: list[tuple[SiteStats, int, torch.Tensor]] = []
        self.clock = 0  # ticks once per pack and once per first unpack of a site
        # The moved bytes the backward of the latest compiled region asked for, and the most
        # one asked for (``restored_all_at_once``).
        self._region: weakref.ref | None = None
        self._region_bytes = self.region_peak = 0

    # forward ----------------------------------------------------------------------------
    def pack(self, saved: torch.Tensor) -> tuple | _Entry | _View:
        plain = type(saved) is torch.Tensor
        if self.idle and plain:
            counted = self._count(saved, saved)
            if counted is not None:
                return counted
        if _dynamo_callback() is not None:  # in a compiled module's eager fallback
            return torch.compiler.disable(self.pack)(saved)
        t, rebuild = (saved, None) if plain else unwrap(saved)
        if t.numel() == 0:  # no site, as in ``_count``
            return saved, saved._version, -1
        site = len(self.sizes)
        if self.idle or site in self.untracked:  # a DTensor counts by its local shard
            counted = self._count(saved, t)
            if counted is not None:
                return counted
        move = self.untracked_moves.get(site)
        if (move is not None and t.dtype is move.dtype and rebuild is None
                and t.layout is _STRIDED and not t.is_nested):  # as the checked step's was
            if of_a_leaf(t):  # a weight where the checked step moved a tensor: kept, tracked
                self.other_graph = True
            else:
                storage = t.untyped_storage()
                if storage.nbytes() == move.nbytes and self._host_takes(move.nbytes):
                    return self._move(site, t, storage, move)
        return self._track(saved, t, rebuild)

    def _count(self, saved: torch.Tensor, t: torch.Tensor) -> tuple | None:
        """Pack an untracked site: keep ``saved``, count ``t`` (its plain tensor); None
        where ``t`` is larger than the plan's site (then it is tracked: its row plans for it)."""
        nbytes = t.numel() * t.element_size()  # a sparse tensor has no nbytes
        if not nbytes:  # holds nothing, so no site: torch < 2.13's checkpoint saves one per call
            return saved, saved._version, -1
        site = len(self.sizes)
        limits = self.limits
        if limits is not None and (site >= len(limits) or nbytes > limits[site]):
            return None
        if site in self.leaves and not of_a_leaf(t):
            self.other_graph = True  # no weight where the checked step saved one
        self.stats.untracked_tensors += 1
        if site not in self.shares:
            self.stats.untracked_bytes += nbytes
        self.sizes.append(nbytes)
        return saved, saved._version, -1

    def leaf_sites(self) -> frozenset[int]:
        """The tracked sites that saved a weight or a leaf: with the sizes of what was saved,
        what tells one model's graph from another's."""
        return frozenset(s.site for s in self.stats.sites if s.reason in WEIGHTS)

    def counted(self) -> list[int]:
        """What the step saved, as untracked steps compare it: the saved tensors' own sizes (a
        view's, not its storage's) in order, so that sites that trade places are seen too."""
        return self.sizes

    def _track(self, saved: torch.Tensor, t: torch.Tensor,
               rebuild: Callable | None) -> tuple | _Entry | _View:
        """Pack a site with its row in the step's table, and its storage counted in the
        residency ledger."""
        site = len(self.sizes)
        if self.device is None:
            self._first_pack(t.device)
        if self.timer is not None:  # first: the row's making is the hook's time too
            self.timer.packed(site)
        stats = SiteStats(site, tuple(t.shape), _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype),
                          t.numel() * t.element_size(), "keep", packed_at=self.clock)
        self.clock += 1
        self.sizes.append(stats.nbytes)
        self.stats.sites.append(stats)
        if self.offloader.modules is not None:
            stats.module = self.offloader.modules.current()
        if self.blocks is not None and self.blocks.observing:  # a measured step
            self.blocks.saw(t)
            # what placing it runs (a count of zeros, a copy) is not the observed blocks'
            packed = self.blocks.outside(self._place, saved, t, stats, rebuild)
        else:
            packed = self._place(saved, t, stats, rebuild)
        if self.timer is not None:
            self.timer.placed()
        return packed

    def _place(self, saved: torch.Tensor, t: torch.Tensor, stats: SiteStats,
               rebuild: Callable | None) -> tuple | _Entry | _View:
        """Keep, share or move a tracked site, as the plan says."""
        site = stats.site
        stats.reason = skip_reason(t, self.min_bytes)
        if stats.reason:
            if stats.reason in ("small", "view of larger storage"):
                self.residency.hold(t.untyped_storage())
                self._same_bytes(t, stats)
            return saved, saved._version, site
        storage = t.untyped_storage()
        entry = self._by_storage.get(storage._cdata)
        if (entry is not None and entry.held() is storage and entry.probe.dtype is t.dtype
                and entry.owner() is counter_owner(t) and entry.version == t._version):
            stats.decision, stats.reason = "dedup", f"shares storage with site {entry.id}"
            self.shared.add(entry.id)
            return _View(entry, stats.shape, t.stride(), t.storage_offset(), t._version,
                         rebuild)
        held = self.residency.hold(storage)
        codec = self.offloader.codec_for(site, stats)
        if codec != "keep" and not self._host_takes(storage.nbytes()):
            codec, stats.reason = "keep", HOST_BUDGET
        if codec == "keep":
            stats.reason = stats.reason or "plan"
            if self._same_bytes(t, stats):
                return saved, saved._version, site
            if self.measure:
                self._counts.append((stats, t.numel(), self.transfer.nonzero(t)))
            return saved, saved._version, site
        entry = _Entry(site, t, held, rebuild, stats)
        stats.decision = codec
        self._offload(entry, t, storage, storage.nbytes(), get_codec(codec))
        stats.nbytes = entry.nbytes
        return entry

    def _host_takes(self, nbytes: int) -> bool:
        """Whether the host budget has room for a payload of at most ``nbytes`` (taken)."""
        if self.host_left is None:
            return True
        if nbytes > self.host_left:
            return False
        self.host_left -= nbytes
        return True

    def _same_bytes(self, t: torch.Tensor, stats: SiteStats) -> bool:
        """Whether an earlier kept site of the step holds ``t``'s bytes (the same tensor
        saved twice: a log-softmax by itself and by the loss), at the same version; then the
        row shares that site's, and the step counts the bytes once."""
        key = (t.data_ptr(), stats.nbytes, t.dtype, id(counter_owner(t)), t._version)
        storage, first = t.untyped_storage(), self._kept.get(key)
        if first is None or first[1]() is not storage:  # a freed site's address, taken again
            self._kept[key] = stats.site, weakref.ref(storage)
            return False
        stats.decision, stats.reason = "dedup", f"shares storage with site {first[0]}"
        self.same_bytes.add(stats.site)
        return True

    def _move(self, site: int, t: torch.Tensor, storage: torch.UntypedStorage,
              move: Move) -> _Entry:
        """Move a site as the checked plan moved it, without a row or residency: the step
        only sums it (``StepStats.untracked_moved_*``)."""
        self.sizes.append(t.nbytes)
        if self.device is None:
            self._first_pack(t.device)
        entry = _Entry(site, t, weakref.ref(storage) if move.shared else None, None, None)
        self._offload(entry, t, storage, move.nbytes, move.codec)
        stats = self.stats
        if entry.kept is None:
            stats.untracked_moved_tensors += 1
            stats.untracked_moved_bytes += entry.nbytes
            stats.untracked_stored_bytes += entry.payload.nbytes
        else:  # the offload failed: kept
            stats.untracked_tensors += 1
            stats.untracked_bytes += entry.nbytes
        return entry

    def _offload(self, entry: _Entry, t: torch.Tensor, storage: torch.UntypedStorage,
                 nbytes: int, codec: Codec) -> None:
        """Start moving ``t``'s whole storage (``nbytes``): every view of it comes back
        exactly. A tensor that is all of its storage, in order (most activations), moves as
        it is, and a raw copy of it comes back in its shape and strides; any other view moves
        its storage as a 1-D tensor, viewed again at unpack.

        A lossy codec compresses a view of a larger storage on its own elements instead
        (q, k and v split from one projection): each block's scale is then its own values',
        not those of the storage's other parts, and the view comes back contiguous. Later
        views of that storage move on their own too."""
        lossy = codec.name in LOSSY_CODECS
        own = lossy and t.nbytes < nbytes
        entry.nbytes = t.nbytes if own else nbytes
        data = t.detach()  # shares t's version counter: made the entry's probe once copied
        whole = codec.exact_size and t.nbytes == nbytes and t.is_contiguous()  # so offset 0
        if own:  # its elements in order: what the encoder reads anyway
            flat = data.contiguous()
        else:
            flat = data if whole else data.as_strided((nbytes // t.element_size(),), (1,), 0)
        if lossy and self.probe is not None and self.probe.lossy:
            self._originals[entry.id] = flat.detach()  # kept alive for the guard's probe step
        seed = seed_of(self.seed, entry.id) if lossy else 0
        self.transfer.offload(entry, flat, codec, entry.id, self.measure,
                              self._record if entry.stats is not None else None, seed)
        # A view moved on its own elements comes back as decoded: contiguous, in its shape.
        if not own and (not whole or entry.header is not None):
            entry.shape, entry.stride, entry.offset = t.shape, t.stride(), t.storage_offset()
        # A failed offload keeps ``flat``, which may be ``data``: then it is the probe as it is.
        entry.probe = data if entry.kept is data else version_probe(data)
        self._entries[entry.id] = weakref.ref(entry)
        if entry.held is not None and not own:
            self._by_storage[storage._cdata] = entry

    def _first_pack(self, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise unsupported_device(device)
        self.device = device
        self.stats.device = device.type
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self.measure and (self.timer is None or self.timer.clock.device != device):
            self.timer = StepTimer(device)

    @property
    def timed_plainly(self) -> bool:
        """The step the engine times without its hooks (``Learning._plain_step``): dormant,
        but for ``plain_hooks`` and its timer."""
        return self.dormant and self.timer is not None

    def end_forward(self) -> None:
        if self.dormant:
            if self.timed_plainly:
                self.timer.forward_done()
            return
        self._by_storage.clear()
        self._kept.clear()
        self.transfer.poll()
        if self.prefetch_bytes is None:  # nothing measured: two of its largest moved (but one)
            self.prefetch_bytes = resident_window(
                [entry.nbytes for entry in self.live_entries() if entry.kept is None])
        if self.checked is not None:
            self.stats.resized = self.sizes != self.checked.counted
        self.stats.forward_wait_s += self.transfer.take_waited()
        if self.timer is not None:
            self.timer.forward_done()

    # backward ---------------------------------------------------------------------------
    def unpack(self, saved: tuple | _Entry | _View) -> torch.Tensor:
        if _dynamo_callback() is not None:  # in a compiled module's eager fallback
            return torch.compiler.disable(self.unpack)(saved)
        if not self.backward_begun:
            self._begin_backward()
        if type(saved) is tuple:  # kept: the tensor, its version when saved, its site
            t, version, site = saved
            if t._version != version:
                version_error(t._version, version, t.dtype, tuple(t.shape))
            if self.timer is not None and site >= 0:
                with self._lock:
                    self._time_unpack(site)
            return t
        if type(saved) is _Entry:
            entry, size, stride, offset, version, rebuild = (
                saved, saved.shape, saved.stride, saved.offset, saved.version, saved.rebuild)
        else:
            entry, size, stride, offset, version, rebuild = saved
        if entry.probe._version != version:
            version_error(entry.probe._version, version, entry.probe.dtype,
                          size if size is not None else entry.as_left().shape)
        start = time.perf_counter()
        self._lock.acquire()  # faster than ``with``, on every unpack
        try:
            if self.timer is not None:
                self._time_unpack(entry.id)
            base, ready = self._device_copy(entry)
            if self.prefetch_bytes:
                self._prefetch_after(entry)
            waited = time.perf_counter() - start
            if entry.stats is None:
                self.stats.untracked_wait_s += waited
            else:
                entry.stats.wait_s += waited
        finally:
            self._lock.release()
        if ready is not None:  # every unpack: backward may run this op on another stream
            stream = current_stream(entry.source.index)  # a device made once, at the pack
            stream.wait_event(ready)
            base.record_stream(stream)
        if stride is not None and (offset or base.shape != size or base.stride() != stride):
            base = base.as_strided(size, stride, offset)
        return base if rebuild is None else rebuild(base)

    def plain_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks of a step that keeps every tensor as autograd would, but for a callback at
        its backward's end, which reads the allocator's peak (``backward_peak``)."""
        return torch.autograd.graph.saved_tensors_hooks(_same, self.unpack_plain)

    def unpack_plain(self, t: torch.Tensor) -> torch.Tensor:
        if not self.backward_begun:
            self._begin_backward()
        return t

    def _begin_backward(self) -> None:
        """At backward's first unpack: have autograd, when this backward ends, read the
        allocator's peak (CUDA: ``backward_peak``) and stamp the end for a timed step."""
        self.backward_begun = True
        self.saved_before_backward = len(self.sizes)
        device, timer = self.device, self.timer
        if timer is not None:
            timer.backward_begin()
        if device is None or (device.type != "cuda" and timer is None):
            return

        def ended() -> None:
            if device.type == "cuda":
                self.backward_peak = peak_allocated_bytes(device)
            if timer is not None:
                timer.backward_done()

        with contextlib.suppress(RuntimeError):  # an unpack outside backward: read at close
            torch.autograd.Variable._execution_engine.queue_callback(ended)

    def _time_unpack(self, site: int) -> None:
        if site not in self._unpacked:
            self._unpacked.add(site)
            self.timer.unpacked(site)
            if self.blocks is not None:
                self.blocks.backward_started()

    def _device_copy(self, entry: _Entry) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The entry's tensor on its device: prefetched, still held from an earlier unpack,
        or restored now."""
        if entry.prefetched is not None:
            base, entry.prefetched = entry.prefetched, None
            self._inflight -= entry.nbytes
        else:
            base = entry.restored() if entry.restored is not None else None
            if base is None:
                base, entry.restored_ready = self._restore(entry)
                entry.restored = self._copy_ref(entry, base)
        if not entry.consumed:
            entry.consumed = True
            if entry.stats is not None:
                self._first_unpack(entry, base)
        return base, entry.restored_ready

    def _copy_ref(self, entry: _Entry, copy: torch.Tensor) -> weakref.ref:
        """A weak reference to a restored copy, which gives it back while it lives; where the
        step tracks the entry, the residency ledger's, counting it."""
        if entry.stats is None:
            return weakref.ref(copy)
        return self.residency.restored(copy, entry.nbytes)

    def _first_unpack(self, entry: _Entry, base: torch.Tensor) -> None:
        """Record a tracked entry's first unpack."""
        entry.stats.unpacked_at = self.clock
        self.clock += 1
        self.unpack_order.append(entry.id)
        self._count_region(entry.nbytes)
        original = self._originals.pop(entry.id, None) if self._originals else None
        if original is not None:
            entry.stats.error = relative_error(original, base).item()
            if self.probe.restored is not None:
                self.probe.restored(entry.id, original, base)
        elif entry.held() is not None and self.probe is None:
            # Still alive although copied out: something else holds it (the training loop,
            # the user's code), so moving it freed nothing. Later steps keep it.
            self.offloader.held_elsewhere.add(entry.id)

    def _restore(self, entry: _Entry) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Restore now; short of memory, give back what was prefetched and try once more."""
        try:
            out = self.transfer.restore(entry)
        except Exception:  # noqa: BLE001 - retried below, and reported if it fails again
            self._drop_prefetched()
            try:
                out = self.transfer.restore(entry)
            except Exception as err:
                raise RuntimeError(
                    f"cswap could not bring back saved tensor {entry.id} "
                    f"({fmt_bytes(entry.nbytes)}) for backward: {type(err).__name__}: {err}. "
                    "Its payload is intact in host memory; lower CSwapConfig.prefetch_bytes or "
                    "the batch size to leave room."
                ) from err
        return out

    def _drop_prefetched(self) -> None:
        for ref in self._entries.values():
            entry = ref()
            if entry is not None:
                entry.prefetched = None
        self._inflight = 0

    def _prefetch_after(self, entry: _Entry) -> None:
        """Bring back the sites expected next, within the bytes-in-flight budget."""
        if self._order is None:
            self._order = self._prev_order or sorted(self._entries, reverse=True)
            self._position = {site: i for i, site in enumerate(self._order)}
        order, entries, budget = self._order, self._entries, self.prefetch_bytes
        cursor, inflight = self._cursor, self._inflight
        position = self._position.get(entry.id)
        if position is not None and position >= cursor:
            cursor = position + 1
        while cursor < len(order):
            ref = entries.get(order[cursor])
            nxt = ref() if ref is not None else None
            if nxt is not None and not nxt.consumed and nxt.prefetched is None:
                if inflight and inflight + nxt.nbytes > budget:
                    break
                try:
                    nxt.prefetched, nxt.restored_ready = self.transfer.restore(nxt)
                except Exception:  # noqa: BLE001 - restored on demand instead, or reported then
                    break
                nxt.restored = self._copy_ref(nxt, nxt.prefetched)
                if nxt.stats is not None:
                    nxt.stats.prefetched = True
                inflight += nxt.nbytes
            cursor += 1
        self._cursor, self._inflight = cursor, inflight

    def _count_region(self, nbytes: int) -> None:
        """Count a moved storage's first unpack towards the compiled region asking for it, if
        one does: a region's backward asks for everything it saved as it starts, one unpack
        after another (pytorch/pytorch#148222)."""
        node = torch._C._current_autograd_node()
        if type(node).__name__ != "CompiledFunctionBackward":
            return
        if self._region is None or self._region() is not node:
            self._region, self._region_bytes = weakref.ref(node), 0
        self._region_bytes += nbytes
        self.region_peak = max(self.region_peak, self._region_bytes)

    def moved_bytes(self) -> int:
        """Bytes of the tracked storages moved off the device."""
        return sum(s.nbytes for s in self.stats.sites if s.decision not in ("keep", "dedup"))

    def restored_all_at_once(self) -> bool:
        """Whether one compiled region's backward asked for at least half the bytes moved off
        the device (of 4 storages or more) at once: then offloading lowered little at the
        peak. Counted by region, not by what backward held at once: a loss outside the region
        (cross-entropy's log-softmax) gives its tensors back before the region asks for its
        own, and one compiled per block asks for a block's at a time."""
        moved = sum(s.decision not in ("keep", "dedup") for s in self.stats.sites)
        return moved >= 4 and self.region_peak >= 0.5 * self.moved_bytes()

    def live_entries(self) -> list[_Entry]:
        """The step's entries autograd still holds."""
        return [entry for entry in (ref() for ref in list(self._entries.values()))
                if entry is not None]

    # statistics -------------------------------------------------------------------------
    def _record(self, entry: _Entry) -> None:
        """A tracked site's offload is done (in the compression thread for compressed ones)."""
        stats = entry.stats
        if entry.kept is not None:
            stats.decision, stats.reason = "keep", "offload failed"
            return
        stats.stored_bytes, stats.offload_s = entry.stored_bytes, entry.seconds
        if entry.codec != stats.decision:
            stats.reason = f"{stats.decision} out of device memory"
            stats.decision = entry.codec
        if entry.nonzero is not None:
            # the bytes moved (the whole storage of a view), which the zeros were counted in
            numel = (entry.header.numel if entry.header is not None
                     else entry.nbytes // entry.payload.element_size())
            self._counts.append((stats, numel, entry.nonzero))

    def close(self) -> None:
        """Turn the zero counts of finished offloads into sparsities (call after a drain),
        and read the allocator's peak."""
        counts, self._counts = self._counts, []
        for stats, numel, nonzero in counts:  # ints, or counts copied to host memory
            stats.sparsity = 1.0 - int(nonzero) / numel if numel else 0.0
        if self.device is not None and self.device.type == "cuda":
            self.stats.peak_allocated_bytes = (
                self.backward_peak if self.backward_peak is not None
                else peak_allocated_bytes(self.device))


# Dynamo compiles every Python frame that starts while its frame callback is set, as it is
# in the eager parts of a module compiled with ``module.compile()``: there it would compile
# the hooks (and fail). Their own frames are marked never to compile (``hide_from_dynamo``),
# and their work runs with the callback off; elsewhere the check costs ~40 ns.
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # a torch without Dynamo
    def _dynamo_callback() -> None:
        return None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def hide_from_dynamo() -> None:
    """Mark the hooks' frames never to compile, once Dynamo is loaded (importing it just for
    this would cost every user a second)."""
    global _hidden
    if _hidden or "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo.eval_frame import skip_code

    skip_code(Step.pack.__code__)
    skip_code(Step._count.__code__)
    skip_code(of_a_leaf.__code__)  # which _count calls
    skip_code(Step.unpack.__code__)
    skip_code(Step.unpack_plain.__code__)
    skip_code(_same.__code__)
    _hidden = True


_hidden = False
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``, made once per dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name

