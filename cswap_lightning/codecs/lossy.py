"""Lossy codecs for dense floating tensors: per-block scaled int8, fp8 (e4m3) and int4.

ZVC and RLE save nothing on dense activations (GELU outputs, attention probabilities); these
codecs trade a bounded error for a fixed 2-8x size cut. The payload layout and the exact
rounding rules are specified in ``format.py``; this module is their pure-torch reference.

Each block of ``block_size`` consecutive elements gets its own float32 scale, so one outlier
costs precision only in its own block. The default, 256 elements, keeps the scales at 1.6 %
of an int8 payload (3 % for int4) and maps one block onto one CUDA thread block.

Non-finite values keep their place and kind: +inf, -inf and NaN each have a reserved code,
and the scale is taken over the finite elements only. The payload size depends on the
element count alone, so a device encoder never has to report it back to the host.
"""

from __future__ import annotations

import itertools
import struct

import torch

from .format import Header, Packed
from .reference import Codec, _align16, _assemble, _cdiv, _section

LOSSY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_BLOCK_SIZE = 256
_U32 = 2**32
_FLOAT32_MAX = torch.finfo(torch.float32).max


def lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash of u32 bit patterns held in an int32 tensor, in place.

    Counter-based: element i's rounding noise is a pure function of (seed, i), so a kernel
    computes the same bits as this reference without sharing generator state. int32 products
    wrap like the kernel's u32 ones (tests check this against a pure-Python oracle)."""
    x ^= _shift_right(x, 16)
    x *= _as_int32(0x7FEB352D)
    x ^= _shift_right(x, 15)
    x *= _as_int32(0x846CA68B)
    x ^= _shift_right(x, 16)
    return x


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of u32 bit patterns in int32 (``>>`` alone extends the sign)."""
    return (x >> k).bitwise_and_((1 << (32 - k)) - 1)


def _as_int32(u: int) -> int:
    """The int32 value with the bits of the u32 ``u``."""
    return u - _U32 if u >= 2**31 else u


def rounding_noise(seed: int, numel: int, device: torch.device) -> torch.Tensor:
    """u(i) of ``format.py`` for i < numel: float32 multiples of 2**-24 in [0, 1)."""
    key = int(lowbias32_(torch.tensor(_as_int32(seed), dtype=torch.int32)))
    # The bit patterns of 0..numel-1 as int32 (numel may exceed 2**31), without an int64 pass;
    # one XOR flips the sign bit back and mixes in the key.
    hashed = torch.arange(-(2**31), numel - 2**31, dtype=torch.int32, device=device)
    lowbias32_(hashed.bitwise_xor_(_as_int32(key % _U32 ^ 2**31)))
    return _shift_right(hashed, 8).to(torch.float32).mul_(2.0**-24)


class LossyCodec(Codec):
    """Per-block scaled quantization of float32, float16 and bfloat16 tensors.

    ``seed`` starts the codec's own sequence of rounding seeds: an encode without an explicit
    seed takes the next one (seed, seed + 1, ...), so a run is reproducible and never touches
    torch's global generator. Subclasses set the codes (``format.py``) and the rounding."""

    lossless = False
    max_numel = _U32 - 1
    levels: int  # finite values map onto the codes -levels..levels
    nan_code: int
    pos_inf_code: int
    neg_inf_code: int
    code_bits: int = 8
    stochastic: bool = True

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> None:
        if not isinstance(block_size, int) or not 2 <= block_size < 2**31 or block_size % 2:
            raise ValueError(
                f"block_size must be an even int in [2, 2**31), got {block_size!r} "
                f"(default {DEFAULT_BLOCK_SIZE})"
            )
        self.block_size = block_size
        self._seeds = itertools.count(_check_seed(seed))

    def payload_nbytes(self, numel: int, nnz: int = 0, elem_size: int = 0, nruns: int = 0) -> int:
        """Exact payload size; a function of ``numel`` (and the block size) alone."""
        return self._payload_nbytes(numel, self.block_size)

    def encode(self, t: torch.Tensor, seed: int | None = None) -> Packed:
        """Quantize ``t`` (any shape and strides) in logical row-major order.

        ``seed`` (a u32) fixes the stochastic rounding of int8 and int4; None takes the
        codec's next seed. fp8 rounds to nearest and ignores it."""
        if t.dtype not in LOSSY_DTYPES:
            raise TypeError(
                f"lossy codec {self.name!r} takes floating tensors of dtype float32, float16 or "
                f"bfloat16, got {t.dtype}; swap it with a lossless codec (raw, zvc, rle)"
            )
        if t.numel() > self.max_numel:
            raise ValueError(f"codec {self.name!r} needs numel < 2**32, got {t.numel()}")
        if not self.stochastic:
            seed = 0
        elif seed is None:
            seed = next(self._seeds) % _U32
        else:
            seed = _check_seed(seed)
        header = Header(self.name, t.dtype, tuple(t.shape))
        return Packed(header, self._encode_values(t.detach().reshape(-1), seed))

    def decode(self, packed: Packed) -> torch.Tensor:
        """A new contiguous tensor of the header's dtype and shape, on the payload's device."""
        h = packed.header
        if h.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a {h.codec!r} payload")
        return self._decode_values(packed.payload, h.numel, h.dtype).reshape(h.shape)

    def _encode_values(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """The payload of the 1-D tensor ``flat``."""
        numel, block = flat.numel(), self.block_size
        nblocks = _cdiv(numel, block)
        x = torch.empty(nblocks * block, dtype=torch.float32, device=flat.device)
        x[:numel] = flat
        x[numel:] = 0.0  # the last block's padding: zeros change neither scale nor codes
        finite = x.nan_to_num(0.0, 0.0, 0.0).view(nblocks, block)
        scales = _round_up_to_float32(finite.abs().amax(dim=1).double() / self.levels)
        y = finite.div_(torch.where(scales > 0, scales, 1.0)[:, None])
        codes = self._quantize(y.view(-1), seed)
        codes.masked_fill_(x == float("inf"), self.pos_inf_code)
        codes.masked_fill_(x == -float("inf"), self.neg_inf_code)
        codes.masked_fill_(torch.isnan(x), self.nan_code)
        head = bytearray(struct.pack("<IIQ", block, seed, 0))
        preamble = torch.frombuffer(head, dtype=torch.uint8)
        packed_codes = self._pack(codes)[: self._code_nbytes(numel)]
        return _assemble([preamble.to(flat.device), scales, packed_codes], flat.device)

    def _decode_values(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The 1-D decoded tensor; reads the block size, so on a GPU it waits for the payload."""
        if payload.numel() < 16:
            raise ValueError(f"{self.name} payload has {payload.numel()} bytes, fewer than 16")
        block = int(_section(payload, 0, 4, torch.int32)) % _U32
        if block < 2 or block % 2:
            raise ValueError(f"{self.name} payload has block size {block}; it must be even, >= 2")
        expected = self._payload_nbytes(numel, block)
        if payload.numel() != expected:
            raise ValueError(
                f"{self.name} payload has {payload.numel()} bytes, expected {expected} "
                f"for {numel} elements in blocks of {block}"
            )
        nblocks = _cdiv(numel, block)
        scales = _section(payload, 16, 16 + 4 * nblocks, torch.float32)
        codes = self._unpack(payload[_codes_offset(nblocks) :], numel)
        values = self._dequantize(codes).mul_(scales.repeat_interleave(block)[:numel])
        values.clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)
        values.masked_fill_(codes == self.pos_inf_code, float("inf"))
        values.masked_fill_(codes == self.neg_inf_code, -float("inf"))
        values.masked_fill_(codes == self.nan_code, float("nan"))
        return values.to(dtype)

    def _payload_nbytes(self, numel: int, block: int) -> int:
        return _codes_offset(_cdiv(numel, block)) + self._code_nbytes(numel)

    def _code_nbytes(self, numel: int) -> int:
        return _cdiv(numel * self.code_bits, 8)

    def _quantize(self, y: torch.Tensor, seed: int) -> torch.Tensor:
        """int8 codes of the scaled finite values ``y`` (|y| <= levels): stochastic rounding."""
        a = y.abs()
        low = a.floor()
        up = rounding_noise(seed, y.numel(), y.device) < a.sub_(low)  # a - low is exact
        return low.add_(up).copysign_(y).to(torch.int8)

    def _dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of finite int8 codes, in a new tensor."""
        return codes.to(torch.float32)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """The code bytes of an even number of int8 codes."""
        return codes.view(torch.uint8)

    def _unpack(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` int8 codes from the code bytes."""
        return data.view(torch.int8)

    # Codec's bit-pattern hooks serve the bit-exact codecs; quantizing needs the values and
    # their dtype, which is why encode and decode are overridden.
    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        raise TypeError(f"lossy codec {self.name!r} quantizes values: call encode(tensor)")

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError(f"lossy codec {self.name!r} decodes to values: call decode(packed)")


class Int8Codec(LossyCodec):
    """int8 codes with stochastic rounding: 4x smaller than float32, 2x than 16-bit floats.

    Error bound, per finite element x of a block with scale s = max|x| / 126 (rounded up):
    |x - x'| < s, before x' is rounded to the input dtype. Unbiased: E[x'] = x, up to the
    float32 rounding of x / s and the 2**-24 resolution of the rounding noise."""

    name = "int8"
    levels = 126
    nan_code, pos_inf_code, neg_inf_code = -128, 127, -127


class Int4Codec(LossyCodec):
    """4-bit codes with stochastic rounding, two per byte: 8x smaller than float32.

    Error bound, per finite element x of a block with scale s = max|x| / 6 (rounded up):
    |x - x'| < s, before x' is rounded to the input dtype. Unbiased: E[x'] = x, up to the
    float32 rounding of x / s and the 2**-24 resolution of the rounding noise."""

    name = "int4"
    levels = 6
    nan_code, pos_inf_code, neg_inf_code = -8, 7, -7
    code_bits = 4

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        nibbles = codes.view(torch.uint8) & 0x0F
        return nibbles[0::2] | (nibbles[1::2] << 4)

    def _unpack(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        nibbles = torch.stack([data & 0x0F, data >> 4], dim=1).view(-1)[:numel]
        return (nibbles.view(torch.int8) ^ 8) - 8  # sign-extend 4-bit two's complement


class FP8Codec(LossyCodec):
    """float8 e4m3fn codes, rounded to nearest: 4x smaller than float32, 2x than 16-bit floats.

    Error bound, per finite element x of a block with scale s = max|x| / 416 (rounded up):
    |x - x'| <= max(2**-4 * |x|, 2**-10 * s), the e4m3 rounding (3 mantissa bits; absolute
    2**-10 in its subnormal range), up to float32 rounding (relative 2**-23) and before x' is
    rounded to the input dtype. Deterministic: no seed."""

    name = "fp8"
    levels = 416
    nan_code, pos_inf_code, neg_inf_code = 0x7F, 0x7E, 0xFE - 256  # as int8
    stochastic = False

    def _quantize(self, y: torch.Tensor, seed: int) -> torch.Tensor:
        return y.to(torch.float8_e4m3fn).view(torch.int8)

    def _dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).to(torch.float32)


def reconstruction_error(codec: Codec, t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Relative L2 error ``||x' - x|| / ||x||`` of a round trip of ``t`` through ``codec``.

    Over the finite elements of ``t`` (the lossy codecs keep the others exactly), computed in
    float64; 0 when both norms are 0, inf when only ``||x||`` is. A 0-dim float32 tensor on
    ``t``'s device, so a metric can log it without waiting for the device. ``seed`` fixes a
    lossy codec's rounding, so that measuring leaves the codec's own seed sequence alone."""
    packed = codec.encode(t, seed=seed) if isinstance(codec, LossyCodec) else codec.encode(t)
    return relative_error(t, codec.decode(packed))


def relative_error(original: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """``||restored - original|| / ||original||`` over the finite elements of ``original``, as
    :func:`reconstruction_error` defines it, for a round trip made elsewhere."""
    x = original.detach().reshape(-1).to(torch.float64)
    restored = restored.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(x)
    x = torch.where(finite, x, 0.0)
    error = torch.linalg.vector_norm(torch.where(finite, restored, 0.0) - x)
    norm = torch.linalg.vector_norm(x)
    relative = torch.where(norm > 0, error / norm, torch.where(error > 0, float("inf"), 0.0))
    return relative.to(torch.float32)


def _check_seed(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed < _U32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return seed


def _codes_offset(nblocks: int) -> int:
    return 16 + _align16(4 * nblocks)


def _round_up_to_float32(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= each float64 value of ``x``."""
    nearest = x.to(torch.float32)
    above = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    return torch.where(nearest.to(torch.float64) < x, above, nearest)
