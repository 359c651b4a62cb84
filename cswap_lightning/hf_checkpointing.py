"""Hugging Face's activation checkpointing switches, under whichever names the installed
transformers gives them.

transformers 5.17 added ``offload`` (each checkpointed layer inside torch's
``save_on_cpu(pin_memory=True)``) to the model's ``gradient_checkpointing_enable`` and to the
Trainer's ``gradient_checkpointing_kwargs``; 5.23 renamed them ``activation_checkpointing_enable``
and ``activation_checkpointing_kwargs`` (``activation_checkpointing`` the flag), keeping the old
names as deprecated aliases. What a model or the arguments have decides, not the version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn


def checkpointing_switch(model: nn.Module) -> Callable[..., None]:
    """The model's ``activation_checkpointing_enable``, or its ``gradient_checkpointing_enable``
    before transformers 5.23. Both take the keyword arguments for torch's checkpoint first."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    return enable if enable is not None else model.gradient_checkpointing_enable


def checkpointing_off(model: nn.Module) -> None:
    """Turn the model's activation checkpointing off (the switch's counterpart)."""
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable if disable is not None else model.gradient_checkpointing_disable)()


def has_offload(switch: Callable[..., None]) -> bool:
    """Whether a checkpointing switch takes ``offload`` (transformers >= 5.17)."""
    return "offload" in inspect.signature(switch).parameters


def trainer_checkpointing(args: Any) -> dict[str, Any] | None:
    """The keyword arguments a Trainer with ``TrainingArguments`` ``args`` checkpoints the model
    with (``every_n_layers`` and ``offload`` among them), or ``None`` where it does not
    checkpoint: ``activation_checkpointing(_kwargs)``, ``gradient_checkpointing(_kwargs)``
    before transformers 5.23."""
    name = ("activation_checkpointing" if hasattr(args, "activation_checkpointing")
            else "gradient_checkpointing")
    if not getattr(args, name):
        return None
    return dict(getattr(args, f"{name}_kwargs") or {})
