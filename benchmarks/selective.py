"""Recomputation below the layer, measured with the engine's ledger (and on CUDA the
allocator's peak): what one Llama-3-8B layer (hidden 4096, MLP 14336, 32 heads, 8 key/value
heads; bf16; SDPA; random init) saves per token, what it keeps recomputed below the layer (its
input, the outputs of its matmuls and attention) and recomputed whole (its input); the step's
time each way, and whether each way's gradients are bitwise plain training's (beside plain
against plain, the control); beside the estimate's figures for an H100 PCIe.

    .venv/bin/python benchmarks/selective.py --out benchmarks/results/selective-cpu-...
    python3 benchmarks/selective.py --device cuda --layers 4 --seq 4096 --out ...  # a GPU

writes ``OUT.md`` and ``OUT.json``. A CPU's times say what recomputing costs on that CPU
only (its elementwise kernels are slow beside its matmuls in a different way than a GPU's).
On CUDA the steps compared bit for bit run deterministic kernels (``deterministic``), the
timed ones the default kernels, and plain against plain says whether the comparison can
hold.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import transformers

import cswap_lightning as cswap
from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.commands.traced import trace_path, traced_step
from cswap_lightning.core.recompute import below, units
from cswap_lightning.planning import models, sizing
from cswap_lightning.planning.dataflow import WEIGHTS
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import Setup, estimate

KiB = 1024


def llama(layers: int, narrow: int = 1) -> transformers.PreTrainedModel:
    """Llama-3-8B's layers, ``narrow`` times narrower (hidden size, MLP and heads; the head
    dimension as it is)."""
    config = {k: v for k, v in models.KNOWN["llama-3-8b"].items() if k != "model_type"}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads"):
        if config[key] % narrow:
            raise ValueError(f"--narrow {narrow} does not divide {key} ({config[key]}): "
                             "use 1, 2, 4 or 8")
        config[key] //= narrow
    # the head apart; no key/value cache, as in fine-tuning (Hugging Face's default keeps one
    # in training too: each layer would copy its keys and values into it)
    config |= {"num_hidden_layers": layers, "vocab_size": 1024, "use_cache": False}
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)


def own_bytes(stats: cswap.StepStats, first: int, stop: int) -> int:
    """The saved activations of sites ``first`` to ``stop``, each storage once."""
    return sum(s.nbytes for s in stats.sites[first:stop]
               if s.decision != "dedup" and s.reason in ("", "plan", "small"))


@contextlib.contextmanager
def deterministic(dev: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the steps compared bit for bit (strict: with
    ``warn_only`` cuDNN's attention backward stayed non-deterministic on an H100); the timed
    steps run the default kernels, as training does."""
    if dev.type != "cuda":
        yield
        return
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = False
        torch.use_deterministic_algorithms(False)


def measure(layers: int, sequence: int, repeats: int, dev: torch.device,
            profiles: Path | None = None, memory: Path | None = None, narrow: int = 1) -> dict:
    """Plain, below the layer and whole, each measured (``profiles``: a folder where each
    way's profiled step is written too; ``memory``: one where, on CUDA, what one more step of
    each way held at the allocator's peak is written, ``live_at_peak``)."""
    model = llama(layers, narrow).to(dev)
    ids = torch.randint(0, 1024, (1, sequence), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    off = cswap.Offloader(cswap.CSwapConfig(plan="keep", min_bytes=0, profile_steps=1,
                                            budget=None)).watch(model)
    names = [n for n in units(model) if n.count(".") == 2]  # the layers
    off.recomputer.verdicts.whole.add(dev.type)  # whole layers too, to compare (not by default)

    cuda = dev.type == "cuda"
    grads: list[torch.Tensor] = []

    def step(split: list | None = None) -> tuple[cswap.StepStats, float]:
        """One step, its seconds (``split``: appended, the host's forward, the forward to
        the device's end, and the backward's seconds, the device waited for in between)."""
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        started = time.perf_counter()
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        if split is not None:
            host = time.perf_counter()
            if cuda:
                torch.cuda.synchronize(dev)
            forward = time.perf_counter()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - started
        if split is not None:
            split.append((host - started, forward - started, started + seconds - forward))
        grads[:] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return off.last_step(), seconds

    def bitwise(reference: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))

    with deterministic(dev):
        plain, _ = step()  # measured: each layer's call, and what it would keep below it
        step()  # its block calls are read as this one starts
    reference = list(grads)
    calls = [c for c in off.block_calls if c.name in names]
    ways: dict[str, dict] = {}
    layers_below = list(below(units(model)))
    heaviest = WEIGHTS[-1]  # the way below the layer that keeps the most to run the least
    for way, chosen, weight, lean in (
            ("plain", [], 0.0, True), ("below the layer", layers_below, 0.0, True),
            (f"below the layer, weight {heaviest:g}", layers_below, heaviest, True),
            ("whole", names, 0.0, True),
            ("below the layer, under checkpoint", layers_below, 0.0, False),
            ("whole, under checkpoint", names, 0.0, False)):
        off.recomputer.verdicts.on = lean  # without: every first run under checkpoint
        off.recompute(chosen, dict.fromkeys(chosen, weight) if weight else None)
        with deterministic(dev):
            # watched under checkpoint, then (below the layer) its choice settled: the layers
            # run first without autograd from the next step on (``core/lean.py``)
            step()
            step()
            stats, _ = step()
        same = bitwise(reference)  # plain: against its own earlier step (the control)
        seconds = statistics.median(step()[1] for _ in range(repeats))
        split: list[tuple[float, float, float]] = []
        for _ in range(repeats):
            step(split)
        host, forward, backward = (statistics.median(s) for s in zip(*split, strict=True))
        allocated = torch.cuda.max_memory_allocated(dev) if cuda else None  # the last step's
        busy = None
        if profiles is not None:
            traced = traced_step(step, dev, trace_path(profiles, f"profile {way}"))
            busy = None if traced is None else traced.kernels_s + traced.copies_s
            host_functions(step, trace_path(profiles, f"host {way}"))
        if memory is not None and cuda:
            path = trace_path(memory, f"memory {way}")
            try:
                live_at_peak(step, dev, path)
            except (RuntimeError, KeyError, TypeError) as e:  # a diagnostic: measuring goes on
                path.write_text(f"not recorded: {e!r}\n")
        if not chosen:
            stats = plain  # the measured step's rows
        ways[way] = {"sites": len(stats.sites), "peak_resident_bytes": stats.peak_resident_bytes,
                     "peak_bytes": stats.peak_bytes, "allocator_peak_bytes": allocated,
                     "bitwise_with_plain": same, "step_s": seconds, "device_busy_s": busy,
                     "forward_host_s": host, "forward_s": forward, "backward_s": backward}
    off.close()
    tokens = sequence
    call = calls[-1]
    fewest = call.below[0]  # the way recomputed here (weight 0)
    per_layer = {
        "saves_kib_per_token": own_bytes(plain, call.first_site, call.stop_site) / tokens / KiB,
        "below_keeps_kib_per_token": sum(fewest.kept) / tokens / KiB,
        "whole_keeps_kib_per_token": call.input_bytes / tokens / KiB,
        "kept_outputs_kib_per_token": [round(n / tokens / KiB, 2) for n in fewest.kept[1:]],
        "forward_s": call.forward_s, "elementwise_s": fewest.seconds}
    freed = (ways["plain"]["peak_resident_bytes"]
             - ways["below the layer"]["peak_resident_bytes"]) / layers / tokens / KiB
    layer = sizing.first_layer(estimate(Setup("llama-3-8b", 8192, 1),
                                        device("h100-pcie")))
    h100 = {"saves_kib_per_token": layer.saved_kib, "below_keeps_kib_per_token": layer.below_kib,
            "below_ms": 1e3 * layer.below_s, "forward_ms": 1e3 * layer.forward_s}
    return {"layers": layers, "sequence": sequence, "narrow": narrow, "per_layer": per_layer,
            "ledger_freed_kib_per_token_per_layer": freed, "ways": ways, "device": str(dev),
            "estimate_h100_pcie_s8192": h100}


def host_functions(step: Callable[[], object], path: Path, steps: int = 3) -> None:
    """``steps`` more steps under cProfile: the Python functions the host spent most time in
    (their own time, per step), what a host-bound step is made of."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(f"{steps} steps under cProfile, own time first\n{text.getvalue()}")


def live_at_peak(step: Callable[[], object], dev: torch.device, path: Path) -> None:
    """One more step with the allocator's history recorded: what was allocated at its peak,
    by the innermost Python frame outside torch that allocated it, largest first."""
    torch.cuda.synchronize(dev)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=dev)
    try:
        step()
        traces = torch.cuda.memory._snapshot(dev)["device_traces"][dev.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=dev)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in traces:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocated_by(event.get("frames", ())))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        entry = by.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    lines = [f"allocated at the peak (of this step's allocations): {peak / 2**20:.1f} MiB"]
    lines += [f"{size / 2**20:10.1f} MiB {count:5d}  {where}"
              for where, (size, count) in sorted(by.items(), key=lambda kv: -kv[1][0])[:30]]
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n")


def _allocated_by(frames: Sequence[dict]) -> str:
    """The innermost frames outside torch's own files (two, innermost first)."""
    ours = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
            if "/torch/" not in f["filename"] and f["filename"].endswith(".py")]
    return " < ".join(ours[:2]) or "?"


TITLE = "Recomputation below the layer: one Llama-3-8B layer"


def markdown(r: dict) -> str:
    p, h = r["per_layer"], r["estimate_h100_pcie_s8192"]
    plain = r["ways"]["plain"]["step_s"]
    where = "CPU" if r["device"] == "cpu" else "GPU"
    shapes = ("Llama-3-8B's layer shapes" if r.get("narrow", 1) == 1 else
              f"Llama-3-8B's layers {r['narrow']} times narrower (not the estimate's shapes)")
    lines = [(f"{shapes}, {r['layers']} layers, sequence {r['sequence']}, "
              f"batch 1, bf16, SDPA, random init, transformers {transformers.__version__}, "
              "plan keep (the ledger counts every saved tensor the engine's hooks see)."), "",
             f"| per layer, per token | measured ({where}) | estimated (H100 PCIe, s8192) |",
             "|---|---:|---:|",
             (f"| saved plainly | {p['saves_kib_per_token']:.1f} KiB | "
             f"{h['saves_kib_per_token']:.1f} KiB |"),
             (f"| kept below the layer (input + the fewest bytes that make what backward reads) | "
             f"{p['below_keeps_kib_per_token']:.1f} KiB | {h['below_keeps_kib_per_token']:.1f} "
             "KiB |"),
             f"| kept recomputed whole (input) | {p['whole_keeps_kib_per_token']:.1f} KiB | |",
             (f"| ledger's peak, lower per layer below the layer | "
             f"{r['ledger_freed_kib_per_token_per_layer']:.1f} KiB | |"),
             (f"| recomputation's cost below the layer / whole (share of the forward) | "
             f"{p['elementwise_s'] / p['forward_s']:.0%} (block timer, {where}) | "
             f"{h['below_ms'] / h['forward_ms']:.0%} ({h['below_ms']:.2f} of "
             f"{h['forward_ms']:.2f} ms) |"), "",
             f"Kept outputs, KiB per token: {p['kept_outputs_kib_per_token']}", "",
             ("| way | sites | ledger's peak (saved tensors) | with what backward holds again "
              f"| allocator's peak | step on this {where} | vs plain | kernels (profiled step) "
              "| forward: host, to its end | backward | gradients bitwise |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for way, m in r["ways"].items():
        allocated = ("-" if m["allocator_peak_bytes"] is None
                     else f"{m['allocator_peak_bytes'] / 2**20:.1f} MiB")
        busy = m.get("device_busy_s")
        kernels = "-" if busy is None else f"{1e3 * busy:.1f} ms"
        lines.append(f"| {way} | {m['sites']} | {m['peak_resident_bytes'] / 2**20:.1f} MiB | "
                     f"{m['peak_bytes'] / 2**20:.1f} MiB | {allocated} | "
                     f"{1e3 * m['step_s']:.1f} ms | {m['step_s'] / plain:.3f}x | {kernels} | "
                     f"{1e3 * m['forward_host_s']:.1f}, {1e3 * m['forward_s']:.1f} ms | "
                     f"{1e3 * m['backward_s']:.1f} ms | "
                     f"{'yes' if m['bitwise_with_plain'] else 'NO'} |")
    lines += ["", ("The ledger's peak is the step's saved tensors on the device at once "
              "(`StepStats.peak_resident_bytes`); beside it, with what a recomputed layer "
              "saves again while backward runs it (`StepStats.peak_bytes`); on CUDA the "
              "allocator's peak of the way's last timed step. Gradients bitwise: the way's third "
              "step (the first without autograd, `core/lean.py`) against plain training's "
              "(plain: against its own earlier step, the control); the timed steps follow "
              "it. Kernels: the seconds the GPU ran kernels in one more step under "
              "torch.profiler (`--profile`; its table beside the results), to set beside the "
              "step's time. Step times are medians of the repeats on this machine; the "
              "forward's and backward's of as many more, the device waited for between them "
              "(host: until the forward returned). Under checkpoint: first runs without "
              "autograd off (`Verdicts.on`), every recomputed layer's forward under "
              "checkpoint, as before `core/lean.py`"
              + (", a shared 2-core CPU under other load: they say what recomputing costs "
                 "here only." if where == "CPU" else "."))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--narrow", type=int, default=1,
                   help="divide the layers' hidden size, MLP and heads by this (1, 2, 4 or 8): "
                        "a quick run where bfloat16 matmuls are slow (CPUs without bfloat16 "
                        "instructions take seconds for one layer's weight gradients)")
    p.add_argument("--profile", action="store_true",
                   help="one more step of each way under torch.profiler: its table beside OUT "
                        "(OUT-profiles/profile-WAY.txt) and, on CUDA, the seconds the device "
                        "ran kernels; and three under cProfile (OUT-profiles/host-WAY.txt)")
    p.add_argument("--memory", action="store_true",
                   help="on CUDA, one more step of each way with the allocator's history: what "
                        "was allocated at its peak, by where (OUT-memory/memory-WAY.txt)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    profiles = None
    if args.profile:
        profiles = Path(f"{args.out}-profiles")
        profiles.mkdir(parents=True, exist_ok=True)
    memory = None
    if args.memory:
        memory = Path(f"{args.out}-memory")
        memory.mkdir(parents=True, exist_ok=True)
    r = measure(args.layers, args.seq, args.repeats, dev, profiles, memory, args.narrow)
    meta = result_meta(dev, command=" ".join(
        ["python", *sys.argv] if argv is None else ["python", __file__, *argv]),
        kind="measurement (the engine's ledger; this machine's times) beside an estimate")
    table = markdown(r)
    print(table)
    write_results(args.out, TITLE, meta, r, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
