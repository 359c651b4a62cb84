"""Budgets are met by measurement, and the default budget moves nothing on a run that fits.

The model is 8 x (Linear(1024) + GELU) at batch 512: every activation is 2 MiB, and GELU
outputs are dense, so what the engine keeps or moves is plain to count. On the CPU a raw
restore costs nothing, so backward brings back everything the prefetch window allows at once:
the worst case for a budget.
"""

import contextlib
import copy
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import wide_mlp
from torch import nn

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.planning.advisor import AUTO_MARGIN, resolve_budget
from cswap_lightning.records import StepStats, fmt_bytes

MiB = 1 << 20


def train(config: CSwapConfig, steps: int, epochs: int = 1) -> tuple[Offloader, list]:
    """``steps`` steps per epoch; the offloader and every step's statistics."""
    model, x = wide_mlp(nn.GELU)
    off = Offloader(config)
    stats = []
    for _ in range(epochs):
        off.new_epoch()
        for _ in range(steps):
            with off:
                loss = model(x).square().mean()
            loss.backward()
            del loss
            stats.append(off.last_step())
    with warnings.catch_warnings():  # an empty block, said to save nothing: it is meant to
        warnings.filterwarnings("ignore", "cswap: no tensor autograd saved")
        with off:  # close the last step, which checks the plan against it
            pass
    off.close()
    return off, stats


def keep_peak(prefetch_bytes: int) -> int:
    _, stats = train(CSwapConfig(plan="keep", prefetch_bytes=prefetch_bytes), steps=1)
    return stats[-1].peak_resident_bytes


def test_the_default_budget_is_auto_and_none_still_means_everything():
    assert CSwapConfig().budget == "auto"
    _, stats = train(CSwapConfig(budget=None, profile_steps=1), steps=3)
    # Every activation inside; the input, which the loop holds, is found to stay.
    assert [s.offloaded_bytes for s in stats[1:]] == [16 * 2 * MiB] * 2


# A window of two activations: backward holds the one in use and the next two.
SMALL_WINDOW = 4 * MiB


@pytest.mark.slow
def test_a_budget_between_keeping_and_moving_everything_is_met_by_measurement():
    keep = keep_peak(SMALL_WINDOW)
    assert keep == 17 * 2 * MiB  # the input and the 16 activations inside
    _, everything = train(CSwapConfig(budget=None, profile_steps=1,
                                      prefetch_bytes=SMALL_WINDOW), steps=2)
    budget = int(0.4 * keep)
    off, stats = train(CSwapConfig(budget=budget, profile_steps=1,
                                   prefetch_bytes=SMALL_WINDOW), steps=3)
    planned = stats[-1]
    assert off.plan.fits
    assert planned.peak_resident_bytes <= 1.15 * budget, off.plan.table()
    assert planned.offloaded_bytes <= 0.85 * everything[-1].offloaded_bytes
    assert planned.offloaded_bytes > 0
    # The plan says what it predicted and what the step that ran it measured.
    assert off.plan.measured_peak == stats[1].peak_resident_bytes
    assert off.plan.predicted_peak == pytest.approx(off.plan.measured_peak, rel=0.15)
    assert "predicted" in off.plan.table() and "measured" in off.plan.table()


@pytest.mark.parametrize("fraction, narrowed", [(0.4, True), (0.6, False)])
def test_the_plan_narrows_the_prefetch_window_to_meet_the_budget(fraction, narrowed):
    """With a 512 MiB window (the default before "auto") backward would bring back every
    moved tensor at once on the CPU, and no choice of sites meets 40% of keeping everything:
    the plan halves the window until one does, the engine uses it, and the measured peak
    meets the budget. At 60% the window fits as it is."""
    default_window = 512 * MiB
    budget = int(fraction * keep_peak(default_window))
    off, stats = train(CSwapConfig(budget=budget, profile_steps=1,
                                   prefetch_bytes=default_window), steps=2)
    measured = stats[-1].peak_resident_bytes
    assert off.plan.fits, off.plan.table()
    assert (off.plan.prefetch_bytes < default_window) == narrowed, off.plan.table()
    assert measured <= 1.15 * budget, off.plan.table()
    assert off.plan.predicted_peak == pytest.approx(measured, rel=0.15), off.plan.table()


def test_a_budget_no_window_can_meet_is_said_not_to_fit():
    """In the plan's table, and as a warning (once), with what would fit; each step's
    summary says the budget was not met, and by how much."""
    budget = int(0.1 * keep_peak(SMALL_WINDOW))  # less than one layer's own activations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off, stats = train(CSwapConfig(budget=budget, profile_steps=1), steps=3)
    assert not off.plan.fits and "DOES NOT FIT" in off.plan.table()
    assert stats[-1].peak_resident_bytes > budget
    said = [str(w.message) for w in caught if "is not met" in str(w.message)]
    lowest = off.plan.predicted_peak
    assert said == [(f"cswap: the budget of {fmt_bytes(budget)} is not met: whatever it moves, "
                    f"the planner predicts a peak of {fmt_bytes(lowest)}, "
                    f"{fmt_bytes(lowest - budget)} over it; a budget of about "
                    f"{fmt_bytes(lowest)} or more would be met "
                    "(predicted). Raise the budget or lower the batch size. "
                    "offloader.plan.table() shows the plan, and logging at INFO "
                    "(logging.getLogger('cswap_lightning').setLevel('INFO')) the planner's "
                    "decisions")]
    last = stats[-1]
    assert last.budget_bytes == budget and last.budget_met is False
    assert (f"budget {fmt_bytes(budget)}: NOT MET: the ledger's peak (saved tensors, "
            "recomputed blocks' included; the rest of the step's memory is not measured on "
            f"the CPU) was {fmt_bytes(last.peak_bytes)}, "
            f"{fmt_bytes(last.peak_bytes - budget)} over it") in last.table()


def test_a_budget_met_is_said_so_in_the_summary():
    budget = int(0.6 * keep_peak(SMALL_WINDOW))
    _, stats = train(CSwapConfig(budget=budget, profile_steps=1), steps=3)
    assert stats[-1].budget_met
    assert f"budget {fmt_bytes(budget)}: held, by the ledger's peak" in stats[-1].table()


@pytest.mark.slow
def test_room_to_spare_moves_nothing_even_while_profiling():
    budget = int(1.5 * keep_peak(SMALL_WINDOW))
    off, stats = train(CSwapConfig(budget=budget, profile_steps=3,
                                   prefetch_bytes=SMALL_WINDOW), steps=5)
    # The first step cannot know the run fits: it swaps, and measures what would stay.
    assert stats[0].offloaded_bytes > 0
    assert [s.offloaded_bytes for s in stats[1:]] == [0] * 4
    assert all(d.decision == "keep" for d in off.plan.decisions.values())
    assert off.plan.predicted_peak == pytest.approx(off.plan.measured_peak, rel=0.15)


@pytest.mark.slow
def test_the_default_moves_nothing_on_a_run_that_fits_not_even_at_a_new_epoch():
    off, stats = train(CSwapConfig(), steps=3, epochs=2)
    assert stats[0].offloaded_bytes > 0  # the very first step measures by swapping
    assert [s.offloaded_bytes for s in stats[1:]] == [0] * 5
    assert off.plan.fits and off.plan.budget_bytes > 17 * 2 * MiB


def test_auto_is_what_the_process_can_still_have_less_a_margin(monkeypatch):
    cpu = torch.device("cpu")
    assert 0 < resolve_budget("auto", cpu) < resolve_budget(1.0, cpu)
    assert resolve_budget(1 << 20, cpu) == 1 << 20
    assert resolve_budget(None, cpu) is None
    # CUDA: free memory plus what the caching allocator holds (the step's own tensors,
    # freed by now, among it), less the margin.
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 40 << 30)
    assert resolve_budget("auto", gpu) == (70 << 30) - int(AUTO_MARGIN * (80 << 30))
    assert resolve_budget(0.5, gpu) == 40 << 30


def train_lm(model: nn.Module, ids: torch.Tensor, config: CSwapConfig, steps: int,
             watch: bool = False) -> tuple[Offloader, list, frozenset[str]]:
    """``steps`` steps of a language model (``watch``: its blocks may be recomputed): the
    offloader, every step's statistics and the blocks recomputed at the end."""
    off, stats = Offloader(config), []
    if watch:
        off.watch(model)
    for _ in range(steps):
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
        stats.append(off.last_step())
    with off:  # closes the last step
        pass
    recomputed = off.recomputed
    off.close()
    return off, stats, recomputed


def _transformer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=3, n_embd=128, n_head=4, n_positions=128, vocab_size=500,
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=344, vocab_size=500))
    return model.train(), torch.randint(0, 500, (8, 128))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_budget_is_met_on_transformers_too(kind):
    """Attention, residuals, views and dropout masks: 40% of what keeping everything holds
    is met within 15%, and the plan's prediction is within 15% of the measurement."""
    model, ids = _transformer(kind)
    _, kept, _ = train_lm(model, ids, CSwapConfig(plan="keep", min_bytes=0), 1)
    budget = int(0.4 * kept[-1].peak_resident_bytes)
    off, stats, _ = train_lm(model, ids, CSwapConfig(budget=budget, profile_steps=1,
                                                     min_bytes=0), 3)
    measured = stats[-1].peak_resident_bytes
    assert off.plan.fits, off.plan.table()
    assert 0 < stats[-1].offloaded_bytes < stats[0].offloaded_bytes  # some, not everything
    assert measured <= 1.15 * budget, off.plan.table()
    assert off.plan.predicted_peak == pytest.approx(measured, rel=0.15), off.plan.table()


@pytest.mark.slow
def test_a_storage_two_kept_sites_share_is_counted_once():
    """GPT-2 (4 layers, 256 wide, batch 8 x 128): cross-entropy saves its log-softmax twice
    (196 MiB, one storage). Kept, both were counted: 600.8 MiB saved under a plan that keeps
    everything against 404.5 moving everything, and after new_epoch() the prediction, made
    from kept rows, grew by 196 MiB over the 343.4 MiB measured, so a budget the step fits
    in moved tensors it did not need to."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, n_positions=128)).train()
    ids = torch.randint(0, model.config.vocab_size, (8, 128),
                        generator=torch.Generator().manual_seed(0))

    def step(off: Offloader) -> StepStats:
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return off.last_step()

    everything = Offloader(CSwapConfig(budget=None, profile_steps=1))
    moved = step(everything)
    everything.close()
    # room for every saved tensor, not for twice the log-softmax; above half of it, so the
    # steps keep their hooks (on the CPU) and count what they keep
    off = Offloader(CSwapConfig(budget=450 * MiB, profile_steps=1))
    step(off)  # measured
    checking = step(off)
    first = off.plan.predicted_peak
    untracked = step(off)
    assert not untracked.sites and not untracked.hooks_off
    assert checking.saved_bytes == untracked.saved_bytes == moved.saved_bytes
    off.new_epoch()
    step(off)  # measured again, under the plan: every site kept
    step(off)  # plans again from it
    assert off.plan.predicted_peak == first == checking.peak_resident_bytes, off.plan.table()
    assert all(d.decision == "keep" for d in off.plan.decisions.values()), off.plan.table()
    off.close()


def train_beside_plain(off: Offloader, model: nn.Module, x: torch.Tensor,
                       steps: int) -> list:
    """Train ``model`` under ``off`` and a copy without it; the gradients must be bitwise
    equal at every step. Each step's statistics."""
    plain = copy.deepcopy(model)
    stats = []
    for _ in range(steps):
        for net, ctx in ((model, off), (plain, contextlib.nullcontext())):
            net.zero_grad()
            with ctx:
                loss = net(x).square().mean()
            loss.backward()
            del loss
        stats.append(off.last_step())
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
    return stats


@pytest.mark.slow
def test_a_run_that_fits_runs_without_hooks_once_its_plan_is_checked():
    """Once a step has checked a plan that moves nothing, later steps run without the
    engine's hooks at all: autograd keeps every saved tensor and does its own version
    check; gradients are those of plain training. new_epoch() brings the hooks back."""
    model, x = wide_mlp(nn.GELU)
    off = Offloader(CSwapConfig(budget=1 << 40, profile_steps=1))
    stats = train_beside_plain(off, model, x, steps=4)
    # Measured (swapping), then the plan's first step checks it, then no hooks.
    assert [bool(s.sites) for s in stats] == [True, True, False, False]
    assert [s.hooks_off for s in stats] == [False, False, True, True]
    assert stats[3].saved_bytes == stats[3].offloaded_bytes == 0  # the engine saw nothing
    # Its peak is the one measured on the step that checked the plan (and saved the same).
    assert stats[3].peak_resident_bytes == off.plan.measured_peak == stats[1].peak_resident_bytes
    assert "without the engine's hooks" in stats[3].table()
    seen = []
    for _ in range(2):  # entered from elsewhere: with hooks once (it saves nothing), then none
        with off:
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
    assert seen[0] is not None and seen[1] is None
    off.new_epoch()
    stats = train_beside_plain(off, model, x, steps=1)
    assert stats[0].sites and not stats[0].hooks_off  # measured again, with hooks

    with off:
        y = model[0](x)
        z = y.sigmoid()  # saves its output ...
        z.mul_(2)  # ... which is then modified in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


@pytest.mark.slow
def test_a_step_that_saves_more_is_measured_and_planned_again():
    """Counting is enough to see a batch grow: the next step measures, and a plan for the
    bigger step moves what the budget needs."""
    model, x = wide_mlp(nn.GELU)
    budget = int(1.2 * keep_peak(SMALL_WINDOW))
    off = Offloader(CSwapConfig(budget=budget, profile_steps=1, prefetch_bytes=SMALL_WINDOW))
    for batch in (x, x, x, torch.cat([x, x])):  # measured, checked, counted, grown
        with off:
            loss = model(batch).square().mean()
        loss.backward()
        del loss
    grown = off.last_step()
    assert grown.untracked_tensors > 0  # counted, and found bigger
    for _ in range(3):  # measured again, then planned for the bigger batch
        with off:
            loss = model(torch.cat([x, x])).square().mean()
        loss.backward()
        del loss
    last = off.last_step()
    assert last.offloaded_tensors and last.offloaded_bytes > 0
    assert last.peak_resident_bytes <= 1.15 * budget
    off.close()


@pytest.mark.slow
def test_under_a_budget_the_kept_sites_are_only_counted_and_the_moved_ones_still_move():
    """A plan that moves some sites: once it is checked, the sites it keeps are counted and
    the ones it moves are moved, bitwise, neither tracked one by one."""
    model, x = wide_mlp(nn.GELU)
    budget = int(0.4 * keep_peak(SMALL_WINDOW))
    off = Offloader(CSwapConfig(budget=budget, profile_steps=1, prefetch_bytes=SMALL_WINDOW))
    stats = train_beside_plain(off, model, x, steps=4)
    checked, counted = stats[1], stats[3]
    kept = [s for s in checked.sites if s.decision == "keep"]
    moved = [s for s in checked.sites if s.decision != "keep"]
    assert kept and moved and checked.untracked_tensors == 0
    assert counted.untracked_tensors == len(kept)
    assert not counted.sites and counted.untracked_moved_tensors == len(moved)
    assert off.tracked_step() is checked
    assert counted.offloaded_bytes == checked.offloaded_bytes > 0
    assert counted.saved_bytes == checked.saved_bytes
    assert counted.peak_resident_bytes == off.plan.measured_peak == checked.peak_resident_bytes
    off.close()


@pytest.mark.slow
def test_a_fixed_keep_plan_runs_without_hooks_once_a_step_has_checked_it():
    """plan="keep": after the measured steps, one step checks what it keeps; later steps
    run without hooks (autograd's own version check), with plain training's gradients."""
    model, x = wide_mlp(nn.GELU)
    off = Offloader(CSwapConfig(plan="keep", profile_steps=1, min_bytes=0))
    stats = train_beside_plain(off, model, x, steps=4)
    assert [bool(s.sites) for s in stats] == [True, True, False, False]
    assert [s.hooks_off for s in stats] == [False, False, True, True]
    assert stats[3].peak_resident_bytes == stats[1].peak_resident_bytes > 0

    with off:
        z = model[0](x).sigmoid()  # saves its output ...
        z.mul_(2)  # ... which is then modified in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    off.close()


@pytest.mark.slow
def test_a_fixed_plan_tracks_again_without_measuring_when_the_saved_tensors_change():
    """plan="raw": the kept sites (weights) are counted once checked and the moved ones still
    move; a bigger batch makes the next step track every site and check again, with no
    measuring step and no warning (a fixed plan has nothing to plan again)."""
    model, x = wide_mlp(nn.GELU)
    off = Offloader(CSwapConfig(plan="raw", profile_steps=1, min_bytes=0))
    stats = train_beside_plain(off, model, x, steps=3)
    checked, counted = stats[1], stats[2]
    kept = [s.site for s in checked.sites if s.decision == "keep"]
    assert kept and counted.untracked_tensors == len(kept)
    assert counted.offloaded_bytes == checked.offloaded_bytes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "changed ... times" warning
        for batch in (torch.cat([x, x]),) * 3:  # counted and found bigger, checks, counted
            with off:
                loss = model(batch).square().mean()
            loss.backward()
            del loss
            stats.append(off.last_step())
    grown, rechecked, recounted = stats[3:]
    assert grown.untracked_tensors == len(kept) and grown.offloaded_bytes > 0
    assert rechecked.untracked_tensors == 0 and rechecked.sites
    assert recounted.untracked_tensors == len(kept)
    assert recounted.peak_resident_bytes == rechecked.peak_resident_bytes > 0
    assert off.learning.measure_left == 0  # nothing was measured again
    off.close()


def test_sites_that_trade_places_are_tracked_again():
    """The same count and bytes in another order (a data-dependent branch) is a change: a
    kept weight and a moved activation that trade places make the next step track every
    site, so the activation moves again, instead of being kept as site 0 was."""
    p = torch.randn(1000, requires_grad=True)  # sin saves it: a leaf, kept
    q = torch.randn(3000, requires_grad=True)

    def step(off, weight_first):
        parts = [lambda: p.sin().sum(), lambda: (q * 2).sin().sum()]  # q * 2: moved
        with off:
            loss = sum(f() for f in (parts if weight_first else parts[::-1]))
        loss.backward()
        return off.last_step()

    off = Offloader(CSwapConfig(plan="raw", profile_steps=1, min_bytes=0))
    before = [step(off, True) for _ in range(3)]  # measured, checks, counted
    assert before[2].untracked_tensors == 1 and before[2].offloaded_bytes == 3000 * 4
    after = [step(off, False) for _ in range(3)]  # counted (unseen), checks, counted
    assert after[0].offloaded_bytes == 0  # site 0, the activation now, was kept unseen ...
    assert after[1].untracked_tensors == 0  # ... but the change was seen: tracked again
    assert [s.offloaded_bytes for s in after[1:]] == [3000 * 4] * 2
    off.close()


@pytest.mark.slow
def test_varying_lengths_are_planned_for_the_longest_without_measuring_again():
    """Dynamic padding: each batch has another length. A step longer than the plan's is
    planned for from its own rows (its larger sites moved raw meanwhile); shorter ones run
    the plan. Nothing is measured again and nobody is warned; once the longest is planned
    for, a run that fits keeps everything and only counts it; gradients are plain
    training's."""
    model, x = wide_mlp(nn.GELU)
    off = Offloader(CSwapConfig(budget=1 << 40, profile_steps=1))
    stats = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (64, 128, 512, 96, 256, 512, 160, 512, 320, 200):
            stats += train_beside_plain(off, model, x[:rows], steps=1)
    with off:  # closes the last step
        pass
    assert off.learning.measure_left == 0 and off.learning.replans == 0
    assert [bool(s.offloaded_bytes) for s in stats[:3]] == [True, True, True]  # measured, grew
    assert not any(s.offloaded_bytes for s in stats[3:])  # planned for 512 rows: keeps all
    assert not any(s.sites for s in stats[4:])  # checked on step 3, then only counted
    assert [d.shape for d in off.plan.decisions.values()][-1][0] == 512
    off.close()


@pytest.mark.slow
def test_a_budget_plan_for_the_longest_meets_the_budget_on_shorter_steps():
    """Under a budget, the plan made for the longest step serves the shorter ones. Steps
    that run a checked plan untracked report the checking step's peak (and say when their
    sizes differ from its); the plan itself, run by steps that track every site, keeps each
    length within the budget, measured."""
    model, x = wide_mlp(nn.GELU)
    budget = int(0.5 * keep_peak(SMALL_WINDOW))
    config = CSwapConfig(budget=budget, profile_steps=1, prefetch_bytes=SMALL_WINDOW)
    off = Offloader(config)
    stats = []
    for rows in (128, 512, 256, 384, 512, 200, 448):
        stats += train_beside_plain(off, model, x[:rows], steps=1)
    with off:  # closes the last step
        pass
    assert off.learning.measure_left == 0 and off.learning.replans == 0 and off.plan.fits
    assert [s.resized for s in stats[3:]] == [True] * 4  # 256 rows checked the plan
    assert "differ in size from this step's" in stats[3].table()
    learned = off.state_dict()
    off.close()
    for rows in (512, 384, 200):
        fresh = Offloader(config)
        fresh.load_state_dict(learned)  # its first step runs the plan, tracking every site
        step, = train_beside_plain(fresh, model, x[:rows], steps=1)
        assert step.sites and not step.untracked_tensors and not step.resized
        assert step.offloaded_bytes and step.kept_bytes
        assert step.peak_resident_bytes <= 1.15 * budget, step.peak_resident_bytes / budget
        fresh.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_with_varying_lengths_are_never_measured_again(kind):
    """Dynamic padding on real architectures, default config: every batch another length,
    the longest neither first nor last. No step is measured after the first ones, nothing
    warns, and gradients are bitwise those of plain training at every step."""
    model, ids = _transformer(kind)
    plain = copy.deepcopy(model)
    off, stats = Offloader(CSwapConfig()), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, length in enumerate((40, 96, 17, 128, 64, 9, 128, 77, 33, 110)):
            batch = ids[:, :length]
            for net, ctx in ((model, off), (plain, contextlib.nullcontext())):
                net.zero_grad()
                torch.manual_seed(step)  # the same dropout masks
                with ctx:
                    loss = net(input_ids=batch, labels=batch).loss
                loss.backward()
                del loss
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (step, length)
            stats.append(off.last_step())
    with off:  # closes the last step
        pass
    assert off.learning.replans == 0 and off.learning.measure_left == 0
    # the run fits: once its plan is checked, the steps run without hooks
    assert [s.hooks_off for s in stats[-3:]] == [True] * 3, [
        (len(s.sites), s.untracked_tensors, s.resized) for s in stats]
    off.close()


def small_blocks() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
                            for _ in range(6)])
    return model, torch.randn(32, 64)


def planned(dropped: frozenset[int]) -> tuple[Offloader, list[StepStats]]:
    """Six steps of ``small_blocks`` under a budget of half its saved activations, measured
    on one step; the forwards numbered in ``dropped`` have their graph dropped without a
    backward (a step skipped)."""
    model, x = small_blocks()
    off = Offloader(CSwapConfig(budget="120KiB", min_bytes=0, profile_steps=1,
                                recompute="off"))
    stats = []
    for i in range(6):
        with off:
            loss = model(x).relu().sum()
        if i not in dropped:
            loss.backward()
            stats.append(off.last_step())
        del loss
    off.close()
    return off, stats


def test_a_step_whose_graph_goes_without_backward_neither_measures_nor_checks_a_plan(caplog):
    """The measured step, then the step that checks the plan, skipped (their graphs dropped):
    the next steps measure and check instead, and the plan is the one made without skips.
    Measured on a forward alone, the plan went over its budget (128 KiB for 120) and was made
    again."""
    off, stats = planned(frozenset())
    with caplog.at_level("INFO", logger="cswap_lightning"):
        skipped, skipped_stats = planned(frozenset({0, 2}))
    plain, dropped = ([(d.site, d.decision) for d in p.decisions.values()]
                      for p in (off.plan, skipped.plan))
    assert dropped == plain and any(decision != "keep" for _, decision in plain)
    assert skipped.plan.predicted_peak == off.plan.predicted_peak <= 120 << 10
    assert skipped.plan.measured_peak == off.plan.measured_peak == off.plan.predicted_peak
    assert stats[-1].peak_resident_bytes == skipped_stats[-1].peak_resident_bytes
    assert not any("passed the budget" in m for m in caplog.messages)
    assert [m for m in caplog.messages if "backward had not begun" in m] == [
        f"cswap: step {i}'s backward had not begun when the next step did: it neither "
        "measures nor checks a plan" for i in (0, 2)]


def test_a_host_budget_caps_what_the_plan_moves():
    """No device budget moves every site; a host budget of 5 MiB, two of the 2 MiB
    activations (raw: a payload is its tensor's bytes), the earliest: the rest are kept and
    say why."""
    off, stats = train(CSwapConfig(budget=None, profile_steps=1, host_budget="5MiB"), steps=3)
    assert [s.stored_bytes for s in stats] == [2 * 2 * MiB] * 3  # the measured step's too
    kept = [d for d in off.plan.decisions.values() if d.reason == "the host budget"]
    assert kept and all(d.decision == "keep" for d in kept)
    assert "the host budget" in off.plan.table()


@pytest.mark.slow
@pytest.mark.parametrize("host", [0, "1MiB"])
def test_under_a_host_budget_the_planner_recomputes_instead_of_swapping(host):
    """Half of Llama's peak: without a host budget the planner swaps about 20 MiB; with
    none or 1 MiB of host memory it recomputes layers instead, and still meets the budget."""
    model, ids = _transformer("llama")
    _, kept, _ = train_lm(model, ids, CSwapConfig(plan="keep", min_bytes=0), 1)
    budget = int(0.5 * kept[-1].peak_resident_bytes)
    config = CSwapConfig(budget=budget, profile_steps=1, min_bytes=0)
    _, free, _ = train_lm(copy.deepcopy(model), ids, config, 4, watch=True)
    assert free[-1].stored_bytes > 8 * MiB
    off, stats, recomputed = train_lm(copy.deepcopy(model), ids,
                                      replace(config, host_budget=host), 4, watch=True)
    limit = CSwapConfig(host_budget=host).host_budget
    assert off.plan.fits and recomputed
    assert stats[-1].stored_bytes <= limit
    assert stats[-1].peak_resident_bytes <= 1.15 * budget, off.plan.table()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("plan", ["raw", "zvc"])
def test_no_plan_holds_more_than_the_host_budget(plan, device):
    """A fixed plan moves what the host budget holds (each step's payloads, counted at their
    tensors' bytes: on CUDA, pinned) and keeps the rest on the device, where training goes on
    as without it."""
    model, x = wide_mlp(nn.GELU)
    model, x = model.to(device), x.to(device)
    plain = copy.deepcopy(model)
    plain(x).square().mean().backward()
    off, first = Offloader(CSwapConfig(plan=plan, host_budget="5MiB")), None
    for _ in range(3):
        model.zero_grad()
        with off:
            loss = model(x).square().mean()
        loss.backward()
        last = off.last_step()
        first = first or last
        assert 0 < last.offloaded_bytes <= 5 * MiB
    # two 2 MiB tensors moved, the first two; every other one the plan moves is kept for it
    moved = [s.site for s in first.sites if s.decision == plan]
    held = [s for s in first.sites if s.reason == "the host budget"]
    assert len(moved) == 2 and len(held) > 10
    assert all(s.decision == "keep" and s.site > max(moved) for s in held)
    assert any(line.startswith("moved out to host memory: 4.0 MiB")
               and line.endswith(f"; {len(held)} saved tensors kept for the host budget")
               for line in first.summary())
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
