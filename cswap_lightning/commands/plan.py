"""`cswap plan`: will a model's training step fit a GPU, and how, estimated without the GPU.

For a model (a name of ``planning/models.py``'s table or a ``config.json``), a sequence, a
batch, a dtype, LoRA or full fine-tuning and a device of ``planning/devices.py``: the step is
traced on the meta device and timed on the device's calibrated roofline
(``planning/estimate.py``), then replayed without help, under activation checkpointing and
under the planner's mix at the device's memory and at a few budgets, and the largest
sequence that fits each way is searched (``planning/sizing.py``). Every figure printed is an
estimate, and the calibration's error on the measured profiles it did not fit is printed
with them (``planning/calibration.py``).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from collections.abc import Callable

from ..extras import require
from ..planning import calibration, models, sizing
from ..planning.devices import DEVICES, device
from ..planning.estimate import DTYPES, OPTIMIZERS, Estimate, Setup, estimate
from .args import number, whole
from .progress import Progress

GiB = 1 << 30
DEFAULT_SEQUENCE = 4096
CEILING = 262144  # the longest sequence searched
WIDTH = 100
# Marks a budget row whose budget is over the device's memory (planned for the device's).
OVER_DEVICE = "(> device)"


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "plan", help="will it fit: a model's training step on a GPU of a table, estimated "
        "without one (peak, checkpointing, the planner's mix, the longest sequence)")
    p.add_argument("model", help=f"one of {', '.join([*models.KNOWN, *models.CNNS])}, or a "
                   "transformers config.json (or its folder)")
    p.add_argument("--seq", type=whole(1), default=None,
                   help=f"tokens per sequence (default {DEFAULT_SEQUENCE}, or the model's "
                   "learned positions where fewer)")
    p.add_argument("--batch", type=whole(1), default=1, help="sequences (images) per step")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                   help="the weights' and activations' dtype")
    tuning = p.add_mutually_exclusive_group()
    tuning.add_argument("--lora", dest="lora", action="store_true",
                        help="LoRA (peft) on every linear layer but the head; the rest frozen")
    tuning.add_argument("--full", dest="lora", action="store_false",
                        help="full fine-tuning (the default)")
    tuning.add_argument("--qlora", action="store_true",
                        help="QLoRA: --lora with the base's linear layers in 4-bit NF4 "
                        "(bitsandbytes, double quantization)")
    p.add_argument("--lora-rank", type=whole(1), default=16)
    p.add_argument("--lora-dropout", type=number(lambda v: 0 <= v < 1, "a number in [0, 1)"),
                   default=0.0, help="peft's dropout before each adapter (a mask saved per "
                   "adapter where above 0)")
    p.add_argument("--device", choices=tuple(DEVICES), default="h100-pcie")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                   help="; ".join(f"{o.name}: {o.describe}" for o in OPTIMIZERS.values()))
    p.add_argument("--layers", type=whole(1), default=None,
                   help="that many of the model's layers instead of its config's")
    p.add_argument("--budgets", type=number(lambda v: v > 0, "a positive number of GiB"),
                   nargs="*", default=(), metavar="GIB",
                   help="more budgets for the planner's mix, in GiB")
    p.add_argument("--finer", action="store_true",
                   help="also weigh a layer's activation modules as units of recomputation "
                   "(slower to plan; layers are weighed whole and below the layer anyway)")
    p.add_argument("--lossy", choices=tuple(sizing.LOSSY_SPEEDS), default=None,
                   help="let the planner's mix send blocks through this lossy codec too "
                   "(CSwapConfig.lossy; the accuracy guard checks it in training)")
    p.add_argument("--dense", action="store_true",
                   help="let the planner's mix send bfloat16 activations through the lossless "
                   "exponent codec too (CSwapConfig.dense_compressor; its speeds estimated)")
    p.add_argument("--host-memory", type=number(lambda v: v >= 0, "a number of GiB >= 0"),
                   default=None, metavar="GIB",
                   help="host memory per GPU process the swapped blocks may hold, in GiB "
                   "(CSwapConfig.host_budget; default: what they need)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="skip the search for the longest sequence that fits")


def run_plan(args: argparse.Namespace) -> int:
    """Estimate, replay and print (module docstring); 1 with the reason where the model or
    its setup cannot be estimated."""
    try:
        return _run(args)
    except ValueError as err:
        print(f"cswap plan: {err}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    # the calibration's profiles include transformers models, a CNN's plan too
    require("transformers", "cswap plan")
    dev = device(args.device)
    lora = (models.LoRA(rank=args.lora_rank, dropout=args.lora_dropout, quantized=args.qlora)
            if args.lora or args.qlora else None)
    spec = models.model(args.model, lora=lora, layers=args.layers)
    sequence = args.seq or min(DEFAULT_SEQUENCE, spec.max_sequence or DEFAULT_SEQUENCE)
    setup = Setup(args.model, sequence, args.batch, DTYPES[args.dtype], lora,
                  layers=args.layers)
    began = time.monotonic()
    est = estimate(setup, dev, OPTIMIZERS[args.optimizer])
    base = sizing.baselines(est)
    peers = sizing.peers(est)
    limit = sizing.usable(dev)
    budgets = [(f"the device ({limit / GiB:.1f} GiB)", limit)]
    budgets += [(f"{b:g} GiB", int(b * GiB)) for b in args.budgets]
    budgets += [("half the peak without help", base[0].prediction.peak_bytes // 2),
                ("checkpointing's peak", base[1].prediction.peak_bytes),
                ("offloaded checkpointing's peak", peers[0].prediction.peak_bytes)]
    budgets = [(label if b <= limit else f"{label} {OVER_DEVICE}", b) for label, b in budgets]
    print(header(est, spec, args.lossy, args.dense))
    print(memory(est, base[0]))
    print(below_the_layer(est), flush=True)
    progress = Progress("cswap plan")
    progress(f"planning at {len(budgets)} budgets (one to two minutes for a 32-layer model)")
    host = None if args.host_memory is None else int(args.host_memory * GiB)
    ways = base + peers + sizing.mixes(
        est, budgets, finer=args.finer, lossy=args.lossy, progress=progress, dense=args.dense,
        host=host)
    print(plans(ways, host), flush=True)
    if args.search:
        ceiling = min(spec.max_sequence or CEILING, CEILING) if spec.sequence else 4096
        print(longest(est, ceiling, "sequence" if spec.sequence else "batch", progress, host))
    print(f"({time.monotonic() - began:.0f} s)")
    return 0


def header(est: Estimate, spec: models.Model, lossy: str | None = None,
           dense: bool = False) -> str:
    s, dev = est.setup, est.device
    tuning = (f"LoRA rank {s.lora.rank} (dropout {s.lora.dropout:g}) on every linear layer "
              "but the head" if s.lora else "full fine-tuning")
    if spec.four_bit:
        tuning = f"QLoRA: {tuning}, their base in 4-bit NF4 (bitsandbytes, double quantization)"
    shape = (f"sequence {s.sequence}" if spec.sequence
             else f"{models.IMAGE_SIDE}x{models.IMAGE_SIDE} images")
    low, high = calibration.HELD_OUT_STEP_ERROR
    title = (f"cswap plan: {spec.name}, {shape}, batch {s.batch}, "
             f"{str(s.dtype).removeprefix('torch.')}, {tuning}; {est.optimizer.describe}"
             + ("; eager attention (transformers has no SDPA for it)"
                if spec.attention == "eager" else "")
             + (f"; its quantization_config ({spec.quantization}) is NOT modelled: weights "
                f"counted in {str(s.dtype).removeprefix('torch.')}" if spec.quantization else "")
             + (f"; NOT run by its batch of {'text' if spec.sequence else 'images'} (their "
                "weights are counted, their activations are not): " + ", ".join(
                    f"{name} ({n / 1e6:,.1f} M weights)" for name, n in est.unread.items())
                if est.unread else ""))
    where = (f"on {dev.name} ({dev.memory_bytes / GiB:.1f} GiB, "
             f"{sizing.CONTEXT_BYTES / GiB:.0f} GiB of it left to the CUDA context; link "
             f"{dev.link.d2h / 1e9:.0f} GB/s each way; measured by this project: "
             f"{dev.measured})")
    profiled = calibration.PROFILED
    held_out = sum(not case.calibrates for case in profiled)
    caveat = ("ESTIMATES, not measurements: the step traced on the meta device (saved tensors "
              f"and allocator bytes), times from a roofline calibrated on {len(profiled)} "
              f"profiles measured on H100s and H200s; on the {held_out} it was not fitted "
              "to, the plain step came "
              f"within {low:+.0%} to {high:+.0%} and the saved bytes exact (one H100 profile "
              "saved copies the trace does not make). The allocator's fragmentation is not "
              "modelled.")
    lines = [title, where, " ".join((caveat, calibration.end_to_end_summary(
        calibration.end_to_end()), calibration.below_summary(calibration.below_check())))]
    if lossy is not None:
        encode, decode = sizing.lossy_speeds(lossy, dev)
        lines.append(f"{lossy}: encoding at {encode / 1e9:.0f} GB/s and decoding at "
                     f"{decode / 1e9:.0f} GB/s (the H200's measured {lossy} kernels, scaled to "
                     "this device's memory rate), encoding on a stream of its own as the "
                     "engine does; what its kernels take from compute is not modelled.")
    if dense:
        encode, decode = sizing.dense_speeds(dev)
        lines.append(f"exponent (lossless): bfloat16 activations at {sizing.DENSE_RATIO:.0%} of "
                     f"their bytes (measured on random weights), encoding at {encode / 1e9:.0f} "
                     f"GB/s and decoding at {decode / 1e9:.0f} GB/s: not measured yet, int8's "
                     "measured kernels scaled by the bytes each moves.")
    return "\n".join(textwrap.fill(line, WIDTH) for line in lines) + "\n"


def memory(est: Estimate, keep: sizing.Way) -> str:
    t, limit = est.training, sizing.usable(est.device)
    tokens = est.setup.sequence * est.setup.batch
    rows = [("weights", t.weights), ("gradients", t.gradients),
            ("optimizer state", t.optimizer_state),
            ("saved activations", est.saved_bytes),
            ("peak without help (step)", keep.prediction.peak_bytes),
            ("peak of the optimizer's update", est.optimizer_peak)]
    lines = ["memory (GiB, estimated)"]
    lines += [f"  {label:<34} {n / GiB:>9.2f}" for label, n in rows]
    lines.append(f"  ({est.saved_bytes / tokens / 1024:.0f} KiB saved per token; "
                 f"{t.trained_elements / 1e6:,.1f} M trained weights)")
    verdict = "FITS" if keep.fits else "DOES NOT FIT"
    lines.append(f"  without help: {verdict} in {limit / GiB:.1f} GiB" + (
        "" if est.optimizer_peak <= limit else
        " (the optimizer's update alone does not: no plan of activations helps)") + "\n")
    return "\n".join(lines)


def below_the_layer(est: Estimate) -> str:
    """What a layer saves, and recomputed below the layer (its elementwise work again) keeps
    and costs; empty where the model has no layers."""
    layer = sizing.first_layer(est)
    if layer is None:
        return ""
    return textwrap.fill(
        f"a layer ({layer.name}) saves {layer.saved_kib:.0f} KiB per token; recomputed below "
        f"the layer (its elementwise work again, from the fewest bytes kept) it "
        f"keeps {layer.below_kib:.0f} KiB per token for {1e3 * layer.below_s:.2f} ms "
        f"({layer.below_s / layer.forward_s:.0%} of its forward)"
        + "".join(f"{', or keeping more to run less again' if k == 0 else ','} {kib:.0f} KiB "
                  f"for {1e3 * seconds:.2f} ms" for k, (kib, seconds) in enumerate(layer.heavier))
        + f"; recomputed whole {layer.whole_kib:.0f} KiB for {1e3 * layer.forward_s:.2f} ms "
        f"(estimated)", WIDTH) + "\n"


def plans(ways: list[sizing.Way], host: int | None = None) -> str:
    checkpointing = ways[1]
    title = ("plans (the replay of the estimated step; a step is forward and backward, the "
             "optimizer apart)")
    labels = [{"no help": "none (no help)", "checkpointing": "none (checkpointing)",
               "checkpointing, inputs offloaded": "none (ckpt, inputs offloaded)",
               "every tensor offloaded": "none (every tensor offloaded)"}.get(
        way.label, way.label) for way in ways]
    left = max(28, *map(len, labels))
    # the figures first, the plan's words last: the rows' figures line up in a narrow terminal
    lines = [title,
             (f"  {'budget':<{left}} {'peak GiB':>8} {'host GiB':>8} {'step ms':>8} "
              f"{'vs ckpt':>8}       plan")]
    for label, way in zip(labels, ways):
        p = way.prediction
        lines.append(f"  {label:<{left}} {p.peak_bytes / GiB:>8.2f} "
                     f"{p.host_bytes / GiB:>8.2f} {1e3 * way.step_s:>8.1f} "
                     f"{checkpointing.step_s / way.step_s:>7.2f}x "
                     f"{'' if way.fits else 'OVER':<5} {way.how}")
    bound = (f"; at most {host / GiB:g} GiB (--host-memory)" if host is not None else
             "; where the machine cannot pin that much, plan with --host-memory GIB"
             if any(way.prediction.host_bytes for way in ways) else "")
    notes = [("the peers, as this engine would run them: ckpt, inputs offloaded: Unsloth's "
              "offloaded checkpointing (Hugging Face's offload=True); every tensor offloaded: "
              "torchtune's activation offloading (torch's save_on_cpu)"),
             ("host GiB: what the swapped blocks hold in host memory (pinned) at the end of "
              "forward, per GPU process (a compressed one at its size: its slot)" + bound)]
    if not all(way.fits for way in ways):
        notes.append("OVER: the plan does not fit (the device's memory, or its budget)")
    if any(OVER_DEVICE in label for label in labels):
        notes.append(f"{OVER_DEVICE}: a budget over the device's memory, planned for the "
                     "device's")
    lines += [textwrap.fill(note, WIDTH, initial_indent="  ", subsequent_indent="    ")
              for note in notes]
    return "\n".join(lines) + "\n"


def longest(est: Estimate, ceiling: int, what: str,
            progress: Callable[[str], None] | None = None, host: int | None = None) -> str:
    parts = []
    for how, label in (("none", "without help"), ("checkpointing", "checkpointing"),
                       ("planner", "the planner")):
        if progress is not None:
            progress(f"the longest {what} that fits {label}")
        n = sizing.largest(est, how, ceiling, host if how == "planner" else None)
        parts.append(f"{label} {'none' if n is None else n}"
                     + (" (the search's ceiling)" if n == ceiling else ""))
    return f"the longest {what} that fits (estimated): " + ", ".join(parts)
