"""argparse types for the commands: a value out of range is a usage error (exit status 2)
naming the flag and what it accepts, caught before anything runs rather than as a traceback
from deep inside."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..config import parse_budget


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number from ``low`` (to ``high``, if given)."""
    accepted = f">= {low}" if high is None else f"from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a whole number {accepted}, got {text!r}")
        return value

    return parse


def number(accepts: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """A number ``accepts`` takes (NaN never is), described as ``expected`` in the error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


fraction = number(lambda v: 0.0 <= v <= 1.0, "a number from 0 to 1")


def budget(text: str) -> int | float | str | None:
    """``none``, ``auto``, a fraction like ``0.5`` (written with a point), a percentage like
    ``50%``, a size like ``2GiB`` or a byte count like ``2000000000`` or ``2e9``: what
    ``CSwapConfig.budget`` accepts (the config checks the value itself)."""
    if text in ("none", "auto"):
        return None if text == "none" else text
    parsed = parse_budget(text)
    if parsed is not text:  # a size or a percentage
        return parsed
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if "." in text and 0.0 < value <= 1.0:
        return value
    if math.isfinite(value) and value >= 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(
        f"expected none, auto, a share of device memory like 0.5 or 50%, or a size like 2GiB "
        f"or 2000000000 (bytes); got {text!r}")


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, where this machine has that GPU: a device the
    run could not use is a usage error here, not a traceback from its first tensor."""
    import torch

    if text in ("auto", "cpu"):
        return text
    try:
        parsed = torch.device(text)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    if not torch.cuda.is_available():
        build = "a build without CUDA" if torch.version.cuda is None else "no GPU or driver found"
        raise argparse.ArgumentTypeError(
            f"got {text!r}, but torch {torch.__version__} sees no CUDA device ({build}); use "
            "--device cpu, or auto (a GPU if there is one)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, but this machine has {count} CUDA device(s): cuda:0 to "
            f"cuda:{count - 1}")
    return text
