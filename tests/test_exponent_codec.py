"""The exponent codec's reference (lossless, bfloat16): its payload against the format spelled
out in plain Python, its round trip, sizes and errors, and what it saves on a transformer's
activations."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cswap_lightning.codecs import Header, Packed, bit_view, get_codec

CODEC = get_codec("exponent")


def oracle(t: torch.Tensor) -> bytes:
    """The payload, from format.py's words alone."""
    u = [v & 0xFFFF for v in bit_view(t.reshape(-1)).tolist()]
    exponents = [(v >> 7) & 0xFF for v in u]
    rest = bytes(((v >> 8) & 0x80) | (v & 0x7F) for v in u)
    bases, widths, planes = [], [], []
    for k in range(math.ceil(len(u) / 32)):
        group = exponents[32 * k:32 * k + 32]
        base = min(group)
        width = (max(group) - base).bit_length()
        bases.append(base)
        widths.append(width)
        for j in range(width):
            planes.append(sum(1 << i for i, e in enumerate(group) if (e - base) >> j & 1))

    def pad16(b: bytes) -> bytes:
        return b + bytes(-len(b) % 16)

    head = pad16(struct.pack("<QQ", len(planes), 0) + rest)
    return pad16(pad16(head + bytes(bases)) + bytes(widths)) + struct.pack(
        f"<{len(planes)}I", *planes)


def bf16_bits(numel: int, seed: int, spread: int) -> torch.Tensor:
    """Random bfloat16 bit patterns (NaNs, infinities, zeros and subnormals among them) whose
    exponents lie within ``spread`` of each other, or anywhere (``spread`` 256)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 1 << 16, (numel,), generator=g, dtype=torch.int32)
    centre = int(torch.randint(0, 256, (), generator=g))
    exponent = (centre + torch.randint(0, spread, (numel,), generator=g)) % 256
    u = (low & 0x807F) | (exponent << 7)
    return u.to(torch.int16).view(torch.bfloat16)


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 200), seed=st.integers(0, 2**31), spread=st.sampled_from(
    [1, 2, 3, 9, 256]), layout=st.sampled_from(["contiguous", "strided", "matrix"]))
def test_payload_is_the_spec_and_round_trips_bit_for_bit(numel, seed, spread, layout):
    t = bf16_bits(numel, seed, spread)
    if layout == "strided":
        t = torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    elif layout == "matrix" and numel % 4 == 0:
        t = t.view(4, -1).t()  # non-contiguous: packed in logical row-major order
    packed = CODEC.encode(t)
    assert packed.header == Header("exponent", torch.bfloat16, tuple(t.shape))
    assert bytes(packed.payload.tolist()) == oracle(t)
    nplanes = int(packed.payload[:8].view(torch.int64))
    assert packed.payload.numel() == CODEC.payload_nbytes(numel, numel, 2, nplanes=nplanes)
    assert CODEC.payload_length(packed.payload[:16], numel, 2) == (packed.payload.numel(), None)
    assert packed.payload.numel() <= CODEC.capacity(numel, 2)
    out = CODEC.decode(packed)
    assert out.is_contiguous() and out.shape == t.shape
    assert torch.equal(bit_view(out), bit_view(t.contiguous()))


def test_a_transformers_activations_shrink_by_a_third():
    """GELU's output of a BERT-sized layer, random weights: the exponents of neighbouring
    elements lie close, so the payload is at most 76% of the tensor (1.37x measured on
    Llama-3-8B-shaped layers' saved tensors, random init)."""
    torch.manual_seed(0)
    x = torch.randn(512, 1024)
    act = torch.nn.functional.gelu(x @ (torch.randn(1024, 4096) / 32)).to(torch.bfloat16)
    packed = CODEC.encode(act)
    assert packed.payload.numel() <= 0.76 * act.numel() * 2
    assert torch.equal(bit_view(CODEC.decode(packed)), bit_view(act))


def test_widths_follow_each_groups_range():
    flat = torch.full((64,), 1.5, dtype=torch.bfloat16)  # one exponent: no planes at all
    assert CODEC.payload_length(CODEC.encode(flat).payload[:16], 64, 2)[0] == 16 + 64 + 32
    wide = flat.clone()
    wide[3] = 0.0  # exponent 0 beside 127: that group needs 7 planes, the other none
    assert int(CODEC.encode(wide).payload[:8].view(torch.int64)) == 7


def test_packed_bytes_round_trip():
    t = bf16_bits(100, seed=1, spread=3).view(10, 10)
    packed = CODEC.encode(t)
    again = Packed.from_bytes(packed.to_bytes())
    assert again.header == packed.header
    assert torch.equal(bit_view(CODEC.decode(again)), bit_view(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16])
def test_other_dtypes_are_refused_by_name(dtype):
    with pytest.raises(ValueError, match=f"packs bfloat16 tensors, got {dtype}"):
        CODEC.encode(torch.zeros(8, dtype=dtype))
