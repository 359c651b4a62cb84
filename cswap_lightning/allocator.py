"""The CUDA caching allocator's byte counters, read without what ``torch.cuda`` adds.

``torch.cuda.memory_allocated`` and ``max_memory_allocated`` build ``memory_stats()``: every
statistic of every pool, flattened into dotted names and sorted in Python, to read one number.
Read once per step, or once per saved tensor while a profile is captured, that is host time
the device may wait for. The same numbers are in the nested dictionary torch builds first.
"""

from __future__ import annotations

import torch

Device = torch.device | int | None


def allocated_bytes(device: Device = None) -> int:
    """``torch.cuda.memory_allocated(device)``: the bytes of live tensors."""
    return _allocated(device, "current")


def peak_allocated_bytes(device: Device = None) -> int:
    """``torch.cuda.max_memory_allocated(device)``: the most since the peak was last reset."""
    return _allocated(device, "peak")


def _allocated(device: Device, which: str) -> int:
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before CUDA is initialized
    return stats.get("allocated_bytes", {}).get("all", {}).get(which, 0)
