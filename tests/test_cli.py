"""The `cswap` command line: a numeric flag out of range is a usage error (exit status 2) that
names the flag and what it accepts, never a traceback from deep in the run."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from cswap_lightning import __version__
from cswap_lightning.commands import args, cli
from cswap_lightning.commands.demo import TRAIN_IMAGES, load_digits

FAST_CODEC = ["--quick", "--no-relu", "--no-nvcomp", "--codecs", "zvc", "--dtypes", "float32",
              "--sparsities", "0"]
WHOLE = "expected a whole number"
BUDGET = "expected none, auto, a share of device memory like 0.5 or 50%, or a size like 2GiB"
MISSING_GPU = f"cuda:{torch.cuda.device_count()}"  # one past this machine's last GPU

BAD_FLAGS = [  # the command line, the flag the error names, what it says the flag accepts
    (["demo", "--budget", "inf"], "--budget", BUDGET),
    (["demo", "--budget", "1.5"], "--budget", BUDGET),
    (["demo", "--budget", "0"], "--budget", BUDGET),
    (["demo", "--budget", "lots"], "--budget", BUDGET),
    (["demo", "--min-bytes", "-1"], "--min-bytes", f"{WHOLE} >= 0"),
    (["demo", "--epochs", "0"], "--epochs", f"{WHOLE} >= 1"),
    (["demo", "--epochs", "1.5"], "--epochs", f"{WHOLE} >= 1"),
    (["demo", "--batch-size", "0"], "--batch-size", f"{WHOLE} from 1 to {TRAIN_IMAGES}"),
    (["demo", "--batch-size", "5000"], "--batch-size", f"{WHOLE} from 1 to {TRAIN_IMAGES}"),
    (["demo", "--width", "0"], "--width", f"{WHOLE} >= 1"),
    (["demo", "--device", "tpu"], "--device", "expected auto, cpu, cuda or cuda:N"),
    (["demo", "--device", MISSING_GPU], "--device", f"got {MISSING_GPU!r}, but"),
    (["bench", "advisor", "--device", "gpu"], "--device", "expected auto, cpu, cuda or cuda:N"),
    (["bench", "overhead", "--device", MISSING_GPU], "--device", f"got {MISSING_GPU!r}, but"),
    (["bench", "step", "--steps", "0", "--warmup", "0"], "--steps", f"{WHOLE} >= 1"),
    (["bench", "step", "--steps", "1", "--warmup", "-1"], "--warmup", f"{WHOLE} >= 0"),
    (["bench", "step", "--steps", "1", "--warmup", "0", "--batch-size", "0"], "--batch-size",
     f"{WHOLE} >= 1"),
    (["bench", "codec", "--sizes", "256KiB", "--repeats", "0", *FAST_CODEC], "--repeats",
     f"{WHOLE} >= 1"),
    (["bench", "codec", "--sizes", "256KiB", "--warmup", "-1", *FAST_CODEC], "--warmup",
     f"{WHOLE} >= 0"),
    (["bench", "codec", "--sizes", "0", *FAST_CODEC], "--sizes",
     "expected a positive multiple of 4"),
    (["bench", "codec", "--sizes", "6", *FAST_CODEC], "--sizes",
     "expected a positive multiple of 4"),
    (["bench", "codec", "--sparsities", "101"], "--sparsities", f"{WHOLE} from 0 to 100"),
    (["tune", "--max-evals", "0"], "--max-evals", f"{WHOLE} >= 1"),
    (["tune", "--startup", "0"], "--startup", f"{WHOLE} >= 1"),
    (["tune", "--seed", "-1"], "--seed", f"{WHOLE} >= 0"),
    (["tune", "--mib", "0"], "--mib", f"{WHOLE} >= 1"),
    (["tune", "--sparsity", "2"], "--sparsity", "expected a number from 0 to 1"),
    (["tune", "--sparsity", "nan"], "--sparsity", "expected a number from 0 to 1"),
]


@pytest.mark.parametrize("argv, flag, accepted", BAD_FLAGS,
                         ids=[" ".join(argv) for argv, _, _ in BAD_FLAGS])
def test_out_of_range_flag_is_a_usage_error_naming_it(argv, flag, accepted, capsys):
    with pytest.raises(SystemExit) as failure:
        cli.main(argv)
    assert failure.value.code == 2
    error = capsys.readouterr().err
    value = argv[argv.index(flag) + 1]
    assert f"error: argument {flag}: {accepted}" in error and f"got {value!r}" in error, error


@pytest.mark.parametrize("text, value", [("none", None), ("auto", "auto"), ("0.5", 0.5),
                                         ("1.0", 1.0), ("1", 1), ("2000000000", 2_000_000_000),
                                         ("2e9", 2_000_000_000), ("2.5e9", 2_500_000_000),
                                         ("2GiB", 2 << 30), ("50%", 0.5)])
def test_budget_flag_reads_what_the_config_accepts(text, value):
    parsed = args.budget(text)
    assert parsed == value and type(parsed) is type(value)


def test_a_one_byte_budget_is_a_usage_error_saying_the_fix(capsys):
    with pytest.raises(SystemExit) as failure:
        cli.main(["demo", "--budget", "1"])
    assert failure.value.code == 2
    assert "CSwapConfig.budget=1 is 1 byte" in capsys.readouterr().err


def test_demo_batch_size_bound_is_its_training_split():
    import torch

    assert len(load_digits(torch.device("cpu"))[0]) == TRAIN_IMAGES


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_usage_error_saying_so(capsys):
    with pytest.raises(SystemExit) as failure:
        cli.main(["demo", "--device", "cuda"])
    assert failure.value.code == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"cswap-lightning {__version__}"


def test_a_flag_the_config_refuses_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as failure:
        cli.main(["demo", "--budget", "1e21"])
    assert failure.value.code == 2
    assert "error: CSwapConfig.budget=1000000000000000000000 bytes" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly():
    # `cswap recipes | head -1`: the reader goes away before the command writes
    run = subprocess.Popen([sys.executable, "-m", "cswap_lightning", "recipes"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.close()
    _, err = run.communicate(timeout=120)
    assert run.returncode == 1 and err == b"", err.decode()[-3000:]


def test_env_reports_what_a_bug_report_needs(capsys):
    from cswap_lightning.codecs.cuda_build import find_nvcc

    assert cli.main(["env"]) == 0
    lines = dict(re.fullmatch(r"(.+?) {2,}(.+)", line).groups()  # name, then its value
                 for line in capsys.readouterr().out.splitlines())
    assert lines["cswap-lightning"].startswith(__version__)
    assert lines["torch"].startswith(torch.__version__)
    assert lines["CUDA"] == "not available" or lines["CUDA"].startswith("cuda:0")
    assert ("release" in lines["nvcc"]) if find_nvcc() else ("not found" in lines["nvcc"])
    assert "enable" in lines["CUDA codecs"]
    link = [value for name, value in lines.items() if name.startswith("link ")]
    assert link and all("GB/s" in value for value in link)
    assert f"transformers {__import__('transformers').__version__}" in lines["packages"]
