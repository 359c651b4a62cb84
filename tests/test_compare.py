"""`cswap compare`: the CNN recipe trained lossless and lossy from one seed, at a CPU size."""

import json
import sys
import warnings
from pathlib import Path

import pytest

from cswap_lightning.commands import compare as compare_module
from cswap_lightning.commands.cli import main
from cswap_lightning.commands.compare import compare

ROOT = Path(__file__).resolve().parents[1]


def cnn_args(root: Path, *extra: str) -> list[str]:
    """The CNN recipe for two epochs of three batches, logging under ``root``."""
    return [
        "--config", str(ROOT / "recipes" / "cnn.yaml"),
        "--trainer.max_epochs", "2",
        "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--data.cache_dir", str(root / "data"),
        *extra,
    ]


@pytest.fixture(autouse=True)
def no_command_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


@pytest.mark.dali
@pytest.mark.slow
def test_compare_trains_both_plans_and_reports_the_lossy_savings(tmp_path, capsys):
    lossless, lossy = compare(cnn_args(tmp_path), lossy="int8", out=str(tmp_path / "result"))
    assert (lossless.plan, lossy.plan) == ("auto", "int8")
    assert len(lossless.metric) == len(lossy.metric) == 2  # one value per epoch
    assert all(0.0 <= v <= 1.0 for v in lossless.metric + lossy.metric)
    assert len(lossless.step_s) == len(lossy.step_s) == 6
    # int8 keeps a byte per float32 element plus a scale per block: about 4x smaller.
    assert lossless.lossy_bytes == 0 and lossy.lossy_bytes > 0
    assert lossy.lossy_bytes / lossy.lossy_stored_bytes > 3.5
    assert lossy.offloaded_bytes == lossless.offloaded_bytes  # the same sites left the device
    assert lossy.stored_bytes < lossless.stored_bytes
    assert lossy.link_bytes < lossless.link_bytes
    out = capsys.readouterr().out
    assert "val_acc after epoch" in out and "x smaller" in out
    assert (tmp_path / "result.md").exists() and (tmp_path / "result.json").exists()


@pytest.mark.dali
def test_an_interrupted_lossy_run_keeps_the_lossless_results(tmp_path, monkeypatch):
    real = compare_module.train_once

    def interrupted_lossy(args, label, change, metric):
        if label == "lossy":
            raise KeyboardInterrupt
        return real(args, label, change, metric)

    monkeypatch.setattr(compare_module, "train_once", interrupted_lossy)
    out = tmp_path / "result"
    with pytest.raises(KeyboardInterrupt):
        compare(cnn_args(tmp_path, "--trainer.max_epochs", "1"), out=str(out))
    (run,) = json.loads(Path(f"{out}.json").read_text())["runs"]
    assert run["label"] == "lossless" and len(run["metric"]) == 1
    assert "did not finish" in Path(f"{out}.md").read_text()


@pytest.mark.dali
@pytest.mark.parametrize("sanity_steps", ["2", "0"])
def test_compare_names_a_metric_the_model_does_not_log_before_training(tmp_path, monkeypatch,
                                                                        sanity_steps):
    trained = []
    monkeypatch.setattr(compare_module._Recorder, "on_train_batch_start",
                        lambda *args: trained.append(args))
    with pytest.raises(ValueError, match="no 'val_f1'.*val_acc"):
        compare(cnn_args(tmp_path, "--trainer.max_epochs", "1",
                         "--trainer.num_sanity_val_steps", sanity_steps), metric="val_f1")
    assert not trained


@pytest.mark.dali
def test_cli_compare_metric_missing_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as failure:
        main(["compare", "--metric", "val_f1", *cnn_args(tmp_path)])
    assert failure.value.code == 2
    assert "error: the model logs no 'val_f1' in validation" in capsys.readouterr().err


@pytest.mark.dali
def test_compare_from_the_console_leaves_lightningcli_no_command_line_to_warn_of(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cswap", "compare", "--metric", "val_f1",
                                      *cnn_args(tmp_path)])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        main()  # stops at the missing metric, after LightningCLI has parsed the recipe
    assert not [w for w in caught if "args parameter" in str(w.message)]
    assert sys.argv[1] == "compare"  # the process's command line as it was


@pytest.mark.dali
def test_compare_needs_a_cswap_strategy(tmp_path):
    with pytest.raises(TypeError, match="SingleDeviceStrategy, not a CSwap strategy"):
        compare(cnn_args(tmp_path, "--trainer.strategy", "auto", "--trainer.max_epochs", "1"))


def test_cli_compare_needs_a_recipe_and_a_known_codec(capsys):
    with pytest.raises(SystemExit):
        main(["compare"])
    assert "--config NAME (`cswap recipes` lists them)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "--lossy", "int3", "--config", "recipes/cnn.yaml"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
