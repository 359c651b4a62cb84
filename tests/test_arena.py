"""The planned host arena at run time: used when it can be, never when it must not be."""

import copy
import gc
import threading
import warnings
import weakref

import pytest
import torch
from conftest import model_and_batch
from torch.nn import functional as F

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.codecs import get_codec
from cswap_lightning.core import arena as arena_module
from cswap_lightning.core.arena import ALIGNMENT, HostArena
from cswap_lightning.core.transfer import Stored, Transfer
from cswap_lightning.planning.memplan import Buffer, plan
from cswap_lightning.records import SiteStats, StepStats


@pytest.fixture(autouse=True)
def arena_on_the_cpu(monkeypatch):
    """The engine plans an arena for pinned memory only; these tests run it on the CPU."""
    monkeypatch.setattr(Transfer, "arena_everywhere", True)


def forward(model, x, y, off=None):
    """The loss of one forward, under ``off`` if given.

    Inside the ``with`` block the report of the step just closed is read first: it waits
    for the arena planned from that step, so that this step can use it."""
    if off is None:
        return F.cross_entropy(model(x), y)
    with off:
        off.transfer.arena_report()
        return F.cross_entropy(model(x), y)


def grads(model, x, y, off=None):
    model.zero_grad(set_to_none=True)
    forward(model, x, y, off).backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert torch.equal(ga, gb)


def assert_same_grads(a, b):
    assert_bitwise_equal([p.grad for p in a.parameters()], [p.grad for p in b.parameters()])


def close_last(off):
    """The report of the last step (entering the Offloader closes it)."""
    with off:
        return off.transfer.arena_report()


def warmed_up(name="cnn", plan_name="zvc"):
    """A model, a reference copy, a batch, and an Offloader whose arena is planned."""
    model, x, y = model_and_batch(name)
    off = Offloader(CSwapConfig(plan=plan_name, min_bytes=0))
    ref = copy.deepcopy(model)
    for _ in range(2):
        assert_bitwise_equal(grads(ref, x, y), grads(model, x, y, off))
    assert close_last(off).hits > 0
    return model, ref, x, y, off


@pytest.mark.parametrize("plan_name", ["raw", "zvc"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_training_with_the_arena_is_lossless_and_reuses_regions(name, plan_name):
    model, x, y = model_and_batch(name)
    ref, swapped = copy.deepcopy(model), copy.deepcopy(model)
    off = Offloader(CSwapConfig(plan=plan_name, min_bytes=0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(swapped.parameters(), lr=0.1)
    for i in range(3):
        assert_bitwise_equal(grads(ref, x, y), grads(swapped, x, y, off))
        ref_opt.step()
        opt.step()
        report = off.transfer.arena_report()
        if i == 0:
            assert report is None  # no step closed yet
        elif i == 1:  # step 0 ran before any plan, and planned the arena
            assert report.payloads > 5
            assert report.hits == 0 and report.fallbacks == {"no arena": report.payloads}
            assert report.replanned
            slack = report.payloads * ALIGNMENT
            assert report.arena_bytes <= report.lower_bound + slack
            assert report.arena_bytes >= report.lower_bound
            assert report.per_tensor_bytes >= report.lower_bound
        else:  # step 1 used the arena planned from step 0: slots as large as payloads can be
            assert report.hits == report.payloads > 0, report
    gc.collect()
    assert off.transfer.host_memory.arena.in_use() == 0  # backward dropped every payload
    off.close()


def test_steady_steps_use_the_arena_without_planning_it_again():
    """Once a raw plan is checked, steps move untracked (no rows to plan from): every payload
    still takes its region, and the arena stays as planned."""
    model, x, y = model_and_batch("cnn")
    ref = copy.deepcopy(model)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0, profile_steps=1))
    reports = []
    for _ in range(6):
        assert_bitwise_equal(grads(ref, x, y), grads(model, x, y, off))
        reports.append(off.transfer.arena_report())
    steady = off.last_step()
    assert steady.untracked_moved_tensors > 0
    assert all(s.decision == "dedup" for s in steady.sites)  # shared storages stay tracked
    planned = reports[2]  # step 1 checked the plan, in the arena planned from step 0
    for report in reports[3:]:
        assert not report.replanned and report.fallbacks == {}
        assert report.hits == steady.untracked_moved_tensors == planned.payloads == report.payloads
        assert report.arena_bytes == planned.arena_bytes
    off.close()


def test_payloads_live_in_their_region_and_get_it_back_once_dropped():
    transfer = Transfer(arena="always")
    site = SiteStats(0, (1000,), "float32", 4000, "raw", stored_bytes=4000, unpacked_at=1)
    transfer.step_closed(StepStats(0, [site]))
    assert transfer.arena_report().arena_bytes == 4096  # the slot, rounded up to ALIGNMENT
    buffer = transfer.host_memory.arena.buffer
    t = torch.randn(1000)
    first = transfer.offload(Stored(t.device), t, get_codec("raw"), site=0)
    assert first.payload.data_ptr() == buffer.data_ptr()
    second = transfer.offload(Stored(t.device), t * 2, get_codec("raw"), site=0)
    assert second.lease is None  # the region is held: memory of its own
    assert torch.equal(transfer.restore(first)[0], t)  # not overwritten
    assert torch.equal(transfer.restore(second)[0], t * 2)
    del first
    gc.collect()
    third = transfer.offload(Stored(t.device), t * 3, get_codec("raw"), site=0)
    assert third.payload.data_ptr() == buffer.data_ptr()  # given back
    assert torch.equal(transfer.restore(third)[0], t * 3)
    transfer.step_closed(StepStats(1, [site]))
    report = transfer.arena_report()
    assert (report.hits, report.fallbacks) == (2, {"busy": 1})
    transfer.close()


def test_a_raw_payload_takes_its_region_in_its_own_shape_and_strides():
    """An activation has dimensions: its region is viewed in them, so that neither the copy
    into it nor the tensor restored from it needs a view of its own."""
    transfer = Transfer(arena="always")
    site = SiteStats(0, (8, 125), "float32", 4000, "raw", stored_bytes=4000, unpacked_at=1)
    transfer.step_closed(StepStats(0, [site]))
    assert transfer.arena_report().arena_bytes == 4096  # planned (in the background)
    buffer = transfer.host_memory.arena.buffer
    t = torch.randn(8, 125)
    stored = transfer.offload(Stored(t.device), t, get_codec("raw"), site=0)
    assert stored.lease is not None and stored.payload.data_ptr() == buffer.data_ptr()
    assert (stored.payload.shape, stored.payload.stride()) == (t.shape, t.stride())
    restored = transfer.restore(stored)[0]
    assert (restored.shape, restored.stride()) == (t.shape, t.stride())
    assert torch.equal(restored, t)
    transfer.close()


def raw_step(index, nbytes):
    site = SiteStats(0, (nbytes // 4,), "float32", nbytes, "raw", stored_bytes=nbytes,
                     unpacked_at=1)
    return StepStats(index, [site])


def test_a_compressed_payload_longer_than_its_first_copy_is_settled_whole():
    """A zvc payload's first copy takes what the site needed last time (and a little more);
    the length read back from the copied bytes says how much more to copy."""
    transfer = Transfer(arena="always")
    site = SiteStats(0, (8192,), "float32", 32768, "zvc", stored_bytes=1, unpacked_at=1)
    transfer.step_closed(StepStats(0, [site]))
    capacity = get_codec("zvc").capacity(8192, 4)
    assert transfer.arena_report().arena_bytes == -(-capacity // ALIGNMENT) * ALIGNMENT
    sparse = torch.randn(8192).relu() * (torch.rand(8192) < 0.1)
    first = transfer.offload(Stored(sparse.device), sparse, get_codec("zvc"), site=0)
    assert first.lease is not None and first.copied == first.length  # nothing known yet: all
    denser = torch.randn(8192).relu()
    second = transfer.offload(Stored(denser.device), denser, get_codec("zvc"), site=0)
    assert first.length < second.copied < second.length  # the rest was copied after
    assert second.stored_bytes == second.length == get_codec("zvc").encode(denser).payload.numel()
    assert int(second.nonzero) == int((denser != 0).sum())
    assert torch.equal(transfer.restore(first)[0], sparse)
    assert torch.equal(transfer.restore(second)[0], denser)
    transfer.close()


def test_the_arena_is_planned_again_when_a_site_changes_size():
    transfer = Transfer()
    for index, nbytes in enumerate([20_000, 20_000, 10_000]):
        transfer.step_closed(raw_step(index, nbytes))
        report = transfer.arena_report()
        assert report.replanned == (index != 1)
    assert report.arena_bytes == 20 * ALIGNMENT
    transfer.close()


def test_a_region_sharing_bytes_with_a_held_one_waits_for_its_release():
    # Blocks 0 and 1 never live together, so the planner lets them share bytes.
    layout = plan([Buffer(0, 1024, 0, 1), Buffer(1, 1024, 2, 3)], alignment=512)
    assert layout.regions[0] == layout.regions[1]
    arena = HostArena(layout, signature=(), pin=False)
    view, _ = arena.acquire(0, 1024)
    assert arena.acquire(1, 1024) == "busy"  # a step that differs from the plan
    assert arena.acquire(2, 8) == "unplanned"
    del view
    gc.collect()
    view, _ = arena.acquire(1, 1000)
    assert view.data_ptr() == arena.buffer.data_ptr() and view.numel() == 1000
    assert arena.acquire(0, 2048) == "too big"


def test_a_region_is_viewed_as_its_payloads_dtype_and_its_arena_lives_while_the_view_does():
    """A replanned arena is dropped while payloads of live steps still view the old one: the
    old one (its memory, its pinning on CUDA) must stay until the last view goes, and then
    go, its region given back."""
    layout = plan([Buffer(0, 1024, 0, 1), Buffer(1, 4096, 0, 1)], alignment=512)
    arena = HostArena(layout, signature=(), pin=False)
    view, lease = arena.acquire(1, 4000, torch.float64)
    assert view.dtype is torch.float64 and view.numel() == 500
    assert view.data_ptr() == arena.buffer.data_ptr() + layout.regions[1][0]
    halves, _ = arena.acquire(0, 1024, torch.bfloat16)
    assert halves.numel() == 512
    assert halves.data_ptr() == arena.buffer.data_ptr() + layout.regions[0][0]
    view.copy_(torch.arange(500, dtype=torch.float64))
    alive = weakref.ref(arena)
    del arena, halves
    gc.collect()
    assert alive() is not None  # the view holds it
    assert torch.equal(view, torch.arange(500, dtype=torch.float64))
    alive().acquire(3, 8)  # takes in what was released since (region 0)
    assert alive().in_use() == 1
    del view
    gc.collect()
    assert alive() is None and lease.key == 1


def test_a_larger_batch_falls_back_then_is_replanned():
    model, ref, x, y, off = warmed_up()
    big_x, big_y = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])
    assert_bitwise_equal(grads(ref, big_x, big_y), grads(model, big_x, big_y, off))
    report = close_last(off)
    assert report.fallbacks.get("too big", 0) > 0 and report.replanned
    assert_bitwise_equal(grads(ref, big_x, big_y), grads(model, big_x, big_y, off))
    report = close_last(off)
    assert report.hits == report.payloads and not report.replanned
    off.close()


def test_two_forwards_alive_at_once_keep_their_payloads_apart():
    model, ref, x, y, off = warmed_up()
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    (F.cross_entropy(ref(x), y) + F.cross_entropy(ref(x), y)).backward()
    first = forward(model, x, y, off)
    second = forward(model, x, y, off)  # while the first one's payloads are held
    report = off.transfer.arena_report()  # of the first forward, closed by the second
    assert report.hits == report.payloads
    (first + second).backward()
    assert_same_grads(ref, model)
    report = close_last(off)
    assert report.hits == 0 and report.fallbacks == {"busy": report.payloads}
    off.close()


def test_retain_graph_keeps_payloads_intact_while_another_step_runs():
    model, ref, x, y, off = warmed_up()
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    kept = F.cross_entropy(ref(x), y)
    kept.backward(retain_graph=True)
    F.cross_entropy(ref(x), y).backward()
    kept.backward()
    kept = forward(model, x, y, off)
    kept.backward(retain_graph=True)
    forward(model, x, y, off).backward()  # its regions are held by the retained graph
    kept.backward()  # reads the retained payloads a second time
    assert_same_grads(ref, model)
    report = close_last(off)
    assert report.fallbacks == {"busy": report.payloads}
    off.close()


def test_an_arena_that_cannot_be_allocated_falls_back_with_one_warning():
    model, x, y = model_and_batch("cnn")
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for size in (2**61, 2**61, 2**62):  # more than any address space
            site = SiteStats(0, (size,), "uint8", size, "raw", stored_bytes=size, unpacked_at=1)
            off.transfer.step_closed(StepStats(0, [site]))
            assert off.transfer.arena_report().arena_bytes == 0
    messages = [str(w.message) for w in caught if "could not allocate" in str(w.message)]
    assert len(messages) == 1, messages
    ref = copy.deepcopy(model)
    assert_bitwise_equal(grads(ref, x, y), grads(model, x, y, off))
    report = close_last(off)
    assert report.fallbacks == {"no arena": report.payloads}
    assert report.arena_bytes > 0  # planned again from a real step, and allocated
    off.close()


@pytest.mark.gpu
def test_arena_on_cuda_is_pinned_lossless_and_reused():
    model, x, y = model_and_batch("mlp", "cuda")  # no cuDNN convolutions: deterministic
    ref = copy.deepcopy(model)
    off = Offloader(CSwapConfig(plan="zvc", min_bytes=0))
    for _ in range(3):
        assert_bitwise_equal(grads(ref, x, y), grads(model, x, y, off))
    report = close_last(off)
    assert report.hits == report.payloads > 0
    assert off.transfer.host_memory.arena.buffer.is_pinned()
    off.close()


def test_unpinning_runs_on_its_own_thread_when_an_arena_goes():
    """A pinned arena's finalizer only queues its unpinning (safe inside any code a weakref
    callback interrupts); the cswap-unpin thread runs it, and outlives a job that fails."""
    arena_module._start_unpinner()
    ran = []
    done = threading.Event()

    class Dropped:
        pass

    dropped = Dropped()
    weakref.finalize(dropped, arena_module._UNPINS.put,
                     lambda: (ran.append(threading.current_thread().name), done.set()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failing job's warning, from the other thread
        arena_module._UNPINS.put(lambda: 1 / 0)  # queued first
        del dropped
        assert done.wait(10)
    assert ran == ["cswap-unpin"]
