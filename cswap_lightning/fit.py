"""`cswap fit`: LightningCLI over any LightningModule and datamodule, for the YAML recipes.

``cswap fit --config recipes/resnet50.yaml --trainer.max_steps 100`` is LightningCLI's
``fit`` subcommand: every option, ``--print_config`` and ``--help`` are LightningCLI's own.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

# Registers the strategy names "cswap", "cswap_ddp" and "cswap_fsdp" for --trainer.strategy.
from .integrations import lightning as _strategies  # noqa: F401


def main(args: list[str] | None = None) -> LightningCLI:
    """Run ``Trainer.fit`` as configured by ``args`` (what would follow ``cswap fit``).

    ``None`` parses the process's command line, which must start with ``fit``.
    """
    return LightningCLI(
        args=None if args is None else ["fit", *args], parser_kwargs={"prog": "cswap"}
    )
