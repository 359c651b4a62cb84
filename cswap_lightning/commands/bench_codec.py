"""`cswap bench codec`: the codecs' throughput and ratio against the copies they compete with.

For each codec, dtype, size and sparsity, on synthetic tensors (ReLU-like values, a uniformly
random fraction set to zero) and on real post-ReLU activations of the demo CNN, it measures
compression and decompression throughput (GB/s of *uncompressed* bytes) and the compression
ratio, and checks that every lossless decode is bitwise equal to its input (a lossy one,
int8 by default, fp8 and int4 on request: within its relative error ceiling below; the
planner needs their speed to weigh lossy swaps). In the same run it
measures the limits: a device-to-device copy of the same size (on the CPU: a memory copy) and
pinned device-to-host and host-to-device copies (CUDA only). Where ``nvidia.nvcomp`` imports
(CUDA only), nvCOMP's Cascaded, Bitcomp and LZ4 run on the same tensors.

Every operation is timed as a caller sees it: allocation of its output and any host
synchronisation inside it included (the CUDA encoders read the compressed size back). Times
are medians, from CUDA events on a GPU and the host clock on the CPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..codecs import bit_view
from ..codecs.lossy import FP8Codec, Int4Codec, Int8Codec, relative_error
from ..codecs.reference import Codec, ExponentCodec, RLECodec, ZVCCodec
from ..planning.profiler import median_seconds
from ..records import fmt_bytes
from .bench_step import result_meta, write_results

KiB, MiB = 1024, 1024 * 1024
GPU_SIZES = tuple(256 * KiB * 4**i for i in range(6))  # 256 KiB .. 256 MiB
CPU_SIZES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
SPARSITIES = (0, 25, 50, 75, 90, 95)  # percent
QUICK_SPARSITIES = (0, 50, 90)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CODECS = {"zvc": ZVCCodec, "rle": RLECodec, "exponent": ExponentCodec, "int8": Int8Codec,
          "fp8": FP8Codec, "int4": Int4Codec}
DEFAULT_CODECS = ("zvc", "rle", "exponent", "int8")
# A lossy round trip whose relative L2 error passes this is a codec bug, not a speed to report
# (measured on activations: int8 0.01-0.03, int4 0.2-0.5).
LOSSY_CEILING = {"int8": 0.05, "fp8": 0.1, "int4": 0.6}
# nvCOMP algorithms and their options; Bitcomp's algorithm_type 1 is its variant for sparse data.
NVCOMP_ALGORITHMS = {"Cascaded": {}, "Bitcomp": {}, "Bitcomp sparse": {"algorithm_type": 1},
                     "LZ4": {}}
# The target: at >= 16 MiB and 50% sparsity, each direction >= 60% of a D2D copy.
TARGET_BYTES, TARGET_SPARSITY, TARGET_FRACTION = 16 * MiB, 50, 0.6

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": 1024 * MiB,
          "gib": 1024 * MiB}


def parse_size(text: str) -> int:
    """Bytes from "256KiB", "1MiB", "1g" or "4096" (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match[2].lower())
    if not unit:
        raise ValueError(f"bad size {text!r}: write a whole number with an optional unit "
                         f"KiB, MiB or GiB, e.g. 256KiB or 16MiB")
    return int(match[1]) * unit


@dataclass(frozen=True)
class Contender:
    """One way to compress a tensor: ours or nvCOMP's, behind the same three calls."""

    name: str
    impl: str
    encode: Callable[[torch.Tensor], Any]
    decode: Callable[[Any, torch.Tensor], torch.Tensor]  # (packed, original) -> decoded
    nbytes: Callable[[Any], int]
    dtypes: tuple[torch.dtype, ...] | None = None  # the dtypes it packs (None: any)


def our_contenders(dev: torch.device, names: list[str]) -> tuple[list[Contender], list[str]]:
    """The codecs for ``dev``: CUDA kernels when the library loads, else the reference."""
    codecs: list[Codec] = [CODECS[n]() for n in names]
    impl, notes = "reference (pure torch)", []
    if dev.type == "cuda":
        from ..codecs.cuda import CUDA_CODECS, load_extension

        if load_extension() is None:
            notes.append("the CUDA codec library did not load: the reference codecs were "
                         "measured on the GPU instead (see the warning above)")
        else:
            codecs, impl = [CUDA_CODECS[n]() for n in names], "CUDA kernels"
    return [Contender(c.name, impl, c.encode, lambda p, t, c=c: c.decode(p), _packed_nbytes,
                      c.dtypes) for c in codecs], notes


def _packed_nbytes(packed) -> int:
    return packed.nbytes


def nvcomp_contenders(dev: torch.device) -> tuple[list[Contender], str | None]:
    """nvCOMP's algorithms on ``dev``, or none and the reason they were skipped."""
    if dev.type != "cuda":
        return [], "nvCOMP runs on CUDA devices only"
    try:
        from nvidia import nvcomp
    except ImportError as err:
        return [], f"nvidia.nvcomp is not importable ({err}): pip install nvidia-nvcomp-cu13"
    stream = torch.cuda.current_stream(dev).cuda_stream
    contenders = []
    for name, options in NVCOMP_ALGORITHMS.items():
        codec = nvcomp.Codec(algorithm=name.split()[0], device_id=dev.index or 0,
                             cuda_stream=stream, **options)
        parsed: list = []  # [compressed buffer, its decompression config]

        def encode(t: torch.Tensor, codec=codec):
            # Integer bit patterns: nvCOMP has no bfloat16 type, and bits are what must survive.
            return codec.encode(nvcomp.as_array(bit_view(t.reshape(-1)), cuda_stream=stream))

        def decode(packed, t: torch.Tensor, codec=codec, parsed=parsed):
            # nvCOMP's fastest documented path: a decompression config parsed once per buffer
            # (that parse synchronises), then decodes that never wait for the host.
            if not parsed or parsed[0] is not packed:
                parsed[:] = [packed, codec.decompression_config(packed)]
            out = torch.empty_like(t)
            codec.decode(packed, out=nvcomp.as_array(bit_view(out.reshape(-1)), cuda_stream=stream),
                         decompression_config=parsed[1])
            return out

        contenders.append(Contender(f"nvcomp {name}", f"nvCOMP {nvcomp.__version__}", encode,
                                    decode, lambda packed: int(packed.buffer_size)))
    return contenders, None


def measure_limits(nbytes: int, dev: torch.device, warmup: int, repeats: int) -> dict:
    """GB/s of a same-size device copy and, on CUDA, of pinned D2H and H2D copies.

    Each gets at least one warm-up copy, which takes the first-touch page faults of the new
    buffers out of the timing."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def gbps(copy: Callable[[], object]) -> float:
        return nbytes / median_seconds(copy, dev, max(warmup, 1), repeats) / 1e9

    limits = {"bytes": nbytes, "copy_gbps": gbps(lambda: dst.copy_(src)), "d2h_gbps": None,
              "h2d_gbps": None}
    if dev.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        limits["d2h_gbps"] = gbps(lambda: host.copy_(src, non_blocking=True))
        limits["h2d_gbps"] = gbps(lambda: src.copy_(host, non_blocking=True))
    return limits


def synthetic(nbytes: int, dtype: torch.dtype, sparsity: float, dev: torch.device,
              gen: torch.Generator) -> torch.Tensor:
    """ReLU-like values (|N(0, 1)|) with a uniformly random ``sparsity`` fraction set to zero."""
    n = nbytes // dtype.itemsize
    values = torch.randn(n, device=dev, generator=gen).abs_().to(dtype)
    return values.masked_fill_(torch.rand(n, device=dev, generator=gen) < sparsity, 0)


def relu_activations(dev: torch.device, batch: int, width: int,
                     train_steps: int) -> dict[str, torch.Tensor]:
    """Post-ReLU outputs of the demo CNN on scikit-learn digits after a few training steps,
    captured with forward hooks (BatchNorm in training mode, as during a training step)."""
    from ..recipes.nets import build_cnn
    from .demo import load_digits

    torch.manual_seed(0)
    x, y, _, _ = load_digits(dev)
    model = build_cnn(width).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(train_steps):
        at = (128 * step) % (len(x) - 128)
        loss = F.cross_entropy(model(x[at:at + 128]), y[at:at + 128])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    captured: dict[str, torch.Tensor] = {}
    relus = [m for m in model if isinstance(m, nn.ReLU)]
    hooks = [relu.register_forward_hook(
        lambda module, args, out, name=f"cnn relu{i + 1}": captured.__setitem__(
            name, out.detach().clone())) for i, relu in enumerate(relus)]
    with torch.no_grad():
        model(x[:batch])
    for hook in hooks:
        hook.remove()
    return captured


def dense_activations(dev: torch.device, tokens: int, hidden: int) -> dict[str, torch.Tensor]:
    """bfloat16 outputs of a transformer's MLP, random weights at their usual scale (what
    the exponent codec is for): BERT's GELU and Llama's SiLU-gated product."""
    gen = torch.Generator(device=dev).manual_seed(0)

    def project(x: torch.Tensor, width: int) -> torch.Tensor:
        w = torch.randn(x.shape[1], width, device=dev, generator=gen) / x.shape[1] ** 0.5
        return (x @ w).to(torch.bfloat16)

    x = torch.randn(tokens, hidden, device=dev, generator=gen)
    return {"bert gelu": F.gelu(project(x, 4 * hidden)),
            "llama silu * up": F.silu(project(x, 4 * hidden)) * project(x, 4 * hidden)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (so NaN payloads and -0.0 count), whatever the dtypes."""
    return a.numel() * a.element_size() == b.numel() * b.element_size() and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def measure(contender: Contender, t: torch.Tensor, dev: torch.device, warmup: int,
            repeats: int) -> dict:
    """One contender on one tensor: ratio, both throughputs; raises if the round trip differs
    (a lossy one: if its error passes its ceiling)."""
    packed = contender.encode(t)
    restored = contender.decode(packed, t)
    ceiling = LOSSY_CEILING.get(contender.name)
    error = None if ceiling is None else float(relative_error(t, restored.reshape(t.shape)))
    if (not same_bits(restored, t)) if ceiling is None else not error <= ceiling:
        what = ("did not reproduce its input bit for bit" if ceiling is None else
                f"lost more than its ceiling (relative error {error:.3g} > {ceiling})")
        raise RuntimeError(
            f"{contender.name} ({contender.impl}) {what}: {t.dtype} tensor of {t.numel()} "
            "elements. This is a codec bug; the benchmark stops rather than report its speed.")
    nbytes, compressed = t.numel() * t.element_size(), contender.nbytes(packed)
    compress_s = median_seconds(lambda: contender.encode(t), dev, warmup, repeats)
    decompress_s = median_seconds(lambda: contender.decode(packed, t), dev, warmup, repeats)
    ratio = nbytes / compressed
    return {"codec": contender.name, "impl": contender.impl,
            "compressed_bytes": compressed, "ratio": ratio, "relative_error": error,
            "compress_gbps": nbytes / compress_s / 1e9,
            "decompress_gbps": nbytes / decompress_s / 1e9,
            # Uncompressed bytes per second through compress-then-decompress, times the ratio.
            "roundtrip_x_ratio": nbytes / (compress_s + decompress_s) / 1e9 * ratio}


def run_codec_bench(device: str = "auto", sizes: list[int] | None = None,
                    dtypes: list[str] | None = None, codecs: list[str] | None = None,
                    sparsities: list[int] | None = None, quick: bool = False,
                    warmup: int | None = None, repeats: int | None = None, relu: bool = True,
                    dense: bool = True, nvcomp: bool = True, out: str | None = None) -> dict:
    """Measure every case, print a line per case and a summary; optionally save md and JSON.

    ``quick`` trims the defaults (three sparsities, fewer repeats, a smaller CNN); explicit
    arguments win. ``relu``: the demo CNN's ReLU outputs too; ``dense``: a transformer's MLP
    outputs (``dense_activations``), bfloat16, where bfloat16 is measured. Returns the JSON
    document (meta, limits, rows, summary)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    sizes = sizes or list(GPU_SIZES if gpu else CPU_SIZES)
    dtypes = dtypes or list(DTYPES)
    unknown = [d for d in dtypes if d not in DTYPES] + [c for c in codecs or [] if c not in CODECS]
    if unknown:
        raise ValueError(f"unknown dtype or codec {unknown}; dtypes: {list(DTYPES)}, "
                         f"codecs: {list(CODECS)}")
    if any(s <= 0 or s % 4 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes (whole float32 "
                         f"elements), got {sizes}")
    sparsities = sparsities or list(QUICK_SPARSITIES if quick else SPARSITIES)
    warmup = (0 if quick else 1) if warmup is None else warmup
    repeats = (2 if quick else 10 if gpu else 3) if repeats is None else repeats
    contenders, notes = our_contenders(dev, codecs or list(DEFAULT_CODECS))
    nvcomp_skipped = "not requested (--no-nvcomp)"
    if nvcomp:
        found, nvcomp_skipped = nvcomp_contenders(dev)
        contenders += found
    if nvcomp_skipped:
        notes.append(f"nvCOMP skipped: {nvcomp_skipped}")

    cases: list[tuple[str, torch.dtype, float | None, Callable[[], torch.Tensor]]] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for dtype_name in dtypes:
        for nbytes in sizes:
            for pct in sparsities:
                cases.append(("synthetic", DTYPES[dtype_name], pct, lambda n=nbytes, d=dtype_name,
                              s=pct: synthetic(n, DTYPES[d], s / 100, dev, gen)))
    if relu:
        batch, width, steps = (64, 16, 5) if quick else (1024, 64, 20) if gpu else (256, 32, 20)
        activations = relu_activations(dev, batch, width, steps)
        for dtype_name in dtypes:
            for name, act in activations.items():
                cases.append((name, DTYPES[dtype_name], None,
                              lambda a=act, d=dtype_name: a.to(DTYPES[d])))
    if dense and "bfloat16" in dtypes:
        tokens, hidden = (512, 256) if quick else (4096, 1024) if gpu else (1024, 512)
        for name, act in dense_activations(dev, tokens, hidden).items():
            cases.append((name, torch.bfloat16, None, lambda a=act: a))

    print(f"cswap bench codec: device {dev}, {len(cases)} tensors x "
          f"{', '.join(c.name for c in contenders)}; {warmup} warm-up + {repeats} timed runs "
          "each; every decode checked bit for bit")
    for note in notes:
        print(f"  note: {note}")
    limits: dict[int, dict] = {}
    rows: list[dict] = []
    for i, (source, dtype, pct, make) in enumerate(cases, 1):
        t = make()
        nbytes = t.numel() * t.element_size()
        if nbytes not in limits:
            limits[nbytes] = measure_limits(nbytes, dev, warmup, repeats)
        sparsity = 1 - bit_view(t).count_nonzero().item() / max(t.numel(), 1)
        case = {"source": source, "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
                "target_sparsity": pct, "sparsity": sparsity,
                "copy_gbps": limits[nbytes]["copy_gbps"]}
        results = []
        for contender in contenders:
            if contender.dtypes is not None and t.dtype not in contender.dtypes:
                continue
            row = {**case, **measure(contender, t, dev, warmup, repeats)}
            row["compress_vs_copy"] = row["compress_gbps"] / row["copy_gbps"]
            row["decompress_vs_copy"] = row["decompress_gbps"] / row["copy_gbps"]
            rows.append(row)
            results.append(f"{row['codec']} {row['ratio']:.2f}x {row['compress_gbps']:.2f}/"
                           f"{row['decompress_gbps']:.2f}")
        print(f"  [{i}/{len(cases)}] {source} {case['dtype']} {fmt_bytes(nbytes)} "
              f"{100 * sparsity:.0f}% zeros (copy {case['copy_gbps']:.1f} GB/s): "
              f"{'; '.join(results)} GB/s", flush=True)
        del t

    summary = {"target": target_lines(rows), "nvcomp_on_relu": nvcomp_lines(rows),
               "notes": notes}
    doc = {"limits": list(limits.values()), "rows": rows, "summary": summary}
    print(markdown(doc, cases=False))
    if out:
        meta = result_meta(dev, sizes=[fmt_bytes(s) for s in sizes], sparsities=sparsities,
                           warmup=warmup, repeats=repeats, quick=quick)
        write_results(out, "cswap bench codec", meta, doc, markdown(doc))
        doc = {"meta": meta, **doc}
    return doc


def target_lines(rows: list[dict]) -> list[str]:
    """The issue's target, per codec, dtype and size: both directions against the copy."""
    ours = [r for r in rows if r["source"] == "synthetic" and r["bytes"] >= TARGET_BYTES
            and r["target_sparsity"] == TARGET_SPARSITY and not r["codec"].startswith("nvcomp")]
    if not ours:
        return [(f"no synthetic case of >= {fmt_bytes(TARGET_BYTES)} at {TARGET_SPARSITY}% "
                 "sparsity in this run: the target was not evaluated")]
    lines = []
    for r in ours:
        met = min(r["compress_vs_copy"], r["decompress_vs_copy"]) >= TARGET_FRACTION
        lines.append(f"{r['codec']} ({r['impl']}) {r['dtype']} {fmt_bytes(r['bytes'])}: "
                     f"compress {r['compress_vs_copy']:.0%} and decompress "
                     f"{r['decompress_vs_copy']:.0%} of the copy bandwidth "
                     f"({r['copy_gbps']:.1f} GB/s): {'met' if met else 'missed'} "
                     f"(target {TARGET_FRACTION:.0%} each)")
    return lines


def nvcomp_lines(rows: list[dict]) -> list[str]:
    """On each ReLU activation: our best against nvCOMP's best, by round trip x ratio."""
    lines = []
    cases = {(r["source"], r["dtype"]) for r in rows if r["source"] != "synthetic"}
    for source, dtype in sorted(cases):
        mine = [r for r in rows if (r["source"], r["dtype"]) == (source, dtype)]
        lossless = [r for r in mine
                    if not r["codec"].startswith("nvcomp") and r["codec"] not in LOSSY_CEILING]
        if not lossless:
            continue
        ours = max(lossless, key=lambda r: r["roundtrip_x_ratio"])
        theirs = [r for r in mine if r["codec"].startswith("nvcomp")]
        if not theirs:
            continue
        best = max(theirs, key=lambda r: r["roundtrip_x_ratio"])
        verdict = "ahead" if ours["roundtrip_x_ratio"] > best["roundtrip_x_ratio"] else "behind"
        lines.append(f"{source} {dtype} ({100 * ours['sparsity']:.0f}% zeros): {ours['codec']} "
                     f"{ours['roundtrip_x_ratio']:.1f} vs {best['codec']} "
                     f"{best['roundtrip_x_ratio']:.1f} GB/s x ratio: {verdict}")
    return lines


def _gbps(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _error(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


_LIMITS_HEAD = """## Limits

GB/s of a copy of each size: on a GPU a device-to-device copy and pinned host copies; on the
CPU a memory copy (D2H and H2D are n/a).

| size | device copy | pinned D2H | pinned H2D |
|---:|---:|---:|---:|"""
_CASES_HEAD = """## Cases

Throughput in GB/s of uncompressed bytes. "vs copy" divides it by the device copy of the same
size. "round trip x ratio" is bytes / (compress + decompress time) x compression ratio.

"error" is a lossy round trip's relative L2 error ("-": lossless, checked bit for bit).

| source | dtype | size | zeros | codec | impl | ratio | compress | decompress | vs copy (c / d) \
| round trip x ratio | error |
|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"""
_TARGET_HEAD = (f"## Target: >= {fmt_bytes(TARGET_BYTES)} at {TARGET_SPARSITY}% sparsity, each "
                f"direction >= {TARGET_FRACTION:.0%} of the device copy")


def markdown(doc: dict, cases: bool = True) -> str:
    """Limits, every case (unless ``cases`` is false), then the summary, as markdown."""
    limits = sorted(doc["limits"], key=lambda m: m["bytes"])
    parts = [_LIMITS_HEAD + "".join(
        f"\n| {fmt_bytes(m['bytes'])} | {_gbps(m['copy_gbps'])} | {_gbps(m['d2h_gbps'])} | "
        f"{_gbps(m['h2d_gbps'])} |" for m in limits)]
    if cases:
        parts.append(_CASES_HEAD + "".join(
            f"\n| {r['source']} | {r['dtype']} | {fmt_bytes(r['bytes'])} | "
            f"{100 * r['sparsity']:.1f}% | {r['codec']} | {r['impl']} | {r['ratio']:.2f}x | "
            f"{r['compress_gbps']:.2f} | {r['decompress_gbps']:.2f} | "
            f"{r['compress_vs_copy']:.0%} / {r['decompress_vs_copy']:.0%} | "
            f"{r['roundtrip_x_ratio']:.2f} | {_error(r.get('relative_error'))} |"
            for r in doc["rows"]))
    summary = doc["summary"]
    parts.append(_bullets(_TARGET_HEAD, summary["target"]))
    parts.append(_bullets("## nvCOMP on ReLU activations (round trip x ratio)",
                          summary["nvcomp_on_relu"] or ["no nvCOMP rows in this run"]))
    if summary["notes"]:
        parts.append(_bullets("## Notes", summary["notes"]))
    return "\n\n".join(parts)


def _bullets(title: str, items: list[str]) -> str:
    return title + "\n\n" + "\n".join(f"- {item}" for item in items)
