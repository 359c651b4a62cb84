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

transformers = pytest.importorskip("transformers")
README = Path(__file__).resolve().parents[1] / "README.md"

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
    assert said[0] == "cswap plan: planning at 5 budgets"
    assert [line.split(":")[1] for line in said[1:6]] == [
        " planned at the device", " planned at 0.5 GiB",
        " planned at half the peak without help", " planned at checkpointing's peak",
        " planned at offloaded checkpointing's peak"]
    assert said[6:] == [f"cswap plan: the longest sequence that fits {how}"
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
                "none (ckpt, inputs offloaded)", "recompute every block, swap its input",
                "none (every tensor offloaded)", "swap every block",
                "ckpt, inputs offloaded: Unsloth's offloaded checkpointing",
                "every tensor offloaded: torchtune's activation offloading",
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


# The README's list: the conformance suite's tiny transformers configs (``test_conformance.HF``),
# written without ``architectures``, as a config class writes them: the model class is then
# transformers' causal LM of their model_type, or an encoder's sequence classifier.
PLANNED = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral", "qwen2": "Qwen2",
           "qwen2_moe": "Qwen2-MoE", "qwen3": "Qwen3", "gemma": "Gemma", "gemma2": "Gemma-2",
           "phi": "Phi", "phi3": "Phi-3", "opt": "OPT", "falcon": "Falcon", "gpt2": "GPT-2",
           "gptj": "GPT-J", "gpt_neox": "GPT-NeoX", "gpt_neo": "GPT-Neo", "bloom": "BLOOM",
           "mamba": "Mamba", "mamba2": "Mamba-2", "bert": "BERT", "roberta": "RoBERTa",
           "albert": "ALBERT", "distilbert": "DistilBERT", "electra": "ELECTRA",
           "mpnet": "MPNet"}
UNTRACEABLE = {"bart": "BART", "t5": "T5", "deberta_v2": "DeBERTa-v2"}
EAGER = "; eager attention (transformers has no SDPA for it)"


@pytest.mark.parametrize("kind, head", [
    ("llama", "LlamaForCausalLM"), ("mamba", "MambaForCausalLM"),
    ("bert", "BertForSequenceClassification"),
    ("distilbert", "DistilBertForSequenceClassification"),
    ("t5", "T5ForSequenceClassification"), ("nothing-of-the-kind", "")])
def test_a_config_without_architectures_trains_an_encoder_as_a_classifier_else_a_causal_lm(
        kind, head):
    assert models._head(kind) == head


def test_the_readme_names_the_families_planned():
    text = " ".join(README.read_text().split())
    names = list(PLANNED.values())
    assert f"Checked on tiny configs of {', '.join(names[:-1])} and {names[-1]};" in text
    assert f"({', '.join(name + chr(39) + 's' for name in UNTRACEABLE.values())})" in text


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*PLANNED, *UNTRACEABLE])
def test_each_family_plans_or_says_why_it_cannot(kind, config_file, capsys):
    from test_conformance import HF  # the suite that trains each under the engine

    data = HF[kind][0].config().to_dict()
    assert "architectures" not in data or not data["architectures"]
    path = config_file(kind, data)
    status = cli.main(["plan", path, "--seq", "32", "--no-search"])
    printed = capsys.readouterr()
    if kind in UNTRACEABLE:
        assert status == 1
        assert printed.err.startswith("cswap plan: the model's step reads a tensor's values (")
        return
    assert status == 0, printed.err[-2000:]
    out = " ".join(printed.out.split())
    head = models._head(data["model_type"])
    assert getattr(transformers, head)._supports_sdpa == (EAGER not in out)
    assert out.startswith(f"cswap plan: {kind}, sequence 32, batch 1, bfloat16, full fine-tuning")
    assert "without help: FITS" in out
    assert "NOT run by its batch" not in out  # every weight read


def test_a_multimodal_config_plans_its_text_path_and_says_what_did_not_run(config_file, capsys):
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 256, "max_position_embeddings": 4096}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 16}
    gemma3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4}
    assert cli.main(["plan", config_file("g3", gemma3), "--seq", "64", "--no-search"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("NOT run by its batch of text (their weights are counted, their activations are "
            "not): model.vision_tower (0.0 M weights), model.multi_modal_projector (") in out
    assert "without help: FITS" in out


def test_a_four_bit_config_plans_qlora_and_other_quantizations_are_said_not_modelled(
        config_file, capsys):
    """A QLoRA snapshot's config (bitsandbytes, 4 bits): its base planned in 4 bits as
    ``--qlora`` plans it, adapters only (without ``--lora`` it is refused, saying so); a
    quantization the estimate does not model (GPTQ) is said on the first line."""
    nf4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    wide = {**TINY, "hidden_size": 2048, "intermediate_size": 4096}  # weights in GiB
    snapshot = config_file("q", {**wide, "quantization_config": nf4})
    plain = config_file("p", wide)
    weights = {}
    for name, path, flag in (("snapshot", snapshot, "--lora"), ("qlora", plain, "--qlora"),
                             ("lora", plain, "--lora")):
        assert cli.main(["plan", path, "--seq", "64", flag, "--no-search"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert ("their base in 4-bit NF4" in out) == (name != "lora"), name
        assert "NOT modelled" not in out
        weights[name] = float(re.search(r"weights (\S+)", out).group(1))
    assert weights["snapshot"] == weights["qlora"] < weights["lora"]
    assert cli.main(["plan", snapshot, "--seq", "64", "--no-search"]) == 1
    assert "trains adapters only: plan it with --qlora" in capsys.readouterr().err
    gptq = config_file("g", {**TINY, "quantization_config": {"quant_method": "gptq",
                                                             "bits": 4}})
    assert cli.main(["plan", gptq, "--seq", "64", "--lora", "--no-search"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("(mixed precision); its quantization_config (gptq) is NOT modelled: "
            "weights counted in bfloat16 on H100 PCIe") in out


def test_learned_positions_cap_the_longest_sequence(config_file, capsys):
    # OPT's positions are a table, as GPT-2's and BERT's: no longer sequence than it holds
    path = config_file("opt", {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2,
                               "word_embed_proj_dim": 32, "vocab_size": 128,
                               "max_position_embeddings": 128})
    assert cli.main(["plan", path, "--seq", "64"]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == (
        "the longest sequence that fits (estimated): without help 128 (the search's ceiling), "
        "checkpointing 128 (the search's ceiling), the planner 128 (the search's ceiling)")


def test_a_model_whose_step_reads_values_says_so_in_one_line(config_file, capsys):
    path = config_file("t5", {"model_type": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64,
                              "num_layers": 2, "num_heads": 2, "vocab_size": 128,
                              "decoder_start_token_id": 0, "pad_token_id": 0})
    assert cli.main(["plan", path, "--seq", "64", "--no-search"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cswap plan: the model's step reads a tensor's values (")
    assert err.endswith("a trace without data cannot: estimate a model whose forward branches "
                        "on shapes only\n") and err.count("\n") == 1


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
    readme = README.read_text()
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


def test_host_memory_bounds_what_each_plan_holds_on_the_host(config, capsys):
    """Without a bound, the mixes swap (host memory held); with --host-memory 0, none does."""
    row = re.compile(r"(\d+\.\d\d) +(\d+\.\d\d) +(\d+\.\d) +(\d+\.\d\d)x")
    held = {}
    for host in (None, "0"):
        more = [] if host is None else ["--host-memory", host]
        assert cli.main(["plan", config, "--seq", "2048", "--layers", "8", "--no-search",
                         *more]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert any("host GiB" in line and "peak GiB" in line for line in lines)
        held[host] = [float(m[2]) for line in lines if (m := row.search(line))]
        # no help, checkpointing, the peers' two ways and four budgets
        assert len(held[host]) == 8
    assert max(held[None][4:]) > 0 and held["0"][4:] == [0.0] * 4
    assert held["0"][:2] == [0.0] * 2 and held["0"][2:4] == held[None][2:4]  # the peers' own
    assert ("host GiB: what the swapped blocks hold in host memory (pinned) at the end of "
            "forward, per GPU process (a compressed one at its size: its slot); at most 0 GiB "
            "(--host-memory)") in " ".join(" ".join(lines).split())
