"""`cswap bench suite`: four models, every way of holding saved activations, three memory levels.

ResNet-50 and VGG-16 (bf16 autocast, 224x224, large batch), BERT-large (sequence 512) and GPT-2
medium (sequence 1024), random weights, generated data, one process. Methods: no offload,
activation checkpointing per block, Hugging Face's built-in offload (checkpointed layers
whose saved inputs go through a synchronous ``save_on_cpu``), ``torch.autograd.graph.
save_on_cpu(pin_memory=True)``, torchtune's ``OffloadActivations``, and cswap raw, auto and
auto with ``lossy="int8"``; the two auto ones at a device-memory budget of 100%, 50% and 35%
of no offload's measured peak (the engine's ``budget`` applies to ``plan="auto"``; every
other method runs once and is placed by its own measured peak). Then, per model, the largest batch that fits (no offload, activation
checkpointing, cswap auto), goals computed from the figures, and a verdict per memory level.

``--small`` runs the same code at CPU sizes. Peak memory is measured, never modelled: on CUDA
the allocator's peak (``max_memory_allocated``) over each step; on the CPU, where there is no
separate device, a ledger of live tensor storages (see :class:`DeviceLedger`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import io
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import Self

from ..config import CSwapConfig
from ..core.engine import Offloader
from ..hf_checkpointing import checkpointing_switch, has_offload
from ..planning import profiled
from ..records import fmt_bytes
from .args import number
from .bench_step import _Counted, result_meta, write_results

NO_OFFLOAD = "no offload"
CHECKPOINTING = "activation checkpointing"
HF_OFFLOAD = "HF built-in offload"
SAVE_ON_CPU = "save_on_cpu"
TORCHTUNE = "torchtune OffloadActivations"
CSWAP = {  # method -> CSwapConfig fields
    "cswap raw": {"plan": "raw"},
    "cswap auto": {"plan": "auto"},
    "cswap auto + int8": {"plan": "auto", "lossy": "int8"},
}
BUDGETED = ("cswap auto", "cswap auto + int8")  # CSwapConfig.budget is for plan="auto" only
METHODS = (NO_OFFLOAD, CHECKPOINTING, HF_OFFLOAD, SAVE_ON_CPU, TORCHTUNE, *CSWAP)
DESCRIPTIONS = {
    NO_OFFLOAD: "autograd keeps every saved tensor on the device (the baseline of every ratio)",
    CHECKPOINTING: "torch.utils.checkpoint (non-reentrant) around each block (ResNet "
    "bottleneck, VGG stage, transformer layer); Hugging Face models through their own "
    "activation_checkpointing_enable() (gradient_checkpointing_enable() before transformers 5.23)",
    HF_OFFLOAD: "transformers' activation_checkpointing_enable(offload=True), what the Trainer "
    "does for activation_checkpointing_kwargs={'offload': True} (transformers 5.17-5.22: "
    "gradient_checkpointing_enable and gradient_checkpointing_kwargs): each checkpointed layer "
    "runs inside save_on_cpu(pin_memory=True), synchronous copies",
    SAVE_ON_CPU: "torch.autograd.graph.save_on_cpu(pin_memory=True) around forward: every "
    "saved tensor copied to host memory, copied back on use",
    TORCHTUNE: "torchtune.training.OffloadActivations: side stream, pinned memory, no "
    "look-ahead prefetch, no compression",
    "cswap raw": "this library, plan='raw': every saved tensor it can move, uncompressed "
    "(no budget: the engine's budget is for plan='auto')",
    "cswap auto": "this library, plan='auto': the advisor picks raw or zvc per tensor",
    "cswap auto + int8": "this library, plan='auto', lossy='int8': int8 allowed for dense tensors",
}
MAX_BATCH_METHODS = (NO_OFFLOAD, CHECKPOINTING, "cswap auto")
LEVELS = (1.0, 0.5, 0.35)
GOAL_LEVEL = 0.35  # the goals' memory level: a fraction of no offload's measured peak
GOALS = (
    "at 35% of no offload's memory: >= 0.92x no offload's samples/s",
    "at 35% of no offload's memory: >= 1.2x activation checkpointing's samples/s",
    ">= 1.5x HF's built-in offload's samples/s, in no more memory",
    ("exposed swap time, compressed (cswap auto at the 35% budget) vs raw, per byte "
     "offloaded: -55% or better"),
    ">= 4x the largest batch at <= 15% slowdown",
)


# -- models ---------------------------------------------------------------------------------
@dataclass
class ModelCase:
    """A model to build (on the CPU, random weights), its batches and its loss."""

    key: str
    label: str
    shape: str  # sizes in words, for the report
    batch_size: int
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], object]
    loss: Callable[[nn.Module, object], torch.Tensor]
    hf: bool  # a transformers model (has its own checkpointing and offload switches)


MODELS = ("resnet50", "vgg16", "bert-large", "gpt2-medium")


def workload(key: str, small: bool) -> ModelCase:
    """The full-size model, or a CPU-sized one with the same structure (``small``)."""
    if key in ("resnet50", "vgg16"):
        from ..recipes.nets import resnet50, vgg16

        # Small: the same networks, narrow, on small images (VGG's on larger ones: its
        # classifier's weights would outweigh its activations at 32x32).
        width, side, batch, classes = (
            (4, 32 if key == "resnet50" else 64, 16, 10) if small
            else (64, 224, 256 if key == "resnet50" else 128, 1000))
        net = {"resnet50": resnet50, "vgg16": vgg16}[key]
        label = {"resnet50": "ResNet-50", "vgg16": "VGG-16"}[key]

        def images(n: int, dev: torch.device):
            g = torch.Generator().manual_seed(n)
            return (torch.randn(n, 3, side, side, generator=g).to(dev),
                    torch.randint(0, classes, (n,), generator=g).to(dev))

        def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        return ModelCase(key, label, f"width {width}, 3x{side}x{side} images, {classes} classes",
                        batch, partial(net, width, classes), images, cross_entropy, hf=False)
    if key in ("bert-large", "gpt2-medium"):
        bert = key == "bert-large"
        hidden, layers, heads, seq, batch, vocab = (
            (64, 2, 4, 64 if bert else 128, 8 if bert else 4, 1000) if small else
            (1024, 24, 16, 512 if bert else 1024, 16 if bert else 8, 30522 if bert else 50257))

        def build() -> nn.Module:
            if bert:
                from transformers import BertConfig, BertForSequenceClassification

                return BertForSequenceClassification(BertConfig(
                    vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=4 * hidden,
                    max_position_embeddings=seq, num_labels=2, use_cache=False))
            from transformers import GPT2Config, GPT2LMHeadModel

            return GPT2LMHeadModel(GPT2Config(
                vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq,
                bos_token_id=vocab - 1, eos_token_id=vocab - 1, use_cache=False))

        def tokens(n: int, dev: torch.device):
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(0, vocab, (n, seq), generator=g)
            labels = torch.randint(0, 2, (n,), generator=g) if bert else ids
            return {"input_ids": ids.to(dev), "labels": labels.to(dev)}

        def hf_loss(model: nn.Module, batch) -> torch.Tensor:
            return model(**batch).loss

        label = "BERT-large" if bert else "GPT-2 medium"
        if small:
            label += " (small)"
        return ModelCase(key, label, f"hidden {hidden}, {layers} layers, {heads} heads, sequence "
                        f"{seq}", batch, build, tokens, hf_loss, hf=True)
    raise ValueError(f"unknown model {key!r}; choose from {', '.join(MODELS)}")


class Checkpointed(nn.Module):
    """``inner`` under non-reentrant activation checkpointing: recomputed in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def checkpoint_blocks(net: nn.Sequential) -> nn.Sequential:
    """Each ResNet bottleneck, and each VGG stage (the layers up to a max-pool), checkpointed."""
    from ..recipes.nets import Bottleneck

    resnet = any(isinstance(layer, Bottleneck) for layer in net)
    layers: list[nn.Module] = []
    stage: list[nn.Module] = []
    for layer in net:
        if isinstance(layer, Bottleneck):
            layers.append(Checkpointed(layer))
        elif isinstance(layer, nn.Conv2d) and not resnet:
            stage.append(layer)  # in a VGG stage
        elif stage:
            stage.append(layer)
            if isinstance(layer, nn.MaxPool2d):
                layers.append(Checkpointed(nn.Sequential(*stage)))
                stage = []
        else:
            layers.append(layer)
    return nn.Sequential(*layers, *stage)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class Skip(Exception):
    """A method that cannot run here; the message says why."""


def hf_checkpointing(model: nn.Module, offload: bool) -> None:
    """Non-reentrant checkpointing of each layer through the model's own switch, with its
    built-in offload where asked."""
    import transformers

    enable = checkpointing_switch(model)
    if offload and not has_offload(enable):
        raise Skip(f"transformers {transformers.__version__} has no built-in activation offload "
                   "(offload=True to gradient_checkpointing_enable, transformers >= 5.17, or "
                   "to activation_checkpointing_enable, >= 5.23)")
    enable({"use_reentrant": False}, **({"offload": True} if offload else {}))


# -- what a method does ---------------------------------------------------------------------
class _Method:
    """One method set up on a model: the model to train, the context around forward, and
    the engine (cswap) or hooks object whose bytes are counted (torchtune)."""

    def __init__(self, name: str, wl: ModelCase, model: nn.Module, budget_bytes: int | None,
                 min_bytes: int, prefetch_bytes: int | None = None) -> None:
        self.name, self.model, self.offloader, self.counted = name, model, None, None
        self.context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if name == CHECKPOINTING:
            if wl.hf:
                hf_checkpointing(model, offload=False)
            else:
                self.model = checkpoint_blocks(model)
        elif name == HF_OFFLOAD:
            if not wl.hf:
                raise Skip("not a Hugging Face model (transformers' offload switch belongs to "
                           "its PreTrainedModel layers)")
            hf_checkpointing(model, offload=True)
        elif name == SAVE_ON_CPU:
            self.context = torch.autograd.graph.save_on_cpu(pin_memory=True)
        elif name == TORCHTUNE:
            if importlib.util.find_spec("torchtune") is None:
                raise Skip("torchtune is not installed")
            if model_device(model).type != "cuda":
                raise Skip("needs CUDA: its hooks record CUDA streams and events (not tried "
                           "on this device)")
            from torchtune.training import OffloadActivations

            hooks = OffloadActivations(min_offload_size=min_bytes)
            self.counted = _Counted(hooks, lambda t, p: hooks.tracker.get(p, (None, False))[1])
            self.context = self.counted
        elif name in CSWAP:
            prefetch = {} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
            self.offloader = Offloader(CSwapConfig(**CSWAP[name], budget=budget_bytes,
                                                   min_bytes=min_bytes, **prefetch))
            self.context = self.offloader
        elif name != NO_OFFLOAD:
            raise ValueError(f"unknown method {name!r}")

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()


# -- measuring --------------------------------------------------------------------------------
class HookTap:
    """Wraps every saved-tensor hook pair pushed while it is active (``saved_tensors_hooks`` and
    what is built on it: ``save_on_cpu``, checkpointing, torchtune's hooks, the engine), the
    same way for every method: it counts the bytes a pack hook copies out (tensors in what the
    hook returns that do not share the saved tensor's storage), tells a :class:`DeviceLedger`
    which allocations happen inside a pack hook (a method's host tier), and hands it the
    tensors unpack hooks give back (on the device again from then on)."""

    def __init__(self) -> None:
        self.moved = 0
        self.ledger: DeviceLedger | None = None
        self._local = threading.local()
        self._push = None

    def __enter__(self) -> Self:
        autograd = torch._C._autograd
        self._push = push = autograd._push_saved_tensors_default_hooks
        autograd._push_saved_tensors_default_hooks = lambda pack, unpack: push(
            self._pack(pack), self._unpack(unpack))
        return self

    def __exit__(self, *exc) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks = self._push

    def packing(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def take_moved(self) -> int:
        moved, self.moved = self.moved, 0
        return moved

    def _pack(self, pack):
        def tapped(t: torch.Tensor):
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                packed = pack(t)
            finally:
                self._local.depth -= 1
            ptr = t.untyped_storage().data_ptr()
            self.moved += sum(x.numel() * x.element_size() for x in tree_leaves(packed)
                              if isinstance(x, torch.Tensor) and x.numel()
                              and x.untyped_storage().data_ptr() != ptr)
            return packed

        return tapped

    def _unpack(self, unpack):
        def tapped(packed):
            t = unpack(packed)
            if self.ledger is not None and isinstance(t, torch.Tensor):
                self.ledger.hold(t)
            return t

        return tapped


class DeviceLedger(TorchDispatchMode):
    """Peak bytes of live tensor storages on the compute side of a CPU step, measured.

    Counted: the storages of the tensors given at the start (parameters, buffers, optimizer
    state, the batch), every storage an operation on the training thread creates outside a
    saved-tensor pack hook (activations, gradients, temporaries, recomputation), and the
    storage of every tensor an unpack hook hands back, from then on. Each storage counts once,
    with its size, until it is freed (a weak reference to it says when, on whichever thread
    drops it). Not counted: what a pack hook allocates (the copy a method keeps on the host
    side) and what other threads allocate (an offload engine's workers) until it is handed
    back. The rule is the same for every method; it is what would sit in device memory if the
    host side were a separate memory, as it is on a GPU.
    """

    def __init__(self, tap: HookTap, held: Iterator[torch.Tensor]) -> None:
        super().__init__()
        self.tap = tap
        self.now = self.peak = 0
        self._held: dict[int, tuple[weakref.ref, int]] = {}
        self._lock = threading.Lock()
        for t in held:
            self.hold(t)

    def hold(self, t: torch.Tensor) -> None:
        if _storage_key(t) is None:
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self._held:
                counted = self._held[key][1]
                if counted == nbytes:
                    return
                self.now -= counted  # resized in place
            self._held[key] = (weakref.ref(storage, partial(self._freed, key)), nbytes)
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def _freed(self, key: int, _ref) -> None:
        with self._lock:
            held = self._held.pop(key, None)
            if held is not None:
                self.now -= held[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tap.packing():
            return out
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            # A view or an in-place result allocates nothing: it counts if its storage does
            # (resized in place by an out= op, it is counted again at its new size).
            if key not in inputs or key in self._held:
                self.hold(t)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (None: no CPU storage of its own to count)."""
    if t.device.type != "cpu" or t.is_meta or t.layout != torch.strided or t.is_nested:
        return None
    return t.untyped_storage()._cdata


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> Iterator:
    yield from model.parameters()
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield from (x for x in tree_leaves(batch) if isinstance(x, torch.Tensor))


@dataclass
class StepResult:
    step_s: float
    forward_s: float
    peak_bytes: int | None  # CUDA: allocator peak; CPU: the ledger's, on a ledger step only


def _step(m: _Method, wl: ModelCase, optimizer, batch, dev: torch.device,
          ledger: DeviceLedger | None = None) -> StepResult:
    cuda = dev.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        begin, forward_done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    with ledger if ledger is not None else contextlib.nullcontext():
        start = time.perf_counter()
        if cuda:
            begin.record()
        with autocast, m.context:
            loss = wl.loss(m.model, batch)
        forward_s = time.perf_counter() - start
        if cuda:
            forward_done.record()
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(dev)
        step_s = time.perf_counter() - start
    if cuda:
        return StepResult(step_s, begin.elapsed_time(forward_done) / 1e3,
                          torch.cuda.max_memory_allocated(dev))
    return StepResult(step_s, forward_s, None if ledger is None else ledger.peak)


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:200]}"


def _free(dev: torch.device) -> None:
    """Give a run's device memory back before the next one (CUDA; the CPU needs nothing)."""
    if dev.type == "cuda":
        gc.collect()  # an out-of-memory error's traceback holds tensors in reference cycles
        torch.cuda.empty_cache()


@dataclass
class Settings:
    """How each run is measured."""

    dev: torch.device
    steps: int  # timed steps
    warmup: int  # untimed steps first (cswap: at least its profiled steps + 1)
    min_bytes: int  # smaller saved tensors stay (cswap, torchtune)
    prefetch_bytes: int | None = None  # cswap's; None: the engine's default


def measure(wl: ModelCase, base: nn.Module, method: str, batch_size: int, s: Settings,
            budget: float | None = None, budget_bytes: int | None = None) -> dict:
    """One method at one batch size (and budget): steps timed, peak measured, bytes counted.

    A method that cannot run gives ``{"skipped": reason}``; out of device memory, also
    ``"oom": True``."""
    dev, steps, warmup = s.dev, s.steps, s.warmup
    row: dict = {"method": method, "budget": budget, "budget_bytes": budget_bytes,
                 "batch": batch_size}
    m = model = optimizer = batch = None
    try:
        model = copy.deepcopy(base).to(dev).train()
        m = _Method(method, wl, model, budget_bytes, s.min_bytes, s.prefetch_bytes)
        optimizer = torch.optim.SGD(m.model.parameters(), lr=1e-4)
        batch = wl.make_batch(batch_size, dev)
        if m.offloader is not None:  # its plan is made after the profiled steps
            warmup = max(warmup, m.offloader.config.profile_steps + 1)
        results, stats, moved = [], [], []
        with HookTap() as tap:
            for _ in range(warmup + steps):
                results.append(_step(m, wl, optimizer, batch, dev))
                moved.append(m.counted.moved_bytes() if m.counted else tap.take_moved())
                if m.offloader is not None:
                    stats.append(m.offloader.last_step())
            if dev.type == "cpu":  # one more step, under the ledger, for the peak
                ledger = tap.ledger = DeviceLedger(tap, _state_tensors(m.model, optimizer, batch))
                results.append(_step(m, wl, optimizer, batch, dev, ledger))
                tap.ledger = None
                peak = ledger.peak
            else:
                peak = max(r.peak_bytes for r in results[warmup:])
        timed = results[warmup:warmup + steps]
        step_s = statistics.median(r.step_s for r in timed)
        row |= {"samples_per_s": batch_size / step_s, "step_s": step_s,
                "forward_s": statistics.median(r.forward_s for r in timed), "peak_bytes": peak,
                "link_bytes": 2 * moved[warmup + steps - 1]}
        if stats:
            last = stats[-1]
            row |= {"offloaded_bytes": last.offloaded_bytes, "stored_bytes": last.stored_bytes,
                    "link_bytes": 2 * last.stored_bytes,
                    "wait_s": statistics.median(st.wait_s for st in stats[warmup:]),
                    "engine_stall_s": _median_attr(stats[warmup:], "forward_wait_s"),
                    "engine_peak_bytes": getattr(last, "peak_resident_bytes", None),
                    "decisions": _decisions(last)}
    except Skip as err:
        row["skipped"] = str(err)
    except torch.OutOfMemoryError as err:
        row |= {"skipped": f"out of device memory ({_reason(err)[:120]})", "oom": True}
    except Exception as err:  # noqa: BLE001 - a method that fails here is reported, not fatal
        row["skipped"] = f"failed on {dev.type}: {_reason(err)}"
    finally:
        if m is not None:
            with contextlib.suppress(Exception):
                m.close()
        del m, model, optimizer, batch
        _free(dev)
    return row


def _median_attr(stats: list, name: str) -> float | None:
    """The median of a StepStats figure over steps, None where this engine has no such figure."""
    values = [getattr(s, name, None) for s in stats]
    return None if None in values else statistics.median(values)


def _decisions(st) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in st.sites:
        counts[s.decision] = counts.get(s.decision, 0) + 1
    return counts


# -- the largest batch ------------------------------------------------------------------------
def max_batch(wl: ModelCase, base: nn.Module, method: str, s: Settings, start: int, limit: int,
              cap: int | None, deadline: float, bisections: int,
              known: dict[int, dict] | None = None) -> dict:
    """Largest batch of ``method`` that fits (CUDA: no out-of-memory, and within ``cap`` if
    given; CPU: measured peak within ``cap``), by doubling from ``start`` up to ``limit``, then
    bisecting; each try is a short :func:`measure` (``known``: rows already measured, by
    batch). Stops early where the next try would end past ``deadline``, or at an error that is
    not a lack of memory."""
    tries: list[dict] = []
    stop: list[str] = []
    pace: list[tuple[int, float]] = []  # (batch, seconds a try took)

    def fits(b: int) -> bool | None:
        row = (known or {}).get(b)
        if row is None:
            # A try's time grows with the batch: do not start one that cannot finish.
            size, took = pace[-1] if pace else (b, 0.0)
            if time.monotonic() + took * b / size > deadline:
                stop.append("time budget")
                return None
            began = time.monotonic()
            row = measure(wl, base, method, b, s)
            pace.append((b, time.monotonic() - began))
        failed = "skipped" in row and not row.get("oom")
        ok = "skipped" not in row and (cap is None or row["peak_bytes"] <= cap)
        tries.append({k: row.get(k) for k in ("batch", "samples_per_s", "peak_bytes")}
                     | {"fits": ok, "why": row.get("skipped")})
        if ok:
            text = (f"fits, {row['samples_per_s']:.1f} samples/s, peak "
                    f"{fmt_bytes(row['peak_bytes'])}")
        else:
            text = f"does not fit ({row.get('skipped') or 'peak ' + fmt_bytes(row['peak_bytes'])})"
        print(f"      {method}, batch {b}: {text}", flush=True)
        if failed:
            stop.append(row["skipped"])
            return None
        return ok

    good = bad = None
    b = start
    while not stop:
        ok = fits(b)
        if ok is None:
            break
        if ok:
            good = b
            if b >= limit:
                stop.append("search limit")
                break
            b = min(2 * b, limit)
        else:
            bad = b
            if good is not None or b == 1:
                break
            b = max(1, b // 2)
    while not stop and good is not None and bad is not None and bisections > 0 and bad - good > 1:
        mid = (good + bad) // 2
        ok = fits(mid)
        if ok is None:
            break
        good, bad = (mid, bad) if ok else (good, mid)
        bisections -= 1
    best = next((t for t in tries if t["batch"] == good and t["fits"]), None)
    return {"method": method, "max_batch": good,
            "samples_per_s": best["samples_per_s"] if best else None,
            "peak_bytes": best["peak_bytes"] if best else None,
            "limited_by": stop[0] if stop else "memory", "tries": tries}


# -- one model --------------------------------------------------------------------------------
def _label(row: dict) -> str:
    if row.get("budget") is None:
        return row["method"]
    return f"{row['method']} @{round(100 * row['budget'])}%"


def _plan(levels: tuple[float, ...]) -> list[tuple[str, float | None]]:
    """(method, budget level) in the order they run: what the goals need first, so that a
    time budget that runs out leaves the least important runs out."""
    low = min(levels)
    first = [(NO_OFFLOAD, None), (CHECKPOINTING, None), ("cswap raw", None)]
    first += [(c, low) for c in BUDGETED]
    first += [(HF_OFFLOAD, None), (SAVE_ON_CPU, None), (TORCHTUNE, None)]
    rest = [(c, level) for level in sorted(levels, reverse=True) if level != low
            for c in BUDGETED]
    return first + rest


def run_model(wl: ModelCase, dev: torch.device, opts: argparse.Namespace, deadline: float,
              save: Callable[[dict], None]) -> dict:
    """Every method on ``wl``, the largest batches, the goals and the verdict."""
    levels = tuple(opts.levels)
    result: dict = {"model": wl.key, "label": wl.label, "shape": wl.shape,
                    "batch": wl.batch_size, "params": 0, "levels": list(levels), "runs": [],
                    "max_batch": [], "complete": False, "prefetch_bytes": opts.prefetch_bytes}
    torch.manual_seed(0)
    try:
        base = wl.build().train()
    except Exception as err:  # noqa: BLE001 - e.g. transformers missing: the other models go on
        result["runs"] = [{"method": m, "budget": None, "label": m,
                           "skipped": f"the model could not be built: {_reason(err)}"}
                          for m in METHODS]
        result |= {"goals": goals(result), "verdict": verdict(result, levels), "complete": True}
        save(result)
        return result
    result["params"] = sum(p.numel() for p in base.parameters())
    began = time.monotonic()
    baseline: dict | None = None
    settings = Settings(dev, opts.steps, opts.warmup, opts.min_bytes, opts.prefetch_bytes)
    for method, level in _plan(levels):
        row_stub = {"method": method, "budget": level}
        # No offload runs whatever the time (every figure is relative to it), and methods
        # that cannot run here say why at no cost.
        exempt = method == NO_OFFLOAD or (method == HF_OFFLOAD and not wl.hf) or (
            method == TORCHTUNE and dev.type != "cuda")
        if time.monotonic() > deadline and not exempt:
            result["runs"].append(row_stub | {"skipped": "time budget used up"})
            continue
        if level is not None and (baseline is None or "skipped" in baseline):
            result["runs"].append(row_stub | {"skipped": "no offload did not run: no budget"})
            continue
        budget_bytes = None if level is None else int(level * baseline["peak_bytes"])
        row = measure(wl, base, method, wl.batch_size, settings, row_stub["budget"],
                      budget_bytes)
        if method == NO_OFFLOAD:
            baseline = row
        _derive(row, baseline)
        result["runs"].append(row)
        print(f"  [{wl.key} {time.monotonic() - began:5.0f} s] {_progress(row)}", flush=True)
        save(result)
    if opts.max_batch and baseline is not None and "skipped" not in baseline:
        cap = opts.memory_cap
        if cap is None and dev.type == "cpu":
            cap = baseline["peak_bytes"]
        result["memory_cap"] = cap
        search = replace(settings, steps=opts.search_steps)
        first = None
        for method in MAX_BATCH_METHODS:
            start = wl.batch_size if first is None else first
            limit = 16 * wl.batch_size if first is None else opts.max_factor * first
            known = {wl.batch_size: baseline} if method == NO_OFFLOAD else None
            found = max_batch(wl, base, method, search, start, limit, cap, deadline,
                              opts.bisections, known)
            if method == NO_OFFLOAD:
                first = found["max_batch"]
                if first is None:
                    break
            result["max_batch"].append(found)
            print(f"  [{wl.key} {time.monotonic() - began:5.0f} s] max batch, {method}: "
                  f"{found['max_batch']} ({found['limited_by']})", flush=True)
            save(result)
    result["goals"] = goals(result)
    result["verdict"] = verdict(result, levels)
    result["complete"] = True
    save(result)
    del base
    _free(dev)
    return result


def _derive(row: dict, baseline: dict | None) -> None:
    """Ratios to no offload, and the exposed swap time of cswap runs."""
    row["label"] = _label(row)
    if "skipped" in row or baseline is None or "skipped" in baseline:
        return
    row["vs_no_offload"] = row["samples_per_s"] / baseline["samples_per_s"]
    row["peak_fraction"] = row["peak_bytes"] / baseline["peak_bytes"]
    row["forward_extra_s"] = max(0.0, row["forward_s"] - baseline["forward_s"])
    if "wait_s" in row:
        # CSwap's own measure: backward's waits plus forward's stalls, as the engine times
        # them; an engine that does not report forward stalls gets forward time beyond no
        # offload's instead.
        stall = row.get("engine_stall_s")
        row["stall_s"] = row["forward_extra_s"] if stall is None else stall
        row["stall_source"] = "forward time beyond no offload" if stall is None else (
            "StepStats.forward_wait_s")
        row["exposed_s"] = row["wait_s"] + row["stall_s"]


def _progress(row: dict) -> str:
    if "skipped" in row:
        return f"{row['label']}: skipped ({row['skipped']})"
    text = (f"{row['label']}: {row['samples_per_s']:.1f} samples/s "
            f"({row.get('vs_no_offload', 1.0):.2f}x), peak {fmt_bytes(row['peak_bytes'])} "
            f"({100 * row.get('peak_fraction', 1.0):.0f}%), link {fmt_bytes(row['link_bytes'])}")
    if "exposed_s" in row:
        text += f", exposed swap {1e3 * row['exposed_s']:.1f} ms"
    return text


# -- goals and verdict ------------------------------------------------------------------------
def _ran(result: dict) -> list[dict]:
    return [r for r in result["runs"] if "skipped" not in r and "peak_fraction" in r]


def _row(result: dict, label: str) -> dict | None:
    return next((r for r in _ran(result) if r["label"] == label), None)


def _fastest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["samples_per_s"], default=None)


def goals(result: dict) -> list[dict]:
    """Each goal of issue 13 with PASS, FAIL or n/a and the measured figures behind it."""
    low = GOAL_LEVEL
    base = _row(result, NO_OFFLOAD)
    out: list[dict] = []

    def add(goal: str, status: str, measured: str) -> None:
        out.append({"goal": goal, "status": status, "measured": measured})

    if base is None:
        for goal in GOALS:
            add(goal, "n/a", "no offload did not run")
        return out
    cswap_runs = [r for r in _ran(result) if r["method"] in CSWAP]
    in_low = [r for r in cswap_runs if r["peak_fraction"] <= low]
    best = _fastest(in_low)
    lowest = min(cswap_runs, key=lambda r: r["peak_fraction"], default=None)
    nofit = ("no cswap run fits" + (f" (lowest: {lowest['label']} at "
                                    f"{100 * lowest['peak_fraction']:.0f}%)" if lowest else ""))
    if not cswap_runs:
        add(GOALS[0], "n/a", "no cswap run ran")
    elif best is None:
        add(GOALS[0], "FAIL", nofit)
    else:
        ratio = best["vs_no_offload"]
        add(GOALS[0], "PASS" if ratio >= 0.92 else "FAIL",
            f"{best['label']}: {ratio:.2f}x no offload at {100 * best['peak_fraction']:.0f}% of "
            "its memory")
    ckpt = _row(result, CHECKPOINTING)
    if ckpt is None or not cswap_runs:
        add(GOALS[1], "n/a", "activation checkpointing or cswap did not run")
    elif best is None:
        add(GOALS[1], "FAIL", nofit)
    else:
        ratio = best["samples_per_s"] / ckpt["samples_per_s"]
        add(GOALS[1], "PASS" if ratio >= 1.2 else "FAIL",
            f"{best['label']}: {ratio:.2f}x activation checkpointing (which peaks at "
            f"{100 * ckpt['peak_fraction']:.0f}%)")
    hf = _row(result, HF_OFFLOAD)
    if hf is None or not cswap_runs:
        why = next((r.get("skipped") for r in result["runs"] if r["method"] == HF_OFFLOAD), "")
        add(GOALS[2], "n/a", f"HF built-in offload did not run: {why}" if hf is None
            else "cswap did not run")
    else:
        rival = _fastest([r for r in cswap_runs if r["peak_bytes"] <= hf["peak_bytes"]])
        if rival is None:
            add(GOALS[2], "FAIL", f"no cswap run fits in HF offload's "
                f"{100 * hf['peak_fraction']:.0f}%")
        else:
            ratio = rival["samples_per_s"] / hf["samples_per_s"]
            add(GOALS[2], "PASS" if ratio >= 1.5 else "FAIL",
                f"{rival['label']}: {ratio:.2f}x HF built-in offload (which peaks at "
                f"{100 * hf['peak_fraction']:.0f}%)")
    # Per byte offloaded: a run that keeps more on the device exposes less swap time for
    # that reason alone; what the goal asks is what compression does to the same swaps.
    at = f"@{round(100 * low)}%"
    raw = _row(result, "cswap raw")
    auto = [r for r in (_row(result, f"{c} {at}") for c in BUDGETED)
            if r is not None and r.get("offloaded_bytes")]
    compressed = [r for r in auto if set(r.get("decisions", {})) - {"raw", "keep", "dedup"}]
    if raw is None or not auto:
        add(GOALS[3], "n/a", f"cswap raw, or cswap auto {at}, did not run or offloaded nothing")
    elif not compressed:
        add(GOALS[3], "n/a", f"cswap auto {at} compressed no tensor (the advisor swapped all "
            "it offloaded raw): no compression to compare")
    elif raw["exposed_s"] <= 0.0 or not raw.get("offloaded_bytes"):
        add(GOALS[3], "n/a", "cswap raw exposes no swap time")
    else:
        def per_gib(r: dict) -> float:
            return r["exposed_s"] / (r["offloaded_bytes"] / 2**30)

        comp = min(compressed, key=per_gib)
        change = per_gib(comp) / per_gib(raw) - 1.0
        add(GOALS[3], "PASS" if change <= -0.55 else "FAIL",
            f"{comp['label']} {1e3 * comp['exposed_s']:.1f} ms for "
            f"{fmt_bytes(comp['offloaded_bytes'])} offloaded against raw "
            f"{1e3 * raw['exposed_s']:.1f} ms for {fmt_bytes(raw['offloaded_bytes'])}: "
            f"{100 * change:+.0f}% per byte")
    searches = {s["method"]: s for s in result.get("max_batch", [])}
    mine, theirs = searches.get("cswap auto"), searches.get(NO_OFFLOAD)
    if not mine or not theirs or not mine["max_batch"] or not theirs["max_batch"]:
        add(GOALS[4], "n/a", "largest batch not searched (or nothing fit)")
    else:
        factor = mine["max_batch"] / theirs["max_batch"]
        speed = mine["samples_per_s"] / theirs["samples_per_s"]
        more = "at least " if mine["limited_by"] != "memory" else ""
        add(GOALS[4], "PASS" if factor >= 4 and speed >= 0.85 else "FAIL",
            f"cswap auto: batch {mine['max_batch']} ({more}{factor:.1f}x no offload's "
            f"{theirs['max_batch']}) at {speed:.2f}x its samples/s")
    return out


def verdict(result: dict, levels: tuple[float, ...]) -> str:
    """Which run is fastest within each memory level."""
    parts = []
    for level in sorted(levels, reverse=True):
        fit = [r for r in _ran(result) if r["peak_fraction"] <= level + 1e-9]
        best = _fastest(fit)
        where = f"<= {round(100 * level)}% of no offload's memory"
        if best is None:
            parts.append(f"{where}: nothing fits")
        else:
            parts.append(f"{where}: {best['label']} ({best['samples_per_s']:.1f} samples/s, "
                         f"{best['vs_no_offload']:.2f}x)")
    return f"{result['label']}: " + "; ".join(parts)


# -- the report -------------------------------------------------------------------------------
def peak_meaning(dev: torch.device) -> str:
    """What "peak memory" means in this report, on ``dev``."""
    if dev.type == "cuda":
        return ("Peak memory: torch.cuda.max_memory_allocated over a training step (weights, "
                "gradients, the batch, saved tensors, temporaries), reset before each step; the "
                "largest over the timed steps. Host memory, pinned or not, is not counted.")
    return ("Peak memory: the CPU has no separate device memory, so a ledger measures what "
            "would be on one, by the same rule for every method, over one more training step "
            "(forward, backward, optimizer): the storages of the parameters, buffers, optimizer "
            "state and batch, of every tensor an operation on the training thread allocates "
            "outside a saved-tensor pack hook, and of every tensor an unpack hook hands back, "
            "each counted once from then until it is freed. Not counted: what a pack hook copies "
            "a saved tensor into, and what another thread allocates, until it is handed back "
            "(a method's host side). On the CPU host and device are the same RAM and a swap is "
            "a memory copy on the same cores, and a few timed steps on a shared machine are "
            "noisy: the CPU figures check the code, they do not rank the methods.")


def markdown(results: list[dict], dev: torch.device, opts: argparse.Namespace) -> str:
    """The report's body (the header comes from ``write_results``)."""
    within = ("device memory" if dev.type == "cuda" and opts.memory_cap is None
              else "the memory cap given for each model")
    lines = [peak_meaning(dev), "",
             ("Methods (budget: bytes, that fraction of no offload's measured peak; every "
              "other method runs once and is placed by its measured peak):"), ""]
    lines += [f"- {name}: {DESCRIPTIONS[name]}" for name in METHODS]
    lines += [(f"- max batch: the largest batch that fits in {within}, found by doubling (and "
               f"bisecting on a GPU), for {', '.join(MAX_BATCH_METHODS)} (no budget), with its "
               "samples/s"), "",
              ("Figures: samples/s (median step, optimizer included) and its ratio to no "
               "offload's; peak memory and its fraction of no offload's; bytes over the link per "
               "step (what leaves the device, counted twice: out in forward, back in "
               "backward); exposed swap time of cswap runs (CSwap's measure: backward's waits, "
               "StepStats.wait_s, plus forward's stalls, StepStats.forward_wait_s, or forward "
               "time beyond no offload's where the engine does not report them); the engine's "
               "own peak of resident saved-tensor bytes (StepStats.peak_resident_bytes, where "
               "the engine reports it); cswap's sites: how many saved tensors the engine kept "
               "(keep), shared (dedup) or sent through each codec on the last step."), "",
              "Goals (PASS/FAIL/n/a per model below, computed from the measured figures):", ""]
    lines += [f"- {g}" for g in GOALS]
    for result in results:
        lines += ["", *model_markdown(result, opts)]
    return "\n".join(lines)


def _fmt_window(prefetch_bytes: int | None) -> str:
    return "auto (the engine's)" if prefetch_bytes is None else fmt_bytes(prefetch_bytes)


def _predicted(result: dict, row: dict, opts: argparse.Namespace) -> str:
    """The replay's prediction of a run of a full-size model profiled on the first H100 run
    (``planning.profiled``), as ratios to its prediction of no offload; "-" where it has none
    (other sizes, models, methods)."""
    if opts.small:
        return "-"
    predicted = profiled.predict_run(result["model"], row["method"], row.get("budget"),
                                     result["batch"], result.get("prefetch_bytes"))
    if predicted is None:
        return "-"
    run, base = predicted
    return (f"{run.step_s / base.step_s:.2f}x, {run.peak_bytes / base.peak_bytes:.0%} "
            "(H100 profile)")


def model_markdown(result: dict, opts: argparse.Namespace) -> list[str]:
    lines = [f"## {result['label']}", "",
             (f"{result['shape']}, batch {result['batch']}, {result['params'] / 1e6:.1f} M "
              f"parameters; cswap's prefetch_bytes "
              f"{_fmt_window(result.get('prefetch_bytes'))}"
              f"{'' if result['complete'] else ' (PARTIAL: still running, or cut off)'}"),
             "", ("| method | samples/s | vs no offload | peak memory | vs no offload | "
                  "link bytes/step | exposed swap | engine's peak | cswap's sites | "
                  "replay predicts: step, peak vs no offload |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    order = {name: i for i, name in enumerate(METHODS)}
    rows = sorted(result["runs"], key=lambda r: (order[r["method"]], -(r.get("budget") or 0)))
    for r in rows:
        label = _label(r)
        if "skipped" in r:
            lines.append(f"| {label} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        exposed = f"{1e3 * r['exposed_s']:.1f} ms" if "exposed_s" in r else "-"
        engine = r.get("engine_peak_bytes")
        engine_text = "-" if r["method"] not in CSWAP else (
            fmt_bytes(engine) if engine is not None else "n/a")
        sites = ", ".join(f"{k} {v}" for k, v in sorted(r.get("decisions", {}).items()))
        lines.append(
            f"| {label} | {r['samples_per_s']:.1f} | {r.get('vs_no_offload', math.nan):.2f}x | "
            f"{fmt_bytes(r['peak_bytes'])} | {100 * r.get('peak_fraction', math.nan):.0f}% | "
            f"{fmt_bytes(r['link_bytes'])} | {exposed} | {engine_text} | {sites or '-'} | "
            f"{_predicted(result, r, opts)} |")
    if result.get("max_batch"):
        cap = result.get("memory_cap")
        lines += ["", f"max batch (within {fmt_bytes(cap) if cap else 'device memory'}):", "",
                  "| method | largest batch | samples/s there | peak | stopped by |",
                  "|---|---:|---:|---:|---|"]
        for s in result["max_batch"]:
            if s["max_batch"] is None:
                lines.append(f"| {s['method']} | none fits | | | {s['limited_by']} |")
                continue
            lines.append(f"| {s['method']} | {s['max_batch']} | {s['samples_per_s']:.1f} | "
                         f"{fmt_bytes(s['peak_bytes'])} | {s['limited_by']} |")
    elif opts.max_batch:
        lines += ["", "max batch: not searched (no offload did not run, or out of time)"]
    if "goals" in result:
        lines += ["", "Goals:", ""]
        lines += [f"- {g['status']}: {g['goal']}: {g['measured']}" for g in result["goals"]]
        lines += ["", f"Verdict: {result['verdict']}"]
    if result.get("plot"):
        lines += ["", f"![{result['label']}: samples/s against peak memory]({result['plot']})"]
    return lines


def plot(result: dict, path: Path) -> bool:
    """Samples/s against peak memory, one marker per run, cswap budgets joined by lines."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    ran = _ran(result)
    if not ran:
        return False
    fig = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    unit = 2**30 if max(r["peak_bytes"] for r in ran) >= 2**30 else 2**20
    markers = dict(zip(METHODS, "osDv^ph*", strict=True))
    for method in METHODS:
        rows = sorted((r for r in ran if r["method"] == method), key=lambda r: r["peak_bytes"])
        if not rows:
            continue
        xs = [r["peak_bytes"] / unit for r in rows]
        ys = [r["samples_per_s"] for r in rows]
        ax.plot(xs, ys, marker=markers[method], linestyle="-" if len(rows) > 1 else "",
                label=method)
        for r, x, y in zip(rows, xs, ys, strict=True):
            if r.get("budget") is not None:
                ax.annotate(f"{round(100 * r['budget'])}%", (x, y), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    base = _row(result, NO_OFFLOAD)
    if base is not None:
        for level in result["levels"]:
            ax.axvline(level * base["peak_bytes"] / unit, color="grey", linestyle=":",
                       linewidth=0.8)
    levels = "/".join(f"{round(100 * level)}" for level in result["levels"])
    ax.set_xlabel(f"peak memory ({'GiB' if unit == 2**30 else 'MiB'}); dotted: {levels}% of "
                  "no offload's")
    ax.set_ylabel("samples/s")
    ax.set_title(f"{result['label']}, batch {result['batch']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# -- the command ------------------------------------------------------------------------------
def add_parser(bench_kinds) -> argparse.ArgumentParser:
    """Register ``cswap bench suite`` under the ``bench`` subcommands."""
    from .args import whole as _whole

    suite = bench_kinds.add_parser(
        "suite", help="ResNet-50, VGG-16, BERT-large, GPT-2 medium: every offload method at "
        "100/50/35%% of no offload's memory, largest batch, goals; report, JSON and plots")
    suite.add_argument("--out", default=None, help="folder for suite.md, suite.json and PNGs")
    suite.add_argument("--small", action="store_true",
                       help="CPU-sized models (what CI runs); every method that runs there")
    suite.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    suite.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    suite.add_argument("--steps", type=_whole(1), default=None,
                       help="timed steps per run (default: 4, --small 2)")
    suite.add_argument("--warmup", type=_whole(0), default=1,
                       help="untimed steps first (cswap: at least its profiled steps + 1)")
    suite.add_argument("--levels", nargs="+", type=_level, default=list(LEVELS),
                       help="memory levels, fractions of no offload's peak (default: 1 0.5 0.35)")
    suite.add_argument("--min-bytes", type=_whole(0), default=None,
                       help="smaller saved tensors stay (cswap, torchtune); default 64 KiB, "
                       "--small 4 KiB")
    suite.add_argument("--prefetch-bytes", type=_whole(0), default=None,
                       help="cswap's prefetch_bytes (default: the engine's, 'auto': what "
                       "hides the measured link)")
    suite.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=True,
                       help="search the largest batch that fits")
    suite.add_argument("--max-factor", type=_whole(2), default=8,
                       help="search other methods up to this multiple of no offload's batch")
    suite.add_argument("--memory-cap", type=_whole(1), default=None,
                       help="bytes a batch may peak at in the search (default: device memory; "
                       "CPU: no offload's peak at the suite's batch)")
    suite.add_argument("--time-budget", type=_seconds, default=None,
                       help="seconds for the whole suite, shared by the models; runs left when "
                       "a model's share is spent are reported as skipped")
    suite.add_argument("--threads", type=_whole(1), default=None,
                       help="intra-op CPU threads while it runs (default: unchanged; --small "
                       "on the CPU: 1, as tiny ops on a busy machine only lose by more)")
    return suite


_level = number(lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1]")
_seconds = number(lambda v: v > 0.0, "a number of seconds > 0")


def run_suite(opts: argparse.Namespace, command: list[str] | None = None) -> list[dict]:
    """Run the suite; print progress and the report; write it under ``opts.out``."""
    device = opts.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    opts.steps = opts.steps or (2 if opts.small else 4)
    opts.min_bytes = opts.min_bytes if opts.min_bytes is not None else (
        4096 if opts.small else 64 * 1024)
    opts.search_steps = 1 if dev.type == "cpu" else 2
    opts.bisections = 0 if opts.small else 1
    threads = opts.threads or (1 if opts.small and dev.type == "cpu" else None)
    if threads:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return _run_suite(opts, dev, command)
        finally:
            torch.set_num_threads(previous)
    return _run_suite(opts, dev, command)


def _run_suite(opts: argparse.Namespace, dev: torch.device, command: list[str] | None
               ) -> list[dict]:
    out = Path(opts.out) if opts.out else None
    meta = result_meta(dev, size="small (CPU sizes)" if opts.small else "full",
                       models=list(opts.models), steps=opts.steps, warmup=opts.warmup,
                       levels=list(opts.levels), precision="bf16 autocast" if dev.type == "cuda"
                       else "float32", optimizer="SGD, no momentum (no optimizer state)",
                       threads=torch.get_num_threads(), time_budget_s=opts.time_budget)
    if command is not None:
        meta["command"] = " ".join(["cswap", *command])
    print(f"cswap bench suite: {', '.join(opts.models)} on {meta['device']}, "
          f"{'small' if opts.small else 'full'} sizes, {opts.steps} timed steps per run"
          + (f", time budget {opts.time_budget:.0f} s" if opts.time_budget else ""), flush=True)
    results: list[dict] = []
    began = time.monotonic()
    total = opts.time_budget

    def save(current: dict | None = None) -> None:
        """Write what is measured so far (after every run: a cut-off run keeps its results)."""
        if out is None:
            return
        done = results + [current] if current is not None else results
        meta["models_done"] = f"{sum(r['complete'] for r in done)} of {len(opts.models)}"
        quiet = contextlib.redirect_stdout(io.StringIO()) if current is not None else (
            contextlib.nullcontext())
        with quiet:
            write_results(str(out / "suite"), "cswap bench suite", meta,
                          {"peak": peak_meaning(dev), "models": done}, markdown(done, dev, opts))

    for i, key in enumerate(opts.models):
        deadline = math.inf if total is None else began + total * (i + 1) / len(opts.models)
        wl = workload(key, opts.small)
        print(f"{wl.label}: {wl.shape}, batch {wl.batch_size}", flush=True)
        result = run_model(wl, dev, opts, deadline, save)
        if out is not None and plot(result, out / f"suite-{key}.png"):
            result["plot"] = f"suite-{key}.png"
        results.append(result)
        for g in result["goals"]:
            print(f"  {g['status']}: {g['goal']}: {g['measured']}")
        print(f"  Verdict: {result['verdict']}", flush=True)
        save()
    print(markdown(results, dev, opts))
    print(f"cswap bench suite: done in {time.monotonic() - began:.0f} s")
    return results


def main(opts: argparse.Namespace, command: list[str] | None = None) -> int:
    run_suite(opts, command)
    return 0
