"""The cheapest mix of keep, swap and recompute per block that meets a memory budget.

Swapping is free only while the link's windows can carry it: about a fifth of a modern GPU's
activations cross PCIe inside a step (the first H100 run). Beyond that, every byte swapped
stalls the step for the link's time, while recomputing a block costs its forward once more.
So the planner, replaying the step (``replay.py``) for each candidate:

1. keeps everything if that fits (a run that fits costs nothing);
2. otherwise, for each count of blocks swapped (the earliest: backward needs them last;
   compressed where a block's codec says so, which widens the link's window), recomputes the
   fewest other blocks that make the peak fit, those that free the most bytes per second of
   recomputation first, and takes the mix the replay predicts fastest: swaps inside the
   link's window cost nothing, swaps beyond it the link's time, recomputation a forward;
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .replay import KEEP, RAW, Codec, Decision, Engine, Link, Plan, Prediction, predict
from .workload import Workload


@dataclass(frozen=True)
class Mix:
    """The chosen plan, its prediction, and the plain step's, for the table."""

    plan: Plan
    prediction: Prediction
    keep: Prediction  # keeping everything
    budget_bytes: int | None
    fits: bool
    how: str  # which candidate won
    candidates: dict[str, Prediction] = field(default_factory=dict)
    engine: Engine = field(default_factory=Engine)  # the settings it was replayed with

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

    def decisions(self, workload: Workload) -> list[Decision]:
        return self.plan.decisions(workload)


def choose(workload: Workload, budget_bytes: int | None, link: Link | None = None,
           engine: Engine | None = None, codec_of: Callable[[int], Codec] | None = None,
           recompute: bool = True, inflight_choices: Sequence[int] = ()) -> Mix:
    """The fastest plan the replay predicts to fit ``budget_bytes`` (the allocator's peak);
    ``codec_of(block)`` is how a swapped block travels (raw by default); ``recompute=False``
    only keeps or swaps; ``inflight_choices``: larger bounds on bytes in flight than
    ``engine``'s the plan may use, where the replay's peak with the copies in flight
    (``held_peak_bytes``) stays within the budget."""
    engine = engine or Engine()
    best = _choose(workload, budget_bytes, link or Link(), engine, codec_of, recompute)
    for bound in sorted(b for b in inflight_choices if b > engine.inflight_bytes):
        if not best.fits or best.how == "keep everything":
            break
        wider = _choose(workload, budget_bytes, link or Link(),
                        replace(engine, inflight_bytes=bound), codec_of, recompute, held=True)
        if wider.fits and wider.prediction.step_s < best.prediction.step_s:
            best = wider
    return best


def choose_among(workloads: Sequence[Workload], budget_bytes: int | None,
                 link: Link | None = None, engine: Engine | None = None,
                 inflight_choices: Sequence[int] = ()) -> tuple[Workload, Mix]:
    """``choose`` for each of the same step's workloads (its units of recomputation cut
    otherwise, ``Workload.with_units``): the fastest mix that fits, else the first's."""
    mixes = [(w, choose(w, budget_bytes, link, engine, inflight_choices=inflight_choices))
             for w in workloads]
    fitting = [(w, m) for w, m in mixes if m.fits]
    return min(fitting, key=lambda wm: wm[1].prediction.step_s) if fitting else mixes[0]


def _choose(workload: Workload, budget_bytes: int | None, link: Link, engine: Engine,
            codec_of: Callable[[int], Codec] | None, recompute: bool,
            held: bool = False) -> Mix:
    """``choose`` at one bound on bytes in flight (``held``: the copies in flight count
    against the budget too)."""
    codec_of = codec_of or (lambda block: RAW)

    def run(plan: Plan) -> Prediction:
        return predict(workload, plan, link, engine)

    keep = run(Plan())
    if budget_bytes is None or keep.peak_bytes <= budget_bytes:
        return Mix(Plan(), keep, keep, budget_bytes, True, "keep everything", engine=engine)
    names = [b.name for b in workload.blocks]
    swap = {b: Decision("swap", codec_of(b)) for b in range(len(names))}
    ranked = ([b for b in sorted(range(len(names)), key=lambda b: -_bytes_per_second(workload, b))
               if workload.blocks[b].recomputable] if recompute else [])

    def plan_of(chosen: dict[int, Decision]) -> Plan:
        return Plan(KEEP, {names[b]: d for b, d in chosen.items()})

    def fits(chosen: dict[int, Decision]) -> bool:
        p = run(plan_of(chosen))
        return max(p.peak_bytes, p.held_peak_bytes if held else 0) <= budget_bytes

    def mixed(swapped: int, recomputed: int) -> dict[int, Decision]:
        """The earliest ``swapped`` blocks swapped, the ``recomputed`` best others
        recomputed."""
        chosen = {b: swap[b] for b in range(swapped)}
        others = [b for b in ranked if b >= swapped]
        return chosen | {b: Decision("recompute") for b in others[:recomputed]}

    # For each count of earliest blocks swapped, the fewest recomputations that fit.
    candidates: dict[str, tuple[dict[int, Decision], Prediction]] = {}
    for swapped in range(len(names) + 1):
        left = sum(b >= swapped for b in ranked)
        k = _first(left + 1, lambda k, s=swapped: fits(mixed(s, k)))
        if k is None:
            continue
        chosen = mixed(swapped, k)
        candidates[f"swap the earliest {swapped} blocks, recompute {k}"] = (
            chosen, run(plan_of(chosen)))
        if k == 0:  # swapping more would only add link time
            break
    if not candidates and ranked:  # every block recomputed is not enough: move inputs too
        full = {b: Decision("recompute") for b in ranked}

        def moved(k: int) -> dict[int, Decision]:
            chosen = dict(full)
            for b in range(k):
                d = chosen.get(b)
                chosen[b] = (replace(d, swap_input=True, codec=swap[b].codec)
                             if d is not None else swap[b])
            return chosen

        k = _first(len(names) + 1, lambda k: fits(moved(k)))
        if k is not None:
            candidates[f"recompute all, swap the earliest {k} inputs or blocks"] = (
                moved(k), run(plan_of(moved(k))))
    if candidates:
        how, (chosen, prediction) = min(candidates.items(), key=lambda kv: kv[1][1].step_s)
        return Mix(plan_of(chosen), prediction, keep, budget_bytes, True, how,
                   {h: p for h, (_, p) in candidates.items()}, engine)
    # nothing fits: the plan that comes closest, and how far off it is
    tightest = {b: (Decision("recompute", swap[b].codec, swap_input=True)
                    if b in ranked else swap[b]) for b in range(len(names))}
    return Mix(plan_of(tightest), run(plan_of(tightest)), keep, budget_bytes, False,
               "does not fit", engine=engine)


def _bytes_per_second(workload: Workload, block: int) -> float:
    """Bytes a block's recomputation frees (its saved activations but its input) per second
    of its forward."""
    ops = workload.ops[workload.blocks[block].ops.start:workload.blocks[block].ops.stop]
    kept = workload.block_input(block)
    freed = sum(workload.saved[i].storage_nbytes for op in ops for i in op.saves
                if workload.saved[i].activation and workload.saved[i].storage == i
                and i != kept)
    seconds = sum(op.forward_s for op in ops)
    return freed / seconds if seconds > 0 else float("inf")


def _first(n: int, ok: Callable[[int], bool]) -> int | None:
    """The least k in [0, n) with ok(k), assuming ok is monotone (False then True); None if
    none."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo < n else None


def table(mix: Mix, workload: Workload) -> str:
    """A row per block the mix swaps or recomputes (what it saved, what recomputing it costs:
    its forward once more), then the prediction against keeping everything."""
    rows = [f"{'block':<28} {'decision':<22} {'saves':>10} {'costs ms':>9}"]
    for block, decision in zip(workload.blocks, mix.decisions(workload), strict=True):
        if decision.action == "keep":
            continue
        what = decision.action
        if decision.action == "swap" and decision.codec.name != "raw":
            what += f" {decision.codec.name}"
        if decision.swap_input:
            what += " (input swapped)"
        ops = workload.ops[block.ops.start:block.ops.stop]
        saved = sum(workload.saved[i].storage_nbytes for op in ops for i in op.saves
                    if workload.saved[i].activation and workload.saved[i].storage == i)
        cost = (f"{1e3 * sum(op.forward_s for op in ops):.3f}"
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
