"""A training step as the replay (``replay.py``) sees it, read from a profile measured
without offload.

A profile (``profile-*.json.gz``; how they were made: ``evidence/h100-2026-11-24/README.md``)
lists every tensor autograd saved in forward, in order (module, bytes, storage bytes, whether
it is the first save of its storage, parameter or not, the allocator's bytes at that moment),
each leaf module's forward and backward times (CUDA events around module hooks), the
allocator's bytes when a module's backward began, forward and backward without any hook
(``plain_*_ms``), the allocator's bytes before the step and its peak. From it, a
:class:`Workload`:

- **ops**: runs of saves by one module, each storage saved once in a run (one autograd op, or a
  few of one module): the unit of compute, memory and events in the replay. The modules'
  times are scaled to sum to the plain totals (the hooks cost time; where the host fell
  behind, the device waited inside the modules it timed). Time spent outside any leaf module
  (attention's core, the loss) goes to the functions' runs saved there where the profile
  timed it (``capture``'s gaps), and is spread over the modules in proportion where not.
  Where it timed the host (a CUDA profile with ``forward_host_ms``), each op also has the
  host's time to issue its forward (``Op.host_s``, scaled to the host's plain forward) and
  its device time is no longer scaled up to the plain forward: the replay's host clock gives
  what the device waited for.
  Where the profile has no backward times (its backward hooks did not fire), an op's backward
  takes its forward time times the plain backward/forward ratio.
- **blocks**: what activation checkpointing recomputes: transformer layers (``...h.3``,
  ``...layer.3``), ResNet bottlenecks (``layer2.1``), and the stages of a plain ``Sequential``
  (``features.0`` ...), each ending at a max-pool (the op that saves int64 indices). The ops
  before, between and after them form blocks that cannot be recomputed. Where the profile
  says (an estimate's ``layers``), a layer also knows what recomputing it below the layer
  keeps and costs, each way the cut weighs its work (``Below``; ``Workload.with_below``
  weighs them).
- **the allocator's other bytes**: what it holds beside the step's start (weights, the batch)
  and the saved tensors. In forward, an op's (measured at its saves: outputs not yet saved,
  temporaries). In backward, the weights' gradients made so far, plus the op's activation
  gradients: the gradient of its output, measured at its module's backward hook where the
  profile has one (less the saved tensors and weight gradients then held), else as large as
  its largest saved activation; and the gradient of its input, which the op allocates, as large
  as its largest saved activation (at the loss: the logits' two gradients). Replayed without
  offload, this gives the profile's measured peak within 2% on the four H100 profiles.

A storage the step did not allocate (the batch, which the training loop holds) is found by
the allocator's count: at its first save, the bytes the step has allocated so far cannot hold
(half of) it beside the storages saved before. Moving such a tensor frees nothing.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

# A block recomputed below the layer (``core/selective.py``) is named as the block, and this.
BELOW = ":elementwise"


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saved in forward. ``below``: not saved by the plain step, but kept
    by a recomputation of its block below the layer (its inputs, the outputs of its matrix
    products, attention and convolutions), which is all that step saves for the block."""

    module: str  # the leaf module running when it was saved ("" outside any)
    dtype: str
    nbytes: int  # the tensor's own bytes
    storage_nbytes: int
    storage: int  # the index of the first saved tensor of its storage
    parameter: bool
    held: bool  # its storage was there before the step (the batch): moving it frees nothing
    below: bool = False

    @property
    def activation(self) -> bool:
        """Bytes the step allocated for forward and keeps for backward (counted once, at the
        first save of the storage)."""
        return not (self.parameter or self.held)


@dataclass(frozen=True)
class Op:
    """A run of saves by one module: the replay's unit of compute and memory."""

    module: str
    block: int  # index into Workload.blocks
    saves: range  # indices into Workload.saved
    forward_s: float
    backward_s: float
    forward_other: int  # allocator bytes beside the step's start and saved tensors, in forward
    backward_grads: int  # activation gradients while its backward runs
    weight_grads: int  # bytes of the weight gradients its backward makes
    # the host's seconds issuing its forward, where the profile measured them (0: the device
    # never waits for the host, and its forward time includes what it waited)
    host_s: float = 0.0


@dataclass(frozen=True)
class Below:
    """What recomputing a block below the layer one way keeps and costs: the bytes of each
    tensor it keeps (its inputs, then the outputs of its matrix products, attention and
    convolutions, or of the calls the cut chose instead; ``dtype``: theirs, as far as one is
    known), the forward seconds of the operators it runs again, and the weight of their work
    its cut was made with (``dataflow.Dataflow.cut``)."""

    kept: tuple[int, ...]
    seconds: float
    dtype: str = "float32"
    weight: float = 0.0

    def scaled(self, k: float) -> Below:
        return replace(self, kept=tuple(round(n * k) for n in self.kept),
                       seconds=self.seconds * k)


@dataclass(frozen=True)
class Block:
    """Ops that activation checkpointing recomputes together (``recomputable``), or the ops
    before, between or after such blocks. ``below``: what recomputing it below the layer
    would keep and cost each way (``dataflow.WEIGHTS``), where known; ``selective``:
    recomputed, it runs below the layer this way (``Workload.with_below``: its last op saves
    what that keeps)."""

    name: str
    ops: range  # indices into Workload.ops
    recomputable: bool
    parent: str = ""  # the unit this block was cut from (``Workload.with_units``), if any
    below: tuple[Below, ...] = ()
    selective: Below | None = None

    def recompute_s(self, ops: Sequence[Op], whole_scale: float = 1.0,
                    below_scale: float = 1.0) -> float:
        """What recomputing it costs: its forward once more (times ``whole_scale``:
        ``replay.Engine.recompute_scale``), or below the layer, its elementwise part (times
        ``below_scale``: ``replay.Engine.below_scale``)."""
        if self.selective is not None:
            return below_scale * self.selective.seconds
        return whole_scale * sum(op.forward_s for op in ops[self.ops.start:self.ops.stop])


@dataclass(frozen=True)
class Workload:
    """One training step measured without offload."""

    name: str
    batch: int
    saved: tuple[Saved, ...]
    ops: tuple[Op, ...]
    blocks: tuple[Block, ...]
    start_bytes: int  # allocated before the step: weights, the batch
    peak_bytes: int  # the profile's measured peak
    weight_bytes: int  # the weights autograd saved (each storage once)
    # saves backward asks for at once (one autograd node's, measured: ``StepTimer.together``),
    # all at the op of the latest of them: a recomputation asking for all its block kept
    together: tuple[tuple[int, ...], ...] = ()

    @cached_property
    def asked_early(self) -> tuple[dict[int, tuple[int, ...]], frozenset[int]]:
        """From ``together``: at each op, the saves of earlier ops one node asks for there
        (a group's, at the op of its latest), and all such saves; made once, for the replay."""
        asked_at: dict[int, tuple[int, ...]] = {}
        if not self.together:
            return asked_at, frozenset()
        op_of = {i: k for k, op in enumerate(self.ops) for i in op.saves}
        for group in self.together:
            first = max(op_of[i] for i in group)
            asked_at[first] = (*asked_at.get(first, ()),
                               *(i for i in group if op_of[i] != first))
        return asked_at, frozenset(i for saves in asked_at.values() for i in saves)

    @cached_property
    def save_facts(self) -> tuple[list[int], list[bool], list[bool]]:
        """Each save's storage, whether it is an activation, and whether only a recomputation
        below the layer keeps it: lists the replay reads at every op, made once."""
        return ([s.storage for s in self.saved], [s.activation for s in self.saved],
                [s.below for s in self.saved])

    @cached_property
    def storage_bytes(self) -> list[int]:
        """Each save's ``storage_nbytes``: made once, for the replay."""
        return [s.storage_nbytes for s in self.saved]

    @cached_property
    def below_saves(self) -> dict[int, tuple[int, ...]]:
        """Each block's saves that only a recomputation below the layer keeps (``Saved.below``),
        where it has any: made once, for the replay."""
        saves: dict[int, tuple[int, ...]] = {}
        for op in self.ops:
            below = tuple(i for i in op.saves if self.saved[i].below)
            if below:
                saves[op.block] = (*saves.get(op.block, ()), *below)
        return saves

    @cached_property
    def last_forward_op(self) -> dict[int, int]:
        """Each saved storage's last op in forward (the last that saves it): made once, for
        the replay."""
        return {self.saved[i].storage: k for k, op in enumerate(self.ops) for i in op.saves}

    @property
    def forward_s(self) -> float:
        return sum(op.forward_s for op in self.ops)

    @property
    def backward_s(self) -> float:
        return sum(op.backward_s for op in self.ops)

    @property
    def activation_bytes(self) -> int:
        """The saved tensors' bytes the step allocated (each storage once)."""
        return sum(s.storage_nbytes for i, s in enumerate(self.saved)
                   if s.storage == i and s.activation and not s.below)

    def block_input(self, block: int) -> int | None:
        """The storage checkpointing keeps for a block: its first saved activation's (the
        block's input, or the batch)."""
        for op in self.ops[self.blocks[block].ops.start:self.blocks[block].ops.stop]:
            for i in op.saves:
                if not (self.saved[i].parameter or self.saved[i].below):
                    return self.saved[i].storage
        return None

    def recompute_inputs(self, block: int) -> tuple[int, ...]:
        """The storages a recomputation of the block keeps: below the layer, what its last op
        saves; else its input (``block_input``)."""
        b = self.blocks[block]
        if b.selective is not None:
            return tuple(self.saved[i].storage for i in self.ops[b.ops.stop - 1].saves)
        first = self.block_input(block)
        return () if first is None else (first,)

    def with_below(self, way: int | Sequence[int] = 0) -> Workload:
        """The same step with each block that can be recomputed below the layer (``below``
        known) doing so the ``way``-th way when recomputed (one for every block, or one per
        block), named ``block:elementwise``: an op after its last saves what that keeps
        (``Saved.below``: only then), and the block as a whole is its ``parent`` (``merged``
        makes it whole again). Itself where no block is known."""
        ways = [way] * len(self.blocks) if isinstance(way, int) else list(way)
        if not any(len(b.below) > k and b.recomputable for b, k in zip(self.blocks, ways,
                                                                         strict=True)):
            return self
        saved, ops, blocks = list(self.saved), [], []
        for block, k_way in zip(self.blocks, ways, strict=True):
            start = len(ops)
            for k in block.ops:
                ops.append(replace(self.ops[k], block=len(blocks)))
            if len(block.below) <= k_way or not block.recomputable:
                blocks.append(replace(block, ops=range(start, len(ops))))
                continue
            below = block.below[k_way]
            first = len(saved)
            saved += [Saved(f"{block.name} (kept)", below.dtype, n, n, first + j, False,
                            False, True)
                      for j, n in enumerate(below.kept)]
            ops.append(Op(f"{block.name} (kept)", len(blocks), range(first, len(saved)),
                          0.0, 0.0, 0, 0, 0))
            blocks.append(replace(block, name=f"{block.name}{BELOW}", ops=range(start, len(ops)),
                                  parent=block.name, selective=below))
        return replace(self, saved=tuple(saved), ops=tuple(ops), blocks=tuple(blocks))

    def ways_below(self) -> tuple[Workload, ...]:
        """The step with its blocks recomputed below the layer each way (``with_below``) but
        those that keep and cost what an earlier way does; none where no block is known."""
        out: dict[tuple, Workload] = {}
        for way in range(max((len(b.below) for b in self.blocks), default=0)):
            w = self.with_below(way)
            same = tuple(b.selective and (b.selective.kept, b.selective.seconds)
                         for b in w.blocks)
            out.setdefault(same, w)
        return tuple(out.values())

    def with_units(self, unit: Callable[[Op], bool]) -> Workload:
        """The same step with finer units of recomputation: each op for which ``unit`` holds
        (an activation module inside a layer, say) is a block of its own, and the rest of a
        block that held one cannot be recomputed alone; each piece names that block its
        ``parent``, which ``merged`` makes whole again."""
        blocks: list[Block] = []
        block_of: list[int] = []
        for block in self.blocks:
            cuts = [k for k in block.ops if unit(self.ops[k])]
            if not cuts:
                block_of += [len(blocks)] * len(block.ops)
                blocks.append(block)
                continue
            start, parent = block.ops.start, block.name if block.recomputable else ""
            for k in [*cuts, block.ops.stop]:
                if k > start:
                    block_of += [len(blocks)] * (k - start)
                    blocks.append(Block(f"{block.name} [{start - block.ops.start}:"
                                        f"{k - block.ops.start}]", range(start, k), False,
                                        parent))
                if k < block.ops.stop:
                    block_of.append(len(blocks))
                    blocks.append(Block(self.ops[k].module, range(k, k + 1), True, parent))
                start = k + 1
        ops = tuple(replace(op, block=b) for op, b in zip(self.ops, block_of, strict=True))
        return replace(self, ops=ops, blocks=tuple(blocks))

    def merged(self, parents: Collection[str]) -> Workload:
        """The blocks cut from each of ``parents`` made one recomputable block again (named
        as the parent); a workload with no such pieces is itself."""
        if not any(block.parent in parents for block in self.blocks):
            return self
        blocks: list[Block] = []
        block_of: list[int] = []
        for block in self.blocks:
            whole = block.parent in parents
            if whole and blocks and blocks[-1].name == block.parent:
                last = blocks[-1]
                blocks[-1] = replace(last, ops=range(last.ops.start, block.ops.stop))
            else:
                blocks.append(Block(block.parent, block.ops, True, below=block.below)
                              if whole else block)
            block_of += [len(blocks) - 1] * len(block.ops)
        ops = tuple(replace(op, block=b) for op, b in zip(self.ops, block_of, strict=True))
        return replace(self, ops=ops, blocks=tuple(blocks))

    def scaled(self, batch: int) -> Workload:
        """The same step at another batch size: activations, the batch, the allocator's other
        bytes and compute times in proportion (weights and their gradients as they are)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        k = batch / self.batch

        def size(n: int) -> int:
            return round(n * k)

        saved = tuple(s if s.parameter else replace(s, nbytes=size(s.nbytes),
                                                     storage_nbytes=size(s.storage_nbytes))
                      for s in self.saved)
        ops = tuple(replace(op, forward_s=op.forward_s * k, backward_s=op.backward_s * k,
                            forward_other=size(op.forward_other),
                            backward_grads=size(op.backward_grads)) for op in self.ops)
        blocks = tuple(replace(b, below=tuple(way.scaled(k) for way in b.below),
                               selective=None if b.selective is None else b.selective.scaled(k))
                       for b in self.blocks)
        batch_bytes = sum(s.storage_nbytes for i, s in enumerate(self.saved)
                          if s.storage == i and s.held)
        return replace(self, name=f"{self.name} at batch {batch}", batch=batch, saved=saved,
                       ops=ops, blocks=blocks,
                       start_bytes=self.start_bytes + size(batch_bytes) - batch_bytes,
                       peak_bytes=size(self.peak_bytes - self.start_bytes) + self.start_bytes)


# -- reading a profile ------------------------------------------------------------------------
_LAYER = re.compile(r"^((?:.*\.)?(?:h|layer|layers|blocks)\.\d+|layer\d+\.\d+)\.")
_SEQUENTIAL_CHILD = re.compile(r"^(.+)\.\d+$")
_INDICES = "int64"  # what a max-pool saves beside its input


def layer_of(module: str) -> str | None:
    """The layer (a block activation checkpointing recomputes: ``...h.3``, ``...layers.3``,
    ``layer2.1``) a module is, or is inside; None outside every layer."""
    match = _LAYER.match(f"{module}.")
    return match.group(1) if match else None


def load(path: str | Path) -> Workload:
    """The workload of a ``profile-*.json.gz`` (or ``.json``) file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    try:
        return from_profile(data)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a profile of the expected schema ({err!r}); see "
                         "cswap_lightning/planning/evidence/h100-2026-11-24/README.md") from err


def from_profile(data: dict) -> Workload:
    """The workload of a profile's parsed JSON."""
    start = data["allocated_before_step"]
    saved = _saved(data["saved"], start)
    runs = _runs(saved)
    blocks, block_of_run = _blocks(saved, runs)
    modules = data["modules"]
    forward_s, backward_s, host_s = _times(data, saved, runs)
    forward_other = _forward_other(data["saved"], saved, runs, start)
    # a frozen weight (LoRA's base) makes no gradient; profiles without the key train all
    trained = [row.get("requires_grad", True) for row in data["saved"]]
    weight_grads = [sum(saved[i].storage_nbytes for i in run
                        if saved[i].parameter and saved[i].storage == i and trained[i])
                    for run in runs]
    output_grads = _measured_output_grads(modules, saved, runs, start, weight_grads)
    ops = []
    for k, run in enumerate(runs):
        largest = max((saved[i].storage_nbytes for i in run if not saved[i].parameter),
                      default=0)
        output_grad = largest if output_grads[k] is None else output_grads[k]
        ops.append(Op(saved[run[0]].module, block_of_run[k], run, forward_s[k], backward_s[k],
                      forward_other[k], output_grad + largest, weight_grads[k], host_s[k]))
    name = data["name"]
    batch = re.search(r"-b(\d+)$", name)
    return Workload(name, int(batch.group(1)) if batch else 1, saved, tuple(ops),
                    _with_layers(blocks, ops, data.get("layers", ())), start,
                    data["peak_allocated"], sum(weight_grads))


def _with_layers(blocks: tuple[Block, ...], ops: Sequence[Op], layers: Sequence[dict]
                 ) -> tuple[Block, ...]:
    """The blocks, each layer with what recomputing it below the layer keeps and costs each
    way, where the profile says (an estimate's ``layers``): its elementwise share of its
    forward."""
    found = {layer["layer"]: layer for layer in layers}
    out = []
    for block in blocks:
        layer = found.get(block.name) if block.recomputable else None
        if layer and layer["forward_ms"] > 0:
            forward_s = sum(op.forward_s for op in ops[block.ops.start:block.ops.stop])
            block = replace(block, below=tuple(
                Below((layer["input_bytes"], *way["kept"]),
                      way["elementwise_forward_ms"] / layer["forward_ms"] * forward_s,
                      way["kept_dtype"] or "float32", way["weight"])
                for way in layer["below"]))
        out.append(block)
    return tuple(out)


def _saved(rows: Sequence[dict], start: int) -> tuple[Saved, ...]:
    """Each saved tensor with its storage found: a later save of a storage shares it with the
    latest first save of as many bytes (the profile marks first saves, not which storage)."""
    saved: list[Saved] = []
    latest: dict[int, int] = {}  # storage bytes -> index of the latest first save
    fresh = 0  # bytes of the storages the step allocated and saved so far
    for i, row in enumerate(rows):
        size = row["storage_nbytes"]
        if row["first_of_storage"]:
            storage = latest[size] = i
            # held: the bytes the step allocated so far cannot hold half of it beside the
            # storages saved before (a margin for buffers and the allocator's rounding)
            held = not row["parameter"] and row["allocated"] - start < fresh + size // 2
            if not (row["parameter"] or held):
                fresh += size
        elif size in latest:
            storage = latest[size]
            held = saved[storage].held
        else:
            raise ValueError(f"saved tensor {i} ({row['module']!r}) shares a storage of "
                             f"{size} bytes that no earlier tensor was the first save of")
        saved.append(Saved(row["module"], row["dtype"], row["nbytes"], size, storage,
                           row["parameter"], held))
    return tuple(saved)


def _runs(saved: Sequence[Saved]) -> list[range]:
    """Saves cut where the module changes or a storage comes again (a new op of the module)."""
    runs: list[range] = []
    begin, storages = 0, set()
    for i, s in enumerate(saved):
        if i > begin and (s.module != saved[begin].module or s.storage in storages):
            runs.append(range(begin, i))
            begin, storages = i, set()
        storages.add(s.storage)
    if saved:
        runs.append(range(begin, len(saved)))
    return runs


def _blocks(saved: Sequence[Saved], runs: Sequence[range]) -> tuple[tuple[Block, ...], list[int]]:
    """Blocks over the runs, and each run's block."""
    keys: list[str | None] = []  # the recomputable block of each run, or None
    stage: dict[str, int] = {}  # a Sequential -> the stage its children are in
    for run in runs:
        module = saved[run[0]].module
        layer, child = _LAYER.match(module), _SEQUENTIAL_CHILD.match(module)
        if not module:  # a function outside any leaf module: part of what runs around it
            key = keys[-1] if keys else None
        elif layer:
            key = layer.group(1)
        elif child:
            parent = child.group(1)
            key = f"{parent} stage {stage.setdefault(parent, 0)}"
            if any(saved[i].dtype == _INDICES for i in run):  # a max-pool ends the stage
                stage[parent] += 1
        else:
            key = None
        keys.append(key)
    unfinished = {f"{parent} stage {n}" for parent, n in stage.items()}  # after the last pool
    keys = [None if key in unfinished else key for key in keys]
    blocks: list[Block] = []
    block_of_run: list[int] = []
    for k, key in enumerate(keys):
        if k and key == keys[k - 1]:
            blocks[-1] = replace(blocks[-1], ops=range(blocks[-1].ops.start, k + 1))
        else:
            blocks.append(Block(key or "", range(k, k + 1), key is not None))
        block_of_run.append(len(blocks) - 1)
    return tuple(_named_span(b, saved, runs) for b in blocks), block_of_run


def _named_span(block: Block, saved: Sequence[Saved], runs: Sequence[range]) -> Block:
    """A block that cannot be recomputed is named by its first and last modules."""
    if block.recomputable:
        return block
    first = saved[runs[block.ops.start][0]].module or "(functions)"
    last = saved[runs[block.ops.stop - 1][0]].module or "(functions)"
    return replace(block, name=first if first == last else f"{first} .. {last}")


def _times(data: dict, saved: Sequence[Saved], runs: Sequence[range]
           ) -> tuple[list[float], list[float], list[float]]:
    """Each run's forward and backward seconds, scaled to the plain totals (module docstring),
    and its host's seconds in forward: a module's time is split evenly over its runs; a
    module that saved nothing (dropout at rate 0, a pooling that keeps nothing) adds its time
    to the module registered before it. Where the profile timed the gaps between leaf modules
    (``capture``: ``forward_after_ms``), a leaf's gaps go to the functions' runs saved in them
    (attention after its projections, the loss after the head), or to its own runs where
    those saved nothing; older profiles leave that time to the scaling, spread over every
    module. Where it timed the host too (``forward_host_ms``), the host's times are scaled to
    its plain forward, and the forward's device times no more than down to theirs: the
    replay's host clock then makes what the device waited for the host."""
    modules, rows = data["modules"], data["saved"]
    runs_of: dict[str, list[int]] = {}
    after_of: dict[str, list[int]] = {}  # a leaf -> the functions' runs saved after it
    for k, run in enumerate(runs):
        module = saved[run[0]].module
        runs_of.setdefault(module, []).append(k)
        if not module and "after" in rows[run[0]]:
            after_of.setdefault(rows[run[0]]["after"], []).append(k)
    forward, backward, host = ([0.0] * len(runs) for _ in range(3))

    def add(targets: list[int], forward_ms: float, backward_ms: float, host_ms: float) -> None:
        for k in targets:
            forward[k] += forward_ms / len(targets)
            backward[k] += backward_ms / len(targets)
            host[k] += host_ms / len(targets)

    owner: str | None = None
    for m in modules:
        name = m["module"]
        if name in runs_of:
            owner = name
        target = runs_of.get(name) or (runs_of[owner][-1:] if owner else [0])
        add(target, m["forward_ms"], m["backward_ms"], m.get("forward_host_ms", 0.0))
        add(after_of.get(name) or target, m.get("forward_after_ms", 0.0),
            m.get("backward_after_ms", 0.0), m.get("forward_after_host_ms", 0.0))
    add(after_of.get("") or [0], data.get("forward_lead_ms", 0.0),
        data.get("backward_lead_ms", 0.0), data.get("forward_lead_host_ms", 0.0))
    plain_forward, plain_backward = data["plain_forward_ms"] / 1e3, data["plain_backward_ms"] / 1e3
    total_forward, total_backward, total_host = sum(forward), sum(backward), sum(host)
    if total_forward <= 0:
        raise ValueError("the profile's modules have no forward time")
    # on the CPU the device's clock is the host's: nothing for a host clock to add
    timed_host = (total_host > 0 and "plain_host_forward_ms" in data
                  and data.get("device") != "cpu")
    # with the host timed, the rest of the plain forward was the device waiting for it
    device_forward = min(plain_forward, total_forward / 1e3) if timed_host else plain_forward
    forward = [t / total_forward * device_forward for t in forward]
    if total_backward > 0:
        backward = [t / total_backward * plain_backward for t in backward]
    else:
        backward = [t * plain_backward / device_forward for t in forward]
    host = ([t / total_host * data["plain_host_forward_ms"] / 1e3 for t in host] if timed_host
            else [0.0] * len(runs))
    return forward, backward, host


def _forward_other(rows: Sequence[dict], saved: Sequence[Saved], runs: Sequence[range],
                   start: int) -> list[int]:
    """Each run's most allocator bytes at its saves beyond the step's start and the saved
    storages the step allocated so far."""
    other, fresh = [], 0
    for run in runs:
        most = 0
        for i in run:
            s = saved[i]
            if s.storage == i and s.activation:
                fresh += s.storage_nbytes
            most = max(most, rows[i]["allocated"] - start - fresh)
        other.append(most)
    return other


def _measured_output_grads(modules: Sequence[dict], saved: Sequence[Saved],
                           runs: Sequence[range], start: int,
                           weight_grads: Sequence[int]) -> list[int | None]:
    """Each run's activation gradients when its backward begins, as its module's backward hook
    measured them (the allocator's bytes then, less the step's start, the saved storages
    still held and the weight gradients made so far), where its module had one run and one
    backward; None elsewhere."""
    measured: list[int | None] = [None] * len(runs)
    count: dict[str, int] = {}
    for run in runs:
        count[saved[run[0]].module] = count.get(saved[run[0]].module, 0) + 1
    at = {m["module"]: m["backward_allocated"][0] for m in modules
          if len(m["backward_allocated"]) == 1 and count.get(m["module"]) == 1}
    alive = {i: s.storage_nbytes for i, s in enumerate(saved) if s.storage == i and s.activation}
    last_use = {}  # storage -> the earliest run that saved it: backward frees it there
    for k, run in enumerate(runs):
        for i in run:
            last_use.setdefault(saved[i].storage, k)
    grads = 0
    held = sum(alive.values())
    for k in range(len(runs) - 1, -1, -1):
        module = saved[runs[k][0]].module
        if module in at:
            measured[k] = max(at[module] - start - held - grads, 0)
        grads += weight_grads[k]
        for i in runs[k]:
            storage = saved[i].storage
            if last_use[storage] == k and storage in alive:
                held -= alive.pop(storage)
    return measured
