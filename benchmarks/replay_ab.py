"""The replay's speed, this checkout against another commit's, on the replays the planner
makes, every prediction asserted the same.

The planner replays the step once per mix it weighs: `cswap plan` thousands of times for a
32-layer model, and the engine on the training thread when it plans a budget. A change to
the replay (``planning/replay.py``) is measured here: the calls to ``replay.predict`` that
`cswap plan`'s planning and the engine's make are recorded (their workloads, mixes, links
and settings), then each is replayed by this checkout's replay and by the other commit's
(``git archive``, imported as ``cswap_base`` beside this one, its ``_Replay`` given the same
objects). Every prediction must be the same, field by field: a faster replay that predicts
otherwise is a different replay. Two measures, as ``engine_ab.py``'s:

- ``--measure time``: the two sides alternately, process time, the fastest of ``--rounds``;
- ``--measure instructions`` (the steady one on this drifting machine): every ``--every``-th
  replay of each case, pickled, replayed by each side in a process of its own under
  valgrind's callgrind, instrumentation on for the replays alone.

- ``cswap plan``: Llama-3-8B with LoRA, sequence 8192 (``--layers``, 8 by default), an H100
  PCIe, at half the peak without help and at checkpointing's peak, lossless and with int8;
  GPT-2 medium (sequence 1024, batch 8) and ResNet-50 (batch 128) at checkpointing's peak;
- the engine: a 32-layer Llama with LoRA (tiny shapes, sequence 64) planning a budget of a
  quarter of its saved activations (``planner_speed.py``'s case).

    .venv/bin/python benchmarks/replay_ab.py --base HEAD --out benchmarks/results/replay-ab-...

writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ab import callgrind, git, instrumented, package_at
from planner_speed import engine_calls

from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.planning import mix, models, replay, sizing
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import Setup, estimate


def recorded(run) -> list[tuple]:
    """The replays ``run()`` has the planner make: (workload, mix, link, engine) each."""
    calls, original = [], mix.predict

    def record(workload, plan, link, engine):
        calls.append((workload, plan, link, engine))
        return original(workload, plan, link, engine)

    with mock.patch.object(mix, "predict", record):
        run()
    return calls


def plan_cases(layers: int) -> dict[str, list[tuple]]:
    """`cswap plan`'s replays, by case."""
    cases = {}
    setups = [(f"llama-3-8b, {layers} layers, LoRA, sequence 8192",
               Setup("llama-3-8b", 8192, 1, lora=models.LoRA(), layers=layers), ("half", "ckpt"),
               (None, "int8")),
              ("gpt2-medium, sequence 1024, batch 8", Setup("gpt2-medium", 1024, 8), ("ckpt",),
               (None,)),
              ("resnet50, batch 128", Setup("resnet50", 224, 128), ("ckpt",), (None,))]
    for name, setup, where, lossies in setups:
        est = estimate(setup, device("h100-pcie"))
        keep, checkpointing = sizing.baselines(est)
        budgets = {"half": ("half the peak", keep.prediction.peak_bytes // 2),
                   "ckpt": ("checkpointing's peak", checkpointing.prediction.peak_bytes)}
        cases[name] = recorded(lambda est=est, where=where, lossies=lossies, budgets=budgets: [
            sizing.mixes(est, [budgets[w] for w in where], lossy=lossy, clip=False)
            for lossy in lossies])
        print(f"{name}: {len(cases[name])} replays recorded", flush=True)
    return cases


def engine_case() -> list[tuple]:
    """The engine's replays planning a tiny 32-layer Llama's budget."""
    calls = engine_calls(32)  # its calls to mix.choose_among, made again here to record
    return recorded(lambda: [mix.choose_among(*args, **(kwargs | {"replays": mix.Replays()}))
                             for args, kwargs in calls])


def fields(prediction: object) -> dict:
    """A prediction's fields by name (one side may have fields the other has not)."""
    return dataclasses.asdict(prediction)


def replayed(module: object, calls: list[tuple]) -> list[dict]:
    """Each call replayed by ``module`` (a package's ``planning.replay``): its fields."""
    return [fields(module._Replay(w, p, lk, e, False).run()) for w, p, lk, e in calls]


def same(case: str, mine: list[dict], theirs: list[dict]) -> None:
    """Every field both sides have, the same in every replay."""
    for n, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if {k: a[k] for k in a.keys() & b.keys()} != {k: b[k] for k in a.keys() & b.keys()}:
            raise SystemExit(f"{case}: replay {n} predicts otherwise:\n this {a}\n base {b}")


def by_time(case: str, calls: list[tuple], base_replay: object, rounds: int) -> dict:
    """Each call replayed by both, alternately, ``rounds`` times; the fastest round's total
    each side."""
    times: dict[str, list[float]] = {"base": [], "this": []}
    got = {}
    for r in range(rounds):
        for side in ("base", "this") if r % 2 else ("this", "base"):
            started = time.process_time()
            got[side] = replayed(base_replay if side == "base" else replay, calls)
            times[side].append(time.process_time() - started)
        same(case, got["this"], got["base"])
    base, this = min(times["base"]), min(times["this"])
    print(f"{case}: {len(calls)} replays, base {base:.2f} s, this {this:.2f} s, "
          f"{base / this:.2f}x", flush=True)
    return {"case": case, "replays": len(calls), "base": base, "this": this,
            "faster": base / this}


def one_side(base: str, side: str, calls_file: str, out_file: str) -> None:
    """Under callgrind: the pickled calls replayed by one side, instrumentation on for the
    replays alone; their fields pickled to ``out_file``."""
    with open(calls_file, "rb") as f:
        calls = pickle.load(f)
    with tempfile.TemporaryDirectory() as folder:
        module = package_at(base, folder).planning.replay if side == "base" else replay
        replayed(module, calls[:1])  # what runs once (imports, cached properties) left out
        with instrumented():
            got = replayed(module, calls)
    with open(out_file, "wb") as f:
        pickle.dump(got, f)


def by_instructions(case: str, calls: list[tuple], base: str, every: int) -> dict:
    """Every ``every``-th call replayed by each side under callgrind; instructions each."""
    subset = calls[::every]
    counts, got = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/calls", "wb") as f:
            pickle.dump(subset, f)

        def run(side: str) -> None:
            counts[side] = callgrind(__file__, ["--one-side", side, "--base", base, "--calls",
                                                f"{folder}/calls", "--fields",
                                                f"{folder}/{side}.fields"], side)
            with open(f"{folder}/{side}.fields", "rb") as f:
                got[side] = pickle.load(f)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(run, ("base", "this")))
    same(case, got["this"], got["base"])
    print(f"{case}: {len(subset)} replays, base {counts['base'] / len(subset):.0f}, this "
          f"{counts['this'] / len(subset):.0f} instructions a replay, "
          f"{counts['base'] / counts['this']:.2f}x", flush=True)
    return {"case": case, "replays": len(subset), "base": counts["base"] / len(subset),
            "this": counts["this"] / len(subset), "faster": counts["base"] / counts["this"]}


def markdown(rows: list[dict], args: argparse.Namespace, head: str) -> str:
    if args.measure == "time":
        what = (f"process time on this CPU, the two alternately, the fastest of {args.rounds} "
                "rounds each")
        unit, digits = "s, all its replays", 2
    else:
        what = (f"instructions (valgrind's callgrind), every {args.every}th replay, each side "
                "in a process of its own")
        unit, digits = "instructions a replay", 0
    lines = [(f"The planner's recorded replays replayed by this checkout ({head} and its "
              f"working tree) and by {args.base}: {what}; every prediction the same, field by "
              "field (asserted)."), "",
             f"| case | replays | base ({unit}) | this ({unit}) | faster |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['replays']} | {r['base']:.{digits}f} | "
                     f"{r['this']:.{digits}f} | {r['faster']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with")
    parser.add_argument("--layers", type=int, default=8, help="Llama-3-8B's layers")
    parser.add_argument("--measure", choices=("time", "instructions"), default="time")
    parser.add_argument("--rounds", type=int, default=3, help="alternate rounds (time)")
    parser.add_argument("--every", type=int, default=20,
                        help="replay every so many recorded calls (instructions)")
    parser.add_argument("--no-engine", action="store_true", help="only `cswap plan`'s cases")
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    for hidden in ("--one-side", "--calls", "--fields"):  # a callgrind run's
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.base = git("rev-parse", "--short", args.base)
    torch.set_num_threads(1)
    if args.one_side:
        one_side(args.base, args.one_side, args.calls, args.fields)
        return
    cases = plan_cases(args.layers)
    if not args.no_engine:
        cases["the engine, a 32-layer Llama with LoRA (tiny shapes)"] = engine_case()
    if args.measure == "time":
        with tempfile.TemporaryDirectory() as folder:
            base_replay = package_at(args.base, folder).planning.replay
            rows = [by_time(case, calls, base_replay, args.rounds)
                    for case, calls in cases.items()]
    else:
        rows = [by_instructions(case, calls, args.base, args.every)
                for case, calls in cases.items()]
    head = git("rev-parse", "--short", "HEAD")
    text = markdown(rows, args, head)
    print(text)
    if args.out:
        meta = result_meta(torch.device("cpu"), kind="measurement, this CPU (planning time)",
                           base=args.base, head=head, measure=args.measure)
        meta["command"] = " ".join(["benchmarks/replay_ab.py", *(argv or sys.argv[1:])])
        write_results(args.out, "The replay's speed, against a base commit", meta,
                      {"cases": rows}, text)


if __name__ == "__main__":
    main()
