"""The replay: one training step simulated under a plan, to predict its time and peak memory.

A plan decides per block (``workload.py``: a transformer layer, a ResNet bottleneck, a VGG
stage, or the ops around them): keep its saved tensors on the device, swap them to host memory
(raw, or through a codec of some ratio and speed), or recompute the block in backward from its
input (kept, or swapped), as activation checkpointing does; a layer recomputed below the layer
(``Block.selective``) keeps its input and its matmuls' and attention's outputs instead (kept,
or swapped) and runs only its elementwise work again. The replay runs the step as the
engine (``core/step.py``, ``core/transfer.py``) and PyTorch run it:

- forward issues each op on the compute stream; each storage a swapped block saves is copied
  out on the device-to-host stream after the op that saved it (encoded first for a codec),
  one copy after another at the link's speed. Forward lets go of the original once its op is
  done; the host waits, and with it forward, when the bytes it has left in flight would pass
  ``inflight_bytes``. A storage saved again later is moved once (the engine's de-duplication).
- backward runs the ops in reverse order, each after the saved tensors it needs are back: a
  swapped storage is restored on the host-to-device stream when an op needs it, unless it was
  prefetched; a storage's first use prefetches the next ones in backward's order while the
  prefetched bytes not yet used stay within ``prefetch_bytes`` (one always goes). Storages
  one autograd node asked for at once on the measured step (``Workload.together``: a block's
  recomputation asking for all it kept) all come back when backward reaches the latest of
  them, and its op waits for every one. A restored copy lives until its op is done: a
  storage two ops saved comes back twice, as on the H100
  (``evidence/h100-2026-11-24/trace-raw-all.summary.json``: GPT-2's 13.8 GB out and 15.8 GB
  back, which the replay gives to the byte). A recomputed block runs its forward again before
  its first op in backward (after its input is back, if swapped); its saved tensors then live
  until their ops in backward are done. The host never waits in backward (on the H100 it
  finished backward at 391 ms of a 564 ms step): its restores queue at once, and the device
  runs them in order.
- the optimizer (SGD: reads weights and gradients, writes weights) ends the step at the
  device's copy bandwidth.

Memory is counted as ``torch.cuda.max_memory_allocated`` counts it (the measured peaks are
that): a tensor from its allocation until the program drops it, in program order. An original
being copied out is free by that count once forward drops it, though the allocator cannot
reuse its memory before the copy ends (up to ``inflight_bytes`` more device memory in use than
the peak says): ``held_peak_bytes`` counts those too. At each op the allocator also holds
what the workload measured or modelled beside the saved tensors (its temporaries in forward;
weight gradients so far and activation gradients in backward).

The engine's host time per moved tensor (its pack and unpack hooks, the copies' launches:
66.1 us on the H200, 99.3 before its transfer path made fewer CUDA calls, 188 us on the
H100) moves the host clock, half at the copy out and half at the unpack: where it adds up
past the device's work, the step waits for the host. The two directions never copy at once
here, as in the engine: backward's first restore waits for forward's last copy out (on the
H200 each direction ran at 50.3 GB/s with the other busy, 55.0 alone). A codec's encoding
runs on a lane of its own, as the engine queues it on its compress stream: the copy out
waits for its tensor's encoding, and the next tensor encodes while this one is copied;
decoding takes the copy back's lane (the engine decodes on the restore stream). A codec
whose encoding reads a size back to the host (the reference zvc and rle: ``Codec.waits``)
holds forward until its encoding is done. What the kernels take from compute's SMs is not
modelled; until a GPU measurement says which is nearer, ``Engine.codec_kernels`` can put
them in the copy's lane (as the replay did before) or on the compute stream's clock
instead. Where a profile timed the host too (``Op.host_s``: captured CUDA profiles that
hold ``forward_host_ms``, and the engine's own measured steps on CUDA, their host's time
outside the pack hooks), the host clock also moves by each op's time to issue
its forward: an op cannot end before the host has issued it, so a forward the host sets the
pace of waits for it, and the engine's host time per moved tensor adds to that; recomputing a
block costs the longer of its kernels and the host's issuing them again. A profile without (the
evidence committed before, every estimate) leaves the host out of forward, its device times
scaled to include what the device waited for. Not modelled: the host's time in backward
but for restores and recomputation, and the allocator's fragmentation. Every figure the
replay gives is a prediction, not a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..config import AUTO_INFLIGHT_BYTES, MAX_STORAGE_TO_VIEW_RATIO, CSwapConfig
from .workload import Block, Op, Workload

GB = 1e9


@dataclass(frozen=True)
class Link:
    """Bytes per second each way between device and host memory (measured on the H100 PCIe:
    53.4-54.9 GB/s, also under compute load), and of a device-to-device copy (bytes copied)."""

    d2h: float = 54 * GB
    h2d: float = 54 * GB
    device: float = 1440 * GB

    def __post_init__(self) -> None:
        for name in ("d2h", "h2d", "device"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Link.{name} must be > 0 bytes per second, "
                                 f"got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Codec:
    """How a swapped tensor travels: ``ratio`` of its bytes stored, encoded before the copy
    out and decoded after the copy back at these speeds (bytes of the tensor per second);
    ``waits``: the host waits for its encoding (a compaction that reads a size back)."""

    name: str = "raw"
    ratio: float = 1.0
    encode: float = math.inf
    decode: float = math.inf
    waits: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.ratio:
            raise ValueError(f"Codec {self.name!r}: ratio must be > 0, got {self.ratio!r}")
        if not (self.encode > 0 and self.decode > 0):
            raise ValueError(f"Codec {self.name!r}: encode and decode speeds must be > 0 "
                             f"bytes per second, got {self.encode!r} and {self.decode!r}")


RAW = Codec()
Action = Literal["keep", "swap", "recompute"]


@dataclass(frozen=True)
class BlockDecision:
    """What to do with a block's saved tensors. ``codec``: how they (for ``"recompute"``: its
    input, if ``swap_input``) are swapped."""

    action: Action = "keep"
    codec: Codec = RAW
    swap_input: bool = False

    def __post_init__(self) -> None:
        if self.action not in ("keep", "swap", "recompute"):
            raise ValueError(f"BlockDecision.action must be 'keep', 'swap' or 'recompute', "
                             f"got {self.action!r}")
        if self.swap_input and self.action != "recompute":
            raise ValueError("BlockDecision.swap_input is for action='recompute' (a recomputed "
                             f"block's input), got action={self.action!r}")


KEEP = BlockDecision("keep")
SWAP = BlockDecision("swap")
RECOMPUTE = BlockDecision("recompute")


@dataclass(frozen=True)
class Mix:
    """A mix the planner weighs: a decision per block (by name), ``default`` for the others.
    The one it chooses becomes the engine's ``plan.Plan`` (its recomputed blocks and swaps)."""

    default: BlockDecision = KEEP
    blocks: Mapping[str, BlockDecision] = field(default_factory=dict)

    def decisions(self, workload: Workload) -> list[BlockDecision]:
        """Each of the workload's blocks' decision: ``default`` recomputes only the blocks that
        can be recomputed (the others keep); a block named to be recomputed must be one."""
        names = [b.name for b in workload.blocks]
        unknown = sorted(set(self.blocks) - set(names))
        if unknown:
            raise ValueError(f"the plan names blocks {unknown} that {workload.name} does not "
                             f"have; its blocks: {names}")
        decisions = []
        for block in workload.blocks:
            decision = self.blocks.get(block.name, self.default)
            if decision.action == "recompute" and not block.recomputable:
                if block.name in self.blocks:
                    raise ValueError(f"block {block.name!r} of {workload.name} cannot be "
                                     "recomputed (only layers, bottlenecks and stages can)")
                decision = KEEP
            decisions.append(decision)
        return decisions


def no_offload() -> Mix:
    return Mix()


def checkpoint_all(offload_inputs: bool = False) -> Mix:
    """Activation checkpointing around every block that can be recomputed, inputs kept
    (``offload_inputs``: each swapped raw, as Unsloth's offloaded checkpointing and Hugging
    Face's ``offload=True`` do)."""
    return Mix(BlockDecision("recompute", RAW, swap_input=True) if offload_inputs
               else RECOMPUTE)


def swap_all(codec: Codec = RAW) -> Mix:
    """Every saved tensor the engine can move, swapped (``plan="raw"`` for ``RAW``)."""
    return Mix(BlockDecision("swap", codec))


CodecKernels = Literal["own stream", "copy lane", "compute"]
# where a codec's kernels run (``Engine.codec_kernels``), as results name it
CODEC_KERNELS: dict[str, str] = {
    "own stream": "encoding on a stream of its own, as the engine does, what its kernels take "
                  "from compute's SMs not modelled",
    "copy lane": "encoding and copying one after the other in the copy's lane",
    "compute": "the kernels' whole time on the compute stream's clock"}


@dataclass(frozen=True)
class Engine:
    """The engine's settings the replay follows (``CSwapConfig``'s)."""

    min_bytes: int = CSwapConfig.min_bytes
    prefetch_bytes: int = 512 << 20  # the engine's fixed window when the H100 run was made
    inflight_bytes: int = AUTO_INFLIGHT_BYTES
    # measured, not a setting: the engine's host time per moved tensor on CUDA (`cswap bench
    # overhead --device cuda`, plan=raw: 66.1 us on the H200, 2026-11-27,
    # benchmarks/results/overhead-h200-2026-11-27-b.md)
    host_s_per_move: float = 66.1e-6
    # where a codec's kernels take their time, not measured yet (`cswap bench measure`'s int8
    # row tells; one of CODEC_KERNELS): "own stream", encoding on a lane of its own before the
    # copy out, decoding in the copy back's lane (the engine's streams); "copy lane", both in
    # the copy's lane (the link waits for them, compute does not); "compute", on the compute
    # stream's clock (they take the SMs; the copies go on while the next tensor encodes),
    # encoding after the op that saved the tensor, decoding before backward's next op once
    # its copy back is issued
    codec_kernels: CodecKernels = "own stream"
    # what recomputing a whole block costs against its profiled forward: 1 as profiled. Not
    # a calibration but a bracket: on the H200 (2026-11-27) the models' checkpointing cost
    # 0.66x (Llama) and 0.78x (GPT-2 medium) of it, 0.98-1.08x for CNNs' blocks, 3.68x for
    # BERT-large's (host-bound). Below the layer is left as estimated: it measured dearer
    recompute_scale: float = 1.0
    # what recomputing below the layer costs against its estimate: 1 as estimated. Also a
    # bracket: on the H200 (2026-11-27, Llama-3-8B's layer shapes, 8192 tokens) every layer so
    # recomputed cost 1.46-1.78x the estimate's share of a plain step
    # (``calibration.below_check``)
    below_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.codec_kernels not in CODEC_KERNELS:
            raise ValueError(f"Engine.codec_kernels must be one of {tuple(CODEC_KERNELS)}, "
                             f"got {self.codec_kernels!r}")
        if not self.recompute_scale > 0:
            raise ValueError(f"Engine.recompute_scale must be above 0 (1: as profiled), got "
                             f"{self.recompute_scale!r}")
        if not self.below_scale > 0:
            raise ValueError(f"Engine.below_scale must be above 0 (1: as estimated), got "
                             f"{self.below_scale!r}")

    def recompute_s(self, block: Block, ops: Sequence[Op]) -> float:
        """What recomputing ``block`` costs, priced with this engine's scales."""
        return block.recompute_s(ops, self.recompute_scale, self.below_scale)


@dataclass(frozen=True)
class Interval:
    """Something the step did on a lane (``compute``, ``encode``, ``d2h``, ``h2d``), in
    seconds."""

    lane: str
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class Prediction:
    """The replay's figures for one step (predictions, not measurements)."""

    step_s: float
    forward_s: float  # forward on the compute stream, its stalls included
    backward_s: float  # backward, recomputation and waits for restores included
    optimizer_s: float
    forward_stall_s: float  # compute idle in forward: the host waited at the in-flight bound
    backward_wait_s: float  # compute idle in backward: waiting for restores
    recompute_s: float
    peak_bytes: int  # the allocator's peak, as torch.cuda.max_memory_allocated counts it
    peak_at: str  # where it happens
    forward_peak_bytes: int  # the peak until forward ends (it falls as more is moved)
    # the peak with the originals whose copies out are still running: their memory is not
    # reusable before the copy ends, so the allocator's reserved memory must cover them too
    held_peak_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    # the host memory the moved tensors take at the end of forward: their bytes on the device
    # (a compressed payload's slot is as large until its length is known)
    host_bytes: int = 0
    # the least bound on bytes in flight under which forward never waits at it: under any
    # bound from there up, the step replays the same
    inflight_needed_bytes: int = 0
    timeline: tuple[Interval, ...] = ()


def predict(workload: Workload, plan: Mix | None = None, link: Link | None = None,
            engine: Engine | None = None, timeline: bool = False) -> Prediction:
    """Replay ``workload`` under ``plan`` (default: no offload); ``timeline`` records every
    op and copy."""
    return _Replay(workload, plan or Mix(), link or Link(), engine or Engine(),
                   timeline).run()


@dataclass
class _Entry:
    """A storage moved off the device: its copy out, and its copy back while one lives."""

    nbytes: int  # on the device
    stored: int  # over the link
    codec: Codec
    out_end: float = 0.0  # when the copy out ends
    back_end: float = 0.0  # when the live copy back ends
    back: bool = False  # a copy back lives
    prefetched: bool = False  # that copy was prefetched and no op has used it yet
    used: bool = False  # backward has asked for it


class _Replay:
    """One step replayed: ``run`` goes through forward, then backward, in program order,
    keeping the clocks (host, compute stream, copy streams) and the allocator's bytes."""

    def __init__(self, workload: Workload, plan: Mix, link: Link, engine: Engine,
                 timeline: bool) -> None:
        self.w, self.link, self.engine = workload, link, engine
        self.decisions = plan.decisions(workload)
        self.storage_of, self.activation, self.kept_below = workload.save_facts
        # what each recomputed block keeps (its input; below the layer, what its last op
        # saves), None for the others
        self.inputs = [workload.recompute_inputs(b) if d.action == "recompute" else None
                       for b, d in enumerate(self.decisions)]
        # the saves of blocks that would keep them below the layer but are not recomputed
        self.absent = {i for b, saves in workload.below_saves.items()
                       if self.inputs[b] is None for i in saves}
        # the last op of each recomputed block: backward recomputes the block there
        self.recomputes_at = {workload.blocks[b].ops.stop - 1
                              for b, kept in enumerate(self.inputs)
                              if kept is not None and workload.blocks[b].ops}
        # saves one autograd node asks for before their own op (each held until it is done)
        self.asked_at, self.asked = workload.asked_early
        self.record = timeline
        self.timeline: list[Interval] = []
        # clocks (seconds) and what they add up
        self.host = self.compute = self.d2h_free = self.h2d_free = self.encode_free = 0.0
        self.stall = self.wait = self.recompute_s = 0.0
        # the least bound on bytes in flight under which forward never waits at it
        self.inflight_needed = 0
        self.decoding = 0.0  # decode seconds the next op in backward runs first
        self.d2h_bytes = self.h2d_bytes = 0
        # copies out, oldest first (one lane: they end in order): when each ends, and the bytes
        # of those before it; the host waits on those from ``out_head`` on (the ones it has
        # not seen end), and the held peak counts those of them still running
        self.out_ends: list[float] = []
        self.out_before: list[int] = [0]
        self.out_head = self.running_head = 0
        # memory: original storages on the device, the saves holding them there, copies back
        self.device: dict[int, int] = {}  # storage -> bytes
        self.device_bytes = 0
        self.holders: dict[int, int] = {}  # storage -> how many saves hold it
        self.holding: set[int] = set()  # saves that hold their storage
        self.entries: dict[int, _Entry] = {}  # moved storage -> its entry
        self.copies = 0  # bytes of copies back alive
        self.grads = 0  # weight gradients made so far
        self.peak, self.peak_at = 0, ("", None)  # the phase and op of the peak
        self.held_peak = 0
        self.last_forward_op = workload.last_forward_op
        self.start_bytes = workload.start_bytes
        self.min_bytes = max(engine.min_bytes, 1)
        self.storage_bytes = workload.storage_bytes
        # backward's prefetching (set when backward begins)
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.cursor = self.ahead = 0

    def run(self) -> Prediction:
        self._forward()
        forward_end, forward_peak = self.compute, self.peak
        self._backward()
        backward_end = self.compute
        optimizer_s = 3 * self.w.weight_bytes / (2 * self.link.device)
        self._mark("compute", "optimizer", backward_end, backward_end + optimizer_s)
        return Prediction(
            step_s=backward_end + optimizer_s, forward_s=forward_end,
            backward_s=backward_end - forward_end, optimizer_s=optimizer_s,
            forward_stall_s=self.stall, backward_wait_s=self.wait,
            recompute_s=self.recompute_s, peak_bytes=self.peak, peak_at=self._peak_at(),
            forward_peak_bytes=forward_peak,
            held_peak_bytes=self.held_peak, inflight_needed_bytes=self.inflight_needed,
            d2h_bytes=self.d2h_bytes, h2d_bytes=self.h2d_bytes, host_bytes=self.out_before[-1],
            timeline=tuple(self.timeline))

    # -- bookkeeping ----------------------------------------------------------------------------
    def _mark(self, lane: str, label: str, start: float, end: float) -> None:
        if self.record and end > start:
            self.timeline.append(Interval(lane, label, start, end))

    def _point(self, other: int, phase: str, op: Op) -> None:
        """The allocator's bytes now, with ``other`` beside the saved tensors (during ``op``'s
        ``phase``)."""
        now = self.start_bytes + self.device_bytes + self.copies + self.grads + other
        if now > self.peak:
            self.peak, self.peak_at = now, (phase, op)
        ends, compute = self.out_ends, self.compute
        k = self.running_head if self.running_head > self.out_head else self.out_head
        while k < len(ends) and ends[k] <= compute:  # the compute clock only goes on
            k += 1
        self.running_head = k
        held = now + self.out_before[-1] - self.out_before[k]  # and the copies running
        if held > self.held_peak:
            self.held_peak = held

    def _peak_at(self) -> str:
        phase, op = self.peak_at
        return f"{phase} {op.module or '(functions)'}" if op is not None else ""

    def _allocate(self, storage: int) -> None:
        device = self.device
        if storage not in device:
            nbytes = device[storage] = self.storage_bytes[storage]
            self.device_bytes += nbytes

    def _free(self, storage: int) -> None:
        self.device_bytes -= self.device.pop(storage, 0)

    def _hold(self, i: int) -> None:
        """Save ``i`` keeps its storage on the device until its op in backward is done."""
        if i not in self.holding:
            storage = self.storage_of[i]
            self.holding.add(i)
            holders = self.holders
            holders[storage] = holders.get(storage, 0) + 1
            self._allocate(storage)

    def _release(self, i: int) -> None:
        if i in self.holding:
            storage = self.storage_of[i]
            self.holding.remove(i)
            holders = self.holders
            if holders[storage] == 1:
                del holders[storage]
                self._free(storage)
            else:
                holders[storage] -= 1

    def _moved(self, i: int) -> bool:
        """Whether save ``i``'s storage was moved off the device and backward asks for it
        (not for what a recomputation below the layer kept: that one is done with)."""
        return (self.activation[i] and not self.kept_below[i]
                and self.storage_of[i] in self.entries)

    def _movable(self, i: int) -> bool:
        """Whether the engine moves saved tensor ``i`` (``core/tensors.py``'s skip_reason)."""
        s = self.w.saved[i]
        return (s.activation and s.nbytes >= self.min_bytes
                and s.storage_nbytes <= MAX_STORAGE_TO_VIEW_RATIO * s.nbytes)

    # -- forward ------------------------------------------------------------------------------
    def _forward(self) -> None:
        storage_of, activation, absent = self.storage_of, self.activation, self.absent
        entries, holders, last_forward_op = self.entries, self.holders, self.last_forward_op
        device, storage_bytes = self.device, self.storage_bytes
        for k, op in enumerate(self.w.ops):
            decision, inputs = self.decisions[op.block], self.inputs[op.block]
            compute, host = self.compute, self.host
            begin = compute if compute > host else host
            # issuing its kernels: it cannot end before they are issued
            self.host = host = host + op.host_s
            done = begin + op.forward_s
            end = done if done > host else host
            self.stall += begin - compute + (end - done)
            self.compute = end
            if self.record:
                self._mark("compute", f"forward {op.module}", begin, self.compute)
            saves = [i for i in op.saves if i not in absent] if absent else op.saves
            for i in saves:  # (``_allocate``, inline: at every save of every replay)
                if storage_of[i] == i and activation[i] and i not in device:
                    device[i] = nbytes = storage_bytes[i]
                    self.device_bytes += nbytes
            self._point(op.forward_other, "forward", op)
            if not saves:
                continue
            swap = decision.action == "swap" or decision.swap_input
            for i in saves:
                storage = storage_of[i]
                if not activation[i] or storage in entries:  # moved already: shared
                    continue
                if inputs is not None and storage not in inputs:
                    continue  # recomputed in backward
                if swap and self._movable(i):
                    self._move_out(storage, decision.codec, i)
                else:
                    self._hold(i)
            for i in saves:
                storage = storage_of[i]
                if last_forward_op[storage] == k and storage not in holders:
                    # forward lets go of it (``_free``: once, it pops)
                    self.device_bytes -= device.pop(storage, 0)

    def _move_out(self, storage: int, codec: Codec, save: int) -> None:
        """Queue a storage's copy out after the op that saved it (``save``); the host waits
        first while the bytes in flight would pass the bound (``Transfer._bound``)."""
        nbytes = self.w.saved[storage].storage_nbytes
        stored = round(nbytes * codec.ratio)
        ends, before, k = self.out_ends, self.out_before, self.out_head
        while k < len(ends) and ends[k] <= self.host:  # seen ended
            k += 1
        if k < len(ends) and before[-1] - before[k] + nbytes > self.inflight_needed:
            self.inflight_needed = before[-1] - before[k] + nbytes
        while k < len(ends) and before[-1] - before[k] + nbytes > self.engine.inflight_bytes:
            self.host = max(self.host, ends[k])  # waits for the oldest
            k += 1
        self.out_head = k
        self.host += self.engine.host_s_per_move / 2
        encoding, ready = nbytes / codec.encode, max(self.compute, self.host)
        if encoding and self.engine.codec_kernels == "compute":
            self.compute += encoding
            ready, encoding = max(self.compute, self.host), 0.0
        elif encoding and self.engine.codec_kernels == "own stream":
            ready = self.encode_free = max(ready, self.encode_free) + encoding
            if self.record:
                self._mark("encode", f"encode {save} {self.w.saved[save].module}",
                           ready - encoding, ready)
            encoding = 0.0
        start = max(ready, self.d2h_free)
        if codec.waits:  # forward goes on once the encoding is done
            self.host = max(self.host, start + encoding if encoding else ready)
        end = start + encoding + stored / self.link.d2h
        self.d2h_free = end
        self.out_ends.append(end)
        self.out_before.append(self.out_before[-1] + nbytes)
        self.entries[storage] = _Entry(nbytes, stored, codec, out_end=end)
        self.d2h_bytes += stored
        if self.record:
            self._mark("d2h", f"out {save} {self.w.saved[save].module}", start, end)

    # -- backward -----------------------------------------------------------------------------
    def _backward(self) -> None:
        w = self.w
        self.order = self._prefetch_order()
        self.position = {storage: n for n, storage in enumerate(self.order)}
        input_copy: dict[int, set[int]] = {}  # recomputed block -> its input's copy back
        storage_of, activation, kept_below = self.storage_of, self.activation, self.kept_below
        holding, entries, asked = self.holding, self.entries, self.asked
        recomputes_at, asked_at, blocks = self.recomputes_at, self.asked_at, w.blocks
        for k in range(len(w.ops) - 1, -1, -1):
            op = w.ops[k]
            if k in recomputes_at:
                self._recompute(op.block, input_copy)
            ready = self.host
            for i in asked_at.get(k, ()) if entries else ():
                if self._moved(i):
                    back = self._unpack(storage_of[i])
                    ready = back if back > ready else ready
            used: set[int] = set()
            for i in op.saves if entries else ():
                storage = storage_of[i]
                if not activation[i] or kept_below[i] or storage not in entries:
                    continue  # (what a recomputation below the layer kept is done with)
                if storage in input_copy.get(op.block, ()):  # back for the recompute
                    back = entries[storage].back_end
                elif i in asked:  # back since its node asked for it
                    back = entries[storage].back_end
                    used.add(storage)
                elif storage not in used:
                    back = self._unpack(storage)
                    used.add(storage)
                else:
                    continue
                ready = back if back > ready else ready
            compute, host = self.compute, self.host
            issued = compute if compute > host else host
            begin = ready if ready > issued else issued
            self.wait += begin - issued
            self.compute = begin + self.decoding + op.backward_s
            self.decoding = 0.0
            if self.record:
                self._mark("compute", f"backward {op.module}", begin, self.compute)
            self._point(op.backward_grads, "backward", op)
            self.grads += op.weight_grads
            if blocks[op.block].ops.start == k and op.block in input_copy:
                used |= input_copy.pop(op.block)  # the block is done with its input
            if used:
                self._drop_copies(used)
            for i in op.saves:
                if i in holding:
                    self._release(i)

    def _prefetch_order(self) -> list[int]:
        """Moved storages in the order backward first asks for them (the order the engine
        learns from the step before)."""
        entries = self.entries
        if not entries:
            return []
        order: dict[int, None] = {}
        storage_of, asked_at, recomputes_at = self.storage_of, self.asked_at, self.recomputes_at
        for k in range(len(self.w.ops) - 1, -1, -1):
            op = self.w.ops[k]
            if k in recomputes_at:
                for storage in self.inputs[op.block]:
                    if storage in entries:
                        order.setdefault(storage)
            for saves in (asked_at.get(k, ()), op.saves):
                for i in saves:
                    if storage_of[i] in entries:
                        order.setdefault(storage_of[i])
        return list(order)

    def _recompute(self, block: int, input_copy: dict[int, set[int]]) -> None:
        """Run a block's forward again (below the layer: its elementwise part), once what it
        kept is back where it was moved: its saved storages live again, held by their saves.
        Below the layer, what it kept is given back as the recomputation ends (a kept output
        that the step saves lives on as its save)."""
        w, b = self.w, self.w.blocks[block]
        inputs, ready = self.inputs[block], self.host
        moved = {storage for storage in inputs if storage in self.entries}
        for storage in moved:
            ready = max(ready, self._unpack(storage))
        begin = max(self.compute, self.host, ready)
        self.wait += begin - max(self.compute, self.host)
        ops = w.ops[b.ops.start:b.ops.stop]
        seconds = self.engine.recompute_s(b, w.ops)
        # the host issues the forward again when the device reaches it (backward's own
        # kernels it issues far ahead): where that takes longer than the kernels, it is the cost
        issued = sum(op.host_s for op in ops)
        if issued:
            seconds = max(seconds, issued)
            self.host = max(self.host, begin + issued)
        self.compute = begin + self.decoding + seconds
        self.decoding = 0.0
        self.recompute_s += seconds
        self._mark("compute", f"recompute {b.name}", begin, self.compute)
        activation, kept_below, storage_of = self.activation, self.kept_below, self.storage_of
        for op in ops:
            for i in op.saves:
                if activation[i] and not kept_below[i] and storage_of[i] not in inputs:
                    self._hold(i)
        if not b.selective:
            input_copy[block] = moved
            return
        for op in ops:
            for i in op.saves:
                if kept_below[i]:
                    self._release(i)
        self._drop_copies(moved)

    def _unpack(self, storage: int) -> float:
        """The storage's copy back for the op about to run (restored now if none lives),
        prefetching after it (``Step._prefetch_after``); when the copy is complete."""
        entry = self.entries[storage]
        self.host += self.engine.host_s_per_move / 2
        if entry.prefetched:
            entry.prefetched = False
            self.ahead -= entry.nbytes
        elif not entry.back:
            self._restore(storage, "back")
        if not entry.used:
            entry.used = True
            self._prefetch_after(storage)
        return entry.back_end

    def _prefetch_after(self, storage: int) -> None:
        if not self.engine.prefetch_bytes:
            return
        self.cursor = max(self.cursor, self.position[storage] + 1)
        while self.cursor < len(self.order):
            following = self.order[self.cursor]
            entry = self.entries[following]
            if not (entry.used or entry.back):
                if self.ahead and self.ahead + entry.nbytes > self.engine.prefetch_bytes:
                    break
                self._restore(following, "prefetch")
                entry.prefetched = True
                self.ahead += entry.nbytes
            self.cursor += 1

    def _restore(self, storage: int, why: str) -> None:
        """Queue a copy back (``why``: "back" for the op about to run, or "prefetch"): after
        the copy out, and the copies back queued before it."""
        entry = self.entries[storage]
        start = max(self.host, entry.out_end, self.h2d_free)
        decoding = entry.nbytes / entry.codec.decode
        if self.engine.codec_kernels == "compute":
            self.decoding += decoding
            decoding = 0.0
        end = start + entry.stored / self.link.h2d + decoding
        self.h2d_free = entry.back_end = end
        entry.back = True
        self.copies += entry.nbytes
        self.h2d_bytes += entry.stored
        if self.record:
            self._mark("h2d", f"{why} {storage}", start, end)

    def _drop_copies(self, storages: set[int]) -> None:
        """The op is done with these copies back: they are freed."""
        for storage in storages:
            entry = self.entries[storage]
            if entry.back and not entry.prefetched:
                entry.back = False
                self.copies -= entry.nbytes
