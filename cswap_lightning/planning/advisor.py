"""The CSwap cost model: which codec each swapped site travels through.

Swapping a site of S bytes raw exposes the part of its transfers its windows cannot hide::

    T_raw = max(S / BW_d2h - W_fwd, 0) + max(S / BW_h2d - W_bwd, 0)

Compressing it first to C bytes costs the codec's time and exposes less transfer::

    T_c = t_encode + t_decode + max(C / BW_d2h - W_fwd, 0) + max(C / BW_h2d - W_bwd, 0)

A site is compressed iff ``T_c < T_raw``. ``C`` is the codec's exact payload size for the
measured sparsity (format.py), or for the dense codec (exponent) what the site's payload
measured, ``DENSE_RATIO`` of its bytes until one did. Which sites swap at all is the
planner's choice (``planner.py``: the replayed peak against the budget); ``plan.py``'s
:class:`Plan` holds the decisions.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..codecs import get_codec
from .plan import Decision
from .predictor import CodecTimeModel
from .profiler import Link, SiteProfile

# budget="auto" leaves this fraction of the device's memory free, for what the engine does
# not see (temporaries of a plan it has not measured, allocator fragmentation).
AUTO_MARGIN = 0.1


def exposed_s(nbytes: int, link: Link, forward_s: float, backward_s: float) -> float:
    """Transfer time a swap of ``nbytes`` cannot hide behind its windows."""
    return max(nbytes / link.d2h - forward_s, 0.0) + max(nbytes / link.h2d - backward_s, 0.0)


# The dense codec's payload against its tensor, until a site's was measured: 1.29-1.44x on
# the saved tensors of Llama-3-8B-shaped layers, BERT's GELU and Llama's SiLU-gated product
# (random weights, bfloat16; `cswap bench codec`'s dense sources).
DENSE_RATIO = 0.75
# A site this sparse, or sparser, is the zero codecs' (a zero's exponent widens its group).
DENSE_MAX_SPARSITY = 0.01


def dense_ok(p: SiteProfile) -> bool:
    """Whether the dense codec (exponent) can pay for ``p``: bfloat16 with (almost) no zeros."""
    return get_codec("exponent").packs(p.dtype) and p.sparsity < DENSE_MAX_SPARSITY


def predicted_stored_bytes(codec: str, p: SiteProfile) -> int:
    """Payload bytes of ``p`` under ``codec``: the format's exact size formula, or for rle
    and exponent what a payload of it measured (before that, an estimate)."""
    elem = getattr(torch, p.dtype).itemsize
    numel = p.nbytes // elem
    if codec == "exponent":
        if "exponent" in p.stored:
            return p.stored["exponent"]
        return round(DENSE_RATIO * p.nbytes) if dense_ok(p) else p.nbytes
    nnz = round(numel * (1.0 - p.sparsity))
    if codec == "rle":
        if "rle" in p.stored:
            return p.stored["rle"]  # measured: the run count is not a function of sparsity
        # Zeros placed independently: a zero run starts wherever a zero follows a non-zero.
        nruns = round(numel * p.sparsity * (1.0 - p.sparsity)) + 1
        return get_codec(codec).payload_nbytes(numel, nnz, elem, nruns)
    return get_codec(codec).payload_nbytes(numel, nnz, elem)


# Sparse tensors are left to the lossless codecs, which keep their zeros for free.
LOSSY_MAX_SPARSITY = 0.5


class Advisor:
    """Turns site profiles into a plan with the cost model above.

    ``dense`` (a codec name: exponent) is weighed too for the sites it can pay for
    (``dense_ok``); ``lossy`` (a codec name), for dense sites ``lossy_ok`` accepts;
    ``prefetch_bytes`` is the engine's prefetch window to plan with (the engine's
    ``"auto"`` window is worked out before: ``planning.prefetch``); the plan may halve it.
    """

    def __init__(self, compressor: str, link: Link, model: CodecTimeModel,
                 lossy: str | None = None,
                 lossy_ok: Callable[[SiteProfile], bool] = lambda p: True,
                 prefetch_bytes: int = 512 << 20, dense: str | None = None) -> None:
        self.compressor = compressor
        self.dense = dense
        self.link = link
        self.model = model
        self.lossy = lossy
        self.lossy_ok = lossy_ok
        self.prefetch_bytes = prefetch_bytes

    def codec_cost(self, codec: str, p: SiteProfile) -> tuple[float, int]:
        """Predicted exposed time of swapping ``p`` through ``codec``, and its stored bytes."""
        stored = predicted_stored_bytes(codec, p)
        codec_s = (self.model.predict(codec, "encode", p.nbytes, p.sparsity)
                   + self.model.predict(codec, "decode", p.nbytes, p.sparsity))
        return codec_s + exposed_s(stored, self.link, p.forward_s, p.backward_s), stored

    def costs(self, p: SiteProfile) -> tuple[float, float, int]:
        """Predicted exposed time raw, and compressed, and the compressed bytes."""
        return exposed_s(p.nbytes, self.link, p.forward_s, p.backward_s), *self.codec_cost(
            self.compressor, p)

    def decide(self, p: SiteProfile) -> Decision:
        """Raw, compressed or (where allowed) lossy, for a site that will be offloaded."""
        raw_s, best_s, stored = self.costs(p)
        best, reason = self.compressor, "compression pays"
        if self.dense and dense_ok(p):
            dense_s, dense_stored = self.codec_cost(self.dense, p)
            if dense_s < best_s:
                best, best_s, stored = self.dense, dense_s, dense_stored
        if self.lossy and p.sparsity < LOSSY_MAX_SPARSITY and self.lossy_ok(p):
            lossy_s, lossy_stored = self.codec_cost(self.lossy, p)
            if lossy_s < best_s:
                best, reason, best_s, stored = self.lossy, "lossy pays", lossy_s, lossy_stored
        if best_s < raw_s:
            return Decision(p.site, p.shape, p.dtype, p.nbytes, p.sparsity, best, reason,
                            stored, raw_s, best_s)
        reason = "transfer hidden" if raw_s == 0.0 else "compression costs more"
        return Decision(p.site, p.shape, p.dtype, p.nbytes, p.sparsity, "raw", reason,
                        p.nbytes, raw_s, raw_s)


def resolve_budget(budget: float | str | None, device: torch.device) -> int | None:
    """The configured budget in bytes for ``device`` (None: no budget).

    ``"auto"`` is what the process can still have when the plan is made, less
    ``AUTO_MARGIN`` of the device's memory: on CUDA the free memory plus what the caching
    allocator holds (the last step's saved tensors, freed by now, among it); on the CPU
    the free RAM, usually far more than a step saves, so that nothing moves there."""
    if budget is None or isinstance(budget, int):
        return budget
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        available = free + torch.cuda.memory_reserved(device)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if budget == "auto":
        return max(int(available - AUTO_MARGIN * total), 0)
    return int(budget * total)
