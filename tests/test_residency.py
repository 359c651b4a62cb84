"""Measured residency of saved tensors."""

import gc

from conftest import wide_mlp
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
    assert f"peak resident {stats.peak_resident_bytes / MiB:.1f} MiB" in stats.table()
    assert stats.as_dict()["peak_resident_bytes"] == stats.peak_resident_bytes > 0
    off.close()


