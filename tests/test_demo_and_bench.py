"""The main job and the step benchmark, run for real at a small size."""

import json
import subprocess
import sys

import pytest
import torch

from cswap_lightning.commands.bench_step import run_step_bench
from cswap_lightning.commands.cli import main
from cswap_lightning.commands.demo import run_demo
from cswap_lightning.config import CSwapConfig


def test_demo_trains_with_the_advisor_and_keeps_gradients(capsys):
    result = run_demo(epochs=2)
    out = capsys.readouterr().out
    assert result["gradients_equal"]
    assert result["accuracy"] > 0.8  # digits are learnable in two epochs
    step = result["last_step"]
    assert step["offloaded_bytes"] > 0
    moved = [s for s in step["sites"] if s["decision"] not in ("keep", "dedup")]
    assert moved and all(s["decision"] in ("raw", "zvc") for s in moved)
    assert "The advisor's plan" in out and "bitwise equal" in out and "Memory:" in out
    # measured: moving freed memory at the peak (0.61x on the CPU, with its 2 MiB prefetch)
    assert step["peak_resident_bytes"] < 0.8 * result["keep_peak_bytes"]
    # what the step counted as keeping everything is what a step keeping everything measured
    assert step["keep_all_bytes"] == result["keep_peak_bytes"]
    assert "in a step keeping them all" in out
    if torch.cuda.is_available():
        assert "left cuda memory for host memory" in out
    else:  # "left the cpu memory" said what it does not do
        assert "moved into the engine's host buffers" in out and "left" not in out


def test_demo_with_zvc_compresses_relu_outputs():
    result = run_demo(epochs=1, config=CSwapConfig(plan="zvc", min_bytes=64 * 1024))
    assert result["gradients_equal"]
    step = result["last_step"]
    assert step["offloaded_bytes"] > step["stored_bytes"] > 0  # ReLU outputs compressed
    assert any(s["decision"] == "zvc" for s in step["sites"])


@pytest.mark.slow
def test_cli_demo_exit_code_and_module_entry_point():
    assert main(["demo", "--epochs", "1", "--plan", "raw"]) == 0
    proc = subprocess.run([sys.executable, "-m", "cswap_lightning", "demo", "--epochs", "1"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Gradient check" in proc.stdout


def test_cli_rejects_unknown_plan(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--plan", "lz4"])
    assert "invalid choice: 'lz4'" in capsys.readouterr().err


def test_step_bench_measures_every_method(tmp_path):
    rows = run_step_bench("mlp", "cpu", batch_size=64, steps=1, warmup=1,
                          out=str(tmp_path / "step"))
    by_name = {r["method"]: r for r in rows}
    assert by_name["no offload"]["time_ratio"] == 1.0
    assert by_name["no offload"]["moved_bytes"] == 0
    assert by_name["save_on_cpu(pin_memory=True)"]["moved_bytes"] > 0
    assert "skipped" in by_name["torchtune OffloadActivations"]  # CPU: torchtune needs CUDA
    raw, zvc = by_name["cswap plan=raw"], by_name["cswap plan=zvc"]
    assert raw["moved_bytes"] > zvc["moved_bytes"] > 0  # ReLU activations compress
    assert raw["peak_resident_bytes"] > 0 and by_name["no offload"]["peak_resident_bytes"] is None
    assert "engine's peak resident" in (tmp_path / "step.md").read_text()
    assert all(r["step_s"] > 0 for r in rows if "step_s" in r)
    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["meta"]["model"] == "mlp" and len(saved["rows"]) == len(rows)
    assert "| cswap plan=zvc |" in (tmp_path / "step.md").read_text()


def test_a_captured_profile_replays_as_the_h100_ones_do(tmp_path):
    """planning/capture.py writes the schema workload.load reads: every saved tensor, its
    storage seen once, weights marked, each leaf module's time; the plain totals beside."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from cswap_lightning.planning.capture import capture
    from cswap_lightning.planning.workload import from_profile

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=32, use_cache=False))
    ids = torch.randint(0, 300, (2, 32))
    profile = capture(model, lambda: model(input_ids=ids, labels=ids).loss, "gpt2-tiny-b2",
                      warmup=1, steps=2, log=lambda _: None)
    saved = profile["saved"]
    assert any(r["parameter"] for r in saved) and not all(r["parameter"] for r in saved)
    assert sum(r["first_of_storage"] for r in saved) < len(saved)  # a storage saved twice
    assert {r["module"] for r in saved} >= {"transformer.h.0.ln_1", "transformer.h.1.mlp.c_fc"}
    assert all(m["calls"] >= 1 for m in profile["modules"] if m["module"].endswith("c_fc"))
    assert profile["plain_forward_ms"] > 0 and profile["plain_backward_ms"] > 0
    assert model.transformer.h[0].ln_1.weight.grad is None  # left as it found it
    w = from_profile(profile)
    assert [b.name for b in w.blocks if b.recomputable] == ["transformer.h.0", "transformer.h.1"]
    assert len(w.saved) == len(saved)


@pytest.mark.parametrize(("key", "label"), [("resnet50", "ResNet-50"),
                                            ("llama3-8b-4l", "Llama-3-8B, 4 layers (small)")])
def test_measure_bench_runs_every_method_and_labels_a_cpu_run_a_dry_run(tmp_path, key, label):
    from cswap_lightning.commands.bench_measure import nearest, run_measure_bench
    from cswap_lightning.planning.replay import CODEC_KERNELS
    from cswap_lightning.planning.sizing import LOSSY_SPEEDS

    trace = key == "resnet50"
    results = run_measure_bench([key], str(tmp_path / "measure"), rounds=1, device="cpu",
                                trace=trace)
    rows = {r["method"]: r for r in results[0]["rows"]}
    if trace:  # a table per method; the device's times only on CUDA
        assert len(list((tmp_path / "measure-traces").glob(f"{key}-*.txt"))) == len(rows)
        assert not any("traced_kernels_s" in r or "trace_failed" in r for r in rows.values())
    assert set(rows) == {"no offload", "checkpointing", "cswap, budget 85% of no offload",
                         "cswap, budget 50% of no offload",
                         "cswap, budget checkpointing's peak", "cswap default (fits)",
                         "cswap, every block recomputed",
                         "cswap, every block recomputed, first runs without autograd",
                         "cswap int8, every tensor swapped"}
    for way in ("", ", first runs without autograd"):  # alike on the CPU; on CUDA, not so
        every = rows[f"cswap, every block recomputed{way}"]  # checkpointing's blocks
        assert every["recomputed_blocks"] == every["first_runs_without_autograd"] > 0
        assert every["predicted_step_s"] == rows["checkpointing"]["predicted_step_s"]
        assert every["moved_sites"] == 0
    assert all(r["timed_steps"] == 1 and r["predicted_step_s"] > 0 for r in rows.values())
    # the host's times beside the device's (on CUDA they tell a host-bound step); on the CPU
    # the host's time is the step's
    assert all(r["host_forward_s"] == r["forward_s"] < r["host_step_s"] == r["step_s"]
               for r in rows.values())
    engines = [r for m, r in rows.items() if m.startswith("cswap")]
    assert all(r["forward_wait_s"] >= 0 and r["backward_wait_s"] >= 0 for r in engines)
    # no step runs without hooks on the CPU: nothing scaled the engines' windows
    assert all(r["engine_plain_forward_s"] is None and r["engine_plain_backward_s"] is None
               and r["engine_plain_host_forward_s"] is None for r in engines)
    # and the CPU's windows are the host's: no host clock of its own for the replay
    assert all(r["engine_host_windows_s"] == 0 for r in engines)
    assert all(r["host_arena"] is None for r in engines)  # planned for CUDA payloads only
    # the allocator's driver calls are CUDA's: none counted on the CPU
    assert all(r["device_mallocs"] == r["alloc_retries"] == 0 for r in rows.values())
    # every tensor through int8, predicted at the H200's int8 speeds: here (the small model)
    # none is as large as min_bytes, and the replay and the engine agree that none moves
    int8 = rows["cswap int8, every tensor swapped"]
    assert tuple(int8["int8_speeds"]) == LOSSY_SPEEDS["int8"]
    assert int8["predicted_stored_bytes"] == int8["stored_bytes"] == 0
    by_lane = int8["predicted_step_s_by_codec_kernels"]
    assert set(by_lane) == set(CODEC_KERNELS) and set(by_lane.values()) == {
        int8["predicted_step_s"]}
    assert int8["nearest_codec_kernels"] == "own stream"  # all alike: the first
    assert nearest({"own stream": 0.10, "copy lane": 0.12, "compute": 0.15}, 0.13) == "copy lane"
    assert (tmp_path / f"profile-{key}-cpu.json.gz").exists()
    text = (tmp_path / "measure.md").read_text()
    assert "DRY RUN on the CPU" in text and f"| {label} | checkpointing |" in text
    assert "| forward (ms) device / host |" in text and "| cudaMalloc / retries" in text


def test_a_traced_step_on_the_cpu_writes_its_operators_and_times_nothing(tmp_path):
    from cswap_lightning.commands.traced import trace_path, traced_step

    x = torch.randn(64, 64)
    path = trace_path(tmp_path, "resnet50 cswap, budget checkpointing's peak")
    assert path.name == "resnet50-cswap-budget-checkpointing-s-peak.txt"
    assert traced_step(lambda: x @ x, torch.device("cpu"), path) is None
    assert "aten::mm" in path.read_text()


@pytest.mark.gpu
def test_on_cuda_a_traced_step_parts_kernels_from_copies(tmp_path):
    from cswap_lightning.commands.traced import traced_step

    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    host = torch.empty(2048, 2048, pin_memory=True)

    def step():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        host.copy_(x @ x, non_blocking=True)
        end.record()
        torch.cuda.synchronize(dev)
        walls.append(begin.elapsed_time(end) / 1e3)

    walls = []
    traced = traced_step(step, dev, tmp_path / "cuda.txt")
    assert traced is not None and traced.kernels_s > 0 and traced.copies_s > 0
    # 16 MiB over a PCIe link (at most ~100 GB/s) takes at least 0.16 ms; the matmul and the
    # copy, one after the other on one stream, no longer than the step itself
    assert traced.copies_s > 1.6e7 / 100e9
    assert traced.kernels_s + traced.copies_s <= 1.05 * walls[0]


def test_the_measure_table_says_where_the_engines_host_waited():
    from cswap_lightning.commands.bench_measure import markdown

    row = {"method": "cswap, budget 85% of no offload", "budget_bytes": 2**30,
           "predicted_step_s": 0.1, "predicted_peak": 2**30, "step_s": 0.12, "step_error": -0.17,
           "forward_s": 0.05, "host_forward_s": 0.049, "device_mallocs": 3, "alloc_retries": 0,
           "peak_bytes": 2**30, "peak_error": 0.0, "time_vs_no_offload": 1.2,
           "peak_vs_no_offload": 0.85, "throughput_vs_checkpointing": 1.1,
           "engine_how": "swap the earliest 2 blocks", "engine_predicted_step_s": 0.1,
           "engine_predicted_peak": 2**30, "forward_wait_s": 0.002, "backward_wait_s": 0.003}
    text = markdown([{"label": "M", "rows": [row]}], torch.device("cuda"))
    assert ("swap the earliest 2 blocks; the host waited 2.0 ms in forward, 3.0 ms in "
            "backward") in text
    assert "| 50.0 / 49.0 |" in text and "| 3 / 0 |" in text
    quiet = markdown([{"label": "M", "rows": [row | {"forward_wait_s": 0.0,
                                                      "backward_wait_s": 0.0}]}],
                     torch.device("cuda"))
    assert "the host waited" not in quiet


def test_a_failed_trace_leaves_the_measured_rows(tmp_path, monkeypatch):
    from cswap_lightning.commands import bench_measure

    def fails(*args, **kwargs):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(bench_measure, "traced_step", fails)
    results = bench_measure.run_measure_bench(["resnet50"], str(tmp_path / "m"), rounds=1,
                                              device="cpu", trace=True)
    rows = results[0]["rows"]
    assert rows and all("failed" not in r and r["step_s"] > 0 for r in rows)
    assert all(r["trace_failed"] == "RuntimeError: CUPTI unavailable" for r in rows)
    assert "trace FAILED" in (tmp_path / "m.md").read_text()
