"""The engine's invariants (DESIGN.md): lossless, nothing lost, PyTorch semantics kept."""

import contextlib
import copy
import gc
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import MODELS, grads, model_and_batch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from cswap_lightning import CSwapConfig, Offloader, offload
from cswap_lightning.codecs import ZVCCodec, register
from cswap_lightning.config import MIN_BUDGET
from cswap_lightning.core import step

LOSSLESS = ("raw", "zvc", "rle", "auto")


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert torch.equal(ga, gb)


# Steps until the last one runs a plan that moves tensors: "auto" on CUDA measures a step
# swapping, times a plain one, measures one keeping every tensor where there is room, then
# plans.
STEPS = {"auto": 4}


def assert_lossless(name, plan, device):
    model, x, y = model_and_batch(name, device)
    steps = STEPS.get(plan, 2)
    ref = grads(copy.deepcopy(model), x, y, steps=steps)
    # The control: plain training must repeat itself bit for bit, or no engine could.
    assert_bitwise_equal(ref, grads(copy.deepcopy(model), x, y, steps=steps))
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0, budget=None))
    got = grads(copy.deepcopy(model), x, y, off, steps=steps)
    assert_bitwise_equal(ref, got)
    step = off.last_step()
    assert step.offloaded_bytes > 0, step.table()
    if plan in ("zvc", "rle"):
        assert {s.decision for s in step.sites} & {plan}
    off.close()
    return step


@pytest.mark.parametrize("plan", LOSSLESS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_lossless_plans_give_bitwise_equal_gradients(name, plan):
    assert_lossless(name, plan, "cpu")


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("plan", LOSSLESS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_lossless_on_cuda(name, plan):
    assert_lossless(name, plan, "cuda")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_follows_its_cuda_sequence_on_the_cpu_bitwise(name, monkeypatch):
    """The steps "auto" runs on CUDA (measured swapping, plain and timed, measured keeping,
    then the plan), run on the CPU: each step's gradients bitwise, the plan's step moving."""
    from cswap_lightning.core import learning

    monkeypatch.setattr(learning, "hooks_idle", lambda device: True)
    monkeypatch.setattr(learning, "room_to_keep", lambda *args, **kwargs: True)
    model, x, y = model_and_batch(name)
    off = Offloader(CSwapConfig(plan="auto", min_bytes=0, budget=None))
    plain, hooked = copy.deepcopy(model), copy.deepcopy(model)
    seen = []
    for _ in range(STEPS["auto"]):
        assert_bitwise_equal(grads(plain, x, y), grads(hooked, x, y, off))
        step = off.last_step()
        seen.append((step.offloaded_bytes > 0, step.hooks_off, off.plan is not None))
    off.close()
    assert seen == [(True, False, False), (False, True, False), (False, False, False),
                    (True, False, True)]


def test_offload_in_a_loop_reuses_one_session_and_learns():
    model, x, y = model_and_batch("mlp")
    config = CSwapConfig(plan="auto", min_bytes=0, profile_steps=1)
    assert offload(config) is offload(CSwapConfig(plan="auto", min_bytes=0, profile_steps=1))
    assert offload(config) is not offload(CSwapConfig(plan="raw"))
    for _ in range(2):
        with offload(config):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    assert offload(config).plan is not None  # planned after the one profiled step
    shared = offload(config)
    shared.close()
    assert offload(config) is not shared  # a closed session is never handed out again


def test_a_fixed_plans_table_shows_what_its_tracked_step_did():
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0, budget=None))
    assert off.plan is None  # no step yet
    grads(model, x, y, off, steps=2)
    table = off.plan.table()
    assert table.startswith('plan="zvc" is fixed') and off.tracked_step().table() in table
    moved = [d for d in off.plan.decisions.values() if d.decision not in ("keep", "dedup")]
    assert moved and {d.decision for d in moved} == {"zvc"}
    off.close()


class Squared(torch.autograd.Function):
    """x * x, saving its input; with ``empty``, an empty tensor first, as torch < 2.13's
    checkpoint does at each call (``_NoopSaveInputs``)."""

    @staticmethod
    def forward(ctx, x, empty: bool):
        extra = (torch.empty((0,)),) if empty else ()
        ctx.save_for_backward(*extra, x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        *extra, x = ctx.saved_tensors
        assert all(t.shape == (0,) for t in extra)
        return 2 * x * grad, None


@pytest.mark.parametrize("plan", ["raw", "auto"])
def test_an_empty_saved_tensor_is_no_site_so_each_step_numbers_its_sites_alike(plan):
    """The checked step runs a recomputed block under checkpoint, later steps without it: on
    torch < 2.13 only the first saved an empty tensor, which numbered every later site one
    off the plan's (the plan then no longer followed)."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 16, requires_grad=True), torch.randn(8, 16)
    shapes, got = {}, {}
    for empty in (False, True):
        off = Offloader(CSwapConfig(plan=plan, min_bytes=0, profile_steps=1))
        for n in range(4):
            with off:
                loss = Squared.apply(x @ w, empty).tanh().sum()
            loss.backward()
            got[empty, n], w.grad = w.grad, None
            shapes[empty, n] = [s.shape for s in off.last_step().sites]
        off.close()
    for n in range(4):
        assert torch.equal(got[False, n], got[True, n])
        assert shapes[False, n] == shapes[True, n]
    assert shapes[False, 0] == [(8, 16), (8, 16), (8, 16)]  # x, x @ w, tanh's output


def test_a_kept_tensor_at_a_dead_ones_address_is_no_dedup_of_it():
    """Half the loop's results die in forward, their saved tensors with them; the allocator
    gives their addresses to later ones (and Python their version counters' ids): a kept site
    shares a site's bytes only while that site's storage lives, not after."""
    torch.manual_seed(0)
    x, w = torch.randn(256, requires_grad=True), torch.randn(256, 256, requires_grad=True)
    off, live = Offloader(CSwapConfig()), []
    with off:
        for i in range(1500):
            y = F.linear(x.view(1, 1, 256) + i, w).sin()  # saves 3 tensors
            if i % 2:
                live.append(y)
            del y
        loss = sum(t.sum() for t in live)
    loss.backward()
    shared = [(s.site, int(s.reason.split()[-1])) for s in off.last_step().sites
              if s.decision == "dedup"]
    assert not [(site, of) for site, of in shared if site - of > 2]  # another loop step's
    off.close()


def test_auto_plan_swaps_raw_while_profiling_then_follows_the_advisor():
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="auto", min_bytes=0, profile_steps=2, budget=None))
    for _ in range(2):
        grads(model, x, y, off, steps=1)
        assert {s.decision for s in off.last_step().sites} - {"keep", "dedup"} == {"raw"}
        assert off.plan is None  # planned when the next step starts
    grads(model, x, y, off, steps=1)
    assert off.plan is not None
    third = off.last_step()
    for s in third.sites:
        if s.decision != "dedup" and not (s.reason and s.reason != "plan"):
            assert s.decision == off.plan.decisions[s.site].decision, (s, off.plan.table())
    off.close()


def test_compression_really_saves_host_memory_on_cpu():
    model, x, y = model_and_batch("mlp")
    x = x.relu()  # sparse input too
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    with off:
        loss = F.cross_entropy(model(x), y)
    off.transfer.drain()
    held = off.live_host_bytes()
    step = off.last_step()
    assert 0 < held == step.stored_bytes < step.offloaded_bytes
    assert step.ratio > 1.3
    loss.backward()


def test_filters_keep_parameters_views_small_and_unsupported_tensors():
    w = torch.nn.Parameter(torch.randn(256, 256))
    big = torch.randn(256, 256, requires_grad=True)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=1024))
    with off:
        torch.mm(big * 2, w.t()).sum().backward()  # saves (big*2) and w.t(), a parameter view
        small = torch.randn(4, requires_grad=True)
        (small * 2).sin().sum().backward()
        z = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)
        (z * z).abs().sum().backward()
        sparse = torch.randn(64, 64).to_sparse().requires_grad_()
        torch.sparse.mm(sparse, big[:64].detach().requires_grad_()).sum().backward()
    reasons = {s.reason for s in off.last_step().sites if s.decision == "keep"}
    decisions = [s.decision for s in off.last_step().sites]
    assert "view of a leaf" in reasons
    assert "small" in reasons
    assert "dtype complex64" in reasons
    assert "sparse/nested" in reasons
    assert "raw" in decisions


def test_views_of_one_storage_are_offloaded_once():
    x = torch.randn(64, 96, requires_grad=True)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    with off:
        h = (x * 3).relu()
        q, k, v = h.split(32, dim=1)  # three views of one storage, like attention q/k/v
        out = (q.sin() + k.sin() + v.sin() + h.t().cos().t()[:, :32]).sum()
    out.backward()
    ref_x = x.detach().clone().requires_grad_()
    h = (ref_x * 3).relu()
    q, k, v = h.split(32, dim=1)
    (q.sin() + k.sin() + v.sin() + h.t().cos().t()[:, :32]).sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    sites = off.last_step().sites
    dedup = [s for s in sites if s.decision == "dedup"]
    offloaded = [s for s in sites if s.decision == "raw"]
    assert len(dedup) >= 3
    assert sum(s.nbytes for s in offloaded) < 3 * h.numel() * 4  # not once per view


def test_retain_graph_allows_two_backward_passes():
    model, x, y = model_and_batch("cnn")
    ref_model, off_model = copy.deepcopy(model), copy.deepcopy(model)
    loss = F.cross_entropy(ref_model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    with off:
        loss = F.cross_entropy(off_model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise_equal([p.grad for p in ref_model.parameters()],
                         [p.grad for p in off_model.parameters()])


def test_gradient_accumulation_over_micro_batches():
    model, x, y = model_and_batch("cnn")
    ref_model, off_model = copy.deepcopy(model), copy.deepcopy(model)
    off = Offloader(CSwapConfig(plan="auto", min_bytes=0, budget=None))
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        F.cross_entropy(ref_model(xb), yb).backward()
        with off:
            loss = F.cross_entropy(off_model(xb), yb)
        loss.backward()
    assert_bitwise_equal([p.grad for p in ref_model.parameters()],
                         [p.grad for p in off_model.parameters()])
    # several forwards before one backward (the other accumulation style)
    ref_model.zero_grad()
    off_model.zero_grad()
    sum(F.cross_entropy(ref_model(xb), yb) for xb, yb in zip(x.chunk(2), y.chunk(2))).backward()
    losses = []
    for xb, yb in zip(x.chunk(2), y.chunk(2)):
        with off:
            losses.append(F.cross_entropy(off_model(xb), yb))
    sum(losses).backward()
    assert_bitwise_equal([p.grad for p in ref_model.parameters()],
                         [p.grad for p in off_model.parameters()])


def test_autocast_bfloat16_on_cpu():
    model, x, y = model_and_batch("transformer")
    ref_model, off_model = copy.deepcopy(model), copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = F.cross_entropy(ref_model(x), y)
    ref_loss.backward()
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    with off, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(off_model(x), y)
    loss.backward()
    assert_bitwise_equal([p.grad for p in ref_model.parameters()],
                         [p.grad for p in off_model.parameters()])
    assert any(s.dtype == "bfloat16" and s.decision == "zvc" for s in off.last_step().sites)


@pytest.mark.parametrize("way", ["non-reentrant", "reentrant", "selective"])
def test_checkpoint_region_inside_offloaded_forward(way):
    """A checkpointed region in the engine's forward, as torch runs each kind: the same bits,
    what goes through autograd's hooks moved (selective checkpointing's own saves, the
    matmuls', stay with its dispatch mode)."""
    from cswap_lightning.commands.suite_cases import selective_context

    model, x, y = model_and_batch("mlp")
    reentrant = way == "reentrant"
    x.requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
    context = {"context_fn": selective_context} if way == "selective" else {}

    def forward(m):
        h = m[0](x).relu()
        h = checkpoint(lambda t: m[3](m[2](t).relu()), h, use_reentrant=reentrant, **context)
        return F.cross_entropy(m[4](h), y)

    ref_model, off_model = copy.deepcopy(model), copy.deepcopy(model)
    forward(ref_model).backward()
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    with off:
        loss = forward(off_model)
    loss.backward()
    assert_bitwise_equal([p.grad for p in ref_model.parameters()],
                         [p.grad for p in off_model.parameters()])
    assert off.last_step().offloaded_bytes > 0


@pytest.mark.parametrize("plan", ["zvc", "keep"])
@pytest.mark.parametrize("after_forward", [False, True])
def test_inplace_modification_after_pack_raises_like_pytorch(plan, after_forward):
    def run(offloader):
        x = torch.randn(128, 128, requires_grad=True)
        with offloader:
            y = x.sigmoid()  # sigmoid saves its output
            if not after_forward:
                y.mul_(2)
        if after_forward:
            y.mul_(2)
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(contextlib.nullcontext())  # plain PyTorch
    # (plain saved_tensors_hooks skip this check; the engine must not)
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(off)
    assert (off.last_step().offloaded_bytes > 0) == (plan != "keep")


@pytest.mark.slow
def test_exception_in_forward_leaves_no_state_and_nothing_leaks():
    model, x, y = model_and_batch("cnn")
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    with pytest.raises(ValueError, match="boom"), off:
        model(x)
        raise ValueError("boom")
    gc.collect()
    assert off.live_entries() == 0
    held = []
    for _ in range(20):
        grads(model, x, y, off)
        gc.collect()
        held.append((off.live_entries(), off.live_host_bytes()))
    assert set(held) == {(0, 0)}
    # hooks are gone after the failed step: a plain forward saves tensors normally
    out = model(x).sum()
    assert out.grad_fn is not None
    assert off.last_step().offloaded_bytes > 0


def test_hooks_are_not_left_installed_after_the_block():
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        (x * 2).sin().sum()
    n_sites = len(off.last_step().sites)
    (x * 2).sin().sum().backward()
    assert len(off.last_step().sites) == n_sites


def test_a_closed_offloader_says_so_and_offload_gives_a_new_one():
    config = CSwapConfig(plan="raw", min_bytes=0)
    shared = offload(config)
    shared.close()
    with pytest.raises(RuntimeError, match="was closed; create a new one"):
        shared.__enter__()
    fresh = offload(config)
    assert fresh is not shared
    with fresh:
        (torch.randn(64, 64, requires_grad=True) * 2).sin().sum().backward()
    fresh.close()


def test_prefetch_follows_the_learned_order_within_the_budget():
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    grads(model, x, y, off, steps=2)
    offloaded = [s for s in off.last_step().sites if s.decision == "raw"]
    assert len(offloaded) >= 4
    # with room for everything, every site but the first one backward needs is prefetched
    assert sum(s.prefetched for s in offloaded) == len(offloaded) - 1
    none = Offloader(CSwapConfig(plan="raw", min_bytes=0, prefetch_bytes=0))
    grads(model, x, y, none, steps=2)
    assert not any(s.prefetched for s in none.last_step().sites)


def test_prefetch_follows_the_recorded_order_not_a_fixed_one():
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    grads(model, x, y, off, steps=2)
    learned = off._step.unpack_order  # what the next step will follow
    assert len(learned) >= 4
    learned.reverse()  # pretend backward ran the other way round last step
    grads(model, x, y, off)
    # the real order walks backwards through the pretended one: nothing is ahead to prefetch
    assert not any(s.prefetched for s in off.last_step().sites)


def lossless_with_warnings(plan):
    """Two steps of the MLP under ``plan``: asserts bitwise-equal gradients, returns the
    Offloader and the messages of the warnings raised."""
    model, x, y = model_and_batch("mlp")
    ref = grads(copy.deepcopy(model), x, y)
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(copy.deepcopy(model), x, y, off, steps=2)
    assert_bitwise_equal(ref, got)
    return off, [str(w.message) for w in caught]


def test_offload_failure_keeps_the_tensor_with_one_warning(monkeypatch):
    class Broken:
        name = "broken"
        exact_size = True

        def encode(self, t, trim=True):
            raise MemoryError("host RAM exhausted")

    monkeypatch.setattr(step, "get_codec", lambda name: Broken())
    off, caught = lossless_with_warnings("raw")
    messages = [m for m in caught if "could not offload" in m]
    assert len(messages) == 1 and "host RAM exhausted" in messages[0]
    assert {s.reason for s in off.last_step().sites} >= {"offload failed"}


class ScratchHungryZVC(ZVCCodec):
    """ZVC whose device scratch never fits: encoding runs out of memory on every ``encode_oom``
    call and decoding on the first of two calls (the device attempt, then the host one)."""

    def __init__(self, encode_oom: bool) -> None:
        self.encode_oom = encode_oom
        self.decodes = 0

    def encode(self, t, trim=True):
        if self.encode_oom:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().encode(t, trim)

    def decode(self, packed):
        self.decodes += 1
        if self.decodes % 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().decode(packed)


@pytest.mark.parametrize("encode_oom", [True, False])
def test_a_codec_out_of_device_memory_falls_back_with_one_warning(encode_oom):
    """Encoding falls back to raw (no scratch); decoding to the host, then a copy over."""
    codec = ScratchHungryZVC(encode_oom)
    register(codec)
    try:
        off, caught = lossless_with_warnings("zvc")
    finally:
        register(ZVCCodec())
    messages = [m for m in caught if "ran out of device memory" in m]
    assert len(messages) == 1 and "(injected)" in messages[0]
    sites = [s for s in off.last_step().sites if s.stored_bytes]
    if encode_oom:
        assert {(s.decision, s.reason) for s in sites} == {("raw", "zvc out of device memory")}
        assert codec.decodes == 0
    else:
        assert "decoded on the host" in messages[0] and {s.decision for s in sites} == {"zvc"}
        # every restore tried the device, then the host; two steps, each site at least once
        assert codec.decodes % 2 == 0 and codec.decodes >= 2 * 2 * len(sites)
    off.close()


def test_statistics_table_and_dict():
    model, x, y = model_and_batch("cnn")
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    grads(model, x, y, off)
    step = off.last_step()
    table = step.table()
    assert table.count("\n") >= len(step.sites) + 2
    assert "zvc" in table and "ratio" in table
    d = step.as_dict()
    assert d["offloaded_bytes"] == step.offloaded_bytes > 0
    assert len(d["sites"]) == len(step.sites)
    assert all(s["sparsity"] is not None for s in d["sites"] if s["decision"] == "zvc")


class DeviceWork:
    """Stands for the events after a step's device work: done once the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_entering_a_step_never_waits_for_the_device(monkeypatch):
    """A measured step whose device work is not done yet is finished at a later step's start
    (its measurements, then the plan), never waited for; the steps in between run unmeasured,
    and no step waits for the arena's planning thread."""
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="auto", min_bytes=0, profile_steps=1, budget=None))
    off.transfer.arena_everywhere = True  # plan an arena on the CPU too
    work, waits = DeviceWork(), []
    monkeypatch.setattr(off.transfer, "marks", lambda device: [work])
    monkeypatch.setattr(off.transfer, "drain", lambda device=True: waits.append(device))
    grads(model, x, y, off, steps=3)
    assert off.plan is None and [s.measure for s, _ in off.closing.owed] == [True, False]
    assert not off._step.measure  # the one measurement owed is not taken again
    work.done = True
    grads(model, x, y, off, steps=1)
    assert off.plan is not None and not off.closing.owed
    assert waits == []
    gate = threading.Event()
    off.transfer._worker.submit(lambda: gate.wait(30))  # busy until the gate opens
    start = time.perf_counter()
    with off:  # closes the last step without waiting for the worker
        pass
    assert time.perf_counter() - start < 10
    gate.set()
    assert off.transfer.arena_report() is not None  # the closed steps still planned the arena
    off.close()


def test_last_step_without_the_device_waits_for_host_work_only(monkeypatch):
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    grads(model, x, y, off, steps=2)
    waits, drain = [], off.transfer.drain
    monkeypatch.setattr(off.transfer, "drain", lambda device=True: (waits.append(device),
                                                                      drain(device)))
    quick = off.last_step(device=False)
    zvc = [s for s in quick.sites if s.decision == "zvc"]
    assert zvc and all(s.stored_bytes > 0 and s.sparsity is None for s in zvc)
    assert off.last_step() is quick and all(s.sparsity is not None for s in zvc)
    assert waits == [False, True]
    off.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_training_on_the_second_gpu_creates_no_context_on_the_first():
    code = textwrap.dedent("""
        import torch
        from conftest import grads, model_and_batch
        from cswap_lightning import CSwapConfig, Offloader

        torch.cuda.set_device(1)
        model, x, y = model_and_batch("mlp", "cuda:1")
        off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
        grads(model, x, y, off, steps=3)
        assert off.transfer.arena_report() is not None
        assert off.transfer.host_memory.arena.buffer.is_pinned()
        off.close()
        assert not torch._C._cuda_hasPrimaryContext(0)
    """)
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True)


@pytest.mark.gpu
def test_cuda_forward_never_synchronises_and_memory_stays_flat():
    model, x, y = model_and_batch("cnn", "cuda")
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    grads(model, x, y, off, steps=2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with off:
                loss = F.cross_entropy(model(x), y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loss.backward()
        del loss
    torch.cuda.synchronize()
    gc.collect()
    step = off.last_step()
    assert step.offloaded_bytes > 0
    assert "offload failed" not in {s.reason for s in step.sites}
    assert torch.cuda.memory_allocated() - before <= 1 << 20
    assert off.live_host_bytes() == 0


def test_backward_threads_unpacking_one_site_at_once(monkeypatch):
    """Autograd runs one backward thread per device (a model split over GPUs in one process);
    here two threads unpack the same saved tensor at once, while its restore is slow."""
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    weights = [torch.randn(256, 256, requires_grad=True) for _ in range(2)]
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0, prefetch_bytes=0))
    restore = off.transfer.restore

    def slow_restore(stored):
        time.sleep(0.01)  # the first thread waits here; the second arrives meanwhile
        return restore(stored)

    monkeypatch.setattr(off.transfer, "restore", slow_restore)
    ref = [(torch.relu(x * 2) * w).sum() for w in weights]
    ref = [torch.autograd.grad(loss, [w])[0] for loss, w in zip(ref, weights)]
    for _ in range(5):
        with off:
            h = torch.relu(x * 2)
            losses = [(h * w).sum() for w in weights]  # both save h: one site, one entry
            del h  # else it is held elsewhere, and the engine learns to keep it
        got = [None, None]

        def backward(i, losses=losses, got=got):
            got[i] = torch.autograd.grad(losses[i], [weights[i]])[0]

        threads = [threading.Thread(target=backward, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert_bitwise_equal(ref, got)
        assert off._step._inflight == 0  # the restore was counted once, not once per thread
        assert off._step.unpack_order == [0]
    off.close()


@pytest.fixture
def one_process_mesh(monkeypatch):
    """A one-process gloo group on the CPU and its device mesh, for DTensor models."""
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                        "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    torch.distributed.init_process_group("gloo")
    yield init_device_mesh("cpu", (1,))
    torch.distributed.destroy_process_group()


def test_tensor_parallel_activations_move_as_their_local_shards(one_process_mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def parallel(model):
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        return parallelize_module(copy.deepcopy(model), one_process_mesh, plan)

    def full(gradients):
        return [g.full_tensor() if hasattr(g, "full_tensor") else g for g in gradients]

    model, x, y = model_and_batch("mlp")
    ref = full(grads(parallel(model), x, y, steps=2))
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    assert_bitwise_equal(ref, full(grads(parallel(model), x, y, off, steps=2)))
    sites = off.last_step().sites
    assert not [s for s in sites if s.reason.startswith("subclass")]  # DTensors moved too
    assert {s.reason for s in sites if s.decision == "keep"} <= {"parameter", "view of a leaf",
                                                                 "small", "held elsewhere"}
    assert sum(s.decision == "zvc" for s in sites) >= 4
    off.close()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_model_gives_bitwise_equal_gradients(backend):
    """A compiled model saves its activations through AOTAutograd's one function: the hooks
    see them like any others."""
    model, x, y = model_and_batch("mlp")
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    ref = grads(compiled, x, y, steps=2)
    compiled_off = torch.compile(copy.deepcopy(model), backend=backend)
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    got = grads(compiled_off, x, y, off, steps=2)
    assert_bitwise_equal(ref, got)
    step = off.last_step()
    assert "zvc" in {s.decision for s in step.sites}
    assert max(s.sparsity or 0.0 for s in step.sites) > 0.3  # the ReLU outputs went through ZVC
    off.close()


@pytest.mark.gpu
def test_a_storage_unpacked_on_a_second_stream_waits_for_its_restore():
    """Two ops that saved one tensor, run on two streams: backward runs each on its own
    stream, and the second unpack (served from the restored copy) must wait too."""
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    w1 = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    w2 = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)

    def run(ctx):
        with ctx:
            h = torch.relu(x)
            a = h @ w1
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                b = h @ w2
            torch.cuda.current_stream().wait_stream(side)
            loss = (a + b).sum()
            del h  # else it is held elsewhere, and the engine learns to keep it: no dedup
        return torch.autograd.grad(loss, [w1, w2])

    ref = run(contextlib.nullcontext())
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    for _ in range(3):
        got = run(off)
        torch.cuda.synchronize()
        assert_bitwise_equal(ref, got)
        assert "dedup" in {s.decision for s in off.last_step().sites}
    off.close()


# -- what the measured steps measure (the H200 check of 2026-11-26) ---------------------------
def _swapping_step(peak: int, moved: int):
    from cswap_lightning.records import SiteStats, StepStats

    stats = StepStats(0)
    stats.peak_allocated_bytes = peak
    row = SiteStats(0, (moved,), "uint8", moved, "raw")
    row.stored_bytes = moved
    stats.sites.append(row)
    return stats


def test_measured_steps_keep_every_tensor_only_where_the_device_has_room_for_them():
    """The swap-all step's peak above today's allocation plus what it moved must fit in four
    fifths of what the device can still give (free, and reserved but unused)."""
    from cswap_lightning.planning.planner import room_to_keep

    GiB = 1 << 30
    stats = _swapping_step(peak=10 * GiB, moved=5 * GiB)
    assert stats.offloaded_bytes == 5 * GiB
    cuda = torch.device("cuda", 0)
    # extra = (10 - 4) + 5 = 11 GiB; can give 20 + 12 - 4 = 28 GiB (22.4 of it allowed)
    assert room_to_keep(stats, cuda, (20 * GiB, 12 * GiB, 4 * GiB))
    assert not room_to_keep(stats, cuda, (5 * GiB, 12 * GiB, 4 * GiB))  # 10.4 allowed
    assert not room_to_keep(stats, torch.device("cpu"), (20 * GiB, 12 * GiB, 4 * GiB))


def test_the_profiler_times_sites_from_the_steps_that_moved_nothing():
    """A swapping step's windows hold its copies' stalls; a step that kept everything times
    the compute alone, and its windows are the ones the planner replays."""
    from cswap_lightning.planning.profiler import Profiler
    from cswap_lightning.records import SiteStats, StepStats

    def step(decision: str) -> StepStats:
        stats = StepStats(0)
        stats.sites.append(SiteStats(0, (1024,), "float32", 4096, decision))
        return stats

    profiler = Profiler()
    profiler.observe(step("raw"), {0: (1.0, 2.0, 0.0)})
    assert profiler.profile()[0].forward_s == 1.0  # no plain step yet: the swapping one
    profiler.observe(step("keep"), {0: (0.1, 0.3, 0.0)})
    profiler.observe(step("raw"), {0: (5.0, 5.0, 0.0)})
    site = profiler.profile()[0]
    assert (site.forward_s, site.backward_s) == (0.1, 0.3)


def test_the_ledger_counts_a_restored_copy_while_an_alias_of_it_lives():
    """A recomputation below the layer gives a kept output back detached (an alias, not a
    view): the copy's own tensor may go while the alias holds its memory in the recomputed
    graph, and the ledger counts it until that memory goes."""
    from cswap_lightning.core.residency import Residency
    from cswap_lightning.records import StepStats

    residency = Residency(StepStats(0))
    copy = torch.zeros(1024)
    ref = residency.restored(copy, copy.nbytes)
    alias = copy.detach()
    del copy
    residency.fold()
    assert ref() is None and residency.now == 4096
    del alias
    residency.fold()
    assert residency.now == 0


def test_the_timer_groups_the_first_unpacks_one_autograd_node_asked_for():
    """``x.sin() * x.cos()``: the product's node asks for both its saved tensors at once (a
    group), each function's node for its own input (alone, so no group)."""
    from cswap_lightning.planning.profiler import StepTimer

    timer = StepTimer(torch.device("cpu"))
    sites = iter(range(10))
    x = torch.randn(8, requires_grad=True)

    def unpack(saved: tuple[int, torch.Tensor]) -> torch.Tensor:
        timer.unpacked(saved[0])
        return saved[1]

    with torch.autograd.graph.saved_tensors_hooks(lambda t: (next(sites), t), unpack):
        y = (x.sin() * x.cos()).sum()
    y.backward()
    assert sorted(timer.unpack_order()) == [0, 1, 2, 3]
    assert [sorted(group) for group in timer.together()] == [[2, 3]]


def test_the_hosts_windows_leave_the_pack_hooks_out(monkeypatch):
    """The host's window of a site is its time from the site's hook's end to the next hook's
    start (or forward's end): the forward's own, as a step without hooks spends it, however
    long the hooks took. The host's clock is scripted."""
    from cswap_lightning.planning import profiler

    clock = iter([0.0, 0.0,  # forward begins: its stamp (the CPU's: the host clock), the host
                  1.0, 1.0, 1.4,  # site 0: its stamp, the hook's start, its end 0.4 s later
                  2.0, 2.0, 2.9,  # site 1: a hook of 0.9 s
                  3.5, 3.5])  # forward ends: stamp and host
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(clock))
    timer = profiler.StepTimer(torch.device("cpu"))
    timer.begin()
    for site in (0, 1):
        timer.packed(site)
        timer.placed()
    timer.forward_done()
    windows = timer.windows()
    assert {site: w[2] for site, w in windows.items()} == pytest.approx({0: 0.6, 1: 0.6})
    assert {site: w[0] for site, w in windows.items()} == pytest.approx({0: 1.0, 1: 1.5})
    assert timer.host_forward_s() == pytest.approx(3.5)  # the hooks in it


@pytest.mark.gpu
def test_the_step_peak_is_the_allocators_when_backward_ends():
    """A trainer that resets the allocator's peak between steps (as the benchmarks do) left
    the engine reading the peak since that reset when the step closed, at the next step's
    start: the budget then planned without the weights, gradients and loss."""
    model, x, y = model_and_batch("mlp", "cuda")
    off = Offloader(CSwapConfig(plan="keep"))
    with off:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert off.last_step().peak_allocated_bytes == peak
    off.close()


@pytest.mark.gpu
def test_under_a_budget_a_measured_step_keeps_every_tensor_where_the_device_has_room():
    """The first measured step swaps (safe where nothing fits); the next keeps all, so the
    planner's windows and the allocator's peak are those of the step without copies."""
    model, x, y = model_and_batch("mlp", "cuda")
    plain = Offloader(CSwapConfig(plan="keep"))
    grads(model, x, y, plain)
    keep_peak = plain.last_step().peak_allocated_bytes
    plain.close()
    off = Offloader(CSwapConfig(budget=keep_peak // 2, min_bytes=0))
    rows = []
    for _ in range(off.config.profile_steps + 3):
        grads(model, x, y, off)
        step = off.last_step()
        if not step.hooks_off:  # the plain step the engine times sees no site
            rows.append({s.decision for s in step.sites})
    assert "raw" in rows[0]
    assert any(decisions and decisions <= {"keep", "dedup"} for decisions in rows[1:]), rows
    off.close()


def test_with_room_every_measured_step_after_a_swapping_one_keeps_all_and_plans_from_it(
        monkeypatch):
    """The engine's real path with the device's answer injected (the CPU has no allocator):
    under a budget nothing fits, a measured step that swapped is followed by one that keeps
    every tensor, before the plan and again after new_epoch() with the plan in place; the
    steps between run the plan, which moves."""
    from cswap_lightning.core import learning

    model, x, y = model_and_batch("mlp")

    def decisions(room: bool) -> list[set[str]]:
        monkeypatch.setattr(learning, "room_to_keep", lambda stats, device: room)
        off = Offloader(CSwapConfig(budget=MIN_BUDGET, min_bytes=0, profile_steps=2,
                                    recompute="off"))
        rows = []
        for epoch in range(2):
            if epoch:
                off.new_epoch()
            for _ in range(4):
                grads(model, x, y, off)
                step = off.last_step()
                rows.append(step.offloaded_bytes + step.untracked_moved_bytes > 0)
        off.close()
        return rows

    assert decisions(room=False) == [True] * 8  # no room: every step moves
    rows = decisions(room=True)  # whether each step moved
    assert rows[:3] == [True, False, True]  # measured: swapping, keeping; then the plan
    assert rows[4:6] == [True, False], rows  # after new_epoch: the plan, then keeping


def test_measured_forward_times_are_scaled_to_a_step_timed_without_hooks(monkeypatch):
    """On a GPU the measured steps' hooks leave the device idle between kernels (GPT-2
    medium's measured forward took 5x the plain one on an H100, and the plans moved what
    the link could not hide). With room, one step runs without hooks, its forward timed,
    and the measured steps' windows and block times the planner is given are scaled to it,
    backward's to its backward. The device's answers are injected (the CPU has no allocator,
    and its hooks' time is the step's)."""
    from cswap_lightning.core import learning

    monkeypatch.setattr(learning, "room_to_keep", lambda stats, device: True)
    monkeypatch.setattr(learning, "hooks_idle", lambda device: True)
    given = []
    choose = learning.Learning._plan_recompute

    def planning(self, step):
        profile = self.profiler.profile()
        given.append((self.plain_forward_s, sum(p.forward_s for p in profile),
                      [c.forward_s for c in self.block_calls],
                      self.plain_host_forward_s, sum(p.host_s for p in profile),
                      self.plain_backward_s, sum(p.backward_s for p in profile)))
        return choose(self, step)

    monkeypatch.setattr(learning.Learning, "_plan_recompute", planning)
    model, x, y = model_and_batch("transformer")
    off = Offloader(CSwapConfig(budget=MIN_BUDGET, min_bytes=0, profile_steps=2))
    off.watch(model)
    hooks_off = []
    for _ in range(4):
        grads(model, x, y, off)
        hooks_off.append(off.last_step().hooks_off)
    assert hooks_off[:3] == [False, True, False], hooks_off  # swapping, plain, keeping
    plain, windows, blocks, plain_host, host_windows, plain_back, back_windows = given[0]
    assert plain is not None and plain > 0
    assert 0 < windows <= plain * (1 + 1e-9)  # the keeping step's, scaled to the plain one
    assert blocks and 0 < sum(blocks) <= plain * (1 + 1e-9)
    # the host's windows, what the replay's host clock runs on, measured with the hooks left
    # out (not scaled); the plain step's host time kept beside them
    assert plain_host is not None and host_windows > 0
    # and backward's, first unpack to its end, to the plain step's
    assert plain_back is not None and 0 < back_windows <= plain_back * (1 + 1e-9)
    off.new_epoch()  # measured again: timed again
    assert (off.learning.plain_forward_s, off.learning.plain_backward_s,
            off.learning.plain_host_forward_s) == (None, None, None)
    off.close()


def test_without_room_for_a_step_without_hooks_the_hosts_windows_are_still_measured(
        monkeypatch):
    """Where the device has no room for every saved tensor (a large model's fine-tuning, the
    case that matters), no step runs without hooks; the host's windows, which leave the hooks
    out, still give the replay its host clock (they were 0 before: scaled to a plain step
    that never ran). On the CPU, whose windows are the host's, they stay 0. The device's
    answers are injected."""
    from cswap_lightning.core import learning

    monkeypatch.setattr(learning, "room_to_keep", lambda stats, device: False)
    model, x, y = model_and_batch("transformer")
    host = {}
    for idle in (True, False):
        monkeypatch.setattr(learning, "hooks_idle", lambda device, idle=idle: idle)
        off = Offloader(CSwapConfig(budget=MIN_BUDGET, min_bytes=0, profile_steps=2))
        for _ in range(3):
            grads(model, x, y, off)
            assert not off.last_step().hooks_off
        assert off.learning.plain_forward_s is None  # no step ran without hooks
        host[idle] = sum(p.host_s for p in off.learning.profiler.profile())
        off.close()
    assert host[True] > 0 and host[False] == 0


@pytest.mark.parametrize("how", ["raises", "goes without backward"])
def test_a_step_timed_without_hooks_that_fails_or_is_skipped_is_timed_again(how, monkeypatch):
    """The step timed without hooks raised in forward, or its graph went without a backward:
    the next measured step is timed so instead (before, no step was, for the whole epoch, and
    the plan took the hooked steps' times). The device's answers are injected, as above."""
    from cswap_lightning.core import learning

    monkeypatch.setattr(learning, "room_to_keep", lambda *args, **kwargs: True)
    monkeypatch.setattr(learning, "hooks_idle", lambda device: True)
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="auto", min_bytes=0, budget=None, profile_steps=2))
    seen = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        with contextlib.suppress(RuntimeError), off:
            loss = F.cross_entropy(model(x), y)
            if i == 1 and how == "raises":
                raise RuntimeError("the step's forward failed")
        if i == 1:
            del loss
            continue
        loss.backward()
        seen.append((off.last_step().hooks_off, off.learning.plain_forward_s is not None))
    off.close()
    assert seen == [(False, False), (True, False), (False, True)]  # measured, timed, measured


def test_a_scaled_block_call_keeps_the_host_time_of_its_recomputation_below_the_layer():
    """A block's forward is scaled to the plain step's; recomputing it below the layer runs
    under dispatch modes, host-bound as the measured step was (an H100 measured it slower than
    recomputing whole): its cost stays what was measured, plus the forward's extra host time
    under them."""
    from cswap_lightning.core.learning import _scaled
    from cswap_lightning.core.recompute import BlockCall
    from cswap_lightning.planning.workload import Below

    call = BlockCall("layers.0", 0, 5, 1, 64, forward_s=0.010,
                     below=(Below((64, 32), 0.004), Below((64, 96), 0.001, weight=0.2)))
    scaled = _scaled(call, 0.2)
    assert scaled.forward_s == pytest.approx(0.002)
    assert [way.seconds for way in scaled.below] == pytest.approx([0.004 + 0.008, 0.001 + 0.008])
    assert _scaled(replace(call, below=()), 0.2).below == ()


@pytest.mark.gpu
def test_on_cuda_the_plans_step_time_is_the_plain_steps_not_the_hooked_ones():
    """GPT-2's measured steps run far slower than plain ones on a GPU (the hooks leave it
    idle); the engine's prediction for a plan that keeps everything is the plain step's, in
    time and memory."""
    import time

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8)).cuda()
    ids = torch.randint(0, 1000, (4, 512), device="cuda")

    def step(off=None):
        model.zero_grad(set_to_none=True)
        if off is None:
            model(ids, labels=ids).loss.backward()
            return
        with off:
            loss = model(ids, labels=ids).loss
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    plain_s = (time.perf_counter() - began) / 5
    plain_peak = torch.cuda.max_memory_allocated()
    off = Offloader(CSwapConfig(budget=1 << 40))
    off.watch(model)
    for _ in range(6):
        step(off)
    assert off.learning.plain_forward_s is not None
    prediction = off.recomputation.mix.prediction
    predicted = prediction.step_s - prediction.optimizer_s
    assert predicted < 1.5 * plain_s, (predicted, plain_s)
    # the peak from the plain step's allocator peak, not the measured steps' (2.7 GiB more
    # on GPT-2 medium on an H100)
    assert abs(prediction.peak_bytes - plain_peak) <= 0.05 * plain_peak, (
        prediction.peak_bytes, plain_peak)
    off.close()


def _said(run) -> list[str]:
    """The messages of the warnings ``run()`` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught]


def test_a_budget_met_by_moving_without_a_watched_model_says_blocks_cannot_be_recomputed():
    """Said once the plan is made, where it has to move tensors (or cannot meet the budget):
    not where nothing needs to move, nor with a watched model or recompute='off'."""
    model, x, y = model_and_batch("mlp")
    keep = Offloader(CSwapConfig(plan="keep"))
    grads(model, x, y, keep)
    budget = keep.last_step().peak_resident_bytes // 2
    keep.close()
    unwatched = Offloader(CSwapConfig(budget=budget, profile_steps=1))
    said = _said(lambda: grads(model, x, y, unwatched, steps=3))
    assert [m for m in said if "no model is watched" in m] == [(
        f"cswap: budget={budget} with recompute='auto', but no model is watched, so no block "
        "can be recomputed to meet it (only moved): call offloader.watch(model) once before "
        "training (the Lightning strategies and CSwapCallback do), or set recompute='off'")]
    assert _said(lambda: grads(model, x, y, unwatched, steps=2)) == []  # once
    unwatched.close()
    for config in (CSwapConfig(budget=budget, profile_steps=1),
                   CSwapConfig(budget=budget, profile_steps=1, recompute="off"),
                   CSwapConfig(budget=1 << 40, profile_steps=1)):
        off = Offloader(config)
        if config.recompute == "auto" and config.budget == budget:
            off.watch(model)
        said = _said(lambda off=off: grads(model, x, y, off, steps=3))
        assert not [m for m in said if "no model is watched" in m], config
        off.close()


MISPLACED = ("{what}: enter it around forward alone, and call backward after it: `with "
             "offloader: loss = loss_fn(model(x), y)` then `loss.backward()`")


def test_an_offloader_around_backward_is_said_once():
    model, x, y = model_and_batch("mlp")
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))

    def around_both():
        with off:
            F.cross_entropy(model(x), y).backward()

    what = "cswap: backward ran inside the Offloader's block"
    assert _said(around_both) == [MISPLACED.format(what=what)]
    assert _said(around_both) == []
    off.close()
    alone = Offloader(CSwapConfig(plan="raw", min_bytes=0))

    def around_backward():
        loss = F.cross_entropy(model(x), y)
        with alone:
            loss.backward()

    what = "cswap: no tensor autograd saved passed through the Offloader's block"
    assert _said(around_backward) == [MISPLACED.format(what=what)]
    alone.close()
    forward = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    assert _said(lambda: grads(model, x, y, forward)) == []  # around forward: nothing said

    def evaluation():
        with forward, torch.no_grad():
            model(x)

    assert _said(evaluation) == []  # a pass under no_grad after training steps saves nothing
    forward.close()


def test_a_gradient_penalty_in_forward_is_no_misplaced_backward():
    # WGAN-GP's pattern: a gradient with create_graph inside forward, whose graph forward
    # saves for the backward after the block; bitwise as without the engine, nothing said.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))

    def penalised(block) -> list[torch.Tensor]:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model.zero_grad(set_to_none=True)
        with block:
            out = model(x)
            grad = torch.autograd.grad(out.sum(), x, create_graph=True)[0]
            loss = out.mean() + ((grad.norm(dim=1) - 1) ** 2).mean()
        loss.backward()
        return [p.grad for p in model.parameters()]

    plain = penalised(contextlib.nullcontext())
    for _ in range(4):  # measured, checked, then untracked
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gradients = penalised(off)
        assert [str(w.message) for w in caught] == []
        assert all(torch.equal(a, b) for a, b in zip(gradients, plain, strict=True))
    assert off.last_step().untracked_moved_tensors > 0
    off.close()


def test_a_model_on_the_meta_device_fails_at_its_first_step_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).to("meta")
    off = Offloader(CSwapConfig())
    with pytest.raises(RuntimeError) as failure, off:
        model(torch.randn(4, 8, device="meta")).sum()
    assert str(failure.value) == (
        "cswap: autograd saved a tensor on meta; the engine runs on the CPU and on CUDA GPUs "
        "only: a model on the meta device has no data to train: materialise it first (e.g. "
        "model.to_empty(device='cuda') and load or initialise its weights)")
    off.close()
