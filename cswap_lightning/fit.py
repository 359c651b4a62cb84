"""`cswap fit`: LightningCLI over any LightningModule and datamodule, for the YAML recipes.

``cswap fit --config resnet50 --trainer.max_steps 100`` is LightningCLI's ``fit`` subcommand
(``--config`` also takes a shipped recipe's name): every option, ``--print_config`` and
``--help`` are LightningCLI's own.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

# Registers the strategy names "cswap", "cswap_ddp" and "cswap_fsdp" for --trainer.strategy.
from .integrations import lightning as _strategies  # noqa: F401
from .recipes import resolve_configs


def main(args: list[str] | None = None) -> LightningCLI:
    """Run ``Trainer.fit`` as configured by ``args`` (what would follow ``cswap fit``).

    ``None`` parses the process's command line, which must start with ``fit``.
    """
    args = sys.argv[2:] if args is None else args
    return LightningCLI(args=["fit", *resolve_configs(args)], parser_kwargs={"prog": "cswap"})
