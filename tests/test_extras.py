"""What needs an optional dependency (pyproject's extras) says, where it is not installed,
which extra installs it: one line, not a traceback ending in ``No module named 'peft'``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cswap_lightning
from cswap_lightning.commands import cli
from cswap_lightning.extras import EXTRAS, MissingExtra, require

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 64, "max_position_embeddings": 512}


def hide(monkeypatch, *modules: str) -> None:
    """Make ``modules`` fail to import, as where they are not installed."""
    for name in [m for m in sys.modules if m.split(".")[0] in modules]:
        monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_missing_extra_names_the_feature_the_package_and_the_extra(monkeypatch):
    hide(monkeypatch, "peft")
    with pytest.raises(MissingExtra) as missing:
        require("peft", "LoRA")
    assert str(missing.value) == ("LoRA needs peft, which is not installed: "
                                  "pip install 'cswap-lightning[hf]'")
    assert isinstance(missing.value, ModuleNotFoundError)  # what callers caught before


def test_a_module_of_no_extra_is_not_said_to_be_one():
    with pytest.raises(ModuleNotFoundError) as missing:
        require("cswap_lightning.no_such_module", "nothing")
    assert type(missing.value) is ModuleNotFoundError


def test_each_extra_named_installs_that_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for package, extra in EXTRAS.values():
        assert any(r.split(">=")[0].split("<")[0] == package for r in extras[extra]), package


def test_cswap_plan_with_lora_without_peft_says_which_extra(config_file, monkeypatch, capsys):
    hide(monkeypatch, "peft")
    assert cli.main(["plan", config_file("tiny", TINY), "--seq", "64", "--lora"]) == 1
    printed = capsys.readouterr()
    assert printed.err == ("cswap: LoRA needs peft, which is not installed: "
                           "pip install 'cswap-lightning[hf]'\n")
    assert printed.out == ""  # said before any work


def test_cswap_bench_finetune_with_lora_without_peft(tmp_path, monkeypatch, capsys):
    hide(monkeypatch, "peft")
    assert cli.main(["bench", "finetune", "llama-3-8b", "--lora", "--small", "--device", "cpu",
                     "--seq", "32", "--steps", "1", "--out", str(tmp_path / "ft")]) == 1
    assert capsys.readouterr().err.endswith("cswap: LoRA needs peft, which is not installed: "
                                            "pip install 'cswap-lightning[hf]'\n")
    assert not (tmp_path / "ft.md").exists()  # said before any work


@pytest.mark.parametrize("model", ["gpt2-medium", "resnet50"])
def test_cswap_plan_without_transformers(model, monkeypatch, capsys):
    # a CNN's plan too: the calibration it is printed with was fitted on transformers models
    hide(monkeypatch, "transformers")
    assert cli.main(["plan", model, "--no-search"]) == 1
    assert capsys.readouterr().err == ("cswap: cswap plan needs transformers, which is not "
                                       "installed: pip install 'cswap-lightning[hf]'\n")


def test_the_hugging_face_callback_without_transformers(monkeypatch):
    hide(monkeypatch, "transformers", "accelerate")
    monkeypatch.delitem(sys.modules, "cswap_lightning.integrations.hf", raising=False)
    with pytest.raises(MissingExtra, match=r"^cswap_lightning.CSwapCallback needs (transformers|"
                       r"accelerate), which is not installed: pip install 'cswap-lightning\[hf\]'"):
        cswap_lightning.CSwapCallback  # noqa: B018 - the attribute's import is the test


ENGINE_ALONE = """
import sys
for name in ("transformers", "accelerate", "peft", "nvidia"):
    sys.modules[name] = None  # importing them fails, as where they are not installed
import torch
import cswap_lightning as cswap

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
offloader = cswap.offload(cswap.CSwapConfig(plan="raw", min_bytes=0)).watch(model)
for _ in range(3):
    with offloader:
        loss = model(torch.randn(32, 64)).sum()
    loss.backward()
step = offloader.last_step()
print(step.untracked_moved_tensors + sum(s.decision == "raw" for s in step.sites))
"""


def test_the_engine_needs_no_extra():
    # The README's promise; a process of its own, where nothing imported them before.
    run = subprocess.run([sys.executable, "-c", ENGINE_ALONE], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout) == 2  # the input and the ReLU's output (the second layer's input)


def test_cswap_plan_qlora_without_bitsandbytes_names_its_extra(monkeypatch, capsys):
    from cswap_lightning.commands import cli

    hide(monkeypatch, "bitsandbytes")
    assert cli.main(["plan", "llama-3-8b", "--qlora", "--layers", "1", "--seq", "64",
                     "--no-search"]) == 1
    assert capsys.readouterr().err.strip() == (
        "cswap: QLoRA (4-bit base weights) needs bitsandbytes, which is not installed: "
        "pip install 'cswap-lightning[qlora]'")
