"""Tests for the packed format and the pure-torch reference codecs."""

from __future__ import annotations

import itertools
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cswap_lightning.codecs import (
    DTYPES,
    FORMAT_VERSION,
    Header,
    Packed,
    bit_view,
    codec_names,
    get_codec,
    nonzero_count,
    register,
)

CODECS = ("raw", "zvc", "rle")
MAIN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert a.dtype == b.dtype
    assert torch.equal(bit_view(a), bit_view(b))


def payload_bytes(packed: Packed) -> bytes:
    return bytes(packed.payload.cpu().tolist())


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, sparsity: float, seed: int):
    """Random bit patterns (NaNs, infs, -0.0, denormals included) with a fraction zeroed."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        t = torch.rand(numel, generator=g) >= sparsity
    else:
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        t = raw.view(dtype).clone()
        bit_view(t)[torch.rand(numel, generator=g) < sparsity] = 0
    return t.reshape(shape)


def oracle_payload(codec: str, t: torch.Tensor) -> bytes:
    """The payload spelled out from the format spec in plain Python."""
    size = t.dtype.itemsize
    ints = bit_view(t.reshape(-1)).tolist()
    nonzero = [v != 0 for v in ints]
    values = b"".join(v.to_bytes(size, "little", signed=v < 0) for v in ints if v)

    def pad16(b: bytes) -> bytes:
        return b + bytes(-len(b) % 16)

    if codec == "raw":
        return b"".join(v.to_bytes(size, "little", signed=v < 0) for v in ints)
    if codec == "zvc":
        words = [
            sum(1 << i for i in range(32) if 32 * w + i < len(ints) and nonzero[32 * w + i])
            for w in range(math.ceil(len(ints) / 32))
        ]
        mask = struct.pack(f"<{len(words)}I", *words)
        return pad16(struct.pack("<QQ", len(values) // size, 0) + mask) + values
    runs, at = [], 0
    for is_nonzero, group in itertools.groupby(nonzero):
        n = len(list(group))
        if not is_nonzero:
            runs.append((at, n))
        at += n
    starts = struct.pack(f"<{len(runs)}I", *(s for s, _ in runs))
    lengths = struct.pack(f"<{len(runs)}I", *(n for _, n in runs))
    preamble = struct.pack("<QQ", len(runs), len(values) // size)
    return pad16(pad16(preamble + starts) + lengths) + values


def count_runs(t: torch.Tensor) -> int:
    ints = bit_view(t.reshape(-1)).tolist()
    return sum(1 for is_zero, _ in itertools.groupby(v == 0 for v in ints) if is_zero)


def assert_round_trip(codec_name: str, t: torch.Tensor) -> Packed:
    """Round trip is bit-exact, payload matches the spec, and its size matches the formula."""
    codec = get_codec(codec_name)
    packed = codec.encode(t)
    assert packed.header == Header(codec_name, t.dtype, tuple(t.shape))
    assert packed.payload.device == t.device
    assert payload_bytes(packed) == oracle_payload(codec_name, t)
    nnz = int(nonzero_count(t))
    assert packed.payload.numel() == codec.payload_nbytes(
        t.numel(), nnz, t.dtype.itemsize, count_runs(t)
    )
    out = codec.decode(packed)
    assert out.is_contiguous()
    assert out.device == t.device
    assert_bit_equal(out, t.contiguous())
    return packed


# Layouts turn a contiguous tensor into a view with the same logical contents.
LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1),
    "strided": lambda t: torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0],
    "sliced": lambda t: torch.repeat_interleave(t, 2, dim=0)[::2] if t.dim() else t,
}

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    dtype=st.sampled_from(MAIN_DTYPES),
    shape=shapes,
    sparsity=st.floats(0, 1),
    seed=st.integers(0, 2**31),
    layout=st.sampled_from(sorted(LAYOUTS)),
)
def test_round_trip_main_dtypes(codec, dtype, shape, sparsity, seed, layout):
    base = random_tensor(shape, dtype, sparsity, seed)
    t = LAYOUTS[layout](base)
    assert_bit_equal(t, base)  # the layout changes strides, not contents
    assert_round_trip(codec, t)


@settings(max_examples=100, deadline=None)
@given(
    codec=st.sampled_from(CODECS),
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    sparsity=st.floats(0, 1),
    seed=st.integers(0, 2**31),
)
def test_round_trip_all_dtypes(codec, dtype, shape, sparsity, seed):
    assert_round_trip(codec, random_tensor(shape, dtype, sparsity, seed))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", MAIN_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (1, 1, 1, 1), (33,), (2, 40)])
def test_edge_shapes(codec, dtype, shape):
    assert_round_trip(codec, random_tensor(shape, dtype, 0.5, seed=1))


@pytest.mark.parametrize("codec", CODECS)
def test_non_contiguous_views(codec):
    base = random_tensor((6, 10, 4), torch.float32, 0.6, seed=2)
    views = [
        base.transpose(0, 2),
        base.permute(1, 2, 0),
        base[::2, 1::3],
        base[:, 3],
        base[..., 1:3].unsqueeze(1),
        random_tensor((5, 1), torch.float16, 0.5, seed=3).expand(5, 70),
        random_tensor((1,), torch.bfloat16, 0.0, seed=4).expand(3, 4, 5),
        torch.zeros(1).expand(100, 100),
    ]
    for v in views:
        assert not v.is_contiguous()
        assert_round_trip(codec, v)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_special_values(codec, dtype):
    t = torch.tensor(
        [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-3, 0.0, -0.0],
        dtype=dtype,
    )
    bit_view(t)[7] = 1  # the smallest positive denormal
    nan_with_payload = torch.full((1,), float("nan"), dtype=dtype)
    bit_view(nan_with_payload)[0] |= 0b10110  # set mantissa payload bits
    t = torch.cat([t, nan_with_payload])
    packed = assert_round_trip(codec, t)
    out = get_codec(codec).decode(packed)
    assert torch.signbit(out[1]) and out[1] == 0  # -0.0 survives
    assert torch.isnan(out[2]) and torch.isnan(out[3])
    assert bit_view(out)[-1] == bit_view(nan_with_payload)[0]
    assert int(nonzero_count(t)) == 9  # only the first element is bitwise zero


# [0, 1.5, 0, 0, 2] as float32: 1.5 = 0x3FC00000, 2.0 = 0x40000000.
KAT_INPUT = [0.0, 1.5, 0.0, 0.0, 2.0]
KAT_VALUES = "0000c03f 00000040"
KAT_PAYLOADS = {
    "raw": "00000000 0000c03f 00000000 00000000 00000040",
    # nnz=2, reserved=0 | mask word 0b10010 (elements 1 and 4), padding | values
    "zvc": "02000000 00000000 00000000 00000000 12000000" + " 00" * 12 + " " + KAT_VALUES,
    # nruns=2, nnz=2 | starts 0, 2, padding | lengths 1, 2, padding | values
    "rle": "02000000 00000000 02000000 00000000"
    " 00000000 02000000 00000000 00000000"
    " 01000000 02000000 00000000 00000000 " + KAT_VALUES,
}


@pytest.mark.parametrize("codec", CODECS)
def test_known_answer_payload(codec):
    t = torch.tensor(KAT_INPUT, dtype=torch.float32)
    packed = get_codec(codec).encode(t)
    assert payload_bytes(packed) == bytes.fromhex(KAT_PAYLOADS[codec])
    assert packed.payload.numel() == get_codec(codec).payload_nbytes(5, 2, 4, nruns=2)
    assert packed.nbytes == len(packed.header.to_bytes()) + len(bytes.fromhex(KAT_PAYLOADS[codec]))
    assert_bit_equal(get_codec(codec).decode(packed), t)


def test_known_answer_zvc_two_mask_words_bool():
    t = torch.zeros(40, dtype=torch.bool)
    t[0] = t[33] = t[39] = True
    packed = get_codec("zvc").encode(t)
    expected = (
        struct.pack("<QQ", 3, 0)
        + struct.pack("<II", 0x00000001, (1 << 1) | (1 << 7))
        + bytes(8)
        + b"\x01\x01\x01"
    )
    assert payload_bytes(packed) == expected


def test_known_answer_rle_all_zero_and_no_zero():
    zeros = get_codec("rle").encode(torch.zeros(7, dtype=torch.float16))
    # nruns=1, nnz=0 | start 0 + pad | length 7 + pad | no values
    expected = struct.pack("<QQI", 1, 0, 0) + bytes(12) + struct.pack("<I", 7) + bytes(12)
    assert payload_bytes(zeros) == expected
    ones = get_codec("rle").encode(torch.ones(3, dtype=torch.float16))
    assert payload_bytes(ones) == struct.pack("<QQ", 0, 3) + bytes.fromhex("003c" * 3)


@pytest.mark.parametrize("elem_size", [1, 2, 4, 8])
def test_rle_capacity_holds_every_payload(elem_size):
    """The capacity is the largest payload of any number of runs (each one zero long, the
    rest values): a single zero among 8-byte elements makes a larger payload than the most
    runs do (an int64 tensor of 4096 elements, one zero: 32808 bytes)."""
    rle = get_codec("rle")
    for numel in range(1, 130):
        largest = max(rle.payload_nbytes(numel, numel - r, elem_size, r)
                      for r in range(math.ceil(numel / 2) + 1))
        assert rle.capacity(numel, elem_size) == largest
    ids = torch.arange(1, 4097, dtype=torch.int64)
    ids[7] = 0
    assert get_codec("rle").encode(ids).payload.numel() == 32808 <= rle.capacity(4096, 8)


def test_header_known_bytes_and_properties():
    h = Header("zvc", torch.float16, (2, 3))
    assert h.to_bytes() == b"CSWP" + bytes([FORMAT_VERSION, 1, 1, 2]) + struct.pack("<qq", 2, 3)
    assert (h.numel, h.nbytes) == (6, 12)
    assert Header("raw", torch.bool, ()).to_bytes() == b"CSWP\x01\x00\x03\x00"
    assert Header("raw", torch.bool, ()).numel == 1


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_header_round_trip(codec, dtype):
    for shape in [(), (0,), (5,), (2, 0, 7), (3, 1, 2**40, 1)]:
        h = Header(codec, dtype, shape)
        assert Header.from_bytes(h.to_bytes()) == h
        assert Header.from_bytes(h.to_bytes() + b"trailing payload") == h


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"NOPE\x01\x00\x00\x00", "bad magic"),
        (b"CSWP\x02\x00\x00\x00", "unknown format version 2"),
        (b"CSWP\x01\x07\x00\x00", "unknown codec id 7"),  # first reserved id
        (b"CSWP\x01\x00\x0c\x00", "unknown dtype id 12"),  # len(DTYPES)
        (b"CSWP\x01", "truncated header"),
        (b"CSWP\x01\x00\x00\x02" + bytes(8), "need 24 for 2 dims"),
    ],
)
def test_header_from_bytes_errors(data, message):
    with pytest.raises(ValueError, match=message):
        Header.from_bytes(data)


def test_header_rejects_bad_fields():
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        Header("lz4", torch.float32, (1,))
    with pytest.raises(ValueError, match="unsupported dtype"):
        Header("raw", torch.complex64, (1,))
    with pytest.raises(ValueError, match="invalid shape"):
        Header("raw", torch.float32, (2, -1))


@pytest.mark.parametrize("codec", CODECS)
def test_packed_bytes_round_trip(codec):
    t = random_tensor((4, 9), torch.bfloat16, 0.7, seed=5)
    packed = get_codec(codec).encode(t)
    data = packed.to_bytes()
    assert len(data) == packed.nbytes
    assert data == packed.header.to_bytes() + payload_bytes(packed)
    restored = Packed.from_bytes(data)
    assert restored.header == packed.header
    assert torch.equal(restored.payload, packed.payload)
    assert_bit_equal(get_codec(codec).decode(restored), t)


def test_packed_bytes_round_trip_empty_payload():
    packed = get_codec("raw").encode(torch.empty(0, 3))
    restored = Packed.from_bytes(packed.to_bytes())
    assert restored.header == packed.header
    assert restored.payload.numel() == 0
    assert get_codec("raw").decode(restored).shape == (0, 3)


def test_packed_rejects_bad_payload():
    with pytest.raises(ValueError, match="1-D uint8"):
        Packed(Header("raw", torch.float32, (1,)), torch.zeros(4, dtype=torch.int8))


def test_decode_returns_new_memory_and_raw_encode_does_not_copy():
    t = torch.arange(8, dtype=torch.float32)
    packed = get_codec("raw").encode(t)
    assert packed.payload.data_ptr() == t.data_ptr()  # no transient copy of a big tensor
    out = get_codec("raw").decode(packed)
    out.fill_(0)
    assert_bit_equal(get_codec("raw").decode(packed), torch.arange(8, dtype=torch.float32))


def test_decode_rejects_foreign_and_damaged_payloads():
    packed = get_codec("zvc").encode(torch.ones(4))
    with pytest.raises(ValueError, match="'rle' cannot decode a 'zvc' payload"):
        get_codec("rle").decode(packed)
    raw = get_codec("raw").encode(torch.ones(4))
    with pytest.raises(ValueError, match="expected 16"):
        get_codec("raw").decode(Packed(raw.header, raw.payload[:-4]))
    rle = get_codec("rle").encode(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="rle payload has"):
        get_codec("rle").decode(Packed(rle.header, rle.payload[:-4]))


@pytest.mark.parametrize("codec", ["zvc", "rle"])
def test_numel_limit(codec):
    huge = torch.zeros(1, dtype=torch.bool).expand(2**32)  # no memory behind it
    with pytest.raises(ValueError, match="numel < 2\\*\\*32"):
        get_codec(codec).encode(huge)


def test_registry():
    assert set(CODECS) <= set(codec_names())
    assert all(get_codec(name).name == name for name in CODECS)
    assert all(get_codec(name).lossless for name in CODECS)
    with pytest.raises(ValueError, match=r"unknown codec 'nope'; registered: .*'raw'"):
        get_codec("nope")


def test_register_replaces_and_rejects_unknown_wire_names():
    original = get_codec("raw")

    class Faster(type(original)):
        pass

    try:
        register(Faster())
        assert isinstance(get_codec("raw"), Faster)
    finally:
        register(original)
    assert get_codec("raw") is original

    class Nameless(type(original)):
        name = "mystery"

    with pytest.raises(ValueError, match="'mystery' has no wire id"):
        register(Nameless())
    assert "mystery" not in codec_names()


def test_bit_view_and_nonzero_count():
    for dtype in DTYPES:
        assert bit_view(torch.zeros(2, dtype=dtype)).element_size() == dtype.itemsize
        assert not bit_view(torch.zeros(2, dtype=dtype)).dtype.is_floating_point
    assert bit_view(torch.ones(1, dtype=torch.bool)).dtype == torch.uint8
    t = torch.tensor([[0.0, -0.0], [float("nan"), 3.0]]).t()
    count = nonzero_count(t)
    assert count.dtype == torch.int64 and count.dim() == 0
    assert int(count) == 3


def test_zvc_beats_raw_on_sparse_tensor():
    t = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    t[torch.rand(1_000_000, generator=torch.Generator().manual_seed(1)) < 0.9] = 0
    zvc, raw = get_codec("zvc"), get_codec("raw")
    packed = zvc.encode(t)
    nnz = int(nonzero_count(t))
    assert packed.payload.numel() == zvc.payload_nbytes(t.numel(), nnz, 4)
    assert packed.nbytes < raw.encode(t).nbytes
    assert packed.payload.numel() < 0.15 * t.numel() * 4
    assert_bit_equal(zvc.decode(packed), t)


def test_rle_beats_raw_and_zvc_on_long_zero_runs():
    t = torch.zeros(1000, 1000)
    t[:, :50] = torch.randn(1000, 50, generator=torch.Generator().manual_seed(0))
    rle, zvc, raw = get_codec("rle"), get_codec("zvc"), get_codec("raw")
    packed = rle.encode(t)
    assert packed.payload.numel() == rle.payload_nbytes(t.numel(), 50_000, 4, nruns=1000)
    assert packed.nbytes < zvc.encode(t).nbytes < raw.encode(t).nbytes
    assert_bit_equal(rle.decode(packed), t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(codec, dtype):
    cpu = random_tensor((37, 3, 11), dtype, 0.6, seed=7)
    cuda = cpu.cuda().transpose(0, 2)
    packed = get_codec(codec).encode(cuda)
    assert packed.payload.is_cuda
    expected = get_codec(codec).encode(cpu.transpose(0, 2))
    assert torch.equal(packed.payload.cpu(), expected.payload)
    out = get_codec(codec).decode(packed)
    assert out.is_cuda
    assert_bit_equal(out.cpu(), cpu.transpose(0, 2).contiguous())
