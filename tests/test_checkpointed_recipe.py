"""The gpt2_checkpointed recipe: with its blocks checkpointed, the engine moves only what they
keep for backward (their inputs), never what they recompute."""

import pytest
from test_recipes import ROOT, SMALL, no_command_line, small_args  # noqa: F401 (autouse)

from cswap_lightning.commands.fit import main as fit


@pytest.mark.slow
def test_checkpointed_gpt2_leaves_the_engine_only_what_blocks_do_not_recompute(tmp_path):
    moved = {}
    for name in ("gpt2", "gpt2_checkpointed"):
        trainer = fit(small_args(ROOT / "recipes" / f"{name}.yaml", tmp_path / name)).trainer
        sites = trainer.strategy.offloader.last_step().sites
        moved[name] = {s.shape for s in sites if s.decision != "keep"}
    batch, length, hidden = SMALL["data.batch_size"], SMALL["data.seq_len"], SMALL["model.hidden_size"]
    inside = (batch, length, 4 * hidden)  # the MLP's activations, recomputed in backward
    assert inside in moved["gpt2"] and inside not in moved["gpt2_checkpointed"]
    assert (batch, length, hidden) in moved["gpt2_checkpointed"]  # the blocks' inputs
