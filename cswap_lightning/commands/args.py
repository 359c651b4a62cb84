"""argparse types for the commands: a value out of range is a usage error (exit status 2)
naming the flag and what it accepts, caught before anything runs rather than as a traceback
from deep inside."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
    """``none``, ``auto``, a fraction like ``0.5`` (written with a point) or a byte count like
    ``2000000000`` or ``2e9``: what ``CSwapConfig.budget`` accepts."""
    if text in ("none", "auto"):
        return None if text == "none" else text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if "." in text and 0.0 < value <= 1.0:
        return value
    if math.isfinite(value) and value >= 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(
        f"expected none, auto, a fraction of device memory in (0, 1] like 0.5, or a number of "
        f"bytes >= 1 like 2000000000; got {text!r}")
