"""Every YAML recipe in recipes/ parses, prints its CSwap options and trains at a CPU size."""

import csv
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from cswap_lightning import CSwapConfig
from cswap_lightning.commands.cli import main
from cswap_lightning.commands.fit import cli_args
from cswap_lightning.commands.fit import main as fit
from cswap_lightning.integrations.lightning import CSwapStrategy
from cswap_lightning.recipes import cpu_size, describe, resolve_configs, shipped
from cswap_lightning.recipes.models import ImageClassifier
from cswap_lightning.recipes.nets import resnet50, vgg16
from cswap_lightning.recipes.tokens import TokenSequences

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CNN = ROOT / "recipes" / "cnn.yaml"  # (its data is DALI's: the tests running it are marked)


def on_dali(path: Path) -> list[pytest.MarkDecorator]:
    """The ``dali`` marker for a recipe whose data DALI loads (its tests skip without DALI)."""
    return [pytest.mark.dali] if "DALIImageDataModule" in path.read_text() else []


RECIPE_CASES = [pytest.param(path, marks=on_dali(path), id=path.stem) for path in RECIPES]

# CI sizes: a recipe's value (or its class's default) is lowered to these, never raised.
SMALL = {
    "model.width": 8,
    "model.hidden_size": 32,
    "model.num_layers": 2,
    "model.num_heads": 2,
    "model.vocab_size": 128,
    "data.vocab_size": 128,
    "data.image_size": 32,
    "data.seq_len": 16,
    "data.num_samples": 48,
    "data.batch_size": 8,
}


def init_args(recipe: dict, section: str) -> dict:
    """What ``recipe`` builds its ``section`` (model or data) with: its values over the
    class's defaults."""
    module, _, name = recipe[section]["class_path"].rpartition(".")
    signature = inspect.signature(getattr(importlib.import_module(module), name))
    defaults = {key: parameter.default for key, parameter in signature.parameters.items()}
    return defaults | (recipe[section].get("init_args") or {})


def small_args(path: Path, root: Path, accelerator: str = "cpu") -> list[str]:
    """Arguments that run recipe ``path`` for 2 steps at a CPU size, writing only under ``root``."""
    recipe = yaml.safe_load(path.read_text())
    args = {section: init_args(recipe, section) for section in ("model", "data")}
    overrides = ["--config", str(path)]
    for key, small in SMALL.items():
        section, name = key.split(".")
        if name in args[section]:
            overrides += [f"--{key}", str(min(args[section][name], small))]
    if "cache_dir" in args["data"]:
        overrides += ["--data.cache_dir", str(root / "data")]
    return [
        *overrides,
        "--trainer.accelerator", accelerator,
        "--trainer.max_steps", "2",
        "--trainer.limit_train_batches", "2",  # one epoch, so validation runs too
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(root),
        "--trainer.strategy.init_args.config.min_bytes", "4096",  # offload at CI sizes
    ]


@pytest.fixture(autouse=True)
def no_command_line(monkeypatch):
    """Run as if called from Python, not with pytest's own arguments on the command line."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


def test_recipes_are_found_and_shipped_with_the_package():
    assert {path.stem for path in RECIPES} >= {"cnn", "vgg16", "resnet50", "bert", "gpt2"}
    assert {name: path.read_text() for name, path in shipped().items()} == {
        path.stem: path.read_text() for path in RECIPES}


def test_config_names_resolve_to_shipped_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cnn = str(shipped()["cnn"])
    assert resolve_configs(["--config", "cnn", "--trainer.max_steps", "2"]) == [
        "--config", cnn, "--trainer.max_steps", "2"]
    assert resolve_configs(["-c", "recipes/bert.yaml"]) == ["-c", str(shipped()["bert"])]
    assert resolve_configs(["--config=gpt2.yaml"]) == [f"--config={shipped()['gpt2']}"]
    (tmp_path / "cnn").write_text("trainer: {}\n")  # a file of that name wins
    assert resolve_configs(["--config", "cnn"]) == ["--config", "cnn"]
    assert resolve_configs(["--config"]) == ["--config"]  # LightningCLI reports it
    with pytest.raises(SystemExit, match=r"'vgg'.*not a file, nor a shipped recipe \(bert, cnn"):
        resolve_configs(["--config", "vgg"])
    with pytest.raises(SystemExit, match="'elsewhere/cnn.yaml'"):
        resolve_configs(["--config", "elsewhere/cnn.yaml"])


def test_cswap_recipes_lists_each_with_what_it_trains(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    width = len("gpt2_checkpointed")  # the longest name: every description in one column
    for name, path in shipped().items():
        assert f"{name:{width}} {describe(path)}" in out and f"\n{'':{width}} {path}" in out
        size = ("CPU-sized: cswap fit --config cnn" if name == "cnn" else
                f"GPU-sized; on a CPU: cswap fit --config {name} --size cpu")
        assert f"\n{'':{width}} {size}\n" in out
    assert describe(shipped()["bert"]).startswith("BERT-base sequence classification")
    assert describe(shipped()["bert"]).endswith("on generated token sequences.")


@pytest.mark.parametrize("path", RECIPE_CASES)
def test_recipe_trains_two_steps_with_the_engine(path, tmp_path):
    cli = fit(small_args(path, tmp_path))
    trainer = cli.trainer
    assert isinstance(trainer.strategy, CSwapStrategy)
    assert trainer.global_step == 2
    for name in ("train_loss", "val_loss"):
        assert torch.isfinite(trainer.callback_metrics[name]), name
    assert trainer.strategy.offloader.last_step().offloaded_bytes > 0
    log_dir = Path(trainer.log_dir)
    assert log_dir.is_relative_to(tmp_path)
    assert (log_dir / "config.yaml").is_file() and (log_dir / "metrics.csv").is_file()


@pytest.mark.parametrize("path", RECIPE_CASES)
def test_print_config_shows_every_cswap_option(path, capsys):
    with pytest.raises(SystemExit) as done:
        fit(["--config", str(path), "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    recipe = yaml.safe_load(path.read_text())["trainer"]["strategy"]["init_args"]["config"]
    defaults = {f.name: f.default for f in dataclasses.fields(CSwapConfig)}
    expected = {name: recipe.get(name, default) for name, default in defaults.items()}
    config = printed["init_args"]["config"]
    assert config == {name: list(v) if isinstance(v, tuple) else v for name, v in expected.items()}


@pytest.mark.dali
@pytest.mark.parametrize(
    "key, value, named",  # keys inside a class_path are named relative to the class
    [("model.arch", "bogus", "arch"), ("data.image_size", "big", "image_size"),
     ("trainer.max_steps", "two", "trainer.max_steps")],
)
def test_bad_value_fails_naming_the_key(key, value, named, capsys, tmp_path):
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), f"--{key}", value, "--trainer.default_root_dir", str(tmp_path)])
    assert failure.value.code == 2
    error = capsys.readouterr().err
    assert value in error.partition(f'Parser key "{named}"')[2]  # the key, then the value
    assert not any(tmp_path.iterdir())  # failed before anything ran


@pytest.mark.dali
def test_bad_cswap_option_fails_at_parse_time_naming_it(tmp_path, capsys):
    key = "--trainer.strategy.init_args.config.plan"
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), key, "bogus", "--trainer.default_root_dir", str(tmp_path)])
    assert failure.value.code == 2
    error = capsys.readouterr().err
    assert 'Parser key "plan"' in error and "'zvc'" in error and "Got value: bogus" in error
    assert not any(tmp_path.iterdir())  # failed before anything ran


CSWAP_CONFIG = "trainer.strategy.init_args.config"


@pytest.mark.dali
def test_cswap_options_have_a_short_alias(capsys):
    assert cli_args(["--cswap.plan", "zvc", "--cswap.budget=0.5", "--trainer.max_steps", "2"]) == [
        f"--{CSWAP_CONFIG}.plan", "zvc", f"--{CSWAP_CONFIG}.budget=0.5", "--trainer.max_steps", "2"]
    with pytest.raises(SystemExit) as done:
        fit(["--config", str(CNN), "--cswap.plan", "zvc", "--cswap.budget=0.5", "--print_config"])
    assert done.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]["config"]
    assert (config["plan"], config["budget"]) == ("zvc", 0.5)


@pytest.mark.dali
@pytest.mark.parametrize("yaml_line, first_line, hint", [
    ("        budjet: null", f"{CSWAP_CONFIG}: Option 'budjet' is not accepted",
     "  did you mean 'budget'?"),
    ("        plan: zcv", (f"{CSWAP_CONFIG}.plan: Expected a typing.Literal['auto', 'keep', "
                          "'raw', 'zvc', 'rle', 'exponent', 'int8', 'fp8', 'int4']. "
                          "Got value: zcv"),
     "jsonargparse's full report:"),
])
def test_a_refused_yaml_value_is_said_first(yaml_line, first_line, hint, tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text(f"trainer:\n  strategy:\n    init_args:\n      config:\n{yaml_line}\n")
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), "--config", str(override)])
    assert failure.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [f"cswap fit: error: {first_line}", hint]
    assert not any(line.startswith("usage:") for line in err)


@pytest.mark.dali
def test_a_misspelt_option_is_said_with_the_likely_one(capsys):
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), "--trainer.max_epohcs", "2"])
    assert failure.value.code == 2
    assert capsys.readouterr().err.splitlines()[:2] == [
        "cswap fit: error: unrecognized arguments: --trainer.max_epohcs 2",
        "  did you mean 'trainer.max_epochs'?"]


@pytest.mark.dali
@pytest.mark.parametrize("key, value, error", [
    ("min_bytes", "-1", "CSwapConfig.min_bytes must be >= 0 bytes, got -1"),
    ("prefetch_bytes", "-1", "CSwapConfig.prefetch_bytes must be >= 0 bytes, got -1"),
    ("budget", "1.5", "CSwapConfig.budget must be None (offload everything), 'auto'"),
])
def test_out_of_range_cswap_option_is_a_short_usage_error(key, value, error, tmp_path, capsys):
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), f"--{CSWAP_CONFIG}.{key}", value,
             "--trainer.default_root_dir", str(tmp_path)])
    assert failure.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cswap fit: error: {CSWAP_CONFIG}: {error}") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # failed before anything ran


@pytest.mark.dali
def test_out_of_range_value_in_a_yaml_config_is_a_short_usage_error(tmp_path, capsys):
    override = tmp_path / "override.yaml"
    override.write_text("trainer:\n  strategy:\n    init_args:\n      config:\n"
                        "        min_bytes: -4096\n")
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), "--config", str(override)])
    assert failure.value.code == 2
    assert capsys.readouterr().err == (f"cswap fit: error: {CSWAP_CONFIG}: CSwapConfig.min_bytes "
                                       "must be >= 0 bytes, got -4096\n")


@pytest.mark.dali
@pytest.mark.parametrize("key", ["model.width", "model.num_classes", "data.batch_size",
                                 "data.image_size", "data.num_threads"])
def test_recipe_sizes_must_be_positive_at_parse_time(key, capsys, tmp_path):
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), f"--{key}", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert failure.value.code == 2
    err = capsys.readouterr().err
    assert f'Parser key "{key.split(".")[1]}"' in err and "PositiveInt: 0" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.dali
def test_recipe_argument_refused_when_built_is_a_short_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as failure:
        fit(["--config", str(CNN), "--data.channels", "2", "--trainer.default_root_dir",
             str(tmp_path)])
    assert failure.value.code == 2
    assert capsys.readouterr().err == ("cswap fit: error: channels must be 1 (grayscale) or 3 "
                                       "(RGB), got 2\n")


@pytest.mark.dali
@pytest.mark.slow
def test_console_entry_runs_without_lightningclis_args_warning_and_fails_cleanly(tmp_path):
    args = small_args(CNN, tmp_path)
    args[1] = "cnn"  # a recipe name, resolved by `cswap fit`

    def cswap_fit(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cswap_lightning", "fit", *args, *extra],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              check=False)

    good = cswap_fit()
    assert good.returncode == 0, good.stderr[-3000:]
    assert "args parameter" not in good.stderr and "args=" not in good.stderr
    bad = cswap_fit(f"--{CSWAP_CONFIG}.budget", "1.5")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert bad.stderr.splitlines()[-1].startswith(f"cswap fit: error: {CSWAP_CONFIG}: "
                                                  "CSwapConfig.budget must be")


@pytest.mark.dali
@pytest.mark.slow
def test_cnn_recipe_as_shipped_learns_through_the_console_entry(tmp_path):
    run = subprocess.run(  # by name, from a directory with no recipes/ in it
        [sys.executable, "-m", "cswap_lightning", "fit", "--config", "cnn",
         "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
         "--trainer.default_root_dir", str(tmp_path), "--data.cache_dir", str(tmp_path / "data")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (log_dir,) = (tmp_path / "lightning_logs").iterdir()
    with open(log_dir / "metrics.csv") as metrics:
        accuracy = [float(row["val_acc"]) for row in csv.DictReader(metrics) if row["val_acc"]]
    assert len(accuracy) == 3 and accuracy[-1] > 0.9  # one validation per epoch
    assert (log_dir / "cswap_summary.txt").is_file()


def without_dali(root: Path) -> dict[str, str]:
    """An environment whose Python finds no DALI: an empty nvidia package under ``root``
    hides the installed one's."""
    (root / "nvidia").mkdir()
    (root / "nvidia" / "__init__.py").touch()
    return {**os.environ, "PYTHONPATH": str(root)}


def test_dali_tests_skip_cleanly_without_dali(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_dali.py"],
        cwd=ROOT, env=without_dali(tmp_path), capture_output=True, text=True, timeout=300,
        check=False,
    )
    # 5: the module skipped as a whole, so nothing was collected (a collection error is 2).
    assert run.returncode == 5 and "1 skipped" in run.stdout, run.stdout[-3000:]
    assert "NVIDIA DALI is not installed" in run.stdout


def test_an_image_recipe_without_dali_is_a_short_usage_error(tmp_path):
    # The data module's import fails: the error said is its own, not a traceback of the
    # report's condensing (which looked the class up to place its arguments).
    run = subprocess.run(
        [sys.executable, "-m", "cswap_lightning", "fit", "--config", "cnn",
         "--trainer.default_root_dir", str(tmp_path)],
        cwd=tmp_path, env=without_dali(tmp_path), capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[0] == (
        "cswap fit: error: data: the image recipes load data with NVIDIA DALI, which is not "
        "installed: pip install 'cswap-lightning[dali]' (nvidia-dali-cuda130; Linux x86_64 or "
        "aarch64)")
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("build, params", [(vgg16, 138_357_544), (resnet50, 25_557_032)])
def test_networks_match_torchvisions(build, params):
    with torch.device("meta"):  # shapes only: no memory, no time
        net = build()
    assert sum(p.numel() for p in net.parameters()) == params  # torchvision's published sizes
    relus = [m for m in net.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(relu.inplace for relu in relus)


def test_cnn_arch_names_the_input_it_needs():
    with pytest.raises(ValueError, match="in_channels=3.*data.image_size 8"):
        ImageClassifier(arch="cnn", in_channels=3)


def test_token_sequences_carry_a_learnable_pattern():
    data = TokenSequences("classification", 64, 12, vocab_size=100, num_labels=4, seed=0)
    steps = (data.input_ids[:, 1:] - data.input_ids[:, :-1]) % 100
    assert torch.equal(steps, steps[:, :1].expand_as(steps))  # one step per sequence
    assert torch.equal(data.labels, data.input_ids[:, 0] // 25)  # which quarter it starts in
    by_step = TokenSequences("step_classification", 64, 12, vocab_size=100, num_labels=7, seed=0)
    assert torch.equal(by_step.labels,
                       (by_step.input_ids[:, 1] - by_step.input_ids[:, 0]) % 100 - 1)
    lm = TokenSequences("causal_lm", 64, 12, vocab_size=100, num_labels=4, seed=0)
    assert lm.labels is lm.input_ids  # the model shifts them


@pytest.mark.gpu
@pytest.mark.parametrize("name", [pytest.param(name, marks=on_dali(
    ROOT / "recipes" / f"{name}.yaml")) for name in ("cnn", "bert")])
def test_recipe_on_gpu_moves_activations_off_the_device(name, tmp_path):
    # On CUDA the step after the measured one runs without hooks, its time taken as plain
    # training's (``Learning._time_plain``): the plan runs from the third step on.
    cli = fit([*small_args(ROOT / "recipes" / f"{name}.yaml", tmp_path, accelerator="gpu"),
               "--trainer.max_steps", "4", "--trainer.limit_train_batches", "4"])
    assert cli.trainer.strategy.root_device.type == "cuda"
    assert cli.trainer.global_step == 4
    assert cli.trainer.strategy.offloader.last_step().offloaded_bytes > 0


GPU_SIZED = [name for name in shipped() if name != "cnn"]


@pytest.mark.parametrize("name", GPU_SIZED)
def test_a_gpu_sized_recipe_ships_its_cpu_size_and_says_how_to_run_it(name):
    assert cpu_size(name) is not None and cpu_size("cnn") is None
    assert f"#   cswap fit --config {name} --size cpu\n" in shipped()[name].read_text()


def test_a_gpu_sized_recipe_as_shipped_is_refused_where_torch_sees_no_gpu(capsys):
    with pytest.raises(SystemExit) as failure:
        cli_args(["--config", "gpt2"], cuda=False)
    assert failure.value.code == 2
    assert capsys.readouterr().err == (
        "cswap fit: error: the gpt2 recipe is sized for a GPU, and torch sees no CUDA device "
        "here: on the CPU it would take many GB of RAM and minutes a step. Run its CPU size: "
        "cswap fit --config gpt2 --size cpu (or --size gpu to run it as shipped)\n")
    gpt2 = str(shipped()["gpt2"])
    assert cli_args(["--config", "gpt2"], cuda=True) == ["--config", gpt2]
    assert cli_args(["--config", "gpt2", "--size", "gpu"], cuda=False) == ["--config", gpt2]
    sized = ["--config", "gpt2", "--model.hidden_size", "64"]  # sized by the user
    assert cli_args(sized, cuda=False) == ["--config", gpt2, "--model.hidden_size", "64"]
    assert cli_args(["--config", "cnn"], cuda=False) == ["--config", str(shipped()["cnn"])]


def test_size_cpu_lays_the_cpu_size_over_the_recipe_right_after_it(capsys):
    gpt2, cpu = str(shipped()["gpt2"]), str(cpu_size("gpt2"))
    assert cli_args(["--trainer.max_steps", "2", "--config", "gpt2", "--size", "cpu",
                     "--data.batch_size", "2"], cuda=False) == [
        "--trainer.max_steps", "2", "--config", gpt2, "--config", cpu, "--data.batch_size", "2"]
    assert cli_args(["--size=cpu", "-c", str(RECIPES[0].parent / "gpt2.yaml")], cuda=True) == [
        "-c", str(RECIPES[0].parent / "gpt2.yaml"), "--config", cpu]
    for args, error in ([["--config", "cnn", "--size", "cpu"], "cnn has no other size"],
                        [["--config", "gpt2", "--size", "big"], "--size takes cpu or gpu"]):
        with pytest.raises(SystemExit) as failure:
            cli_args(args, cuda=False)
        assert failure.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n == "gpt2" else [pytest.mark.slow, *on_dali(shipped()[n])])
    for n in GPU_SIZED])
def test_a_recipe_at_its_cpu_size_moves_its_larger_activations(name, tmp_path):
    """At the CPU size the YAML names, with the default min_bytes, the engine has work: it
    moves tensors, and the measured peak of saved tensors is below keeping them all."""
    args = ["--config", name, "--size", "cpu", "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "3", "--trainer.limit_train_batches", "3",
            "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path)]
    if "cache_dir" in init_args(yaml.safe_load(shipped()[name].read_text()), "data"):
        args += ["--data.cache_dir", str(tmp_path / "data")]
    offloader = fit(args).trainer.strategy.offloader
    tracked = offloader.tracked_step()
    assert offloader.config.min_bytes == CSwapConfig().min_bytes
    assert tracked.offloaded_bytes > 0 and tracked.peak_share < 1, tracked.table()


@pytest.mark.slow
def test_sigterm_stops_cswap_fit_after_the_step_with_a_checkpoint(tmp_path):
    """A scheduler's SIGTERM: the run stops after the step under way, saves a checkpoint it
    can resume from, writes cswap's summary, and exits with 143 (128 + SIGTERM)."""
    import signal
    import time

    root = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "cswap_lightning", "fit", "--config", "cnn",
         "--trainer.max_epochs", "100000", "--trainer.limit_train_batches", "2",
         "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
         "--trainer.default_root_dir", str(root), "--data.cache_dir", str(tmp_path / "data")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300  # trained a while: an epoch's checkpoint is there
    # (only the run's folder is searched: the data's is being written and renamed meanwhile)
    while not list(root.rglob("epoch=*.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    text = run.stdout.read()
    assert run.wait(timeout=300) == 143, text[-3000:]
    checkpoint = next(root.rglob("sigterm.ckpt"))
    assert "cswap fit: stopped by SIGTERM at global step" in text
    assert f"checkpoint saved to {checkpoint}; resume with the same command and --ckpt_path" in text
    assert "cswap fit: SIGTERM: stopping after the step under way" in text
    assert torch.load(checkpoint, weights_only=False)["global_step"] > 0
