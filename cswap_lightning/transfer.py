"""Moving saved tensors off the device and back, without stalling the thread that runs compute.

Each direction has one worker thread and, on CUDA, one side stream. The forward thread only
records an event and hands the tensor over; the offload worker orders its stream after that
event, compresses, and copies into (pinned) host memory. Anything that has to wait (a codec
that must read a size back, a pinned allocation) waits in the worker, never in forward. On
the CPU the same code runs with no streams: payloads land in separate host storage.

Payloads of a known site go into the planned host arena (``arena.py``) when it can take
them, and into memory of their own otherwise.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .arena import ArenaReport, HostMemory, Lease
from .codecs import Codec, Packed, get_codec, nonzero_count
from .stats import StepStats


@dataclass
class Stored:
    """A tensor's packed bytes held in host memory."""

    packed: Packed
    device: torch.device  # where the tensor came from and goes back to
    nonzero: torch.Tensor  # 0-dim count of non-zero elements, in host memory once `done`
    done: torch.cuda.Event | None  # recorded after the device-to-host copy
    seconds: float  # worker time spent compressing and copying
    lease: Lease | None = None  # the arena region holding the payload, if it is in one

    @property
    def nbytes(self) -> int:
        return self.packed.payload.numel()


class Transfer:
    """Offload and restore jobs, one worker thread and one CUDA stream per direction.

    With ``arena`` (the default), payloads go into a host arena planned from the closed
    steps handed to :meth:`step_closed`."""

    def __init__(self, pin_memory: bool = True, arena: bool = True) -> None:
        self.pin_memory = pin_memory
        pin_arena = pin_memory and torch.cuda.is_available()
        self.host_memory = HostMemory(pin=pin_arena) if arena else None
        self._offload = ThreadPoolExecutor(1, thread_name_prefix="cswap-offload")
        self._restore = ThreadPoolExecutor(1, thread_name_prefix="cswap-restore")
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._warned: set[str] = set()

    def offload(
        self, flat: torch.Tensor, codec: Codec, site: int | None = None
    ) -> Future[Stored | torch.Tensor]:
        """Start moving ``flat`` off the device; the future holds the tensor itself on failure.

        ``site`` (the tensor's site in the step) lets its payload use the arena."""
        ready = None
        if flat.is_cuda:
            ready = torch.cuda.current_stream(flat.device).record_event()
            # The caching allocator must not reuse this memory before the offload stream has
            # read it, whichever thread drops the last reference.
            flat.record_stream(self._stream_pair(flat.device)[0])
        return self._offload.submit(self._offload_job, flat, codec, ready, site)

    def restore(
        self, stored: Future[Stored | torch.Tensor]
    ) -> Future[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """Start bringing a payload back; the future holds the tensor and its ready event."""
        return self._restore.submit(self._restore_job, stored)

    def drain(self, device: bool = True) -> None:
        """Wait until every job submitted so far has finished on the host and, with ``device``,
        on the device."""
        self._offload.submit(lambda: None).result()
        self._restore.submit(lambda: None).result()
        if not device:
            return
        for offload_stream, restore_stream in list(self._streams.values()):
            offload_stream.synchronize()
            restore_stream.synchronize()

    def step_closed(self, step: StepStats, device: torch.device | None = None) -> None:
        """Plan the arena from a finished step on ``device``, in the background, once the
        offload jobs submitted so far are done (queued behind them: the caller never waits)."""
        if self.host_memory is not None:
            self._offload.submit(self.host_memory.step_closed, step, device)

    def arena_report(self) -> ArenaReport | None:
        """Arena against lower bound and per-tensor bytes for the last closed step (None
        without an arena or before the first closed step); waits for the offload jobs
        submitted so far, since steps are closed behind them."""
        if self.host_memory is None:
            return None
        self._offload.submit(lambda: None).result()
        return self.host_memory.report()

    def close(self) -> None:
        self._offload.shutdown(wait=True)
        self._restore.shutdown(wait=True)
        if self.host_memory is not None:
            self.host_memory.close()

    def _stream_pair(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    @contextlib.contextmanager
    def _on_stream(self, device: torch.device, index: int):
        if device.type != "cuda":
            yield
            return
        # The device first, so that leaving the stream does not set the worker thread's own
        # device (0) back with cudaSetDevice, which creates a context there (CUDA 12) in a
        # process that never used that GPU; torch.cuda.device's exit does not.
        with torch.cuda.device(device), torch.cuda.stream(self._stream_pair(device)[index]):
            yield

    def _offload_job(
        self, flat: torch.Tensor, codec: Codec, ready: torch.cuda.Event | None, site: int | None
    ) -> Stored | torch.Tensor:
        start = time.perf_counter()
        try:
            with self._on_stream(flat.device, 0):
                if ready is not None:
                    torch.cuda.current_stream().wait_event(ready)
                nonzero = self._to_host(nonzero_count(flat), source=flat)
                packed = self._encode(codec, flat)
                host, lease = self._payload_to_host(packed.payload, flat, site)
                done = torch.cuda.current_stream().record_event() if flat.is_cuda else None
                if lease is not None:
                    lease.last_use = done
        except Exception as err:  # noqa: BLE001 - any failure must keep the tensor intact
            self._warn_once(
                type(err).__name__,
                f"cswap: could not offload a saved tensor ({type(err).__name__}: {err}); "
                "it stays on its device. Further failures of this kind are not reported.",
            )
            return flat
        seconds = time.perf_counter() - start
        return Stored(Packed(packed.header, host), flat.device, nonzero, done, seconds, lease)

    def _encode(self, codec: Codec, flat: torch.Tensor) -> Packed:
        """``codec``'s payload, or the raw one where the codec's scratch does not fit on the
        device (raw needs none): near the memory limit is where offloading matters most."""
        try:
            return codec.encode(flat)
        except torch.OutOfMemoryError as err:
            if codec.name == "raw":
                raise
            self._warn_once(
                "encode oom",
                f"cswap: the {codec.name} codec ran out of device memory ({err}); such tensors "
                "are swapped uncompressed. Further cases are not reported.",
            )
            return get_codec("raw").encode(flat)

    def _payload_to_host(
        self, payload: torch.Tensor, source: torch.Tensor, site: int | None
    ) -> tuple[torch.Tensor, Lease | None]:
        """The payload copied into its site's arena region if it can have it, else to host
        memory of its own."""
        taken = None
        if site is not None and self.host_memory is not None:
            taken = self.host_memory.acquire(site, payload.numel())
        if taken is None:
            return self._to_host(payload, source), None
        region, lease = taken
        if payload.is_cuda:
            for event in lease.wait_for:  # earlier holders' copies out of the region
                torch.cuda.current_stream().wait_event(event)
        region.copy_(payload, non_blocking=True)
        return region, lease

    def _to_host(self, payload: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if not payload.is_cuda:
            shares_memory = payload.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
            return payload.clone() if shares_memory else payload
        try:
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=self.pin_memory)
        except RuntimeError as err:
            self._warn_once(
                "pin",
                f"cswap: pinned host memory is exhausted ({err}); using pageable memory, "
                "whose copies are slower and synchronous.",
            )
            host = torch.empty(payload.shape, dtype=payload.dtype)
        host.copy_(payload, non_blocking=True)
        return host

    def _restore_job(
        self, stored_future: Future[Stored | torch.Tensor]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        stored = stored_future.result()
        if isinstance(stored, torch.Tensor):  # offload failed: the tensor never left
            return stored, None
        device = stored.device
        with self._on_stream(device, 1):
            if stored.done is not None:
                torch.cuda.current_stream().wait_event(stored.done)
            payload = stored.packed.payload.to(device, non_blocking=True)
            if stored.lease is not None and payload.is_cuda:
                stored.lease.last_use = torch.cuda.current_stream().record_event()
            out = self._decode(stored, payload)
            ready = torch.cuda.current_stream().record_event() if out.is_cuda else None
        return out, ready

    def _decode(self, stored: Stored, payload: torch.Tensor) -> torch.Tensor:
        """The tensor from ``payload`` (``stored``'s payload, on its device); where the
        codec's scratch does not fit on the device, decoded on the host and copied over."""
        codec = get_codec(stored.packed.header.codec)
        packed = Packed(stored.packed.header, payload)
        copied = payload is not stored.packed.payload  # a device copy only this job holds
        try:
            return codec.decode_owned(packed) if copied else codec.decode(packed)
        except torch.OutOfMemoryError as err:
            self._warn_once(
                "decode oom",
                f"cswap: the {codec.name} codec ran out of device memory ({err}); such tensors "
                "are decoded on the host instead (slower). Further cases are not reported.",
            )
            del packed, payload
            return codec.decode(stored.packed).to(stored.device)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
