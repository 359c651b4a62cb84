"""Measuring ``cswap bench suite``'s runs: one training step, one method at one batch size,
the largest batch that fits, and every run on one model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..records import fmt_bytes
from .suite_cases import (
    BUDGETED,
    CHECKPOINTING,
    HF_OFFLOAD,
    MAX_BATCH_METHODS,
    METHODS,
    NO_OFFLOAD,
    SAVE_ON_CPU,
    TORCHTUNE,
    Method,
    ModelCase,
    Skip,
)
from .suite_ledger import DeviceLedger, HookTap
from .suite_report import goals, run_label, verdict


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


def _step(m: Method, wl: ModelCase, optimizer, batch, dev: torch.device,
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
        m = Method(method, wl, model, budget_bytes, s.min_bytes, s.prefetch_bytes)
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
    row["label"] = run_label(row)
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
