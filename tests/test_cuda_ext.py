"""Tests for the compiled CUDA codecs: the build, the loader without a GPU, the lossy element
math run on the host, and (on a GPU) byte-for-byte agreement with the reference codecs."""

from __future__ import annotations

import ctypes
import math
import os
import re
import stat
import subprocess
import warnings
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from cswap_lightning.codecs import CODEC_IDS, Packed, bit_view, cuda_build, get_codec
from cswap_lightning.codecs import cuda as cuda_codecs
from cswap_lightning.codecs.cuda import (
    CudaExponentCodec,
    CudaFP8Codec,
    CudaInt4Codec,
    CudaInt8Codec,
    CudaRLECodec,
    CudaZVCCodec,
    load_extension,
)
from cswap_lightning.codecs.lossy import FP8Codec, Int4Codec, Int8Codec
from cswap_lightning.commands import cli

NVCC = cuda_build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=f"no nvcc: {cuda_build.NVCC_MISSING}")
CUDA_CODECS = {"zvc": CudaZVCCodec, "rle": CudaRLECodec}
LOSSY_CUDA = {"int8": CudaInt8Codec, "fp8": CudaFP8Codec, "int4": CudaInt4Codec}
LOSSY_REFERENCE = {"int8": Int8Codec, "fp8": FP8Codec, "int4": Int4Codec}
LOSSY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HARNESS = Path(__file__).parent / "lossy_host_harness.cu"
EMULATOR = Path(__file__).parent / "kernel_emulator.h"
EMULATED_HARNESS = Path(__file__).parent / "emulated_codec_harness.cpp"


@pytest.fixture(scope="module")
def built_library(tmp_path_factory) -> str:
    """The library compiled for sm_80 and sm_90 into a fresh cache."""
    if NVCC is None:
        pytest.skip(f"no nvcc: {cuda_build.NVCC_MISSING}")
    return str(cuda_build.build(cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture
def fresh_loader():
    load_extension.cache_clear()
    yield
    load_extension.cache_clear()


def sample(numel: int, dtype: torch.dtype, sparsity: float, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN, inf, -0.0 among them) with a fraction of elements zeroed."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) >= sparsity
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).clone()
    bit_view(t)[torch.rand(numel, generator=g) < sparsity] = 0
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) and numel >= 8:
        t[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    return t


def lossy_sample(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Groups of 64 elements with magnitudes from 1e-40 to 1e38 (so subnormal, overflowing
    and all-zero blocks too), some zeros, and NaN, +-inf and -0.0."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-40, 38, 79, dtype=torch.float64)
    groups = magnitudes[torch.randint(0, 79, (numel // 64 + 1,), generator=g)]
    x = torch.randn(numel, generator=g, dtype=torch.float64) * groups.repeat_interleave(64)[:numel]
    x[torch.rand(numel, generator=g) < 0.05] = 0.0
    x = x.to(dtype)
    if numel >= 8:
        x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    return x


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit patterns, except that NaNs need only be NaNs in the same places."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(bit_view(a[~nan]), bit_view(b[~nan]))


# --- build -----------------------------------------------------------------------------------


@pytest.mark.slow
@needs_nvcc
def test_build_produces_private_library_for_sm80_and_sm90(tmp_path):
    path = cuda_build.build(cache_dir=tmp_path)
    assert path.name == "libcswap_codec.so" and path.stat().st_size > 0
    assert path.parent.parent == tmp_path
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert all(f in cuda_build.ARCH_FLAGS for f in (
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"))
    assert cuda_build.build(cache_dir=tmp_path) == path  # cached: same key, no rebuild
    assert list(path.parent.iterdir()) == [path]  # no temporary files left behind

    os.chmod(path, 0o777)
    with pytest.raises(cuda_build.BuildError, match="writable by group or others"):
        cuda_build.check_cache_file(path)
    with pytest.raises(cuda_build.BuildError, match="writable by group or others"):
        cuda_build.build(cache_dir=tmp_path)


def test_missing_nvcc_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.BuildError, match="nvcc .* not found.*CUDA_HOME"):
        cuda_build.build()
    assert cli.main(["build-ext"]) == 1
    assert "install the CUDA toolkit" in capsys.readouterr().err


def test_the_cuda_codecs_encode_without_waiting_unless_the_reference_stands_in(monkeypatch):
    from cswap_lightning.codecs.reference import RLECodec, ZVCCodec

    assert ZVCCodec.encode_waits and RLECodec.encode_waits and not get_codec("int8").encode_waits
    monkeypatch.setattr(cuda_codecs, "load_extension", lambda: None)
    assert cuda_codecs.CudaZVCCodec().encode_waits
    monkeypatch.setattr(cuda_codecs, "load_extension", lambda: object())
    assert not any(c().encode_waits for c in (cuda_codecs.CudaZVCCodec, cuda_codecs.CudaRLECodec))


def test_sources_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["cswap_lightning"]
    src, names = cuda_build.source_dir(), set(cuda_build.SOURCE_NAMES)
    for name in names:
        assert (src / name).is_file()
        assert any(fnmatch(f"cuda_ext/{name}", g) for g in globs), name  # in the wheel
    # every source the build includes is hashed into its key (a changed header builds anew)
    assert {p.name for p in src.iterdir() if p.suffix in (".cu", ".cuh", ".h")} == names
    included = {m for name in names
                for m in re.findall(r'#include "([^"]+)"', (src / name).read_text())}
    assert included <= names


# --- the library's host side, which runs without a GPU -------------------------------------


def test_library_host_api(built_library):
    lib = cuda_codecs.open_library(built_library)
    assert lib.cswap_abi_version() == cuda_codecs.ABI_VERSION
    assert lib.cswap_status_string(1) == b"invalid argument"
    assert lib.cswap_max_payload_bytes(1, 33, 4) == 16 + 16 + 33 * 4
    assert lib.cswap_max_payload_bytes(2, 5, 2) == 16 + 2 * 16 + 5 * 2
    assert lib.cswap_max_payload_bytes(1, 5, 3) == 0

    # Arguments are checked before anything touches the device, so fake pointers are safe.
    fake, ws = 1 << 20, lib.cswap_workspace_bytes(100, 4)
    bad_calls = {
        "elem_size must be 1, 2, 4 or 8": (fake, 100, 3, fake, 1 << 16, None, fake, ws, 4, 256),
        "numel must be below 2\\*\\*32": (fake, 2**32, 4, fake, 1 << 40, None, fake, 1 << 40, 4,
                                           256),
        "block must be a multiple of 32": (fake, 100, 4, fake, 1 << 16, None, fake, ws, 4, 48),
        "grid must be at least 1": (fake, 100, 4, fake, 1 << 16, None, fake, ws, 0, 256),
        "payload buffer has 10 bytes": (fake, 100, 4, fake, 10, None, fake, ws, 4, 256),
        "workspace has 8 bytes": (fake, 100, 4, fake, 1 << 16, None, fake, 8, 4, 256),
        "misaligned pointer": (fake + 2, 100, 4, fake, 1 << 16, None, fake, ws, 4, 256),
    }
    for message, args in bad_calls.items():
        assert lib.cswap_zvc_compress(*args, None) == 1
        with pytest.raises(RuntimeError, match=f"invalid argument: {message}"):
            cuda_codecs.check_status(lib, lib.cswap_rle_compress(*args, None), "rle compress")
    assert lib.cswap_zvc_decompress(fake, 8, fake, 100, 4, fake, ws, 4, 256, None) == 1
    assert b"fewer than the 32" in lib.cswap_last_error()


def test_lossy_host_api(built_library):
    lib = cuda_codecs.open_library(built_library)
    for name, codec in LOSSY_REFERENCE.items():
        for numel in (0, 1, 31, 33, 257, 10_000):
            for block_size in (2, 256, 1000):
                assert lib.cswap_lossy_payload_bytes(CODEC_IDS[name], numel, block_size) == \
                    codec(block_size).payload_nbytes(numel)
    assert lib.cswap_lossy_payload_bytes(1, 100, 256) == 0  # zvc is not lossy
    assert lib.cswap_lossy_payload_bytes(3, 100, 255) == 0

    # Arguments are checked before anything touches the device, so fake pointers are safe.
    fake, int8 = 1 << 20, CODEC_IDS["int8"]
    bad_compress = {
        "codec must be int8 \\(3\\), fp8 \\(4\\) or int4 \\(5\\), got 2":
            (2, fake, 100, 0, 256, 0, fake, 1 << 16, 4, 256),
        "dtype must be float32 \\(0\\), float16 \\(1\\) or bfloat16 \\(2\\), got 4":
            (int8, fake, 100, 4, 256, 0, fake, 1 << 16, 4, 256),
        "numel must be below 2\\*\\*32": (int8, fake, 2**32, 0, 256, 0, fake, 1 << 40, 4, 256),
        "grid must be at least 1": (int8, fake, 100, 0, 256, 0, fake, 1 << 16, 0, 256),
        "block must be a multiple of 32": (int8, fake, 100, 0, 256, 0, fake, 1 << 16, 4, 48),
        "block_size must be even and at least 2, got 7":
            (int8, fake, 100, 0, 7, 0, fake, 1 << 16, 4, 256),
        "payload buffer has 131 bytes, needs 132": (int8, fake, 100, 0, 256, 0, fake, 131, 4, 256),
        "misaligned pointer: elements need 4-byte": (int8, fake + 2, 100, 0, 256, 0, fake, 1 << 16,
                                                     4, 256),
        "misaligned pointer: elements need 2-byte": (int8, fake + 1, 100, 1, 256, 0, fake, 1 << 16,
                                                     4, 256),
        "null device pointer": (int8, None, 100, 0, 256, 0, fake, 1 << 16, 4, 256),
    }
    for message, args in bad_compress.items():
        with pytest.raises(RuntimeError, match=f"invalid argument: {message}"):
            cuda_codecs.check_status(lib, lib.cswap_lossy_compress(*args, None), "compress")
    assert lib.cswap_lossy_decompress(int8, fake, 8, fake, 100, 0, 4, 256, None) == 1
    assert b"fewer than the 16 of its preamble" in lib.cswap_last_error()
    assert lib.cswap_lossy_decompress(int8, fake, 132, fake, 100, 3, 4, 256, None) == 1


@pytest.fixture(scope="module")
def lossy_harness(tmp_path_factory) -> Path:
    """tests/lossy_host_harness.cu built for the host (no GPU needed to run it)."""
    if NVCC is None:
        pytest.skip(f"no nvcc: {cuda_build.NVCC_MISSING}")
    out = tmp_path_factory.mktemp("harness") / "lossy_host_harness"
    cmd = [NVCC, "-std=c++17", "-gencode=arch=compute_80,code=sm_80",
           "-I", str(cuda_build.source_dir()), "-o", str(out), str(HARNESS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("name", sorted(LOSSY_REFERENCE))
def test_lossy_element_math_matches_the_reference_on_the_host(lossy_harness, tmp_path, name):
    """The kernels' hash, scales, rounding and code layout, run on the CPU, give the reference
    payload byte for byte; their decoding gives the reference values."""
    for dtype in LOSSY_DTYPES:
        x = lossy_sample(20_011, dtype, seed=LOSSY_DTYPES.index(dtype))
        (tmp_path / "in.bin").write_bytes(bytes(x.float().view(torch.uint8).tolist()))
        for block_size, seed in [(256, 0), (2, 7), (1000, 2**32 - 3)]:
            args = [str(CODEC_IDS[name]), str(block_size), str(seed)]
            files = [str(tmp_path / f) for f in ("in.bin", "payload.bin", "decoded.bin")]
            subprocess.run([str(lossy_harness), *args, *files], check=True, timeout=60)
            reference = LOSSY_REFERENCE[name](block_size)
            packed = reference.encode(x, seed=seed)
            assert (tmp_path / "payload.bin").read_bytes() == bytes(packed.payload.tolist())
            decoded = torch.frombuffer(bytearray((tmp_path / "decoded.bin").read_bytes()),
                                       dtype=torch.float32)
            assert_same_values(decoded.to(dtype), reference.decode(packed))


# --- the kernels themselves, run on the CPU by tests/kernel_emulator.h -------------------------

_LAUNCH = re.compile(r"(?m)^([ \t]*)([^\n;{}]*?)<<<(.*?)>>>\((.*?)\);", re.DOTALL)
_DYNAMIC_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")
_STATIC_SHARED = re.compile(r"__shared__ (\w+) (\w+)(\[\w+\])?;")
# (grid, block): one block of one warp, several blocks, and a block of an odd number of warps.
EMULATED_LAUNCHES = [(1, 32), (3, 64), (5, 96)]


_LOCAL_INCLUDE = re.compile(r'(?m)^#include "(\w+\.cuh)"\n')


def one_source(name: str, seen: set[str] | None = None) -> str:
    """The shipped source ``name`` with the headers of its own folder it includes written in
    place (each once, as ``#pragma once`` would), so that the emulator rewrites all of it."""
    seen = set() if seen is None else seen
    text = (cuda_build.source_dir() / name).read_text().replace("#pragma once\n", "")
    return _LOCAL_INCLUDE.sub(
        lambda m: "" if m[1] in seen else (seen.add(m[1]) or one_source(m[1], seen)), text)


def emulated_source(cu: str) -> str:
    """cswap_codec.cu (with its headers in place) with its launches and shared memory
    rewritten for the emulator."""
    out, launches = _LAUNCH.subn(
        lambda m: f"{m[1]}emu::launch(emu::Config({m[3]}), [&] {{ {m[2]}({m[4]}); }});", cu)
    out, arrays = _DYNAMIC_SHARED.subn(r"\1 *\2 = emu::dynamic_smem<\1>();", out)
    out, statics = _STATIC_SHARED.subn(r"auto &\2 = emu::static_smem<\1\3>(__LINE__);", out)
    assert launches == cu.count("<<<") and arrays == cu.count("extern __shared__")
    assert arrays + statics == cu.count("__shared__ ")
    return out


@pytest.fixture(scope="module")
def emulated_harness(tmp_path_factory) -> Path:
    """tests/emulated_codec_harness.cpp: the library's kernels on CPU threads, built with the
    address and alignment sanitizers where the host compiler has them (a 16-byte load from an
    address that is not 16-byte aligned stops the harness, as it would fault on a GPU)."""
    if NVCC is None:
        pytest.skip(f"no nvcc: {cuda_build.NVCC_MISSING}")
    folder = tmp_path_factory.mktemp("emulated")
    cu = one_source("cswap_codec.cu")
    (folder / "cswap_codec_emulated.cpp").write_text(emulated_source(cu))
    out = folder / "emulated_codec_harness"
    sanitizers = ["-Xcompiler", "-fsanitize=address", "-Xcompiler", "-fsanitize=alignment",
                  "-Xcompiler", "-fno-sanitize-recover=alignment"]
    for sanitize in (sanitizers, []):
        obj = folder / "harness.o"
        compile_ = [NVCC, "-std=c++20", "-O1", "-c", *sanitize, "-Xcompiler", "-pthread",
                    "-I", str(folder), "-I", str(cuda_build.source_dir()),
                    "-Xcompiler", f"-include,{EMULATOR}", "-o", str(obj), str(EMULATED_HARNESS)]
        link = [NVCC, "--cudart", "none", *sanitize, "-Xcompiler", "-pthread", "-o", str(out),
                str(obj)]
        done = subprocess.run(compile_, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode == 0:
            done = subprocess.run(link, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode == 0:
            return out
    pytest.fail(f"the emulated harness did not build: {done.stderr}")


def run_emulated(harness: Path, commands: list[list]) -> None:
    """Runs the harness commands in one process (starting the threads is its main cost)."""
    script = "".join(" ".join(map(str, c)) + "\n" for c in commands)
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0"}
    done = subprocess.run([str(harness)], input=script, capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"


def patterned(numel: int, dtype: torch.dtype, pattern: float | str, seed: int) -> torch.Tensor:
    """``sample`` for a float (the fraction of zeros); else random non-zero bit patterns with
    "dense": no zero, "zeros": only zeros, "alternate": every other element zero, "runs": zero
    runs of 1 to 3000 elements between 1 to 40 non-zeros."""
    if isinstance(pattern, float):
        return sample(numel, dtype, pattern, seed)
    t = sample(numel, dtype, 0.0, seed)
    bits = bit_view(t)
    bits[bits == 0] = 1
    if pattern == "zeros":
        bits.zero_()
    elif pattern == "alternate":
        bits[::2] = 0
    elif pattern == "runs":
        g = torch.Generator().manual_seed(seed)
        i = 0
        while i < numel:
            i += int(torch.randint(1, 41, (1,), generator=g))
            run = int(torch.randint(1, 3001, (1,), generator=g))
            bits[i:i + run] = 0
            i += run
    return t


# A tile is 32 bytes per thread: 1024 elements of 1 byte for a block of 32 threads, 256 of 4.
# (dtype, numel, pattern, grid, block, shift): every element size, tensors of 0 to 3 elements,
# sizes that are no multiple of 32 or of a 16-byte pack, tiles walked by a few blocks or many,
# and elements that start `shift` elements past a 16-byte boundary (the element-wise path).
EMULATED_CASES = [
    (torch.bool, 0, 0.5, 1, 32, 0), (torch.bool, 33, 1.0, 3, 64, 0),
    (torch.bool, 10_243, 0.5, 3, 32, 0), (torch.bool, 3000, "alternate", 1, 32, 0),
    (torch.uint8, 5000, "alternate", 5, 64, 3), (torch.uint8, 7777, "runs", 3, 32, 0),
    (torch.uint8, 2, "dense", 1, 32, 1), (torch.uint8, 17, 0.5, 3, 64, 15),
    (torch.float16, 1, 0.0, 5, 96, 0), (torch.float16, 3, "zeros", 1, 32, 0),
    (torch.float16, 1000, 0.97, 1, 32, 0), (torch.float16, 10_243, 0.9, 3, 64, 0),
    (torch.bfloat16, 4093, "runs", 5, 96, 5), (torch.bfloat16, 515, 0.5, 3, 32, 7),
    (torch.float32, 31, 0.5, 3, 64, 0), (torch.float32, 32, 0.0, 5, 96, 0),
    (torch.float32, 10_243, 0.5, 5, 96, 0), (torch.float32, 5, "dense", 1, 32, 0),
    (torch.float32, 6000, "zeros", 3, 32, 0), (torch.float32, 9001, "runs", 8, 32, 0),
    (torch.float32, 2049, "dense", 3, 64, 1), (torch.float32, 3333, 0.6, 3, 32, 3),
    (torch.float64, 33, 0.5, 1, 32, 0), (torch.float64, 1000, 0.5, 3, 64, 0),
    (torch.float64, 10_243, 0.97, 3, 64, 0), (torch.float64, 4000, "runs", 5, 32, 1),
    (torch.float64, 257, "alternate", 3, 32, 1),
]


@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
def test_emulated_kernels_match_the_reference(emulated_harness, tmp_path, name):
    """zvc and rle encode give the reference payload byte for byte, and decode the reference
    payload bit for bit, over EMULATED_CASES."""
    commands, checks = [], []
    for i, (dtype, numel, pattern, grid, block, shift) in enumerate(EMULATED_CASES):
        t = patterned(numel, dtype, pattern, seed=numel)
        payload = get_codec(name).encode(t).payload.numpy().tobytes()
        f = {k: tmp_path / f"{i}-{k}" for k in ("in", "payload", "ref", "out")}
        f["in"].write_bytes(bit_view(t).numpy().tobytes())
        f["ref"].write_bytes(payload)
        args = [CODEC_IDS[name], dtype.itemsize, numel, grid, block, shift]
        commands += [["encode", *args, 0, 0, f["in"], f["payload"]],
                     ["decode", *args, f["ref"], f["out"]]]
        checks.append((f, (dtype, numel, pattern, grid, block, shift)))
    run_emulated(emulated_harness, commands)
    for f, case in checks:
        assert f["payload"].read_bytes() == f["ref"].read_bytes(), case
        assert f["out"].read_bytes() == f["in"].read_bytes(), case


def test_emulated_look_back_combines_tiles_in_order(emulated_harness):
    """The look-back of 70 tiles running at once (three windows of 32), some publishing late,
    gives each tile the in-order combination of its predecessors' summaries, for the zvc count,
    the rle encode counts and the rle decode run state (whose combination is not commutative).
    The harness exits 1 on the first wrong prefix, which ``run_emulated`` asserts against."""
    run_emulated(emulated_harness, [["lookback", 70]])


@pytest.mark.parametrize("name", sorted(LOSSY_REFERENCE))
def test_emulated_lossy_kernels_match_the_reference(emulated_harness, tmp_path, name):
    """The lossy kernels give the reference payload for the same seed and decode it to the
    reference values, with quantization blocks smaller and larger than the thread blocks, a
    multiple of the 16-byte group of elements or not (6: element by element), elements
    16-byte aligned or ``shift`` elements past (element by element), and last groups cut
    short."""
    # (numel, block_size, seed, shift)
    cases = [(0, 256, 3, 0), (1, 2, 7, 0), (33, 256, 0, 0), (1001, 64, 2**32 - 3, 0),
             (5003, 1000, 5, 0), (1003, 256, 11, 1), (777, 6, 13, 0), (4099, 24, 17, 3),
             (2048, 256, 19, 0)]
    commands, checks = [], []
    for d, dtype in enumerate(LOSSY_DTYPES):
        for i, (numel, block_size, seed, shift) in enumerate(cases):
            grid, block = EMULATED_LAUNCHES[(i + d) % len(EMULATED_LAUNCHES)]
            x = lossy_sample(numel, dtype, seed=numel)
            reference = LOSSY_REFERENCE[name](block_size)
            expected = reference.encode(x, seed=seed)
            f = {k: tmp_path / f"{d}-{i}-{k}" for k in ("in", "payload", "ref", "out")}
            f["in"].write_bytes(bit_view(x).numpy().tobytes())
            f["ref"].write_bytes(expected.payload.numpy().tobytes())
            args = [CODEC_IDS[name], LOSSY_DTYPES.index(dtype), numel, grid, block, shift]
            commands += [["encode", *args, block_size, seed, f["in"], f["payload"]],
                         ["decode", *args, f["ref"], f["out"]]]
            checks.append((f, reference.decode(expected), (dtype, numel, block_size, grid)))
    run_emulated(emulated_harness, commands)
    for f, want, case in checks:
        assert f["payload"].read_bytes() == f["ref"].read_bytes(), case
        decoded = bytearray(f["out"].read_bytes())
        assert_same_values(torch.frombuffer(decoded, dtype=want.dtype) if decoded else
                           torch.empty(0, dtype=want.dtype), want)


def exponent_sample(numel: int, seed: int, pattern: str = "normal") -> torch.Tensor:
    """bfloat16 activations for the exponent codec: "normal" (a transformer's: one scale
    per 4096 elements), "special" (zeros, signed zeros, infinities, NaNs and subnormals mixed
    in: groups 8 bits wide) or "flat" (every element the same: groups 0 bits wide)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(numel // 4096 + 1, generator=g).mul(8).exp2().repeat_interleave(4096)
    x = torch.randn(numel, generator=g) * scale[:numel]
    if pattern == "special":
        picks = torch.randint(0, 7, (numel,), generator=g)
        for code, value in enumerate((0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40)):
            x[picks == code] = value
    elif pattern == "flat":
        x.fill_(-3.5)
    return x.to(torch.bfloat16)


# (numel, pattern, grid, block, shift): empty, one group cut short, several tiles of 256
# groups walked by few blocks or one, a last tile cut short, elements off 16-byte alignment.
EXPONENT_CASES = [(0, "normal", 1, 32, 0), (1, "special", 3, 64, 0), (33, "normal", 5, 96, 1),
                  (8192, "flat", 1, 32, 0), (20_000, "normal", 3, 64, 3),
                  (9000, "special", 5, 96, 0), (50_001, "normal", 2, 1024, 0)]


def test_emulated_exponent_kernels_match_the_reference(emulated_harness, tmp_path):
    """The exponent kernels give the reference payload byte for byte and decode it bit for
    bit, over EXPONENT_CASES."""
    commands, checks = [], []
    for i, (numel, pattern, grid, block, shift) in enumerate(EXPONENT_CASES):
        t = exponent_sample(numel, seed=i, pattern=pattern)
        f = {k: tmp_path / f"{i}-{k}" for k in ("in", "payload", "ref", "out")}
        f["in"].write_bytes(bit_view(t).numpy().tobytes())
        f["ref"].write_bytes(get_codec("exponent").encode(t).payload.numpy().tobytes())
        args = [CODEC_IDS["exponent"], 2, numel, grid, block, shift]
        commands += [["encode", *args, 0, 0, f["in"], f["payload"]],
                     ["decode", *args, f["ref"], f["out"]]]
        checks.append((f, (numel, pattern, grid, block, shift)))
    run_emulated(emulated_harness, commands)
    for f, case in checks:
        assert f["payload"].read_bytes() == f["ref"].read_bytes(), case
        assert f["out"].read_bytes() == f["in"].read_bytes(), case


def test_emulated_decoders_stay_inside_damaged_payloads(emulated_harness, tmp_path):
    """Truncated payloads, absurd counts and random bytes decode to something, never reading
    or writing outside the buffers (the harness is built with the address sanitizer)."""
    g = torch.Generator().manual_seed(0)
    commands = []
    for name in ("zvc", "rle", "exponent", "int8", "fp8", "int4"):
        numel = 1000
        dtype = torch.bfloat16 if name == "exponent" else torch.float16
        t = lossy_sample(numel, dtype) if name in LOSSY_REFERENCE else sample(numel, dtype, 0.9)
        payload = bytearray(get_codec(name).encode(t).payload.numpy().tobytes())
        counts = bytearray(payload)
        counts[0:8] = (2**63 + 5).to_bytes(8, "little")  # nnz, nruns or block size and seed
        small = bytearray(payload)
        small[0:8] = (2).to_bytes(8, "little")
        noise = bytes(torch.randint(0, 256, (len(payload),), dtype=torch.uint8, generator=g))
        damaged = [payload[:16], payload[:-1], payload[: len(payload) // 2], counts, small,
                   noise, payload + bytes(16)]
        type_ = LOSSY_DTYPES.index(dtype) if name in LOSSY_REFERENCE else dtype.itemsize
        for i, data in enumerate(damaged):
            if name == "zvc" and len(data) < 16 + 128:
                continue  # shorter than the mask: refused before any launch
            planes = len(data) - (16 + 1008 + 2 * 32)  # the exponent payload's planes' bytes
            if name == "exponent" and (planes < 0 or planes % 4):
                continue  # not a whole payload of 1000 elements: refused before any launch
            path = tmp_path / f"{name}-{i}"
            path.write_bytes(bytes(data))
            commands.append(["decode", CODEC_IDS[name], type_, numel, 3, 64, 0, path,
                             tmp_path / f"{name}-{i}.out"])
    run_emulated(emulated_harness, commands)
    for command in commands:  # each one ran to the end and wrote a whole tensor
        assert command[-1].stat().st_size == numel * dtype.itemsize, command


@pytest.mark.parametrize("name", sorted(LOSSY_CUDA))
def test_cpu_tensors_use_the_lossy_reference(name):
    codec = LOSSY_CUDA[name](block_size=64, grid=3, block=64)
    assert codec.name == name and codec.lossless is False
    for dtype in LOSSY_DTYPES:
        x = lossy_sample(1000, dtype, seed=1)
        packed = codec.encode(x, seed=5)
        expected = LOSSY_REFERENCE[name](64).encode(x, seed=5)
        assert torch.equal(packed.payload, expected.payload)
        assert_same_values(codec.decode(packed), LOSSY_REFERENCE[name]().decode(expected))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_library_reports_missing_device(built_library):
    lib = cuda_codecs.open_library(built_library)
    assert lib.cswap_check_device() == 2
    assert lib.cswap_last_error().startswith(b"the CUDA runtime cannot see a device")


def test_loader_warns_once_without_cuda(monkeypatch, fresh_loader):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="CUDA codec library is unavailable: CUDA is not "
                      "available.*pure-torch reference"):
        assert load_extension() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_extension() is None  # no second warning
        assert cuda_codecs.enable_cuda_codecs() is False


def test_loader_warns_when_nvcc_is_missing(monkeypatch, fresh_loader):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.warns(RuntimeWarning, match="nvcc .* not found"):
        assert load_extension() is None


@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool,
                                   torch.float64])
def test_cpu_tensors_use_the_reference(name, dtype):
    codec, reference = CUDA_CODECS[name](), get_codec(name)
    assert codec.name == name
    for numel, sparsity in [(0, 0.5), (1, 0.0), (33, 0.5), (100, 1.0), (1000, 0.9)]:
        t = sample(numel, dtype, sparsity, seed=numel)
        packed = codec.encode(t[1:] if numel else t)
        expected = reference.encode(t[1:] if numel else t)
        assert packed.header == expected.header
        assert torch.equal(packed.payload, expected.payload)
        out = codec.decode(packed)
        assert torch.equal(bit_view(out), bit_view(t[1:] if numel else t))


# --- on a GPU: the same bytes as the reference ----------------------------------------------

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.bool]
SIZES = [0, 1, 31, 32, 33, 2**20 + 7]
# (grid, block); None: the default grid. Small grids make each block walk several tiles.
LAUNCHES = [(None, 256), (1, 32), (3, 64), (7, 1024)]


def assert_matches_reference(name: str, t: torch.Tensor, codec=None) -> None:
    codec = codec or CUDA_CODECS[name]()
    expected = get_codec(name).encode(t.cpu())
    packed = codec.encode(t)
    assert packed.payload.is_cuda
    assert packed.header == expected.header
    assert packed.payload.numel() == expected.payload.numel()
    assert torch.equal(packed.payload.cpu(), expected.payload), "payload bytes differ"
    out = codec.decode(packed)
    assert out.is_cuda and out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(bit_view(out.cpu()), bit_view(t.cpu().contiguous()))
    # Reference payloads decode on the GPU too.
    cross = codec.decode(type(expected)(expected.header, expected.payload.cuda()))
    assert torch.equal(bit_view(cross.cpu()), bit_view(t.cpu().contiguous()))


@pytest.fixture
def cuda_lib():
    if load_extension() is None:
        pytest.fail("the CUDA codec library did not load on a CUDA machine")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 1.0])
def test_gpu_matches_reference(cuda_lib, name, dtype, numel, sparsity):
    assert_matches_reference(name, sample(numel, dtype, sparsity, seed=numel).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8, torch.int16,
                                   torch.float8_e4m3fn])
def test_gpu_other_element_sizes(cuda_lib, name, dtype):
    for numel in (1, 33, 70_001):
        assert_matches_reference(name, sample(numel, dtype, 0.6, seed=numel).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("grid,block", LAUNCHES)
def test_gpu_launch_configurations(cuda_lib, name, grid, block):
    codec = CUDA_CODECS[name](grid=grid, block=block)
    for numel, sparsity in [(1, 0.5), (32 * block * 5 + 3, 0.5), (300_007, 0.97),
                            (300_007, 0.03), (2**20 + 7, 0.5)]:
        assert_matches_reference(name, sample(numel, torch.float16, sparsity, numel).cuda(), codec)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_gpu_many_tiles_at_once(cuda_lib, name, dtype):
    """Thousands of tiles in flight (the look-back under the GPU's real concurrency and memory
    model), with long runs and alternating zeros, from 16-byte aligned and misaligned starts;
    repeated encodes give the same bytes."""
    codec = CUDA_CODECS[name](grid=4096, block=64)  # 512 to 4096 elements a tile
    for pattern in (0.5, "runs", "alternate"):
        t = patterned(2**21 + 13, dtype, pattern, seed=3).cuda()
        assert_matches_reference(name, t)
        assert_matches_reference(name, t[1:], codec)
        first = codec.encode(t).payload
        for _ in range(3):
            assert torch.equal(codec.encode(t).payload, first)


@pytest.mark.gpu
@pytest.mark.parametrize("grid,block", LAUNCHES)
def test_gpu_exponent_matches_reference(cuda_lib, grid, block):
    """The exponent kernels on the device: the reference's bytes and the tensor back bit for
    bit, for each pattern, sizes up to thousands of tiles, and views off alignment."""
    codec = CudaExponentCodec(grid=grid, block=block)
    for numel in (0, 1, 33, 8192 * 3 + 5, 2**21 + 13):
        for pattern in ("normal", "special", "flat"):
            t = exponent_sample(numel, seed=numel, pattern=pattern).cuda()
            assert_matches_reference("exponent", t, codec)
    t = exponent_sample(4099, seed=1).cuda()
    assert_matches_reference("exponent", t[3:], codec)
    assert_matches_reference("exponent", t[: 64 * 64].view(64, 64).t(), codec)


def test_cpu_tensors_use_the_exponent_reference():
    t = exponent_sample(1000, seed=2)
    packed = CudaExponentCodec().encode(t)
    assert torch.equal(packed.payload, get_codec("exponent").encode(t).payload)
    assert torch.equal(bit_view(CudaExponentCodec().decode(packed)), bit_view(t))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_misaligned_views_and_layouts(cuda_lib, name, dtype):
    base = sample(4099, dtype, 0.5, seed=5).cuda()
    for offset in (1, 3, 7, 31, 33):
        assert_matches_reference(name, base[offset:])
    assert_matches_reference(name, base[: 64 * 64].view(64, 64).t())  # non-contiguous
    assert_matches_reference(name, base[1::3])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_special_values(cuda_lib, name, dtype):
    values = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-3, 0.0]
    t = torch.tensor(values * 9, dtype=dtype)
    bit_view(t)[7] = 1  # smallest positive denormal
    assert_matches_reference(name, t.cuda())
    runs = torch.zeros(10_000, dtype=dtype)
    runs[[0, 31, 32, 33, 4095, 4096, 9999]] = -0.0  # non-zero bits between runs of zeros
    assert_matches_reference(name, runs.cuda())


@pytest.mark.gpu
def test_gpu_encode_runs_on_the_current_stream(cuda_lib):
    t = sample(2**20 + 7, torch.float32, 0.5).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        packed = CudaZVCCodec().encode(t)
        out = CudaZVCCodec().decode(packed)
    side.synchronize()
    assert torch.equal(bit_view(out), bit_view(t))
    assert math.prod(out.shape) == t.numel()


# --- on a GPU: the lossy kernels give the reference's bytes for the same seed ----------------

LOSSY_SIZES = [0, 1, 31, 33, 257, 2**20 + 7]


def assert_lossy_matches_reference(name: str, x: torch.Tensor, seed: int, codec=None) -> None:
    codec = codec or LOSSY_CUDA[name]()
    reference = LOSSY_REFERENCE[name](codec.block_size)
    expected = reference.encode(x.cpu(), seed=seed)
    packed = codec.encode(x, seed=seed)
    assert packed.payload.is_cuda and packed.header == expected.header
    assert packed.payload.numel() == expected.payload.numel()
    assert torch.equal(packed.payload.cpu(), expected.payload), "payload bytes differ"
    out = codec.decode(packed)
    assert out.is_cuda and out.is_contiguous()
    want = reference.decode(expected)
    assert_same_values(out.cpu(), want)
    # Reference payloads decode on the GPU, and kernel payloads with the reference.
    assert_same_values(codec.decode(Packed(expected.header, expected.payload.cuda())).cpu(), want)
    assert_same_values(reference.decode(Packed(packed.header, packed.payload.cpu())), want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOSSY_CUDA))
@pytest.mark.parametrize("dtype", LOSSY_DTYPES)
@pytest.mark.parametrize("numel", LOSSY_SIZES)
def test_gpu_lossy_matches_reference(cuda_lib, name, dtype, numel):
    x = lossy_sample(numel, dtype, seed=numel).cuda()
    for block_size, seed in [(256, 0), (2, 7), (1000, 2**32 - 3)]:
        assert_lossy_matches_reference(name, x, seed, LOSSY_CUDA[name](block_size))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOSSY_CUDA))
@pytest.mark.parametrize("grid,block", LAUNCHES)
def test_gpu_lossy_launch_configurations(cuda_lib, name, grid, block):
    """Thread blocks larger and smaller than the quantization blocks, few and many of them."""
    for block_size in (2, 64, 256, 4096):
        codec = LOSSY_CUDA[name](block_size, grid=grid, block=block)
        for numel in (1, block_size * 5 + 3, 300_007):
            x = lossy_sample(numel, torch.float16, seed=numel).cuda()
            assert_lossy_matches_reference(name, x, seed=block_size, codec=codec)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOSSY_CUDA))
@pytest.mark.parametrize("dtype", LOSSY_DTYPES)
def test_gpu_lossy_views_and_special_values(cuda_lib, name, dtype):
    base = lossy_sample(4099, dtype, seed=5).cuda()
    for offset in (1, 3, 33):
        assert_lossy_matches_reference(name, base[offset:], seed=offset)
    assert_lossy_matches_reference(name, base[: 64 * 64].view(64, 64).t(), seed=1)
    assert_lossy_matches_reference(name, base[1::3], seed=2)
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny, info.tiny * info.eps, 0.0, -0.0, float("nan"),
             float("inf")]
    assert_lossy_matches_reference(name, torch.tensor(edges * 40, dtype=dtype).cuda(), seed=3)
    assert_lossy_matches_reference(name, torch.full((777,), float("nan"), dtype=dtype).cuda(), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOSSY_CUDA))
def test_gpu_lossy_codec_rounds_as_the_reference_given_the_seed(cuda_lib, name):
    x = lossy_sample(10_000, torch.bfloat16, seed=6)
    codec, reference = LOSSY_CUDA[name](), LOSSY_REFERENCE[name]()
    for seed in (41, 42, 2**32 - 1):
        assert torch.equal(codec.encode(x.cuda(), seed=seed).payload.cpu(),
                           reference.encode(x, seed=seed).payload)


@pytest.mark.gpu
def test_gpu_lossy_damaged_payload_decodes_to_nan(cuda_lib):
    codec = CudaInt8Codec()
    packed = codec.encode(lossy_sample(1000, torch.float32).cuda(), seed=0)
    short = codec.decode(Packed(packed.header, packed.payload[:-16].clone()))
    odd = packed.payload.clone()
    odd[:4] = torch.tensor([3, 0, 0, 0])  # block size 3: odd
    for out in (short, codec.decode(Packed(packed.header, odd))):
        assert torch.isnan(out).all()


@pytest.mark.gpu
def test_gpu_lossy_runs_on_the_current_stream(cuda_lib):
    x = lossy_sample(2**20 + 7, torch.float32).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        packed = CudaInt4Codec().encode(x, seed=9)
        out = CudaInt4Codec().decode(packed)
    side.synchronize()
    expected = Int4Codec().encode(x.cpu(), seed=9)
    assert torch.equal(packed.payload.cpu(), expected.payload)
    assert_same_values(out.cpu(), Int4Codec().decode(expected))


def test_ctypes_signatures_cover_the_header():
    header = (cuda_build.source_dir() / "cswap_codec.h").read_text()
    declared = {line.split("(")[0].split()[-1].lstrip("*") for line in header.splitlines()
                if line.startswith(("int cswap_", "const char *cswap_", "uint64_t cswap_"))}
    assert declared == set(cuda_codecs._SIGNATURES)
    assert all(isinstance(v[0], type) and issubclass(v[0], ctypes._SimpleCData)
               for v in cuda_codecs._SIGNATURES.values())


def test_environment_variable_opts_every_offloader_in_once(monkeypatch):
    from cswap_lightning import CSwapConfig, Offloader
    from cswap_lightning.codecs import cuda

    calls = []
    monkeypatch.setattr(cuda, "enable_cuda_codecs", lambda: calls.append(1) or True)
    for value, expected in ((None, []), ("1", [1])):
        if value is None:
            monkeypatch.delenv("CSWAP_CUDA_CODECS", raising=False)
        else:
            monkeypatch.setenv("CSWAP_CUDA_CODECS", value)
        cuda.enable_cuda_codecs_if_requested.cache_clear()
        for _ in range(2):
            Offloader(CSwapConfig()).close()
        assert calls == expected
    cuda.enable_cuda_codecs_if_requested.cache_clear()
