"""The accuracy guard, with injected lossy codecs: one that destroys information, one that
keeps it."""

import gc
import logging
import math

import pytest
import torch
from conftest import Destructive, Faithful, grads, model_and_batch
from torch import nn
from torch.nn import functional as F

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.core.guard import (
    FLOOR,
    AccuracyGuard,
    GuardReport,
    _Exact,
    compare_gradients,
)


def guarded(name="mlp", **config):
    net, x, y = model_and_batch(name)
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0, guard_every=2, **config)).watch(net)
    return net, x, y, off, AccuracyGuard(off)


def test_guard_trips_on_a_codec_that_destroys_information_and_reverts_sites(as_int8):
    as_int8(Destructive())
    net, x, y, off, guard = guarded(guard_tolerance=0.05)
    assert guard.due()
    report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert report.worst_rel_error > 0.5 and report.worst_cosine < 0.9
    assert report.reverted and set(report.reverted) <= set(report.site_errors)
    assert min(report.site_errors[s] for s in report.reverted) >= max(
        (e for s, e in report.site_errors.items() if s not in report.reverted), default=0.0)
    assert off.reverted == set(report.reverted)
    with off:
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    decisions = {s.site: s.decision for s in off.last_step().sites}
    assert all(decisions[s] == "raw" for s in report.reverted)
    assert guard.reverted_sites.compute().item() == len(report.reverted)
    off.close()


def test_guard_does_not_trip_on_a_faithful_codec(as_int8):
    as_int8(Faithful())
    net, x, y, off, guard = guarded()
    report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert report.worst_rel_error == 0.0 and report.worst_cosine == pytest.approx(1.0)
    assert report.site_errors and all(e == 0.0 for e in report.site_errors.values())
    assert not report.reverted and not off.reverted
    assert guard.worst_rel_error.compute().item() == 0.0
    off.close()


class Poisoned(Faithful):
    """Registered as "int8", gives back NaNs (e.g. a scale that overflowed)."""

    def decode(self, packed):
        return torch.full_like(super().decode(packed), float("nan"))


def test_a_nan_from_the_lossy_plan_trips_any_tolerance_and_is_reported_as_inf(as_int8):
    as_int8(Poisoned())
    net, x, y, off, guard = guarded(guard_tolerance=1e9)
    report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert report.worst_rel_error == math.inf and report.worst_cosine == -1.0
    assert report.site_errors and all(e == math.inf for e in report.site_errors.values())
    assert not any(math.isnan(v) for v in report.log_values().values())
    assert report.reverted and off.reverted == set(report.reverted)
    assert guard.worst_rel_error.compute().item() == math.inf
    assert guard.worst_cosine.compute().item() == -1.0
    off.close()


@pytest.mark.parametrize("exact, lossy, rel_error, cosine", [
    ([3.0, 4.0], [3.0, 4.0], 0.0, 1.0),
    ([3.0, 4.0], [3.0, 0.0], 0.8, 0.6),
    ([0.0, 0.0], [0.0, 0.0], 0.0, 1.0),  # no gradient either way: nothing was bent
    ([0.0, 0.0], [0.0, 1e-20], math.inf, 0.0),  # any error is infinite relative to none
    ([3.0, 4.0], [float("nan"), 4.0], math.inf, -1.0),
    ([3.0, 4.0], [float("inf"), 4.0], math.inf, -1.0),
    ([float("nan"), 4.0], [float("nan"), 4.0], math.inf, -1.0),  # nothing to vouch against
], ids=["equal", "bent", "both zero", "exact zero", "lossy nan", "lossy inf", "exact nan"])
def test_compare_gradients_resolves_zeros_and_non_finite_values_for_the_guard(exact, lossy,
                                                                             rel_error, cosine):
    got = compare_gradients(torch.tensor(exact), torch.tensor(lossy))
    assert got == (pytest.approx(rel_error), pytest.approx(cosine))


def test_a_nan_in_a_report_or_its_metrics_counts_as_the_worst_value():
    nan = float("nan")
    report = GuardReport(0, {"a": 0.9, "b": nan}, {"a": 0.1, "b": nan}, {}, 0.0)
    assert report.worst_rel_error == math.inf and report.worst_cosine == -1.0
    guard = AccuracyGuard(Offloader(CSwapConfig(plan="int8")))
    guard.worst_rel_error.update(nan)
    guard.worst_cosine.update(nan)
    assert guard.worst_rel_error.compute().item() == math.inf
    assert guard.worst_cosine.compute().item() == -1.0


def test_probe_leaves_gradients_buffers_and_random_state_as_they_were(as_int8):
    as_int8(Destructive())
    net, x, y, off, guard = guarded("cnn")  # BatchNorm: running statistics are buffers
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
    assert torch.equal(rng, torch.get_rng_state())
    off.close()


def test_guard_is_due_every_n_steps_only_with_lossy_sites(as_int8):
    as_int8(Faithful())
    *_, guard = guarded()
    assert [guard.due() for _ in range(5)] == [True, False, True, False, True]
    lossless = AccuracyGuard(Offloader(CSwapConfig(plan="zvc", guard_every=1)))
    assert not any(lossless.due() for _ in range(3))


def test_excluded_modules_and_non_floating_tensors_are_never_lossy(as_int8):
    as_int8(Faithful())
    net, x, y = model_and_batch("cnn")
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0, lossy_exclude=("8",))).watch(net)
    with off:
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    sites = [s for s in off.last_step().sites if s.decision not in ("keep", "dedup")]
    assert {s.module for s in sites if s.decision == "int8"} and all(
        s.module != "8" for s in sites if s.decision == "int8")
    assert all(s.decision == "raw" for s in sites if s.module == "8" or s.dtype == "int64")
    assert any(s.dtype == "int64" for s in sites)  # max-pool indices
    off.close()


def test_compiled_submodules_are_named_as_written_and_can_be_excluded(as_int8):
    """Dynamo traces the engine's module hooks too: they must not break compilation, and a
    compiled region's sites carry the name the user gave the module."""
    as_int8(Faithful())
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                              torch.compile(head, backend="aot_eager"))
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0, lossy_exclude=("2",))).watch(net)
    x = torch.randn(16, 32)
    for step in range(3):
        # Hooks added and removed around each step would change Dynamo's guards every step.
        with torch._dynamo.config.patch(error_on_recompile=step > 0), off:
            loss = net(x).sum()
        loss.backward()
    sites = [s for s in off.last_step().sites if s.decision not in ("keep", "dedup")]
    # module 0 saves only the input, which the loop holds: the engine learned to keep it
    assert {s.module for s in sites} == {"1", "2"}
    assert {s.reason for s in off.last_step().sites if s.module == "0"} == {"held elsewhere"}
    assert {s.decision for s in sites if s.module == "2"} == {"raw"}
    assert {s.decision for s in sites if s.module != "2"} == {"int8"}
    off.close()


def test_module_hooks_last_until_close_or_a_new_watch_and_only_for_lossy_exclude():
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    excluding = CSwapConfig(plan="raw", lossy_exclude=("0",))
    off = Offloader(excluding).watch(net)
    assert len(hooks) == before + 1
    off.watch(net)  # the Hugging Face callback watches again on every train()
    assert len(hooks) == before + 1
    off.close()
    assert len(hooks) == before
    Offloader(excluding).watch(net)  # dropped without close()
    gc.collect()
    assert len(hooks) == before
    off = Offloader(CSwapConfig(plan="raw")).watch(net)  # no patterns: nothing to name
    assert len(hooks) == before and off.modules is None


def tiny_bert():
    """A 2-layer BERT at sequence length 64: its attention probabilities and feed-forward
    activations reach the default ``min_bytes``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=256,
                        max_position_embeddings=64, num_labels=2)
    ids, labels = torch.randint(0, 100, (8, 64)), torch.randint(0, 2, (8,))
    model = BertForSequenceClassification(config).train()
    return model, lambda: model(input_ids=ids, labels=labels).loss


def test_a_tiny_bert_at_int8_and_default_settings_keeps_every_site_lossy():
    """An attention key's bias has an exact gradient of about zero (softmax ignores it), so
    any rounding is a huge error relative to it: against the gradient's scale it is none."""
    model, loss = tiny_bert()
    off = Offloader(CSwapConfig(plan="int8"))
    guard = AccuracyGuard(off)
    key_bias = model.bert.encoder.layer[0].attention.self.key.bias
    exact, lossy = (torch.autograd.grad(grads_loss(off.probe_next_step(kind), loss), [key_bias])[0]
                    for kind in ("lossless", "measure errors"))
    assert exact.norm() < 1e-9 and compare_gradients(exact, lossy)[0] > 1e3  # unfloored
    for _ in range(3):
        report = guard.probe(model, loss)
        assert not report.reverted and report.passes == 2 and len(report.site_errors) >= 10
        assert report.worst_rel_error < 0.05 and report.grad_error < 0.05
        assert report.rel_error["bert.encoder.layer.0.attention.self.key.bias"] < 1e-3
        with off:
            training_loss = loss()
        training_loss.backward()
    assert not off.reverted and len(off.lossy_sites()) >= 10
    off.close()


def grads_loss(off, loss):
    with off:
        return loss()


class Gate(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.weight  # saves a, for the weight's gradient


class OutlierGate(nn.Module):
    """One activation carries a 1e5 channel into a learnable gate: int8 rounds the gate's
    other inputs to multiples of ~800, which wrecks the gate's gradient, while that tensor's
    round trip looks good (the outlier dominates its norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 63), nn.Tanh(), nn.Linear(63, 63), nn.Tanh(),
                                  nn.Linear(63, 63), nn.Tanh())
        self.gate = Gate(64)
        self.head = nn.Linear(63, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.cat([self.body(x), 1e5 * x[:, :1]], dim=1)
        return self.head(self.gate(a)[:, :63])


def test_the_culprit_is_found_by_its_effect_on_the_gradients_and_reverted_first(caplog):
    torch.manual_seed(0)
    net, x, y = OutlierGate(), torch.randn(64, 16), torch.randint(0, 10, (64,))
    off = Offloader(CSwapConfig(plan="int8", min_bytes=0))  # no watch(): the check names sites
    guard = AccuracyGuard(off)
    with caplog.at_level(logging.INFO, logger="cswap_lightning.core.guard"):
        report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    (culprit,) = [s for s, module in report.modules.items() if module == "gate"]
    # Ranked by round-trip error, it would not be in the worse half reverted first.
    ranked = sorted(report.site_errors, key=report.site_errors.get, reverse=True)
    assert ranked.index(culprit) >= len(ranked) // 2
    assert report.rel_error["gate.weight"] > 0.5
    assert report.reverted == [culprit] and off.reverted == {culprit}
    assert report.culprit_errors[culprit] > 0.5 and report.error_after < 0.05
    assert report.passes > 2 and off.modules is None
    assert f"reverting site {culprit} (gate) to lossless" in caplog.text
    assert f"round-trip error {report.site_errors[culprit]:.3g}" in caplog.text
    assert f"cswap/reconstruction_error/gate/{culprit}" in report.log_values()
    with off:  # the next training step: only the culprit went back to lossless
        loss = F.cross_entropy(net(x), y)
    loss.backward()
    decisions = {s.site: s.decision for s in off.last_step().sites}
    assert decisions[culprit] == "raw"
    assert off.lossy_sites() == set(report.site_errors) - {culprit}
    off.close()


def test_the_guard_rests_once_nothing_is_lossy(as_int8):
    as_int8(Destructive())
    net, x, y, off, guard = guarded()
    assert guard.due()
    report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert set(report.reverted) == set(report.site_errors) and report.error_after == 0.0
    due = []
    for _ in range(10):
        due.append(guard.due())
        grads(net, x, y, off)
    assert not any(due) and off.lossy_sites() == frozenset()
    off.close()


def test_a_check_that_passes_costs_two_passes_and_logs_its_figures(as_int8, caplog):
    as_int8(Faithful())
    net, x, y, off, guard = guarded()
    with caplog.at_level(logging.INFO, logger="cswap_lightning.core.guard"):
        report = guard.probe(net, lambda: F.cross_entropy(net(x), y))
    assert report.passes == 2 and not report.reverted and report.error_after is None
    assert "worst parameter gradient error 0 (whole model 0) within tolerance 0.1" in caplog.text
    values = report.log_values()
    assert values["cswap/reconstruction_error"] == 0.0 and values["cswap/guard_passes"] == 2
    assert guard.reconstruction.compute().item() == 0.0
    off.close()


def test_the_floor_is_a_tenth_of_the_mean_gradient_per_element():
    exact = [torch.tensor([3.0, 4.0]), torch.zeros(2), torch.tensor([1e-12, 0.0])]
    lossy = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.05]), torch.tensor([0.0, 1e-3])]
    errors, _, whole = _Exact(["a", "b", "c"], exact).measure(lossy)
    scale = math.sqrt(25 / 6)  # |G| / sqrt(N): every gradient's elements
    floor = FLOOR * scale * math.sqrt(2)
    assert errors == {"a": 0.0, "b": pytest.approx(0.05 / floor),
                      "c": pytest.approx(math.hypot(1e-12, 1e-3) / floor)}
    assert whole == pytest.approx(math.hypot(0.05, math.hypot(1e-12, 1e-3)) / 5)
    assert compare_gradients(exact[2], lossy[2])[0] > 1e8  # unfloored: "huge"
