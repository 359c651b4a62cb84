"""Will it fit: a training step estimated on a device (``estimate.py``), replayed without
help, under activation checkpointing and under the planner's mix; and the largest sequence
(or, for a CNN, batch) that fits each way.

A step fits where the replay's allocator peak and the optimizer's update both stay within
the device's memory less ``CONTEXT_BYTES`` (the CUDA context and the libraries' workspaces,
which ``memory_allocated`` does not count). The caching allocator's fragmentation is not
modelled: a peak close to the limit may not fit. Every figure is an estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..codecs import get_codec
from ..config import INFLIGHT_CHOICES
from . import mix, models, profiled
from .advisor import DENSE_RATIO
from .devices import DEVICES, Device
from .estimate import Estimate, cached
from .replay import (
    RAW,
    Codec,
    Engine,
    Mix,
    Prediction,
    checkpoint_all,
    predict,
    swap_all,
)
from .workload import Block, Saved, Workload

CONTEXT_BYTES = 1 << 30
GRANULE = 256  # sequence lengths searched in steps of this many tokens


def usable(device: Device) -> int:
    """The bytes a step's allocator may hold on ``device``."""
    return device.memory_bytes - CONTEXT_BYTES


@dataclass(frozen=True)
class Way:
    """One way to train the step: its plan's prediction and whether it fits."""

    label: str
    how: str
    prediction: Prediction
    fits: bool

    @property
    def step_s(self) -> float:
        """Forward and backward (the optimizer apart)."""
        return self.prediction.step_s - self.prediction.optimizer_s


def baselines(est: Estimate, engine: Engine | None = None) -> list[Way]:
    """No help, and checkpointing every block, replayed on ``est``'s device (``engine``: the
    replay's settings, its defaults if None)."""
    w, link, limit = est.workload(), est.device.link, usable(est.device)
    optimizer_fits = est.optimizer_peak <= limit
    keep = predict(w, link=link, engine=engine)
    checkpointed = predict(w, checkpoint_all(), link=link, engine=engine)
    return [Way("no help", "keep everything", keep, optimizer_fits and keep.peak_bytes <= limit),
            Way("checkpointing", "recompute every block", checkpointed,
                optimizer_fits and checkpointed.peak_bytes <= limit)]


def peers(est: Estimate) -> list[Way]:
    """The peers' offloading, replayed on ``est``'s device as this engine would run it:
    checkpointing every block with its input swapped (offloaded checkpointing: Unsloth's,
    Hugging Face's ``offload=True``), and every saved tensor swapped (torchtune's activation
    offloading, torch's ``save_on_cpu``)."""
    w, limit = est.workload(), usable(est.device)
    out = []
    for label, how, plan in (
            ("checkpointing, inputs offloaded", "recompute every block, swap its input",
             checkpoint_all(offload_inputs=True)),
            ("every tensor offloaded", "swap every block", swap_all())):
        p = predict(w, plan, link=est.device.link)
        out.append(Way(label, how, p, est.optimizer_peak <= limit and p.peak_bytes <= limit))
    return out


def mixes(est: Estimate, budgets: Sequence[tuple[str, int]], finer: bool = False,
          lossy: str | None = None, clip: bool = True,
          progress: Callable[[str], None] | None = None,
          replays: mix.Replays | None = None, engine: Engine | None = None,
          dense: bool = False, host: int | None = None) -> list[Way]:
    """The planner's mix at each budget (a label and the allocator's bytes it may use; with
    ``clip``, at most the device's), over layers recomputed whole or below the layer as
    units of recomputation, ``finer``: and over their activation modules too (slower to
    plan); ``lossy``: blocks may also travel through that lossy codec (``lossy_codec``);
    ``dense``: and through the lossless exponent codec (``dense_codec``);
    ``progress`` is told each budget's mix as it is chosen; ``replays``: the replay's
    predictions made before for the same estimate (kept across calls); ``engine``: the
    engine's settings the replay follows (its defaults if None); ``host``: the host memory
    what a mix swaps may hold (None: any)."""
    w, link, limit = est.workload(), est.device.link, usable(est.device)
    units = profiled.unit_candidates(w, activations=finer)
    codecs = (None, *([dense_codec(est.device)] if dense else []),
              *([lossy_codec(lossy, est.device)] if lossy is not None else []))
    out, replays = [], replays or mix.Replays()
    for label, budget in budgets:
        _, chosen = mix.choose_among(units, min(budget, limit) if clip else budget, link,
                                     engine, inflight_choices=INFLIGHT_CHOICES, codecs=codecs,
                                     replays=replays, host_bytes=host)
        out.append(Way(label, chosen.how, chosen.prediction,
                       est.optimizer_peak <= limit and chosen.fits))
        if progress is not None:
            progress(f"planned at {label}: {chosen.how}")
    return out


# The lossy codecs' speeds in bytes of bfloat16 tensors per second, measured on the H200
# (`cswap bench codec`, 2026-11-27, 64 MiB, the slower of its sparsities 0, 50 and 90%, the
# encoders skipping the division for zeros: int8 compress 536 GB/s, decompress 835 GB/s; fp8
# 698 and 1006; benchmarks/results/codec-h200-2026-11-27-b.md).
LOSSY_SPEEDS = {"int8": (536e9, 835e9), "fp8": (698e9, 1006e9)}
_FLOATING = ("float32", "float16", "bfloat16")


def lossy_speeds(name: str, device: Device) -> tuple[float, float]:
    """A lossy codec's encode and decode speeds on ``device`` (bytes of bfloat16 tensors per
    second): the H200's measured ones (``LOSSY_SPEEDS``) scaled by the device's memory rate
    against the H200's (an estimate)."""
    if name not in LOSSY_SPEEDS:
        raise ValueError(f"no speeds for lossy codec {name!r}; known: {', '.join(LOSSY_SPEEDS)}")
    h200 = DEVICES["h200"]
    scale = (device.bandwidth * device.rates.memory) / (h200.bandwidth * h200.rates.memory)
    encode, decode = LOSSY_SPEEDS[name]
    return encode * scale, decode * scale


def lossy_codec(name: str, device: Device) -> mix.CodecOf:
    """How a block of an estimated step travels through a lossy codec on ``device``: its
    floating activations at the codec's exact size (dense: an estimate knows no sparsity),
    the others raw, at ``lossy_speeds``."""
    codec = get_codec(name)
    return _through(name, _FLOATING, lambda s: codec.payload_nbytes(
        s.storage_nbytes // getattr(torch, s.dtype).itemsize), *lossy_speeds(name, device))


# The exponent codec's bytes moved per byte of its tensor (it reads the tensor twice to
# encode), against int8's 1.5 each way: its speeds, not measured yet, are int8's measured
# ones scaled by these.
DENSE_TRAFFIC = {"encode": 2.75, "decode": 1.75}


def dense_speeds(device: Device) -> tuple[float, float]:
    """The exponent codec's encode and decode speeds on ``device`` (bytes of bfloat16 tensors
    per second): int8's (``lossy_speeds``) scaled by the bytes each moves
    (``DENSE_TRAFFIC``): an estimate of an estimate until its kernels are measured."""
    encode, decode = lossy_speeds("int8", device)
    return encode * 1.5 / DENSE_TRAFFIC["encode"], decode * 1.5 / DENSE_TRAFFIC["decode"]


def dense_codec(device: Device) -> mix.CodecOf:
    """How a block of an estimated step travels through the lossless exponent codec on
    ``device``: its bfloat16 activations at ``advisor.DENSE_RATIO`` of their bytes (an
    estimate knows no sparsity), the others raw, at ``dense_speeds``."""
    return _through("exponent", ("bfloat16",), lambda s: DENSE_RATIO * s.storage_nbytes,
                    *dense_speeds(device))


def _through(name: str, dtypes: tuple[str, ...], stored: Callable[[Saved], float],
             encode: float, decode: float) -> mix.CodecOf:
    """A block's activations of ``dtypes`` through codec ``name`` (each at ``stored`` of its
    storage's bytes, at these speeds in bytes of them a second), the others raw."""

    def codec_of(w: Workload, block: Block) -> Codec:
        saves = [w.saved[i] for op in w.ops[block.ops.start:block.ops.stop] for i in op.saves
                 if w.saved[i].activation and w.saved[i].storage == i]
        raw = sum(s.storage_nbytes for s in saves)
        packed = [s for s in saves if s.dtype in dtypes]
        if not raw or not packed:
            return RAW
        kept = raw - sum(s.storage_nbytes - stored(s) for s in packed)
        moved = sum(s.storage_nbytes for s in packed)
        return Codec(name, kept / raw, raw * encode / moved, raw * decode / moved)

    return codec_of


@dataclass(frozen=True)
class Layer:
    """One layer of an estimated step, per token: what it saves, what recomputing it below
    the layer (its elementwise work again, from the fewest bytes kept; ``heavier``: the
    other ways, each keeping more to run less again) or whole keeps, and what each costs."""

    name: str
    saved_kib: float
    below_kib: float
    whole_kib: float
    below_s: float
    forward_s: float
    heavier: tuple[tuple[float, float], ...] = ()  # each other way's KiB kept and seconds


def first_layer(est: Estimate) -> Layer | None:
    """The estimated step's first layer that can be recomputed below the layer (None where
    the model has none)."""
    w = est.workload()
    k = next((k for k, b in enumerate(w.blocks) if b.below), None)
    if k is None:
        return None
    block, kib = w.blocks[k], est.setup.sequence * est.setup.batch * 1024
    fewest, *others = dict.fromkeys((sum(b.kept), b.seconds) for b in block.below)
    return Layer(block.name, mix.saved_bytes(w, k) / kib, fewest[0] / kib,
                 w.saved[w.block_input(k)].storage_nbytes / kib, fewest[1],
                 sum(op.forward_s for op in w.ops[block.ops.start:block.ops.stop]),
                 tuple((n / kib, seconds) for n, seconds in others))


def fits(est: Estimate, how: str, workload: Workload | None = None,
         host: int | None = None) -> bool:
    """Whether ``est`` (or ``workload``, the same step at another size) fits its device
    without help (``how="none"``), under checkpointing (``"checkpointing"``) or with one of
    the planner's most frugal plans (``"planner"``: ``mix.frugal``, the fewest inputs swapped
    first; with ``host`` bytes of host memory, those that move no more)."""
    limit = usable(est.device)
    if est.optimizer_peak > limit:
        return False
    w = workload or est.workload()
    plans = {"none": [Mix()], "checkpointing": [checkpoint_all()],
             "planner": (mix.frugal(w, k) for k in range(len(w.blocks) + 1))}[how]
    for plan in plans:
        p = predict(w, plan, link=est.device.link)
        if host is not None and p.host_bytes > host:
            return False  # the earliest more swapped only hold more
        if p.peak_bytes <= limit:
            return True
    return False


def largest(est: Estimate, how: str, ceiling: int, host: int | None = None) -> int | None:
    """The largest sequence (a CNN: batch) at most ``ceiling`` that fits ``how``
    (``fits``, with ``host``), in steps of ``GRANULE`` tokens (a batch: of 1); None where the
    smallest does not fit.

    A step's saved and allocated bytes grow in proportion to its tokens (the fused attention
    keeps nothing of the sequence squared), so the search scales ``est``'s workload
    (``Workload.scaled``, the sequence taken for the batch) instead of tracing each length;
    the answer is then traced, and searched among traced sizes below where that does not
    fit."""
    setup = est.setup
    sequence = models.model(setup.model, setup.dropout, setup.lora, setup.layers).sequence
    # (a tiny model's table of positions may hold fewer than a granule)
    step, size = (min(GRANULE, ceiling), setup.sequence) if sequence else (1, setup.batch)
    base = replace(est.workload(), batch=size)

    def traced_fits(n: int) -> bool:
        sized = replace(setup, sequence=n) if sequence else replace(setup, batch=n)
        return fits(cached(sized, est.device, est.optimizer), how, host=host)

    found = _largest(lambda n: fits(est, how, base.scaled(n), host), step, ceiling)
    if found is None or traced_fits(found):
        return found
    return _largest(traced_fits, step, found - step)  # the scaling was off: search traces


def _largest(ok: Callable[[int], bool], step: int, ceiling: int) -> int | None:
    """The largest multiple of ``step`` up to ``ceiling`` with ``ok`` (``ok`` true up to some
    size, false beyond): doubling, then bisection."""
    if ceiling < step or not ok(step):
        return None
    good, bad = step, None
    while bad is None:
        n = min(2 * good, ceiling // step * step)
        if n == good:
            return good
        if ok(n):
            good = n
        else:
            bad = n
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if ok(middle):
            good = middle
        else:
            bad = middle
    return good
