"""`cswap fit`: LightningCLI over any LightningModule and datamodule, for the YAML recipes.

``cswap fit --config resnet50 --trainer.max_steps 100`` is LightningCLI's ``fit`` subcommand
(``--config`` also takes a shipped recipe's name): every option, ``--print_config`` and
``--help`` are LightningCLI's own, and ``--cswap.FIELD VALUE`` is short for
``--trainer.strategy.init_args.config.FIELD VALUE``. A value the classes refuse when they are
built (a negative ``min_bytes``, ``budget: 1.5``) is a one-line usage error, exit status 2, not
a traceback; one jsonargparse refuses (a misspelt key, a value outside a ``Literal``) is too,
its innermost line first, before jsonargparse's full report and without the usage.

``--size cpu`` runs a GPU-sized recipe at its CPU size (``recipes.apply_size``). On SIGTERM it
stops after the step under way, saves a checkpoint and exits with status 143
(``StopOnSigterm``).
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from dataclasses import fields, is_dataclass
from difflib import get_close_matches
from pathlib import Path
from pydoc import locate
from types import FrameType
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..config import CSwapConfig

# Importing it registers the strategy names "cswap", "cswap_ddp" and "cswap_fsdp".
from ..integrations.lightning import _CSwapMixin
from ..recipes import apply_size, resolve_configs

CSWAP_CONFIG = "trainer.strategy.init_args.config"
ALIAS = "--cswap."  # --cswap.budget 0.5: --trainer.strategy.init_args.config.budget 0.5
CSWAP_FIELDS = ", ".join(f.name for f in fields(CSwapConfig))


def _usage_error(message: str) -> NoReturn:
    print(f"cswap fit: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def cli_args(args: list[str], cuda: bool | None = None) -> list[str]:
    """LightningCLI's arguments for ``args``: ``--cswap.FIELD`` spelt out in full, each
    shipped recipe's name given to ``--config`` replaced by its path, and ``--size`` applied
    (``recipes.apply_size``; ``cuda``: whether this machine has a GPU, asked if None). A
    ``--size`` that cannot apply, or a GPU-sized recipe as shipped on a machine without a
    GPU, is a usage error."""
    full = [f"--{CSWAP_CONFIG}.{arg.removeprefix(ALIAS)}" if arg.startswith(ALIAS) else arg
            for arg in args]
    try:
        return apply_size(resolve_configs(full),
                          torch.cuda.is_available() if cuda is None else cuda)
    except ValueError as err:
        _usage_error(str(err))


# jsonargparse's report nests the error of each alternative of each union under the key
# that failed: these lines are structure, not the error.
_STRUCTURE = re.compile(r"(- )?(Does not validate against any of the Union subtypes|Subtypes: .*|"
                        r"Errors:|Given value( type)?: .*|Expected a <class '(str|NoneType)'>)")
_KEY = re.compile(r'Parser key "(.+)":')
_CLASS = re.compile(r"- Problem with given class_path '(.+)':")
_UNKNOWN = re.compile(r"(?:Option|does not accept option) '([^']+)'|"
                      r"unrecognized arguments: --(\S+)")


def innermost_error(report: str) -> str:
    """The line of jsonargparse's nested ``report`` that says what is wrong (the most deeply
    nested one), after the full key it is about (``trainer.strategy.init_args.config.plan:
    Expected a typing.Literal[...]. Got value: zcv``); the report itself if it has one line."""
    path: list[tuple[int, str]] = []  # (indent, key part) of the lines the next one is under
    best: tuple[int, str] | None = None
    for line in report.splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        while path and path[-1][0] >= indent:
            path.pop()
        key, cls = _KEY.fullmatch(text), _CLASS.fullmatch(text)
        if key:
            path.append((indent, key[1]))
        elif cls:
            path.append((indent, _arguments_key(cls[1])))
        elif text and not _STRUCTURE.fullmatch(text) and (best is None or indent > best[0]):
            where = ".".join(part for _, part in path if part)
            best = (indent, f"{where}: {text}" if where else text)
    return report if best is None else best[1]


def _arguments_key(class_path: str) -> str:
    """Where a class's arguments sit under its key: ``init_args``, but a dataclass's fields
    sit at the key itself; "" where the class cannot be imported (a recipe's data module
    without DALI), which is then what is wrong, as the report's next line says."""
    try:
        return "" if is_dataclass(locate(class_path)) else "init_args"
    except Exception:  # noqa: BLE001 - pydoc wraps whatever the import raised
        return ""


class _Parser(LightningArgumentParser):
    """LightningCLI's parser, whose usage errors lead with the line that says what is wrong
    instead of ending a 50-line usage message with it."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse is trying alternatives: not the end
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self  # `fit`'s, for its options
        prog = parser.prog.replace(" [options]", "")
        first = innermost_error(message)
        lines = [f"{prog}: error: {first}"]
        unknown = _UNKNOWN.search(first)
        if unknown:
            known = ([f.name for f in fields(CSwapConfig)] if first.startswith(CSWAP_CONFIG)
                     else [action.dest for action in parser._actions])
            close = get_close_matches(unknown[1] or unknown[2], known, n=1)
            lines += [f"  did you mean {close[0]!r}?"] if close else []
            if first.startswith(CSWAP_CONFIG):
                lines.append(f"  CSwapConfig's fields: {CSWAP_FIELDS}")
        if first != message:
            lines += ["jsonargparse's full report:", message]
        lines.append(f"`{prog} --help` lists every option; --cswap.FIELD VALUE sets a "
                     "CSwapConfig field")
        print("\n".join(lines), file=sys.stderr)
        raise SystemExit(2)


def cswap_cli(args: list[str] | None, prog: str, **kwargs: Any) -> LightningCLI:
    """LightningCLI (``CSwapCLI``) with the condensed usage errors, as ``prog``."""
    return CSwapCLI(args=args, parser_class=_Parser, parser_kwargs={"prog": prog}, **kwargs)


class StopOnSigterm(Callback):
    """What ``cswap fit`` does on SIGTERM (a scheduler's or a container's stop). Lightning
    stops after the step under way (``SIGTERMException``); this callback then saves a
    checkpoint, so that nothing trained is lost. Its signal handler says so at the first
    SIGTERM, and stops the process at once at a second one, or at a first one that comes
    before training has started (nothing to lose then)."""

    def __init__(self) -> None:
        self.checkpoint: Path | None = None
        self.step = 0
        self._signals = 0

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self.step = trainer.global_step
            path = Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"
            self.checkpoint = path / "sigterm.ckpt"
            trainer.save_checkpoint(self.checkpoint)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler of the process; Lightning calls it after its own while it
        trains."""
        self._signals += 1
        training = signal.getsignal(signal.SIGTERM) is not self.handler  # Lightning's, with it
        if training and self._signals == 1:
            print("cswap fit: SIGTERM: stopping after the step under way and saving a "
                  "checkpoint (SIGTERM again stops at once)", file=sys.stderr, flush=True)
            return
        raise SystemExit(128 + signum)


class CSwapCLI(LightningCLI):
    """LightningCLI whose configured classes refusing their arguments end in a usage error;
    ``stop`` (``cswap fit``'s) joins the Trainer's callbacks."""

    def __init__(self, *args: Any, stop: StopOnSigterm | None = None, **kwargs: Any) -> None:
        self.stop = stop
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        """Build the strategy's CSwapConfig once first, to name the key of a bad value: inside
        the Trainer's ``str | Strategy`` union, jsonargparse would report the config's error
        as a long traceback whose cause is the ``str`` alternative's."""
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False
        strategy = config.trainer.strategy
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
        if self.stop is not None:
            self.trainer.callbacks.append(self.stop)


def main(args: list[str] | None = None) -> LightningCLI:
    """Run ``Trainer.fit`` as configured by ``args`` (what would follow ``cswap fit``).

    ``None`` parses the process's command line, which must start with ``fit``: its recipe
    names and ``--cswap.FIELD`` are resolved in place, in ``sys.argv``, because LightningCLI
    reads either ``sys.argv`` or ``args`` (and warns when given ``args`` beside a command line).
    """
    if args is None:
        sys.argv[2:] = cli_args(sys.argv[2:])
    else:
        args = ["fit", *cli_args(args)]
    stop = StopOnSigterm()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop.handler) if main_thread else None
    try:
        return cswap_cli(args, "cswap", stop=stop)
    except SIGTERMException:
        saved = (f"checkpoint saved to {stop.checkpoint}; resume with the same command and "
                 f"--ckpt_path {stop.checkpoint}" if stop.checkpoint else "no checkpoint saved")
        print(f"cswap fit: stopped by SIGTERM at global step {stop.step}: {saved}",
              file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
