"""The cheapest mix of keep, swap and recompute per block that meets a memory budget.

Swapping is free only while the link's windows can carry it: about a fifth of a modern GPU's
activations cross PCIe inside a step (the first H100 run). Beyond that, every byte swapped
stalls the step for the link's time, while recomputing a block costs its forward once more.
So the planner, replaying the step (``replay.py``) for each candidate:

1. keeps everything if that fits (a run that fits costs nothing);
2. otherwise, for each count of blocks swapped (the earliest: backward needs them last;
   compressed where a block's codec says so, which widens the link's window; where a layer
   can be recomputed below the layer, also so with what that keeps swapped, which halves
   what the link carries for its elementwise work again, and then with the first of those
   swapped whole while that is faster: the link has the longest to carry the earliest
   blocks' bytes, and a block swapped whole runs nothing again), recomputes the fewest other
   blocks that make the peak fit, those that free the most bytes per second of
   recomputation first (a layer below the layer, ``Workload.with_below``, or whole), and
   takes the mix the replay predicts fastest: swaps inside the link's window cost nothing,
   swaps beyond it the link's time, recomputation a forward (below the layer, its
   elementwise part);
3. where even recomputing every block leaves the peak over the budget, swaps the recomputed
   blocks' inputs and the blocks that cannot be recomputed too, earliest first.

Where the engine's bound on bytes in flight is the planner's to choose, a larger bound is
tried too: the first blocks' activations come faster than the link carries them, and a
bound that lets forward run on while their copies catch up swaps more blocks for free. The
originals being copied cannot be reused before their copy ends, so a larger bound is taken
only where the replay's peak with them (``held_peak_bytes``) stays within the budget.

A budget no mix meets is said, with the bytes missing, instead of run over silently. Every
figure is a prediction.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import product, takewhile

from .replay import KEEP, RAW, BlockDecision, Codec, Engine, Link, Mix, Prediction, predict
from .workload import Block, Workload

# How a block of a workload travels when swapped (its inputs, where it is recomputed).
CodecOf = Callable[[Workload, Block], Codec]


class Replays:
    """The replay's predictions by workload, mix and settings, and the workloads with parents
    made whole, kept while the planner weighs one step: at each of several budgets it tries
    many of the same mixes. A workload is known by its identity, and kept here while known."""

    def __init__(self) -> None:
        self._merged: dict[tuple[int, frozenset[str]], Workload] = {}
        self._below: dict[tuple[int, tuple[int, ...]], Workload] = {}
        self._predictions: dict[tuple, dict[int, Prediction]] = {}  # by bound in flight
        self._known: dict[int, Workload] = {}

    def merged(self, workload: Workload, parents: frozenset[str]) -> Workload:
        """``workload.merged(parents)``, made once."""
        key = (self._know(workload), parents)
        if key not in self._merged:
            self._merged[key] = workload.merged(parents)
        return self._merged[key]

    def with_below(self, workload: Workload, ways: Sequence[int]) -> Workload:
        """``workload.with_below(ways)``, made once."""
        key = (self._know(workload), tuple(ways))
        if key not in self._below:
            self._below[key] = workload.with_below(ways)
        return self._below[key]

    def predict(self, workload: Workload, plan: Mix, link: Link, engine: Engine) -> Prediction:
        """``replay.predict``, run once per workload, mix, link and engine, and once for every
        bound on bytes in flight that forward would not wait at (the planner tries several):
        a step replayed under a bound it never waited at replays the same under any bound
        from its ``inflight_needed_bytes`` up."""
        key = (self._know(workload), plan.default, frozenset(plan.blocks.items()), link,
               replace(engine, inflight_bytes=0))
        known = self._predictions.setdefault(key, {})
        bound = engine.inflight_bytes
        found = known.get(bound)
        if found is None:
            found = next((p for b, p in known.items()
                          if p.inflight_needed_bytes <= min(b, bound)), None)
        if found is None:
            found = known[bound] = predict(workload, plan, link, engine)
        return found

    def _know(self, workload: Workload) -> int:
        self._known.setdefault(id(workload), workload)
        return id(workload)


@dataclass(frozen=True)
class Choice:
    """The mix chosen (``plan``), its prediction, and the plain step's, for the table."""

    plan: Mix
    prediction: Prediction
    keep: Prediction  # keeping everything
    budget_bytes: int | None
    fits: bool
    how: str  # which candidate won
    candidates: dict[str, Prediction] = field(default_factory=dict)
    engine: Engine = field(default_factory=Engine)  # the settings it was replayed with
    workload: Workload | None = None  # the step the plan is for (its parents made whole)
    host_bytes: int | None = None  # the host memory its payloads may hold (None: any)

    @property
    def inflight_bytes(self) -> int:
        """The bound on bytes in flight the mix was replayed with."""
        return self.engine.inflight_bytes

    @property
    def missing_bytes(self) -> int:
        """Bytes the budget lacks for this plan (0 where it fits)."""
        if self.budget_bytes is None:
            return 0
        return max(self.prediction.peak_bytes - self.budget_bytes, 0)

    def decisions(self, workload: Workload | None = None) -> list[BlockDecision]:
        """A decision per block of the mix's own workload (or of ``workload``)."""
        return self.plan.decisions(workload or self.workload)


def choose(workload: Workload, budget_bytes: int | None, link: Link | None = None,
           engine: Engine | None = None, codec_of: CodecOf | None = None,
           recompute: bool = True, inflight_choices: Sequence[int] = (),
           replays: Replays | None = None, faster_than: float = math.inf,
           prune: bool = True, host_bytes: int | None = None) -> Choice:
    """The fastest plan the replay predicts to fit ``budget_bytes`` (the allocator's peak)
    with what it swaps holding at most ``host_bytes`` of host memory (None: any);
    ``codec_of(workload, block)`` is how a swapped block travels (raw by default);
    ``recompute=False``
    only keeps or swaps; ``inflight_choices``: larger bounds on bytes in flight than
    ``engine``'s the plan may use, where the replay's peak with the copies in flight
    (``held_peak_bytes``) stays within the budget; ``replays``: predictions made before, for
    the same step at other budgets; ``faster_than``: a step time another plan has already
    (where none is faster, the plan returned may be any, not fitting); ``prune=False``: search
    what cannot beat a plan found too (the same choice, more replays: what it saves is
    measured against that, ``benchmarks/planner_speed.py``)."""
    engine, replays = engine or Engine(), replays or Replays()
    faster_than = faster_than if prune else math.inf
    best = _choose(workload, budget_bytes, link or Link(), engine, codec_of, recompute, replays,
                   faster_than=faster_than, prune=prune, host_bytes=host_bytes)
    for bound in sorted(b for b in inflight_choices if b > engine.inflight_bytes):
        if not best.fits or best.how == "keep everything":
            break
        wider = _choose(workload, budget_bytes, link or Link(),
                        replace(engine, inflight_bytes=bound), codec_of, recompute, replays,
                        held=True, faster_than=best.prediction.step_s if prune else math.inf,
                        prune=prune, host_bytes=host_bytes)
        if not (wider.fits and wider.prediction.step_s < best.prediction.step_s):
            break  # a wider bound held more than the budget, or gained nothing
        best = wider
    return replace(best, host_bytes=host_bytes)


def choose_among(workloads: Sequence[Workload], budget_bytes: int | None,
                 link: Link | None = None, engine: Engine | None = None,
                 inflight_choices: Sequence[int] = (),
                 codecs: Sequence[CodecOf | None] = (None,),
                 replays: Replays | None = None, prune: bool = True,
                 host_bytes: int | None = None) -> tuple[Workload, Choice]:
    """``choose`` for each of the same step's workloads (its units of recomputation cut
    otherwise, ``Workload.with_units``) and each way of swapping (``codecs``: raw, or a
    codec per block): the fastest mix that fits, else the first's. ``replays``: predictions
    made before, for the same step at other budgets; ``prune`` and ``host_bytes``: as
    ``choose``'s."""
    replays = replays or Replays()
    mixes, fastest = [], math.inf
    for w, codec_of in product(workloads, codecs):
        mixes.append(choose(w, budget_bytes, link, engine, codec_of,
                            inflight_choices=inflight_choices, replays=replays,
                            faster_than=fastest, prune=prune, host_bytes=host_bytes))
        if mixes[-1].fits:
            fastest = min(fastest, mixes[-1].prediction.step_s)
    fitting = [m for m in mixes if m.fits]
    best = min(fitting, key=lambda m: m.prediction.step_s) if fitting else mixes[0]
    base = next((w for w in workloads if any(b.below for b in w.blocks)
                 and not any(b.selective for b in w.blocks)), None)
    if best.fits and base is not None:
        best = _ways_per_block(base, best, link or Link(), replays)
    return best.workload, best


def _ways_per_block(base: Workload, chosen: Choice, link: Link, replays: Replays) -> Choice:
    """``chosen`` with each block it recomputes below the layer taking a way of its own: its
    decisions replayed with the way of a run of those blocks (the first ones, or the last)
    changed, kept where predicted faster within the budget (the earliest layers swapped may
    carry fewer bytes over the link, later ones run less again). ``base``: the step the ways
    were taken from (``Workload.with_below``)."""
    index = {b.name: k for k, b in enumerate(base.blocks) if b.below}  # by the parent's name
    way = [0] * len(base.blocks)
    whole = set()  # blocks recomputed whole: merged back into their parent
    for block in chosen.workload.blocks:
        if block.selective is not None:
            k = index.get(block.parent)
            if k is None or block.selective not in base.blocks[k].below:
                return chosen  # not a way of ``base``'s
            way[k] = base.blocks[k].below.index(block.selective)
        elif block.recomputable and block.below:
            whole.add(block.name)
    order = [index[b.parent] for b, decision in zip(chosen.workload.blocks, chosen.decisions(),
                                                  strict=True)
             if b.selective is not None and decision.action == "recompute"]
    if not order:
        return chosen
    budget, host = chosen.budget_bytes, chosen.host_bytes
    held = max(budget, chosen.prediction.held_peak_bytes)  # what it was chosen with
    best, best_way = chosen, way
    for j, cut in product(range(max(len(base.blocks[k].below) for k in order)),
                          range(1, len(order))):
        for run in (order[:cut], order[cut:]):
            trial = list(best_way)
            for k in run:
                if j < len(base.blocks[k].below):
                    trial[k] = j
            if trial == best_way:
                continue
            w = replays.merged(replays.with_below(base, trial), frozenset(whole))
            p = replays.predict(w, chosen.plan, link, chosen.engine)
            if (p.peak_bytes <= budget and p.held_peak_bytes <= held
                    and (host is None or p.host_bytes <= host)
                    and p.step_s < best.prediction.step_s):
                best = replace(best, prediction=p, workload=w,
                               how=best.how.split(";")[0] + _weighed(w, chosen.plan)
                               + _through(chosen.plan))
                best_way = trial
    return best


@dataclass(frozen=True)
class _Unit:
    """What the planner may recompute: one block, or (``whole``) every block cut from one
    parent (a layer whose activation module is a unit of its own)."""

    name: str
    blocks: tuple[int, ...]
    whole: bool


def _choose(workload: Workload, budget_bytes: int | None, link: Link, engine: Engine,
            codec_of: CodecOf | None, recompute: bool, replays: Replays,
            held: bool = False, faster_than: float = math.inf, prune: bool = True,
            host_bytes: int | None = None) -> Choice:
    """``choose`` at one bound on bytes in flight (``held``: the copies in flight count
    against the budget too; ``faster_than``, ``prune`` and ``host_bytes``: as ``choose``'s).
    What a mix holds on the host grows with the blocks it swaps (or whose inputs it swaps),
    not with those it recomputes."""
    codec_of = codec_of or (lambda w, block: RAW)

    def merged(parents: frozenset[str]) -> Workload:
        return replays.merged(workload, parents)

    def run(chosen: tuple[Workload, Mix]) -> Prediction:
        return replays.predict(*chosen, link, engine)

    keep = run((workload, Mix()))
    if budget_bytes is None or keep.peak_bytes <= budget_bytes:
        return Choice(Mix(), keep, keep, budget_bytes, True, "keep everything", engine=engine,
                   workload=workload)
    names = [b.name for b in workload.blocks]
    units = _units(workload) if recompute else []
    # the ranking over every unit, and over the finest alone (a prefix of the first may take
    # a whole parent where its pieces alone would do)
    rankings = [units] + ([[u for u in units if not u.whole]]
                          if any(u.whole for u in units) else [])

    def on_device(chosen: tuple[Workload, Mix]) -> bool:
        p = run(chosen)
        return max(p.peak_bytes, p.held_peak_bytes if held else 0) <= budget_bytes

    def on_host(chosen: tuple[Workload, Mix]) -> bool:
        return host_bytes is None or run(chosen).host_bytes <= host_bytes

    def fits(chosen: tuple[Workload, Mix]) -> bool:
        return on_device(chosen) and on_host(chosen)

    def eligible(ranked: list[_Unit], swapped: int) -> list[_Unit]:
        return [u for u in ranked if min(u.blocks) >= swapped]

    def swap(b: int, below: bool) -> BlockDecision:
        """Block ``b`` swapped; ``below``: where it can be, recomputed below the layer with
        what that keeps swapped (the link carries less, for its elementwise work again)."""
        block = workload.blocks[b]
        if below and block.selective:
            return BlockDecision("recompute", codec_of(workload, block), swap_input=True)
        return BlockDecision("swap", codec_of(workload, block))

    def mixed(ranked: list[_Unit], swapped: int, recomputed: int,
              below: bool = False, whole_first: int = 0) -> tuple[Workload, Mix]:
        """The earliest ``swapped`` blocks swapped (``below``: as ``swap`` says, but the
        first ``whole_first`` of them), the ``recomputed`` best units of the others
        recomputed (a piece of a parent recomputed whole goes with it)."""
        chosen = eligible(ranked, swapped)[:recomputed]
        whole = frozenset(u.name for u in chosen if u.whole)
        decisions = {names[b]: swap(b, below and b >= whole_first) for b in range(swapped)}
        decisions |= {u.name: BlockDecision("recompute") for u in chosen
                      if u.whole or workload.blocks[u.blocks[0]].parent not in whole}
        return merged(whole), Mix(KEEP, decisions)

    fastest, skipped = faster_than, False

    def least(ranked: list[_Unit], swapped: int, below: bool,
              whole_first: int = 0) -> int | None:
        """The fewest recomputations that fit with ``swapped`` blocks swapped (None: none),
        by bisection. Recomputing more only adds work, so once a count that does not fit
        is no faster than the fastest plan so far, neither is the least that fits: with
        ``prune``, the search stops there (``_Beaten``; where that count is none, swapping
        more blocks only adds link time, so no later count of blocks swapped is faster
        either: ``_Beaten(True)``); while there is no plan to beat yet
        (no count of blocks swapped has fit), recomputing every unit is tried first: where
        that does not fit, no count does, and one replay says so (a budget nothing fits
        tries every count)."""
        def ok(k: int) -> bool:
            chosen = mixed(ranked, swapped, k, below, whole_first)
            if fits(chosen):
                return True
            if prune and run(chosen).step_s >= fastest:
                raise _Beaten(k == 0)
            return False

        n = len(eligible(ranked, swapped)) + 1
        if prune and fastest < math.inf:
            if ok(0):  # none at all (or beaten already)
                return 0
        elif prune and not fits(mixed(ranked, swapped, n - 1, below, whole_first)):
            return None
        return _first(n, ok)

    # For each count of earliest blocks swapped (raw or compressed; where blocks can be
    # recomputed below the layer, also so with what they keep swapped), the fewest
    # recomputations that fit.
    ways = (False, True) if any(b.selective for b in workload.blocks) else (False,)
    candidates: dict[str, tuple[tuple[Workload, Mix], Prediction]] = {}
    below_best: tuple[float, int, int] | None = None  # the fastest swapping below the layer

    def add(n: int, ranked: list[_Unit], swapped: int, k: int, below: bool,
            whole_first: int = 0) -> Prediction:
        nonlocal fastest
        chosen = mixed(ranked, swapped, k, below, whole_first)
        recomputed = sum(d.action == "recompute" and not d.swap_input
                         for d in chosen[1].blocks.values())
        where = ""
        if below:
            where = (f" (the first {whole_first} whole, the rest below the layer)"
                     if whole_first else " (below the layer)")
        how = (f"swap the earliest {swapped} blocks{where}, recompute {recomputed}"
               + (" of the finest units" if n else "") + _weighed(*chosen) + _through(chosen[1]))
        candidates[how] = (chosen, run(chosen))
        fastest = min(fastest, candidates[how][1].step_s)
        return candidates[how][1]

    def sweep(ranked: list[_Unit], below: bool) -> Iterator[tuple[int, int]]:
        """Each count of blocks swapped with its fewest recomputations, up to the first that
        needs none (swapping more would only add link time). Once recomputing nothing is
        beaten, so is every larger count (``_Beaten.later``); below the layer, the first of
        them that fits recomputing nothing is still weighed (found by bisection): the
        fastest mix below the layer seeds the search for its earliest blocks whole."""
        nonlocal skipped
        for swapped in range(len(names) + 1):
            if host_bytes is not None and not on_host(mixed(ranked, swapped, 0, below)):
                return  # swapping more holds more on the host
            try:
                k = least(ranked, swapped, below)
            except _Beaten as beaten:
                skipped = True
                if not beaten.later:
                    continue
                if below:
                    first = _first(len(names) - swapped, lambda i, after=swapped + 1: on_device(
                        mixed(ranked, after + i, 0, below)))
                    if first is not None and on_host(mixed(ranked, swapped + 1 + first, 0,
                                                           below)):
                        yield swapped + 1 + first, 0
                return
            if k is not None:
                yield swapped, k
                if k == 0:
                    return

    for (n, ranked), below in product(enumerate(rankings), ways):
        for swapped, k in sweep(ranked, below):
            step_s = add(n, ranked, swapped, k, below).step_s
            if below and swapped and (below_best is None or step_s < below_best[0]):
                below_best = (step_s, n, swapped)
    # The fastest mix swapping below the layer, its earliest blocks swapped whole instead,
    # the first one, two, ... while that gets faster: they put more on the link, which has
    # the longest of forward to carry the earliest blocks' bytes, and run nothing again.
    if below_best is not None:
        step_s, n, swapped = below_best
        for whole_first in (b + 1 for b in range(swapped) if workload.blocks[b].selective):
            try:
                k = least(rankings[n], swapped, True, whole_first)
            except _Beaten:
                skipped = True
                break
            if k is None:
                break
            faster = add(n, rankings[n], swapped, k, True, whole_first).step_s
            if faster >= step_s:
                break
            step_s = faster
    # every unit recomputed is not enough, or nothing is: move inputs too, on the workload
    # whose parents are whole (the most a recomputation frees)
    whole = merged(frozenset(u.name for u in units if u.whole))

    def moved(k: int) -> tuple[Workload, Mix]:
        return whole, frugal(whole, k, codec_of, bool(units))

    if not candidates and skipped:  # none faster than ``faster_than``
        return Choice(Mix(), keep, keep, budget_bytes, False, "none faster",
                      engine=engine, workload=workload)
    if candidates:
        how, ((w, plan), prediction) = min(candidates.items(), key=lambda kv: kv[1][1].step_s)
        return Choice(plan, prediction, keep, budget_bytes, True, how,
                   {h: p for h, (_, p) in candidates.items()}, engine, w)
    # the counts the host holds, each in turn: not bisected, as the peak falls with the
    # first inputs moved and may rise with the last (``frugal``)
    counts = range(len(whole.blocks) + 1)
    held = counts if host_bytes is None else list(
        takewhile(lambda k: on_host(moved(k)), counts))
    k = next((k for k in held if on_device(moved(k))), None) if units else None
    if k is not None:
        # and the earliest of those blocks swapped whole instead, each count in turn (the
        # peak need not fall or rise with it): they cost the link's time, no forward again
        found = {f"recompute all, swap the earliest {k} inputs or blocks": moved(k)}
        for n in range(1, k + 1):
            chosen = whole, frugal(whole, k, codec_of, bool(units), whole=n)
            if fits(chosen):
                found[f"swap the earliest {n} blocks, recompute the others, the inputs of "
                      f"those up to block {k} swapped"] = chosen
        how, (w, plan) = min(found.items(), key=lambda kv: run(kv[1]).step_s)
        return Choice(plan, run((w, plan)), keep, budget_bytes, True, how + _through(plan),
                      {h + _through(c[1]): run(c) for h, c in found.items()}, engine, w)
    # nothing fits: the plan that comes closest (moving what the host can hold), and how far
    # off it is
    w, plan = moved(min(held, key=lambda k: run(moved(k)).peak_bytes))
    stopped = len(held) < len(counts)
    return Choice(plan, run((w, plan)), keep, budget_bytes, False, "does not fit" + (
        " (the host budget stops it moving more)" if stopped else ""),
                  engine=engine, workload=w)


def frugal(w: Workload, k: int, codec_of: CodecOf | None = None,
           recompute: bool = True, whole: int = 0) -> Mix:
    """The last resort: every block that can be recomputed recomputed (with ``recompute``),
    and the earliest ``k`` swapped, a recomputed one's input, another whole (``codec_of``:
    how; raw by default), the first ``whole`` of them whole in any case. Swapping the last
    blocks' inputs too need not lower the peak: backward wants them first, and they come
    back while the later blocks run again."""
    codec_of = codec_of or (lambda w, block: RAW)
    decisions = {}
    for b, block in enumerate(w.blocks):
        again = recompute and block.recomputable and b >= whole
        if b < k:
            decisions[block.name] = BlockDecision("recompute" if again else "swap",
                                                  codec_of(w, block), swap_input=again)
        elif again:
            decisions[block.name] = BlockDecision("recompute")
    return Mix(KEEP, decisions)


class _Beaten(Exception):
    """A search for the fewest recomputations found no faster plan than one found before;
    ``later``: nor can one swapping more blocks (recomputing nothing was no faster)."""

    def __init__(self, later: bool = False) -> None:
        super().__init__(later)
        self.later = later


def _through(plan: Mix) -> str:
    """The codecs a mix's swapped blocks and inputs travel through, where not raw."""
    names = sorted({d.codec.name for d in plan.blocks.values()
                    if d.action == "swap" or d.swap_input} - {RAW.name})
    return f"; swapped through {', '.join(names)}" if names else ""


def _weighed(workload: Workload, plan: Mix) -> str:
    """How a mix's blocks recomputed below the layer keep, where not all by the fewest
    bytes: the weight, or each weight and how many blocks."""
    weights = Counter(block.selective.weight for block, decision in zip(
        workload.blocks, plan.decisions(workload), strict=True)
        if block.selective is not None and decision.action == "recompute")
    if not any(weights):
        return ""
    if len(weights) == 1:
        return f"; below the layer by weight {next(iter(weights)):g}"
    return "; below the layer by weight " + ", ".join(
        f"{weight:g} ({n} blocks)" for weight, n in sorted(weights.items()))


def _units(workload: Workload) -> list[_Unit]:
    """Every recomputable block, and every parent cut into blocks as a whole, those that
    free the most bytes per second of recomputation first."""
    units = [_Unit(b.name, (k,), False) for k, b in enumerate(workload.blocks) if b.recomputable]
    pieces: dict[str, list[int]] = {}
    for k, block in enumerate(workload.blocks):
        if block.parent:
            pieces.setdefault(block.parent, []).append(k)
    units += [_Unit(parent, tuple(blocks), True) for parent, blocks in pieces.items()]
    return sorted(units, key=lambda u: -_bytes_per_second(workload, u.blocks))


def _bytes_per_second(workload: Workload, blocks: Sequence[int]) -> float:
    """Bytes recomputing these blocks as one frees (their saved activations less what the
    recomputation keeps: the first one's input, or below the layer what it keeps) per second
    of the recomputation."""
    block = workload.blocks[blocks[0]]
    if len(blocks) == 1 and block.selective is not None:
        freed = saved_bytes(workload, blocks[0]) - sum(block.selective.kept)
    else:
        kept = workload.block_input(blocks[0])
        freed = sum(saved_bytes(workload, b, but=kept) for b in blocks)
    seconds = sum(workload.blocks[b].recompute_s(workload.ops) for b in blocks)
    if seconds > 0:
        return freed / seconds
    return float("inf") if freed > 0 else 0.0


def saved_bytes(workload: Workload, block: int, but: int | None = None) -> int:
    """The activations a block's plain forward saves (each storage once, ``but`` one)."""
    b = workload.blocks[block]
    return sum(workload.saved[i].storage_nbytes for op in workload.ops[b.ops.start:b.ops.stop]
               for i in op.saves if workload.saved[i].activation and i != but
               and workload.saved[i].storage == i and not workload.saved[i].below)


def _first(n: int, ok: Callable[[int], bool]) -> int | None:
    """The least k in [0, n) with ok(k), assuming ok is monotone (False then True); None if
    none."""
    k = bisect_left(range(n), True, key=ok)
    return k if k < n else None


def table(mix: Choice, workload: Workload | None = None) -> str:
    """A row per block the mix swaps or recomputes (what it saved, what recomputing it costs:
    its forward once more), then the prediction against keeping everything."""
    workload = mix.workload or workload
    rows = [f"{'block':<28} {'decision':<22} {'saves':>10} {'costs ms':>9}"]
    for b, (block, decision) in enumerate(zip(workload.blocks, mix.decisions(workload),
                                              strict=True)):
        if decision.action == "keep":
            continue
        what = decision.action
        if block.selective and decision.action == "recompute":
            what += " below"
        if decision.action == "swap" and decision.codec.name != "raw":
            what += f" {decision.codec.name}"
        if decision.swap_input:
            what += " (kept swapped)" if block.selective else " (input swapped)"
        saved = saved_bytes(workload, b)
        cost = (f"{1e3 * mix.engine.recompute_s(block, workload.ops):.3f}"
                if decision.action == "recompute" else "link")
        rows.append(f"{block.name:<28} {what:<22} {saved / 2**20:>6.1f} MiB {cost:>9}")
    p, keep = mix.prediction, mix.keep
    budget = "none" if mix.budget_bytes is None else f"{mix.budget_bytes / 2**20:.1f} MiB"
    rows.append(
        f"{mix.how}: predicted step {p.step_s * 1e3:.1f} ms ({p.step_s / keep.step_s:.2f}x "
        f"keeping everything), peak {p.peak_bytes / 2**20:.1f} MiB "
        f"({p.peak_bytes / keep.peak_bytes:.0%} of keeping everything; "
        f"{p.held_peak_bytes / 2**20:.1f} MiB with the copies in flight, at most "
        f"{mix.inflight_bytes / 2**20:.0f} MiB), budget {budget}"
        + ("" if mix.fits else f": DOES NOT FIT, {mix.missing_bytes / 2**20:.0f} MiB short")
        + " (a prediction: replay of the step)")
    return "\n".join(rows)
