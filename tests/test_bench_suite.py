"""`cswap bench suite --small`, run for real on the CPU (about a minute), and its ledger."""

import json
import math

import pytest
import torch
from conftest import with_checkpointing_of_5_17

from cswap_lightning.commands.cli import main
from cswap_lightning.commands.suite_cases import HF_OFFLOAD, METHODS, MODELS, workload
from cswap_lightning.commands.suite_ledger import DeviceLedger, HookTap
from cswap_lightning.commands.suite_report import GOALS
from cswap_lightning.commands.suite_runs import Settings, measure


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    assert main(["bench", "suite", "--small", "--device", "cpu", "--out", str(out)]) == 0
    return out, json.loads((out / "suite.json").read_text()), (out / "suite.md").read_text()


def by_label(model: dict) -> dict[str, dict]:
    return {r["label"]: r for r in model["runs"]}


def test_report_names_every_method_and_goal(suite):
    _, data, report = suite
    for name in (*METHODS, "activation checkpointing", "save_on_cpu", "no offload",
                 "max batch"):
        assert name in report
    for goal in GOALS:
        assert report.count(f": {goal}: ") == len(MODELS)  # one verdict per model and goal
    for line in ("- date: ", "- device: cpu", "- torch: ", "- command: cswap bench suite --small"):
        assert line in report
    assert report.count("Verdict: ") == len(MODELS)
    assert [m["model"] for m in data["models"]] == list(MODELS)
    for model in data["models"]:
        assert model["complete"]
        assert {g["status"] for g in model["goals"]} <= {"PASS", "FAIL", "n/a"}
        assert len(model["goals"]) == len(GOALS)


def test_measured_figures_are_numbers(suite):
    _, data, _ = suite
    for model in data["models"]:
        ran = [r for r in model["runs"] if "skipped" not in r]
        assert {r["method"] for r in ran} >= {"no offload", "activation checkpointing",
                                              "save_on_cpu", "cswap raw", "cswap auto",
                                              "cswap auto + int8"}
        for r in ran:
            for key in ("samples_per_s", "step_s", "peak_bytes", "vs_no_offload",
                        "peak_fraction"):
                assert math.isfinite(r[key]) and r[key] > 0, (model["model"], r["label"], key)
            assert r["link_bytes"] >= 0
            if r["method"].startswith("cswap"):
                assert math.isfinite(r["exposed_s"]) and r["exposed_s"] >= 0
        for search in model["max_batch"]:
            assert search["max_batch"] >= 1 and search["samples_per_s"] > 0


def test_skipped_methods_carry_reasons(suite):
    _, data, _ = suite
    for model in data["models"]:
        runs = by_label(model)
        # torchtune is in the benchmarks' environment (.venv-bench), not in the tests'
        skipped = runs["torchtune OffloadActivations"]["skipped"]
        assert "CUDA" in skipped or skipped == "torchtune is not installed"
        hf = runs["HF built-in offload"]
        if model["model"] in ("resnet50", "vgg16"):
            assert "not a Hugging Face model" in hf["skipped"]
        else:  # transformers pins its host copies: no pinned memory without an accelerator
            assert "skipped" not in hf or "pin" in hf["skipped"]
        for r in model["runs"]:
            assert "skipped" not in r or len(r["skipped"]) > 10


def test_offloading_lowers_the_measured_peak(suite):
    _, data, _ = suite
    for model in data["models"]:
        runs = by_label(model)
        base, raw = runs["no offload"], runs["cswap raw"]
        assert raw["link_bytes"] > 0 and raw["offloaded_bytes"] > 0
        assert raw["peak_bytes"] < base["peak_bytes"], model["model"]
        assert runs["activation checkpointing"]["peak_bytes"] < base["peak_bytes"]
        assert base["link_bytes"] == 0
        # A budget the step fits in offloads nothing; less memory than that offloads some.
        assert runs["cswap auto @100%"]["offloaded_bytes"] == 0
        assert runs["cswap auto @35%"]["offloaded_bytes"] > 0


def test_plots_are_written(suite):
    out, data, report = suite
    for model in data["models"]:
        png = out / f"suite-{model['model']}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in report


@pytest.mark.parametrize("api", ["installed", "5.17-5.22"])
def test_hf_offload_is_found_under_either_name(api, monkeypatch):
    """transformers 5.17-5.22 have the offload switch on gradient_checkpointing_enable, later
    releases on activation_checkpointing_enable: the method runs under either."""
    pinned = []  # transformers' offload: torch's save_on_cpu, into pinned memory
    enter = torch.autograd.graph.save_on_cpu.__init__

    def spy(self, pin_memory=False, device_type="cuda"):
        pinned.append(pin_memory)
        enter(self, pin_memory, device_type)

    monkeypatch.setattr(torch.autograd.graph.save_on_cpu, "__init__", spy)
    wl = workload("gpt2-medium", small=True)
    base = wl.build()
    if api == "5.17-5.22":
        base = with_checkpointing_of_5_17(type(base))(base.config)
    row = measure(wl, base, HF_OFFLOAD, 2, Settings(torch.device("cpu"), steps=1, warmup=0,
                                                    min_bytes=0))
    assert pinned and all(pinned)
    # Without CUDA, pinning fails where torch pins for the CPU (the CPU build: transformers
    # asks for the CPU, which is available) and is skipped where it pins for CUDA (a CUDA
    # build: CUDA is not available): the run fails, or completes.
    if torch.cuda.is_available():
        assert "skipped" not in row, row["skipped"]
    else:
        assert "pin_memory" in row.get("skipped", "pin_memory"), row["skipped"]


def test_ledger_counts_allocations_not_views_and_not_pack_copies():
    x = torch.randn(1024)
    with HookTap() as tap:
        ledger = tap.ledger = DeviceLedger(tap, iter([x]))
        with ledger:
            view = x[:10].view(2, 5)  # shares x's storage: nothing new
            assert ledger.now == 4096
            doubled = x * 2  # a new storage
            assert ledger.now == 8192
            del doubled  # freed: subtracted
            assert ledger.now == 4096 and ledger.peak == 8192
            w = torch.randn(1024, requires_grad=True)
            before = ledger.now
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                y = (w * 2).sin().sum()  # sin saves w * 2: copied out in the pack hook
            # w * 2 itself is freed; its copy is the method's host side, not counted
            assert ledger.now - before < 4096
            y.backward()  # the copy, handed back by the unpack hook, counts from then on
    assert tap.moved == 4096
    assert ledger.peak >= 8192 and view.shape == (2, 5)


def test_levels_must_be_fractions(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "suite", "--levels", "0"])
    assert "expected a fraction in (0, 1]" in capsys.readouterr().err


def test_full_size_reports_print_the_replays_prediction_beside_each_run():
    """A full-size model profiled on the H100: each run the replay models carries its
    prediction (ratios to no offload's); a cswap budget is predicted as the planner mixes."""
    import argparse

    from cswap_lightning.commands.suite_report import model_markdown

    runs = [{"method": m, "budget": b, "label": m, "samples_per_s": 1.0, "peak_bytes": 1,
             "link_bytes": 0, "vs_no_offload": 1.0, "peak_fraction": 1.0}
            for m, b in (("no offload", None), ("activation checkpointing", None),
                         ("cswap raw", None), ("cswap auto", 0.5), ("save_on_cpu", None))]
    result = {"model": "bert-large", "label": "BERT-large", "shape": "-", "batch": 16,
              "params": 0, "runs": runs, "complete": True, "prefetch_bytes": None}
    lines = model_markdown(result, argparse.Namespace(small=False, max_batch=False))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert "1.00x, 100% (H100 profile)" in rows["no offload"]
    assert "(H100 profile)" in rows["activation checkpointing"] and "(H100 profile)" in rows[
        "cswap raw"]
    assert rows["save_on_cpu"].rstrip(" |").endswith("-")  # not modelled
    small = model_markdown(result, argparse.Namespace(small=True, max_batch=False))
    assert not any("H100 profile" in line for line in small)
