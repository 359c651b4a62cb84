"""`cswap bench advisor`: does the advisor pick the faster of raw and compressed swaps?

Real activations are collected from a few models' forward passes. Each is swapped out and
back through the engine's own transfer path, raw and compressed, and timed; the advisor
predicts both from its measured link and calibrated codec times. With no compute to hide
behind (windows of zero), the faster measured choice is the one the advisor should pick.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..codecs import get_codec
from ..core.tensors import skip_reason
from ..core.transfer import Stored, Transfer
from ..planning.advisor import Advisor
from ..planning.predictor import CodecTimeModel, calibrate
from ..planning.profiler import Link, SiteProfile, measure_link
from ..planning.storages import FirstSaves
from ..recipes.nets import build_cnn
from ..records import fmt_bytes
from .progress import Progress


@dataclass
class Case:
    """One activation: what was measured, what was predicted."""

    source: str
    nbytes: int
    sparsity: float
    measured_raw_s: float
    measured_codec_s: float
    predicted_raw_s: float
    predicted_codec_s: float
    advisor: str  # raw | codec name
    codec: str

    @property
    def faster(self) -> str:
        return "raw" if self.measured_raw_s <= self.measured_codec_s else self.codec


def _models(device: torch.device) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Small networks whose saved tensors span sparse (ReLU) and dense (GELU, attention)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, activation="gelu",
                                       batch_first=True)
    relu_layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    return {
        "cnn": (build_cnn(64), torch.rand(256, 1, 8, 8, generator=gen)),
        "mlp": (nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU()),
                torch.randn(256, 512, generator=gen)),
        "gelu-transformer": (layer, torch.randn(8, 128, 256, generator=gen)),
        "relu-transformer": (relu_layer, torch.randn(8, 128, 256, generator=gen)),
    }


def collect_activations(device: torch.device, min_bytes: int = 256 << 10
                        ) -> list[tuple[str, torch.Tensor]]:
    """The distinct tensors autograd saves in each model's forward that could be offloaded."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, (model, x) in _models(device).items():
        model, firsts = model.to(device), FirstSaves()

        def pack(t: torch.Tensor, name=name, firsts=firsts) -> torch.Tensor:
            if not skip_reason(t, min_bytes) and firsts.first(t.untyped_storage()):
                out.append((f"{name} {list(t.shape)}", t.detach().clone()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x.to(device).requires_grad_())
    return out


def _swap_seconds(transfer: Transfer, t: torch.Tensor, codec: str, repeats: int = 3) -> float:
    """Best wall time of a full swap out and back through the engine's transfer path."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stored = transfer.offload(Stored(t.device), t, get_codec(codec))
        _, ready = transfer.restore(stored)
        if ready is not None:
            ready.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


class Timings(NamedTuple):
    """What the check measures of the device, given instead (tests: a device whose times
    follow a law, so that the check does not depend on the machine's load): the link, the
    codec's time model, and a swap's seconds (``transfer``, the flat tensor, the codec)."""

    link: Link
    time_model: CodecTimeModel
    swap_seconds: Callable[[Transfer, torch.Tensor, str], float]


def run_advisor_check(device: str = "auto", codec: str = "zvc",
                      timings: Timings | None = None) -> list[Case]:
    """Measure (or, with ``timings``, take) and predict every collected activation's swap;
    print a table and the accuracy, and (measuring) what profiling a step costs."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto"
                       else device)
    progress = Progress("cswap bench advisor")
    if timings is None:
        progress(f"timing the {codec} codec on synthetic tensors for the advisor's time model")
        calibration = calibrate(dev, (codec,))
        progress("measuring the link")
        timings = Timings(measure_link(dev), calibration.model, _swap_seconds)
        error = f"codec time model error on held-out runs (MAPE) {100 * calibration.mape:.1f}%"
    else:
        error, calibration = "timings given, not measured", None
    advisor = Advisor(codec, timings.link, timings.time_model)
    transfer, cases = Transfer(pin_memory=True), []
    print(f"cswap bench advisor: {codec} vs raw on {dev}; {error}")
    activations = collect_activations(dev)
    progress(f"swapping {len(activations)} activations raw and with {codec}, 3 times each")
    for source, t in activations:
        flat = t.reshape(-1)
        sparsity = 1.0 - torch.count_nonzero(flat).item() / flat.numel()
        nbytes = flat.numel() * flat.element_size()
        profile = SiteProfile(0, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes,
                              True, sparsity=sparsity)
        raw_s, codec_s, _ = advisor.costs(profile)
        cases.append(Case(source, nbytes, sparsity, timings.swap_seconds(transfer, flat, "raw"),
                          timings.swap_seconds(transfer, flat, codec), raw_s, codec_s,
                          advisor.decide(profile).decision, codec))
    transfer.close()
    print(report(cases))
    if calibration is not None:
        progress("timing 20 steps of the demo CNN with and without profiling")
        print(f"profiling a step (demo CNN, batch 128) takes {profiling_overhead(dev):.3f}x "
              "the time of the same step unprofiled (median of 20, interleaved)")
    return cases


def profiling_overhead(device: torch.device, steps: int = 20) -> float:
    """Step time while profiling over step time without, same model and batch, interleaved."""
    from torch.nn import functional as F

    from ..config import CSwapConfig
    from ..core.engine import Offloader

    torch.manual_seed(0)
    model = build_cnn(32).to(device)
    x, y = torch.rand(128, 1, 8, 8, device=device), torch.randint(0, 10, (128,), device=device)
    plain = Offloader(CSwapConfig(plan="raw", min_bytes=64 << 10))
    profiling = Offloader(CSwapConfig(plan="auto", min_bytes=64 << 10, profile_steps=10**9))
    seconds = {id(plain): [], id(profiling): []}
    for i in range(2 * steps + 4):
        off = (plain, profiling)[i % 2]
        start = time.perf_counter()
        with off:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        off.last_step()  # closes the step: the profiler reads its clocks here
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 4:  # warm-up
            seconds[id(off)].append(time.perf_counter() - start)
    plain.close()
    profiling.close()
    return statistics.median(seconds[id(profiling)]) / statistics.median(seconds[id(plain)])


def accuracy(cases: list[Case]) -> float:
    return sum(c.advisor == c.faster for c in cases) / len(cases) if cases else float("nan")


def report(cases: list[Case]) -> str:
    head = (f"{'activation':<34} {'size':>9} {'zeros':>6} {'raw ms':>8} {'codec ms':>8} "
            f"{'pred raw':>8} {'pred cod':>8} {'faster':<6} {'advisor':<7}")
    rows = [head, "-" * len(head)]
    for c in cases:
        rows.append(
            f"{c.source:<34} {fmt_bytes(c.nbytes):>9} {100 * c.sparsity:>5.1f}% "
            f"{1e3 * c.measured_raw_s:>8.3f} {1e3 * c.measured_codec_s:>8.3f} "
            f"{1e3 * c.predicted_raw_s:>8.3f} {1e3 * c.predicted_codec_s:>8.3f} "
            f"{c.faster:<6} {c.advisor:<7}"
        )
    compressed = sum(c.faster != "raw" for c in cases)
    rows.append("-" * len(head))
    rows.append(f"advisor matched the faster choice in {sum(c.advisor == c.faster for c in cases)}"
                f"/{len(cases)} cases ({100 * accuracy(cases):.0f}%); compression was faster in "
                f"{compressed} of them")
    return "\n".join(rows)
