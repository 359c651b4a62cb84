"""The replay (``planning/replay.py``): its mechanics on hand-built steps, and its predictions
of the four H100 profiles against what the H100 measured (``planning/profiled.py``)."""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatch
from pathlib import Path

import pytest

from cswap_lightning.planning import profiled as evidence
from cswap_lightning.planning.replay import (
    CODEC_KERNELS,
    RECOMPUTE,
    SWAP,
    BlockDecision,
    Codec,
    Engine,
    Link,
    Mix,
    checkpoint_all,
    predict,
    swap_all,
)
from cswap_lightning.planning.workload import Block, Op, Saved, Workload, load

MB = 10**6
LINK = Link(d2h=1000 * MB, h2d=1000 * MB)  # 1 MB per millisecond each way
ENGINE = Engine(min_bytes=1, prefetch_bytes=10**12, inflight_bytes=10**12, host_s_per_move=0.0)


def step(ops: list[tuple[float, float, list[int]]],
         blocks: list[tuple[str, int, bool]] | None = None, start: int = 0) -> Workload:
    """A step of ops ``(forward s, backward s, [bytes of each activation it saves])``, each
    storage its own, no other allocator bytes; ``blocks``: (name, how many ops, recomputable),
    default one block per op, each recomputable."""
    saved: list[Saved] = []
    built: list[Op] = []
    blocks = blocks or [(f"b{k}", 1, True) for k in range(len(ops))]
    block_of = [b for b, (_, n, _) in enumerate(blocks) for _ in range(n)]
    for k, (forward_s, backward_s, sizes) in enumerate(ops):
        first = len(saved)
        saved += [Saved(f"m{k}", "bfloat16", n, n, first + j, False, False)
                  for j, n in enumerate(sizes)]
        built.append(Op(f"m{k}", block_of[k], range(first, len(saved)), forward_s, backward_s,
                        0, 0, 0))
    spans, at = [], 0
    for name, n, recomputable in blocks:
        spans.append(Block(name, range(at, at + n), recomputable))
        at += n
    return Workload("test", 1, tuple(saved), tuple(built), tuple(spans), start, 0, 0)


# -- mechanics ----------------------------------------------------------------------------------
def test_no_offload_is_the_compute_and_every_saved_byte_at_backward_start():
    w = step([(1.0, 2.0, [10 * MB]), (3.0, 4.0, [20 * MB])], start=5 * MB)
    p = predict(w, engine=ENGINE)
    assert p.step_s == pytest.approx(10.0)
    assert p.peak_bytes == 35 * MB
    assert p.d2h_bytes == p.h2d_bytes == 0


def test_a_swap_its_compute_hides_costs_nothing():
    # 10 MB out takes 10 ms, back 10 ms: 20 ms of link behind 30 ms of compute after it
    w = step([(0.001, 0.001, [10 * MB]), (0.015, 0.015, [])])
    kept, swapped = predict(w, engine=ENGINE, link=LINK), predict(w, swap_all(), LINK, ENGINE)
    assert swapped.step_s == pytest.approx(kept.step_s)
    assert swapped.backward_wait_s == 0
    assert (swapped.d2h_bytes, swapped.h2d_bytes) == (10 * MB, 10 * MB)


def test_the_host_time_per_moved_tensor_stalls_a_step_of_many_small_swaps():
    """200 ops of 0.1 ms, each saving a 1 KB tensor: the link carries them at once, but the
    engine's 0.5 ms of host time per moved tensor (half at the copy out, half at the unpack)
    makes the host, not the device, set the pace (measured on CUDA: 99.3 us on the H200)."""
    w = step([(1e-4, 1e-4, [1000])] * 200)
    host = replace(ENGINE, host_s_per_move=5e-4)
    kept, swapped = predict(w, engine=host, link=LINK), predict(w, swap_all(), LINK, host)
    assert kept.step_s == pytest.approx(0.04)  # nothing moved: no host time
    assert swapped.forward_s == pytest.approx(199 * 2.5e-4 + 1e-4)  # the last op waits for 199
    assert swapped.backward_s == pytest.approx(200 * 2.5e-4, rel=0.01)
    free = predict(w, swap_all(), LINK, ENGINE)
    assert free.step_s == pytest.approx(kept.step_s, rel=1e-3)


def test_a_swap_that_does_not_fit_stalls_by_exactly_the_excess():
    # 40 MB: 40 ms out and 40 ms back, behind 10 + 10 ms of compute: 60 ms exposed
    w = step([(0.001, 0.001, [40 * MB]), (0.010, 0.010, [])])
    kept, swapped = predict(w, engine=ENGINE, link=LINK), predict(w, swap_all(), LINK, ENGINE)
    assert swapped.step_s - kept.step_s == pytest.approx(0.060)
    assert swapped.backward_wait_s == pytest.approx(0.060)


def test_forward_waits_at_the_in_flight_bound_for_the_oldest_copy():
    # two 60 MB copies under a 100 MB bound: the second waits until the first is out (61 ms),
    # while forward had issued 1 + 1 ms of compute: it stalls 59 ms
    w = step([(0.001, 0.0, [60 * MB]), (0.001, 0.0, [60 * MB]), (0.001, 0.0, [])])
    bounded = Engine(min_bytes=1, prefetch_bytes=10**12, inflight_bytes=100 * MB,
                     host_s_per_move=0.0)
    p = predict(w, swap_all(), LINK, bounded)
    assert p.forward_stall_s == pytest.approx(0.059)
    assert predict(w, swap_all(), LINK, ENGINE).forward_stall_s == 0


def test_from_the_least_bound_forward_never_waits_at_every_bound_replays_the_same():
    # the second 60 MB copy starts while the first is in flight: 120 MB is the least bound
    # forward never waits at; from there up the step is the same, below it forward stalls
    w = step([(0.001, 0.0, [60 * MB]), (0.001, 0.0, [60 * MB]), (0.001, 0.0, [])])
    unbounded = predict(w, swap_all(), LINK, ENGINE)
    assert unbounded.inflight_needed_bytes == 120 * MB
    for bound in (120 * MB, 500 * MB):
        assert predict(w, swap_all(), LINK, replace(ENGINE, inflight_bytes=bound)) == unbounded
    below = predict(w, swap_all(), LINK, replace(ENGINE, inflight_bytes=120 * MB - 1))
    assert below.forward_stall_s > 0 and unbounded.forward_stall_s == 0
    assert predict(w, Mix(), LINK, ENGINE).inflight_needed_bytes == 0  # nothing moved


def test_recompute_adds_the_blocks_forward_and_frees_its_bytes_until_its_backward():
    ops = [(0.001, 0.002, [8 * MB]), (0.003, 0.004, [30 * MB, 30 * MB]), (0.005, 0.006, [])]
    w = step(ops, blocks=[("stem", 1, False), ("layer", 1, True), ("head", 1, False)])
    kept = predict(w, engine=ENGINE)
    p = predict(w, Mix(blocks={"layer": RECOMPUTE}), engine=ENGINE)
    assert p.step_s - kept.step_s == pytest.approx(0.003)
    assert p.recompute_s == pytest.approx(0.003)
    # both peak at 8 + 60 MB: in forward while the layer runs; recomputed, the layer keeps its
    # input (its first saved tensor, 30 MB) and its other 30 MB live again in its backward
    assert kept.peak_bytes == p.peak_bytes == 68 * MB
    w_input = step([(0.001, 0.002, [8 * MB]), (0.003, 0.004, [8 * MB, 30 * MB]),
                    (0.001, 0.001, [50 * MB])],
                   blocks=[("stem", 1, False), ("layer", 1, True), ("head", 1, False)])
    # kept: 8 + 38 + 50 at the head; recomputed, the layer keeps its input (8) only: 8 + 8 + 50
    assert predict(w_input, engine=ENGINE).peak_bytes == 96 * MB
    assert predict(w_input, Mix(blocks={"layer": RECOMPUTE}), engine=ENGINE).peak_bytes == 66 * MB


def test_recomputation_can_be_charged_a_share_of_its_forward():
    """``Engine.recompute_scale`` (a bracket: checkpointing measured cheaper than the replay
    charges on an H200) scales what recomputing costs, nothing else."""
    ops = [(0.001, 0.002, [8 * MB]), (0.003, 0.004, [30 * MB, 30 * MB]), (0.005, 0.006, [])]
    w = step(ops, blocks=[("stem", 1, False), ("layer", 1, True), ("head", 1, False)])
    plan = Mix(blocks={"layer": RECOMPUTE})
    full, cheaper = (predict(w, plan, engine=replace(ENGINE, recompute_scale=scale))
                     for scale in (1.0, 0.5))
    assert cheaper.recompute_s == pytest.approx(0.0015)
    assert full.step_s - cheaper.step_s == pytest.approx(0.0015)
    assert cheaper.peak_bytes == full.peak_bytes
    kept = predict(w, engine=ENGINE)
    assert predict(w, engine=replace(ENGINE, recompute_scale=0.5)).step_s == kept.step_s
    with pytest.raises(ValueError, match="recompute_scale.*0"):
        Engine(recompute_scale=0.0)


def test_a_recomputed_blocks_swapped_input_comes_back_before_the_recompute():
    w = step([(0.001, 0.001, [20 * MB, 5 * MB]), (0.001, 0.001, [])],
             blocks=[("layer", 1, True), ("head", 1, False)])
    plan = Mix(blocks={"layer": BlockDecision("recompute", swap_input=True)})
    p = predict(w, plan, LINK, ENGINE)
    assert (p.d2h_bytes, p.h2d_bytes) == (20 * MB, 20 * MB)  # its input only
    # out 20 ms from 1 ms, back 20 ms: the recompute waits until 41 ms
    assert p.step_s == pytest.approx(0.041 + 0.001 + 0.001)


def test_the_prefetch_window_bounds_the_copies_back_on_the_device():
    # eight 10 MB swaps; after each restore, prefetch within the window, one always goes
    w = step([(0.001, 0.001, [10 * MB]) for _ in range(8)] + [(0.001, 0.001, [])])

    def peak(window: int) -> int:
        return predict(w, swap_all(), LINK, Engine(min_bytes=1, prefetch_bytes=window,
                                                    inflight_bytes=10**12)).peak_bytes

    assert peak(20 * MB) == 30 * MB  # the copy in use and two prefetched
    assert peak(10**12) == 80 * MB  # all of them at once
    assert peak(0) == 10 * MB  # none ahead: each restored when its op needs it


def test_what_one_node_asks_for_at_once_comes_back_together():
    """Three 10 MB swaps one autograd node asked for at once (a block's recomputation asking
    for all it kept): they come back when backward reaches the latest of them, before its
    op runs, not one at a time; each goes when its own op is done."""
    w = step([(0.001, 0.001, [10 * MB]) for _ in range(3)] + [(0.001, 0.001, [])])
    engine = Engine(min_bytes=1, prefetch_bytes=0, inflight_bytes=10**12)
    alone = predict(w, swap_all(), LINK, engine)
    together = predict(replace(w, together=((0, 1, 2),)), swap_all(), LINK, engine,
                       timeline=True)
    assert alone.peak_bytes == 10 * MB and together.peak_bytes == 30 * MB
    assert together.h2d_bytes == alone.h2d_bytes == 30 * MB
    # the three restores queue at once, and the first op in backward waits for all of them
    backs = [i.end for i in together.timeline if i.lane == "h2d"]
    first = next(i for i in together.timeline if i.label == "backward m2")
    assert len(backs) == 3 and first.start == pytest.approx(max(backs))


def test_a_storage_two_ops_saved_goes_out_once_and_comes_back_for_each():
    saved = (Saved("a", "bfloat16", 10 * MB, 10 * MB, 0, False, False),
             Saved("b", "bfloat16", 10 * MB, 10 * MB, 0, False, False))
    ops = (Op("a", 0, range(1), 0.001, 0.001, 0, 0, 0),
           Op("b", 0, range(1, 2), 0.001, 0.001, 0, 0, 0))
    w = Workload("shared", 1, saved, ops, (Block("all", range(2), False),), 0, 0, 0)
    p = predict(w, swap_all(), LINK, ENGINE)
    assert (p.d2h_bytes, p.h2d_bytes) == (10 * MB, 20 * MB)


def test_what_the_engine_leaves_stays_weights_the_batch_small_tensors():
    saved = (Saved("a", "bfloat16", 10 * MB, 10 * MB, 0, False, True),  # the batch
             Saved("a", "bfloat16", 4 * MB, 4 * MB, 1, True, False),  # a weight
             Saved("a", "bfloat16", 1000, 1000, 2, False, False),  # small
             Saved("a", "bfloat16", 1 * MB, 5 * MB, 3, False, False),  # view of a larger one
             Saved("a", "bfloat16", 2 * MB, 2 * MB, 4, False, False))
    w = Workload("left", 1, saved, (Op("a", 0, range(5), 0.001, 0.001, 0, 0, 0),),
                 (Block("all", range(1), False),), 14 * MB, 0, 4 * MB)
    p = predict(w, swap_all(), LINK, Engine(min_bytes=4096))
    assert p.d2h_bytes == 2 * MB
    assert predict(w, engine=ENGINE).peak_bytes == 14 * MB + 1000 + 5 * MB + 2 * MB


def test_a_codec_shrinks_the_link_bytes_and_adds_its_time():
    w = step([(0.001, 0.001, [40 * MB]), (0.001, 0.001, [])])
    half = Codec("half", ratio=0.5, encode=4000 * MB, decode=4000 * MB)
    raw = predict(w, swap_all(), LINK, ENGINE)
    p = predict(w, swap_all(half), LINK, ENGINE)
    assert (p.d2h_bytes, p.h2d_bytes) == (20 * MB, 20 * MB)
    # the host holds a slot as large as the tensor (a compressed length is known late)
    assert p.host_bytes == raw.host_bytes == 40 * MB
    # each way: 10 ms encode or decode + 20 ms copy instead of 40 ms
    assert raw.step_s - p.step_s == pytest.approx(2 * (0.040 - 0.030))


def test_a_codecs_kernels_take_their_own_stream_the_links_time_or_computes():
    """Where compute hides the link, kernels on their own stream or in the copy's lane cost
    nothing, and on the compute stream's clock their whole time: 10 ms encoding after the op
    that saved the 40 MB, 10 ms decoding before the op that uses it. Where the link sets the
    pace, the copy's lane encodes and copies one after the other (10 + 20 ms a tensor), while
    on its own stream the second tensor encodes during the first one's copy: its copy ends
    10 ms sooner, and so does the step."""
    half = Codec("half", ratio=0.5, encode=4000 * MB, decode=4000 * MB)
    lanes = {where: replace(ENGINE, codec_kernels=where) for where in CODEC_KERNELS}
    assert ENGINE.codec_kernels == "own stream"
    hidden = step([(0.001, 0.001, [40 * MB]), (0.100, 0.100, [])])
    kept = predict(hidden, engine=ENGINE, link=LINK)
    own, lane, sms = (predict(hidden, swap_all(half), LINK, lanes[where])
                      for where in ("own stream", "copy lane", "compute"))
    assert own.step_s == pytest.approx(kept.step_s)
    assert lane.step_s == pytest.approx(kept.step_s)
    assert sms.forward_s == pytest.approx(kept.forward_s + 0.010)
    assert sms.step_s == pytest.approx(kept.step_s + 0.020)
    assert {(p.d2h_bytes, p.h2d_bytes) for p in (own, lane, sms)} == {(20 * MB, 20 * MB)}
    bound = step([(0.001, 0.001, [40 * MB]), (0.001, 0.001, [40 * MB]), (0.001, 0.001, [])])
    own, lane = (predict(bound, swap_all(half), LINK, lanes[where])
                 for where in ("own stream", "copy lane"))
    assert lane.step_s - own.step_s == pytest.approx(0.010)
    timeline = predict(bound, swap_all(half), LINK, lanes["own stream"], timeline=True).timeline
    encodes = [(i.start, i.end) for i in timeline if i.lane == "encode"]
    assert encodes == [pytest.approx((0.001, 0.011)), pytest.approx((0.011, 0.021))]
    with pytest.raises(ValueError, match="codec_kernels.*'gpu'"):
        Engine(codec_kernels="gpu")


def test_a_codec_that_reads_a_size_back_holds_forward_until_it_has_encoded():
    """The reference zvc's compaction reads its count on the host: forward's next op waits
    for the 10 ms encoding that its own stream would otherwise run beside it."""
    half = Codec("half", ratio=0.5, encode=4000 * MB, decode=4000 * MB)
    waiting = replace(half, waits=True)
    w = step([(0.001, 0.001, [40 * MB]), (0.100, 0.100, [])])
    free, held = (predict(w, swap_all(c), LINK, ENGINE) for c in (half, waiting))
    assert free.forward_s == pytest.approx(0.101)
    assert held.forward_s == pytest.approx(0.111)
    assert held.forward_stall_s == pytest.approx(0.010)


def test_plans_are_checked():
    w = step([(0.001, 0.001, [MB])], blocks=[("head", 1, False)])
    with pytest.raises(ValueError, match="does not have"):
        predict(w, Mix(blocks={"nope": SWAP}))
    with pytest.raises(ValueError, match="cannot be recomputed"):
        predict(w, Mix(blocks={"head": RECOMPUTE}))
    assert predict(w, checkpoint_all()).recompute_s == 0  # only blocks that can be
    with pytest.raises(ValueError, match="swap_input"):
        BlockDecision("swap", swap_input=True)
    with pytest.raises(ValueError, match="ratio"):
        Codec("bad", ratio=0)


def test_the_timeline_has_every_op_and_copy():
    w = step([(0.001, 0.002, [10 * MB]), (0.001, 0.002, [])])
    p = predict(w, swap_all(), LINK, ENGINE, timeline=True)
    lanes = [(i.lane, i.label.split()[0]) for i in p.timeline]
    assert lanes.count(("compute", "forward")) == lanes.count(("compute", "backward")) == 2
    assert ("d2h", "out") in lanes and ("h2d", "back") in lanes
    assert max(i.end for i in p.timeline) == pytest.approx(p.step_s)


# -- the profiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(evidence.PROFILES))
def test_no_offload_replayed_gives_the_profiles_own_peak(model):
    w = evidence.workload(model)
    p = predict(w)
    assert abs(p.peak_bytes - w.peak_bytes) <= 0.02 * w.peak_bytes, (p.peak_bytes, w.peak_bytes)
    assert p.step_s == pytest.approx(w.forward_s + w.backward_s + p.optimizer_s)


def test_the_profiles_blocks_and_their_batch():
    layers = {m: [b.name for b in evidence.workload(m).blocks if b.recomputable]
              for m in evidence.PROFILES}
    assert layers["gpt2-medium"] == [f"transformer.h.{n}" for n in range(24)]
    assert layers["bert-large"] == [f"bert.encoder.layer.{n}" for n in range(24)]
    assert len(layers["resnet50"]) == 16 and layers["resnet50"][0] == "layer1.0"
    assert layers["vgg16"] == [f"features stage {n}" for n in range(5)]
    resnet = evidence.workload("resnet50")
    assert resnet.saved[0].held and resnet.saved[0].module == "conv1"  # the batch
    assert resnet.forward_s == pytest.approx(0.0233, rel=0.01)  # the plain, hook-free total


def test_a_workload_scales_with_the_batch():
    w = evidence.workload("resnet50")
    double = w.scaled(2 * w.batch)
    assert double.activation_bytes == pytest.approx(2 * w.activation_bytes, rel=1e-6)
    assert double.forward_s == pytest.approx(2 * w.forward_s)
    assert double.weight_bytes == w.weight_bytes
    assert evidence.workload("resnet50", 256).batch == 256


def test_a_profile_of_another_schema_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="expected schema"):
        load(path)


# -- against the H100's measurements ------------------------------------------------------------
COMPARISONS = evidence.comparisons()


@pytest.mark.parametrize("c", COMPARISONS,
                         ids=lambda c: f"{c.model}-{c.method}-{c.quantity}-{c.source}")
def test_the_replay_lands_within_tolerance_or_the_miss_is_explained(c):
    if c.known_miss:
        assert abs(c.error) > evidence.TOLERANCE, "no longer a miss: drop it from KNOWN_MISSES"
    else:
        assert abs(c.error) <= evidence.TOLERANCE, (c.measured, c.predicted)


def test_every_model_is_compared_for_no_offload_checkpointing_and_swapping_everything():
    compared = {(c.model, c.method) for c in COMPARISONS}
    assert compared == {(m, method) for m in evidence.PROFILES for method in evidence.METHODS}
    assert {c.source for c in COMPARISONS} == {"suite", "README", "trace"}
    listed = {(c.model, c.method, c.quantity, c.source) for c in COMPARISONS}
    assert set(evidence.KNOWN_MISSES) <= listed  # no stale entry


def test_the_readme_rows_are_all_found():
    found = {(c.model, c.method) for c in COMPARISONS if c.source == "README"}
    assert found == set(evidence._README_ROWS.values())
    assert evidence._figure("1.21-1.45x") == (1.21, 1.45)
    assert evidence._figure("7.2x / 7.3x / 2.9x") == (7.2, 7.2)
    assert evidence._figure("0.32 (no lower than checkpointing)") == (0.32, 0.32)


def test_the_table_labels_every_figure_a_prediction():
    text = evidence.table()
    assert text.startswith("prediction (replay of H100 profile)")
    assert all(label in text for label in evidence.LABELS.values())


def test_bench_suite_gets_a_prediction_for_what_the_replay_models():
    p = evidence.predict_method("vgg16", "cswap raw", batch=128)
    assert p is not None and p.d2h_bytes > 0
    assert evidence.predict_method("vgg16", "cswap auto") is None
    assert evidence.predict_method("llama", "no offload") is None


ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_counts_what_the_table_shows():
    readme = (ROOT / "README.md").read_text()
    within = sum(abs(c.error) <= evidence.TOLERANCE for c in COMPARISONS)
    missed = sum(c.known_miss is not None for c in COMPARISONS)
    assert within + missed == len(COMPARISONS)
    assert f"within 15% of {within} of the {len(COMPARISONS)} measured figures" in readme
    assert f"the {missed} others are listed" in readme


def test_the_evidence_ships_with_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["cswap_lightning"]
    package = ROOT / "cswap_lightning"
    files = [p.relative_to(package).as_posix() for p in evidence.EVIDENCE.iterdir()]
    assert len(files) >= 8
    assert all(any(fnmatch(f, g) for g in globs) for f in files), files
