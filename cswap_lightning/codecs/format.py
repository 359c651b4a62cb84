"""The packed tensor format (version 1): the spec every codec implementation must match bit for bit.

A packed tensor is a header followed by a codec-specific payload. All integers are
little-endian. The reference codecs reinterpret tensor memory with ``Tensor.view``, so they
assume a little-endian host, as are all PyTorch targets.

Header (``8 + 8 * ndim`` bytes)::

    offset  size      field
    0       4         magic b"CSWP"
    4       1  u8     format version (1)
    5       1  u8     codec id: raw=0, zvc=1, rle=2, int8=3, fp8=4, int4=5, exponent=6;
                      7..255 reserved
    6       1  u8     dtype id: the index of the dtype in ``DTYPES``
    7       1  u8     ndim
    8       8*ndim    dims, int64 each, outermost first

Payload. Elements are always stored as their raw bit patterns in logical row-major order,
whatever the strides of the source tensor. An element is *zero* when all its bits are zero:
``-0.0`` and NaNs are non-zero, and their bits are preserved. Every section starts at a
16-byte-aligned offset from the start of the payload; padding bytes are zero; the payload
ends right after its last section (no trailing padding). ``align16(n) = ceil(n / 16) * 16``.

raw -- ``numel * elem_size`` bytes::

    [0, numel * elem_size)   the elements

zvc (zero-value compression; needs numel < 2**32)::

    [0, 8)          nnz: u64, the number of non-zero elements
    [8, 16)         reserved: u64 = 0
    [16, M)         mask: ceil(numel / 32) u32 words, M = 16 + 4 * ceil(numel / 32);
                    bit i of word w is set iff element 32 * w + i is non-zero;
                    bits past numel are zero
    [V, V + nnz * elem_size)   the non-zero elements in order, V = align16(M)

rle (runs of zeros; needs numel < 2**32). A run is a maximal range of consecutive zero
elements; runs are listed in increasing order::

    [0, 8)          nruns: u64
    [8, 16)         nnz: u64
    [16, 16 + 4 * nruns)       run starts: u32 element index of each run's first element
    [L, L + 4 * nruns)         run lengths: u32, L = 16 + align16(4 * nruns)
    [V, V + nnz * elem_size)   the non-zero elements in order, V = L + align16(4 * nruns)

exponent (lossless, for dense bfloat16 tensors; bfloat16 only; numel < 2**32). A bfloat16's
sign and mantissa (8 bits) look random, but neighbouring elements' exponents (its other 8
bits) lie close together: each group of 32 consecutive elements (the last one padded) stores
its exponents as offsets from the group's least, in as many bits as the largest offset needs.
For element i, ``e(i)`` is its exponent (bits 7..14) and ``r(i) = bit 15 << 7 | bits 0..6``;
group k holds elements 32k..32k+31, ``base[k]`` is the least e(i) among them and ``w[k]``
(0..8) the fewest bits that hold ``max e(i) - base[k]``; ``g = ceil(numel / 32)``::

    [0, 8)          nplanes: u64, the sum of w[k] over the groups
    [8, 16)         reserved: u64 = 0
    [16, 16 + numel)           r(i): u8 per element
    [B, B + g)                 base[k]: u8 per group, B = 16 + align16(numel)
    [W, W + g)                 w[k]: u8 per group, W = B + align16(g)
    [P, P + 4 * nplanes)       the bit planes: for each group k in order, w[k] u32 words;
                               bit i of its word j is bit j of e(32k + i) - base[k]
                               (0 past numel), P = W + align16(g)

int8, fp8, int4 (lossy; float32, float16 and bfloat16 tensors; numel < 2**32). The elements
are cut into blocks of B consecutive elements (the last block may be shorter), and each block
``b`` is quantized with its own scale ``s[b]``; ``nblocks = ceil(numel / B)``::

    [0, 4)          B: u32, the block size, even and >= 2
    [4, 8)          seed: u32, the seed of the stochastic rounding (int8, int4); 0 for fp8
    [8, 16)         reserved: u64 = 0
    [16, 16 + 4 * nblocks)     s: f32 per block
    [C, C + code bytes)        one code per element in order, C = 16 + align16(4 * nblocks)

Codes. Each codec reserves three codes for +inf, -inf and NaN (whatever its sign and payload
bits), and quantizes finite values onto the levels ``-L..L``:

    int8   i8 per element; L = 126; +inf 127, -inf -127, NaN -128
    int4   4-bit two's complement, element 2k in the low nibble of byte k and element 2k+1 in
           its high nibble (0 past numel): ceil(numel / 2) bytes; L = 6; +inf 7, -inf -7,
           NaN -8
    fp8    float8 e4m3fn per element; L = 416 (0x7D); +inf 0x7E, -inf 0xFE, NaN 0x7F

Encoding. ``m`` is the largest ``|x|`` over the block's finite elements (0 if none);
``s = RU(m / L)``, ``m / L`` computed in float64 and rounded up to float32, so that
``|x| / s <= L``. Each finite ``x`` (converted to float32) maps to ``y = x / s`` (float32,
round to nearest even; ``y = x`` where ``s = 0``), then:

    fp8        q = y rounded to the nearest float8 e4m3fn (ties to even)
    int8/int4  a = |y|, f = floor(a), q = sign(y) * (f + (u(i) < a - f)): stochastic rounding,
               where i is the element's index and
               u(i) = (h(i ^ h(seed)) >> 8) * 2**-24,
               h(x) = lowbias32 on u32 (products wrap mod 2**32):
                      x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16

Decoding. Reserved codes give +inf, -inf and NaN; any other code q gives
``x' = q * s[b]`` (float32, round to nearest even, clamped to the float32 range), then rounded
to nearest even in the tensor's dtype.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import torch

FORMAT_VERSION = 1
MAGIC = b"CSWP"

# A dtype's wire id is its index: append only, never reorder.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.bool,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

# Wire ids of the codec formats; ids 7..255 are reserved for future codecs.
CODEC_IDS: dict[str, int] = {"raw": 0, "zvc": 1, "rle": 2, "int8": 3, "fp8": 4, "int4": 5,
                             "exponent": 6}

_FIXED = struct.Struct("<4sBBBB")
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose elements have the same size as ``dtype``'s."""
    return _BITS_DTYPES[dtype.itemsize]


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as integers of the same size, so that zero means all bits zero."""
    return t.view(bits_dtype(t.dtype))


@dataclass(frozen=True)
class Header:
    """What a payload needs to be decoded: codec, dtype and shape."""

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.codec not in CODEC_IDS:
            raise ValueError(f"unknown codec {self.codec!r}; known: {sorted(CODEC_IDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype}; supported: {DTYPES}")
        if len(self.shape) > 255 or any(d < 0 for d in self.shape):
            raise ValueError(f"invalid shape {tuple(self.shape)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the uncompressed tensor."""
        return self.numel * self.dtype.itemsize

    def to_bytes(self) -> bytes:
        fixed = _FIXED.pack(
            MAGIC, self.version, CODEC_IDS[self.codec], DTYPES.index(self.dtype), len(self.shape)
        )
        return fixed + struct.pack(f"<{len(self.shape)}q", *self.shape)

    @classmethod
    def from_bytes(cls, data: bytes) -> Header:
        """Parse a header from the start of ``data``; bytes after it are ignored."""
        if len(data) < _FIXED.size:
            raise ValueError(f"truncated header: {len(data)} bytes, need at least {_FIXED.size}")
        magic, version, codec_id, dtype_id, ndim = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}, expected {MAGIC!r}: not a cswap packed tensor")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unknown format version {version}; this reader knows {FORMAT_VERSION}"
            )
        codecs = {i: name for name, i in CODEC_IDS.items()}
        if codec_id not in codecs:
            raise ValueError(f"unknown codec id {codec_id}; known: {sorted(codecs)}")
        if dtype_id >= len(DTYPES):
            raise ValueError(f"unknown dtype id {dtype_id}; known: 0..{len(DTYPES) - 1}")
        size = _FIXED.size + 8 * ndim
        if len(data) < size:
            raise ValueError(f"truncated header: {len(data)} bytes, need {size} for {ndim} dims")
        shape = struct.unpack_from(f"<{ndim}q", data, _FIXED.size)
        return cls(codecs[codec_id], DTYPES[dtype_id], shape, version)


@functools.lru_cache(maxsize=4096)
def header(codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Header:
    """``Header(codec, dtype, shape)``, made once: the engine packs the same few shapes at
    every step."""
    return Header(codec, dtype, shape)


@dataclass
class Packed:
    """A packed tensor: header plus payload (1-D uint8, on any device)."""

    header: Header
    payload: torch.Tensor

    def __post_init__(self) -> None:
        if self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise ValueError(
                f"payload must be a 1-D uint8 tensor, got {self.payload.dtype} "
                f"of shape {tuple(self.payload.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.header.to_bytes()) + self.payload.numel()

    def to_bytes(self) -> bytes:
        head = self.header.to_bytes()
        out = bytearray(len(head) + self.payload.numel())
        out[: len(head)] = head
        if self.payload.numel():
            torch.frombuffer(out, dtype=torch.uint8, offset=len(head)).copy_(self.payload)
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes, device: torch.device | str = "cpu") -> Packed:
        header = Header.from_bytes(data)
        body = bytearray(memoryview(data)[len(header.to_bytes()) :])
        if not body:
            return cls(header, torch.empty(0, dtype=torch.uint8, device=device))
        # Copy so the payload owns allocator-aligned memory, whatever the buffer's alignment.
        return cls(header, torch.frombuffer(body, dtype=torch.uint8).to(device, copy=True))
