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
    batch, length = SMALL["data.batch_size"], SMALL["data.seq_len"]
    hidden = SMALL["model.hidden_size"]
    inside = (batch, length, 4 * hidden)  # the MLP's activations, recomputed in backward
    assert inside in moved["gpt2"] and inside not in moved["gpt2_checkpointed"]
    assert (batch, length, hidden) in moved["gpt2_checkpointed"]  # the blocks' inputs


def test_the_recipe_checkpoints_with_the_installed_transformers_spelling():
    """transformers 5.23 renamed gradient_checkpointing_enable (deprecated since, a
    FutureWarning); the recipe uses the name the installed release has, silently."""
    import warnings

    from cswap_lightning.recipes.models import GPT2LM

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        module = GPT2LM(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                        max_positions=16, activation_checkpointing=True)
    checkpointed = getattr(module.model, "is_activation_checkpointing", None)
    assert checkpointed if checkpointed is not None else module.model.is_gradient_checkpointing
