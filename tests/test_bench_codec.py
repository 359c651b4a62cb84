"""`cswap bench codec` at tiny sizes: real codecs, real timings, real ReLU activations."""

import json

import pytest
import torch

from cswap_lightning.codecs import Header, get_codec
from cswap_lightning.commands.bench_codec import (
    Contender,
    measure,
    nvcomp_lines,
    parse_size,
    relu_activations,
    run_codec_bench,
)
from cswap_lightning.commands.cli import main

KIB = 1024


@pytest.fixture(scope="module")
def tiny_run() -> dict:
    return run_codec_bench("cpu", sizes=[64 * KIB], sparsities=[0, 90], quick=True, relu=False,
                           dense=False)


def test_every_codec_and_dtype_is_measured_and_round_trips(tiny_run):
    rows = tiny_run["rows"]
    cases = {(r["codec"], r["dtype"], r["target_sparsity"]) for r in rows}
    assert cases == {(c, d, s) for c in ("zvc", "rle", "int8")
                     for d in ("float32", "float16", "bfloat16") for s in (0, 90)} | {
        ("exponent", "bfloat16", s) for s in (0, 90)}  # bfloat16 only
    for r in rows:
        assert r["impl"] == "reference (pure torch)"
        assert r["compress_gbps"] > 0 and r["decompress_gbps"] > 0 and r["copy_gbps"] > 0
        assert r["bytes"] == 64 * KIB
        assert abs(r["sparsity"] - r["target_sparsity"] / 100) < 0.03  # uniform random zeros


def test_a_transformers_dense_activations_are_measured_in_bfloat16():
    doc = run_codec_bench("cpu", sizes=[64 * KIB], dtypes=["bfloat16"], codecs=["zvc",
                          "exponent"], sparsities=[0], quick=True, relu=False)
    dense = {(r["source"], r["codec"]): r["ratio"] for r in doc["rows"]
             if r["target_sparsity"] is None}
    assert set(dense) == {(s, c) for s in ("bert gelu", "llama silu * up")
                          for c in ("zvc", "exponent")}
    for source in ("bert gelu", "llama silu * up"):  # no zeros, close exponents
        assert dense[source, "zvc"] < 1 and dense[source, "exponent"] > 1.2


def test_ratio_is_the_exact_packed_size_and_follows_sparsity(tiny_run):
    for r in tiny_run["rows"]:
        dtype = getattr(torch, r["dtype"])
        numel = r["bytes"] // dtype.itemsize
        nnz = round(numel * (1 - r["sparsity"]))
        if r["codec"] == "zvc":  # rle's size depends on the run count, not only on nnz
            header = len(Header("zvc", dtype, (numel,)).to_bytes())
            payload = get_codec("zvc").payload_nbytes(numel, nnz, dtype.itemsize)
            assert r["compressed_bytes"] == header + payload
    by_case = {(r["codec"], r["dtype"], r["target_sparsity"]): r["ratio"]
               for r in tiny_run["rows"]}
    assert by_case["zvc", "float32", 90] > 3
    assert by_case["zvc", "float32", 0] < 1  # the mask costs 1 bit per element
    assert by_case["rle", "float32", 90] > by_case["rle", "float32", 0]


def test_a_decode_that_changes_one_bit_stops_the_benchmark():
    zvc = get_codec("zvc")

    def flip_last_bit(packed, t):
        out = zvc.decode(packed)
        out.view(torch.int32).view(-1)[-1] ^= 1
        return out

    broken = Contender("broken", "test", zvc.encode, flip_last_bit, lambda p: p.nbytes)
    with pytest.raises(RuntimeError, match="did not reproduce its input bit for bit"):
        measure(broken, torch.rand(1000), torch.device("cpu"), warmup=0, repeats=1)


def test_lossy_rows_carry_their_error_and_a_lossless_row_none(tiny_run):
    for r in tiny_run["rows"]:
        if r["codec"] == "int8":
            assert 0 < r["relative_error"] < 0.05
            assert r["ratio"] > (3.5 if r["dtype"] == "float32" else 1.8)
        else:
            assert r["relative_error"] is None


def test_a_lossy_decode_past_its_ceiling_stops_the_benchmark():
    int8 = get_codec("int8")

    def halve(packed, t):
        return int8.decode(packed) * 0.5

    broken = Contender("int8", "test", int8.encode, halve, lambda p: p.nbytes)
    with pytest.raises(RuntimeError, match=r"lost more than its ceiling \(relative error 0.5"):
        measure(broken, torch.randn(1000), torch.device("cpu"), warmup=0, repeats=1)


def test_target_line_compares_both_directions_with_the_copy():
    doc = run_codec_bench("cpu", sizes=[16 * 1024 * KIB], dtypes=["float32"], codecs=["zvc"],
                          sparsities=[50], warmup=0, repeats=1, relu=False)
    (row,) = doc["rows"]
    (line,) = doc["summary"]["target"]
    verdict = "met" if min(row["compress_vs_copy"], row["decompress_vs_copy"]) >= 0.6 else "missed"
    assert line.startswith("zvc (reference (pure torch)) float32 16.0 MiB")
    assert f"compress {row['compress_vs_copy']:.0%}" in line and line.count(verdict) == 1


def test_real_relu_activations_are_sparse_and_non_negative():
    acts = relu_activations(torch.device("cpu"), batch=32, width=8, train_steps=2)
    assert list(acts) == ["cnn relu1", "cnn relu2", "cnn relu3"]
    assert acts["cnn relu1"].shape == (32, 8, 8, 8)
    for t in acts.values():
        zeros = (t == 0).float().mean().item()
        assert 0.05 < zeros < 0.95 and t.min() >= 0


@pytest.mark.slow
def test_cli_writes_markdown_and_json(tmp_path, capsys):
    stem = tmp_path / "tmp"
    assert main(["bench", "codec", "--sizes", "64KiB", "--quick", "--out", str(stem)]) == 0
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert {"date", "device", "torch", "command"} <= set(doc["meta"])
    relu_rows = [r for r in doc["rows"] if r["source"].startswith("cnn relu")]
    assert relu_rows and all(0 < r["sparsity"] < 1 for r in relu_rows)
    assert {r["target_sparsity"] for r in doc["rows"]} == {0, 50, 90, None}
    assert doc["limits"][0]["d2h_gbps"] is None  # no pinned copies on the CPU
    text = stem.with_suffix(".md").read_text()
    assert "| synthetic | float32 | 64.0 KiB |" in text and "| cnn relu2 |" in text
    assert "nvCOMP skipped: nvCOMP runs on CUDA devices only" in text
    assert "[1/" in capsys.readouterr().out  # a progress line per case


def test_sizes_parse_binary_units_and_bad_ones_are_named(capsys):
    assert [parse_size(s) for s in ("256KiB", "1MiB", "4096", "2 m", "1GiB")] == [
        256 * KIB, KIB * KIB, 4096, 2 * KIB * KIB, KIB**3]
    with pytest.raises(ValueError, match="bad size '12XB'"):
        parse_size("12XB")
    with pytest.raises(SystemExit):
        main(["bench", "codec", "--sizes", "12XB"])
    assert "bad size '12XB'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        run_codec_bench("cpu", sizes=[6])


def test_nvcomp_verdict_uses_the_best_of_each_side():
    def row(codec, value):
        return {"source": "cnn relu1", "dtype": "float16", "codec": codec, "sparsity": 0.5,
                "roundtrip_x_ratio": value}

    rows = [row("zvc", 30.0), row("rle", 10.0), row("nvcomp LZ4", 20.0),
            row("nvcomp Bitcomp", 40.0)]
    (line,) = nvcomp_lines(rows)
    assert "zvc 30.0 vs nvcomp Bitcomp 40.0" in line and line.endswith("behind")
    assert nvcomp_lines(rows[:3])[0].endswith("ahead")


@pytest.mark.gpu
def test_gpu_run_uses_the_kernels_and_nvcomp_where_installed():
    doc = run_codec_bench("cuda", sizes=[1024 * KIB], sparsities=[50], quick=True)
    impls = {r["impl"] for r in doc["rows"] if not r["codec"].startswith("nvcomp")}
    assert impls == {"CUDA kernels"}
    assert all(m["d2h_gbps"] > 0 and m["h2d_gbps"] > 0 for m in doc["limits"])
    try:
        import nvidia.nvcomp  # noqa: F401
    except ImportError:
        return
    assert {r["codec"] for r in doc["rows"]} >= {"nvcomp Cascaded", "nvcomp Bitcomp", "nvcomp LZ4"}
    assert doc["summary"]["nvcomp_on_relu"]
