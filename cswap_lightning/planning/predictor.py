"""How long a codec takes, predicted from bytes and sparsity, fitted on measured runs.

Per codec and direction the model is::

    seconds = a + b * bytes + c * nonzero bytes + d * bytes * s * (1 - s)

with a, b, c, d >= 0 and s the sparsity: a launch cost, a pass over the input, the work on
what survives, and the cost of an irregular zero mask (branches and scattered writes), which
peaks at s = 0.5 (on the CPU's reference codecs it made the fit's held-out error 3-4x
smaller). It is fitted by non-negative least squares on relative error, so small and large
tensors count alike, and reports its mean absolute percentage error on runs it was not
fitted on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs import get_codec
from ..codecs.format import Packed
from .profiler import Clock

DIRECTIONS = ("encode", "decode")
_MiB = float(1 << 20)


@dataclass(frozen=True)
class KernelRun:
    """One measured codec call."""

    codec: str
    direction: str  # encode | decode
    nbytes: int  # uncompressed bytes
    sparsity: float
    seconds: float


def _features(nbytes: int, sparsity: float) -> list[float]:
    return [1.0, nbytes / _MiB, nbytes * (1.0 - sparsity) / _MiB,
            nbytes * sparsity * (1.0 - sparsity) / _MiB]


class CodecTimeModel:
    """Predicts codec time; ``fit`` it on runs, then ``predict`` or check ``mape``."""

    def __init__(self) -> None:
        self.coefficients: dict[tuple[str, str], np.ndarray] = {}

    def fit(self, runs: Iterable[KernelRun]) -> CodecTimeModel:
        from scipy.optimize import nnls  # 0.3 s to import: only when a plan is made

        groups: dict[tuple[str, str], list[KernelRun]] = {}
        for run in runs:
            groups.setdefault((run.codec, run.direction), []).append(run)
        for key, group in groups.items():
            x = np.array([_features(r.nbytes, r.sparsity) for r in group])
            y = np.array([r.seconds for r in group])
            weight = 1.0 / np.maximum(y, 1e-9)  # relative error
            coefficients, _ = nnls(x * weight[:, None], y * weight)
            # A run slowed by something else (another process, a page fault storm) can drag
            # the whole fit: refit once without the runs far off the first fit.
            error = np.abs(x @ coefficients - y) * weight
            kept = error <= max(3 * np.median(error), 0.05)
            if 4 <= kept.sum() < len(y):
                coefficients, _ = nnls(x[kept] * weight[kept, None], y[kept] * weight[kept])
            self.coefficients[key] = coefficients
        return self

    def predict(self, codec: str, direction: str, nbytes: int, sparsity: float) -> float:
        if codec == "raw":
            return 0.0  # raw encodes to a view and decodes to the restored copy itself
        try:
            coefficients = self.coefficients[(codec, direction)]
        except KeyError:
            raise KeyError(
                f"no measured runs for codec {codec!r} ({direction}); fit the model on runs "
                f"of it first (known: {sorted(self.coefficients)})"
            ) from None
        return float(np.dot(coefficients, _features(nbytes, sparsity)))

    def mape(self, runs: Sequence[KernelRun]) -> float:
        """Mean absolute percentage error (0.1 = 10%) of predictions on ``runs``."""
        errors = [
            abs(self.predict(r.codec, r.direction, r.nbytes, r.sparsity) - r.seconds) / r.seconds
            for r in runs
        ]
        return float(np.mean(errors)) if errors else float("nan")


def sparse_tensor(nbytes: int, sparsity: float, device: torch.device, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ``dtype`` with a given fraction of zeros, placed at random."""
    gen = torch.Generator().manual_seed(seed)
    n = max(nbytes // dtype.itemsize, 1)
    values = torch.rand(n, generator=gen) + 0.5
    values[torch.rand(n, generator=gen) < sparsity] = 0.0
    return values.to(device, dtype)


def measure_runs(
    codec: str,
    device: torch.device,
    sizes: Sequence[int],
    sparsities: Sequence[float],
    repeats: int = 3,
) -> list[KernelRun]:
    """Time ``codec`` encoding and decoding each size x sparsity (best of ``repeats``), on
    float32 tensors or the first dtype a codec of some dtypes only packs."""
    impl, clock, runs = get_codec(codec), Clock(torch.device(device)), []
    dtype = impl.dtypes[0] if impl.dtypes else torch.float32
    for nbytes in sizes:
        for sparsity in sparsities:
            t = sparse_tensor(nbytes, sparsity, device, dtype=dtype)
            packed = impl.encode(t)
            packed = Packed(packed.header, packed.payload.clone())
            for direction, call, arg in (("encode", impl.encode, t),
                                         ("decode", impl.decode, packed)):
                best = float("inf")
                for _ in range(repeats):
                    start = clock.now()
                    call(arg)
                    best = min(best, clock.seconds(start, clock.now()))
                runs.append(KernelRun(codec, direction, t.numel() * t.element_size(), sparsity,
                                      best))
    return runs


@dataclass(frozen=True)
class Calibration:
    """A fitted model and how well it predicts runs it has not seen."""

    model: CodecTimeModel
    mape: float
    fit_runs: tuple[KernelRun, ...]
    held_out_runs: tuple[KernelRun, ...]


_CALIBRATIONS: dict[tuple[torch.device, tuple[str, ...]], Calibration] = {}
_RECORDED: dict[torch.device, list[KernelRun]] = {}


def record_runs(device: torch.device, runs: Iterable[KernelRun]) -> None:
    """Add runs measured elsewhere on ``device`` (the tuner's, at its chosen launch) to what
    calibrations fit on; calibrations made before are dropped, so the next plan uses them."""
    _RECORDED.setdefault(torch.device(device), []).extend(runs)
    _CALIBRATIONS.clear()


def calibrate(device: torch.device, codecs: Sequence[str]) -> Calibration:
    """Measure, fit and validate the codecs' time model on ``device`` (once per process).

    Sizes are a few MiB on the CPU and tens of MiB on CUDA, where small calls are all launch.
    Runs given to :func:`record_runs` for this device join the fitting set.
    """
    device = torch.device(device)
    key = (device, tuple(codecs))
    if key not in _CALIBRATIONS:
        scale = 16 if device.type == "cuda" else 1
        fit_sizes = [scale * s << 10 for s in (256, 1024, 4096)]
        held_sizes = [scale * s << 10 for s in (512, 2048)]
        fit_runs = [r for r in _RECORDED.get(device, []) if r.codec in codecs]
        held_runs = []
        for codec in codecs:
            fit_runs += measure_runs(codec, device, fit_sizes, (0.0, 0.5, 0.9))
            held_runs += measure_runs(codec, device, held_sizes, (0.25, 0.75))
        model = CodecTimeModel().fit(fit_runs)
        _CALIBRATIONS[key] = Calibration(model, model.mape(held_runs), tuple(fit_runs),
                                         tuple(held_runs))
    return _CALIBRATIONS[key]
