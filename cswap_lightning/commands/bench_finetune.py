"""`cswap bench finetune`: a transformer's fine-tuning step, measured on this GPU the ways a user
chooses between, for the setup `cswap plan` estimates.

The setup is `cswap plan`'s (a model name or ``config.json``, sequence, batch, LoRA or full
fine-tuning, bf16), its weights random and built on the device: nothing is downloaded. There is
one copy of the model (a 7-8B model leaves no room for a second), so the methods run one after
another on it, each warmed up, then timed:

- no offload, first and again last: the control (the two say how far a sequential comparison
  can be trusted on this machine);
- activation checkpointing of every layer, through the model's own switch (non-reentrant);
  with ``--peers``, transformers' built-in offload too (the layers' inputs in host memory),
  and torch's selective checkpointing (``suite_cases.sac_policy``: the outputs of matrix
  products and attention saved, the rest run again: torchtitan's ``op`` mode, the peer of
  recomputation below the layer);
- cswap (``plan="auto"``, the model watched: it measures, plans, checks its plan) by default
  (its budget what the device has free: where the step fits, the cost of a run that moves
  nothing), with the allocator's budget at checkpointing's measured peak, and at no offload's
  peak less 75% of the saved activations (counted in a step of its own: each storage autograd
  saved, the parameters apart); with ``--lossy``, at checkpointing's peak through that codec
  too; with ``--dense``, at the 75% budget with the lossless exponent codec weighed too.

Each timed step is forward and backward (no optimizer), device time between events, the
allocator's peak above the step's start plus what the model and batch held then. A method that
runs out of memory, or fails, is reported so and the others go on.

On the CPU (``--small``: a tiny model of the same kind) it is a dry run of the code path; its
figures mean nothing. `cswap plan` with the same arguments and this device gives the estimate
to set beside the measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from ..config import LOSSY_CODECS, CSwapConfig
from ..core.engine import Offloader
from ..hf_checkpointing import checkpointing_off
from ..planning import models
from ..planning.storages import FirstSaves
from ..records import fmt_bytes
from .args import whole
from .bench_measure import Method, _engine_summary, _settle, _step
from .bench_step import device_name, result_meta, write_results
from .suite_cases import hf_checkpointing

LOWER = 0.75  # the share of the saved activations the second budget frees
NO_OFFLOAD, NO_OFFLOAD_AGAIN = "no offload", "no offload, again (the control)"
CHECKPOINTING, HF_OFFLOAD = "activation checkpointing", "HF built-in offload"
SELECTIVE = "selective checkpointing (torch SAC: matmuls and attention saved)"
AT_CHECKPOINTING = "cswap, budget checkpointing's peak"
AT_LOWER = f"cswap, budget {LOWER:.0%} lower saved activations"
DEFAULT = "cswap default"  # its budget what the device has free: a run that fits moves nothing
# The tiny model of ``--small``: the same code path on the CPU
SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
SMALL_LAYERS = 2


def add_parser(bench_kinds) -> argparse.ArgumentParser:
    """Register ``cswap bench finetune`` under the ``bench`` subcommands."""
    p = bench_kinds.add_parser(
        "finetune", help="an LLM fine-tuning step on this GPU: no offload, checkpointing and "
        "cswap at checkpointing's peak and at 75%% fewer saved activations, measured (the "
        "setup `cswap plan` estimates)")
    p.add_argument("model", help=f"one of {', '.join(models.KNOWN)}, or a transformers "
                   "config.json (or its folder)")
    p.add_argument("--seq", type=whole(1), default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=whole(1), default=1, help="sequences per step")
    tuning = p.add_mutually_exclusive_group()
    tuning.add_argument("--lora", dest="lora", action="store_true",
                        help="LoRA (peft) on every linear layer but the head; the rest frozen")
    tuning.add_argument("--full", dest="lora", action="store_false",
                        help="full fine-tuning (the default)")
    tuning.add_argument("--qlora", action="store_true",
                        help="QLoRA: --lora with the base's linear layers in 4-bit NF4 "
                        "(bitsandbytes, double quantization)")
    p.add_argument("--layers", type=whole(1), default=None,
                   help="that many of the model's layers instead of its config's")
    p.add_argument("--steps", type=whole(1), default=5, help="timed steps per method")
    p.add_argument("--lossy", choices=LOSSY_CODECS, default=None,
                   help="also cswap at checkpointing's peak through this lossy codec")
    p.add_argument("--dense", action="store_true",
                   help="also cswap at 75%% fewer saved activations with the lossless exponent "
                   "codec weighed for bfloat16 tensors (CSwapConfig.dense_compressor)")
    p.add_argument("--peers", action="store_true",
                   help="also transformers' built-in offload (checkpointing, inputs on the "
                   "host) and torch's selective checkpointing (matmuls and attention saved)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a dry run)")
    p.add_argument("--small", action="store_true",
                   help="a tiny model of the same kind (the CPU's dry run)")
    p.add_argument("--out", required=True, help="write markdown and JSON results here (stem)")
    return p


def run_finetune(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Build the model on the device, run each method, write ``args.out``.md and .json."""
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cswap bench finetune: no CUDA device here; --device cpu --small runs "
                         "the code path on the CPU")
    began = time.monotonic()
    model, spec = _build(args, dev)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    batch = {"input_ids": ids, "labels": ids}
    loss = SimpleNamespace(loss=lambda net, b: net(**b).loss)  # what ``_step`` calls
    start = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    log(f"{spec.name}: built on {device_name(dev)} ({time.monotonic() - began:.0f} s); "
        f"{fmt_bytes(start)} allocated")

    rows: dict[str, dict] = {}
    setup = {"model": spec.name, "sequence": args.seq, "batch": args.batch,
             "tuning": _tuning(args), "dtype": str(_dtype(dev)),
             "saved_activations_bytes": None, "start_bytes": start}
    plan = (f"cswap plan {args.model} --seq {args.seq} --batch {args.batch} "
            f"--{_tuning(args).lower()}"
            + (f" --layers {args.layers}" if args.layers else ""))
    meta = result_meta(dev, kind="measurement" if dev.type == "cuda" and not args.small
                       else "dry run (CPU or a tiny model: the figures mean nothing)")

    def report(final: bool = False) -> None:
        """The result files with the rows so far (a run cut short keeps what it reached)."""
        _compare(rows, setup["saved_activations_bytes"])
        setup["seconds"] = time.monotonic() - began
        table = markdown(setup, list(rows.values()), plan)
        if final:
            print(table)
        write_results(args.out, f"cswap bench finetune: {spec.name}", meta,
                      {"setup": setup, "rows": list(rows.values()), "estimate_command": plan},
                      table, quiet=not final)

    def measure(name: str, method: Method, warm: Callable[[Method], None],
                cleanup: Callable[[], None] = lambda: None) -> None:
        """Warm ``method`` up, time it, keep its row; out of memory or failing, say so."""
        began = time.monotonic()
        try:
            warm(method)
            method.steps = [_step(method, loss, batch, dev, start) for _ in range(args.steps)]
            rows[name] = _row(method)
            log(f"{name}: {rows[name]['step_s'] * 1e3:.1f} ms, peak "
                f"{fmt_bytes(rows[name]['peak_bytes'])} ({time.monotonic() - began:.0f} s)")
        except torch.OutOfMemoryError:
            rows[name] = {"method": name, "failed": "out of memory"}
            log(f"{name}: out of memory")
        except Exception as err:  # noqa: BLE001 - the other methods go on
            rows[name] = {"method": name, "failed": f"{type(err).__name__}: {str(err)[:300]}"}
            log(f"{name}: FAILED: {rows[name]['failed']}")
        finally:
            if method.offloader is not None:
                with contextlib.suppress(Exception):
                    method.offloader.close()
            with contextlib.suppress(Exception):
                cleanup()
            method.steps = []
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            report()

    def warm(method: Method) -> None:
        _settle(method, loss, batch, dev, start)

    def checkpointed(offload: bool = False, selective: bool = False
                     ) -> Callable[[Method], None]:
        def switch_on_and_warm(method: Method) -> None:
            hf_checkpointing(model, offload=offload, selective=selective)
            warm(method)
        return switch_on_and_warm

    measure(NO_OFFLOAD, Method(NO_OFFLOAD, model), warm)
    keep_peak = rows[NO_OFFLOAD].get("peak_bytes")
    saved = setup["saved_activations_bytes"] = (
        _saved_bytes(model, batch) if keep_peak is not None else None)
    measure(CHECKPOINTING, Method(CHECKPOINTING, model), checkpointed(),
            lambda: checkpointing_off(model))
    if dev.type == "cuda":
        at_checkpointing = rows[CHECKPOINTING].get("peak_bytes")
        lower = None if saved is None else keep_peak - int(LOWER * saved)
    elif saved is not None:  # no allocator: the budget is the engine's saved tensors' (a dry run)
        at_checkpointing, lower = saved // 10, int((1 - LOWER) * saved)
    else:
        at_checkpointing = lower = None
    budgets = [(DEFAULT, "auto", {}), (AT_CHECKPOINTING, at_checkpointing, {}),
               (AT_LOWER, lower, {})]
    if args.lossy:
        budgets.append((f"cswap {args.lossy}, budget checkpointing's peak", at_checkpointing,
                        {"lossy": args.lossy}))
    if args.dense:
        budgets.append((f"cswap exponent, {AT_LOWER.removeprefix('cswap, ')}", lower,
                        {"dense_compressor": "exponent"}))
    for name, budget, settings in budgets:
        if budget is None:  # what it is set by did not run
            continue
        config = CSwapConfig(budget=budget, **settings,
                             **({"min_bytes": 0} if args.small else {}))  # tiny tensors too
        offloader = Offloader(config).watch(model)
        method = Method(name, model, lambda off=offloader: off, offloader,
                        budget_bytes=budget if budget != "auto" else None)
        measure(name, method, warm)
        if budget != "auto":
            rows[name]["budget_bytes"] = budget
    if args.peers:  # after cswap's: a run cut short keeps those first
        measure(HF_OFFLOAD, Method(HF_OFFLOAD, model), checkpointed(offload=True),
                lambda: checkpointing_off(model))
        measure(SELECTIVE, Method(SELECTIVE, model), checkpointed(selective=True),
                lambda: checkpointing_off(model))
    measure(NO_OFFLOAD_AGAIN, Method(NO_OFFLOAD_AGAIN, model), warm)
    report(final=True)
    return rows


def _tuning(args: argparse.Namespace) -> str:
    return "QLoRA" if args.qlora else "LoRA" if args.lora else "full"


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _build(args: argparse.Namespace, dev: torch.device) -> tuple[nn.Module, models.Model]:
    """The model of the setup, its weights random, made on ``dev`` in its dtype (a 7-8B model
    made on the host first would take minutes)."""
    lora = models.LoRA(quantized=args.qlora) if args.lora or args.qlora else None
    spec = models.model(args.model, lora=lora, layers=args.layers or (
        SMALL_LAYERS if args.small else None), overrides=SMALL if args.small else None)
    if not spec.sequence:
        raise SystemExit(f"cswap bench finetune: {args.model} is not a transformer; "
                         "`cswap bench measure` measures the CNNs")
    dtype, default = _dtype(dev), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            torch.manual_seed(0)
            model = spec.build(dtype)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).train(), spec


def _saved_bytes(model: nn.Module, batch: dict) -> int | None:
    """The bytes autograd saves in one forward, each storage once, the parameters apart (the
    activations a budget frees a share of); None where the step runs out of memory."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    firsts, sizes = FirstSaves(), []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and firsts.first(storage):
            sizes.append(storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
    except torch.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
    return sum(sizes)


def _row(m: Method) -> dict:
    """A method's medians over its timed steps (and its engine's decisions)."""
    steps = m.steps
    row = {"method": m.name, "timed_steps": len(steps), "warmup_steps": m.warmup,
           "step_s": statistics.median(s.step_ms for s in steps) / 1e3,
           "forward_s": statistics.median(s.forward_ms for s in steps) / 1e3,
           "host_forward_s": statistics.median(s.host_forward_ms for s in steps) / 1e3,
           "peak_bytes": max(s.peak for s in steps)}
    if m.offloader is not None:
        row |= {k: v for k, v in _engine_summary(m).items() if k != "plan_table"}
    return row


def _compare(rows: dict[str, dict], saved: int | None) -> None:
    """Each row's step time against no offload's, throughput against checkpointing's, and
    how much of the saved activations its peak is below no offload's (``saved``: their
    bytes)."""
    keep, keep_peak = rows[NO_OFFLOAD].get("step_s"), rows[NO_OFFLOAD].get("peak_bytes")
    ckpt = rows.get(CHECKPOINTING, {}).get("step_s")
    for row in rows.values():
        if "step_s" not in row:
            continue
        if keep:
            row["time_vs_no_offload"] = row["step_s"] / keep
        if ckpt:
            row["throughput_vs_checkpointing"] = ckpt / row["step_s"]
        if saved and keep_peak:
            row["saved_activations_lower"] = (keep_peak - row["peak_bytes"]) / saved


def markdown(setup: dict, rows: list[dict], plan: str) -> str:
    saved = setup["saved_activations_bytes"]
    saved = "not counted (no offload did not run)" if saved is None else fmt_bytes(saved)
    lines = [
        (f"{setup['model']}, {setup['tuning']} fine-tuning, sequence {setup['sequence']}, batch "
         f"{setup['batch']}, {setup['dtype'].removeprefix('torch.')}, random weights. Saved "
         f"activations {saved} (each storage autograd saved, once, the "
         f"parameters apart); the model and batch held {fmt_bytes(setup['start_bytes'])} at "
         "a step's start. The methods ran one after another on one copy of the model; no "
         "offload ran first and again last (the control). A step is forward and backward, "
         "device time; peak: the allocator's. The estimate of the same setup: "
         f"`{plan} --device DEVICE`."), "",
        ("| method | budget | what ran | step (ms) | vs no offload | throughput vs "
         "checkpointing | peak | saved activations lower | forward: device / host (ms) | "
         "warm-up steps |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        budget = fmt_bytes(r["budget_bytes"]) if r.get("budget_bytes") else ""
        if "failed" in r:
            lines.append(f"| {r['method']} | {budget} | {r['failed']} | | | | | | | |")
            continue
        lower = (f"{r['saved_activations_lower']:.0%}" if "saved_activations_lower" in r
                 else "")
        ran = r.get("engine_how") or r["method"]
        if r.get("engine_how"):
            ran += (f" ({r['recomputed_blocks']} blocks recomputed, "
                    f"{fmt_bytes(r['offloaded_bytes'])} moved a step")
            ran += "" if r.get("settled", True) else ", NOT settled"
            ran += ")"
        lines.append(
            f"| {r['method']} | {budget} | {ran} | {r['step_s'] * 1e3:.1f} | "
            f"{r.get('time_vs_no_offload', float('nan')):.3f}x | "
            f"{r.get('throughput_vs_checkpointing', float('nan')):.3f}x | "
            f"{fmt_bytes(r['peak_bytes'])} | {lower} | {r['forward_s'] * 1e3:.1f} / "
            f"{r['host_forward_s'] * 1e3:.1f} | {r['warmup_steps']} |")
    return "\n".join(lines) + "\n"
