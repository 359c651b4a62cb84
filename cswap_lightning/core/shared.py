"""``offload(config)``: one Offloader per distinct config and thread, shared by every
``with offload(config):`` written inside a training loop, so that it learns across steps."""

from __future__ import annotations

import threading

from ..config import CSwapConfig, as_config
from .engine import Offloader

_SHARED = threading.local()


def _shared() -> dict[CSwapConfig, Offloader]:
    if not hasattr(_SHARED, "by_config"):
        _SHARED.by_config = {}
    return _SHARED.by_config


def offload(config: CSwapConfig | None = None) -> Offloader:
    """This thread's :class:`Offloader` for ``config`` (one per distinct config and thread),
    so that ``with offload(config):`` written inside a training loop learns across steps."""
    config = as_config(config, "offload")
    shared = _shared()
    if config not in shared:
        shared[config] = Offloader(config)
        shared[config]._registry = shared
    return shared[config]
