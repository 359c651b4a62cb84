"""The cost model, the budget and the predictor, with injected measurements (no clock)."""

import copy
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch
from conftest import grads, model_and_batch
from torch import nn
from torch.nn import functional as F

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.codecs import get_codec
from cswap_lightning.commands.bench_advisor import Timings, accuracy, report, run_advisor_check
from cswap_lightning.core.transfer import Stored
from cswap_lightning.planning import predictor
from cswap_lightning.planning.advisor import Advisor, exposed_s, predicted_stored_bytes
from cswap_lightning.planning.plan import Plan
from cswap_lightning.planning.planner import Measured, Planner
from cswap_lightning.planning.predictor import CodecTimeModel, KernelRun, calibrate, record_runs
from cswap_lightning.planning.profiler import Link, SiteProfile
from cswap_lightning.records import StepStats

MiB = 1 << 20
GB = 1e9


def linear_runs(codec, a, b, c, sizes=(1, 4, 16), sparsities=(0.0, 0.5, 0.9)):
    """Runs that follow seconds = a + b * MiB + c * non-zero MiB exactly."""
    return [
        KernelRun(codec, direction, n * MiB, s, a + b * n + c * n * (1 - s))
        for direction in ("encode", "decode")
        for n in sizes
        for s in sparsities
    ]


def model(a=1e-5, b=1e-5, c=1e-5):
    return CodecTimeModel().fit(linear_runs("zvc", a, b, c))


def site(sparsity, nbytes=16 * MiB, forward_s=0.0, backward_s=0.0, index=0, **kw):
    return SiteProfile(index, (nbytes // 4,), "float32", nbytes, True, sparsity=sparsity,
                       forward_s=forward_s, backward_s=backward_s, **kw)


def test_predictor_recovers_a_linear_law_and_reports_its_error():
    m = model(2e-5, 3e-5, 5e-5)
    assert m.predict("zvc", "encode", 8 * MiB, 0.25) == pytest.approx(2e-5 + 3e-5 * 8 + 5e-5 * 6)
    assert m.mape(linear_runs("zvc", 2e-5, 3e-5, 5e-5, sizes=(2, 64))) < 1e-6
    assert m.mape([KernelRun("zvc", "encode", MiB, 0.0, 2 * m.predict("zvc", "encode", MiB, 0.0))]
                  ) == pytest.approx(0.5)
    assert m.predict("raw", "decode", MiB, 0.0) == 0.0
    with pytest.raises(KeyError, match="no measured runs for codec 'rle'"):
        m.predict("rle", "encode", MiB, 0.5)


def test_predictor_ignores_a_run_slowed_by_something_else():
    runs = linear_runs("zvc", 2e-5, 3e-5, 5e-5)
    runs[4] = replace(runs[4], seconds=20 * runs[4].seconds)  # e.g. another process ran
    m = CodecTimeModel().fit(runs)
    assert m.predict("zvc", "encode", 8 * MiB, 0.25) == pytest.approx(2e-5 + 3e-5 * 8 + 5e-5 * 6)


def test_exposed_time_is_what_the_windows_cannot_hide():
    link = Link(d2h=1 * GB, h2d=2 * GB, device=100 * GB)
    assert exposed_s(10**9, link, 0.0, 0.0) == pytest.approx(1.5)
    assert exposed_s(10**9, link, 0.4, 0.1) == pytest.approx(0.6 + 0.4)
    assert exposed_s(10**9, link, 5.0, 5.0) == 0.0


def test_predicted_payload_is_the_formats_exact_size():
    t = torch.zeros(1000)
    t[:300] = 1.0  # 70% zeros in one run
    p = site(0.7, nbytes=4000)
    assert predicted_stored_bytes("zvc", p) == get_codec("zvc").encode(t).payload.numel()
    p.stored["rle"] = get_codec("rle").encode(t).payload.numel()
    assert predicted_stored_bytes("rle", p) == p.stored["rle"]  # measured wins over estimate


def test_compression_decision_flips_where_the_equations_say():
    link = Link(d2h=10 * GB, h2d=10 * GB, device=1000 * GB)
    m = model()
    advisor = Advisor("zvc", link, m)
    n = 16 * MiB

    def costs(s):
        p = site(s, n)
        c = predicted_stored_bytes("zvc", p)
        t_c = m.predict("zvc", "encode", n, s) + m.predict("zvc", "decode", n, s)
        return t_c + 2 * c / link.d2h, 2 * n / link.d2h

    grid = [i / 100 for i in range(101)]
    flips = [s for s in grid if (costs(s)[0] < costs(s)[1])]
    assert 0.0 < flips[0] < 1.0  # dense stays raw, sparse is compressed
    for s in grid:
        expected = "zvc" if costs(s)[0] < costs(s)[1] else "raw"
        assert advisor.decide(site(s, n)).decision == expected, s
    # Windows long enough to hide the raw transfer: compression only costs time.
    assert advisor.decide(site(0.95, n, forward_s=1.0, backward_s=1.0)).decision == "raw"
    # A codec slower than the link never pays.
    slow = Advisor("zvc", link, model(1.0, 1.0, 1.0))
    assert slow.decide(site(0.95, n)).decision == "raw"


def test_lossy_is_weighed_only_for_dense_allowed_sites_and_only_where_it_pays():
    link = Link(d2h=1 * GB, h2d=1 * GB, device=1000 * GB)  # a slow link: shrinking pays
    runs = linear_runs("zvc", 1e-5, 1e-5, 1e-5) + linear_runs("int8", 1e-5, 1e-5, 0.0)
    m = CodecTimeModel().fit(runs)
    dense, sparse = site(0.1), site(0.8)
    lossy = Advisor("zvc", link, m, lossy="int8")
    d = lossy.decide(dense)
    assert (d.decision, d.reason) == ("int8", "lossy pays")
    assert d.stored_bytes == predicted_stored_bytes("int8", dense) < dense.nbytes / 3.9
    assert lossy.decide(sparse).decision == "zvc"  # sparse sites stay lossless
    assert Advisor("zvc", link, m).decide(dense).decision != "int8"  # lossy="off"
    excluded = Advisor("zvc", link, m, lossy="int8", lossy_ok=lambda p: False)
    assert excluded.decide(dense).decision != "int8"
    slow = CodecTimeModel().fit(linear_runs("zvc", 1e-5, 1e-5, 1e-5)
                                + linear_runs("int8", 1.0, 1.0, 1.0))
    assert Advisor("zvc", link, slow, lossy="int8").decide(dense).decision != "int8"


def planned(profiles, budget, beside=0, prefetch_bytes=0, order=None, link=None,
            together=()):
    """The planner's plan for these measured sites (no clock: link and codec times given),
    ``beside`` bytes held beside them at the step's peak, ``together`` the sites backward
    first asked for at once."""
    stats = StepStats(0)
    stats.peak_resident_bytes, stats.peak_allocated_bytes = MiB, MiB + beside
    config = CSwapConfig(budget=budget, prefetch_bytes=prefetch_bytes, min_bytes=1)
    planner = Planner(config, link or Link(10 * GB, 10 * GB, 1000 * GB), model())
    return planner.plan(Measured(profiles, [], order, stats, torch.device("cpu"),
                                 together=together))


def test_what_one_node_asks_for_at_once_is_planned_as_back_at_once():
    """Four 4 MiB sites, a budget of 10: moving the earliest two fits forward, and backward
    too where each comes back when its op needs it. Where one node asked for all four at once
    (a block's recomputation), they are all back together: no choice fits, and the plan says
    so, with the peak it predicts."""
    profiles = [site(0.0, 4 * MiB, index=i) for i in range(4)]
    alone = planned(profiles, 10 * MiB)
    assert alone.fits and sum(d.decision != "keep" for d in alone.decisions.values()) == 2
    together = planned(profiles, 10 * MiB, together=[(0, 1, 2, 3)])
    assert not together.fits and together.predicted_peak == 16 * MiB


def test_budget_offloads_the_fewest_earliest_sites_that_make_the_peak_fit():
    profiles = [site(0.0, MiB * (i + 1), index=i) for i in range(4)]  # 1, 2, 3, 4 MiB
    profiles.append(SiteProfile(4, (10,), "float32", 40, False, reason="parameter"))
    profiles.append(SiteProfile(5, (10,), "float32", MiB, False, reason="small"))
    base = 2 * MiB  # what the step holds beside its saved tensors
    no_budget = planned(profiles, None, base)
    assert [no_budget.decisions[i].decision for i in range(4)] == ["raw"] * 4
    plan = planned(profiles, 10 * MiB, base)  # room for 8: small 1 + latest sites 4 + 3
    assert [plan.decisions[i].decision for i in range(4)] == ["raw", "raw", "keep", "keep"]
    assert plan.predicted_peak == 8 * MiB and plan.fits
    assert plan.decisions[4].decision == "keep"  # parameters are not counted
    roomy = planned(profiles, 100 * MiB, base)
    assert all(d.decision == "keep" for d in roomy.decisions.values())
    assert roomy.predicted_peak == 11 * MiB
    tight = planned(profiles, 2 * MiB, base)  # even offloading everything does not fit
    assert not tight.fits and "DOES NOT FIT" in tight.table()
    assert [tight.decisions[i].decision for i in range(4)] == ["raw"] * 4
    assert tight.predicted_peak == 4 * MiB  # the largest site, while forward saves it


def test_the_plan_counts_what_backward_brings_back_and_what_stays_held():
    """The replayed peak of the measured step: a tensor the loop holds is there all along;
    a prefetch window brings restores back ahead of use; one as large as all of them brings
    them back at once, and no count of moved sites fits then but the window halved."""
    held = SiteProfile(0, (MiB // 4,), "float32", MiB, False, reason="held elsewhere")
    acts = [site(0.0, MiB, index=i) for i in range(1, 5)]
    profiles = [held, *acts]
    everything = planned(profiles, None)
    assert everything.predicted_peak == 2 * MiB  # the held one and one at a time
    windowed = planned(profiles, None, prefetch_bytes=2 * MiB)
    assert windowed.predicted_peak == 4 * MiB  # held, one in use and the next two
    at_once = planned(profiles, 2 * MiB, prefetch_bytes=512 * MiB)
    assert at_once.fits and at_once.prefetch_bytes == 0, at_once.table()
    assert at_once.predicted_peak == 2 * MiB
    # the latest stays: backward uses it first, before any restore
    assert [at_once.decisions[i].decision for i in range(1, 5)] == ["raw"] * 3 + ["keep"]


def test_plan_round_trips_through_a_dict():
    plan = planned([site(0.9, index=0), site(0.0, index=1)], 64 * MiB, 123,
                   link=Link(GB, GB, GB))
    again = Plan.from_dict(plan.as_dict())
    assert again == plan
    assert again.codec(0, (4 * MiB,), "float32") == plan.decisions[0].decision
    # a smaller tensor at the site is served by the plan; a larger one, or another dtype,
    # falls back to raw
    assert again.codec(0, (7,), "float32") == plan.decisions[0].decision
    assert again.codec(0, (8 * MiB,), "float32") == "raw"
    assert again.codec(0, (7,), "float16") == "raw"


class Gate(nn.Module):
    """ReLU of a shifted input: the shift sets the fraction of zeros it saves."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 256)
        self.shift = 0.0
        self.out = nn.Linear(256, 10)

    def forward(self, x):
        return self.out(F.relu(self.lin(x) + self.shift))


def test_plan_changes_when_sparsity_changes_between_epochs():
    torch.manual_seed(0)
    net, x = Gate(), torch.randn(512, 64)
    y = torch.randint(0, 10, (512,))
    slow_link = Link(1e6, 1e6, 1e9)  # so slow that fewer bytes always pay
    off = Offloader(CSwapConfig(min_bytes=64 * 1024, profile_steps=1, budget=None), link=slow_link,
                    time_model=model(1e-6, 1e-6, 1e-6))

    def step():
        with off:
            loss = F.cross_entropy(net(x), y)
        loss.backward()

    def relu_site():
        (s,) = [s for s in off.last_step().sites if s.shape == (512, 256) and not s.reason]
        return s.site

    net.shift = 100.0  # dense: nothing is zero
    step()
    step()
    assert off.plan.decisions[relu_site()].decision == "raw"
    off.new_epoch()
    net.shift = -100.0  # all zeros
    step()
    step()
    assert off.plan.decisions[relu_site()].decision == "zvc"
    assert off.last_step().sites[relu_site()].decision == "zvc"
    off.close()


def test_lossy_auto_compresses_dense_sites_lossily_except_excluded_modules():
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(lin=nn.Linear(64, 256), act=nn.ReLU(), out=nn.Linear(256, 10)))
    with torch.no_grad():
        net.lin.bias += 100.0  # the ReLU output is dense
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    runs = linear_runs("zvc", 1e-6, 1e-6, 1e-6) + linear_runs("int8", 1e-6, 1e-6, 0.0)
    config = CSwapConfig(min_bytes=64 * 1024, profile_steps=1, lossy="auto", budget=None)
    for exclude, expected in (((), "int8"), (("ac*",), "raw")):
        off = Offloader(replace(config, lossy_exclude=exclude), link=Link(1e6, 1e6, 1e9),
                        time_model=CodecTimeModel().fit(runs)).watch(net)
        for _ in range(2):
            with off:
                loss = F.cross_entropy(net(x), y)
            loss.backward()
        (relu,) = [s for s in off.last_step().sites if s.shape == (512, 256) and not s.reason]
        assert (relu.module, relu.decision) == ("act" if exclude else "", expected)
        assert relu.stored_bytes == (relu.nbytes if expected == "raw"
                                     else predicted_stored_bytes("int8", site(0.0, relu.nbytes)))
        off.close()


def test_auto_budget_keeps_gradients_bitwise_equal():
    model_, x, y = model_and_batch("cnn")
    ref = grads(copy.deepcopy(model_), x, y, None, steps=3)
    off = Offloader(CSwapConfig(min_bytes=0, budget="auto", profile_steps=1))
    got = grads(copy.deepcopy(model_), x, y, off, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert off.plan is not None and off.plan.fits
    off.close()


def test_recorded_runs_join_the_next_calibration_of_their_device():
    cpu = torch.device("cpu")
    before = calibrate(cpu, ("zvc",))
    tuned = KernelRun("zvc", "encode", 3 * MiB, 0.3, 1e-3)
    record_runs(cpu, [tuned, KernelRun("rle", "encode", MiB, 0.3, 1e-3)])
    after = calibrate(cpu, ("zvc",))
    assert after is not before  # planned again with the new runs
    assert tuned in after.fit_runs and not any(r.codec == "rle" for r in after.fit_runs)
    assert tuned not in after.held_out_runs
    predictor._RECORDED.clear()


def test_calibration_is_measured_once_and_validated_on_held_out_runs():
    cal = calibrate(torch.device("cpu"), ("zvc",))
    assert calibrate(torch.device("cpu"), ("zvc",)) is cal
    assert {(r.nbytes, r.sparsity) for r in cal.held_out_runs}.isdisjoint(
        {(r.nbytes, r.sparsity) for r in cal.fit_runs})
    assert cal.mape == pytest.approx(cal.model.mape(cal.held_out_runs))
    big, small = (cal.model.predict("zvc", "encode", n, 0.5) for n in (64 * MiB, MiB))
    assert big > small > 0


@pytest.mark.slow
def test_advisor_picks_the_faster_swap_on_real_activations(capsys):
    """Real activations of four models (ReLU ones half zeros or more, GELU and attention ones
    dense), each swapped through the engine's transfer path raw and with zvc; the device's
    times are given (so the check does not depend on this machine's load): a link, and a
    codec whose time follows a law, over the payload each swap really made. The advisor,
    predicting the payload from the format's size formula and the measured sparsity, picks
    the faster, and each choice is the faster somewhere."""
    link = Link(1 * GB, 1 * GB, 10 * GB)
    codec_time = model(1e-5, 2e-4, 1e-4)  # per call, per MiB, per non-zero MiB

    def swap_seconds(transfer, t, codec):
        stored = transfer.offload(Stored(t.device), t, get_codec(codec))
        restored, _ = transfer.restore(stored)
        assert torch.equal(restored.reshape(-1).view(torch.uint8), t.view(torch.uint8))
        sparsity = 1.0 - torch.count_nonzero(t).item() / t.numel()
        return (stored.stored_bytes / link.d2h + stored.stored_bytes / link.h2d
                + codec_time.predict(codec, "encode", t.nbytes, sparsity)
                + codec_time.predict(codec, "decode", t.nbytes, sparsity))

    cases = run_advisor_check("cpu", timings=Timings(link, codec_time, swap_seconds))
    assert len(cases) >= 20 and {c.sparsity > 0.4 for c in cases} == {True, False}
    assert {c.faster for c in cases} == {"raw", "zvc"}
    assert accuracy(cases) >= 0.9, report(cases)
    progress = capsys.readouterr().err
    assert f"cswap bench advisor: swapping {len(cases)} activations raw and with zvc" in progress


def _step(off, net, x, y):
    with off:
        loss = F.cross_entropy(net(x), y)
    loss.backward()


def test_a_smaller_step_runs_the_plan_and_a_larger_one_is_planned_for_at_once(monkeypatch):
    """A plan serves every step no larger than the one it was made for (a shorter sequence,
    a smaller last batch), with nothing measured again; a larger step, even one that runs
    the checked plan untracked, tracks its larger sites and moves them raw, and the plan is
    made again from their rows, with the link and codec times measured for the plan."""
    from cswap_lightning.planning import planner

    links = []
    monkeypatch.setattr(planner, "measure_link", lambda device: links.append(device)
                        or Link(1e6, 1e6, 1e9))
    net, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(min_bytes=0, profile_steps=1, budget=None),
                    time_model=model(1e-6, 1e-6, 1e-6))
    _step(off, net, x, y)
    _step(off, net, x, y)  # measured, then planned
    old_plan = off.plan
    assert "zvc" in {d.decision for d in old_plan.decisions.values()}  # ReLU outputs compress
    _step(off, net, x[:7], y[:7])  # smaller: the plan's decisions, checked
    assert {s.decision for s in off.last_step().sites} & {"zvc"}
    assert off.plan is old_plan and off.learning.measure_left == 0
    big_x, big_y = torch.cat([x, x]), torch.cat([y, y])
    _step(off, net, big_x, big_y)  # larger: its larger sites tracked and moved raw
    assert {s.decision for s in off.last_step().sites} - {"keep", "dedup"} == {"raw"}
    _step(off, net, big_x, big_y)  # planned for as it starts (the last step closed), checks
    assert {s.decision for s in off.last_step().sites} & {"zvc"}
    assert off.plan is not old_plan and off.learning.measure_left == 0 and len(links) == 1
    assert all(d.shape[0] == 2 * x.shape[0] for d in off.plan.decisions.values()
               if d.decision != "keep" and len(d.shape) == 2)
    for batch in (x[:5], big_x[:, :], x):  # all served by it
        _step(off, net, batch, torch.cat([y, y])[: batch.shape[0]])
    assert off.learning.replans == 0 and off.learning.measure_left == 0 and len(links) == 1
    off.close()


def test_learned_plan_survives_a_state_dict_round_trip():
    import json

    net, x, y = model_and_batch("mlp")
    kw = {"link": Link(1e6, 1e6, 1e9), "time_model": model(1e-6, 1e-6, 1e-6)}
    off = Offloader(CSwapConfig(min_bytes=0, profile_steps=1, budget=None), **kw)
    for _ in range(3):
        _step(off, net, x, y)
    state = json.loads(json.dumps(off.state_dict()))
    restored = Offloader(CSwapConfig(min_bytes=0, profile_steps=1, budget=None), **kw)
    restored.load_state_dict(state)
    assert restored.plan == off.plan
    _step(restored, net, x, y)  # the restored plan applies at once: no profiling step
    decisions = {s.site: s.decision for s in restored.last_step().sites}
    for site, d in off.plan.decisions.items():
        if d.decision in ("raw", "zvc"):
            assert decisions[site] == d.decision
    with pytest.raises(ValueError, match="unknown cswap state version 7"):
        restored.load_state_dict({"version": 7})
    off.close()
    restored.close()


def _saved_plan() -> dict:
    return planned([site(0.9, index=0), site(0.0, index=1)], 64 * MiB, 123,
                   link=Link(GB, GB, GB)).as_dict()


# (where in the saved plan, the bad value there, what the error says after "plan")
DAMAGED_PLANS = [
    (("decisions", 0, "decision"), "evil",
     (r"\['decisions'\]\[0\]\['decision'\] is 'evil'; expected one of 'keep', 'raw', 'zvc', "
      r"'rle', 'int8', 'fp8', 'int4'")),
    (("decisions", 1, "site"), "1", r"\['decisions'\]\[1\]\['site'\] is '1'; expected an int"),
    (("decisions", 0, "shape"), 4,
     r"\['decisions'\]\[0\]\['shape'\] is 4; expected a list or a tuple"),
    (("decisions", 0, "shape"), [4, "x"],
     r"\['decisions'\]\[0\]\['shape'\] is \[4, 'x'\]; expected a list of ints >= 0"),
    (("decisions", 0, "dtype"), "float33",
     r"\['decisions'\]\[0\]\['dtype'\] is 'float33'; expected the name of a torch dtype"),
    (("decisions", 0, "dtype"), 32, r"\['decisions'\]\[0\]\['dtype'\] is 32; expected a str"),
    (("decisions", 0, "nbytes"), 4.5,
     r"\['decisions'\]\[0\]\['nbytes'\] is 4.5; expected an int"),
    (("decisions", 0, "nbytes"), True,
     r"\['decisions'\]\[0\]\['nbytes'\] is True; expected an int"),
    (("decisions", 0, "nbytes"), -1,
     r"\['decisions'\]\[0\]\['nbytes'\] is -1; expected a number >= 0"),
    (("decisions", 0, "sparsity"), 1.5,
     r"\['decisions'\]\[0\]\['sparsity'\] is 1.5; expected a fraction in \[0, 1\]"),
    (("decisions", 0, "raw_s"), float("nan"),
     r"\['decisions'\]\[0\]\['raw_s'\] is nan; expected a number >= 0"),
    (("decisions", 0), "raw", r"\['decisions'\]\[0\] is 'raw'; expected a dict"),
    (("decisions",), {"0": {}}, r"\['decisions'\] is \{'0': \{\}\}; expected a list or a tuple"),
    (("signature",), "float32", r"\['signature'\] is 'float32'; expected a list or a tuple"),
    (("signature", 0), [[4]], r"\['signature'\]\[0\] is \[\[4\]\]; expected a \[shape, dtype\]"),
    (("signature", 1, 1), "fp32",
     r"\['signature'\]\[1\]\[1\] is 'fp32'; expected the name of a torch dtype"),
    (("budget_bytes",), "64 MiB", r"\['budget_bytes'\] is '64 MiB'; expected an int or None"),
    (("fits",), 1, r"\['fits'\] is 1; expected a bool"),
]


@pytest.mark.parametrize("path, value, message", DAMAGED_PLANS,
                         ids=[f"{'.'.join(map(str, p))}={v!r}" for p, v, _ in DAMAGED_PLANS])
def test_a_damaged_saved_plan_is_refused_naming_the_field_and_what_it_accepts(path, value,
                                                                              message):
    data = _saved_plan()
    *parents, key = path
    target = data
    for p in parents:
        target = target[p]
    target[key] = value
    with pytest.raises(ValueError, match=r"^Plan.from_dict: plan" + message):
        Plan.from_dict(data)


def test_a_saved_plan_with_a_missing_unknown_or_repeated_key_is_refused():
    data = _saved_plan()
    del data["decisions"][1]["nbytes"]
    with pytest.raises(ValueError, match=r"decisions'\]\[1\] has no 'nbytes'"):
        Plan.from_dict(data)
    data = _saved_plan()
    data["decisions"][0]["codec"] = "zvc"
    with pytest.raises(ValueError, match=r"decisions'\]\[0\] has an unknown key 'codec'"):
        Plan.from_dict(data)
    data = _saved_plan()
    del data["fits"]
    with pytest.raises(ValueError, match=r"^Plan.from_dict: plan has no 'fits'"):
        Plan.from_dict(data)
    data = _saved_plan()
    data["decisions"][1]["site"] = 0
    with pytest.raises(ValueError, match=r"decisions'\]\[1\]\['site'\] is 0; expected each site"):
        Plan.from_dict(data)
    with pytest.raises(ValueError, match=r"^Plan.from_dict: plan is \[\]; expected a dict"):
        Plan.from_dict([])


def bf16_site(sparsity, nbytes=16 * MiB, **kw):
    return SiteProfile(0, (nbytes // 2,), "bfloat16", nbytes, True, sparsity=sparsity, **kw)


def test_the_dense_codec_is_weighed_for_dense_bfloat16_sites_where_it_pays():
    link = Link(d2h=1 * GB, h2d=1 * GB, device=1000 * GB)  # a slow link: shrinking pays
    runs = linear_runs("zvc", 1e-5, 1e-5, 1e-5) + linear_runs("exponent", 1e-5, 1e-5, 0.0)
    m = CodecTimeModel().fit(runs)
    dense = Advisor("zvc", link, m, dense="exponent")
    d = dense.decide(bf16_site(0.0))
    assert d.decision == "exponent"
    assert d.stored_bytes == predicted_stored_bytes("exponent", bf16_site(0.0)) == 12 * MiB
    # measured once, the site's own payload size counts instead of the estimate
    measured = bf16_site(0.0, stored={"exponent": 15 * MiB})
    assert dense.decide(measured).stored_bytes == 15 * MiB
    assert dense.decide(bf16_site(0.6)).decision == "zvc"  # zeros: the zero codec's
    assert dense.decide(site(0.0)).decision != "exponent"  # float32: not its dtype
    assert Advisor("zvc", link, m).decide(bf16_site(0.0)).decision != "exponent"  # off
    slow = CodecTimeModel().fit(linear_runs("zvc", 1e-5, 1e-5, 1e-5)
                                + linear_runs("exponent", 1.0, 1.0, 1.0))
    assert Advisor("zvc", link, slow, dense="exponent").decide(
        bf16_site(0.0)).decision != "exponent"


def test_dense_bfloat16_activations_swap_through_the_exponent_codec_bit_for_bit():
    """``dense_compressor="exponent"`` on a bfloat16 MLP whose GELU outputs are dense, with a
    slow link and fast codec times given: the advisor sends them through the exponent codec
    (the reference, on the CPU), the gradients are those of plain training, bit for bit, and
    the payloads measured replace the estimate; ``plan="exponent"`` sends the bfloat16 sites
    through it and the others raw."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(torch.bfloat16)
    x, y = torch.randn(512, 64, dtype=torch.bfloat16), torch.randint(0, 10, (512,))

    def step_grads(off=None):
        net.zero_grad(set_to_none=True)
        if off is None:
            loss = F.cross_entropy(net(x).float(), y)
        else:
            with off:
                loss = F.cross_entropy(net(x).float(), y)
        loss.backward()
        return [p.grad.clone() for p in net.parameters()]

    ref = step_grads()
    runs = linear_runs("zvc", 1e-6, 1e-6, 1e-6) + linear_runs("exponent", 1e-6, 1e-6, 0.0)
    config = CSwapConfig(min_bytes=64 * 1024, profile_steps=1, budget=None,
                         dense_compressor="exponent")
    off = Offloader(config, link=Link(1e6, 1e6, 1e9), time_model=CodecTimeModel().fit(runs))
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(ref, step_grads(off), strict=True))
    moved = [s for s in off.last_step().sites if s.decision == "exponent"]
    assert moved and all(s.dtype == "bfloat16" for s in moved)
    assert all(s.stored_bytes < 0.8 * s.nbytes for s in moved)
    assert off.learning.profiler.sites[moved[0].site].stored["exponent"] == moved[0].stored_bytes
    off.close()
    fixed = Offloader(CSwapConfig(plan="exponent", min_bytes=0, budget=None))
    assert all(torch.equal(a, b) for a, b in zip(ref, step_grads(fixed), strict=True))
    decisions = {(s.dtype, s.decision) for s in fixed.last_step().sites if not s.reason}
    assert ("bfloat16", "exponent") in decisions and ("float32", "raw") in decisions
    assert {d for t, d in decisions if t == "bfloat16"} == {"exponent"}
    fixed.close()
