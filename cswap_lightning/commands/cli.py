"""The `cswap` console script: demo, fit, compare, recipes, env, plan, bench, build-ext and
tune."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..config import LOSSY_CODECS, PLANS, CSwapConfig
from ..extras import MissingExtra
from .args import budget as _budget
from .args import device as _device
from .args import fraction as _fraction
from .args import whole as _whole


def _demo_batch_size(text: str) -> int:
    """At most the digits' training images: a larger batch would leave an epoch no step."""
    from .demo import TRAIN_IMAGES

    return _whole(1, TRAIN_IMAGES)(text)


def _size(text: str) -> int:
    """A size like 256KiB, in bytes: a positive multiple of 4, whole elements of every dtype
    the codec benchmark measures."""
    from .bench_codec import parse_size

    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(
            f"expected a positive multiple of 4 bytes (whole float32 elements), got {text!r}")
    return size


def _config(args: argparse.Namespace) -> CSwapConfig:
    return CSwapConfig(plan=args.plan, min_bytes=args.min_bytes, budget=args.budget,
                       prefetch_bytes=args.prefetch_bytes)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except MissingExtra as err:  # `cswap plan llama-3-8b` without transformers: say which extra
        print(f"cswap: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`cswap plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush
        return 1


def _main(argv: list[str] | None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["fit"]:  # LightningCLI parses the rest
        from .fit import main as fit

        fit(None if argv is None else argv[1:])
        return 0
    if (sys.argv[1:] if argv is None else argv)[:1] == ["compare"]:
        return _compare(sys.argv[2:] if argv is None else argv[1:])
    parser = argparse.ArgumentParser(prog="cswap", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cswap-lightning {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fit", help="train a recipe with LightningCLI: cswap fit --config "
                        "cnn (a shipped recipe, or a YAML file; cswap fit --help lists options)")
    commands.add_parser("compare", help="train a recipe lossless and lossy from one seed and "
                        "compare: cswap compare --config cnn [--lossy int8]")
    commands.add_parser("recipes", help="list the shipped recipes (cswap fit --config NAME)")
    commands.add_parser("env", help="versions, CUDA devices, nvcc, the CUDA codec library and "
                        "the link's bandwidth: paste it into a bug report")

    demo = commands.add_parser("demo", help="train a small ReLU CNN on scikit-learn digits")
    demo.add_argument("--epochs", type=_whole(1), default=3)
    demo.add_argument("--batch-size", type=_demo_batch_size, default=128,
                      help="images per step, at most the training split of the digits")
    demo.add_argument("--width", type=_whole(1), default=32, help="channels of the first conv")
    demo.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    demo.add_argument("--plan", default="auto", choices=PLANS)
    demo.add_argument("--min-bytes", type=_whole(0), default=64 * 1024,
                      help="saved tensors smaller than this stay on the device")
    demo.add_argument("--prefetch-bytes", type=_whole(0), default=2 << 20,
                      help="bytes backward may bring back ahead of use (default 2 MiB: small, "
                      "so that what moving freed shows in the measured peak)")
    demo.add_argument("--budget", type=_budget, default=None,
                      help="device memory budget for plan auto: none, auto, bytes or a fraction")

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    step = bench_kinds.add_parser("step", help="step time, peak memory and bytes moved, "
                                  "against no offload and peer methods")
    step.add_argument("--model", default="cnn", choices=("cnn", "mlp", "transformer"))
    step.add_argument("--device", type=_device, default="auto")
    step.add_argument("--batch-size", type=_whole(1), default=None,
                      help="default: per model and device")
    step.add_argument("--steps", type=_whole(1), default=10, help="timed steps per method")
    step.add_argument("--warmup", type=_whole(0), default=3)
    step.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")
    codec = bench_kinds.add_parser("codec", help="zvc/rle throughput and ratio by dtype, size "
                                   "and sparsity, against copy bandwidth and nvCOMP")
    codec.add_argument("--device", type=_device, default="auto")
    codec.add_argument("--sizes", nargs="+", type=_size, default=None, metavar="SIZE",
                       help="e.g. 256KiB 16MiB (default: 256KiB..256MiB by powers of 4 on a "
                       "GPU, 256KiB..16MiB on the CPU)")
    codec.add_argument("--dtypes", nargs="+", choices=("float32", "float16", "bfloat16"),
                       default=None)
    codec.add_argument("--codecs", nargs="+",
                       choices=("zvc", "rle", "exponent", "int8", "fp8", "int4"), default=None,
                       help="default: zvc rle exponent int8 (exponent: bfloat16 only)")
    codec.add_argument("--sparsities", nargs="+", type=_whole(0, 100), default=None,
                       metavar="PCT",
                       help="percentages of zeros (default: 0 25 50 75 90 95)")
    codec.add_argument("--quick", action="store_true",
                       help="sparsities 0,50,90, fewer repeats and a smaller CNN")
    codec.add_argument("--warmup", type=_whole(0), default=None)
    codec.add_argument("--repeats", type=_whole(1), default=None,
                       help="timed runs per operation")
    codec.add_argument("--relu", action=argparse.BooleanOptionalAction, default=True,
                       help="also measure real ReLU activations of the demo CNN")
    codec.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                       help="also measure a transformer's bfloat16 MLP outputs (random weights)")
    codec.add_argument("--nvcomp", action=argparse.BooleanOptionalAction, default=True,
                       help="also run nvCOMP where nvidia.nvcomp imports (CUDA only)")
    codec.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")
    advisor = bench_kinds.add_parser(
        "advisor", help="does the advisor pick the faster of raw and compressed swaps?")
    advisor.add_argument("--device", type=_device, default="auto")
    advisor.add_argument("--codec", default="zvc", choices=("zvc", "rle"))
    overhead = bench_kinds.add_parser(
        "overhead", help="the engine's host time per saved tensor (a chain of tiny ops)")
    overhead.add_argument("--tensors", type=_whole(1), default=2000,
                          help="saved tensors per step")
    overhead.add_argument("--rounds", type=_whole(1), default=7, help="interleaved rounds")
    overhead.add_argument("--steady-steps", type=_whole(1), default=8,
                          help="steps in a row per method for the steady-state figure")
    overhead.add_argument("--device", type=_device, default="cpu", choices=("cpu", "cuda"),
                          help="where the chain runs (cuda: host time of a GPU step)")
    overhead.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")
    plan = bench_kinds.add_parser(
        "plan", help="the planner's keep/swap/recompute mix against checkpointing and swapping, "
        "predicted by the replay of the H100 profiles (no GPU needed)")
    plan.add_argument("--models", nargs="+", default=None,
                      choices=("gpt2-medium", "bert-large", "resnet50", "vgg16"))
    plan.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")
    measure = bench_kinds.add_parser(
        "measure", help="this device's profile, the planner's predictions from it, and the "
        "methods measured beside them, interleaved (a GPU; on the CPU a dry run)")
    measure.add_argument("--models", nargs="+", default=["gpt2-medium", "resnet50"],
                         choices=("gpt2-medium", "bert-large", "resnet50", "vgg16", "llama",
                                  "llama3-8b-4l"),
                         help="llama: the profile of Llama-3-8B's layer shapes (4 layers, "
                         "sequence 4096) only; llama3-8b-4l: the same model measured like "
                         "the others")
    measure.add_argument("--rounds", type=_whole(1), default=12,
                         help="interleaved timed rounds (one step of each method)")
    measure.add_argument("--device", type=_device, default="auto")
    measure.add_argument("--trace", action="store_true",
                         help="one more step of each method under torch.profiler: its table "
                         "in OUT-traces/, the device's kernel and copy time beside the step's")
    measure.add_argument("--out", required=True, help="write markdown and JSON results here "
                         "(stem); profiles go beside")
    from .bench_suite import add_parser as add_suite_parser

    add_suite_parser(bench_kinds)
    from .bench_finetune import add_parser as add_finetune_parser

    add_finetune_parser(bench_kinds)
    from .plan import add_parser as add_plan_parser

    add_plan_parser(commands)

    build_ext = commands.add_parser(
        "build-ext", help="compile the CUDA codec library with nvcc and print its path"
    )
    build_ext.add_argument("--force", action="store_true", help="rebuild even if cached")

    tune = commands.add_parser(
        "tune", help="tune the CUDA kernels' grid and block sizes with hyperopt TPE, against an "
        "exhaustive grid search, and cache them for this GPU (needs CUDA and nvcc)")
    tune.add_argument("--max-evals", type=_whole(1), default=30, help="TPE runs per kernel")
    tune.add_argument("--startup", type=_whole(1), default=6,
                      help="random runs before TPE models")
    tune.add_argument("--seed", type=_whole(0), default=0)
    tune.add_argument("--mib", type=_whole(1), default=64,
                      help="size of the timed tensor in MiB")
    tune.add_argument("--sparsity", type=_fraction, default=0.5, help="fraction of zeros in it")
    tune.add_argument("--dtypes", nargs="+", default=["float32", "float16"],
                      help="float32, float16, bfloat16, float64 or bool, one per element size")
    tune.add_argument("--no-grid-search", action="store_true", help="skip the comparison")
    tune.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")

    args = parser.parse_args(argv)
    if args.command == "recipes":
        from ..recipes import describe, shipped, sizing

        recipes = shipped()
        width = max(map(len, recipes))  # the descriptions in one column
        for name, path in recipes.items():
            print(f"{name:{width}} {describe(path)}\n{'':{width}} {sizing(name)}\n"
                  f"{'':{width}} {path}")
        return 0
    if args.command == "plan":
        from .plan import run_plan

        return run_plan(args)
    if args.command == "env":
        from .env import report

        print(report())
        return 0
    if args.command == "build-ext":
        from ..codecs.cuda_build import BuildError, build

        try:
            print(build(force=args.force))
        except BuildError as err:
            print(f"cswap build-ext: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "tune":
        from ..planning.tuner import Settings, TunerUnavailable
        from .tune import run_tune

        try:
            settings = Settings(args.mib << 20, args.sparsity, args.max_evals, args.startup,
                                args.seed, not args.no_grid_search)
            run_tune(settings, args.dtypes, args.out)
        except (TunerUnavailable, ValueError) as err:
            print(f"cswap tune: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "demo":
        from .demo import run_demo

        try:
            config = _config(args)
        except (TypeError, ValueError) as err:  # a flag the config refuses: name it
            demo.error(str(err))
        result = run_demo(args.epochs, args.batch_size, args.width, args.device, config)
        return 0 if result["gradients_equal"] else 1
    if args.bench == "advisor":
        from .bench_advisor import run_advisor_check

        run_advisor_check(args.device, args.codec)
        return 0
    if args.bench == "codec":
        from .bench_codec import run_codec_bench

        run_codec_bench(args.device, args.sizes, args.dtypes, args.codecs, args.sparsities,
                        args.quick, args.warmup, args.repeats, args.relu, args.dense, args.nvcomp,
                        args.out)
        return 0
    if args.bench == "overhead":
        from .bench_overhead import run_overhead_bench

        run_overhead_bench(args.tensors, rounds=args.rounds, out=args.out,
                           steady_steps=args.steady_steps, device=args.device)
        return 0
    if args.bench == "plan":
        from .bench_plan import run_plan_bench

        run_plan_bench(args.models, args.out)
        return 0
    if args.bench == "measure":
        from .bench_measure import run_measure_bench

        run_measure_bench(args.models, args.out, args.rounds, args.device, args.trace)
        return 0
    if args.bench == "finetune":
        from .bench_finetune import run_finetune

        run_finetune(args)
        return 0
    if args.bench == "suite":
        from .bench_suite import run_suite

        run_suite(args, sys.argv[1:] if argv is None else argv)
        return 0
    from .bench_step import run_step_bench

    run_step_bench(args.model, args.device, args.batch_size, args.steps, args.warmup, args.out)
    return 0


def _compare(argv: list[str]) -> int:
    """``cswap compare [--lossy C] [--metric M] [--out STEM] LIGHTNINGCLI_ARGS...``."""
    parser = argparse.ArgumentParser(
        prog="cswap compare", description="Train a recipe twice from the same seed, lossless "
        "and lossy, and compare the validation metric after each epoch and the bytes saved. "
        "Other arguments (--config NAME or FILE.yaml, --trainer.max_epochs 3, ...) go to "
        "LightningCLI.")
    parser.add_argument("--lossy", default="int8", choices=LOSSY_CODECS)
    parser.add_argument("--metric", default="val_acc", help="what validation logs to compare")
    parser.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")
    args, recipe_args = parser.parse_known_args(argv)
    if not recipe_args:
        parser.error("no recipe: pass --config NAME (`cswap recipes` lists them) or a YAML file")
    from .compare import MetricMissing, compare

    try:
        compare(recipe_args, args.lossy, args.metric, args.out)
    except MetricMissing as err:
        parser.error(str(err).removeprefix("cswap compare: "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
