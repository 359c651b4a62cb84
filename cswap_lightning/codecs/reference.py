"""Pure-torch reference codecs for the format in ``format.py``.

They run on any device and keep everything on the input's device. They favour clarity over
speed (encoding synchronises with the device) and are the ground truth that faster kernels
are tested against.
"""

from __future__ import annotations

import abc

import torch

from .format import Packed, bit_view, bits_dtype
from .format import header as format_header

_U32_LIMIT = 2**32


def nonzero_count(t: torch.Tensor) -> torch.Tensor:
    """Number of bitwise non-zero elements, as a 0-dim int64 tensor on ``t``'s device (no sync)."""
    return torch.count_nonzero(bit_view(t))


class Codec(abc.ABC):
    """A packed-format implementation: encodes any tensor and decodes its own payloads."""

    name: str
    lossless: bool = True
    max_numel: int = 2**63 - 1
    exact_size: bool = True  # the payload's size follows from the shape: no read-back
    # encoding, untrimmed as the engine calls it, waits for the device: the host reads a size
    # its compaction needs (data-dependent indexing)
    encode_waits: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None  # the dtypes it packs (None: any)

    @classmethod
    def packs(cls, dtype: torch.dtype | str) -> bool:
        """Whether it packs tensors of ``dtype`` (a torch dtype or its name)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return cls.dtypes is None or dtype in cls.dtypes

    def encode(self, t: torch.Tensor, trim: bool = True) -> Packed:
        """Pack ``t`` (any shape and strides) in logical row-major order; payload on ``t.device``.

        The payload may share memory with ``t`` (raw does when ``t`` is contiguous). With
        ``trim=False`` an implementation may return its whole output buffer, of
        :meth:`capacity` bytes, instead of reading the payload's length back from the device:
        the length is then in the payload's first 16 bytes (:meth:`payload_length`)."""
        if not self.packs(t.dtype):
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise ValueError(f"codec {self.name!r} packs {names} tensors, got {t.dtype}; send "
                             "other dtypes raw (or through zvc where they are sparse)")
        header = format_header(self.name, t.dtype, tuple(t.shape))
        if t.numel() > self.max_numel:
            raise ValueError(
                f"codec {self.name!r} handles at most {self.max_numel} elements "
                f"(numel < 2**32 for zvc and rle), got {t.numel()}"
            )
        return Packed(header, self._encode_bits(bit_view(t.detach().reshape(-1)), trim))

    def decode(self, packed: Packed) -> torch.Tensor:
        """A new contiguous tensor of the header's dtype and shape, on the payload's device."""
        h = packed.header
        if h.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a {h.codec!r} payload")
        bits = self._decode_bits(packed.payload, h.numel, bits_dtype(h.dtype))
        return bits.view(h.dtype).reshape(h.shape)

    @abc.abstractmethod
    def payload_nbytes(self, numel: int, nnz: int, elem_size: int, nruns: int = 0) -> int:
        """Exact payload size, for the cost model."""

    def capacity(self, numel: int, elem_size: int) -> int:
        """The most bytes a payload of ``numel`` elements can take (an untrimmed buffer's
        size): room enough for any tensor of that size."""
        return self.payload_nbytes(numel, numel, elem_size)

    def payload_length(self, preamble: torch.Tensor, numel: int, elem_size: int
                       ) -> tuple[int, int | None]:
        """The payload's length in bytes and its count of non-zero elements (None where the
        format does not say), from its first 16 bytes (``preamble``, uint8 in host memory)."""
        return self.payload_nbytes(numel, numel, elem_size), None

    @abc.abstractmethod
    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        """Payload for the 1-D integer bit view ``bits`` (untrimmed: see :meth:`encode`)."""

    @abc.abstractmethod
    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """1-D tensor of ``numel`` elements of the integer ``dtype`` from ``payload``."""


class RawCodec(Codec):
    """No compression: the baseline the others must beat."""

    name = "raw"

    def payload_nbytes(self, numel: int, nnz: int, elem_size: int, nruns: int = 0) -> int:
        return numel * elem_size

    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        # A byte view when possible: copying a tensor that is about to leave the device
        # would briefly double its memory.
        bits = bits.contiguous()
        return bits.as_strided((bits.numel(),), (1,)).view(torch.uint8)  # size-1 dims: any stride

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        expected = self.payload_nbytes(numel, numel, dtype.itemsize)
        if payload.numel() != expected:
            raise ValueError(f"raw payload has {payload.numel()} bytes, expected {expected}")
        return payload.view(dtype).clone()


class ZVCCodec(Codec):
    """Zero-value compression: a 1-bit-per-element mask plus the non-zero elements."""

    name = "zvc"
    exact_size = False
    encode_waits = True
    max_numel = _U32_LIMIT - 1

    def payload_nbytes(self, numel: int, nnz: int, elem_size: int, nruns: int = 0) -> int:
        return _zvc_values_offset(numel) + nnz * elem_size

    def payload_length(self, preamble: torch.Tensor, numel: int, elem_size: int
                       ) -> tuple[int, int | None]:
        nnz = int(preamble[:8].view(torch.int64))
        return self.payload_nbytes(numel, nnz, elem_size), nnz

    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        numel = bits.numel()
        # One flag byte per element, padded with zeros to whole u32 mask words.
        flags = torch.zeros(_cdiv(numel, 32) * 32, dtype=torch.bool, device=bits.device)
        torch.ne(bits, 0, out=flags[:numel])
        values = bits[flags[:numel]]
        preamble = torch.tensor([values.numel(), 0], dtype=torch.int64, device=bits.device)
        return _assemble([preamble, _pack_bits(flags.view(torch.uint8)), values], bits.device)

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # The values run to the end of the payload, so decoding needs no read of nnz (no sync).
        nonzero = _unpack_bits(payload[16 : 16 + 4 * _cdiv(numel, 32)], numel)
        values = _section(payload, _zvc_values_offset(numel), payload.numel(), dtype)
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
        return out.masked_scatter_(nonzero, values)


class RLECodec(Codec):
    """Run-length encoding of zero runs: wins over zvc when zeros come in long runs."""

    name = "rle"
    exact_size = False
    encode_waits = True
    max_numel = _U32_LIMIT - 1

    def payload_nbytes(self, numel: int, nnz: int, elem_size: int, nruns: int = 0) -> int:
        return 16 + 2 * _align16(4 * nruns) + nnz * elem_size

    def capacity(self, numel: int, elem_size: int) -> int:
        # r runs (at most one per two elements: runs are maximal) leave at most numel - r
        # values. The run arrays take 16 bytes per four runs: that payload shrinks with r
        # inside each group of four and grows (or, 8-byte elements, stays) from one group's
        # first r to the next's, so the largest is none, or the last group's first r.
        most = _cdiv(numel, 2)
        return max(self.payload_nbytes(numel, numel - r, elem_size, r)
                   for r in {0, 4 * ((most - 1) // 4) + 1 if most else 0})

    def payload_length(self, preamble: torch.Tensor, numel: int, elem_size: int
                       ) -> tuple[int, int | None]:
        nruns, nnz = preamble[:16].view(torch.int64).tolist()
        return self.payload_nbytes(numel, nnz, elem_size, nruns), nnz

    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        zero = bits == 0
        # +1 where a zero run starts, -1 just past where it ends.
        edge = torch.zeros(1, dtype=torch.int8, device=bits.device)
        delta = torch.diff(zero.view(torch.int8), prepend=edge, append=edge)
        starts = torch.nonzero(delta > 0).view(-1)
        lengths = torch.nonzero(delta < 0).view(-1) - starts
        values = bits[~zero]
        counts = [starts.numel(), values.numel()]
        preamble = torch.tensor(counts, dtype=torch.int64, device=bits.device)
        return _assemble([preamble, _low_u32(starts), _low_u32(lengths), values], bits.device)

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nruns, nnz = _section(payload, 0, 16, torch.int64).tolist()
        expected = self.payload_nbytes(numel, nnz, dtype.itemsize, nruns)
        if payload.numel() != expected:
            raise ValueError(
                f"rle payload has {payload.numel()} bytes, expected {expected} "
                f"for {nruns} runs and {nnz} non-zeros"
            )
        lengths_at = 16 + _align16(4 * nruns)
        starts = _from_u32(_section(payload, 16, 16 + 4 * nruns, torch.int32))
        lengths = _from_u32(_section(payload, lengths_at, lengths_at + 4 * nruns, torch.int32))
        delta = torch.zeros(numel + 1, dtype=torch.int8, device=payload.device)
        delta[starts] = 1
        delta[starts + lengths] = -1
        nonzero = delta[:numel].cumsum(0, dtype=torch.int8) == 0
        values = _section(payload, lengths_at + _align16(4 * nruns), payload.numel(), dtype)
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
        return out.masked_scatter_(nonzero, values)


class ExponentCodec(Codec):
    """Lossless for dense bfloat16 tensors (GELU's and SiLU's outputs, attention's inputs):
    their signs and mantissas are kept as they are, their exponents packed per group of 32
    at the width the group's range needs (about 1.37x on a transformer's activations)."""

    name = "exponent"
    exact_size = False
    encode_waits = True
    max_numel = _U32_LIMIT - 1
    dtypes = (torch.bfloat16,)

    def payload_nbytes(self, numel: int, nnz: int, elem_size: int, nruns: int = 0,
                       nplanes: int | None = None) -> int:
        """The payload's size with ``nplanes`` bit planes (None: the most it can take,
        every group 8 bits wide); ``nnz`` and ``nruns`` do not change it."""
        groups = _cdiv(numel, GROUP)
        planes = 8 * groups if nplanes is None else nplanes
        return _exponent_planes_offset(numel) + 4 * planes

    def payload_length(self, preamble: torch.Tensor, numel: int, elem_size: int
                       ) -> tuple[int, int | None]:
        nplanes = int(preamble[:8].view(torch.int64))
        return self.payload_nbytes(numel, numel, elem_size, nplanes=nplanes), None

    def _encode_bits(self, bits: torch.Tensor, trim: bool = True) -> torch.Tensor:
        numel = bits.numel()
        u = bits.to(torch.int32) & 0xFFFF
        rest = ((u >> 8) & 0x80) | (u & 0x7F)
        exponent = (u >> 7) & 0xFF
        groups = _cdiv(numel, GROUP)
        padded = torch.empty(groups * GROUP, dtype=torch.int32, device=bits.device)
        padded[:numel] = exponent
        padded[numel:] = exponent[(groups - 1) * GROUP:].amin() if numel else 0  # offset 0
        padded = padded.view(groups, GROUP)
        base = padded.amin(1)
        offset = padded - base[:, None]
        width = _bit_width(offset.amax(1))
        planes = torch.stack([_pack_bits(((offset >> j) & 1).to(torch.uint8).view(-1)).view(
            groups, 4) for j in range(8)], 1)  # (groups, 8, 4): the u32 words' bytes
        used = torch.arange(8, device=bits.device)[None, :] < width[:, None]
        kept = planes[used].view(torch.int32).view(-1)
        preamble = torch.tensor([kept.numel(), 0], dtype=torch.int64, device=bits.device)
        return _assemble([preamble, rest.to(torch.uint8), base.to(torch.uint8),
                          width.to(torch.uint8), kept], bits.device)

    def _decode_bits(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        groups = _cdiv(numel, GROUP)
        rest = payload[16:16 + numel].to(torch.int32)
        at = 16 + _align16(numel)
        base = payload[at:at + groups].to(torch.int32)
        width = payload[at + _align16(groups):at + _align16(groups) + groups].to(torch.int64)
        words = payload[_exponent_planes_offset(numel):].view(-1, 4)
        planes = torch.zeros(groups, 8, 4, dtype=torch.uint8, device=payload.device)
        planes[torch.arange(8, device=payload.device)[None, :] < width[:, None]] = words
        offset = torch.zeros(groups * GROUP, dtype=torch.int32, device=payload.device)
        for j in range(8):
            offset |= _unpack_bits(planes[:, j].reshape(-1), groups * GROUP).to(torch.int32) << j
        exponent = (base.repeat_interleave(GROUP) + offset)[:numel]
        u = ((rest & 0x80) << 8) | (exponent << 7) | (rest & 0x7F)
        return u.to(dtype)


GROUP = 32  # elements per group of the exponent codec


def _bit_width(x: torch.Tensor) -> torch.Tensor:
    """The fewest bits that hold each of the non-negative ints ``x`` (0 for 0)."""
    width = torch.zeros_like(x)
    for j in range(8):
        width += (x >> j) > 0
    return width


def _exponent_planes_offset(numel: int) -> int:
    groups = _cdiv(numel, GROUP)
    return 16 + _align16(numel) + 2 * _align16(groups)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align16(n: int) -> int:
    return _cdiv(n, 16) * 16


def _zvc_values_offset(numel: int) -> int:
    return 16 + _align16(4 * _cdiv(numel, 32))


def _assemble(sections: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate 1-D sections as bytes, each at a 16-byte-aligned offset, zero padding."""
    offsets, size = [], 0
    for s in sections:
        offsets.append(_align16(size))
        size = offsets[-1] + s.numel() * s.element_size()
    payload = torch.zeros(size, dtype=torch.uint8, device=device)
    for s, at in zip(sections, offsets):
        payload[at : at + s.numel() * s.element_size()].view(s.dtype).copy_(s)
    return payload


def _section(payload: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """``payload[start:stop]`` reinterpreted as ``dtype``; copied only if misaligned for it."""
    s = payload[start:stop]
    if s.storage_offset() % dtype.itemsize:
        s = s.clone()
    return s.view(dtype)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 bytes (a multiple of 8 of them) LSB first into bytes.

    Eight shifts over numel/8 bytes each, rather than one op on an int64 copy of numel.
    Bytes in this order are exactly the little-endian u32 mask words.
    """
    groups = flags.view(-1, 8)
    packed = groups[:, 0].clone()
    for i in range(1, 8):
        packed |= groups[:, i] << i
    return packed


def _unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``_pack_bits``: the first ``numel`` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].view(torch.bool)


def _low_u32(x: torch.Tensor) -> torch.Tensor:
    """The u32 bit patterns (as int32) of non-negative int64 values below 2**32.

    Takes the low little-endian word instead of casting, which would overflow int32.
    """
    return x.view(torch.int32)[::2]


def _from_u32(x: torch.Tensor) -> torch.Tensor:
    """int64 values of u32 bit patterns stored as int32."""
    return x.to(torch.int64) & (_U32_LIMIT - 1)
