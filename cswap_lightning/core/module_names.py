"""Which module of a model is running, by qualified name, while the engine packs.

It lets a config speak of sites by module (``lossy_exclude=("classifier*",)``) rather than by
site number, which changes whenever the model does.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from typing_extensions import Self


class ModuleTracker:
    """A stack of the qualified names of ``model``'s modules whose forward is running, kept
    while the tracker is entered.

    Its global module hooks stay installed until :meth:`close` (or until the tracker is
    garbage-collected): adding and removing them around every step would change what
    ``torch.compile`` guards on and recompile the model each step.
    """

    def __init__(self, model: nn.Module) -> None:
        # torch.compile's wrapper holds the module as `_orig_mod`: name it as the user does
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary(
            {m: ".".join(part for part in name.split(".") if part != "_orig_mod")
             for name, m in model.named_modules()})
        self.stack: list[str] = []
        self.active = False
        tracker = weakref.ref(self)

        # Dynamo traces global hooks into the graph; a compiled region's tensors are saved
        # together when it ends, so they are named after the compiled module as a whole.
        def enter(module: nn.Module, args) -> None:
            if not torch.compiler.is_compiling() and (live := tracker()) is not None:
                live._enter_module(module)

        def exit_(module: nn.Module, args, output) -> None:
            if not torch.compiler.is_compiling() and (live := tracker()) is not None:
                live._exit_module()

        handles = (module_hooks.register_module_forward_pre_hook(enter),
                   module_hooks.register_module_forward_hook(exit_, always_call=True))
        self._remove = weakref.finalize(self, lambda: [h.remove() for h in handles])

    def current(self) -> str:
        """The innermost running module of the model (``""``: the root, or none)."""
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> Self:
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active, self.stack = False, []

    def close(self) -> None:
        """Remove the hooks."""
        self._remove()

    def _enter_module(self, module: nn.Module) -> None:
        if self.active:
            module = getattr(module, "_orig_mod", module)  # torch.compile's wrapper
            self.stack.append(self.names.get(module, self.current()))

    def _exit_module(self) -> None:
        if self.active and self.stack:
            self.stack.pop()
