"""What autograd saves is moved faithfully, and the Offloader behaves in every way it is used:
pieces of one storage, frozen weights, nesting, threads, failures, closing, fork."""

import copy
import multiprocessing
import os
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import cswap_lightning as cswap
from cswap_lightning import CSwapConfig, Offloader

LOSSLESS = ("raw", "zvc", "rle")


def run(model_step, offloader=None):
    """Loss and gradients of ``model_step()`` (a function returning (loss, params))."""
    torch.manual_seed(0)
    if offloader is None:
        loss, params = model_step()
    else:
        with offloader:
            loss, params = model_step()
    grads = torch.autograd.grad(loss, params)
    return [loss.detach(), *grads]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


def recurrent_step(cell):
    x = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(1))

    def step():
        h = c = torch.zeros(4, 16)
        for t in range(5):
            if isinstance(cell, nn.LSTMCell):
                h, c = cell(x[t], (h, c))
            else:
                h = cell(x[t], h)
        return h.square().sum(), list(cell.parameters())

    return step


@pytest.mark.parametrize("plan", LOSSLESS)
@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell])
def test_recurrent_cells_whose_gates_share_a_storage_are_bitwise(cell, plan):
    """ATen splits the gates with unsafe_chunk: pieces of one storage, each with a version
    counter of its own, each then activated in place after another piece was saved."""
    torch.manual_seed(0)
    step = recurrent_step(cell(8, 16))
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
    assert_bitwise(run(step), run(step, off))
    assert off.last_step().offloaded_bytes > 0
    off.close()


@pytest.mark.parametrize("plan", LOSSLESS)
def test_pieces_of_one_storage_activated_in_place_are_not_taken_for_copies(plan):
    """The LSTM cell's pattern, by hand: each piece saved at the same version number, but
    counted by a counter of its own, after an in-place write the first save did not see."""
    w = torch.randn(6, 8, requires_grad=True)

    def step():
        b = torch.randn(6, 6) @ w
        first, second = b.unsafe_split(3)
        first = first.sigmoid_()  # saved (version 1) with the whole storage moving
        second = second.tanh_()  # saved (version 1 of its own counter): not the same bytes
        return (first * 2 + second * 3).square().sum(), [w]

    off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
    assert_bitwise(run(step), run(step, off))
    assert "dedup" not in {s.decision for s in off.last_step().sites}
    off.close()


def test_views_sharing_the_version_counter_still_move_once():
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        h = (x * 2).relu()
        return (h * h.t()).sum() + h[3:].sum() * h.sum(), [x]

    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    assert_bitwise(run(step), run(step, off))
    decisions = [s.decision for s in off.last_step().sites if s.nbytes == 64 * 64 * 4]
    assert decisions == ["raw", "dedup", "dedup"]  # h, then h and h.t() for the product
    off.close()


class LoRALinear(nn.Module):
    """A frozen base weight with a trained low-rank update, as PEFT builds it."""

    def __init__(self, features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, features) / features)
        self.b = nn.Parameter(torch.zeros(features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_frozen_weights_and_their_views_stay_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(256), nn.GELU(), LoRALinear(256), nn.GELU())
    x = torch.randn(64, 256)

    def step():
        return model(x).square().mean(), [p for p in model.parameters() if p.requires_grad]

    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    assert_bitwise(run(step), run(step, off))
    weights = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
    sites = off.last_step().sites
    frozen = [s for s in sites if s.shape in ((256, 256),)]
    assert frozen and {s.reason for s in frozen} <= {"leaf", "view of a leaf"}, sites
    assert all(s.decision in ("keep", "dedup") for s in frozen)
    assert weights  # the model has frozen weights at all
    off.close()


def test_a_batch_the_loop_holds_is_moved_once_then_kept_because_moving_it_freed_nothing():
    """Measured, not assumed: after the first step the engine saw the input still alive when
    backward needed it (the loop holds it), so later steps leave it in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x = torch.randn(256, 512)  # a leaf that does not require grad, held by this loop
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    moved, peaks = [], []
    for _ in range(3):
        with off:
            loss = model(x).sum()
        loss.backward()
        step = off.last_step()
        moved.append(step.offloaded_bytes)
        peaks.append(step.peak_resident_bytes)
        (site,) = [s for s in step.sites if s.shape == (256, 512) and s.site == 0]
    assert site.reason == "held elsewhere" and site.decision == "keep"
    assert moved[1] == moved[0] - x.numel() * 4  # the input no longer crosses the link
    assert peaks[1] <= peaks[0]  # and keeping it costs no device memory
    off.new_epoch()  # re-measured at each epoch
    assert 0 not in off.held_elsewhere
    off.close()


# The Offloader's lifecycle ----------------------------------------------------------------

def mlp_step(model, x):
    def step():
        return model(x).relu().sum(), list(model.parameters())
    return step


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 32)


def test_a_failed_enter_leaves_the_offloader_usable(mlp):
    model, x = mlp
    off = cswap.offload(CSwapConfig(plan="raw", min_bytes=0))
    with (torch.autograd.graph.disable_saved_tensors_hooks("not here"),
          pytest.raises(RuntimeError, match="not here")):
        off.__enter__()
    assert_bitwise(run(mlp_step(model, x)), run(mlp_step(model, x), off))
    assert off.last_step().offloaded_bytes > 0
    off.close()


def test_blocks_nest_as_pytorch_hooks_do(mlp):
    model, x = mlp
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))

    def nested():
        with off, torch.autograd.graph.save_on_cpu(), off:
            return mlp_step(model, x)()

    def step():
        return nested()

    assert_bitwise(run(mlp_step(model, x)), run(step, off))
    assert off.last_step().step == 0  # one step, however deep the blocks
    assert off.last_step().offloaded_bytes > 0
    with off:  # the hooks are gone after the outer block: a fresh step starts
        pass
    assert off.last_step().step == 1
    off.close()


def test_leaving_a_block_that_was_not_entered_says_so():
    off = Offloader()
    with pytest.raises(RuntimeError, match="without being entered"):
        off.__exit__(None, None, None)
    with off:
        pass
    with pytest.raises(RuntimeError, match="without being entered"):
        off.__exit__(None, None, None)
    off.close()


def test_each_thread_gets_its_own_shared_offloader(mlp):
    model, x = mlp
    config = CSwapConfig(plan="raw", min_bytes=0)
    expected = run(mlp_step(model, x))
    results, errors, offloaders = {}, [], {}
    barrier = threading.Barrier(2)

    def train(i):
        try:
            local = copy.deepcopy(model)
            barrier.wait()
            for _ in range(10):
                off = cswap.offload(config)
                results[i] = run(mlp_step(local, x), off)
            offloaders[i] = off
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert offloaders[0] is not offloaders[1]
    assert offloaders[0].last_step().step == 9  # every step its own, none refused
    for got in results.values():
        assert_bitwise(expected, got)


def test_an_offloader_in_use_by_another_thread_says_which_to_use(mlp):
    off = Offloader()
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with off:
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    entered.wait(30)
    try:
        with pytest.raises(RuntimeError, match="another thread.*offload\\(config\\)"):
            off.__enter__()
    finally:
        leave.set()
        thread.join()
    off.close()


def test_two_models_alternating_on_one_offloader_are_told_once():
    """Models that save different tensors (here, how many) are measured again at each
    switch, and the user is told once."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(32, 64), nn.ReLU()),
              nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())]
    off = Offloader(CSwapConfig(min_bytes=0, profile_steps=1), link=cswap_link())
    x = torch.randn(16, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(12):
            with off:
                loss = models[i % 2](x).sum()
            loss.backward()
    told = [w for w in caught if "changed" in str(w.message)]
    assert len(told) == 1 and "its own" in str(told[0].message)
    off.close()


def cswap_link():
    from cswap_lightning.planning.profiler import Link

    return Link(1e9, 1e9, 1e11)


def test_backward_after_close_still_works(mlp):
    model, x = mlp
    for plan in ("raw", "zvc"):
        off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
        torch.manual_seed(0)
        with off:
            loss, params = mlp_step(model, x)()
        off.close()
        got = torch.autograd.grad(loss, params)
        assert_bitwise(run(mlp_step(model, x))[1:], list(got))
        with pytest.raises(RuntimeError, match="closed"):
            off.__enter__()


# Fork ---------------------------------------------------------------------------------------

def _child_step(config, queue):
    torch.set_num_threads(1)  # as DataLoader workers do: OpenMP does not survive a fork
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    expected = run(mlp_step(model, x))
    got = run(mlp_step(model, x), cswap.offload(config))
    queue.put(all(torch.equal(a, b) for a, b in zip(expected, got)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("plan", ["raw", "zvc"])
def test_a_forked_child_trains_with_the_parents_shared_offloader(mlp, plan):
    """After the parent used it (its compression thread running), a forked child must work or
    fail at once, never hang."""
    model, x = mlp
    config = CSwapConfig(plan=plan, min_bytes=0)
    run(mlp_step(model, x), cswap.offload(config))  # the parent uses it first
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_step, args=(config, queue))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung")
    assert child.exitcode == 0 and queue.get(timeout=5) is True
    cswap.offload(config).close()


class _Stepping(torch.utils.data.Dataset):
    """A dataset whose items are made by a training step under the shared Offloader."""

    def __init__(self, config):
        self.config = config

    def __len__(self):
        return 2

    def __getitem__(self, i):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        with cswap.offload(self.config):
            loss = model(torch.randn(4, 32)).sum()
        loss.backward()
        return cswap.offload(self.config).last_step().offloaded_bytes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_dataloader_workers_forked_after_use_run_steps():
    config = CSwapConfig(plan="zvc", min_bytes=0)
    _Stepping(config)[0]  # the parent's compression thread exists now
    loader = torch.utils.data.DataLoader(_Stepping(config), num_workers=1, timeout=120,
                                         multiprocessing_context="fork")
    assert all(int(b) > 0 for b in loader)
    cswap.offload(config).close()


# Loaded state, and memory pressure ----------------------------------------------------------

def planned_offloader(config, model, x, steps=2):
    from cswap_lightning.planning.profiler import Link

    off = Offloader(config, link=Link(1e6, 1e6, 1e9))  # so slow that shrinking always pays
    for _ in range(steps):
        run(mlp_step(model, x), off)
    return off


def test_the_config_wins_over_a_loaded_lossy_plan():
    torch.manual_seed(0)  # GELU's input is dense: int8 pays (the plan keeps the input, held)
    model, x = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)), torch.randn(16, 32)
    lossy = planned_offloader(CSwapConfig(min_bytes=0, profile_steps=1, lossy="int8", budget=None),
                              model, x)
    state = lossy.state_dict()
    assert "int8" in {d["decision"] for d in state["plan"]["decisions"]}
    lossless = Offloader(CSwapConfig(min_bytes=0, profile_steps=1))  # lossy="off"
    lossless.load_state_dict(state)
    assert_bitwise(run(mlp_step(model, x)), run(mlp_step(model, x), lossless))
    assert "int8" not in {s.decision for s in lossless.last_step().sites}
    lossy.close()
    lossless.close()


@pytest.mark.parametrize("field, value", [("order", 5), ("order", {"a": 1}), ("order", [-1]),
                                          ("order", [True]), ("reverted", "x"), ("version", 2)])
def test_bad_loaded_state_is_refused_at_load_naming_the_field(field, value):
    off = Offloader()
    state = off.state_dict() | {field: value}
    with pytest.raises(ValueError, match=field):
        off.load_state_dict(state)
    assert off.state_dict() == Offloader().state_dict()  # nothing was taken
    off.close()


def test_a_failed_restore_gives_back_the_prefetched_memory_and_tries_again(mlp, monkeypatch):
    model, x = mlp
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    restore, failures = off.transfer.restore, []

    def short_of_memory(stored):
        if len(failures) < 1:
            failures.append(stored)
            raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")
        return restore(stored)

    monkeypatch.setattr(off.transfer, "restore", short_of_memory)
    assert_bitwise(run(mlp_step(model, x)), run(mlp_step(model, x), off))
    assert failures  # it failed once, and backward went on
    off.close()


def test_a_restore_that_keeps_failing_says_what_and_how_to_fix_it(mlp, monkeypatch):
    model, x = mlp
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))

    def never(stored):
        raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")

    monkeypatch.setattr(off.transfer, "restore", never)
    with pytest.raises(RuntimeError, match="cswap could not bring back saved tensor .* "
                       "intact in host memory; lower CSwapConfig.prefetch_bytes"):
        run(mlp_step(model, x), off)
    off.close()


def test_host_memory_held_between_steps_is_reported_and_none_on_the_cpu(mlp, monkeypatch):
    """On the CPU no arena is kept between steps (it saves pinning, which the CPU does not
    need); where there is one, its size is in every step's statistics."""
    model, x = mlp
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    for _ in range(3):
        run(mlp_step(model, x), off)
    assert off.last_step().host_held_bytes == 0
    off.close()
    from cswap_lightning.core.transfer import Transfer

    monkeypatch.setattr(Transfer, "arena_everywhere", True)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    for _ in range(3):
        run(mlp_step(model, x), off)
    step = off.last_step()
    assert 0 < step.host_held_bytes <= 2 * step.stored_bytes
    assert "host memory held between steps" in step.table()
    off.close()


def test_a_tensor_saved_by_two_threads_at_once_keeps_its_version():
    """Making the engine's version probe must not touch the tensor's version counter: another
    thread saving the same tensor at that moment would record a version that never was, and
    its backward would fail with PyTorch's in-place error."""
    torch.manual_seed(0)
    h = torch.randn(256, 256, requires_grad=True).relu()  # shared, not a leaf: it is probed
    errors = []
    barrier = threading.Barrier(2)

    def train(seed):
        try:
            w = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed),
                            requires_grad=True)
            off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
            barrier.wait()
            for _ in range(200):
                with off:
                    loss = (h * w).sum()
                torch.autograd.grad(loss, [w])
            off.close()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as Python can: make races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_making_a_version_probe_runs_no_in_place_op_on_the_tensor():
    """The deterministic side of the test above: an in-place op (``set_`` on a view sharing
    the counter) bumps the counter, however briefly; the probe must be made without one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cswap_lightning.core.tensors import version_probe

    class InPlaceOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.endswith("_") or "set_" in func._schema.name:
                self.seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    t = torch.randn(64, requires_grad=True).relu()
    with InPlaceOps() as mode:
        probe = version_probe(t.detach())
    assert mode.seen == [] and probe._version == t._version and probe.numel() == 0
    with torch.no_grad():
        t.add_(1)
    assert probe._version == t._version  # it still shares the counter
