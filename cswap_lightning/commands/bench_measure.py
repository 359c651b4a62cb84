"""`cswap bench measure`: the planner's predictions on this device, then measured beside them.

For each model, in one process:

1. **Profile.** This device's profile of the step without offload (``planning/capture.py``),
   written as ``profile-<model>-<device>.json.gz`` (the schema the H100 profiles have).
2. **Predict.** The replay of that profile with this device's link: no offload, activation
   checkpointing of every block, and the planner's mix (``planning/mix.py``) at 85% and 50% of
   the measured no-offload peak and at checkpointing's measured peak.
3. **Measure**, interleaved (one step of each method per round, the order rotated each round):
   no offload, checkpointing, the engine at each budget (``plan="auto"``, recomputation on,
   the model watched: the engine measures, plans and checks on its own; its rows are
   predicted by its own replay of its measured step, for the plan it ran, and the planner's
   mix from the captured profile is shown beside), the default engine on a run that fits,
   every block recomputed by the engine and nothing moved (checkpointing's memory) as the
   device runs it by default (on the CPU first without autograd, ``core/lean.py``; on CUDA
   under checkpoint, ``Verdicts.whole``) and with first runs without autograd (what they
   gain or lose there), and every tensor swapped through
   int8 (``plan="int8"``), predicted at the int8 kernels' speeds measured on the H200
   (``planning/sizing.LOSSY_SPEEDS``): what tells whether the replay should charge a
   codec's encoding to the link, as it does, or to the compute stream.

Every method trains its own copy of the model (the engine's recomputation wraps a model's
blocks, one engine a model), so the allocator holds the other copies' weights beside each step:
a step's peak is reported as the allocator's peak above the step's start plus the start of one
model alone (its weights and batch, as the profile measured it), and each engine's budget is
given that much more (what the other copies hold), so that it plans for one model's step. The
step is forward and backward (no optimizer: the profile and the replay time the same). Step
times are medians of the timed rounds, device time between events around the step.

On the CPU it runs the small models as a dry run of the code path: the figures mean nothing
(no allocator, one thread) and the result is labelled so.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import gzip
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..config import INFLIGHT_CHOICES, CSwapConfig
from ..core.engine import Offloader
from ..core.recompute import outermost
from ..planning import mix
from ..planning.capture import capture
from ..planning.devices import DEVICES
from ..planning.profiled import unit_candidates
from ..planning.profiler import measure_link
from ..planning.replay import (
    CODEC_KERNELS,
    KEEP,
    BlockDecision,
    Engine,
    Mix,
    checkpoint_all,
    predict,
)
from ..planning.sizing import LOSSY_SPEEDS, lossy_codec
from ..planning.workload import from_profile
from .bench_step import device_name, result_meta, write_results
from .suite_cases import Checkpointed, checkpoint_blocks, hf_checkpointing, llama_config
from .suite_cases import ModelCase as Model
from .suite_cases import workload as model_workload
from .traced import trace_path, traced_step

LEVELS = (0.85, 0.5)
INT8_ALL = "cswap int8, every tensor swapped"
# Checkpointing's memory, the engine's recomputation as the device runs it by default (on
# CUDA under checkpoint, ``Verdicts.whole``), and with its first runs without autograd
RECOMPUTE_ALL = "cswap, every block recomputed"
RECOMPUTE_ALL_LEAN = "cswap, every block recomputed, first runs without autograd"
# The models of the first H100 run at their profiled sizes, and a Llama-3-8B layer stack.
BATCH = {"gpt2-medium": 8, "resnet50": 128, "bert-large": 16, "vgg16": 64}


@dataclass
class Method:
    """One method's model, the context around its forward, and its timed steps."""

    name: str
    model: nn.Module
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    offloader: Offloader | None = None
    budget_bytes: int | None = None  # one model's budget (the engine gets the others' more)
    steps: list[Timed] = field(default_factory=list)
    warmup: int = 0
    settled: bool = True
    held_bytes: int = 0  # device memory its engine holds between steps, once settled


def _spec(key: str, small: bool) -> Model:
    """The model as the first H100 run profiled it: torchvision's CNNs where torchvision
    imports (their module names are the profiles'), else the package's own."""
    spec = model_workload(key, small)
    if key in ("resnet50", "vgg16") and not small and importlib.util.find_spec("torchvision"):
        import torchvision

        spec = replace(spec, build=getattr(torchvision.models, key))
    return spec


def _checkpointed(model: nn.Module, hf: bool) -> nn.Module:
    """Every block under activation checkpointing: a transformers model's layers (its own
    switch), a torchvision ResNet's bottlenecks, a VGG's stages (up to each max-pool)."""
    if hf:
        hf_checkpointing(model, offload=False)
    elif hasattr(model, "layer4"):
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, nn.Sequential(*map(Checkpointed, getattr(model, name))))
    elif hasattr(model, "features"):
        model.features = checkpoint_blocks(model.features)
    else:
        model = checkpoint_blocks(model)
    return model


def _bf16_batch(batch):
    if isinstance(batch, dict):
        return {k: _bf16_batch(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_bf16_batch(v) for v in batch)
    return batch.to(torch.bfloat16) if batch.is_floating_point() else batch


class Timed(NamedTuple):
    """One timed step: device milliseconds of the step and of its forward, the peak as one
    model's (the module docstring), the allocator's bytes at its start, and the host's
    milliseconds until its last kernel was queued and until forward returned (on the CPU, the
    step's; on CUDA, near the device's time where the host set the pace or waited for the
    device: the in-flight bound, the allocator; a traced step tells which). On CUDA also the
    caching allocator's calls to the driver in the step (``cudaMalloc``s, and retries after
    freeing its cache, which synchronize the device): either stalls the host."""

    step_ms: float
    forward_ms: float
    peak: int
    before: int
    host_step_ms: float
    host_forward_ms: float
    device_mallocs: int = 0
    alloc_retries: int = 0
    forward_wait_ms: float = 0.0  # an engine's own waits (its last closed step's)
    backward_wait_ms: float = 0.0
    # device milliseconds until the method's context was entered: the host's work there,
    # the device idle (each timed step starts synchronized)
    enter_ms: float = 0.0


_DRIVER_CALLS = ("num_device_alloc", "num_alloc_retries")


def _step(m: Method, spec: Model, batch, dev: torch.device, own_start: int) -> Timed:
    """One forward and backward of ``m``, timed."""
    cuda = dev.type == "cuda"
    peak = before = 0
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        stats = torch.cuda.memory_stats(dev)
        calls = [stats[key] for key in _DRIVER_CALLS]
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        marks[0].record()
    began = time.perf_counter()
    with m.context():
        if cuda:
            marks[3].record()
        loss = spec.loss(m.model, batch)
    if cuda:
        marks[1].record()
    forward = time.perf_counter()
    loss.backward()
    del loss
    m.model.zero_grad(set_to_none=True)
    if cuda:
        marks[2].record()
    end = time.perf_counter()
    host = 1e3 * (end - began), 1e3 * (forward - began)
    waits = (0.0, 0.0)
    if m.offloader is not None:  # the host's clock: forward at the in-flight bound, backward
        last = m.offloader.last_step()  # for restores
        waits = 1e3 * last.forward_wait_s, 1e3 * last.wait_s
    if not cuda:
        return Timed(*host, peak, before, *host, 0, 0, *waits)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before + own_start
    stats = torch.cuda.memory_stats(dev)
    driver = (stats[key] - c for key, c in zip(_DRIVER_CALLS, calls, strict=True))
    return Timed(marks[0].elapsed_time(marks[2]), marks[0].elapsed_time(marks[1]), peak,
                 before, *host, *driver, *waits, marks[0].elapsed_time(marks[3]))


def _settle(m: Method, spec: Model, batch, dev: torch.device, own_start: int,
            most: int = 16) -> None:
    """Run an engine's steps until its plan is checked and the same two steps in a row (its
    measured steps, its planning and the step that checks the plan come first); a fixed
    plan's, its measured steps and two more (recomputed blocks are watched on the first)."""
    if m.offloader is None or m.offloader.config.plan != "auto":  # nothing to plan
        m.warmup = 2 + (m.offloader.config.profile_steps if m.offloader is not None else 0)
        for _ in range(m.warmup):
            _step(m, spec, batch, dev, own_start)
        return
    cuda = dev.type == "cuda"
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    previous = None
    m.warmup, m.settled = most, False
    for n in range(1, most + 1):
        _step(m, spec, batch, dev, own_start)
        plan = m.offloader.plan
        checked = plan is not None and getattr(plan, "measured_peak", None) is not None
        if checked and plan is previous:
            m.warmup, m.settled = n, True
            break
        previous = plan
    if cuda:
        m.held_bytes = torch.cuda.memory_allocated(dev) - before


def _engine_summary(m: Method) -> dict:
    """What the engine decided and predicted for itself (its own replay of its measured
    step; its figures count the other copies' weights, taken off here)."""
    off = m.offloader
    out: dict = {"warmup_steps": m.warmup, "settled": m.settled,
                 "held_between_steps_bytes": m.held_bytes}
    choice = off.recomputation
    if choice is not None:
        p = choice.mix.prediction
        out |= {"engine_how": choice.mix.how, "engine_recomputed": len(choice.names),
                "engine_predicted_step_s": p.step_s - p.optimizer_s,
                "engine_predicted_peak_raw": p.peak_bytes, "engine_fits": choice.mix.fits,
                "engine_predicted_host_bytes": p.host_bytes}
    last = off.last_step()
    out |= {"offloaded_bytes": last.offloaded_bytes, "stored_bytes": last.stored_bytes,
            "hooks_off": bool(getattr(last, "hooks_off", False)),
            "moved_sites": sum(s.decision not in ("keep", "dedup") for s in last.sites),
            "recomputed_blocks": len(off.recomputed),
            "first_runs_without_autograd": sum(
                why == "" for why in off.recomputer.verdicts.why.values())}
    # its step timed without hooks (CUDA), what it scaled its own by; and the host's windows
    # of its measured steps (hooks left out), which its plain forward's host time checks
    learned = off.learning
    out |= {"engine_plain_forward_s": learned.plain_forward_s,
            "engine_plain_backward_s": learned.plain_backward_s,
            "engine_plain_host_forward_s": learned.plain_host_forward_s,
            "engine_host_windows_s": sum(p.host_s for p in learned.profiler.profile())}
    memory = off.transfer.host_memory
    arena = memory.report() if memory is not None else None  # None: no arena planned
    out["host_arena"] = None if arena is None else {
        "hits": arena.hits, "own_memory": sum(arena.fallbacks.values()),
        "why": dict(arena.fallbacks), "bytes": arena.arena_bytes}
    plan = off.plan
    if plan is not None and hasattr(plan, "table"):
        out["plan_table"] = plan.table()
        out["engine_beside_bytes_raw"] = getattr(plan, "base_bytes", None)
    return out


def run_model(key: str, dev: torch.device, out_dir: Path, rounds: int, small: bool,
              log: Callable[[str], None] = print, traces: Path | None = None) -> dict:
    """One model: profile, predictions, interleaved measurements (module docstring);
    ``traces``: a folder where one more step of each method is traced (``traced_step``)."""
    spec = _spec(key, small)
    batch_size = spec.batch_size if small else BATCH.get(key, spec.batch_size)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    began = time.monotonic()
    base = spec.build().to(dev, dtype).train()
    batch = spec.make_batch(batch_size, dev)
    if dtype == torch.bfloat16:
        batch = _bf16_batch(batch)
    name = f"{key}-b{batch_size}"
    profile = capture(base, lambda: spec.loss(base, batch), name, log=log)
    gpu = device_name(dev).split()[1].lower() if dev.type == "cuda" else "cpu"
    path = out_dir / f"profile-{key}-{gpu}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(profile, f)
    log(f"{key}: profile written to {path} ({time.monotonic() - began:.0f} s)")
    own_start = profile["allocated_before_step"]
    keep_peak = profile["peak_allocated"] or 1 << 30  # the CPU has no allocator peak

    # the methods, each on its own copy; the checkpointed one measured first for its peak
    copies: dict[str, nn.Module] = {}

    def clone() -> nn.Module:
        return copy.deepcopy(base)

    methods = [Method("no offload", base)]
    ckpt = _checkpointed(clone(), spec.hf)
    methods.append(Method("checkpointing", ckpt))
    ckpt_peak = max(_step(methods[1], spec, batch, dev, own_start).peak for _ in range(2))
    budgets = [(f"{level:.0%} of no offload", int(level * keep_peak)) for level in LEVELS]
    budgets.append(("checkpointing's peak", ckpt_peak or keep_peak // 3))
    engines = [(f"cswap, budget {label}", b) for label, b in budgets] + [
        ("cswap default (fits)", None)]
    for label, b in engines:
        model = copies[label] = clone()
        methods.append(Method(label, model, budget_bytes=b))
    methods.append(Method(RECOMPUTE_ALL, clone()))
    methods.append(Method(RECOMPUTE_ALL_LEAN, clone()))
    methods.append(Method(INT8_ALL, clone()))
    # what the other copies hold beside one model's step
    others = (torch.cuda.memory_allocated(dev) - own_start) if dev.type == "cuda" else 0
    for m in methods[2:]:
        budget = "auto" if m.budget_bytes is None else m.budget_bytes + others
        recomputes = m.name in (RECOMPUTE_ALL, RECOMPUTE_ALL_LEAN)
        config = (CSwapConfig(plan="int8") if m.name == INT8_ALL else
                  CSwapConfig(plan="keep", budget=None) if recomputes else
                  CSwapConfig(budget=budget))
        m.offloader = Offloader(config).watch(m.model)
        m.context = (lambda off=m.offloader: off)
        if recomputes:
            m.offloader.recompute(outermost(m.offloader.recomputer.units()))
        if m.name == RECOMPUTE_ALL_LEAN:
            m.offloader.recomputer.verdicts.whole.add(dev.type)

    # predictions from this device's profile
    link = measure_link(dev)
    w = from_profile(profile)
    replay_engine = Engine()
    rows: dict[str, dict] = {}
    keep = predict(w, link=link, engine=replay_engine)
    rows["no offload"] = {"predicted_step_s": keep.step_s - keep.optimizer_s,
                          "predicted_peak": keep.peak_bytes}
    ck = predict(w, checkpoint_all(), link=link, engine=replay_engine)
    rows["checkpointing"] = {"predicted_step_s": ck.step_s - ck.optimizer_s,
                             "predicted_peak": ck.peak_bytes}
    rows[RECOMPUTE_ALL] = dict(rows["checkpointing"])
    rows[RECOMPUTE_ALL_LEAN] = dict(rows["checkpointing"])
    for label, b in engines:
        if b is None:
            rows[label] = {"predicted_step_s": rows["no offload"]["predicted_step_s"],
                           "predicted_peak": keep.peak_bytes, "budget_bytes": None}
            continue
        planned = time.monotonic()
        _, chosen = mix.choose_among(unit_candidates(w), b, link, replay_engine,
                                     inflight_choices=INFLIGHT_CHOICES)
        p = chosen.prediction
        rows[label] = {"predicted_step_s": p.step_s - p.optimizer_s,
                       "predicted_peak": p.peak_bytes, "budget_bytes": b,
                       "predicted_host_bytes": p.host_bytes,
                       "planner_how": chosen.how, "planner_fits": chosen.fits,
                       "planning_s": time.monotonic() - planned}
        log(f"{key}: {label}: planner {chosen.how} (predicted "
            f"{p.step_s / keep.step_s:.3f}x no offload)")

    int8 = lossy_codec("int8", DEVICES["h200"])  # the speeds measured there, unscaled
    swapped = Mix(KEEP, {b.name: BlockDecision("swap", int8(w, b)) for b in w.blocks})
    by_lane = {where: predict(w, swapped, link=link,
                              engine=replace(replay_engine, codec_kernels=where))
               for where in CODEC_KERNELS}
    p = by_lane[replay_engine.codec_kernels]
    rows[INT8_ALL] = {"predicted_step_s": p.step_s - p.optimizer_s,
                      "predicted_peak": p.peak_bytes, "predicted_stored_bytes": p.d2h_bytes,
                      "predicted_step_s_by_codec_kernels": {
                          where: q.step_s - q.optimizer_s for where, q in by_lane.items()},
                      "int8_speeds": LOSSY_SPEEDS["int8"]}

    failed: dict[str, str] = {}

    def guarded(m: Method, run: Callable[[], object]) -> None:
        """A method that fails is reported and dropped; the others go on."""
        try:
            run()
        except Exception as err:  # noqa: BLE001
            failed[m.name] = f"{type(err).__name__}: {str(err)[:300]}"
            log(f"{key}: {m.name}: FAILED: {failed[m.name]}")
            methods.remove(m)
            if m.offloader is not None:
                with contextlib.suppress(Exception):
                    m.offloader.close()

    for m in methods[:]:  # each engine measures, plans and checks before the timed rounds
        settle_began = time.monotonic()
        guarded(m, lambda m=m: _settle(m, spec, batch, dev, own_start))
        log(f"{key}: {m.name}: ready after {m.warmup} steps "
            f"({time.monotonic() - settle_began:.1f} s){'' if m.settled else ', NOT settled'}")
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            guarded(m, lambda m=m: m.steps.append(_step(m, spec, batch, dev, own_start)))
    for m in methods if traces is not None else ():
        try:
            traced = traced_step(lambda m=m: _step(m, spec, batch, dev, own_start), dev,
                                 trace_path(traces, f"{key} {m.name}"))
        except Exception as err:  # noqa: BLE001 - the timed rounds stand without it
            rows[m.name]["trace_failed"] = f"{type(err).__name__}: {str(err)[:300]}"
            log(f"{key}: {m.name}: trace FAILED: {rows[m.name]['trace_failed']}")
            continue
        if traced is not None:
            rows[m.name] |= {"traced_kernels_s": traced.kernels_s,
                             "traced_copies_s": traced.copies_s}
    for name, reason in failed.items():
        rows[name] |= {"method": name, "failed": reason}

    for m in methods:
        row = rows[m.name]
        row |= {"method": m.name,
                "step_s": statistics.median(s.step_ms for s in m.steps) / 1e3,
                "forward_s": statistics.median(s.forward_ms for s in m.steps) / 1e3,
                "host_step_s": statistics.median(s.host_step_ms for s in m.steps) / 1e3,
                "host_forward_s": statistics.median(s.host_forward_ms for s in m.steps) / 1e3,
                "device_mallocs": sum(s.device_mallocs for s in m.steps),
                "alloc_retries": sum(s.alloc_retries for s in m.steps),
                "forward_wait_s": statistics.median(s.forward_wait_ms for s in m.steps) / 1e3,
                "backward_wait_s": statistics.median(s.backward_wait_ms for s in m.steps) / 1e3,
                "enter_s": statistics.median(s.enter_ms for s in m.steps) / 1e3,
                "peak_bytes": max(s.peak for s in m.steps), "timed_steps": len(m.steps),
                "allocated_at_start": statistics.median(s.before for s in m.steps)}
        if m.offloader is not None:
            row |= _engine_summary(m)
            for raw in ("engine_predicted_peak", "engine_beside_bytes"):
                if row.get(f"{raw}_raw") is not None:
                    row[raw] = row.pop(f"{raw}_raw") - others
            m.offloader.close()
    base_row = rows["no offload"]
    ck_row = rows["checkpointing"]
    for row in rows.values():
        if "step_s" not in row:
            continue
        row["time_vs_no_offload"] = row["step_s"] / base_row["step_s"]
        row["peak_vs_no_offload"] = row["peak_bytes"] / max(base_row["peak_bytes"], 1)
        row["throughput_vs_checkpointing"] = ck_row.get("step_s", float("nan")) / row["step_s"]
        # the prediction of what ran: the engine's own replay of its measured step for the
        # plan it chose, where it chose one; else the replay of the captured profile
        row["step_error"] = row.get("engine_predicted_step_s",
                                    row["predicted_step_s"]) / row["step_s"] - 1
        row["peak_error"] = row.get("engine_predicted_peak",
                                    row["predicted_peak"]) / max(row["peak_bytes"], 1) - 1
        b = row.get("budget_bytes")
        if b:
            row["within_budget"] = row["peak_bytes"] <= 1.03 * b
        if "predicted_step_s_by_codec_kernels" in row:
            row["nearest_codec_kernels"] = nearest(row["predicted_step_s_by_codec_kernels"],
                                                   row["step_s"])
    return {"model": key, "label": spec.label, "batch": batch_size, "shape": spec.shape,
            "dtype": str(dtype).removeprefix("torch."), "link": vars(link) | {},
            "others_bytes": others, "own_start_bytes": own_start,
            "profile": path.name, "rows": list(rows.values()),
            "seconds": time.monotonic() - began}


def link_check(dev: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """The pinned link each way alone, both ways at once (two streams), and device-to-host
    while bf16 matrix products run: the replay models the directions as independent and
    copies as free for compute; these say whether they are (GB/s, medians)."""
    if dev.type != "cuda":
        return {}
    src, back = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    host, host_in = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    streams = [torch.cuda.Stream(dev) for _ in range(2)]

    def timed(*work: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(dev)
            began = time.perf_counter()
            for stream, job in zip(streams, work, strict=False):
                with torch.cuda.stream(stream):
                    job()
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    out = {"d2h_alone": nbytes / timed(lambda: host.copy_(src, non_blocking=True)),
           "h2d_alone": nbytes / timed(lambda: back.copy_(host_in, non_blocking=True))}
    both = timed(lambda: host.copy_(src, non_blocking=True),
                 lambda: back.copy_(host_in, non_blocking=True))
    out["both_at_once_each"] = nbytes / both
    matmuls = 4
    compute = timed(lambda: [a @ a for _ in range(matmuls)])
    loaded = timed(lambda: [a @ a for _ in range(matmuls)],
                   lambda: host.copy_(src, non_blocking=True))
    out |= {"matmul_s": compute, "matmul_with_d2h_s": loaded,
            "d2h_under_matmul_lower_bound": nbytes / loaded}
    return {k: (v / 1e9 if not k.endswith("_s") else v) for k, v in out.items()}


def nearest(predicted: dict[str, float], measured: float) -> str:
    """The key of the prediction nearest ``measured`` (the first of equals): which of the
    replay's ways of placing a codec's kernels a measured step bears out."""
    return min(predicted, key=lambda k: abs(predicted[k] - measured))


def run_llama(dev: torch.device, out_dir: Path, small: bool,
              log: Callable[[str], None] = print) -> dict:
    """The profile of an LLM fine-tuning shape: Llama-3-8B's layer shapes (4 layers, random
    init), SDPA, sequence 4096, batch 1, bf16 (on the CPU a tiny one)."""
    from transformers import LlamaForCausalLM

    cfg, seq = llama_config(small)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    began = time.monotonic()
    with dev:
        model = LlamaForCausalLM(cfg).to(dtype).train()
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
    key = f"llama3-8b-4l-s{seq}-b1" if not small else f"llama-tiny-s{seq}-b1"
    profile = capture(model, lambda: model(input_ids=ids, labels=ids).loss, key, log=log)
    gpu = device_name(dev).split()[1].lower() if dev.type == "cuda" else "cpu"
    path = out_dir / f"profile-{key}-{gpu}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(profile, f)
    saved = sum(r["storage_nbytes"] for r in profile["saved"]
                if r["first_of_storage"] and not r["parameter"])
    in_layers = sum(r["storage_nbytes"] for r in profile["saved"]
                    if r["first_of_storage"] and not r["parameter"]
                    and ".layers." in r["module"])
    log(f"llama: profile written to {path} ({time.monotonic() - began:.0f} s)")
    return {"model": "llama", "profile": path.name, "seq": seq,
            "plain_forward_ms": profile["plain_forward_ms"],
            "plain_backward_ms": profile["plain_backward_ms"],
            "peak_bytes": profile["peak_allocated"], "saved_bytes": saved,
            "saved_kib_per_token_per_layer_in_leaf_modules":
                in_layers / seq / cfg.num_hidden_layers / 1024}


def markdown(results: list[dict], dev: torch.device) -> str:
    """One table: predicted beside measured, the error of each, and what the planner chose
    from the captured profile."""
    head = ("| model | method | budget | what ran | step (ms) predicted / measured | error | "
            "forward (ms) device / host | traced step: kernels / copies (ms) | "
            "cudaMalloc / retries in the timed steps | peak (GiB) predicted / measured | "
            "error | time vs no offload | peak vs no offload | throughput vs checkpointing | "
            "the planner on the profile |")
    lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for result in results:
        for r in result["rows"]:
            if "failed" in r:
                lines.append(f"| {result['label']} | {r['method']} | | FAILED: "
                             f"{r['failed'][:120]} | | | | | | | | | | | |")
                continue
            b = r.get("budget_bytes")
            budget = "" if not b else f"{b / 2**30:.2f} GiB" + (
                "" if r.get("within_budget", True) else " (OVER)")
            ran, step, peak, profiled = r["method"], r["predicted_step_s"], r["predicted_peak"], ""
            if "predicted_step_s_by_codec_kernels" in r:
                profiled = "the codec's kernels (replay.Engine.codec_kernels) " + ", ".join(
                    f"{where}: {1e3 * s:.1f} ms"
                    for where, s in r["predicted_step_s_by_codec_kernels"].items())
                if "nearest_codec_kernels" in r:
                    profiled += f"; the measurement nearest {r['nearest_codec_kernels']}"
            if "engine_predicted_step_s" in r:
                ran = r["engine_how"] + (", hooks off" if r.get("hooks_off") else "")
                waits = r.get("forward_wait_s", 0.0), r.get("backward_wait_s", 0.0)
                if max(waits) >= 1e-4:
                    ran += (f"; the host waited {1e3 * waits[0]:.1f} ms in forward, "
                            f"{1e3 * waits[1]:.1f} ms in backward")
                step, peak = r["engine_predicted_step_s"], r["engine_predicted_peak"]
                profiled = (f"{r['planner_how']}: {1e3 * r['predicted_step_s']:.1f} ms, "
                            f"{r['predicted_peak'] / 2**30:.2f} GiB" if "planner_how" in r
                            else "")
            if r.get("recomputed_blocks"):
                ran += (f"; {r['first_runs_without_autograd']} of {r['recomputed_blocks']} "
                        "recomputed blocks first without autograd")
            entered = r.get("enter_s", 0.0)  # the device idle while the engine's block began
            entered = f" (entered at {1e3 * entered:.1f})" if entered >= 1e-4 else ""
            traced = ("trace FAILED" if "trace_failed" in r else
                      f"{1e3 * r['traced_kernels_s']:.1f} / {1e3 * r['traced_copies_s']:.1f}"
                      if "traced_kernels_s" in r else "")
            lines.append(
                f"| {result['label']} | {r['method']} | {budget} | {ran} | "
                f"{1e3 * step:.1f} / {1e3 * r['step_s']:.1f} | "
                f"{100 * r['step_error']:+.0f}% | "
                f"{1e3 * r['forward_s']:.1f} / {1e3 * r['host_forward_s']:.1f}{entered} | "
                f"{traced} | {r['device_mallocs']} / {r['alloc_retries']} | "
                f"{peak / 2**30:.2f} / {r['peak_bytes'] / 2**30:.2f} | "
                f"{100 * r['peak_error']:+.0f}% | {r['time_vs_no_offload']:.3f}x | "
                f"{r['peak_vs_no_offload']:.0%} | {r['throughput_vs_checkpointing']:.2f}x | "
                f"{profiled} |")
    kind = ("measurement" if dev.type == "cuda" else
            "DRY RUN on the CPU: the figures mean nothing (no allocator, small models)")
    return (f"Kind: {kind}. Predicted: for no offload and checkpointing, the replay of this "
            "device's profile (captured in the same process) with this device's measured "
            "link; for the engine's rows, its own replay of its measured step for the plan it "
            "ran (`offloader.recomputation`), and in the last column what the planner chose "
            "from the captured profile at the same budget. Measured: median device time of "
            "forward and backward over the interleaved rounds, the host's time until forward "
            "returned beside the device's forward (near it, the host set the pace or waited "
            "for the device; where the method's block took 0.1 ms or more to enter, the "
            "device's time until then, idle: each timed step starts synchronized), the caching "
            "allocator's calls to the driver over the timed steps (each stalls the host; a "
            "retry synchronizes the device), and the "
            "allocator's peak as one model's (see "
            "`cswap_lightning/commands/bench_measure.py`).\n\n" + "\n".join(lines))


def run_measure_bench(models: list[str], out: str, rounds: int = 12,
                      device: str = "auto", trace: bool = False) -> list[dict]:
    """Each model profiled, predicted and measured; the result files rewritten after each.
    ``trace``: one more step of each method under torch.profiler, its table in
    ``OUT-traces/`` and the device's kernel and copy time in its row."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    small = dev.type != "cuda"
    out_dir = Path(out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    traces = Path(f"{out}-traces") if trace else None
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
    link = link_check(dev)
    print(f"link (GB/s; seconds for *_s): {link}", flush=True)
    for key in models:
        if dev.type == "cuda":  # the models before are gone: their memory back
            gc.collect()
            torch.cuda.empty_cache()
        try:
            results.append(run_llama(dev, out_dir, small) if key == "llama"
                           else run_model(key, dev, out_dir, rounds, small, traces=traces))
        except Exception as err:  # noqa: BLE001 - one model failing leaves the others' rows
            print(f"{key}: FAILED: {type(err).__name__}: {err}", flush=True)
            results.append({"model": key, "failed": f"{type(err).__name__}: {err}"})
        table = markdown([r for r in results if "rows" in r], dev)
        table += "".join(f"\n\nProfile {r['profile']}: plain forward "
                         f"{r['plain_forward_ms']:.1f} ms, "
                         f"backward {r['plain_backward_ms']:.1f} ms, peak "
                         f"{r['peak_bytes'] / 2**30:.2f} GiB, saved "
                         f"{r['saved_bytes'] / 2**30:.2f} GiB"
                         for r in results if r.get("model") == "llama" and "profile" in r)
        print(table, flush=True)
        meta = result_meta(dev, kind="measurement" if dev.type == "cuda" else "dry run",
                           rounds=rounds, link_gb_s=link)
        write_results(out, "cswap bench measure: predicted beside measured", meta,
                      {"results": results}, table)
    return results
