"""One step under ``torch.profiler``: how long the device ran kernels and copies in it.

Set beside the step's time, the device's busy time says what the GPU waited for: a step
whose kernels take far less than the step was paced by the host (its Python, the engine's
hooks) or by waits, which no replay of kernel times sees."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class DeviceTime:
    """Seconds the device spent in one step: kernels, and copies and fills (``Memcpy``,
    between host and device or on the device, and ``Memset``), each summed over every
    stream."""

    kernels_s: float
    copies_s: float


def traced_step(step: Callable[[], object], dev: torch.device, path: Path
                ) -> DeviceTime | None:
    """Run ``step`` once under ``torch.profiler``; write its operators' table (the dearest
    first) to ``path``; on CUDA, the device's time in it (None on the CPU)."""
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="self_device_time_total" if cuda
                                 else "self_cpu_time_total", row_limit=40))
    if not cuda:
        return None
    # a user annotation (record_function) on the device would count its kernels again
    device = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    copies_us = sum(e.self_device_time_total for e in device if _is_copy(e.key))
    total_us = sum(e.self_device_time_total for e in device)
    return DeviceTime((total_us - copies_us) / 1e6, copies_us / 1e6)


def trace_path(folder: Path, name: str) -> Path:
    """Where the table of a step named ``name`` goes (spaces and punctuation as dashes)."""
    return folder / (re.sub(r"[^\w.-]+", "-", name).strip("-") + ".txt")


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))
