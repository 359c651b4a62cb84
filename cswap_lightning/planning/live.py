"""The step the engine measured, as the replay (``replay.py``) sees a workload.

The planner decides what to recompute by replaying the step under candidate plans
(``mix.py``). For the H100 profiles a :class:`~.workload.Workload` comes from a profile file;
here it comes from what the engine measured itself on its measured steps: each site's bytes,
kind and storage (the profiler's rows), the compute around it (the forward and backward
windows; on CUDA also the host's forward window, its time outside the pack hooks:
``Op.host_s``), and the blocks that can be recomputed with the sites each saved
(``core/recompute.py``'s ``BlockCall``). Each site is one op of the replay. What the step
holds beside its saved tensors (on CUDA the allocator's peak less theirs; nothing known on the
CPU) is counted as held from the start, as the advisor counts it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..codecs import get_codec
from ..records import WEIGHTS
from . import mix, replay
from .advisor import predicted_stored_bytes
from .predictor import CodecTimeModel
from .profiler import SiteProfile
from .workload import Below, Block, Op, Saved, Workload

_SHARED = re.compile(r"shares storage with site (\d+)")
_MOVABLE = ("", "plan", "small")  # what the engine may move, or keeps by the plan or by size


class BlockCall(Protocol):
    """A block's call on a measured step (``core.recompute.BlockCall``)."""

    name: str
    first_site: int
    stop_site: int
    input_bytes: int
    below: tuple[Below, ...]  # what recomputing it below the layer keeps and costs, each way


def workload(profiles: Sequence[SiteProfile], calls: Sequence[BlockCall],
             beside_bytes: int = 0, name: str = "measured step",
             innermost: bool = False, together: Sequence[Sequence[int]] = ()) -> Workload:
    """The replay's workload of a measured step: ``profiles`` in site order (the profiler's),
    ``calls`` the blocks that can be recomputed, ``beside_bytes`` what the step holds beside
    its saved tensors, ``together`` the sites backward first asked for at once (by site).
    Where calls nest (an activation module inside a layer), the outer ones are the units, or
    with ``innermost`` the inner ones (the rest of the outer one then cannot be
    recomputed)."""
    index = {p.site: i for i, p in enumerate(profiles)}
    saved: list[Saved] = []
    for i, p in enumerate(profiles):
        shared = _SHARED.fullmatch(p.reason)
        storage = index.get(int(shared.group(1)), i) if shared else i
        weight = p.reason in WEIGHTS
        # Kept for a reason the engine measured (held elsewhere) or could not move at all
        # (sparse, subclasses): left in place, counted from the start.
        held = not (weight or shared or p.offloadable or p.reason in _MOVABLE)
        saved.append(Saved(p.module, p.dtype, p.nbytes, p.nbytes, storage, weight, held))
    block_of = [-1] * len(profiles)  # the recomputable block a site is in, or -1
    parent = [""] * len(profiles)  # the unit left out around a site (its nested ones taken)
    named: list[tuple[str, tuple[Below, ...]]] = []
    for call in sorted(calls, key=lambda c: (c.stop_site - c.first_site) if innermost
                       else c.first_site):
        sites = [index[s] for s in range(call.first_site, call.stop_site) if s in index]
        if sites and all(block_of[i] < 0 for i in sites):
            for i in sites:
                block_of[i] = len(named)
            named.append((call.name, call.below))
        elif innermost:
            for i in sites:
                parent[i] = parent[i] or call.name
    # runs of sites in one block, or outside every block (those cannot be recomputed)
    blocks: list[Block] = []
    start = 0
    for i in range(1, len(profiles) + 1):
        if i == len(profiles) or (block_of[i], parent[i]) != (block_of[start], parent[start]):
            key = block_of[start]
            if key >= 0:
                unit, below = named[key]
                blocks.append(Block(unit, range(start, i), True, parent[start], below))
            else:
                blocks.append(Block(f"(sites {start}-{i - 1})", range(start, i), False,
                                    parent[start]))
            start = i
    ops = tuple(Op(profiles[k].module, b, range(k, k + 1), profiles[k].forward_s,
                   profiles[k].backward_s, 0, 0, 0, profiles[k].host_s)
                for b, block in enumerate(blocks) for k in block.ops)
    # what stays in place is on the device all along: the saved tensors' peak counted it,
    # so what the step holds beside them did not
    held = sum(s.storage_nbytes for i, s in enumerate(saved) if s.held and s.storage == i)
    asked = tuple(group for group in (tuple(index[s] for s in sites if s in index)
                                      for sites in together) if len(group) > 1)
    return Workload(name, 1, tuple(saved), ops, tuple(blocks), beside_bytes + held, 0, 0,
                    asked)


def by_site(w: Workload) -> Workload:
    """The same step with each op a block of its own, none recomputable: the units the
    planner swaps (the earliest sites first)."""
    ops = tuple(replace(op, block=k) for k, op in enumerate(w.ops))
    blocks = tuple(Block(f"site {k}", range(k, k + 1), False) for k in range(len(ops)))
    return replace(w, ops=ops, blocks=blocks)


@dataclass(frozen=True)
class Recomputation:
    """The planner's choice for a measured step: the blocks to recompute (the advisor then
    places the swaps), the mix it comes from, and what it was replayed with."""

    names: tuple[str, ...]
    mix: mix.Choice
    workload: Workload
    link: replay.Link
    engine: replay.Engine
    inflight_choices: tuple[int, ...] = ()
    workloads: tuple[Workload, ...] = ()  # the candidates it was chosen among
    codecs: tuple[mix.CodecOf, ...] = ()  # how blocks may travel compressed

    @property
    def weights(self) -> dict[str, float]:
        """The weight of each block recomputed below the layer: the way its recomputation
        keeps (``dataflow.Dataflow.cut``)."""
        return {block.name: block.selective.weight for block in self.workload.blocks
                if block.name in self.names and block.selective is not None}

    @property
    def inflight_bytes(self) -> int:
        """The bound on bytes in flight the chosen mix was replayed with."""
        return self.mix.inflight_bytes

    def tighter(self, by: int) -> Recomputation:
        """The choice for a budget ``by`` bytes tighter, from the same replayed step."""
        return choose_recompute(self.workloads or (self.workload,),
                                max(self.mix.budget_bytes - by, 0), self.link, self.engine,
                                self.inflight_choices, self.codecs, self.mix.host_bytes)


def candidates(profiles: Sequence[SiteProfile], calls: Sequence[BlockCall],
               beside_bytes: int = 0, together: Sequence[Sequence[int]] = ()
               ) -> tuple[Workload, ...]:
    """The measured step with the outermost units of recomputation; where units nest, with
    the innermost (GPT-2's ``gelu_new`` saves four tensors for a fifth of its layer's
    forward time: recomputing it alone frees more bytes per second than the layer); and
    where the blocks were measured for it, with each block recomputed below the layer (each
    way: ``Workload.ways_below``) or whole. ``together``: as ``workload``'s."""
    outer = workload(profiles, calls, beside_bytes, together=together)
    inner = workload(profiles, calls, beside_bytes, innermost=True, together=together)
    return (outer, *([inner] if inner.blocks != outer.blocks else []), *outer.ways_below())


def block_codec(profiles: Sequence[SiteProfile], codec_for: Callable[[SiteProfile], str],
                model: CodecTimeModel) -> mix.CodecOf:
    """How a block of the measured step travels with each of its movable sites through the
    codec ``codec_for`` names for it (``"raw"``, a compressor, a lossy codec): the bytes
    they would store (each format's size at their measured sparsity) against their raw
    bytes, at the speeds each codec was measured at for them, the host waiting for the
    encoding where a codec's does (``Codec.encode_waits``). What a recomputation below the
    layer keeps counts as dense sites of the block's dtype."""

    def codec_of(w: Workload, block: Block) -> replay.Codec:
        sites = [_site(w, i, profiles) for op in w.ops[block.ops.start:block.ops.stop]
                 for i in op.saves]
        sites = [p for p in sites if p.offloadable]
        raw = sum(p.nbytes for p in sites)
        if not raw:
            return replay.RAW
        codecs = [codec_for(p) for p in sites]
        stored = sum(p.nbytes if c == "raw" else predicted_stored_bytes(c, p)
                     for p, c in zip(sites, codecs, strict=True))
        seconds = [sum(model.predict(c, way, p.nbytes, p.sparsity)
                       for p, c in zip(sites, codecs, strict=True) if c != "raw")
                   for way in ("encode", "decode")]
        encode, decode = (raw / s if s > 0 else float("inf") for s in seconds)
        names = sorted(set(codecs) - {"raw"})
        waits = any(get_codec(name).encode_waits for name in names)
        return replay.Codec("+".join(names) or "raw", stored / raw, encode, decode, waits)

    return codec_of


def _site(w: Workload, i: int, profiles: Sequence[SiteProfile]) -> SiteProfile:
    """Saved tensor ``i`` of a workload of the measured step: its site's profile, or for
    what a recomputation below the layer keeps, a dense site of its bytes."""
    s = w.saved[i]
    if not s.below:
        return profiles[i]
    elem = getattr(torch, s.dtype).itemsize
    return SiteProfile(-1, (s.nbytes // elem,), s.dtype, s.nbytes, True, module=s.module)


def choose_recompute(measured: Sequence[Workload], budget_bytes: int, link: replay.Link,
                     engine: replay.Engine, inflight_choices: Sequence[int] = (),
                     codecs: Sequence[mix.CodecOf] = (), host_bytes: int | None = None
                     ) -> Recomputation:
    """The blocks the planner recomputes to meet ``budget_bytes``, from the measured step
    (with each of its candidate units, ``candidates``) replayed under candidate mixes: none
    where keeping or swapping alone is predicted to meet it at least as fast.
    ``inflight_choices``: larger bounds on bytes in flight it may pick (``mix.choose``);
    ``codecs``: ways blocks may travel compressed (``block_codec``), each weighed against
    swapping them raw where it shrinks some block: compression widens what the link carries
    in its window. ``host_bytes``: the host memory what it swaps may hold (None: any)."""
    shrinking = tuple(codec_of for codec_of in codecs
                      if any(codec_of(measured[0], block).ratio < 1
                             for block in measured[0].blocks))
    chosen_workload, chosen = mix.choose_among(
        measured, budget_bytes, link, engine, inflight_choices=inflight_choices,
        codecs=(None, *shrinking), host_bytes=host_bytes)
    names = tuple(block.name for block, decision in zip(
        chosen_workload.blocks, chosen.decisions(), strict=True)
        if decision.action == "recompute")
    return Recomputation(names, chosen, chosen_workload, link, engine, tuple(inflight_choices),
                         tuple(measured), tuple(codecs))
