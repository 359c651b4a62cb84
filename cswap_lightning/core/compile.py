"""Compile a model block by block, so that offloading still lowers the peak.

A region compiled by ``torch.compile`` is one autograd node: when its backward starts, it asks
for every tensor the region saved, all at once (pytorch/pytorch#148222; compiled autograd does
the same). Compiled whole, a model's backward therefore brings every offloaded activation back
to the device before it computes anything, and the peak is what it was without offloading.
Compiled per block, backward asks for one block's tensors at a time, as in eager mode, and the
engine restores them block by block.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile each block of ``model`` in place with ``torch.compile(**compile_kwargs)``, and
    return ``model``::

        model = cswap_lightning.compile_blocks(model, backend="inductor")

    The blocks are the elements of every outermost ``nn.ModuleList`` (a transformer's layers:
    ``model.model.layers``, ``bert.encoder.layer``, GPT-2's ``transformer.h``) or, in a model
    without one, the children of every outermost ``nn.Sequential`` (the layers of a CNN or an
    MLP). The rest (embeddings, heads) stays eager. A model with neither is one block: it is
    compiled whole, with a warning.

    Each block's ``forward`` is replaced by its compiled version, so module names,
    ``state_dict`` keys and hooks stay as they were, and a deep copy or a pickle of the model
    (an EMA copy, ``ddp_spawn``) compiles its own blocks. Blocks of one class share their
    compiled code; where a block's code reads something of its own (a layer index, a cache
    slot), Dynamo compiles it again for each block, so its recompile limit is raised to the
    number of blocks (and some), lest the blocks after the eighth run eagerly.
    ``block.compile()`` would not do for
    torch's own modules (``nn.Sequential``, ``nn.Linear``): Dynamo skips the frames it starts
    from (``_call_impl``, then their ``forward``), so it compiles nothing of them and, under the
    engine, compiles the engine's hooks instead, which fails (torch 2.13). Blocks already
    compiled are left as they are: a second call compiles nothing.

    Raises ``TypeError`` if ``model`` is not an ``nn.Module`` and ``ValueError`` if it, or a
    module around its blocks, is already compiled whole: the blocks would be traced into that
    one region all the same.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_blocks takes an nn.Module, got {type(model).__name__}")
    whole = compiled_whole(model)
    if whole:
        raise ValueError(
            f"cswap: {', '.join(whole)} is already compiled as a whole (torch.compile or "
            ".compile()), so its blocks would be traced into that one region all the same. "
            "Give compile_blocks the module before it was compiled (m, not torch.compile(m)).")
    found = blocks(model)
    if not found:
        warnings.warn(
            f"cswap: {type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks, so "
            "it is compiled whole: its backward restores every tensor it saved at once, and "
            "offloading lowers nothing at the peak inside it.", UserWarning, stacklevel=2)
        found = [model]
    _allow_recompiles(len(found))
    for block in found:
        if not is_compiled(block):
            block.forward = CompiledForward(block, compile_kwargs)
    return model


class CompiledForward:
    """A block's ``forward``, compiled: its class's ``forward`` through ``torch.compile``,
    called with the block. A copy of the block gets one of its own (a compiled bound method
    would go on running the original block's forward, with the original's weights)."""

    def __init__(self, block: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        self.block = block
        self.compile_kwargs = compile_kwargs
        self.compiled = torch.compile(type(block).forward, **compile_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(self.block, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> CompiledForward:
        return CompiledForward(copy.deepcopy(self.block, memo), self.compile_kwargs)

    def __reduce__(self) -> tuple:
        return CompiledForward, (self.block, self.compile_kwargs)


def _allow_recompiles(blocks: int) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    wanted = blocks + 8
    if getattr(config, name) < wanted:
        setattr(config, name, wanted)
    if getattr(config, "accumulated_recompile_limit", wanted) < wanted:
        config.accumulated_recompile_limit = wanted


def blocks(model: nn.Module) -> list[nn.Module]:
    """What :func:`compile_blocks` compiles: the elements of every outermost ``nn.ModuleList``
    or, where there is none, the children of every outermost ``nn.Sequential``."""
    return list(dict.fromkeys(child for c in containers(model) for child in c.children()))


def containers(model: nn.Module) -> list[nn.Module]:
    """What holds the blocks: every outermost ``nn.ModuleList`` of ``model`` or, where there is
    none, every outermost ``nn.Sequential``."""
    return list(_outermost(model, nn.ModuleList)) or list(_outermost(model, nn.Sequential))


def _outermost(module: nn.Module, kind: type[nn.Module]) -> Iterator[nn.Module]:
    if isinstance(module, kind):
        yield module
        return
    for child in module.children():
        yield from _outermost(child, kind)


def compiled_whole(model: nn.Module) -> list[str]:
    """The modules of ``model`` compiled as one region around some of its blocks (``"the
    model"`` for ``model`` itself): their backward restores the blocks' tensors all at once."""
    inside = set(map(id, blocks(model)))
    return [name or "the model" for name, module in model.named_modules()
            if id(module) not in inside and is_compiled(module)
            and any(id(m) in inside for m in module.modules())]


def is_compiled(module: nn.Module) -> bool:
    """Compiled by ``torch.compile(module)``, ``module.compile()``, ``compile_blocks`` or
    Lightning's ``trainer.fit(torch.compile(module))`` (the last two compile ``forward``)."""
    from torch._dynamo.eval_frame import OptimizedModule  # imported only where compile runs

    forward = module.__dict__.get("forward")
    forward = getattr(forward, "inner_forward", forward)  # recomputed (recompute.py): what it runs
    return (isinstance(module, OptimizedModule) or isinstance(forward, CompiledForward)
            or getattr(module, "_compiled_call_impl", None) is not None
            or (hasattr(forward, "_torchdynamo_orig_callable")
                and not getattr(forward, "_torchdynamo_disable", False)))
