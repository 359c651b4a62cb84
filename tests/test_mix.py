"""The planner's mix of keep, swap and recompute (``planning/mix.py``), on hand-built steps
and on the first H100 run's four profiles (every figure a prediction of the replay)."""

from __future__ import annotations

import pytest
from test_replay import ENGINE, LINK, MB, step

from cswap_lightning.config import AUTO_INFLIGHT_BYTES, INFLIGHT_CHOICES
from cswap_lightning.planning import mix
from cswap_lightning.planning import profiled as evidence
from cswap_lightning.planning.replay import Codec, Engine, Link, checkpoint_all, predict, swap_all


def test_a_budget_the_step_fits_changes_nothing():
    w = step([(1.0, 1.0, [10 * MB])] * 3)
    chosen = mix.choose(w, 10**12, LINK, ENGINE)
    assert chosen.fits and chosen.how == "keep everything" and not chosen.plan.blocks
    assert mix.choose(w, None, LINK, ENGINE).plan.blocks == {}


def blocks4() -> object:
    """Four blocks, each an input of 2 MB (1 ms of forward) and an activation of 10 MB (9 ms):
    recomputing a block keeps its input and frees its activation for 9 ms of compute."""
    ops = [(0.001, 0.001, [2 * MB]), (0.009, 0.009, [10 * MB])] * 4
    return step(ops, blocks=[(f"b{k}", 2, True) for k in range(4)])


def test_the_link_carries_the_earliest_blocks_and_recomputation_the_rest():
    """At 1 MB/ms the copies of the first two blocks hide behind compute; for a budget of
    20 MB (48 MB kept) the mix swaps the first and recomputes two: faster than swapping only
    (which stalls on the link) and than checkpointing every block."""
    w = blocks4()
    keep = predict(w, link=LINK, engine=ENGINE)
    assert keep.peak_bytes == 48 * MB
    cheap = mix.choose(w, 30 * MB, LINK, ENGINE)
    assert [d.action for d in cheap.decisions(w)] == ["swap", "swap", "keep", "keep"]
    assert cheap.prediction.step_s == pytest.approx(keep.step_s)  # inside the link's window
    chosen = mix.choose(w, 20 * MB, LINK, ENGINE)
    assert [d.action for d in chosen.decisions(w)] == ["swap", "recompute", "recompute", "keep"]
    assert chosen.fits and chosen.prediction.peak_bytes <= 20 * MB
    assert chosen.prediction.step_s == pytest.approx(keep.step_s + 2 * 0.009 + 0.002)
    assert chosen.prediction.step_s < predict(w, swap_all(), LINK, ENGINE).step_s
    assert chosen.prediction.step_s < predict(w, checkpoint_all(), LINK, ENGINE).step_s


def test_a_block_that_compresses_swaps_further_inside_the_window():
    """At 0.5 MB/ms one raw block fits the window; halved by a codec, two do."""
    slow = type(LINK)(d2h=500 * MB, h2d=500 * MB)
    w = blocks4()
    raw = mix.choose(w, 30 * MB, slow, ENGINE)
    halved = mix.choose(w, 30 * MB, slow, ENGINE,
                        codec_of=lambda w, b: Codec("zvc", ratio=0.5, encode=1e15, decode=1e15))
    assert [d.action for d in raw.decisions(w)] == ["swap", "recompute", "keep", "keep"]
    assert [d.action for d in halved.decisions(w)] == ["swap", "swap", "keep", "keep"]
    assert halved.prediction.step_s < raw.prediction.step_s


def test_without_recomputation_only_swaps():
    chosen = mix.choose(blocks4(), 30 * MB, LINK, ENGINE, recompute=False)
    assert chosen.fits and {d.action for d in chosen.decisions(blocks4())} <= {"keep", "swap"}


def two_bursts(first: int, third: int) -> object:
    """Two 1 ms blocks saving ``first`` bytes each (faster than the link carries them), then
    a 30 ms block saving ``third`` and a 30 ms block saving 5 MB."""
    return step([(0.001, 0.001, [first]), (0.001, 0.001, [first]),
                 (0.030, 0.030, [third]), (0.030, 0.030, [5 * MB])])


def test_a_larger_bound_in_flight_lets_forward_run_on_while_the_first_blocks_are_copied():
    """At a 10 MB bound forward waits 9 ms for the first block's copy before the second's;
    with 40 MB allowed it runs on and the copies end during the long block: keep's time."""
    w = two_bursts(10 * MB, 30 * MB)
    bounded = type(ENGINE)(min_bytes=1, prefetch_bytes=1, inflight_bytes=10 * MB)
    keep = predict(w, link=LINK, engine=bounded)
    fixed = mix.choose(w, 36 * MB, LINK, bounded)
    wider = mix.choose(w, 36 * MB, LINK, bounded, inflight_choices=(40 * MB,))
    assert [d.action for d in fixed.decisions(w)] == ["swap", "swap", "keep", "keep"]
    assert fixed.inflight_bytes == 10 * MB and fixed.prediction.forward_stall_s > 0.008
    assert wider.inflight_bytes == 40 * MB and wider.prediction.forward_stall_s == 0
    assert wider.prediction.step_s == pytest.approx(keep.step_s)
    assert wider.prediction.held_peak_bytes <= 36 * MB
    assert "at most 38 MiB" in mix.table(wider, w)


def test_a_larger_bound_is_not_taken_where_the_copies_in_flight_pass_the_budget():
    """With 80 MB allowed, the second block's copy still runs while the third block's 30 MB
    are made: 50 MB held against a 45 MB budget, though the allocator's peak says 40."""
    w = two_bursts(20 * MB, 30 * MB)
    bounded = type(ENGINE)(min_bytes=1, prefetch_bytes=1, inflight_bytes=20 * MB)
    wide = type(ENGINE)(min_bytes=1, prefetch_bytes=1, inflight_bytes=80 * MB)
    swapped = mix.Mix(mix.KEEP, {"b0": mix.BlockDecision("swap"), "b1": mix.BlockDecision("swap")})
    held = predict(w, swapped, LINK, wide)
    assert held.peak_bytes == 40 * MB and held.held_peak_bytes == 50 * MB
    chosen = mix.choose(w, 45 * MB, LINK, bounded, inflight_choices=(80 * MB,))
    assert chosen.inflight_bytes == 20 * MB and chosen.prediction.held_peak_bytes <= 45 * MB


def test_a_host_budget_swaps_only_what_the_host_can_hold_and_recomputes_the_rest():
    """Swapping the first block holds its 12 MB on the host: under a host budget of 11 MB the
    mix recomputes it instead (slower, and still within the device's budget)."""
    w = blocks4()
    free = mix.choose(w, 20 * MB, LINK, ENGINE)
    assert free.prediction.host_bytes == free.prediction.d2h_bytes == 12 * MB
    assert mix.choose(w, 20 * MB, LINK, ENGINE, host_bytes=12 * MB).plan == free.plan
    for host in (11 * MB, 0):
        held = mix.choose(w, 20 * MB, LINK, ENGINE, host_bytes=host)
        assert [d.action for d in held.decisions(w)] == ["recompute"] * 3 + ["keep"]
        assert held.fits and held.host_bytes == host and held.prediction.host_bytes == 0
        assert held.prediction.peak_bytes <= 20 * MB
        assert held.prediction.step_s > free.prediction.step_s


def test_below_checkpointings_peak_the_host_budget_bounds_the_inputs_swapped():
    """14 MB needs every block recomputed and the first two inputs (2 MB each) swapped: a host
    budget of 4 MB holds them, one of 3 MB does not, and the mix says why it does not fit."""
    w = blocks4()
    assert predict(w, checkpoint_all(), LINK, ENGINE).peak_bytes > 14 * MB
    held = mix.choose(w, 14 * MB, LINK, ENGINE, host_bytes=4 * MB)
    assert held.fits and held.how == "recompute all, swap the earliest 2 inputs or blocks"
    short = mix.choose(w, 14 * MB, LINK, ENGINE, host_bytes=3 * MB)
    assert not short.fits and short.prediction.host_bytes <= 3 * MB
    assert short.how == "does not fit (the host budget stops it moving more)"


def test_at_offloaded_checkpointings_peak_the_earliest_blocks_swap_whole():
    """Where only every layer recomputed with its input swapped fits (the peers' offloaded
    checkpointing), the earliest layers are swapped whole instead while that fits and is
    faster: the link carries them inside forward, and they run nothing again. Llama-3-8B's
    shapes, 8 layers, LoRA, 4096 tokens on an H100 PCIe, 4 MiB over offloaded
    checkpointing's peak (at it exactly, what a swapped layer keeps under ``min_bytes``
    passes it: its norms' statistics and LoRA's rank-16 products; the peers' own plan is the
    one that fits)."""
    from cswap_lightning.planning import models, sizing
    from cswap_lightning.planning.devices import device
    from cswap_lightning.planning.estimate import Setup, estimate

    est = estimate(Setup("llama-3-8b", 4096, 1, lora=models.LoRA(), layers=8),
                   device("h100-pcie"))
    offloaded = sizing.peers(est)[0].prediction
    w = est.workload()
    at = mix.choose(w, offloaded.peak_bytes, est.device.link)
    assert at.how == "recompute all, swap the earliest 8 inputs or blocks"
    assert at.prediction.step_s == pytest.approx(offloaded.step_s)
    above = mix.choose(w, offloaded.peak_bytes + 4 * 2**20, est.device.link)
    assert above.fits and above.how.startswith("swap the earliest 4 blocks, recompute the "
                                               "others, the inputs of those up to block 8")
    assert above.prediction.step_s < 0.9 * offloaded.step_s


def test_a_budget_no_mix_meets_says_by_how_much():
    w = step([(0.010, 0.010, [10 * MB])] * 4, start=50 * MB)  # 50 MB before any activation
    chosen = mix.choose(w, 40 * MB, LINK, ENGINE)
    assert not chosen.fits and chosen.missing_bytes >= 10 * MB
    assert "DOES NOT FIT" in mix.table(chosen, w)


@pytest.mark.parametrize("model", sorted(evidence.PROFILES))
def test_on_the_h100_profiles_every_budget_down_to_checkpointings_peak_is_met(model):
    """Predictions: from 90% of no offload's peak down to checkpointing's, the mix fits and is
    at least as fast as checkpointing everything and as swapping only (where either fits)."""
    w = evidence.workload(model)
    keep = predict(w)
    checkpointed = predict(w, checkpoint_all())
    swapped = predict(w, swap_all())
    for budget in (int(0.9 * keep.peak_bytes), int(0.7 * keep.peak_bytes),
                   checkpointed.peak_bytes):
        chosen = mix.choose(w, budget)
        if budget < checkpointed.peak_bytes and not chosen.fits:
            continue  # below checkpointing's own peak (VGG-16's classifier holds most)
        assert chosen.fits, (model, budget, mix.table(chosen, w))
        assert chosen.prediction.peak_bytes <= budget
        assert chosen.prediction.step_s <= checkpointed.step_s * 1.001, mix.table(chosen, w)
        if swapped.peak_bytes <= budget:
            assert chosen.prediction.step_s <= swapped.step_s


def test_the_table_labels_the_figures_predictions():
    w = evidence.workload("bert-large")
    chosen = mix.choose(w, int(0.7 * predict(w).peak_bytes))
    text = mix.table(chosen, w)
    assert "recompute" in text and "a prediction" in text
    changed = [d for d in chosen.decisions(w) if d.action != "keep"]
    assert text.count("\n") == len(changed) + 1  # a header, a row per block changed, the total


def test_the_plan_bench_writes_predictions_for_every_model_and_budget(tmp_path):
    from cswap_lightning.commands.bench_plan import LEVELS, run_plan_bench

    rows = run_plan_bench(["bert-large"], out=str(tmp_path / "plan"))
    assert [r["budget"] for r in rows][-1] == "checkpointing's peak"
    assert len(rows) == len(LEVELS) + 1
    assert all(r["fits"] and r["peak_bytes"] <= r["budget_bytes"] for r in rows)
    assert all(r["throughput_vs_checkpointing"] >= 0.999 for r in rows)
    raised = [r for r in rows if r["inflight_bytes"] > AUTO_INFLIGHT_BYTES]
    assert raised and all(r["held_peak_bytes"] <= r["budget_bytes"] for r in raised)
    report = (tmp_path / "plan.md").read_text()
    assert "prediction" in report and "not a measurement" in report


def test_finer_units_split_a_block_around_each_unit():
    """Ops 0-2 one block whose middle op is a unit of its own: the unit is recomputable, the
    ops around it no longer are (checkpointing them alone is not what the engine does)."""
    w = step([(0.001, 0.001, [MB])] * 4, blocks=[("layer", 3, True), ("head", 1, True)])
    finer = w.with_units(lambda op: op.module == "m1")
    assert [(b.name, list(b.ops), b.recomputable) for b in finer.blocks] == [
        ("layer [0:1]", [0], False), ("m1", [1], True), ("layer [2:3]", [2], False),
        ("head", [3], True)]
    assert [op.block for op in finer.ops] == [0, 1, 2, 3]
    assert w.with_units(lambda op: False).blocks == w.blocks


def test_the_live_step_offers_nested_units_as_a_second_candidate():
    from cswap_lightning.core.recompute import BlockCall
    from cswap_lightning.planning import live
    from cswap_lightning.planning.profiler import SiteProfile

    profiles = [SiteProfile(k, (MB // 4,), "float32", MB, True, module=f"m{k}",
                            forward_s=0.001, backward_s=0.001) for k in range(6)]
    calls = [BlockCall("h.0", 0, 3, 1, 0, 0.001), BlockCall("h.0.act", 1, 2, 1, 0, 0.001),
             BlockCall("h.1", 3, 6, 1, 0, 0.001)]
    outer, inner = live.candidates(profiles, calls)
    assert [b.name for b in outer.blocks if b.recomputable] == ["h.0", "h.1"]
    assert [b.name for b in inner.blocks if b.recomputable] == ["h.0.act", "h.1"]
    assert [b.parent for b in inner.blocks] == ["h.0", "h.0", "h.0", ""]
    assert inner.merged({"h.0"}).blocks == outer.blocks  # the layer whole again
    assert len(live.candidates(profiles, [calls[0], calls[2]])) == 1  # nothing nests
    # what one node asked for at once, by site (site 9 was not measured): every candidate's
    grouped = live.candidates(profiles, calls, together=[(4, 5, 9), (2,)])
    assert all(w.together == ((4, 5),) for w in grouped)


def test_gpt2_recomputes_activation_modules_and_layers_where_that_is_faster():
    """Predictions: GPT-2 medium's gelu_new saves four tensors in a fifth of its layer's
    forward time. At 50% of no offload's peak the planner recomputes some of those alone and
    some layers whole (a layer and its activation module are never both recomputed), faster
    than recomputing layers only."""
    layers, finer = evidence.candidates("gpt2-medium")
    budget = int(0.5 * predict(layers).peak_bytes)
    units, chosen = mix.choose_among((layers, finer), budget)
    assert chosen.fits and units is chosen.workload
    recomputed = [b.name for b, d in zip(units.blocks, chosen.decisions(), strict=True)
                  if d.action == "recompute"]
    acts = {name.removesuffix(".mlp.act") for name in recomputed if name.endswith("mlp.act")}
    whole = {name for name in recomputed if not name.endswith("mlp.act")}
    assert acts and whole and not acts & whole, recomputed
    assert chosen.prediction.step_s < 0.98 * mix.choose(layers, budget).prediction.step_s
    assert len(evidence.candidates("vgg16")) == 1  # no activation modules by name


def test_replays_kept_across_budgets_give_the_same_mixes_with_fewer_replays(monkeypatch):
    """``mix.Replays``: the mixes chosen at three budgets with predictions kept across them
    are those chosen afresh at each, with fewer replays: the same workload and mix replayed
    with another engine or link is not taken for a repeat (but for a bound in flight forward
    would not wait at: ``test_a_step_that_never_waited_at_its_bound_is_not_replayed_again``)."""
    layers, finer = evidence.candidates("gpt2-medium")
    keep = predict(layers).peak_bytes
    budgets = [int(level * keep) for level in (0.8, 0.6, 0.5)]
    replays = []
    real = mix.predict
    monkeypatch.setattr(mix, "predict", lambda *a, **k: replays.append(1) or real(*a, **k))
    choices = {}
    for shared in (None, mix.Replays()):
        replays.clear()
        choices[shared is None] = [
            mix.choose_among((layers, finer), b, inflight_choices=(4 << 30,), replays=shared)[1]
            for b in budgets]
        choices[shared is None, "replays"] = len(replays)
    for fresh, kept in zip(choices[True], choices[False], strict=True):
        assert (kept.how, kept.prediction, kept.engine) == (fresh.how, fresh.prediction,
                                                              fresh.engine)
    assert choices[False, "replays"] < 0.8 * choices[True, "replays"]
    assert any(c.inflight_bytes == 4 << 30 for c in choices[True])  # the wider bound was tried


def test_a_step_that_never_waited_at_its_bound_is_not_replayed_again(monkeypatch):
    """``mix.Replays`` gives a step replayed under one bound on bytes in flight for another
    bound where forward would not wait at either: the same prediction, no replay; under a
    bound it would wait at, a replay of its own."""
    layers, _ = evidence.candidates("gpt2-medium")
    plan = swap_all()
    replays, real = [], mix.predict
    monkeypatch.setattr(mix, "predict", lambda *a, **k: replays.append(1) or real(*a, **k))
    kept = mix.Replays()
    wide = kept.predict(layers, plan, Link(), Engine(inflight_bytes=1 << 40))
    needed = wide.inflight_needed_bytes
    assert 0 < needed < 1 << 40 and len(replays) == 1
    assert kept.predict(layers, plan, Link(), Engine(inflight_bytes=needed)) is wide
    assert len(replays) == 1
    tight = kept.predict(layers, plan, Link(), Engine(inflight_bytes=needed // 2))
    assert len(replays) == 2 and tight.forward_stall_s > wide.forward_stall_s
    assert tight == real(layers, plan, Link(), Engine(inflight_bytes=needed // 2))


def test_a_budget_nothing_fits_costs_one_replay_per_count_of_blocks_swapped(monkeypatch):
    """Where recomputing every unit does not fit with the earliest blocks swapped, fewer
    recomputations do not either: one replay says so, not a bisection of the counts (a budget
    nothing fits tries every count of blocks swapped, then of inputs moved)."""
    w = evidence.workload("gpt2-medium")
    keep = predict(w, link=LINK, engine=ENGINE).peak_bytes
    replays, real = [], mix.predict
    monkeypatch.setattr(mix, "predict", lambda *a, **k: replays.append(1) or real(*a, **k))
    chosen = mix.choose(w, keep // 5, LINK, ENGINE)
    assert chosen.how == "does not fit" and not chosen.fits
    counts = len(w.blocks) + 1  # of blocks swapped: none to all
    # keeping everything; one per count; then inputs moved too, each count (the peak falls,
    # then may rise: not bisected), the closest plan among them
    assert len(replays) <= 1 + 2 * counts


def test_recomputing_more_blocks_never_makes_a_step_faster():
    """What the search stops by: with the earliest blocks swapped, recomputing one more of
    the later blocks never makes the step faster (recomputation only adds work), on every
    profile and on a Llama's estimate, its layers recomputed whole and below the layer."""
    from itertools import combinations

    from cswap_lightning.planning.devices import device
    from cswap_lightning.planning.estimate import Setup, estimate
    from cswap_lightning.planning.replay import KEEP, BlockDecision, Mix

    llama = estimate(Setup("llama-3-8b", 1024, 1, layers=4), device("h100-pcie")).workload()
    steps = [evidence.workload(m) for m in ("gpt2-medium", "bert-large", "resnet50", "vgg16")]
    for case, w in enumerate([*steps, *evidence.unit_candidates(llama)]):  # below the layer too
        later = [b.name for b in w.blocks if b.recomputable][-4:]
        for swapped in (0, 2, len(w.blocks) // 2):
            swaps = {b.name: BlockDecision("swap") for b in w.blocks[:swapped]}

            def step_s(names: tuple[str, ...], w=w, swaps=swaps) -> float:
                return predict(w, Mix(KEEP, swaps | {n: BlockDecision("recompute")
                                                     for n in names if n not in swaps}),
                               LINK, ENGINE).step_s

            for k in range(len(later)):
                for names in combinations(later, k):
                    fewer = step_s(names)
                    for more in set(later) - set(names):
                        assert step_s((*names, more)) >= fewer, (case, swapped, names, more)


def test_swapping_one_more_block_never_makes_a_step_faster():
    """What the sweep over counts of blocks swapped stops by (``mix._Beaten.later``): with
    nothing recomputed, swapping the next block too, whole or below the layer, never makes
    the step faster (it only adds link time), on every profile and on a Llama's estimate."""
    from cswap_lightning.planning.devices import device
    from cswap_lightning.planning.estimate import Setup, estimate
    from cswap_lightning.planning.replay import KEEP, RAW, BlockDecision, Mix

    llama = estimate(Setup("llama-3-8b", 1024, 1, layers=4), device("h100-pcie")).workload()
    steps = [evidence.workload(m) for m in ("gpt2-medium", "bert-large", "resnet50", "vgg16")]
    for case, w in enumerate([*steps, *evidence.unit_candidates(llama)]):
        for below in (False, True):
            way = [BlockDecision("recompute", RAW, swap_input=True)
                   if below and b.selective else BlockDecision("swap") for b in w.blocks]
            steps_s = [predict(w, Mix(KEEP, {b.name: d for b, d in zip(
                w.blocks[:swapped], way, strict=False)}), LINK, ENGINE).step_s
                for swapped in range(len(w.blocks) + 1)]
            assert steps_s == sorted(steps_s), (case, below)


def test_once_swapping_alone_is_beaten_no_larger_count_of_blocks_swapped_is_searched(
        monkeypatch):
    """Where recomputing nothing with the earliest blocks swapped is already no faster than a
    mix found, the sweep stops: GPT-2 medium's and BERT-large's profiles at 45% of keeping
    everything (133 and 135 replays when every count was tried)."""
    replays, real = [], mix.predict
    monkeypatch.setattr(mix, "predict", lambda *a, **k: replays.append(1) or real(*a, **k))
    for model in ("gpt2-medium", "bert-large"):
        workloads = evidence.candidates(model)
        keep = predict(workloads[0], link=LINK, engine=ENGINE).peak_bytes
        replays.clear()
        _, chosen = mix.choose_among(workloads, int(0.45 * keep), LINK, ENGINE,
                                     inflight_choices=INFLIGHT_CHOICES)
        assert chosen.fits and len(replays) <= 60, model


def test_a_search_told_of_a_faster_plan_finds_it_only_where_it_is_beaten():
    """``faster_than``: the same plan where it is faster than that, none that fits and is
    faster otherwise; the searches skipped run fewer replays."""
    w = evidence.workload("resnet50")
    budget = int(0.4 * predict(w, link=LINK, engine=ENGINE).peak_bytes)
    free, told = mix.Replays(), mix.Replays()
    chosen = mix.choose(w, budget, LINK, ENGINE, replays=free)
    assert chosen.fits and chosen.how != "keep everything"
    same = mix.choose(w, budget, LINK, ENGINE, faster_than=chosen.prediction.step_s * 1.001)
    assert (same.how, same.prediction) == (chosen.how, chosen.prediction)
    beaten = mix.choose(w, budget, LINK, ENGINE, replays=told,
                        faster_than=chosen.prediction.step_s)
    assert not (beaten.fits and beaten.prediction.step_s < chosen.prediction.step_s)
    assert len(told._predictions) < len(free._predictions)


@pytest.mark.parametrize("model", ["gpt2-medium", "bert-large", "resnet50", "vgg16"])
def test_skipping_what_cannot_win_chooses_what_searching_everything_does(model):
    workloads = evidence.candidates(model)
    keep = predict(workloads[0], link=LINK, engine=ENGINE).peak_bytes
    replays = {True: mix.Replays(), False: mix.Replays()}
    for share in (0.3, 0.45, 0.6, 0.75, 0.9):
        chosen = {prune: mix.choose_among(workloads, int(share * keep), LINK, ENGINE,
                                          inflight_choices=INFLIGHT_CHOICES,
                                          replays=replays[prune], prune=prune)[1]
                  for prune in (True, False)}
        assert (chosen[True].how, chosen[True].prediction) == (
            chosen[False].how, chosen[False].prediction), share
    assert len(replays[True]._predictions) <= len(replays[False]._predictions)


@pytest.mark.slow
def test_the_fewest_recomputations_that_fit_are_found_by_bisection_on_the_profiles(
        monkeypatch):
    """What the main sweep's bisection assumes (``mix._first``): with the earliest blocks
    swapped, once recomputing the best k units fits, recomputing more fits too. Checked at
    every count on the four H100 profiles' workloads (their units cut each way) at two
    budgets; the last resort's count of inputs swapped is not bisected (its peak falls,
    then rises)."""
    broken, checked, first = [], [], mix._first

    def every_count(n, ok):
        fits = [ok(k) for k in range(n)]
        checked.append(n)
        if fits != sorted(fits):
            broken.append(fits)
        return first(n, ok)

    monkeypatch.setattr(mix, "_first", every_count)
    for model in ("gpt2-medium", "bert-large", "resnet50", "vgg16"):
        workloads = evidence.candidates(model)
        keep = predict(workloads[0], link=LINK, engine=ENGINE).peak_bytes
        for share in (0.3, 0.6):
            mix.choose_among(workloads, int(share * keep), LINK, ENGINE,
                             inflight_choices=INFLIGHT_CHOICES, prune=False)
    assert len(checked) > 20 and max(checked) > 10  # searches of many counts ran
    assert not broken, broken[:3]
