"""The README says what the project does: its first commands, and the warnings it lists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_begins_with_the_demo_and_test_commands():
    first_block = README.split("```")[1]
    assert first_block.split() == ["bash", "make", "demo", "make", "test"]


def test_every_warning_listed_is_one_the_library_prints():
    section = README.split("## Warnings you may see")[1].split("\n## ")[0]
    listed = re.findall(r"^\| `(cswap: [^`]+)`", section, flags=re.MULTILINE)
    assert len(listed) >= 6
    source = "".join(p.read_text() for p in (ROOT / "cswap_lightning").rglob("*.py"))
    printed = re.sub(r'"\s*\n\s*f?"', "", source)  # join implicitly concatenated strings
    for message in listed:
        words = [re.escape(w) for w in message.replace("zvc", "{codec.name}").split(" ... ")]
        assert re.search(".*".join(words), printed), message


def test_make_test_fast_is_named_beside_make_test_before_anything_else():
    opening = README.split("## ")[0]
    assert "`make test-fast`" in opening


def python_block(containing: str) -> str:
    return next(block for block in README.split("```python")[1:]
                if containing in block).split("```")[0]


def test_the_plain_loop_runs_as_written_silently_and_prints_the_summary(capsys):
    """The README's plain loop, on a small model: it watches the model (nothing warns), and
    what it prints ends with the summary the integrations print."""
    import warnings

    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                            for _ in range(3)])
    loader = [(torch.randn(32, 64), torch.randint(0, 64, (32,))) for _ in range(4)]
    names = {"model": model, "loader": loader, "loss_fn": F.cross_entropy,
             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(python_block("cswap.offload(config).watch(model)"), names)  # noqa: S102 - as written
    offloader = names["offloader"]
    try:
        assert offloader.recomputer.model is model
        tracked = offloader.tracked_step()
        out = capsys.readouterr().out
        assert out.rstrip().endswith("\n".join(tracked.summary()))
        assert f"budget {6.0:.1f} GiB: held" in out
    finally:
        offloader.close()


def test_the_logging_lines_show_the_planners_decisions(caplog):
    import logging

    from conftest import grads, model_and_batch

    from cswap_lightning import CSwapConfig, Offloader

    logger = logging.getLogger("cswap_lightning")
    level = logger.level
    try:
        exec(python_block('getLogger("cswap_lightning")'), {})  # noqa: S102 - as written
        model, x, y = model_and_batch("mlp")
        off = Offloader(CSwapConfig(budget=1 << 30, profile_steps=1)).watch(model)
        grads(model, x, y, off, steps=3)
        off.close()
        planned = [r.getMessage() for r in caplog.records
                   if r.name.startswith("cswap_lightning") and r.levelno == logging.INFO]
        assert any(m.startswith("cswap: planned to move") for m in planned), planned
    finally:
        logger.setLevel(level)


def test_the_use_it_lines_run_as_written_and_a_step_that_fits_ends_without_hooks(tmp_path):
    """"Use it": each line as written, on a small model on the CPU; the default moves nothing
    where the step fits, and once its plan is checked its steps run without hooks."""
    import lightning
    import torch
    import transformers
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    names = {"lightning": lightning, "transformers": transformers, "model": model,
             "args": transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[]),
             "data": [], "x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,)),
             "loss_fn": F.cross_entropy}
    block = README.split("## Use it")[1].split("```python")[1].split("```")[0]
    exec(block, names)  # noqa: S102 - as written
    offloader = names["offloader"]
    try:
        for _ in range(6):
            with offloader:
                loss = F.cross_entropy(model(names["x"]), names["y"])
            loss.backward()
        last = offloader.last_step()
        assert last.hooks_off and last.offloaded_bytes == 0
    finally:
        offloader.close()
