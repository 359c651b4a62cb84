"""The offload session: autograd's saved-tensor hooks, sites, filters, de-duplication, prefetch.

A *step* is one forward under ``with offloader:`` and the backward that consumes it. The k-th
tensor autograd saves in a step is *site* k; steps repeat, so site ids are stable and what was
learned about site k (its sparsity, when backward needed it) plans the next step.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from typing_extensions import Self

from .advisor import Advisor, Plan, resolve_budget
from .codecs import DTYPES, get_codec, nonzero_count
from .codecs.cuda import enable_cuda_codecs_if_requested
from .codecs.lossy import LOSSY_DTYPES as _LOSSY_TORCH_DTYPES
from .codecs.lossy import relative_error
from .config import LOSSY_CODECS, CSwapConfig
from .module_names import ModuleTracker
from .predictor import CodecTimeModel, calibrate
from .profiler import Link, Profiler, StepTimer, measure_link, signature
from .stats import SiteStats, StepStats
from .transfer import Stored, Transfer

# A view whose storage is this many times larger than itself is kept: offloading it would
# move (and free) nothing but the whole storage.
MAX_STORAGE_TO_VIEW_RATIO = 4
_SUPPORTED_DTYPES = frozenset(DTYPES)
LOSSY_DTYPES = tuple(str(d).removeprefix("torch.") for d in _LOSSY_TORCH_DTYPES)


def unwrap(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
    """The plain tensor that holds ``t``'s memory, and how to wrap it again: a DTensor (tensor
    or sequence parallelism) moves as its local shard; any other tensor as itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported where DTensors exist
    if dtensor is None or type(t) is not dtensor.DTensor or _of_a_leaf(t):
        return t, None
    return t._local_tensor, partial(dtensor.DTensor.from_local, device_mesh=t.device_mesh,
                                    placements=t.placements, shape=t.shape, stride=t.stride())


def _of_a_leaf(t: torch.Tensor) -> bool:
    base = t if t._base is None else t._base
    return base.is_leaf and base.requires_grad


def skip_reason(t: torch.Tensor, min_bytes: int) -> str:
    """Why ``t`` must stay where it is, or ``""`` if it can be offloaded."""
    if isinstance(t, torch.nn.Parameter):
        return "parameter"
    if t.layout != torch.strided or t.is_nested:
        return "sparse/nested"
    if t.is_quantized or t.is_complex() or t.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {str(t.dtype).removeprefix('torch.')}"
    if t.device.type not in ("cuda", "cpu"):
        return f"device {t.device.type}"
    if _of_a_leaf(t):  # held outside autograd: moving it frees nothing
        return "leaf" if t._base is None else "view of a leaf"
    if type(t) is not torch.Tensor:
        return f"subclass {type(t).__name__}"
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
        "counted",
        "id",
        "nbytes",
        "ready",
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
        self.ready: torch.cuda.Event | None = None  # recorded once the device copy is complete
        self.consumed = False  # unpacked at least once
        self.counted = False  # prefetched: its bytes count as in flight until it is unpacked

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
    site: int


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
    rebuild: Callable[[torch.Tensor], torch.Tensor] | None  # a DTensor from its local tensor


class _Step:
    """Packs and unpacks of one forward and its backward."""

    def __init__(self, offloader: Offloader, index: int, order: list[int] | None,
                 profiling: bool) -> None:
        self.offloader = offloader
        self.stats = StepStats(index)
        self.failed = False
        self.profiling = profiling  # time the windows and measure kept sites' sparsity
        self.timer: StepTimer | None = None
        self.device: torch.device | None = None
        self.base_bytes = 0  # device memory in use when forward saved its first tensor
        self._unpacked: set[int] = set()
        # Autograd runs backward on one thread per device: a model split over several GPUs in
        # one process unpacks from several threads at once.
        self._lock = threading.Lock()
        self.probe: str | None = None  # an accuracy-guard probe step (Offloader.probe_next_step)
        self._originals: dict[int, torch.Tensor] = {}
        self._by_storage: dict[int, tuple[StorageWeakRef, int, _Entry]] = {}
        self._entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
        self._prev_order = order  # unpack order learned on an earlier step
        self._order: list[int] | None = None
        self._position: dict[int, int] = {}
        self._cursor = 0
        self._inflight = 0
        self.unpack_order: list[int] = []
        self._counts: list[tuple[SiteStats, int, torch.Tensor]] = []
        self.clock = 0  # ticks once per pack and once per first unpack of a site

    def tick(self) -> int:
        self.clock += 1
        return self.clock - 1

    # forward ----------------------------------------------------------------------------
    def pack(self, saved: torch.Tensor) -> _Kept | _Saved:
        t, rebuild = unwrap(saved)
        site = len(self.stats.sites)
        nbytes = t.numel() * t.element_size()
        stats = SiteStats(site, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes, "keep")
        stats.packed_at = self.tick()
        self.stats.sites.append(stats)
        if self.offloader.modules is not None:
            stats.module = self.offloader.modules.current()
        if self.device is None:
            self._first_pack(t.device)
        if self.timer is not None:
            self.timer.packed(site)
        stats.reason = skip_reason(t, self.offloader.config.min_bytes)
        if stats.reason:
            return _Kept(saved, saved._version, site)
        storage = t.untyped_storage()
        hit = self._by_storage.get(storage._cdata)
        if hit is not None and hit[1] == t._version and hit[2].stats.dtype == stats.dtype:
            stats.decision, stats.reason = "dedup", f"shares storage with site {hit[2].id}"
            return self._saved(hit[2], t, rebuild)
        codec = self.offloader.codec_for(site, stats)
        if codec == "keep":
            stats.reason = "plan"
            if self.profiling:
                self._counts.append((stats, t.numel(), nonzero_count(t)))
            return _Kept(saved, saved._version, site)
        stats.decision = codec
        elem = t.element_size()
        flat = t.detach().as_strided((storage.nbytes() // elem,), (1,), 0)
        stats.nbytes = flat.numel() * elem
        if self.probe == "measure errors" and codec in LOSSY_CODECS:
            self._originals[site] = flat  # kept alive for the guard's probe step only
        future = self.offloader.transfer.offload(flat, get_codec(codec), site)
        future.add_done_callback(lambda f: self._record(stats, f))
        entry = _Entry(stats, future)
        self._entries[entry.id] = entry
        self.offloader._live.add(entry)
        # Holding a weak reference pins the storage's address, so it cannot be mistaken for
        # a new storage that happens to reuse it later in this step.
        self._by_storage[storage._cdata] = (StorageWeakRef(storage), t._version, entry)
        return self._saved(entry, t, rebuild)

    def _first_pack(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.base_bytes = torch.cuda.memory_allocated(device)
        if self.profiling:
            self.timer = StepTimer(device)

    @staticmethod
    def _saved(entry: _Entry, t: torch.Tensor, rebuild: Callable | None) -> _Saved:
        size, stride, offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        return _Saved(entry, size, stride, offset, version_probe(t), t._version, rebuild)

    def end_forward(self) -> None:
        self._by_storage.clear()
        if self.timer is not None:
            self.timer.forward_done()

    # backward ---------------------------------------------------------------------------
    def unpack(self, saved: _Kept | _Saved) -> torch.Tensor:
        if isinstance(saved, _Kept):
            t = saved.tensor
            check_version(t._version, saved.version, t.dtype, tuple(t.shape))
            with self._lock:
                self._time_unpack(saved.site)
            return saved.tensor
        check_version(saved.probe._version, saved.version, saved.probe.dtype, saved.size)
        entry = saved.entry
        start = time.perf_counter()
        with self._lock:
            self._time_unpack(entry.id)
            restoring = self._restore_future(entry)
        base, ready = restoring.result()  # outside the lock: other devices' threads go on
        with self._lock:
            self._hand_over(entry, restoring, base, ready)
            entry.stats.wait_s += time.perf_counter() - start
            self._prefetch_after(entry)
        view = base.as_strided(saved.size, saved.stride, saved.offset)
        return view if saved.rebuild is None else saved.rebuild(view)

    def _time_unpack(self, site: int) -> None:
        if self.timer is not None and site not in self._unpacked:
            self._unpacked.add(site)
            self.timer.unpacked(site)

    def _restore_future(
        self, entry: _Entry
    ) -> Future[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """The entry's device copy: the one autograd still holds, or a restore (prefetched
        earlier, or started now)."""
        base = entry.restored() if entry.restored is not None else None
        if base is not None:
            held: Future = Future()
            held.set_result((base, entry.ready))
            return held
        if entry.restoring is None:
            entry.restoring = self.offloader.transfer.restore(entry.stored)
        if entry.counted:
            entry.counted = False
            self._inflight -= entry.nbytes
        return entry.restoring

    def _hand_over(self, entry: _Entry, restoring: Future, base: torch.Tensor,
                   ready: torch.cuda.Event | None) -> None:
        """Keep the device copy ``restoring`` gave for later unpacks (unless another thread
        already did), order this thread's stream after it, and note the first unpack."""
        if entry.restoring is restoring:
            entry.restoring = None
            entry.restored, entry.ready = weakref.ref(base), ready
        if ready is not None:  # every unpack: backward may run this op on another stream
            stream = torch.cuda.current_stream(base.device)
            stream.wait_event(ready)
            base.record_stream(stream)
        original = self._originals.pop(entry.id, None)
        if original is not None:
            entry.stats.error = relative_error(original, base).item()
        if not entry.consumed:
            entry.consumed = True
            entry.stats.unpacked_at = self.tick()
            self.unpack_order.append(entry.id)

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
                nxt.stats.prefetched = nxt.counted = True
                self._inflight += nxt.nbytes
            self._cursor += 1

    # statistics -------------------------------------------------------------------------
    def _record(self, stats: SiteStats, future: Future[Stored | torch.Tensor]) -> None:
        """Runs in the offload worker when a site's job ends (the entry may be gone by then)."""
        stored = future.result()
        if isinstance(stored, Stored):
            stats.stored_bytes, stats.offload_s = stored.nbytes, stored.seconds
            if stored.packed.header.codec != stats.decision:
                stats.reason = f"{stats.decision} out of device memory"
                stats.decision = stored.packed.header.codec
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
    (per-site sparsity, the order backward needs tensors in) plans the next. With
    ``plan="auto"`` the first ``profile_steps`` steps swap raw and are measured, then the
    advisor plans every site; call :meth:`new_epoch` at each epoch start to re-measure
    (sparsity drifts during training)::

        offloader = Offloader(CSwapConfig())
        for batch in loader:
            with offloader:
                loss = model(batch)
            loss.backward()
        print(offloader.last_step().table())
    """

    def __init__(self, config: CSwapConfig | None = None, *, link: Link | None = None,
                 time_model: CodecTimeModel | None = None) -> None:
        """``link`` and ``time_model`` replace the measured bandwidths and the calibrated codec
        times the advisor uses (e.g. to plan for a link other than the one measured)."""
        enable_cuda_codecs_if_requested()
        self.config = config if config is not None else CSwapConfig()
        self.link = link
        self.time_model = time_model
        self.transfer = Transfer(pin_memory=self.config.pin_memory)
        self.plan: Plan | None = None  # the advisor's, for plan="auto"
        self.profiler = Profiler()
        self._profiling_left = self.config.profile_steps
        self._order: list[int] | None = None  # backward's order of sites, learned
        self.modules: ModuleTracker | None = None  # names sites by module, after watch()
        self.reverted: set[int] = set()  # lossy sites the accuracy guard moved back
        self._next_probe: str | None = None  # "lossless" or "measure errors", for one step
        self._live: weakref.WeakSet[_Entry] = weakref.WeakSet()
        self._step: _Step | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._steps = 0
        self._closed = False

    def __enter__(self) -> Self:
        if self._hooks is not None:
            raise RuntimeError("this Offloader is already active; enter it once per forward pass")
        if self._closed:
            raise RuntimeError("this Offloader was closed; create a new one (or call "
                               "cswap_lightning.offload(config) again for the shared one)")
        self._close_step()
        profiling = self.config.plan == "auto" and self._profiling_left > 0
        self._step = _Step(self, self._steps, self._order, profiling)
        self._step.probe, self._next_probe = self._next_probe, None
        self._steps += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._step.pack, self._step.unpack)
        self._hooks.__enter__()
        if self.modules is not None:
            self.modules.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._hooks is not None and self._step is not None
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        if self.modules is not None:
            self.modules.__exit__(exc_type, exc, tb)
        self._step.end_forward()
        self._step.failed = exc_type is not None

    def watch(self, model: torch.nn.Module) -> Self:
        """Name each site by the module of ``model`` that saved it, for ``lossy_exclude``;
        without patterns there, nothing is watched. The global module hooks this takes slow
        every module call in the process (1.2x on a small model's forward on the CPU) until
        :meth:`close`."""
        if self.modules is not None:
            self.modules.close()
            self.modules = None
        if self.config.lossy_exclude:
            self.modules = ModuleTracker(model)
        return self

    def codec_for(self, site: int, stats: SiteStats) -> str:
        """The plan's decision for a site: a codec name or ``"keep"``."""
        if self.config.plan != "auto":
            codec = self.config.plan
        elif self.plan is None:
            codec = "raw"  # not profiled yet: swap uncompressed
        else:
            codec = self.plan.codec(site, stats.shape, stats.dtype)
        if codec in LOSSY_CODECS and (self._step.probe == "lossless"
                                      or not self.lossy_allowed(site, stats.dtype, stats.module)):
            return "raw"
        return codec

    def probe_next_step(self, kind: str) -> Self:
        """Make the next step a guard probe: ``"lossless"`` swaps lossy sites raw instead;
        ``"measure errors"`` keeps lossy sites' originals to measure their round-trip error."""
        if kind not in ("lossless", "measure errors"):
            raise ValueError(f"probe kind must be 'lossless' or 'measure errors', got {kind!r}")
        self._next_probe = kind
        return self

    def lossy_allowed(self, site: int, dtype: str, module: str) -> bool:
        """Floating tensors only, outside excluded modules, unless the guard moved them back."""
        return (dtype in LOSSY_DTYPES and site not in self.reverted
                and not any(fnmatch(module, p) for p in self.config.lossy_exclude))

    def new_epoch(self) -> None:
        """Re-measure the next ``profile_steps`` steps and plan again (``plan="auto"``)."""
        self.profiler = Profiler()
        self._profiling_left = self.config.profile_steps

    def state_dict(self) -> dict:
        """What was learned (plan, backward order), JSON-able, for checkpoints."""
        return {
            "version": 1,
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "order": self._order,
            "reverted": sorted(self.reverted),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; the plan applies from the next step."""
        if state.get("version") != 1:
            raise ValueError(f"unknown cswap state version {state.get('version')!r}; expected 1")
        self.plan = Plan.from_dict(state["plan"]) if state["plan"] is not None else None
        self._order = state["order"]
        self.reverted = set(state.get("reverted", ()))
        if self.plan is not None:
            self._profiling_left = 0

    def last_step(self, device: bool = True) -> StepStats:
        """Statistics of the most recent step, once its offload work has finished.

        ``device=False`` waits for the host side only, never synchronising with the device
        (for trainers that log every step): sizes, decisions and waits are final, but the
        sparsity of a step that was not profiled may still be ``None``.
        """
        if self._step is None:
            raise RuntimeError("no step has run yet: enter the Offloader around a forward pass")
        self.transfer.drain(device=device)
        if device:
            self._step.close()
        return self._step.stats

    def live_host_bytes(self) -> int:
        """Host bytes held right now for tensors autograd still references."""
        return sum(entry.host_bytes() for entry in list(self._live))

    def live_entries(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Stop the worker threads (the Offloader cannot be used afterwards)."""
        self._closed = True
        self.transfer.close()
        if self.modules is not None:
            self.modules.close()
        if _SHARED.get(self.config) is self:
            del _SHARED[self.config]

    def _close_step(self) -> None:
        step = self._step
        if step is None:
            return
        # Only a profiled step's figures (sparsity, windows) need its offload work done; waiting
        # for that otherwise would hold up the forward about to start.
        if step.profiling:
            self.transfer.drain()
            step.close()
        if step.failed:
            return
        self._order = step.unpack_order or self._order
        self.transfer.step_closed(step.stats, step.device)  # plans the host arena from it
        if self.config.plan != "auto" or step.device is None:
            return
        if step.profiling:
            self.profiler.observe(step.stats, step.timer.windows() if step.timer else {})
            self._profiling_left -= 1
            if self._profiling_left == 0:
                self.plan = self._advise(step)
        elif self.plan is not None and signature(step.stats) != self.plan.signature:
            self.new_epoch()  # the sites changed (dynamic shapes): measure them and plan again

    def _advise(self, step: _Step) -> Plan:
        """The advisor's plan from what the profiler measured."""
        cfg, device = self.config, step.device
        link = self.link or measure_link(device)
        lossy = {"off": None, "auto": "int8"}.get(cfg.lossy, cfg.lossy)
        codecs = (cfg.compressor,) if lossy is None else (cfg.compressor, lossy)
        model = self.time_model or calibrate(device, codecs).model
        advisor = Advisor(cfg.compressor, link, model, lossy,
                          lambda p: self.lossy_allowed(p.site, p.dtype, p.module))
        return advisor.plan(self.profiler.profile(), step.base_bytes,
                            resolve_budget(cfg.budget, device))


_SHARED: dict[CSwapConfig, Offloader] = {}


def offload(config: CSwapConfig | None = None) -> Offloader:
    """The process's :class:`Offloader` for ``config`` (one per distinct config), so that
    ``with offload(config):`` written inside a training loop learns across steps."""
    config = config if config is not None else CSwapConfig()
    if config not in _SHARED:
        _SHARED[config] = Offloader(config)
    return _SHARED[config]
