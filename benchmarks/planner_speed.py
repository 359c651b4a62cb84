"""How long the planner takes to choose a mix, skipping the searches that cannot beat a plan
already found (``mix.choose_among``'s default) against searching everything (``prune=False``,
as before), the choices asserted the same:

- the engine's planning of a 32-layer Llama with LoRA (tiny shapes, sequence 64, a budget of a
  quarter of its saved activations): what its measured step gives the planner, which plans on
  the training thread;
- `cswap plan`'s planning of Llama-3-8B with LoRA at 8192 tokens on an H100 PCIe, at
  checkpointing's peak and at 75% fewer saved activations, lossless and with int8.

Each call the two make to ``mix.choose_among`` is recorded, then made again both ways with
replays of its own, timed in process time, its replays counted.

    .venv/bin/python benchmarks/planner_speed.py --out benchmarks/results/planner-speed-cpu-...

writes ``OUT.md`` and ``OUT.json`` (``--quick``: 4 layers, to see it run).
"""

from __future__ import annotations

import argparse
import sys
import time
from unittest import mock

import torch

import cswap_lightning as cswap
from cswap_lightning.commands.bench_finetune import SMALL, _saved_bytes
from cswap_lightning.commands.bench_step import script_meta, write_results
from cswap_lightning.planning import mix, models, sizing
from cswap_lightning.planning.devices import device
from cswap_lightning.planning.estimate import Setup, estimate


def recorded(run) -> list[tuple[tuple, dict]]:
    """The calls ``run()`` makes to ``mix.choose_among`` (their arguments)."""
    calls, original = [], mix.choose_among

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    with mock.patch.object(mix, "choose_among", record):
        run()
    return calls


def engine_calls(layers: int) -> list[tuple[tuple, dict]]:
    """The engine's planning calls for a tiny Llama with LoRA of ``layers`` layers."""
    torch.manual_seed(0)
    net = models.model("llama-3-8b", lora=models.LoRA(), layers=layers, overrides=SMALL).build()
    ids = torch.randint(0, SMALL["vocab_size"], (1, 64))
    batch = {"input_ids": ids, "labels": ids}
    budget = _saved_bytes(net, batch) // 4
    off = cswap.Offloader(cswap.CSwapConfig(budget=budget, min_bytes=0)).watch(net)

    def steps() -> None:
        for _ in range(5):
            with off:
                loss = net(**batch).loss
            loss.backward()

    calls = recorded(steps)
    off.close()
    return calls


def plan_calls(layers: int | None) -> list[tuple[tuple, dict]]:
    """`cswap plan`'s calls for Llama-3-8B with LoRA at 8192 tokens on an H100 PCIe."""
    est = estimate(Setup("llama-3-8b", 8192, 1, lora=models.LoRA(), layers=layers),
                   device("h100-pcie"))
    keep, checkpointing = sizing.baselines(est)
    budgets = [("checkpointing's peak", checkpointing.prediction.peak_bytes),
               ("75% lower", keep.prediction.peak_bytes - int(0.75 * est.saved_bytes))]
    return recorded(lambda: [sizing.mixes(est, budgets, lossy=lossy, clip=False)
                             for lossy in (None, "int8")])


def timed(args: tuple, kwargs: dict, prune: bool) -> tuple[mix.Choice, float, int]:
    """One recorded call made again: its choice, process seconds and replays."""
    count, original = [0], mix.predict

    def counting(*a, **k):
        count[0] += 1
        return original(*a, **k)

    with mock.patch.object(mix, "predict", counting):
        started = time.process_time()
        _, chosen = mix.choose_among(*args, **(kwargs | {"replays": mix.Replays(),
                                                         "prune": prune}))
        seconds = time.process_time() - started
    return chosen, seconds, count[0]


def measure(case: str, calls: list[tuple[tuple, dict]], log=print) -> dict:
    rows = []
    for args, kwargs in calls:
        everything, slow, slow_replays = timed(args, kwargs, prune=False)
        pruned, fast, fast_replays = timed(args, kwargs, prune=True)
        same = (pruned.how, pruned.prediction, pruned.fits) == (
            everything.how, everything.prediction, everything.fits)
        if not same:
            raise AssertionError(f"{case}: the pruned search chose {pruned.how!r}, the whole "
                                 f"search {everything.how!r}")
        rows.append({"how": pruned.how, "budget_bytes": args[1], "seconds": fast,
                     "replays": fast_replays, "seconds_searching_everything": slow,
                     "replays_searching_everything": slow_replays})
        log(f"{case}: {pruned.how}: {fast:.1f} s ({fast_replays} replays) against "
            f"{slow:.1f} s ({slow_replays})")
    return {"case": case, "calls": rows, "seconds": sum(r["seconds"] for r in rows),
            "seconds_searching_everything": sum(r["seconds_searching_everything"]
                                                for r in rows)}


def markdown(cases: list[dict]) -> str:
    lines = [("Process time on this machine; each call made again with replays of its own. "
              "The same mix chosen both ways, every call (asserted)."), "",
             ("| case | call: the mix chosen | searching everything | skipping what cannot "
              "win | faster |"), "|---|---|---:|---:|---:|"]
    for c in cases:
        for r in c["calls"]:
            lines.append(f"| {c['case']} | {r['how']} | {r['seconds_searching_everything']:.1f} "
                         f"s ({r['replays_searching_everything']} replays) | "
                         f"{r['seconds']:.1f} s ({r['replays']}) | "
                         f"{r['seconds_searching_everything'] / max(r['seconds'], 1e-9):.2f}x |")
        lines.append(f"| {c['case']} | all its calls | {c['seconds_searching_everything']:.1f} s "
                     f"| {c['seconds']:.1f} s | "
                     f"{c['seconds_searching_everything'] / max(c['seconds'], 1e-9):.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="OUT.md and OUT.json are written")
    p.add_argument("--quick", action="store_true", help="4 layers each: to see it run")
    args = p.parse_args(argv)
    layers = 4 if args.quick else None
    cases = [measure("the engine, a 32-layer Llama with LoRA (tiny shapes)"
                     if not args.quick else "the engine, 4 tiny layers",
                     engine_calls(layers or 32)),
             measure("cswap plan llama-3-8b --seq 8192 --lora"
                     + (f" --layers {layers}" if layers else ""), plan_calls(layers))]
    table = markdown(cases)
    print(table)
    meta = script_meta(__file__, argv, kind="measurement (process time on this CPU)")
    write_results(args.out, "The planner's search: skipping what cannot win", meta,
                  {"cases": cases}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
