"""CSwapConfig: every knob of the engine, checked when it is built so mistakes fail early."""

from __future__ import annotations

from dataclasses import dataclass, fields

PLANS = ("auto", "keep", "raw", "zvc", "rle")
COMPRESSORS = ("zvc", "rle")

MiB = 1 << 20


@dataclass(frozen=True)
class CSwapConfig:
    """What to offload, how, and how much to prefetch.

    Args:
        plan: ``"auto"`` decides per saved tensor (swap raw, or compress with ``compressor``
            when its measured sparsity reaches ``sparsity_threshold``); ``"raw"``, ``"zvc"``
            or ``"rle"`` force that codec for every offloaded tensor; ``"keep"`` offloads
            nothing (the engine only measures).
        compressor: codec ``"auto"`` uses for sparse tensors.
        sparsity_threshold: fraction of zero elements from which ``"auto"`` compresses.
        min_bytes: saved tensors smaller than this stay where they are.
        prefetch_bytes: how many bytes backward may bring back ahead of use.
        pin_memory: use page-locked host memory for CUDA tensors (needed for async copies).
    """

    plan: str = "auto"
    compressor: str = "zvc"
    sparsity_threshold: float = 0.5
    min_bytes: int = 256 * 1024
    prefetch_bytes: int = 512 * MiB
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            expected = {"str": str, "float": (int, float), "int": int, "bool": bool}[f.type]
            if not isinstance(value, expected) or (f.type != "bool" and isinstance(value, bool)):
                raise TypeError(
                    f"CSwapConfig.{f.name} must be of type {f.type}, got {value!r} "
                    f"({type(value).__name__})"
                )
        _check_choice("plan", self.plan, PLANS)
        _check_choice("compressor", self.compressor, COMPRESSORS)
        if not 0.0 <= self.sparsity_threshold <= 1.0:
            raise ValueError(
                "CSwapConfig.sparsity_threshold must be in [0, 1], "
                f"got {self.sparsity_threshold!r}"
            )
        for name in ("min_bytes", "prefetch_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"CSwapConfig.{name} must be >= 0 bytes, got {getattr(self, name)!r}"
                )


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"CSwapConfig.{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )
