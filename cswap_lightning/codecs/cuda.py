"""The codecs on CUDA tensors with the compiled kernels of ``cuda_ext/cswap_codec.cu``.

``CudaZVCCodec``, ``CudaRLECodec`` and the lossy ``CudaInt8Codec``, ``CudaFP8Codec`` and
``CudaInt4Codec`` produce the reference codecs' payloads byte for byte (the lossy ones given the
same seed). Tensors not on a CUDA device, and every tensor when the library is unavailable, go
through the reference codecs. They are not registered by default: ``enable_cuda_codecs()``
opts in, and so does the environment variable ``CSWAP_CUDA_CODECS=1`` for every ``Offloader``
a process builds (for command-line tools: ``CSWAP_CUDA_CODECS=1 cswap fit ...``).

zvc and rle encoding enqueues its kernels on ``torch.cuda.current_stream()``; trimmed (the
default), it then reads the payload size back, which waits for that stream. Untrimmed
(``encode(t, trim=False)``, what the engine does), it returns the whole output buffer and
never waits: the length is in the payload's first bytes, read from host memory once copied.
Lossy payload sizes are known up front, so lossy encoding never waits. Decoding never waits:
counts and block sizes are read on the device.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from . import cuda_build
from .format import CODEC_IDS, DTYPES, FORMAT_VERSION
from .lossy import DEFAULT_BLOCK_SIZE, FP8Codec, Int4Codec, Int8Codec, LossyCodec
from .reference import ExponentCodec, RLECodec, ZVCCodec

ABI_VERSION = 3  # CSWAP_CODEC_ABI_VERSION in cswap_codec.h
DEFAULT_BLOCK = 256
# Default grid: 8 blocks of DEFAULT_BLOCK threads per SM, the 2048 threads an SM holds when a
# kernel uses at most 32 registers a thread (all zvc and rle kernels but rle's second encode
# pass do), so that an SM has blocks to run while others wait on their look-backs.
BLOCKS_PER_SM = 8

_c_int, _c_u32, _c_u64, _c_ptr = ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
_COMPRESS_ARGS = [_c_ptr, _c_u64, _c_int, _c_ptr, _c_u64, _c_ptr, _c_ptr, _c_u64, _c_int, _c_int,
                  _c_ptr]
_DECOMPRESS_ARGS = [_c_ptr, _c_u64, _c_ptr, _c_u64, _c_int, _c_ptr, _c_u64, _c_int, _c_int,
                    _c_ptr]
_SIGNATURES: dict[str, tuple[type, list]] = {
    "cswap_abi_version": (_c_int, []),
    "cswap_format_version": (_c_int, []),
    "cswap_status_string": (ctypes.c_char_p, [_c_int]),
    "cswap_last_error": (ctypes.c_char_p, []),
    "cswap_check_device": (_c_int, []),
    "cswap_max_payload_bytes": (_c_u64, [_c_int, _c_u64, _c_int]),
    "cswap_workspace_bytes": (_c_u64, [_c_u64, _c_int]),
    "cswap_zvc_compress": (_c_int, _COMPRESS_ARGS),
    "cswap_rle_compress": (_c_int, _COMPRESS_ARGS),
    "cswap_zvc_decompress": (_c_int, _DECOMPRESS_ARGS),
    "cswap_rle_decompress": (_c_int, _DECOMPRESS_ARGS),
    "cswap_exponent_compress": (_c_int, _COMPRESS_ARGS),
    "cswap_exponent_decompress": (_c_int, _DECOMPRESS_ARGS),
    "cswap_lossy_payload_bytes": (_c_u64, [_c_int, _c_u64, _c_u32]),
    "cswap_lossy_compress": (_c_int, [_c_int, _c_ptr, _c_u64, _c_int, _c_u32, _c_u32, _c_ptr,
                                      _c_u64, _c_int, _c_int, _c_ptr]),
    "cswap_lossy_decompress": (_c_int, [_c_int, _c_ptr, _c_u64, _c_ptr, _c_u64, _c_int, _c_int,
                                        _c_int, _c_ptr]),
}


def open_library(path: str | Path) -> ctypes.CDLL:
    """Load a built library after the ownership checks, declare its functions, check versions.

    Needs no GPU: nothing here calls into the CUDA runtime."""
    cuda_build.check_cache_file(Path(path))
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.cswap_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI version {lib.cswap_abi_version()}, need {ABI_VERSION}")
    if lib.cswap_format_version() != FORMAT_VERSION:
        raise RuntimeError(
            f"{path} writes format version {lib.cswap_format_version()}, need {FORMAT_VERSION}"
        )
    return lib


@functools.cache
def load_extension() -> ctypes.CDLL | None:
    """The CUDA codec library, built on first use; None, with one warning, if unavailable."""
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available (torch.cuda.is_available() is False)")
        lib = open_library(cuda_build.build())
        if lib.cswap_check_device() != 0:
            raise RuntimeError(lib.cswap_last_error().decode())
    except Exception as err:  # noqa: BLE001 - any failure means: use the reference codecs
        warnings.warn(
            f"cswap: the CUDA codec library is unavailable: {err}. The zvc and rle codecs run "
            "as the pure-torch reference instead (same bytes, slower).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return lib


def check_status(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(
            f"cswap CUDA codec: {what} failed: {lib.cswap_status_string(status).decode()}: "
            f"{lib.cswap_last_error().decode()}"
        )


@functools.cache
def _default_grid(device_index: int) -> int:
    return BLOCKS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_launch(grid: int | None, block: int) -> None:
    if grid is not None and grid < 1:
        raise ValueError(f"grid must be at least 1, got {grid}")
    if block < 32 or block > 1024 or block % 32:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")


def _aligned16(payload: torch.Tensor) -> torch.Tensor:
    """``payload``, copied if it is not contiguous and 16-byte aligned as the kernels need."""
    if payload.data_ptr() % 16 or not payload.is_contiguous():
        return payload.clone(memory_format=torch.contiguous_format)
    return payload


class _Launches:
    """A codec's kernel launch parameters.

    ``tuned`` maps (direction, element size), direction "encode" or "decode", to the
    (grid, block) that kernel launches with (``tuner.TuningResult.launches``); kernels not in
    it use ``grid`` (None: a few blocks per SM) and ``block``."""

    def __init__(
        self,
        grid: int | None = None,
        block: int = DEFAULT_BLOCK,
        tuned: Mapping[tuple[str, int], tuple[int, int]] | None = None,
    ) -> None:
        self.grid, self.block, self.tuned = grid, block, dict(tuned or {})
        for launch in [(grid, block), *self.tuned.values()]:
            _check_launch(*launch)

    def launch_params(self, direction: str, elem_size: int) -> tuple[int | None, int]:
        return self.tuned.get((direction, elem_size), (self.grid, self.block))

    def _grid_and_block(self, device: torch.device, direction: str,
                        elem_size: int) -> tuple[int, int]:
        grid, block = self.launch_params(direction, elem_size)
        return grid or _default_grid(device.index), block


class _CudaCodec(_Launches):
    """Launches the kernels for CUDA tensors; everything else goes to the reference class."""

    name: str

    def _launch(self, lib: ctypes.CDLL, device: torch.device, numel: int, direction: str,
                elem_size: int):
        if numel >= 2**32:
            raise ValueError(f"codec {self.name!r} needs numel < 2**32, got {numel}")
        grid, block = self._grid_and_block(device, direction, elem_size)
        workspace_bytes = lib.cswap_workspace_bytes(numel, grid)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        return grid, block, workspace, workspace_bytes, stream

    @property
    def encode_waits(self) -> bool:
        """Untrimmed, the kernels leave the payload's length on the device; the reference
        codec, which runs where the library is missing, reads it back."""
        return load_extension() is None

    def capacity(self, numel: int, elem_size: int) -> int:
        lib = load_extension()
        if lib is None:
            return super().capacity(numel, elem_size)  # type: ignore[misc]
        return max(lib.cswap_max_payload_bytes(CODEC_IDS[self.name], numel, elem_size),
                   super().capacity(numel, elem_size))  # type: ignore[misc]

    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        lib = load_extension() if bits.is_cuda else None
        if lib is None:
            return super()._encode_bits(bits, trim)  # type: ignore[misc]
        bits = bits.contiguous()
        numel, elem_size, device = bits.numel(), bits.element_size(), bits.device
        with torch.cuda.device(device):
            grid, block, workspace, workspace_bytes, stream = self._launch(
                lib, device, numel, "encode", elem_size
            )
            capacity = lib.cswap_max_payload_bytes(CODEC_IDS[self.name], numel, elem_size)
            payload = torch.empty(capacity, dtype=torch.uint8, device=device)
            nbytes = torch.empty((), dtype=torch.int64, device=device)
            compress = getattr(lib, f"cswap_{self.name}_compress")
            status = compress(
                bits.data_ptr() or None, numel, elem_size, payload.data_ptr(), capacity,
                nbytes.data_ptr(), workspace.data_ptr(), workspace_bytes, grid, block, stream,
            )
            check_status(lib, status, f"{self.name} compress")
            # Trimming reads the length back: it waits for the current stream.
            return payload[: int(nbytes.item())] if trim else payload

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        lib = load_extension() if payload.is_cuda else None
        if lib is None:
            return super()._decode_bits(payload, numel, dtype)  # type: ignore[misc]
        payload = _aligned16(payload)
        device = payload.device
        with torch.cuda.device(device):
            grid, block, workspace, workspace_bytes, stream = self._launch(
                lib, device, numel, "decode", dtype.itemsize
            )
            out = torch.empty(numel, dtype=dtype, device=device)
            decompress = getattr(lib, f"cswap_{self.name}_decompress")
            status = decompress(
                payload.data_ptr(), payload.numel(), out.data_ptr() or None, numel,
                dtype.itemsize, workspace.data_ptr(), workspace_bytes, grid, block, stream,
            )
            check_status(lib, status, f"{self.name} decompress")
        return out


class CudaZVCCodec(_CudaCodec, ZVCCodec):
    """zvc with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class CudaRLECodec(_CudaCodec, RLECodec):
    """rle with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class CudaExponentCodec(_CudaCodec, ExponentCodec):
    """exponent with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class _CudaLossyCodec(_Launches):
    """Launches the lossy kernels for CUDA tensors; everything else goes to the reference class.

    ``block_size`` as in ``LossyCodec``; the launch parameters as in ``_Launches``."""

    name: str
    block_size: int

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        grid: int | None = None,
        block: int = DEFAULT_BLOCK,
        tuned: Mapping[tuple[str, int], tuple[int, int]] | None = None,
    ) -> None:
        _Launches.__init__(self, grid, block, tuned)
        LossyCodec.__init__(self, block_size)  # type: ignore[arg-type]

    def _encode_values(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        lib = load_extension() if flat.is_cuda else None
        if lib is None:
            return super()._encode_values(flat, seed)  # type: ignore[misc]
        flat = flat.contiguous()
        numel, device = flat.numel(), flat.device
        with torch.cuda.device(device):
            grid, block = self._grid_and_block(device, "encode", flat.element_size())
            nbytes = self.payload_nbytes(numel)  # type: ignore[attr-defined]
            payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
            status = lib.cswap_lossy_compress(
                CODEC_IDS[self.name], flat.data_ptr() or None, numel, DTYPES.index(flat.dtype),
                self.block_size, seed, payload.data_ptr(), nbytes, grid, block,
                torch.cuda.current_stream(device).cuda_stream,
            )
            check_status(lib, status, f"{self.name} compress")
        return payload

    def _decode_values(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        lib = load_extension() if payload.is_cuda else None
        if lib is None:
            return super()._decode_values(payload, numel, dtype)  # type: ignore[misc]
        payload = _aligned16(payload)
        device = payload.device
        with torch.cuda.device(device):
            grid, block = self._grid_and_block(device, "decode", dtype.itemsize)
            out = torch.empty(numel, dtype=dtype, device=device)
            status = lib.cswap_lossy_decompress(
                CODEC_IDS[self.name], payload.data_ptr(), payload.numel(), out.data_ptr() or None,
                numel, DTYPES.index(dtype), grid, block,
                torch.cuda.current_stream(device).cuda_stream,
            )
            check_status(lib, status, f"{self.name} decompress")
        return out


class CudaInt8Codec(_CudaLossyCodec, Int8Codec):
    """int8 with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class CudaFP8Codec(_CudaLossyCodec, FP8Codec):
    """fp8 with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class CudaInt4Codec(_CudaLossyCodec, Int4Codec):
    """int4 with CUDA kernels; the reference codec for tensors not on a CUDA device."""


# The CUDA codec of each reference codec's name.
CUDA_CODECS: dict[str, type[_Launches]] = {
    c.name: c for c in (CudaZVCCodec, CudaRLECodec, CudaExponentCodec, CudaInt8Codec,
                        CudaFP8Codec, CudaInt4Codec)}


def enable_cuda_codecs(
    tuned: Mapping[str, Mapping[tuple[str, int], tuple[int, int]]] | None = None,
) -> bool:
    """Register the CUDA codecs under the names of the reference ones (zvc, rle, exponent,
    int8, fp8, int4) if the library loads; True if it did.

    ``tuned`` maps a codec name to its launch parameters (see ``_Launches``)."""
    if load_extension() is None:
        return False
    from . import register

    tuned = tuned or {}
    for name, codec in CUDA_CODECS.items():
        register(codec(tuned=tuned.get(name)))
    return True


@functools.cache
def enable_cuda_codecs_if_requested() -> bool:
    """``enable_cuda_codecs()`` once per process if ``CSWAP_CUDA_CODECS=1``; True if enabled."""
    return os.environ.get("CSWAP_CUDA_CODECS") == "1" and enable_cuda_codecs()
