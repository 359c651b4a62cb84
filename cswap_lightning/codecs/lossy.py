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

import struct

import torch

from .format import Header, Packed
from .reference import Codec, _align16, _cdiv, _section

LOSSY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_BLOCK_SIZE = 256
_U32 = 2**32
_FLOAT32_MAX = torch.finfo(torch.float32).max


def lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash of u32 bit patterns held in an int32 tensor, in place.

    Counter-based: element i's rounding noise is a pure function of (seed, i), so a kernel
    computes the same bits as this reference without sharing generator state. int32 products
    wrap like the kernel's u32 ones (tests check this against a pure-Python oracle). One
    scratch tensor serves every shift: on the CPU a fresh large tensor costs more than the
    arithmetic (its pages are faulted in)."""
    scratch = torch.empty_like(x)
    _xor_shift_right_(x, 16, scratch)
    x *= _as_int32(0x7FEB352D)
    _xor_shift_right_(x, 15, scratch)
    x *= _as_int32(0x846CA68B)
    _xor_shift_right_(x, 16, scratch)
    return x


def _xor_shift_right_(x: torch.Tensor, k: int, scratch: torch.Tensor) -> None:
    """``x ^= x >> k`` of u32 bit patterns in int32, through ``scratch``."""
    x.bitwise_xor_(_shift_right(x, k, scratch))


def _shift_right(x: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Logical right shift of u32 bit patterns in int32 (``>>`` alone extends the sign)."""
    return torch.bitwise_right_shift(x, k, out=out).bitwise_and_((1 << (32 - k)) - 1)


def _as_int32(u: int) -> int:
    """The int32 value with the bits of the u32 ``u``."""
    return u - _U32 if u >= 2**31 else u


def rounding_noise(seed: int, numel: int, device: torch.device) -> torch.Tensor:
    """u(i) of ``format.py`` for i < numel: float32 multiples of 2**-24 in [0, 1)."""
    return _noise_bits(seed, numel, device).to(torch.float32).mul_(2.0**-24)


def _noise_bits(seed: int, numel: int, device: torch.device) -> torch.Tensor:
    """u(i) * 2**24 as int32: the hash's top 24 bits."""
    key = int(lowbias32_(torch.tensor(_as_int32(seed), dtype=torch.int32)))
    # The bit patterns of 0..numel-1 as int32 (numel may exceed 2**31), without an int64 pass;
    # one XOR flips the sign bit back and mixes in the key.
    hashed = torch.arange(-(2**31), numel - 2**31, dtype=torch.int32, device=device)
    lowbias32_(hashed.bitwise_xor_(_as_int32(key % _U32 ^ 2**31)))
    return _shift_right(hashed, 8, out=hashed)


def seed_of(*parts: int) -> int:
    """A u32 rounding seed mixed from integers (a run's seed, a step, a site) by the spec's
    hash, in plain Python: under a microsecond per tensor."""
    h = 0
    for part in parts:
        h = _py_lowbias32(h ^ part % _U32)
    return h


def _py_lowbias32(h: int) -> int:
    h ^= h >> 16
    h = h * 0x7FEB352D % _U32
    h ^= h >> 15
    h = h * 0x846CA68B % _U32
    return h ^ h >> 16


class LossyCodec(Codec):
    """Per-block scaled quantization of float32, float16 and bfloat16 tensors.

    The stochastic rounding of int8 and int4 is a pure function of the seed given to
    :meth:`encode`: the codec keeps no state, so what a run compresses depends on the seeds
    its caller chooses (the engine: its own seed, the step and the site), never on what ran
    before in the process, and torch's global generator is never touched. Subclasses set the
    codes (``format.py``) and the rounding."""

    lossless = False
    max_numel = _U32 - 1
    levels: int  # finite values map onto the codes -levels..levels
    nan_code: int
    pos_inf_code: int
    neg_inf_code: int
    code_bits: int = 8
    stochastic: bool = True

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if not isinstance(block_size, int) or not 2 <= block_size < 2**31 or block_size % 2:
            raise ValueError(
                f"block_size must be an even int in [2, 2**31), got {block_size!r} "
                f"(default {DEFAULT_BLOCK_SIZE})"
            )
        self.block_size = block_size

    def payload_nbytes(self, numel: int, nnz: int = 0, elem_size: int = 0, nruns: int = 0) -> int:
        """Exact payload size; a function of ``numel`` (and the block size) alone."""
        return self._payload_nbytes(numel, self.block_size)

    def encode(self, t: torch.Tensor, seed: int = 0) -> Packed:
        """Quantize ``t`` (any shape and strides) in logical row-major order.

        ``seed`` (a u32) fixes the stochastic rounding of int8 and int4: encoding the same
        tensor twice with one seed rounds it the same way, so a caller encoding many tensors
        gives each its own (``seed_of``). fp8 rounds to nearest and ignores it."""
        if t.dtype not in LOSSY_DTYPES:
            raise TypeError(
                f"lossy codec {self.name!r} takes floating tensors of dtype float32, float16 or "
                f"bfloat16, got {t.dtype}; swap it with a lossless codec (raw, zvc, rle)"
            )
        if t.numel() > self.max_numel:
            raise ValueError(f"codec {self.name!r} needs numel < 2**32, got {t.numel()}")
        seed = _check_seed(seed) if self.stochastic else 0
        header = Header(self.name, t.dtype, tuple(t.shape))
        return Packed(header, self._encode_values(t.detach().reshape(-1), seed))

    def decode(self, packed: Packed) -> torch.Tensor:
        """A new contiguous tensor of the header's dtype and shape, on the payload's device."""
        h = packed.header
        if h.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a {h.codec!r} payload")
        return self._decode_values(packed.payload, h.numel, h.dtype).reshape(h.shape)

    def _encode_values(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """The payload of the 1-D tensor ``flat``, written section by section into one buffer.

        Every large temporary is made once and then worked on in place (a fresh tensor's
        pages cost more than the arithmetic on the CPU), and the passes for NaN and inf run
        only where a block has one."""
        numel, block = flat.numel(), self.block_size
        nblocks = _cdiv(numel, block)
        payload = torch.zeros(self._payload_nbytes(numel, block), dtype=torch.uint8,
                              device=flat.device)
        payload[:16] = torch.frombuffer(bytearray(struct.pack("<IIQ", block, seed, 0)),
                                        dtype=torch.uint8)
        x = flat.to(torch.float32)
        if numel % block:  # the last block's padding: zeros change neither scale nor codes
            x = torch.cat([x, x.new_zeros(nblocks * block - numel)])
        blocks, absmax, special = _finite_blocks(x.view(nblocks, block))
        scales = _round_up_to_float32(absmax.double() / self.levels)
        payload[16 : 16 + 4 * nblocks].view(torch.float32).copy_(scales)
        y = torch.div(blocks, torch.where(scales > 0, scales, 1.0)[:, None]).view(-1)
        # int4 packs codes in pairs: an odd count takes one padding zero along (code 0)
        codes = self._quantize(y[: self._code_nbytes(numel) * 8 // self.code_bits], seed)
        if special:
            kept = codes[:numel]
            kept.masked_fill_(flat == float("inf"), self.pos_inf_code)
            kept.masked_fill_(flat == -float("inf"), self.neg_inf_code)
            kept.masked_fill_(torch.isnan(flat), self.nan_code)
        self._pack(codes, payload[_codes_offset(nblocks) :])
        return payload

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
        values = self._dequantize(codes)
        # Finite codes dequantize within +-levels, the reserved ones outside (or to NaN); on
        # CUDA asking would wait for the device, so there the reserved codes are always set.
        special = values.is_cuda or not _within(values, self.levels)
        whole = numel - numel % block
        values[:whole].view(-1, block).mul_(scales[: whole // block, None])
        values[whole:].mul_(scales[whole // block :])  # the last, short block
        values.clamp_(-_FLOAT32_MAX, _FLOAT32_MAX)
        if special:
            values.masked_fill_(codes == self.pos_inf_code, float("inf"))
            values.masked_fill_(codes == self.neg_inf_code, -float("inf"))
            values.masked_fill_(codes == self.nan_code, float("nan"))
        return values.to(dtype)

    def _payload_nbytes(self, numel: int, block: int) -> int:
        return _codes_offset(_cdiv(numel, block)) + self._code_nbytes(numel)

    def _code_nbytes(self, numel: int) -> int:
        return _cdiv(numel * self.code_bits, 8)

    def _quantize(self, y: torch.Tensor, seed: int) -> torch.Tensor:
        """int8 codes of the scaled finite values ``y`` (|y| <= levels), which it overwrites.

        Stochastic rounding ``sign(y) * (f + (u < |y| - f))``, ``f`` the floor of ``|y|``,
        in float arithmetic rather than comparisons (a boolean result costs the CPU several
        times a float one): the cast to int8 truncates to ``sign(y) * f``; then
        ``d = (|y| - f) * 2**24 - u * 2**24`` is exact in sign (a difference rounds to zero
        only when equal), and ``ceil(clamp(d, 0, 1))`` is 1 exactly where ``d > 0``."""
        codes = y.to(torch.int8)
        fraction = y.sub_(codes)  # exact, with the sign of y (or zero)
        step = fraction.abs().mul_(2.0**24).sub_(_noise_bits(seed, y.numel(), y.device))
        step.clamp_(0.0, 1.0).ceil_().copysign_(fraction)
        return codes.add_(step.to(torch.int8))

    def _dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of finite int8 codes, in a new tensor."""
        return codes.to(torch.float32)

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Write the code bytes of int8 codes (an even number for 4-bit codes) to ``out``."""
        out.copy_(codes.view(torch.uint8))

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

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        nibbles = codes.view(torch.uint8) & 0x0F
        torch.bitwise_or(nibbles[0::2], nibbles[1::2] << 4, out=out)

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
    float64; 0 when both norms are 0, inf when only ``||x||`` is (and for a NaN). A 0-dim
    float32 tensor on ``t``'s device, so a metric can log it without waiting for the device.
    ``seed``: a lossy codec's rounding seed."""
    packed = codec.encode(t, seed=seed) if isinstance(codec, LossyCodec) else codec.encode(t)
    return relative_error(t, codec.decode(packed))


def relative_error(original: torch.Tensor, restored: torch.Tensor) -> torch.Tensor:
    """``||restored - original|| / ||original||`` over the finite elements of ``original``, as
    :func:`reconstruction_error` defines it, for a round trip made elsewhere."""
    return relative(*squared_errors(original, restored)).to(torch.float32)


def squared_errors(original: torch.Tensor, restored: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``||restored - original||**2`` and ``||original||**2`` over the finite elements of
    ``original`` (the lossy codecs keep the others exactly), as 0-dim float64 tensors on its
    device: sums that pool over tensors (``metrics.ReconstructionError``)."""
    x = original.detach().reshape(-1).to(torch.float64)
    restored = restored.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(x)
    x = torch.where(finite, x, 0.0)
    return (torch.where(finite, restored, 0.0) - x).square().sum(), x.square().sum()


def relative(error_sq: torch.Tensor, norm_sq: torch.Tensor) -> torch.Tensor:
    """``sqrt(error_sq / norm_sq)``: 0 when both are 0, inf when only ``norm_sq`` is, and inf
    for a NaN (a decoded NaN where the original was finite is the worst error there is)."""
    ratio = torch.where(norm_sq > 0, (error_sq / norm_sq).sqrt(),
                        torch.where(error_sq > 0, float("inf"), 0.0))
    return ratio.nan_to_num(nan=float("inf"), posinf=float("inf"))


def _check_seed(seed: int) -> int:
    if not isinstance(seed, int) or not 0 <= seed < _U32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return seed


def _finite_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``blocks`` with NaN and inf as 0, the largest magnitude in each, and whether any value
    was not finite. On CUDA that answer would wait for the device, so there every tensor is
    treated as if it held some."""
    if not blocks.is_cuda:
        absmax = _absmax(blocks)
        if bool(absmax.isfinite().all()):
            return blocks, absmax, False
    finite = blocks.nan_to_num(0.0, 0.0, 0.0)
    return finite, _absmax(finite), True


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in each row (+0.0 for a row of zeros), without a temporary as
    large as ``blocks`` (``aminmax`` would be one pass, but is 15x slower on the CPU)."""
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()


def _within(values: torch.Tensor, bound: float) -> bool:
    """Whether every value is within +-``bound`` (a NaN is not)."""
    return values.numel() == 0 or bool(torch.maximum(values.amax(), -values.amin()) <= bound)


def _codes_offset(nblocks: int) -> int:
    return 16 + _align16(4 * nblocks)


def _round_up_to_float32(x: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= each float64 value of ``x``."""
    nearest = x.to(torch.float32)
    above = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    return torch.where(nearest.to(torch.float64) < x, above, nearest)
