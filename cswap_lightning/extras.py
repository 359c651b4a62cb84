"""The optional dependencies (pyproject's extras): a feature that needs one imports it through
here, so that where it is not installed the error names the feature, the package and the
extra that installs it, instead of a traceback ending in ``No module named 'peft'``."""

from __future__ import annotations

import importlib
from types import ModuleType

# an extra's top-level module -> (what pip installs, the extra that brings it); DALI's is said
# by the image recipes' module itself (``recipes/images.py``)
EXTRAS = {"transformers": ("transformers", "hf"), "accelerate": ("accelerate", "hf"),
          "peft": ("peft", "hf"), "bitsandbytes": ("bitsandbytes", "qlora")}


class MissingExtra(ModuleNotFoundError):
    """A feature's optional dependency is not installed; the message says which extra."""


def require(module: str, feature: str) -> ModuleType:
    """``module``, imported for ``feature`` ("LoRA", "cswap_lightning.CSwapCallback"):
    :class:`MissingExtra` where it, or a module of the extras it imports, is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise missing(err, feature) from err


def missing(err: ModuleNotFoundError, feature: str) -> ModuleNotFoundError:
    """``err`` as a :class:`MissingExtra` for ``feature`` where the module it did not find
    belongs to an extra; ``err`` itself otherwise (something else is broken)."""
    top = (err.name or "").partition(".")[0]
    if top not in EXTRAS:
        return err
    package, extra = EXTRAS[top]
    return MissingExtra(f"{feature} needs {package}, which is not installed: "
                        f"pip install 'cswap-lightning[{extra}]'", name=err.name)
