"""The `cswap` console script: `cswap demo`, `cswap bench step`, `cswap build-ext`."""

from __future__ import annotations

import argparse
import sys

from .config import PLANS, CSwapConfig


def _config(args: argparse.Namespace) -> CSwapConfig:
    return CSwapConfig(plan=args.plan, min_bytes=args.min_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cswap", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small ReLU CNN on scikit-learn digits")
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument("--batch-size", type=int, default=128)
    demo.add_argument("--width", type=int, default=32, help="channels of the first conv")
    demo.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    demo.add_argument("--plan", default="auto", choices=PLANS)
    demo.add_argument("--min-bytes", type=int, default=64 * 1024)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    step = bench_kinds.add_parser("step", help="step time, peak memory and bytes moved, "
                                  "against no offload and peer methods")
    step.add_argument("--model", default="cnn", choices=("cnn", "mlp", "transformer"))
    step.add_argument("--device", default="auto")
    step.add_argument("--batch-size", type=int, default=None, help="default: per model and device")
    step.add_argument("--steps", type=int, default=10, help="timed steps per method")
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--out", default=None, help="write markdown and JSON results here (stem)")

    build_ext = commands.add_parser(
        "build-ext", help="compile the CUDA codec library with nvcc and print its path"
    )
    build_ext.add_argument("--force", action="store_true", help="rebuild even if cached")

    args = parser.parse_args(argv)
    if args.command == "build-ext":
        from .codecs.cuda_build import BuildError, build

        try:
            print(build(force=args.force))
        except BuildError as err:
            print(f"cswap build-ext: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "demo":
        from .demo import run_demo

        result = run_demo(args.epochs, args.batch_size, args.width, args.device, _config(args))
        return 0 if result["gradients_equal"] else 1
    from .bench import run_step_bench

    run_step_bench(args.model, args.device, args.batch_size, args.steps, args.warmup, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
