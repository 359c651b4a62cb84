"""Tests for the lossy reference codecs (int8, fp8, int4): error bounds, stochastic rounding,
non-finite values and the payload layout of ``format.py``."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cswap_lightning.codecs import (
    CODEC_IDS,
    Header,
    Packed,
    codec_names,
    get_codec,
    reconstruction_error,
)
from cswap_lightning.codecs.lossy import FP8Codec, Int4Codec, Int8Codec, rounding_noise, seed_of

LOSSY = ("int8", "fp8", "int4")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CLASSES = {"int8": Int8Codec, "fp8": FP8Codec, "int4": Int4Codec}
# From the spec in format.py: the largest finite code L, and the code bits per element.
LEVELS = {"int8": 126, "fp8": 416, "int4": 6}
CODE_BITS = {"int8": 8, "fp8": 8, "int4": 4}
INF = float("inf")


def py_lowbias32(x: int) -> int:
    """The spec's hash in plain Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def parse(packed: Packed) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(block size, seed, scales, codes as int8 per element), read as the spec lays them out."""
    data = bytes(packed.payload.cpu().tolist())
    block, seed, reserved = struct.unpack_from("<IIQ", data)
    assert reserved == 0
    numel, name = packed.header.numel, packed.header.codec
    nblocks = math.ceil(numel / block)
    scales = torch.tensor(struct.unpack_from(f"<{nblocks}f", data, 16), dtype=torch.float32)
    at = 16 + math.ceil(4 * nblocks / 16) * 16
    raw = data[at:]
    assert len(raw) == math.ceil(numel * CODE_BITS[name] / 8)
    if name == "int4":
        nibbles = [(raw[i // 2] >> (4 * (i % 2))) & 0xF for i in range(numel)]
        codes = [(v ^ 8) - 8 for v in nibbles]
        assert numel % 2 == 0 or raw[-1] >> 4 == 0  # the pad nibble is zero
    else:
        codes = list(struct.unpack(f"<{numel}b", raw))
    return block, seed, scales, torch.tensor(codes, dtype=torch.int8)


def sample(numel: int, dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def assert_within_bound(name: str, x: torch.Tensor, out: torch.Tensor, packed: Packed) -> None:
    """Non-finite values kept exactly; the scale rule; each finite element within the bound
    each codec's docstring states, plus the rounding of x' to the dtype (eps * |x'| and one
    subnormal step)."""
    block, _, scales, _ = parse(packed)
    x64, o64 = x.reshape(-1).double(), out.reshape(-1).double()
    assert torch.equal(torch.isnan(o64), torch.isnan(x64))
    infinite = torch.isinf(x64)
    assert torch.equal(o64[infinite], x64[infinite])
    finite = torch.isfinite(x64)
    assert torch.isfinite(o64[finite]).all()

    n, nblocks = x64.numel(), scales.numel()
    padded = torch.zeros(nblocks * block, dtype=torch.float64)
    padded[:n] = torch.where(finite, x64.abs(), 0.0)
    absmax = padded.view(nblocks, block).amax(dim=1)
    # s is the smallest float32 with s * L >= absmax (the products are exact in float64).
    level = LEVELS[name]
    assert (scales.double() * level >= absmax).all()
    below = torch.nextafter(scales, torch.zeros_like(scales)).double() * level
    assert ((below < absmax) | ((scales == 0) & (absmax == 0))).all()

    s = scales.double().repeat_interleave(block)[:n]
    if name == "fp8":
        bound = torch.maximum(2**-4 * x64.abs(), 2**-10 * s) * (1 + 2**-23) + 2**-23 * x64.abs()
    else:
        bound = s
    info = torch.finfo(x.dtype)
    slack = info.eps * o64.abs() + info.smallest_normal * info.eps
    err = (x64 - o64).abs()
    bad = finite & (err > bound + slack)
    assert not bad.any(), (
        f"{int(bad.sum())} elements out of bound, e.g. x={x64[bad][:3].tolist()} "
        f"x'={o64[bad][:3].tolist()} bound={bound[bad][:3].tolist()}"
    )


def round_trip(name: str, x: torch.Tensor, seed: int = 0, block_size: int = 64):
    codec = CLASSES[name](block_size=block_size)
    packed = codec.encode(x, seed=seed)
    out = codec.decode(packed)
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    assert packed.header == Header(name, x.dtype, tuple(x.shape))
    assert packed.payload.numel() == codec.payload_nbytes(x.numel())
    return packed, out


# --- error bounds -----------------------------------------------------------------------------

CASES = ("unit", "small", "large", "outlier", "zero_blocks", "subnormal", "mixed", "extreme")


def case_tensor(case: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """1000 elements (blocks of 64, the last one short) of one kind of data."""
    info = torch.finfo(dtype)
    x = sample(1000, torch.float64, 1.0, seed)
    if case == "small":
        x = x * 1e-3
    elif case == "large":
        x = x * info.max / 8
    elif case == "outlier":
        x[70] = 1e4  # block 1 is scaled by it; its other elements lose most precision
    elif case == "zero_blocks":
        x[:128] = 0.0
        x[300:301] = -0.0
    elif case == "subnormal":
        x = x * info.smallest_normal / 8  # the dtype's subnormal range
    elif case == "mixed":
        x = x * torch.logspace(-6, 6, 16, dtype=torch.float64).repeat_interleave(64)[:1000]
    elif case == "extreme":
        x[::7] = info.max * torch.sign(x[::7])  # scale near the float32 limit for float32
    return x.to(dtype)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES)
def test_error_within_stated_bound(name, dtype, case):
    x = case_tensor(case, dtype, seed=CASES.index(case))
    packed, out = round_trip(name, x, seed=11)
    assert_within_bound(name, x, out, packed)
    if case == "zero_blocks":
        assert (out[:128] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(LOSSY),
    dtype=st.sampled_from(FLOATS),
    numel=st.integers(0, 300),
    block_size=st.sampled_from([2, 4, 6, 32, 256]),
    exponent=st.integers(-30, 30),
    special=st.lists(st.tuples(st.integers(0, 299), st.sampled_from([INF, -INF, math.nan])),
                     max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_bound_holds_for_any_block_size_and_scale(name, dtype, numel, block_size, exponent,
                                                  special, seed):
    x = sample(numel, torch.float64, 10.0**exponent, seed % 1000).to(dtype)
    for i, value in special:
        if i < numel:
            x[i] = value
    packed, out = round_trip(name, x, seed=seed, block_size=block_size)
    assert_within_bound(name, x, out, packed)


def test_outlier_costs_precision_only_in_its_block():
    x = sample(512, torch.float32, 1.0, seed=3)
    x[70] = 1e4
    codec = Int8Codec(block_size=64)
    out = codec.decode(codec.encode(x, seed=0))
    err = (out - x).abs()
    assert err[64:128].max() > 1  # the outlier's block is coarse...
    assert err[128:].max() < 0.05 and err[:64].max() < 0.05  # ...the other blocks are not


# --- stochastic rounding -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(name):
    """The mean of K decodes with different seeds converges to x at the rate the rounding's
    variance s**2 * f * (1 - f) / K predicts (f: the fractional part of x / s). float32, as
    rounding x' to a 16-bit dtype adds a bias of its own."""
    x = sample(256, torch.float32, 1.0, seed=5)
    codec, k = CLASSES[name](block_size=64), 300
    decodes = torch.stack([codec.decode(codec.encode(x, seed=seed)).double() for seed in range(k)])
    scales = parse(codec.encode(x, seed=0))[2].double().repeat_interleave(64)
    ratio = x.double().abs() / scales
    frac = ratio - ratio.floor()
    std = scales * torch.sqrt(frac * (1 - frac) / k)
    bias = decodes.mean(dim=0) - x.double()
    assert (bias.abs() <= 6 * std + 2**-16 * scales).all()  # + float32 rounding of x / s
    z = bias.sum() / torch.sqrt((std**2).sum())
    assert abs(float(z)) < 4
    # Not rounding to nearest: elements with a fractional part go both ways.
    varies = (decodes != decodes[0]).any(dim=0)
    assert varies[(frac > 0.05) & (frac < 0.95)].all()


def test_rounding_goes_up_with_probability_of_the_fraction():
    x = torch.full((8192,), 0.25)
    x[0] = 126.0  # s = 1: every other element is y = 0.25
    codes = parse(Int8Codec(block_size=8192).encode(x, seed=123))[3][1:].double()
    assert set(codes.unique().tolist()) == {0.0, 1.0}
    assert abs(codes.mean().item() - 0.25) < 4 * math.sqrt(0.25 * 0.75 / codes.numel())


def test_rounding_noise_matches_the_spec():
    for seed in (0, 1, 2**31 + 5, 2**32 - 1):
        key = py_lowbias32(seed)
        expected = [(py_lowbias32(i ^ key) >> 8) * 2**-24 for i in range(3000)]
        assert rounding_noise(seed, 3000, torch.device("cpu")).tolist() == expected


def test_int8_codes_follow_the_spec_rounding():
    x = torch.full((1000,), 0.5)
    x[0] = 126.0  # s = 1, y = 0.5: code 1 iff u(i) < 0.5
    seed = 99
    key = py_lowbias32(seed)
    expected = [126] + [int((py_lowbias32(i ^ key) >> 8) * 2**-24 < 0.5) for i in range(1, 1000)]
    assert parse(Int8Codec(block_size=1000).encode(x, seed=seed))[3].tolist() == expected


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_codes_of_both_signs_follow_the_spec_rounding(name):
    """Every code, against the spec's formula in plain Python: a = |y|, f = floor(a),
    q = sign(y) * (f + (u(i) < a - f)), with y = x / s in float32."""
    x = sample(3000, torch.float32, 2.0, seed=4)
    x[::50] = torch.round(x[::50])  # some on the grid of s = 1 ...
    x[:1000:2] = 0.0
    x[1] = -0.0
    seed = 2024
    _, _, scales, codes = parse(CLASSES[name](block_size=1000).encode(x, seed=seed))
    y = (x.view(3, 1000) / scales[:, None]).view(-1).tolist()
    key = py_lowbias32(seed)
    expected = []
    for i, value in enumerate(y):
        a = abs(value)
        up = (py_lowbias32(i ^ key) >> 8) * 2**-24 < a - math.floor(a)
        expected.append(int(math.copysign(math.floor(a) + up, value)))
    assert codes.tolist() == expected
    assert min(expected) < -1 and max(expected) > 1


@pytest.mark.parametrize("name", LOSSY)
def test_the_rounding_is_a_function_of_the_seed_alone(name):
    """No state in the codec: a second codec, or the same one after other encodes, rounds a
    tensor the same way given the same seed (0 when none is given)."""
    x = sample(777, torch.float16, 3.0, seed=1)
    codec = CLASSES[name]()
    first = codec.encode(x, seed=7)
    codec.encode(x, seed=8)
    assert torch.equal(first.payload, CLASSES[name]().encode(x, seed=7).payload)
    assert torch.equal(codec.encode(x, seed=7).payload, first.payload)
    assert torch.equal(codec.encode(x).payload, codec.encode(x, seed=0).payload)
    other = codec.encode(x, seed=8)
    if name == "fp8":
        assert parse(first)[1] == parse(other)[1] == 0  # round to nearest: no seed
        assert torch.equal(first.payload, other.payload)
    else:
        assert (parse(first)[1], parse(other)[1]) == (7, 8)
        assert not torch.equal(first.payload, other.payload)


def test_encoding_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    get_codec("int8").encode(torch.full((100,), 0.3), seed=5)
    get_codec("int4").encode(torch.full((100,), 0.3), seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_seed_of_mixes_its_parts_with_the_spec_hash():
    assert seed_of() == 0
    assert seed_of(5) == py_lowbias32(5)
    assert seed_of(5, 9) == py_lowbias32(py_lowbias32(5) ^ 9)
    assert seed_of(2**40 + 3) == py_lowbias32(3)  # parts count modulo 2**32
    seeds = {seed_of(1, step, site) for step in range(20) for site in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**32 for s in seeds)


# --- payload layout --------------------------------------------------------------------------


def payload_hex(packed: Packed) -> str:
    return bytes(packed.payload.tolist()).hex()


def test_known_answer_fp8():
    x = torch.tensor([416.0, -1.0, 0.5, math.nan, INF, -INF, 0.0])
    packed = FP8Codec(block_size=4).encode(x)
    # B=4, seed 0, reserved | s = 1.0, 0.0 (no finite non-zero), pad | codes: 416 = 0x7D,
    # -1 = 0xB8, 0.5 = 0x30, NaN 0x7F | +inf 0x7E, -inf 0xFE, 0
    expected = ("04000000" "00000000" "0000000000000000"
                "0000803f" "00000000" + "00" * 8 + "7db8307f" "7efe00")
    assert payload_hex(packed) == expected
    out = FP8Codec().decode(packed)
    assert out[:3].tolist() == [416.0, -1.0, 0.5] and out[4:].tolist() == [INF, -INF, 0.0]
    assert math.isnan(out[3])


def test_known_answer_int8_and_int4_on_the_grid():
    # Values on the grid of s round the same way whatever the seed.
    x = torch.tensor([126.0, -63.0, 1.0, 0.0, -INF])
    int8 = Int8Codec(block_size=4).encode(x, seed=0x01020304)
    assert payload_hex(int8) == ("04000000" "04030201" "0000000000000000"
                                 "0000803f" "00000000" + "00" * 8 + "7ec10100" "81")
    y = torch.tensor([6.0, -3.0, 1.0, math.nan, INF])
    int4 = Int4Codec(block_size=4).encode(y, seed=5)
    # s = 1 | codes 6, -3 (0xD), 1, NaN -8 (0x8), +inf 7, pad nibble 0
    assert payload_hex(int4) == ("04000000" "05000000" "0000000000000000"
                                 "0000803f" "00000000" + "00" * 8 + "d6" "81" "07")


@pytest.mark.parametrize("name", LOSSY)
def test_payload_size_formula(name):
    for numel in (0, 1, 2, 3, 31, 33, 255, 256, 257, 1000):
        for block in (2, 8, 256):
            codec = CLASSES[name](block_size=block)
            nblocks = math.ceil(numel / block)
            code_bytes = math.ceil(numel * CODE_BITS[name] / 8)
            expected = 16 + math.ceil(4 * nblocks / 16) * 16 + code_bytes
            assert codec.payload_nbytes(numel) == expected
            assert codec.encode(torch.ones(numel)).payload.numel() == expected


@pytest.mark.parametrize("name,ratio_f32,ratio_bf16", [("int8", 3.9, 1.95), ("fp8", 3.9, 1.95),
                                                       ("int4", 7.5, 3.75)])
def test_compression_ratio(name, ratio_f32, ratio_bf16):
    """The default blocks of 256 cost 4 bytes each: int8 and fp8 are ~3.94x smaller than
    float32 and ~1.97x than bfloat16, int4 ~7.76x and ~3.88x (header included)."""
    for dtype, ratio in ((torch.float32, ratio_f32), (torch.bfloat16, ratio_bf16)):
        x = sample(2**16, dtype, 1.0, seed=2)
        packed = get_codec(name).encode(x)
        assert x.numel() * x.element_size() / packed.nbytes >= ratio


# --- shapes, layouts, sizes --------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (31,), (33,), (257,), (2, 0, 3), (3, 5, 7)])
def test_round_trip_shapes(name, dtype, shape):
    x = sample(math.prod(shape), dtype, 1.0, seed=4).reshape(shape)
    codec = get_codec(name)
    packed = codec.encode(x, seed=1)
    assert packed.payload.numel() == codec.payload_nbytes(x.numel())
    out = codec.decode(packed)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    assert_within_bound(name, x, out, packed)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("numel", [1, 31, 33, 256, 257])
def test_odd_sizes_with_the_default_block(name, numel):
    x = sample(numel, torch.float32, 2.0, seed=numel)
    packed = get_codec(name).encode(x, seed=3)
    assert parse(packed)[0] == 256
    assert_within_bound(name, x, get_codec(name).decode(packed), packed)


@pytest.mark.parametrize("name", LOSSY)
def test_non_contiguous_views_encode_their_logical_order(name):
    base = sample(6 * 10 * 4, torch.bfloat16, 1.0, seed=6).reshape(6, 10, 4)
    views = [base.transpose(0, 2), base[::2, 1::3], base[:, 3],
             sample(5, torch.float16, 1.0, seed=7).reshape(5, 1).expand(5, 70)]
    codec = get_codec(name)
    for v in views:
        assert not v.is_contiguous()
        packed = codec.encode(v, seed=9)
        assert torch.equal(packed.payload, codec.encode(v.contiguous(), seed=9).payload)
        assert torch.equal(codec.decode(packed), codec.decode(codec.encode(v.contiguous(),
                                                                          seed=9)))


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", FLOATS)
def test_non_finite_values_keep_place_and_kind(name, dtype):
    x = sample(300, dtype, 1.0, seed=8)
    x[[0, 5, 200]] = math.nan
    x[[1, 64]] = INF
    x[[2, 299]] = -INF
    x[128:192] = torch.tensor([math.nan, INF, -INF, -math.nan], dtype=dtype).repeat(16)
    packed, out = round_trip(name, x)
    assert_within_bound(name, x, out, packed)
    scales = parse(packed)[2]
    assert scales[2] == 0  # a block of non-finite values only has no scale
    assert 0 < scales[1] < 1  # an inf leaves the scale of its block's finite values alone


@pytest.mark.parametrize("name", LOSSY)
def test_packed_bytes_round_trip(name):
    x = sample(100, torch.float16, 1.0, seed=9).reshape(4, 25)
    packed = get_codec(name).encode(x)
    restored = Packed.from_bytes(packed.to_bytes())
    assert restored.header == packed.header
    assert torch.equal(get_codec(name).decode(restored), get_codec(name).decode(packed))


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSY)
def test_other_dtypes_are_refused(name):
    for t in (torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.int32),
              torch.ones(3, dtype=torch.bool), torch.ones(3).to(torch.float8_e4m3fn)):
        with pytest.raises(TypeError, match=f"floating tensors of dtype float32, float16 or "
                           f"bfloat16, got {t.dtype}; swap it with a lossless codec"):
            get_codec(name).encode(t)


def test_bad_parameters_are_refused():
    for block in (0, 1, 3, 2**31, 2.0):
        with pytest.raises(ValueError, match=f"block_size must be an even int .*{block!r}"):
            Int8Codec(block_size=block)
    for seed in (-1, 2**32, 1.5):
        with pytest.raises(ValueError, match=f"seed must be an int in \\[0, 2\\*\\*32\\), got "
                           f"{seed!r}"):
            get_codec("int4").encode(torch.ones(2), seed=seed)


def test_damaged_and_foreign_payloads_are_refused():
    packed = get_codec("int8").encode(torch.ones(100))
    with pytest.raises(ValueError, match="'int4' cannot decode a 'int8' payload"):
        get_codec("int4").decode(packed)
    with pytest.raises(ValueError, match="int8 payload has 131 bytes, expected 132 for 100 "
                       "elements in blocks of 256"):
        get_codec("int8").decode(Packed(packed.header, packed.payload[:-1]))
    odd = packed.payload.clone()
    odd[:4] = torch.tensor([3, 0, 0, 0])
    with pytest.raises(ValueError, match="block size 3; it must be even"):
        get_codec("int8").decode(Packed(packed.header, odd))
    with pytest.raises(ValueError, match="fewer than 16"):
        get_codec("fp8").decode(Packed(Header("fp8", torch.float32, (1,)), packed.payload[:8]))


def test_decoding_needs_nothing_but_the_payload():
    """A codec with another block size decodes the payload with the block size it carries."""
    x = sample(1000, torch.float32, 1.0, seed=10)
    packed = Int8Codec(block_size=8).encode(x, seed=1)
    assert torch.equal(Int8Codec(block_size=512).decode(packed), Int8Codec(8).decode(packed))
    assert_within_bound("int8", x, get_codec("int8").decode(packed), packed)


# --- registry and statistics -------------------------------------------------------------------


def test_registered_with_wire_ids_and_marked_lossy():
    assert {CODEC_IDS[n] for n in LOSSY} == {3, 4, 5}
    for name in LOSSY:
        assert name in codec_names()
        assert get_codec(name).lossless is False
        header = Header(name, torch.bfloat16, (2, 3))
        assert Header.from_bytes(header.to_bytes()) == header
    assert all(get_codec(n).lossless for n in ("raw", "zvc", "rle"))


def test_reconstruction_error():
    x = sample(4096, torch.float32, 1.0, seed=11)
    assert float(reconstruction_error(get_codec("raw"), x)) == 0.0
    errors = {name: float(reconstruction_error(get_codec(name), x)) for name in LOSSY}
    assert 0 < errors["int8"] < errors["fp8"] < errors["int4"] < 0.3
    codec = Int4Codec()
    packed = codec.encode(x, seed=0)
    direct = torch.linalg.vector_norm(codec.decode(packed).double() - x.double()) / \
        torch.linalg.vector_norm(x.double())
    assert math.isclose(float(reconstruction_error(codec, x, seed=0)), float(direct),
                        rel_tol=1e-6)
    assert parse(codec.encode(x))[1] == 0  # measuring took no seed from the codec's sequence
    with_nan = x.clone()
    with_nan[::100] = math.nan
    fp8 = float(reconstruction_error(get_codec("fp8"), with_nan))
    assert math.isfinite(fp8) and fp8 < 0.05
    zeros = reconstruction_error(get_codec("int8"), torch.zeros(10, dtype=torch.bfloat16))
    assert zeros.dtype == torch.float32 and zeros.dim() == 0 and float(zeros) == 0.0
