"""zvc and rle on CUDA tensors with the compiled kernels of ``cuda_ext/cswap_codec.cu``.

``CudaZVCCodec`` and ``CudaRLECodec`` produce the reference codecs' payloads byte for byte.
Tensors not on a CUDA device, and every tensor when the library is unavailable, go through
the reference codecs. They are not registered by default: ``enable_cuda_codecs()`` opts in.

Encoding enqueues its kernels on ``torch.cuda.current_stream()`` and then reads the payload
size back, which waits for that stream (the offload worker's side stream in ``transfer.py``).
Decoding never waits: the payload's counts are read on the device.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

from . import cuda_build
from .format import CODEC_IDS, FORMAT_VERSION
from .reference import RLECodec, ZVCCodec

ABI_VERSION = 1  # CSWAP_CODEC_ABI_VERSION in cswap_codec.h
DEFAULT_BLOCK = 256
BLOCKS_PER_SM = 4

_c_int, _c_u64, _c_ptr = ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
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
}


def open_library(path: str | Path) -> ctypes.CDLL:
    """Load a built library after the ownership checks, declare its functions, check versions.

    Needs no GPU: nothing here calls into the CUDA runtime."""
    cuda_build.check_library(Path(path))
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


class _CudaCodec:
    """Launches the kernels for CUDA tensors; everything else goes to the reference class."""

    name: str

    def __init__(self, grid: int | None = None, block: int = DEFAULT_BLOCK) -> None:
        if grid is not None and grid < 1:
            raise ValueError(f"grid must be at least 1, got {grid}")
        if block < 32 or block > 1024 or block % 32:
            raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
        self.grid, self.block = grid, block

    def _launch(self, lib: ctypes.CDLL, device: torch.device, numel: int):
        if numel >= 2**32:
            raise ValueError(f"codec {self.name!r} needs numel < 2**32, got {numel}")
        grid = self.grid or _default_grid(device.index)
        workspace_bytes = lib.cswap_workspace_bytes(numel, grid)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        return grid, workspace, workspace_bytes, stream

    def _encode_bits(self, bits: torch.Tensor) -> torch.Tensor:
        lib = load_extension() if bits.is_cuda else None
        if lib is None:
            return super()._encode_bits(bits)  # type: ignore[misc]
        bits = bits.contiguous()
        numel, elem_size, device = bits.numel(), bits.element_size(), bits.device
        with torch.cuda.device(device):
            grid, workspace, workspace_bytes, stream = self._launch(lib, device, numel)
            capacity = lib.cswap_max_payload_bytes(CODEC_IDS[self.name], numel, elem_size)
            payload = torch.empty(capacity, dtype=torch.uint8, device=device)
            nbytes = torch.empty((), dtype=torch.int64, device=device)
            compress = getattr(lib, f"cswap_{self.name}_compress")
            status = compress(
                bits.data_ptr() or None, numel, elem_size, payload.data_ptr(), capacity,
                nbytes.data_ptr(), workspace.data_ptr(), workspace_bytes, grid, self.block,
                stream,
            )
            check_status(lib, status, f"{self.name} compress")
            return payload[: int(nbytes.item())]  # waits for the current stream only

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        lib = load_extension() if payload.is_cuda else None
        if lib is None:
            return super()._decode_bits(payload, numel, dtype)  # type: ignore[misc]
        if payload.data_ptr() % 16 or not payload.is_contiguous():
            payload = payload.clone(memory_format=torch.contiguous_format)  # 16-byte aligned
        device = payload.device
        with torch.cuda.device(device):
            grid, workspace, workspace_bytes, stream = self._launch(lib, device, numel)
            out = torch.empty(numel, dtype=dtype, device=device)
            decompress = getattr(lib, f"cswap_{self.name}_decompress")
            status = decompress(
                payload.data_ptr(), payload.numel(), out.data_ptr() or None, numel,
                dtype.itemsize, workspace.data_ptr(), workspace_bytes, grid, self.block, stream,
            )
            check_status(lib, status, f"{self.name} decompress")
        return out


class CudaZVCCodec(_CudaCodec, ZVCCodec):
    """zvc with CUDA kernels; the reference codec for tensors not on a CUDA device."""


class CudaRLECodec(_CudaCodec, RLECodec):
    """rle with CUDA kernels; the reference codec for tensors not on a CUDA device."""


def enable_cuda_codecs() -> bool:
    """Register the CUDA codecs as "zvc" and "rle" if the library loads; True if it did."""
    if load_extension() is None:
        return False
    from . import register

    register(CudaZVCCodec())
    register(CudaRLECodec())
    return True
