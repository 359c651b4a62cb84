"""Measured residency of saved tensors."""

import gc

import pytest
from conftest import grads, model_and_batch, wide_mlp
from torch import nn

from cswap_lightning import CSwapConfig, Offloader

MiB = 1 << 20


def peak(plan: str, prefetch_bytes: int, steps: int = 2) -> int:
    model, x = wide_mlp(nn.ReLU)
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0, prefetch_bytes=prefetch_bytes))
    for _ in range(steps):
        with off:
            loss = model(x).sum()
        loss.backward()
        del loss
    stats = off.last_step()
    off.close()
    return stats.peak_resident_bytes


@pytest.mark.slow
def test_offloading_lowers_the_measured_peak_by_what_the_prefetch_window_allows():
    keep = peak("keep", 4 * MiB)
    # Keep: the input and the outputs of all 8 ReLUs (the Linear inputs) are on the device.
    assert keep == 9 * 2 * MiB
    # Raw, 4 MiB prefetch: the input (held by the loop), the tensor in use and two ahead.
    assert peak("raw", 4 * MiB) == 4 * 2 * MiB <= keep * 0.45
    # Without prefetching, only the input and what forward or backward is using right now.
    assert peak("raw", 0) <= 3 * 2 * MiB


def test_the_timeline_rises_in_forward_and_returns_to_zero_after_backward():
    model, x = wide_mlp(nn.ReLU)
    off = Offloader(CSwapConfig(plan="keep", min_bytes=0))
    with off:
        loss = model(x).sum()
    forward = off.last_step(device=False)
    assert forward.timeline_bytes[-1] == forward.peak_resident_bytes == 18 * MiB
    loss.backward()
    del loss
    gc.collect()
    stats = off.last_step()
    assert stats.timeline_bytes[-1] == 2 * MiB  # only the input, which this test holds
    assert list(stats.timeline_s) == sorted(stats.timeline_s)
    off.close()


def test_the_table_and_dict_show_the_measured_peak():
    model, x = wide_mlp(nn.ReLU)
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    with off:
        loss = model(x).sum()
    loss.backward()
    stats = off.last_step()
    assert (f"saved tensors resident at once: {stats.peak_resident_bytes / MiB:.1f} MiB at the "
            f"peak (measured), {100 * stats.peak_share:.0f}% of the 18.0 MiB that keeping them "
            "all holds") in stats.table()
    assert stats.as_dict()["peak_resident_bytes"] == stats.peak_resident_bytes > 0
    off.close()


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_what_keeping_everything_holds_is_the_peak_a_step_that_moves_nothing_measures(name):
    """``keep_all_bytes``, the storages a step's saved tensors live in summed once each, is the
    measured peak of the same step keeping everything: the baseline of every peak."""
    model, x, y = model_and_batch(name)
    steps = {}
    for plan in ("keep", "raw"):
        off = Offloader(CSwapConfig(plan=plan, min_bytes=0, prefetch_bytes=0))
        grads(model, x, y, off)
        steps[plan] = off.last_step()
        off.close()
    keep, raw = steps["keep"], steps["raw"]
    assert keep.peak_resident_bytes == keep.keep_all_bytes == raw.keep_all_bytes > 0
    assert raw.peak_resident_bytes < raw.keep_all_bytes and raw.peak_share < 1
    assert keep.peak_share == 1.0


def test_the_summary_says_activations_apart_from_weights_and_counts_each_storage_once():
    """A storage several saved tensors view counts once, and weights apart: the wide MLP
    saves 23 tensors, 16 views of its input and of its 8 ReLU outputs (9 storages of 2 MiB:
    each ReLU output is saved by the ReLU and by the next Linear) and 7 weights of 4 MiB
    (the first Linear's input needs no gradient: its weight is not saved)."""
    model, x = wide_mlp(nn.ReLU)
    off = Offloader(CSwapConfig(plan="keep", min_bytes=0))
    with off:
        loss = model(x).sum()
    loss.backward()
    table = off.last_step().table()
    assert ("step 0: autograd saved 23 tensors: 18.0 MiB of activations (each storage once) "
            "and 28.0 MiB of weights, which stay where they are") in table
    assert ("moved out to host memory: 0 B, held there as 0 B; activations kept in place: "
            "18.0 MiB") in table
    off.close()
