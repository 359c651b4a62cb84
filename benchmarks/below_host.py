"""Host time per ATen operator of recomputation below the layer, beside plain training,
``torch.utils.checkpoint`` of the whole layer and torch's own selective activation
checkpointing (``create_selective_checkpoint_contexts``, saving the outputs of the matrix
products and attention: the peer to beat).

Host-bound on purpose: a Llama with tiny shapes (hidden 64, 2 heads, MLP 128, sequence 16,
fp32, random init) on one CPU thread, so a step is almost all Python and dispatch, the time
a GPU waits for where the kernels are short. Each layer runs under the method (the
embeddings, final norm and head plainly); "below" is ``core/selective.py`` as the engine runs
it, without the step's hooks (``Region(None)``), each layer's ``Choice`` made at its first
step (what it keeps: the fewest bytes, so rotary runs no more); "observed" is a plain step with the
``Observer`` the engine's measured steps run over each layer; "floor" is the whole layer
checkpointed with a dispatch mode that does nothing in forward and in the recomputation:
what any design built on dispatch modes pays before doing anything. "lean" and "lean whole"
are the engine's recomputation as it runs once a layer's first run without autograd is
watched and found fit (``core/lean.py``; ``recompute.checkpointed`` without the step's
hooks): below the layer, its choice settled, the first run under ``selective.Lean``; and the
whole layer.

Methods run interleaved (one step of each per round, after a garbage collection), timed in
CPU time of the thread (other processes disturb it far less than wall time); medians of the
forward and of the backward. The operators of each phase are counted once per method by a
dispatch mode outside everything (the calls that reach the kernels: for "below", a
placeholder's ``empty_strided`` and a kept output's ``detach`` stand for the calls it does not
run). Reported: microseconds per operator, and the extra time over plain training per
operator of the layers' forward (what each method's dispatch modes cost an operator).

    .venv/bin/python benchmarks/below_host.py --out benchmarks/results/below-host-cpu-...

writes ``OUT.md`` and ``OUT.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from cswap_lightning.commands.bench_step import result_meta, write_results
from cswap_lightning.commands.suite_cases import selective_context
from cswap_lightning.core.lean import Verdicts
from cswap_lightning.core.recompute import checkpointed
from cswap_lightning.core.rerun import Parts
from cswap_lightning.core.selective import Choice, Observer, Region
from cswap_lightning.planning.profiler import Clock

aten = torch.ops.aten
METHODS = ("plain", "whole", "sac", "below", "observed", "floor", "lean", "lean whole")


def llama(layers: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      num_hidden_layers=layers, vocab_size=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def below_call(forward: Callable, choice: Choice, *args, **kwargs):
    """``forward`` recomputed below the layer, as ``recompute.checkpointed`` runs a block
    (``choice``: the layer's, made at its first call)."""
    region, first = Region(None, choice=choice), [True]

    def body(*args, **kwargs):
        if first[0]:
            first[0] = False
            return forward(*args, **kwargs)
        with region.recomputing():
            return forward(*args, **kwargs)

    out = checkpoint(body, *args, use_reentrant=False, context_fn=region.contexts, **kwargs)
    region.close(out)
    return out


def engine_call(forward: Callable, layer: torch.nn.Module, verdicts: Verdicts, name: str,
                choice: Choice | None, *args, **kwargs):
    """``forward`` recomputed as the engine runs a block (``recompute.checkpointed``), its first
    run without autograd once watched (``verdicts``): below the layer (``choice``: the layer's,
    made at its first call, settled at its second) or whole (``choice`` None)."""
    region = None if choice is None else Region(None, choice=choice)
    return checkpointed(forward, Parts.of([layer], block=True), [], args, kwargs, None, region,
                        verdicts, name)


class Observing:
    """A plain step with an ``Observer`` over each layer, as the engine's measured steps."""

    def __init__(self) -> None:
        self.clock = Clock(torch.device("cpu"))
        self.open: list[Observer] = []

    def saw(self, t: torch.Tensor) -> torch.Tensor:
        for observer in self.open:
            observer.saw(t)
        return t

    def call(self, forward: Callable, *args, **kwargs):
        observer = Observer(self.clock, self.clock.device)
        self.open.append(observer.__enter__())
        try:
            out = forward(*args, **kwargs)
        finally:
            self.open.pop().__exit__(None, None, None)
        observer.finish(out)
        return out

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.saw, lambda t: t)


class Lean:
    """A model's layers run as the engine runs them: the verdicts of their first runs without
    autograd (``lean.py``), which a step's forward begins and ends, and each layer's choice
    below the layer (None: recomputed whole)."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        self.verdicts = Verdicts(lambda: model)
        self.choices: dict[str, Choice | None] = {}

    def without_autograd(self) -> int:
        """How many layers run first without autograd now."""
        return sum(self.verdicts.why.get(name) == "" and (c is None or c.settled is not None)
                   for name, c in self.choices.items())


def wrap(model: transformers.PreTrainedModel, method: str, observing: Observing) -> Lean:
    """Run each layer of ``model`` under ``method``."""
    lean = Lean(model)
    for i, layer in enumerate(model.model.layers):
        forward = layer.__class__.forward.__get__(layer)
        if method == "plain":
            run = forward
        elif method == "whole":
            run = functools.partial(checkpoint, forward, use_reentrant=False)
        elif method == "sac":
            run = functools.partial(checkpoint, forward, use_reentrant=False,
                                    context_fn=selective_context)
        elif method == "below":
            run = functools.partial(below_call, forward, Choice())
        elif method.startswith("lean"):
            name = f"layers.{i}"
            lean.choices[name] = None if method == "lean whole" else Choice()
            run = functools.partial(engine_call, forward, layer, lean.verdicts, name,
                                    lean.choices[name])
        elif method == "floor":
            run = functools.partial(checkpoint, forward, use_reentrant=False, context_fn=lambda: (
                Passing(), Passing()))
        else:
            run = functools.partial(observing.call, forward)
        layer.forward = run
    return lean


class Passing(TorchDispatchMode):
    """A dispatch mode that does nothing: what any mode costs an operator."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class LayerOps(TorchDispatchMode):
    """Counts the operators of the layers' forward (set ``on`` around them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.on
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="rounds before the first "
                        "measured (at least 3: a first run without autograd is watched first)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--label", default="", help="a note on the code measured (before/after)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    ids = torch.randint(0, 128, (1, args.seq), generator=torch.Generator().manual_seed(0))
    models, observing, leans = {}, Observing(), {}
    for m in methods:
        models[m] = llama(args.layers)
        leans[m] = wrap(models[m], m, observing)

    def step(m: str, count: bool = False) -> tuple[float, float, list[torch.Tensor]]:
        model = models[m]
        hooks = observing.hooks() if m == "observed" else contextlib.nullcontext()
        counter = Counting() if count else contextlib.nullcontext()
        begun = time.thread_time()
        leans[m].verdicts.begin(f"layers.{i}" for i in range(args.layers))
        with hooks, counter:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        leans[m].verdicts.end()
        forward = time.thread_time() - begun
        counted = [counter.count] if count else []
        counter = Counting() if count else contextlib.nullcontext()
        begun = time.thread_time()
        with counter:
            loss.backward()
        backward = time.thread_time() - begun
        if count:
            counted.append(counter.count)
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return forward, backward, counted or grads

    for _ in range(args.warmup):  # the engine's first runs without autograd: watched first
        for m in methods:
            step(m)
    reference = step("plain")[2] if "plain" in methods else None
    bitwise = {}
    for m in methods:
        grads = step(m)[2]
        bitwise[m] = reference is not None and all(
            torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    counts = {m: step(m, count=True)[2] for m in methods}
    layer_ops = LayerOps()
    plain_layers = models.get("plain") or llama(args.layers)
    for layer in plain_layers.model.layers:
        layer.register_forward_pre_hook(lambda *_: setattr(layer_ops, "on", True))
        layer.register_forward_hook(lambda *_: setattr(layer_ops, "on", False))
    with layer_ops:
        plain_layers(input_ids=ids, labels=ids, use_cache=False)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    gc.disable()
    try:
        for _ in range(args.rounds):
            for m in methods:
                gc.collect()
                times[m].append(step(m)[:2])
    finally:
        gc.enable()

    rows = []
    for m in methods:
        fwd = statistics.median(t[0] for t in times[m])
        bwd = statistics.median(t[1] for t in times[m])
        rows.append({"method": m, "forward_us": fwd * 1e6, "backward_us": bwd * 1e6,
                     "forward_ops": counts[m][0], "backward_ops": counts[m][1],
                     "bitwise": bitwise[m],
                     "layers_without_autograd": leans[m].without_autograd()})
    plain = next((r for r in rows if r["method"] == "plain"), None)
    for r in rows:
        r["forward_us_per_op"] = r["forward_us"] / r["forward_ops"]
        r["backward_us_per_op"] = r["backward_us"] / r["backward_ops"]
        if plain is not None:
            for phase in ("forward", "backward"):
                r[f"{phase}_extra_us_per_layer_op"] = (
                    (r[f"{phase}_us"] - plain[f"{phase}_us"]) / layer_ops.count)
    sac = next((r for r in rows if r["method"] == "sac"), None)
    if sac is not None:
        for r in rows:
            for key in ("forward_us", "backward_us", "forward_us_per_op", "backward_us_per_op",
                        "forward_extra_us_per_layer_op", "backward_extra_us_per_layer_op"):
                if key in r and sac.get(key):
                    r[f"{key}_vs_sac"] = r[key] / sac[key]
    meta = result_meta(torch.device("cpu"), kind="measurement, this CPU", label=args.label,
                       layers=args.layers, seq=args.seq, rounds=args.rounds,
                       layer_forward_ops=layer_ops.count,
                       shapes="Llama: hidden 64, 2 heads, MLP 128, vocab 128, fp32, SDPA")
    meta["command"] = " ".join(["python", "benchmarks/below_host.py", *sys.argv[1:]])
    write_results(args.out, "Host time per operator: recomputation below the layer", meta,
                  {"rows": rows}, markdown(rows, layer_ops.count))


def markdown(rows: list[dict], layer_ops: int) -> str:
    def x(r: dict, key: str) -> str:
        v = r.get(f"{key}_vs_sac")
        return "" if v is None else f" ({v:.2f}x)"

    note = ("Medians, CPU time of the thread; (Nx): against torch's selective checkpointing "
            "(sac). Extra: over plain training, per operator of the layers' forward "
            f"({layer_ops}).")
    head = ("| method | forward µs | ops | µs/op | extra µs/layer op | backward µs | ops "
            "| µs/op | extra µs/layer op | grads bitwise plain |")
    lines = [note, "", head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["method"]]
        for phase in ("forward", "backward"):
            extra = r.get(f"{phase}_extra_us_per_layer_op")
            cells += [f"{r[f'{phase}_us']:.0f}{x(r, f'{phase}_us')}", str(r[f"{phase}_ops"]),
                      f"{r[f'{phase}_us_per_op']:.1f}{x(r, f'{phase}_us_per_op')}",
                      "" if extra is None
                      else f"{extra:.1f}{x(r, f'{phase}_extra_us_per_layer_op')}"]
        cells.append("yes" if r["bitwise"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Layers run first without autograd (the engine's \"lean\" methods, measured "
              "after they were watched and, below the layer, their choice settled): "
              + ", ".join(f"{r['method']} {r['layers_without_autograd']}" for r in rows
                          if r["method"].startswith("lean")) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
