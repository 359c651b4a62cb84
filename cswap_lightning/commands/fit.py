"""`cswap fit`: LightningCLI over any LightningModule and datamodule, for the YAML recipes.

``cswap fit --config resnet50 --trainer.max_steps 100`` is LightningCLI's ``fit`` subcommand
(``--config`` also takes a shipped recipe's name): every option, ``--print_config`` and
``--help`` are LightningCLI's own. A value the classes refuse when they are built (a negative
``min_bytes``, ``budget: 1.5``) is a one-line usage error, exit status 2, not a traceback.
"""

from __future__ import annotations

import sys
from pydoc import locate
from typing import NoReturn

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI

from ..config import CSwapConfig

# Importing it registers the strategy names "cswap", "cswap_ddp" and "cswap_fsdp".
from ..integrations.lightning import _CSwapMixin
from ..recipes import resolve_configs

CSWAP_CONFIG = "trainer.strategy.init_args.config"


def _usage_error(message: str) -> NoReturn:
    print(f"cswap fit: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class CSwapCLI(LightningCLI):
    """LightningCLI whose configured classes refusing their arguments end in a usage error."""

    def before_instantiate_classes(self) -> None:
        """Build the strategy's CSwapConfig once first, to name the key of a bad value: inside
        the Trainer's ``str | Strategy`` union, jsonargparse would report the config's error
        as a long traceback whose cause is the ``str`` alternative's."""
        strategy = self.config[self.subcommand].trainer.strategy
        if not isinstance(strategy, Namespace):  # a name like "cswap": the default config
            return
        cls, config = locate(strategy.class_path), strategy.init_args.get("config")
        if isinstance(cls, type) and issubclass(cls, _CSwapMixin) and isinstance(config, Namespace):
            try:
                CSwapConfig(**config.as_dict())
            except (TypeError, ValueError) as err:
                _usage_error(f"{CSWAP_CONFIG}: {err}")

    def instantiate_classes(self) -> None:
        """Report what a recipe's class refused (``data.channels 2``): the error jsonargparse
        raised from, without the wrapping and the traceback."""
        try:
            super().instantiate_classes()
        except (TypeError, ValueError) as err:
            while err.__cause__ is not None:
                err = err.__cause__
            _usage_error(str(err))


def main(args: list[str] | None = None) -> LightningCLI:
    """Run ``Trainer.fit`` as configured by ``args`` (what would follow ``cswap fit``).

    ``None`` parses the process's command line, which must start with ``fit``: its recipe
    names are resolved in place, in ``sys.argv``, because LightningCLI reads either
    ``sys.argv`` or ``args`` (and warns when given ``args`` beside a command line).
    """
    if args is None:
        sys.argv[2:] = resolve_configs(sys.argv[2:])
    else:
        args = ["fit", *resolve_configs(args)]
    return CSwapCLI(args=args, parser_kwargs={"prog": "cswap"})
