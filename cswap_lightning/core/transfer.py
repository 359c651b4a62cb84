"""Moving saved tensors off the device and back, from autograd's hooks themselves.

Every payload leaves from the pack hook, on the thread that runs forward, as the peers do,
and nothing there waits for the device. On CUDA the hook orders side streams after the
compute stream and queues the work there: a raw tensor is copied into pinned host memory on
the offload stream; an encoded one (zvc, rle, lossy) is encoded on the compress stream and
its payload copied on the offload stream. The original is released when the stream that
reads it is done with it (the caching allocator is told through ``record_stream``).

A zvc or rle payload's length follows from the data, and reading it back would make forward
wait for the device. So the encoder writes into a buffer of the codec's capacity, and the
copy takes as many bytes as the site's payload needed last time (the whole capacity the
first time) into a host slot of that capacity. Once the copy's event has passed (polled, at
later packs and unpacks), the host reads the payload's true length from its first bytes, in
host memory, copies the rest if the payload outgrew the copy, and drops the device buffer:
the payload is *settled*. A compressed swap holds its buffer (the payload's bound) instead of
the original, for as long as its shorter copy takes.

Forward waits only when the bytes it has left in flight pass ``inflight_bytes``, and then on
the oldest copy's event. Restores are issued from the unpack hook on a third stream
(prefetching is issuing them early). On the CPU the same steps run synchronously, into host
memory of their own. Nothing is lost: a tensor that cannot be offloaded stays where it was.

Payloads of CUDA tensors go into the planned pinned host arena (``arena.py``) when it can
take them, and into pinned memory of their own otherwise.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from ..codecs import Codec, Header, LossyCodec, Packed, get_codec, nonzero_count
from ..records import StepStats
from .arena import ArenaReport, HostMemory, Lease, stop_unpinner

OFFLOAD, RESTORE, COMPRESS = range(3)  # a device's side streams
# Each stream found current, by what torch names it with: (stream id, device index, type)
_CURRENT: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_CPU = torch.device("cpu")  # compared with, as ``device.type`` makes a string (0.3 us)
_PREAMBLE = 16  # bytes at a payload's start that tell its length
HEADROOM = 0.06  # more than last time's length copied at first: sparsity drifts a little


class Stored:
    """A tensor's bytes in host memory, or on their way there: a raw payload is the tensor's
    own elements (``header`` None), an encoded one the codec's packed bytes.

    ``kept`` holds the tensor itself if it could not be offloaded; ``nonzero`` its count of
    non-zero elements (an int, or a 0-dim tensor in host memory once ``done``) where it was
    measured. Until a compressed payload is settled, ``pending`` holds its device buffer and
    ``copied`` the bytes copied so far; ``length`` is the payload's length in bytes (None: all
    of ``payload``). The engine's per-storage record subclasses it, so that one object serves
    both."""

    __slots__ = ("codec", "copied", "done", "header", "kept", "lease", "length", "nonzero",
                 "on_done", "payload", "pending", "seconds", "site", "source")

    def __init__(self, source: torch.device) -> None:
        self.source = source  # the device it came from and goes back to
        self.codec = "raw"  # the codec that made the payload
        self.header: Header | None = None
        self.payload: torch.Tensor | None = None
        self.length: int | None = None
        self.kept: torch.Tensor | None = None
        self.nonzero: torch.Tensor | int | None = None
        self.done: torch.cuda.Event | None = None  # recorded after the device-to-host copy
        self.lease: Lease | None = None  # the arena region holding the payload, if any
        self.seconds = 0.0  # host time spent launching the encode and the copy
        self.pending: torch.Tensor | None = None
        self.copied = 0
        self.site: int | None = None
        self.on_done: Callable[[Stored], None] | None = None

    @property
    def stored_bytes(self) -> int:
        """Bytes of its payload in host memory (those that crossed the link); 0 until
        settled."""
        if self.payload is None or self.pending is not None:
            return 0
        return self.payload.nbytes if self.length is None else self.length

    def host_payload(self) -> torch.Tensor:
        """The payload in host memory, as long as it is."""
        return self.payload if self.length is None else self.payload[: self.length]


class Transfer:
    """Offloads and restores with one CUDA stream per direction, and one for encoding.

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
        # device copies not yet done: (event after the copy, bytes, its payload: settled once
        # the copy is done where compressed), oldest first
        self._inflight: deque[tuple[torch.cuda.Event, int, Stored]] = deque()
        self._inflight_bytes = 0
        # Backward's threads (one per device) restore while another may settle: one at a time.
        self._lock = threading.Lock()
        self.waited_s = 0.0  # forward's waits at the in-flight bound, since the last take
        self._expect: dict[int, int] = {}  # site -> its compressed payload's last length
        self._worker = _Worker()
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}
        self._marks: dict[tuple[int, int], torch.cuda.Event] = {}
        self._warned: set[str] = set()

    # forward ---------------------------------------------------------------------------
    def offload(self, stored: Stored, flat: torch.Tensor, codec: Codec, site: int | None = None,
                count_nonzero: bool = False,
                on_done: Callable[[Stored], None] | None = None, seed: int = 0) -> Stored:
        """Start moving ``flat`` (contiguous: the tensor's whole storage, or a view's own
        elements for a lossy codec) off its device into ``stored``; never raises. A raw
        payload comes back in its shape and strides, an encoded one as decoded.

        ``site`` lets the payload use its arena region, and sizes a compressed payload's first
        copy; ``count_nonzero`` measures its sparsity (compressed payloads always do);
        ``on_done`` is called once the payload is settled (its length known), or the offload
        failed: at once, or at a later pack, unpack or drain; ``seed`` is a lossy codec's
        rounding seed."""
        if self._inflight:
            self._bound(flat.nbytes)
        stored.site = site
        try:
            if flat.is_cuda:
                start = time.perf_counter()
                self._offload_cuda(stored, flat, codec, count_nonzero, seed)
                stored.seconds = time.perf_counter() - start
            else:
                self._offload_cpu(stored, flat, codec, count_nonzero, seed)
        except Exception as err:  # noqa: BLE001 - any failure must keep the tensor intact
            self._failed(stored, flat, err)
        if stored.pending is not None:
            stored.on_done = on_done  # called when it is settled
        elif on_done is not None:
            on_done(stored)
        return stored

    def _offload_cpu(self, stored: Stored, flat: torch.Tensor, codec: Codec,
                     count_nonzero: bool, seed: int) -> None:
        if count_nonzero and codec.exact_size:
            stored.nonzero = nonzero_count(flat)
        payload = flat if codec.name == "raw" else self._encode(codec, stored, flat, True, seed)
        if self.arena_everywhere:
            self._place(stored, flat, payload, codec)
            if stored.pending is not None:
                self._settle(stored)  # as on CUDA, from what the first copy took
            return
        stored.payload = self._to_host(payload, flat)
        if stored.header is not None and not codec.exact_size:
            stored.length, stored.nonzero = codec.payload_length(
                payload[:_PREAMBLE], stored.header.numel, stored.header.dtype.itemsize)

    def _offload_cuda(self, stored: Stored, flat: torch.Tensor, codec: Codec,
                      count_nonzero: bool, seed: int) -> None:
        device = flat.device
        compute = current_stream(device.index)
        offload = self._stream(device, OFFLOAD)
        payload = flat
        if codec.name != "raw":  # encoded on its own stream, so copies of others go on
            encoder = self._stream(device, COMPRESS)
            self._follow(encoder, compute)
            with _on(encoder):
                payload = self._encode(codec, stored, flat, False, seed)
            flat.record_stream(encoder)
            self._follow(offload, encoder)
        else:
            self._follow(offload, compute)
        with _on(offload, compute):
            if count_nonzero and codec.exact_size:
                stored.nonzero = self.nonzero(flat)
            self._place(stored, flat, payload, codec, offload)
            stored.done = offload.record_event()
            if stored.lease is not None:
                stored.lease.last_use = stored.done
            payload.record_stream(offload)
        self._track(stored.done, flat.nbytes, stored)

    def _place(self, stored: Stored, flat: torch.Tensor, payload: torch.Tensor,
               codec: Codec, stream: torch.cuda.Stream | None = None) -> None:
        """Copy ``payload`` (on CUDA: queued on ``stream``, the current one) into host
        memory of its shape and strides: its site's arena region, or memory of its own. Of a
        payload whose length is not known yet, the first part only, into a slot of the
        codec's capacity."""
        if stored.header is None or codec.exact_size:
            slot, stored.lease = self._slot(payload.nbytes, payload.dtype, stored.site, flat,
                                            stream, payload)
            stored.payload = slot
            slot.copy_(payload, non_blocking=True)
            return
        capacity = codec.capacity(stored.header.numel, stored.header.dtype.itemsize)
        stored.payload, stored.lease = self._slot(capacity, payload.dtype, stored.site, flat,
                                                  stream)
        stored.pending = payload
        self._copy_head(stored, payload)

    def _copy_head(self, stored: Stored, payload: torch.Tensor) -> None:
        """Copy what the site's payload needed last time (and some headroom), or all of it."""
        last = self._expect.get(stored.site) if stored.site is not None else None
        head = payload.numel()
        if last is not None:
            head = min(head, max(_PREAMBLE, int(last * (1 + HEADROOM)) + _PREAMBLE))
        stored.payload[:head].copy_(payload[:head], non_blocking=True)
        stored.copied = head

    def _settle(self, stored: Stored) -> None:
        """A compressed payload's first copy is done: read its length from host memory, copy
        the rest if it was longer than what was copied, release the device buffer."""
        header, buffer = stored.header, stored.pending
        length, stored.nonzero = get_codec(stored.codec).payload_length(
            stored.payload[:_PREAMBLE], header.numel, header.dtype.itemsize)
        try:
            if length > stored.copied:  # it grew: the rest, ordered after the first copy
                with _on(self._stream(buffer.device, OFFLOAD) if buffer.is_cuda else None):
                    stored.payload[stored.copied:length].copy_(buffer[stored.copied:length],
                                                               non_blocking=True)
                    if buffer.is_cuda:
                        stored.done = current_stream(buffer.device.index).record_event()
                        if stored.lease is not None:
                            stored.lease.last_use = stored.done
        except Exception as err:  # noqa: BLE001 - the buffer still holds the payload
            stored.kept = get_codec(stored.codec).decode(Packed(header, buffer[:length]))
            stored.payload, stored.lease = None, None
            self._warn_once(type(err).__name__, f"cswap: could not copy a payload to host "
                            f"memory ({type(err).__name__}: {err}); it stays on its device.")
        else:
            stored.length = length
            if stored.site is not None:
                self._expect[stored.site] = length
        stored.pending = None
        if stored.on_done is not None:
            stored.on_done(stored)

    def _bound(self, nbytes: int | None) -> None:
        """Settle finished copies; wait for the oldest while too much is in flight with
        ``nbytes`` more (None: never wait)."""
        with self._lock:
            self._settle_done(nbytes)

    def _settle_done(self, nbytes: int | None) -> None:
        while self._inflight:
            event, size, stored = self._inflight[0]
            busy = not event.query()
            if busy and (nbytes is None or self._inflight_bytes + nbytes <= self.inflight_limit):
                return
            if busy:
                start = time.perf_counter()
                event.synchronize()
                self.waited_s += time.perf_counter() - start
            self._inflight.popleft()
            self._inflight_bytes -= size
            if stored.pending is not None:
                self._settle(stored)
            elif stored.done is event:  # the copy is done: its restore waits for nothing
                stored.done = None

    def poll(self) -> None:
        """Settle the copies that are done, without waiting (unpack and end of forward)."""
        if self._inflight:
            self._bound(None)

    def _track(self, event: torch.cuda.Event, nbytes: int, stored: Stored) -> None:
        self._inflight.append((event, nbytes, stored))
        self._inflight_bytes += nbytes

    def _failed(self, stored: Stored, flat: torch.Tensor, err: Exception) -> None:
        stored.kept, stored.payload, stored.lease, stored.pending = flat, None, None, None
        stored.header, stored.codec = None, "raw"
        self._warn_once(
            type(err).__name__,
            f"cswap: could not offload a saved tensor ({type(err).__name__}: {err}); "
            "it stays on its device. Further failures of this kind are not reported.",
        )

    def _encode(self, codec: Codec, stored: Stored, flat: torch.Tensor, trim: bool,
                seed: int) -> torch.Tensor:
        """``codec``'s payload (its header into ``stored``), or ``flat`` itself, to go raw,
        where the codec's scratch does not fit on the device: near the memory limit is
        where offloading matters most. ``seed``: a lossy codec's rounding seed."""
        try:
            if isinstance(codec, LossyCodec):
                packed = codec.encode(flat, seed=seed)
            else:
                packed = codec.encode(flat) if codec.exact_size else codec.encode(flat, trim=trim)
        except torch.OutOfMemoryError as err:
            self._warn_once(
                "encode oom",
                f"cswap: the {codec.name} codec ran out of device memory ({err}); such tensors "
                "are swapped uncompressed. Further cases are not reported.",
            )
            return flat
        stored.codec, stored.header = codec.name, packed.header
        return packed.payload

    def _slot(self, nbytes: int, dtype: torch.dtype, site: int | None, source: torch.Tensor,
              stream: torch.cuda.Stream | None, like: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, Lease | None]:
        """``nbytes`` of host memory for a payload, in the shape and strides of ``like`` (a
        dense tensor of ``nbytes``), else 1-D ``dtype``: its site's arena region if it can
        have it (the copy into it, on ``stream``, first waits for the region's earlier
        holders), else pinned memory of its own."""
        if site is not None and self.host_memory is not None:
            taken = self.host_memory.acquire(site, nbytes, dtype, like)
            if taken is not None:
                region, lease = taken
                if source.is_cuda:
                    for event in lease.wait_for:  # earlier holders' copies out of the region
                        stream.wait_event(event)
                return region, lease
        if like is None:
            return self._host_empty((nbytes // dtype.itemsize,), dtype, source.is_cuda), None
        return self._host_empty(like.shape, dtype, source.is_cuda, like.stride()), None

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                    stride: tuple[int, ...] | None = None) -> torch.Tensor:
        """Host memory of its own (contiguous, or in ``stride``): pinned where ``pin`` (and
        the config allows)."""
        new, size = (torch.empty, (shape,)) if stride is None else (torch.empty_strided,
                                                                     (shape, stride))
        if not (pin and self.pin_memory):
            return new(*size, dtype=dtype)
        try:
            return new(*size, dtype=dtype, pin_memory=True)
        except RuntimeError as err:
            self._warn_once(
                "pin",
                f"cswap: pinned host memory is exhausted ({err}); using pageable memory, "
                "whose copies are slower and synchronous.",
            )
            return new(*size, dtype=dtype)

    def nonzero(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s count of non-zero elements, in host memory once the current stream is past
        this point (no wait)."""
        return self._to_host(nonzero_count(t), t)

    def _to_host(self, payload: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """A CPU payload in memory of its own (a new payload, or a copy of the source); a
        CUDA one copied to pinned memory, queued on the current stream."""
        if not payload.is_cuda:
            shares = payload is source or (
                payload.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())
            return payload.clone() if shares else payload
        host = self._host_empty(payload.shape, payload.dtype, pin=True)
        host.copy_(payload, non_blocking=True)
        return host

    # backward --------------------------------------------------------------------------
    def restore(self, stored: Stored) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Bring a payload back (on CUDA: queued on the restore stream); the tensor (in the
        shape it left in, or 1-D) and the event after which it is complete."""
        if stored.pending is not None:  # its first copy was not seen done yet
            with self._lock:
                if stored.pending is not None:
                    if stored.done is not None:
                        stored.done.synchronize()
                    self._settle(stored)
        if self._inflight:
            self.poll()
        if stored.kept is not None:  # the offload failed: the tensor never left
            return stored.kept, None
        device = stored.source
        payload = stored.host_payload()
        if device == _CPU:
            # Memory of its own (not an arena region, which goes back when the payload
            # does) can be the tensor itself: on the CPU it is where the tensor lives.
            return self._decode(stored, payload, owned=stored.lease is None), None
        stream = self._stream(device, RESTORE)
        with _on(stream):
            if stored.done is not None:  # None: its copy out was seen done (``_settle_done``)
                stream.wait_event(stored.done)
            copy = payload.to(device, non_blocking=True)
            copied = stream.record_event() if stored.lease is not None else None
            if stored.lease is not None:
                stored.lease.last_use = copied
            out = self._decode(stored, copy, owned=True)
            # a raw payload is its tensor: nothing ran after the copy, its event will do
            return out, copied if copied is not None and out is copy else stream.record_event()

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
            host = Packed(stored.header, stored.host_payload())
            return codec.decode(host).to(stored.source)

    # steps and lifetime ----------------------------------------------------------------
    def take_waited(self) -> float:
        """Seconds forward waited at the in-flight bound since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def drain(self, device: bool = True) -> None:
        """Settle what can be settled without waiting; with ``device``, wait for the work
        started so far on the device and settle all."""
        if device:
            for streams in list(self._streams.values()):
                for stream in streams:
                    stream.synchronize()
        self.poll()

    def marks(self, device: torch.device | None) -> list[torch.cuda.Event]:
        """Events after the work queued so far on ``device``'s streams (compute and side):
        once all have passed, a step's figures can be read without waiting."""
        if device is None or device == _CPU:
            return []
        index = torch.cuda.current_device() if device.index is None else device.index
        streams = [current_stream(index), *self._streams.get(device, ())]
        return [stream.record_event() for stream in streams]

    def step_closed(self, step: StepStats, device: torch.device | None = None,
                    plan: bool = True) -> None:
        """Plan the arena from a finished step on ``device`` (with ``plan``: a step that
        tracked every site it moved), in the background."""
        if self.host_memory is not None and (self.arena_everywhere or (
                device is not None and device.type == "cuda")):
            self._worker.submit(partial(self.host_memory.step_closed, step, device, plan))

    def held_bytes(self) -> int:
        """Host memory kept between steps: the arena (once the planning queued so far is
        done)."""
        if self.host_memory is None:
            return 0
        self._worker.drain()
        return self.host_memory.held_bytes()

    def arena_report(self) -> ArenaReport | None:
        """Arena against lower bound and per-tensor bytes for the last closed step (None
        without an arena or before the first closed step)."""
        if self.host_memory is None:
            return None
        self._worker.drain()
        return self.host_memory.report()

    def close(self) -> None:
        """Finish the background work and give back the host arena's pinning."""
        self._worker.close()
        if self.host_memory is not None:
            self.host_memory.close()

    def _stream(self, device: torch.device, which: int) -> torch.cuda.Stream:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = tuple(torch.cuda.Stream(device) for _ in range(3))
        return streams[which]

    def _follow(self, waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        """``waiter.wait_stream(stream)`` with the same event each time (``wait_stream``
        creates one per call): a wait holds the event's last record when it is queued, so
        recording it again after is safe; one event per thread and stream (by its handle:
        hashing a ``Stream`` builds its device, on every moved tensor)."""
        key = (threading.get_ident(), stream.cuda_stream)
        event = self._marks.get(key)
        if event is None:
            event = self._marks[key] = torch.cuda.Event()
        event.record(stream)
        waiter.wait_event(event)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` (an int: a tensor's ``device.index``) without a
    new ``Stream`` each call: three calls per moved tensor took a tenth of its host time on
    an H200 (``benchmarks/results/overhead-h200-2026-11-27-b.md``), mostly building the
    object and parsing the device. The same stream, found again by torch's name for it."""
    key = torch._C._cuda_getCurrentStream(index)
    stream = _CURRENT.get(key)
    if stream is None:
        if len(_CURRENT) > 256:  # streams made and dropped (pool streams come back)
            _CURRENT.clear()
        stream = _CURRENT[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1],
                                                   device_type=key[2])
    return stream


class _on:  # a context manager, named like torch.cuda.stream
    """Make ``stream`` current (and its device, where it is not), then restore both; None
    does nothing (the CPU). The device first, so that leaving does not set the thread's own
    device back with cudaSetDevice, which creates a context there (CUDA 12) in a process that
    never used that GPU."""

    __slots__ = ("_device", "_previous", "_stream")

    def __init__(self, stream: torch.cuda.Stream | None,
                 previous: torch.cuda.Stream | None = None) -> None:
        self._stream = stream
        self._previous = previous  # the current stream, where the caller has it already

    def __enter__(self) -> None:
        stream = self._stream
        if stream is None:
            return
        # the device switch only where it is not current (a model over several GPUs)
        self._device = (torch.cuda.device(stream.device_index)
                        if stream.device_index != torch._C._cuda_getDevice() else None)
        if self._device is not None:
            self._device.__enter__()
        if self._previous is None:
            self._previous = current_stream(stream.device_index)
        # torch.cuda.set_stream's own call, without its two Python frames (four times per
        # moved tensor)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)

    def __exit__(self, *exc) -> None:
        if self._stream is None:
            return
        previous = self._previous
        torch._C._cuda_setStream(stream_id=previous.stream_id,
                                 device_index=previous.device_index,
                                 device_type=previous.device_type)
        if self._device is not None:
            self._device.__exit__(*exc)


class _Worker:
    """One background thread running queued calls in order (the arena's planning).

    It starts on the first call and ends after a few idle seconds, so an unused engine holds
    no thread; in a forked child it starts afresh (the parent's thread did not come over);
    at interpreter exit it is stopped first, so that no thread of ours is inside a call that
    released the GIL when the interpreter goes (which aborts the process)."""

    IDLE_EXIT_S = 5.0

    def __init__(self) -> None:
        self._reset()
        _WORKERS.add(self)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._calls: deque[Callable[[], object]] = deque()
        self._running = False
        self._thread: threading.Thread | None = None
        self._stopped = False

    def submit(self, call: Callable[[], object]) -> None:
        with self._cond:
            if self._stopped:
                return
            self._calls.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="cswap-worker",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def drain(self) -> None:
        """Wait until every call queued so far has run."""
        with self._cond:
            while (self._calls or self._running) and not self._stopped:
                self._cond.wait()

    def close(self) -> None:
        self.drain()

    def stop(self) -> None:
        """Drop what is queued, let the running call finish, and end the thread."""
        with self._cond:
            self._stopped = True
            self._calls.clear()
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._calls and not self._stopped:
                    self._cond.wait_for(lambda: self._calls or self._stopped, self.IDLE_EXIT_S)
                if not self._calls or self._stopped:
                    self._thread = None
                    self._cond.notify_all()
                    return
                call = self._calls.popleft()
                self._running = True
            try:
                call()
            except Exception as err:  # noqa: BLE001 - the thread must go on
                warnings.warn(f"cswap: background work failed: {err}", RuntimeWarning,
                              stacklevel=1)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def _after_fork(self) -> None:
        """In a forked child, where the parent's thread is gone and its lock may be held:
        the calls it had not run yet run in the child's own thread."""
        calls = list(self._calls)
        self._reset()
        for call in calls:
            self.submit(call)


_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [w._after_fork() for w in list(_WORKERS)])


@atexit.register
def _stop_threads() -> None:
    for worker in list(_WORKERS):
        worker.stop()
    stop_unpinner()
