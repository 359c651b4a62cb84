"""Which module of a model is running, by qualified name, while the engine packs.

It lets a config speak of sites by module (``lossy_exclude=("classifier*",)``) rather than by
site number, which changes whenever the model does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self


class ModuleTracker:
    """A stack of the qualified names of ``model``'s modules whose forward is running."""

    def __init__(self, model: nn.Module) -> None:
        # torch.compile's wrapper holds the module as `_orig_mod`: name it as the user does
        self.names = {m: ".".join(part for part in name.split(".") if part != "_orig_mod")
                      for name, m in model.named_modules()}
        self.stack: list[str] = []
        self._handles: list[RemovableHandle] = []

    def current(self) -> str:
        """The innermost running module of the model (``""``: the root, or none)."""
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> Self:
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._enter_module),
            module_hooks.register_module_forward_hook(self._exit_module, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.stack = [], []

    def _enter_module(self, module: nn.Module, args) -> None:
        # Dynamo traces global hooks into the graph; a compiled region's tensors are saved
        # together when it ends, so they are named after the compiled module as a whole.
        if torch.compiler.is_compiling():
            return
        module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper
        self.stack.append(self.names.get(module, self.current()))

    def _exit_module(self, module: nn.Module, args, output) -> None:
        if self.stack and not torch.compiler.is_compiling():
            self.stack.pop()
