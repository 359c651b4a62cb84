"""`cswap bench finetune` on the CPU: its dry run (a tiny model of the setup's kind) runs every
method on one copy of the model and reports each; a method that runs out of memory is
reported so while the others go on."""

from __future__ import annotations

import json

import pytest
import torch

from cswap_lightning.commands import bench_finetune
from cswap_lightning.commands.cli import main

pytest.importorskip("peft")
pytest.importorskip("transformers")

ENGINES = (bench_finetune.DEFAULT, bench_finetune.AT_CHECKPOINTING, bench_finetune.AT_LOWER)


def _rows(out) -> dict[str, dict]:
    return {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}


def test_the_dry_run_measures_every_method_on_one_model(tmp_path):
    out = tmp_path / "ft"
    assert main(["bench", "finetune", "llama-3-8b", "--lora", "--small", "--device", "cpu",
                 "--seq", "32", "--steps", "2", "--dense", "--out", str(out)]) == 0
    rows = _rows(out)
    dense = "cswap exponent, budget 75% lower saved activations"
    assert list(rows) == [bench_finetune.NO_OFFLOAD, bench_finetune.CHECKPOINTING, *ENGINES,
                          dense, bench_finetune.NO_OFFLOAD_AGAIN]
    assert rows[dense]["budget_bytes"] == rows[bench_finetune.AT_LOWER]["budget_bytes"]
    for row in rows.values():
        assert "failed" not in row, row
        assert row["timed_steps"] == 2 and row["step_s"] > 0
    assert rows[bench_finetune.CHECKPOINTING]["throughput_vs_checkpointing"] == 1.0
    saved = json.loads(out.with_suffix(".json").read_text())["setup"]["saved_activations_bytes"]
    assert saved > 0
    default = rows[bench_finetune.DEFAULT]  # the tiny step fits the machine: nothing moved
    assert default["hooks_off"] and default["offloaded_bytes"] == 0
    lower = rows[bench_finetune.AT_LOWER]
    assert lower["budget_bytes"] == int(0.25 * saved)  # the CPU's budgets: the ledger's terms
    assert lower["settled"] and lower["offloaded_bytes"] > 0  # it had to move what it saved
    assert "cswap plan llama-3-8b --seq 32 --batch 1 --lora" in out.with_suffix(".md").read_text()


def _short_of_memory(monkeypatch, name: str) -> None:
    """Method ``name``'s steps run out of memory."""
    step = bench_finetune._step

    def short(method, *args):
        if method.name == name:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return step(method, *args)

    monkeypatch.setattr(bench_finetune, "_step", short)


def test_a_method_out_of_memory_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    _short_of_memory(monkeypatch, bench_finetune.CHECKPOINTING)
    out = tmp_path / "ft"
    assert main(["bench", "finetune", "gpt2-medium", "--small", "--device", "cpu", "--seq",
                 "32", "--steps", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert rows[bench_finetune.CHECKPOINTING] == {
        "method": bench_finetune.CHECKPOINTING, "failed": "out of memory"}
    assert all("step_s" in rows[name] for name in (*ENGINES, bench_finetune.NO_OFFLOAD_AGAIN))
    assert "throughput_vs_checkpointing" not in rows[bench_finetune.NO_OFFLOAD]
    assert "| activation checkpointing |  | out of memory | |" in out.with_suffix(".md").read_text()


def test_a_cnn_is_refused_with_the_command_that_measures_it(tmp_path):
    with pytest.raises(SystemExit, match="bench measure"):
        main(["bench", "finetune", "resnet50", "--device", "cpu", "--out", str(tmp_path / "x")])


def test_without_no_offloads_step_the_budgets_it_sets_are_not_run(tmp_path, monkeypatch):
    _short_of_memory(monkeypatch, bench_finetune.NO_OFFLOAD)
    out = tmp_path / "ft"
    assert main(["bench", "finetune", "llama-3-8b", "--small", "--device", "cpu", "--seq", "32",
                 "--steps", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert rows[bench_finetune.NO_OFFLOAD]["failed"] == "out of memory"
    # the budgets that are shares of what it measures
    assert bench_finetune.AT_CHECKPOINTING not in rows and bench_finetune.AT_LOWER not in rows
    assert rows[bench_finetune.CHECKPOINTING]["step_s"] > 0
    assert "not counted" in out.with_suffix(".md").read_text()


def test_each_row_is_set_against_no_offload_and_checkpointing():
    gib = 1 << 30
    rows = {bench_finetune.NO_OFFLOAD: {"step_s": 1.0, "peak_bytes": 72 * gib},
            bench_finetune.CHECKPOINTING: {"step_s": 1.4, "peak_bytes": 31 * gib},
            bench_finetune.AT_LOWER: {"step_s": 1.05, "peak_bytes": 35 * gib},
            "failed": {"failed": "out of memory"}}
    bench_finetune._compare(rows, saved=49 * gib)
    lower = rows[bench_finetune.AT_LOWER]
    assert lower["time_vs_no_offload"] == pytest.approx(1.05)
    assert lower["throughput_vs_checkpointing"] == pytest.approx(1.4 / 1.05)
    assert lower["saved_activations_lower"] == pytest.approx(37 / 49)
    assert rows["failed"] == {"failed": "out of memory"}


def test_a_run_cut_short_keeps_the_rows_it_reached(tmp_path, monkeypatch):
    step = bench_finetune._step

    def interrupted(method, *args):
        if method.name == bench_finetune.CHECKPOINTING:
            raise KeyboardInterrupt
        return step(method, *args)

    monkeypatch.setattr(bench_finetune, "_step", interrupted)
    out = tmp_path / "ft"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "finetune", "llama-3-8b", "--small", "--device", "cpu", "--seq", "32",
              "--steps", "1", "--out", str(out)])
    rows = _rows(out)
    assert rows[bench_finetune.NO_OFFLOAD]["step_s"] > 0
    assert bench_finetune.AT_LOWER not in rows


def test_a_checkpointing_switch_that_fails_is_reported_and_the_others_go_on(tmp_path,
                                                                            monkeypatch):
    def no_switch(model, **how):
        raise RuntimeError("this model has no checkpointing switch (a test's)")

    monkeypatch.setattr(bench_finetune, "hf_checkpointing", no_switch)
    out = tmp_path / "ft"
    assert main(["bench", "finetune", "llama-3-8b", "--small", "--device", "cpu", "--seq", "32",
                 "--steps", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert rows[bench_finetune.CHECKPOINTING]["failed"].startswith("RuntimeError: this model")
    assert all("step_s" in rows[name] for name in (*ENGINES, bench_finetune.NO_OFFLOAD_AGAIN))


def test_the_peers_run_on_the_same_model_after_cswap(tmp_path):
    out = tmp_path / "ft"
    assert main(["bench", "finetune", "llama-3-8b", "--lora", "--small", "--device", "cpu",
                 "--seq", "32", "--steps", "1", "--peers", "--out", str(out)]) == 0
    rows = _rows(out)
    assert list(rows) == [bench_finetune.NO_OFFLOAD, bench_finetune.CHECKPOINTING, *ENGINES,
                          bench_finetune.HF_OFFLOAD, bench_finetune.SELECTIVE,
                          bench_finetune.NO_OFFLOAD_AGAIN]
    # transformers' offload pins host memory: without a GPU, torch's CPU build fails to (the
    # one failure here), its CUDA build skips pinning and the row completes
    offload = rows[bench_finetune.HF_OFFLOAD]
    if "failed" in offload:
        assert offload["failed"].startswith("RuntimeError: pin_memory"), offload
    else:
        assert torch.version.cuda is not None and "step_s" in offload, offload
    assert all("failed" not in row for name, row in rows.items()
               if name != bench_finetune.HF_OFFLOAD)


def test_selective_checkpointing_trains_bitwise_as_plain_saving_matmuls_only(monkeypatch):
    """The peer is set up as its users set it up: the same gradients as plain training, its
    policy consulted on every operator of the layers, matrix products saved and the
    elementwise work run again."""
    import transformers

    from cswap_lightning.commands import suite_cases
    from cswap_lightning.hf_checkpointing import checkpointing_off

    decided: list[tuple[str, str]] = []
    policy = suite_cases.sac_policy

    def recording(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        decided.append((func.__name__, decision.name))
        return decision

    monkeypatch.setattr(suite_cases, "sac_policy", recording)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    suite_cases.hf_checkpointing(model, offload=False, selective=True)
    selective = grads()
    checkpointing_off(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, selective, strict=True))
    saved = {name for name, decision in decided if decision == "MUST_SAVE"}
    assert "mm.default" in saved and len(saved) <= 4  # matmuls and attention only
    assert any(decision == "PREFER_RECOMPUTE" for _, decision in decided)


def test_the_dry_run_of_qlora_measures_every_method_on_a_four_bit_base(tmp_path, monkeypatch):
    from cswap_lightning.planning import models

    quantized, four_bit = [], models._four_bit
    monkeypatch.setattr(models, "_four_bit", lambda net, config: quantized.append(
        config.bnb_4bit_quant_type) or four_bit(net, config))
    out = tmp_path / "q"
    assert main(["bench", "finetune", "llama-3-8b", "--qlora", "--small", "--device", "cpu",
                 "--seq", "32", "--steps", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert list(rows) == [bench_finetune.NO_OFFLOAD, bench_finetune.CHECKPOINTING, *ENGINES,
                          bench_finetune.NO_OFFLOAD_AGAIN]
    assert all("failed" not in row for row in rows.values()), rows
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["setup"]["tuning"] == "QLoRA" and quantized == ["nf4"]  # one model, built once
    assert "cswap plan llama-3-8b --seq 32 --batch 1 --qlora" in out.with_suffix(".md").read_text()
