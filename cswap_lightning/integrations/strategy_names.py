"""Lightning's strategy names (``"cswap"``, ``"cswap_ddp"``, ...) from ``import cswap_lightning``.

Lightning finds a strategy name only in its registry, filled by whoever imported the strategy's
module, and has no entry point for strategies. ``import cswap_lightning`` must not import
Lightning (a plain loop does not need it), so it registers the names at once where the program
has imported Lightning, and otherwise as soon as it does: a finder on ``sys.meta_path`` waits
for ``lightning.pytorch`` and, once that module has run, imports the strategies' module (which
registers them).
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from importlib import import_module
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_LIGHTNING = "lightning.pytorch"
_STRATEGIES = "cswap_lightning.integrations.lightning"


def register_strategy_names() -> None:
    """Register the names now if Lightning is loaded, else when it is (once)."""
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(finder, _WhenLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenLightningLoads())


def _register() -> None:
    try:
        import_module(_STRATEGIES)
    except Exception as err:  # noqa: BLE001 - the program's own import of Lightning goes on
        warnings.warn(f"cswap: the strategy names (strategy='cswap', ...) are not registered: "
                      f"importing {_STRATEGIES} failed ({type(err).__name__}: {err}); import "
                      "it yourself to see why", RuntimeWarning, stacklevel=2)


class _WhenLightningLoads(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` as the other finders do, with a loader that registers the
    names once the module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister(importlib.abc.Loader):
    """A module's own loader, registering the names after the module has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:  # resources, source: the loader's own
        return getattr(self.loader, name)
