"""`cswap plan` on the CPU: a small config's step on devices of the table, printed as
labelled estimates with the calibration's error; bad models and setups are errors that say
why."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from cswap_lightning.commands import cli
from cswap_lightning.planning import calibration, models, sizing
from cswap_lightning.planning.devices import DEVICES

pytest.importorskip("transformers")

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 32768, "tie_word_embeddings": True}


@pytest.fixture
def config(config_file) -> str:
    return config_file("tiny-qwen2", TINY)


def test_plan_prints_labelled_estimates_of_every_way(config, capsys):
    assert cli.main(["plan", config, "--seq", "512", "--batch", "2", "--device", "rtx-4090",
                     "--budgets", "0.5"]) == 0
    printed = capsys.readouterr()
    out = " ".join(printed.out.split())  # the header is wrapped
    # the long parts say what they did as they go, on stderr
    said = [line.split(" (")[0] for line in printed.err.splitlines()]
    assert said[0] == "cswap plan: planning at 4 budgets"
    assert [line.split(":")[1] for line in said[1:5]] == [
        " planned at the device", " planned at 0.5 GiB",
        " planned at half the peak without help", " planned at checkpointing's peak"]
    assert said[5:] == [f"cswap plan: the longest sequence that fits {how}"
                        for how in ("without help", "checkpointing", "the planner")]
    assert "cswap plan: tiny-qwen2, sequence 512, batch 2, bfloat16, full fine-tuning" in out
    assert "GeForce RTX 4090" in out and "measured by this project: nothing" in out
    low, high = calibration.HELD_OUT_STEP_ERROR
    assert "ESTIMATES, not measurements" in out and f"{low:+.0%} to {high:+.0%}" in out
    assert "Checked end to end once" in " ".join(out.split())
    assert calibration.below_summary(calibration.below_check()) in out
    for row in ("weights", "gradients", "optimizer state", "saved activations",
                "peak without help (step)", "peak of the optimizer's update",
                "without help: FITS", "none (no help)", "none (checkpointing)",
                "the device (23.0 GiB)", "0.5 GiB", "half the peak without help",
                "checkpointing's peak", "the longest sequence that fits (estimated): "):
        assert row in out, row
    # a tiny model fits any of these devices up to the search's ceiling
    assert "without help 262144 (the search's ceiling)" in out


def test_plan_with_lora_trains_the_adapters_only(config, capsys):
    assert cli.main(["plan", config, "--seq", "256", "--lora", "--lora-rank", "8",
                     "--device", "gh200", "--optimizer", "sgd", "--no-search"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "LoRA rank 8 (dropout 0) on every linear layer but the head" in out
    assert "SGD without momentum" in out and "the longest" not in out
    # 4 layers x 7 adapters x rank 8 x (in + out)
    trained = 4 * 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert f"{trained / 1e6:,.1f} M trained weights" in out


def test_plan_says_what_a_layer_keeps_below_the_layer_and_weighs_a_lossy_codec(config, capsys):
    """The line under the memory table: a layer's saved bytes per token, and what recomputing
    it below the layer (less; each way keeping more runs less again) or whole (less still)
    keeps, and for how long."""
    assert cli.main(["plan", config, "--seq", "512", "--device", "h100-pcie", "--lossy", "int8",
                     "--no-search"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    speeds = sizing.lossy_speeds("int8", DEVICES["h100-pcie"])
    encode, decode = (f"{s / 1e9:.0f} GB/s" for s in speeds)
    assert f"int8: encoding at {encode} and decoding at {decode}" in out
    assert "not modelled" in out
    found = re.search(r"a layer \((\S+)\) saves (\d+) KiB per token; recomputed below the "
                      r"layer .* it keeps (\d+) KiB per token for ([\d.]+) ms \((\d+)% of its "
                      r"forward\)(.*); recomputed whole (\d+) KiB for ([\d.]+) ms \(estimated\)",
                      out)
    assert found, out
    name, saved, below, below_ms, share, heavier, whole, whole_ms = found.groups()
    assert name.endswith("layers.0")
    assert int(whole) < int(below) < int(saved)
    assert 0 < float(below_ms) < float(whole_ms) and 0 < int(share) < 100
    ways = [(int(kib), float(ms)) for kib, ms in re.findall(r"(\d+) KiB for ([\d.]+) ms", heavier)]
    assert heavier.startswith(", or keeping more to run less again") and ways, heavier
    for (kib, ms), (more, less) in itertools.pairwise([(int(below), float(below_ms)), *ways]):
        assert kib <= more and ms > less


def test_a_budget_over_the_device_is_marked_and_planned_for_the_device(config, capsys):
    """A budget over the device's memory (1000 GiB on a 24 GB card) is planned for the
    device's, and its row says so; budgets within it are not marked."""
    assert cli.main(["plan", config, "--seq", "512", "--device", "rtx-4090", "--budgets",
                     "1000", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "1000 GiB (> device)" in out and "half the peak without help (> device)" not in out
    assert "(> device): a budget over the device's memory, planned for the device's" in out


def test_plan_of_a_cnn_searches_the_batch(capsys):
    assert cli.main(["plan", "resnet50", "--batch", "4", "--device", "l40s",
                     "--dtype", "float16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cswap plan: resnet50, 224x224 images, batch 4, float16" in out
    assert "the longest batch that fits (estimated): without help" in out


@pytest.mark.parametrize("argv, says", [
    (["plan", "gpt-5"], "unknown model 'gpt-5'"),
    (["plan", "resnet50", "--lora"], "LoRA and a number of layers are for the transformers"),
    (["plan", "gpt2-medium", "--seq", "2048"], "1024 learned positions"),
])
def test_a_setup_that_cannot_be_estimated_says_why(argv, says, capsys):
    assert cli.main(argv) == 1
    assert says in capsys.readouterr().err


def test_an_unknown_device_is_a_usage_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "llama-3-8b", "--device", "tpu"])
    assert exit_.value.code == 2
    assert "h100-pcie" in capsys.readouterr().err


def _readme_section() -> str:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return readme.split("## Will it fit? `cswap plan`")[1].split("\n## ")[0]


def test_the_readme_names_the_models_and_devices_there_are():
    section = " ".join(_readme_section().split())
    for name in [*models.KNOWN, *models.CNNS, *DEVICES]:
        assert f"`{name}`" in section, name


@pytest.mark.slow
def test_the_readme_example_is_what_the_command_prints(capsys):
    section = _readme_section()
    command, printed = section.split("```bash\n")[1].split("\n")[0], section.split("```\n")[2]
    argv = command.split("#")[0].split()[1:]
    assert argv[:2] == ["plan", "llama-3-8b"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for line in printed.strip().splitlines():
        assert line in out, line


def test_plan_weighs_the_exponent_codec_and_says_its_speeds_are_estimates(config, capsys):
    """``--dense``: the header gives the exponent codec's ratio and estimated speeds; at
    checkpointing's peak the lossless mix through it is no slower than without."""
    args = ["plan", config, "--seq", "512", "--device", "h100-pcie", "--no-search"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main([*args, "--dense"]) == 0
    out = capsys.readouterr().out
    encode, decode = (f"{s / 1e9:.0f} GB/s" for s in sizing.dense_speeds(DEVICES["h100-pcie"]))
    flat = " ".join(out.split())
    assert (f"exponent (lossless): bfloat16 activations at 75% of their bytes (measured on "
            f"random weights), encoding at {encode} and decoding at {decode}: not measured "
            "yet") in flat

    def at_checkpointing(text: str) -> float:
        (row,) = [line for line in text.splitlines() if line.strip().startswith(
            "checkpointing's peak")]
        return float(re.findall(r"\d+\.\d+", row)[-2])  # peak, step ms, ratio: its step

    assert at_checkpointing(out) <= at_checkpointing(plain)
