"""Moving saved tensors off the device and back, from autograd's hooks themselves.

A payload whose size the tensor's shape tells (raw, lossy) is copied from the pack hook, as
the peers do: on CUDA the hook orders a side stream after the compute stream and queues the
copy into pinned memory there, so it returns at once; on the CPU it copies in place. A
compressed payload (zvc, rle) has a size only its data tells, and reading that size back
would make forward wait for the device: those tensors go to one compression thread, which
takes whatever has queued up in one batch. Forward never waits, except when the bytes it has
left in flight (copies not yet done, tensors not yet compressed) pass ``inflight_bytes``.

Restores are issued from the unpack hook on a second stream (prefetching is issuing them
early). Nothing is lost: a tensor that cannot be offloaded stays where it was.

Payloads of CUDA tensors go into the planned pinned host arena (``arena.py``) when it can
take them, and into pinned memory of their own otherwise.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..codecs import Codec, Header, Packed, get_codec, nonzero_count
from .arena import ArenaReport, HostMemory, Lease
from .stats import StepStats

OFFLOAD, RESTORE, COMPRESS = range(3)  # a device's side streams
_CPU = torch.device("cpu")  # compared with, as ``device.type`` makes a string (0.3 us)
_IDLE_EXIT_S = 5.0  # the compression thread ends after this long without work


class Stored:
    """A tensor's bytes in host memory, or on their way there: a raw payload is the tensor's
    own elements (``header`` None), a compressed one the codec's packed bytes.

    ``kept`` holds the tensor itself if it could not be offloaded; ``nonzero`` its count of
    non-zero elements (a 0-dim tensor, in host memory once ``done``) where it was measured.
    The engine's per-storage record subclasses it, so that one object serves both."""

    __slots__ = ("codec", "done", "header", "kept", "lease", "nonzero", "payload", "ready",
                 "seconds", "source")

    def __init__(self, source: torch.device) -> None:
        self.source = source  # the device it came from and goes back to
        self.codec = "raw"  # the codec that made the payload
        self.header: Header | None = None
        self.payload: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None
        self.nonzero: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None  # recorded after the device-to-host copy
        self.lease: Lease | None = None  # the arena region holding the payload, if any
        self.seconds = 0.0  # host time spent compressing and copying
        self.ready: threading.Event | None = None  # set by the compression thread

    @property
    def stored_bytes(self) -> int:
        """Bytes held in host memory for it."""
        return 0 if self.payload is None else self.payload.nbytes


@dataclass(slots=True)
class _Job:
    """A tensor queued for compression."""

    flat: torch.Tensor | None
    codec: Codec
    ready: torch.cuda.Event | None  # recorded on the compute stream after the tensor
    site: int | None
    stored: Stored
    on_done: Callable[[Stored], None] | None


class Transfer:
    """Offloads and restores with one CUDA stream per direction (and one for compression).

    ``arena``: payloads of CUDA tensors use the planned pinned arena (pinning is what it
    saves); ``"always"`` plans one for CPU payloads too (for testing the arena on the CPU).
    ``inflight_bytes``: forward waits once it has left more than this in flight."""

    arena_everywhere = False  # plan an arena for CPU payloads too

    def __init__(self, pin_memory: bool = True, arena: bool | str = True,
                 inflight_bytes: int = 1 << 30) -> None:
        self.pin_memory = pin_memory
        if arena == "always":
            self.arena_everywhere = True
        self.host_memory = HostMemory(pin=pin_memory) if arena else None
        self.inflight_limit = inflight_bytes
        self._inflight: deque[tuple[torch.cuda.Event | threading.Event, int]] = deque()
        self._inflight_bytes = 0
        self.waited_s = 0.0  # forward's waits at the in-flight bound, since the last take
        self._compressor = _Compressor(self._compress)
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}
        self._warned: set[str] = set()

    # forward ---------------------------------------------------------------------------
    def offload(self, stored: Stored, flat: torch.Tensor, codec: Codec, site: int | None = None,
                count_nonzero: bool = False,
                on_done: Callable[[Stored], None] | None = None) -> Stored:
        """Start moving ``flat`` (contiguous: the tensor's whole storage) off its device into
        ``stored``; never raises. It comes back in the same shape, or 1-D; a raw payload
        outside the arena in the same strides too.

        ``site`` lets the payload use its arena region; ``count_nonzero`` measures its
        sparsity (compressed payloads always do); ``on_done`` is called, in the compression
        thread, when a compressed payload is ready."""
        if self._inflight:
            self._bound(flat.nbytes)
        if not codec.exact_size:
            stored.ready = threading.Event()
            self._compressor.submit(_Job(flat, codec, self._record(flat), site, stored, on_done))
            self._track(stored.ready, flat.nbytes)
            return stored
        try:
            if flat.is_cuda:
                start = time.perf_counter()
                with self._on_stream(flat.device, OFFLOAD, after=torch.cuda.current_stream):
                    self._pack(stored, flat, codec, site, count_nonzero)
                stored.seconds = time.perf_counter() - start
                self._track(stored.done, flat.nbytes)
            else:
                self._pack(stored, flat, codec, site, count_nonzero)
        except Exception as err:  # noqa: BLE001 - any failure must keep the tensor intact
            self._failed(stored, flat, err)
        return stored

    def _pack(self, stored: Stored, flat: torch.Tensor, codec: Codec, site: int | None,
              count_nonzero: bool) -> None:
        """Encode ``flat`` (raw: as it is) and copy the payload to the host, on the current
        stream."""
        if count_nonzero:
            stored.nonzero = self._to_host(nonzero_count(flat), flat)
        payload = flat if codec.name == "raw" else self._encode(codec, stored, flat)
        cuda = flat.is_cuda
        if cuda or self.arena_everywhere:
            stored.payload, stored.lease = self._payload_to_host(payload, flat, site)
        else:
            stored.payload = self._to_host(payload, flat)
        if cuda:
            stored.done = torch.cuda.current_stream().record_event()
            if stored.lease is not None:
                stored.lease.last_use = stored.done
            # The caching allocator must not reuse the original's memory before this stream
            # has read it, whichever thread drops the last reference.
            flat.record_stream(torch.cuda.current_stream())

    def _compress(self, job: _Job) -> None:
        """A compressed offload, in the compression thread."""
        flat, stored, start = job.flat, job.stored, time.perf_counter()
        try:
            with self._on_stream(flat.device, COMPRESS):
                if job.ready is not None:
                    torch.cuda.current_stream().wait_event(job.ready)
                self._pack(stored, flat, job.codec, job.site, count_nonzero=True)
            stored.seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - any failure must keep the tensor intact
            self._failed(stored, flat, err)
        job.flat = flat = None  # before anyone is told: the original may be freed now
        stored.ready.set()
        if job.on_done is not None:
            job.on_done(stored)

    def _bound(self, nbytes: int) -> None:
        """Let go of finished work; wait for the oldest while too much is in flight."""
        while self._inflight:
            marker, size = self._inflight[0]
            compressing = isinstance(marker, threading.Event)
            busy = not marker.is_set() if compressing else not marker.query()
            if busy and self._inflight_bytes + nbytes <= self.inflight_limit:
                return
            if busy:
                start = time.perf_counter()
                marker.wait() if compressing else marker.synchronize()
                self.waited_s += time.perf_counter() - start
            self._inflight.popleft()
            self._inflight_bytes -= size

    def _track(self, marker: torch.cuda.Event | threading.Event, nbytes: int) -> None:
        self._inflight.append((marker, nbytes))
        self._inflight_bytes += nbytes

    def _failed(self, stored: Stored, flat: torch.Tensor, err: Exception) -> None:
        stored.kept, stored.payload, stored.lease = flat, None, None
        self._warn_once(
            type(err).__name__,
            f"cswap: could not offload a saved tensor ({type(err).__name__}: {err}); "
            "it stays on its device. Further failures of this kind are not reported.",
        )

    def _encode(self, codec: Codec, stored: Stored, flat: torch.Tensor) -> torch.Tensor:
        """``codec``'s payload (its header into ``stored``), or ``flat`` itself, to go raw,
        where the codec's scratch does not fit on the device: near the memory limit is
        where offloading matters most."""
        try:
            packed = codec.encode(flat)
        except torch.OutOfMemoryError as err:
            self._warn_once(
                "encode oom",
                f"cswap: the {codec.name} codec ran out of device memory ({err}); such tensors "
                "are swapped uncompressed. Further cases are not reported.",
            )
            return flat
        stored.codec, stored.header = codec.name, packed.header
        return packed.payload

    def _payload_to_host(
        self, payload: torch.Tensor, source: torch.Tensor, site: int | None
    ) -> tuple[torch.Tensor, Lease | None]:
        """The payload copied into its site's arena region if it can have it, else to host
        memory of its own."""
        taken = None
        if site is not None and self.host_memory is not None:
            taken = self.host_memory.acquire(site, payload.nbytes, payload.dtype)
        if taken is None:
            return self._to_host(payload, source), None
        region, lease = taken
        if payload.is_cuda:
            for event in lease.wait_for:  # earlier holders' copies out of the region
                torch.cuda.current_stream().wait_event(event)
        region.copy_(payload.view(-1), non_blocking=True)
        return region, lease

    def _to_host(self, payload: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if not payload.is_cuda:  # memory of its own: a new payload, or a copy of the source
            shares = payload is source or (
                payload.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())
            return payload.clone() if shares else payload
        try:
            # in the payload's strides, which a raw payload comes back in (Step._offload)
            host = torch.empty_strided(payload.shape, payload.stride(), dtype=payload.dtype,
                                       pin_memory=self.pin_memory)
        except RuntimeError as err:
            self._warn_once(
                "pin",
                f"cswap: pinned host memory is exhausted ({err}); using pageable memory, "
                "whose copies are slower and synchronous.",
            )
            host = torch.empty_strided(payload.shape, payload.stride(), dtype=payload.dtype)
        host.copy_(payload, non_blocking=True)
        return host

    # backward --------------------------------------------------------------------------
    def restore(self, stored: Stored) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Bring a payload back (on CUDA: queued on the restore stream); the tensor (in the
        shape it left in, or 1-D) and the event after which it is complete."""
        if stored.ready is not None:
            stored.ready.wait()  # the compression thread is done with it
        if stored.kept is not None:  # the offload failed: the tensor never left
            return stored.kept, None
        device = stored.source
        if device == _CPU:
            # Memory of its own (not an arena region, which goes back when the payload
            # does) can be the tensor itself: on the CPU it is where the tensor lives.
            return self._decode(stored, stored.payload, owned=stored.lease is None), None
        with self._on_stream(device, RESTORE):
            stream = torch.cuda.current_stream()
            stream.wait_event(stored.done)
            payload = stored.payload.to(device, non_blocking=True)
            if stored.lease is not None:
                stored.lease.last_use = stream.record_event()
            out = self._decode(stored, payload, owned=True)
            return out, stream.record_event()

    def _decode(self, stored: Stored, payload: torch.Tensor, owned: bool) -> torch.Tensor:
        """The tensor from ``payload`` (``stored``'s payload, or a device copy of it): a raw
        one is the tensor, taken as it is if ``owned`` allows. Where a codec's scratch does
        not fit on the device, decoded on the host and copied over."""
        if stored.header is None:
            return payload if owned else payload.clone()
        codec = get_codec(stored.codec)
        try:
            return codec.decode(Packed(stored.header, payload))
        except torch.OutOfMemoryError as err:
            self._warn_once(
                "decode oom",
                f"cswap: the {codec.name} codec ran out of device memory ({err}); such tensors "
                "are decoded on the host instead (slower). Further cases are not reported.",
            )
            del payload
            return codec.decode(Packed(stored.header, stored.payload)).to(stored.source)

    # steps and lifetime ----------------------------------------------------------------
    def take_waited(self) -> float:
        """Seconds forward waited at the in-flight bound since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def drain(self, device: bool = True) -> None:
        """Wait until the work started so far is done on the host and, with ``device``, on
        the device."""
        self._compressor.drain()
        if not device:
            return
        for streams in list(self._streams.values()):
            for stream in streams:
                stream.synchronize()

    def step_closed(self, step: StepStats, device: torch.device | None = None,
                    plan: bool = True) -> None:
        """Plan the arena from a finished step on ``device`` (with ``plan``: a step that
        tracked every site it moved), in the background (after the compressions queued so
        far, whose sizes it needs)."""
        if self.host_memory is not None and (self.arena_everywhere or (
                device is not None and device.type == "cuda")):
            self._compressor.submit(partial(self.host_memory.step_closed, step, device, plan))

    def held_bytes(self) -> int:
        """Host memory kept between steps: the arena (once the work queued so far is done)."""
        if self.host_memory is None:
            return 0
        self._compressor.drain()
        return self.host_memory.held_bytes()

    def arena_report(self) -> ArenaReport | None:
        """Arena against lower bound and per-tensor bytes for the last closed step (None
        without an arena or before the first closed step)."""
        if self.host_memory is None:
            return None
        self._compressor.drain()
        return self.host_memory.report()

    def close(self) -> None:
        self._compressor.close()
        if self.host_memory is not None:
            self.host_memory.close()

    def _record(self, flat: torch.Tensor) -> torch.cuda.Event | None:
        if not flat.is_cuda:
            return None
        event = torch.cuda.current_stream(flat.device).record_event()
        flat.record_stream(self._stream(flat.device, COMPRESS))
        return event

    def _stream(self, device: torch.device, which: int) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return self._streams[device][which]

    @contextlib.contextmanager
    def _on_stream(self, device: torch.device, which: int, after: Callable | None = None):
        """Run the block on ``device``'s side stream ``which``, ordered after the stream
        ``after(device)`` gives (the compute stream) if given; nothing on the CPU."""
        if device == _CPU:
            yield
            return
        stream = self._stream(device, which)
        if after is not None:
            stream.wait_stream(after(device))
        # The device first, so that leaving the stream does not set the thread's own device
        # back with cudaSetDevice, which creates a context there (CUDA 12) in a process that
        # never used that GPU; torch.cuda.device's exit does not.
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


class _Compressor:
    """One thread running queued jobs in order, taking all that have queued up at once.

    It starts on the first job and ends after a few idle seconds, so an unused engine holds
    no thread; in a forked child it starts afresh (the parent's thread did not come over)."""

    def __init__(self, run: Callable[[_Job], None]) -> None:
        self._run_job = run
        self._reset()
        _COMPRESSORS.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[_Job | Callable[[], None]] = deque()
        self._taken: deque[_Job | Callable[[], None]] = deque()  # the batch being run
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, job: _Job | Callable[[], None]) -> None:
        """Queue a job for ``run``, or a call to make after the jobs queued so far."""
        with self._cond:
            self._jobs.append(job)
            self._start()
            self._cond.notify()

    def drain(self) -> None:
        """Wait until every job queued so far has run."""
        with self._cond:
            while self._jobs or self._taken:
                self._cond.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cswap-compress",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._cond.wait_for(lambda: self._jobs or self._closed, _IDLE_EXIT_S)
                if not self._jobs:
                    self._thread = None
                    return
                self._taken, self._jobs = self._jobs, deque()
            while self._taken:
                self._run(self._taken[0])
                with self._cond:  # done with it: no reference left here to its tensors
                    self._taken.popleft()
                    self._cond.notify_all()

    def _run(self, job: _Job | Callable[[], None]) -> None:
        try:
            self._run_job(job) if isinstance(job, _Job) else job()
        except Exception as err:  # noqa: BLE001 - the thread must go on
            warnings.warn(f"cswap: background work failed: {err}", RuntimeWarning,
                          stacklevel=1)

    def _after_fork(self) -> None:
        """In a forked child, where the parent's thread is gone and its lock may be held:
        the jobs it had not finished run again (a job only writes its own result)."""
        jobs = [*self._taken, *self._jobs]
        for job in jobs:
            if isinstance(job, _Job) and job.flat is None:  # packed, not yet announced
                job.stored.ready.set()
        jobs = [job for job in jobs if not isinstance(job, _Job) or job.flat is not None]
        self._reset()
        if jobs:
            self._jobs.extend(jobs)
            self._start()


_COMPRESSORS: weakref.WeakSet[_Compressor] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [c._after_fork() for c in list(_COMPRESSORS)])
