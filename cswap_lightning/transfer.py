"""Moving saved tensors off the device and back, without stalling the thread that runs compute.

Each direction has one worker thread and, on CUDA, one side stream. The forward thread only
records an event and hands the tensor over; the offload worker orders its stream after that
event, compresses, and copies into (pinned) host memory. Anything that has to wait (a codec
that must read a size back, a pinned allocation) waits in the worker, never in forward. On
the CPU the same code runs with no streams: payloads land in separate host storage.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .codecs import Codec, Packed, get_codec, nonzero_count


@dataclass
class Stored:
    """A tensor's packed bytes held in host memory."""

    packed: Packed
    device: torch.device  # where the tensor came from and goes back to
    nonzero: torch.Tensor  # 0-dim count of non-zero elements, in host memory once `done`
    done: torch.cuda.Event | None  # recorded after the device-to-host copy
    seconds: float  # worker time spent compressing and copying

    @property
    def nbytes(self) -> int:
        return self.packed.payload.numel()


class Transfer:
    """Offload and restore jobs, one worker thread and one CUDA stream per direction."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._offload = ThreadPoolExecutor(1, thread_name_prefix="cswap-offload")
        self._restore = ThreadPoolExecutor(1, thread_name_prefix="cswap-restore")
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._warned: set[str] = set()

    def offload(self, flat: torch.Tensor, codec: Codec) -> Future[Stored | torch.Tensor]:
        """Start moving ``flat`` off the device; the future holds the tensor itself on failure."""
        ready = None
        if flat.is_cuda:
            ready = torch.cuda.current_stream(flat.device).record_event()
            # The caching allocator must not reuse this memory before the offload stream has
            # read it, whichever thread drops the last reference.
            flat.record_stream(self._stream_pair(flat.device)[0])
        return self._offload.submit(self._offload_job, flat, codec, ready)

    def restore(
        self, stored: Future[Stored | torch.Tensor]
    ) -> Future[tuple[torch.Tensor, torch.cuda.Event | None]]:
        """Start bringing a payload back; the future holds the tensor and its ready event."""
        return self._restore.submit(self._restore_job, stored)

    def drain(self) -> None:
        """Wait until every job submitted so far has finished, on the host and the device."""
        self._offload.submit(lambda: None).result()
        self._restore.submit(lambda: None).result()
        for offload_stream, restore_stream in self._streams.values():
            offload_stream.synchronize()
            restore_stream.synchronize()

    def close(self) -> None:
        self._offload.shutdown(wait=True)
        self._restore.shutdown(wait=True)

    def _stream_pair(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _on_stream(self, device: torch.device, index: int):
        if device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream_pair(device)[index])

    def _offload_job(
        self, flat: torch.Tensor, codec: Codec, ready: torch.cuda.Event | None
    ) -> Stored | torch.Tensor:
        start = time.perf_counter()
        try:
            with self._on_stream(flat.device, 0):
                if ready is not None:
                    torch.cuda.current_stream().wait_event(ready)
                nonzero = self._to_host(nonzero_count(flat), source=flat)
                packed = codec.encode(flat)
                host = self._to_host(packed.payload, source=flat)
                done = torch.cuda.current_stream().record_event() if flat.is_cuda else None
        except Exception as err:  # noqa: BLE001 - any failure must keep the tensor intact
            self._warn_once(
                type(err).__name__,
                f"cswap: could not offload a saved tensor ({type(err).__name__}: {err}); "
                "it stays on its device. Further failures of this kind are not reported.",
            )
            return flat
        seconds = time.perf_counter() - start
        return Stored(Packed(packed.header, host), flat.device, nonzero, done, seconds)

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
            out = get_codec(stored.packed.header.codec).decode(Packed(stored.packed.header, payload))
            ready = torch.cuda.current_stream().record_event() if out.is_cuda else None
        return out, ready

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
