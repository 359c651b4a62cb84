"""The metrics give exact values from known step statistics, aggregate as ratios of sums, and
compute without reading anything back to the host."""

from __future__ import annotations

import math

import pytest
import torch

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.integrations.metrics import (
    memory_timeline,
    offload_metrics,
    run_summary,
    step_values,
    undefined,
    write_summary,
)
from cswap_lightning.metrics import CompressionRatio, ReconstructionError
from cswap_lightning.records import SiteStats, StepStats

MiB = 1 << 20


def step(index: int, sites: list[tuple[str, int, int, float]]) -> StepStats:
    """A step whose sites are (decision, nbytes, stored_bytes, wait_s), packed in order and
    unpacked in reverse, as backward does."""
    stats = StepStats(index)
    n = len(sites)
    for i, (decision, nbytes, stored, wait) in enumerate(sites):
        site = SiteStats(i, (nbytes // 4,), "float32", nbytes, decision, stored_bytes=stored,
                         wait_s=wait, packed_at=i)
        site.unpacked_at = None if decision == "keep" else 2 * n - 1 - i
        stats.sites.append(site)
    return stats


FIRST = step(0, [("zvc", 4 * MiB, 1 * MiB, 0.25), ("raw", 2 * MiB, 2 * MiB, 0.5),
                 ("keep", 8 * MiB, 0, 0.0)])
SECOND = step(1, [("rle", 6 * MiB, 3 * MiB, 0.125), ("keep", 1 * MiB, 0, 0.0)])
FIRST.peak_resident_bytes, SECOND.peak_resident_bytes = 9 * MiB, 4 * MiB
FIRST.keep_all_bytes, SECOND.keep_all_bytes = 14 * MiB, 7 * MiB


def test_step_and_running_values_are_exact():
    metrics = offload_metrics()
    first = metrics(**step_values(FIRST))
    assert first["cswap/offloaded_bytes"].item() == 6 * MiB
    assert first["cswap/ratio"].item() == 2.0  # 6 MiB held as 3 MiB
    assert first["cswap/wait_s"].item() == 0.75
    assert first["cswap/keep_all_bytes"].item() == 14 * MiB
    assert first["cswap/peak_percent"].item() == 100 * 9 / 14
    second = metrics(**step_values(SECOND))
    assert second["cswap/ratio"].item() == 2.0
    assert second["cswap/peak_percent"].item() == 100 * 4 / 7
    total = metrics.compute()  # per step, as the step values read: not sums over steps
    assert total["cswap/offloaded_bytes"].item() == 6 * MiB  # (6 + 6) / 2 steps
    assert total["cswap/ratio"].item() == 2.0  # (6 + 6) / (3 + 3): a ratio of sums
    assert total["cswap/wait_s"].item() == 0.4375  # (0.75 + 0.125) / 2
    assert second["cswap/peak_resident_bytes"].item() == 4 * MiB  # this step's
    assert total["cswap/peak_resident_bytes"].item() == 9 * MiB  # the highest seen
    assert total["cswap/keep_all_bytes"].item() == 14 * MiB
    assert total["cswap/peak_percent"].item() == 100 * 9 / 14  # of the highest of each
    metrics.reset()
    assert metrics.compute()["cswap/offloaded_bytes"].item() == 0


def test_what_keeping_everything_holds_comes_from_the_step_that_measured_the_peak():
    untracked = StepStats(5, untracked_tensors=3, untracked_bytes=MiB, peak_resident_bytes=9 * MiB)
    values = step_values(untracked, FIRST)  # FIRST checked the plan untracked runs
    assert (values["peak_resident_bytes"], values["keep_all_bytes"]) == (9 * MiB, 14 * MiB)


def test_ratio_is_of_sums_not_a_mean_of_ratios():
    ratio = CompressionRatio()
    ratio.update(offloaded_bytes=8, stored_bytes=1)  # 8x
    ratio.update(offloaded_bytes=2, stored_bytes=2)  # 1x
    assert ratio.compute().item() == 10 / 3


def test_ratio_is_undefined_until_something_was_offloaded_and_then_not_logged():
    metrics = offload_metrics()
    values = step_values(step(0, [("keep", 64, 0, 0.0)]))
    metrics.update(**values)
    assert math.isnan(metrics.compute()["cswap/ratio"].item())  # was logged as 0.0
    assert undefined(values) == {"ratio", "peak_percent"}  # and nothing was measured
    assert undefined(step_values(FIRST)) == set()


def test_reconstruction_error_is_pooled_relative_l2():
    error = ReconstructionError()
    original = torch.tensor([3.0, 4.0])  # norm 5
    error.update(original, original)
    assert error.compute().item() == 0.0  # lossless
    error.update(torch.tensor([0.0, 0.0, 12.0]), torch.tensor([0.0, 0.0, 7.0]))  # error 5, norm 12
    assert error.compute().item() == pytest.approx((25 / (25 + 144)) ** 0.5, rel=1e-15)
    with pytest.raises(ValueError, match=r"original \[2\] and decoded \[3\]"):
        error.update(original, torch.zeros(3))


def test_compute_stays_on_the_device_without_a_process_group():
    assert not torch.distributed.is_initialized()
    metrics = offload_metrics()
    metrics.update(**step_values(FIRST))
    for name, value in metrics.compute().items():
        assert isinstance(value, torch.Tensor) and value.dtype == torch.float64, name
    error = ReconstructionError()
    error.update(torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    assert error.compute().item() == 1.0


@pytest.mark.gpu
def test_update_and_compute_never_synchronize_on_cuda():
    # With a process group, compute() gathers every rank's states (the sum across ranks, by
    # design), which synchronises; a group an earlier test left behind would do the same.
    assert not torch.distributed.is_initialized()
    metrics = offload_metrics().to("cuda")
    error = ReconstructionError().to("cuda")
    x = torch.randn(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # a host synchronisation raises in this mode
        metrics.update(**step_values(FIRST))
        values = metrics.compute()
        error.update(x, x.half().float())
        relative = error.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert values["cswap/ratio"].item() == 2.0  # 6 MiB offloaded, held as 3 MiB
    assert 0 < relative.item() < 1e-3  # float16 keeps 11 bits: about 3e-4 relative


def test_memory_timeline_draws_the_measured_residency_over_time():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    off = Offloader(CSwapConfig(plan="raw", min_bytes=0))
    with off:
        loss = model(torch.randn(32, 64)).sum()
    loss.backward()
    del loss
    stats = off.last_step()
    (curve, peak, keep_all), = [figure.axes[0].get_lines()
                                for figure in [memory_timeline(stats)]]
    assert list(curve.get_ydata()) == [b / 2**20 for b in stats.timeline_bytes]
    assert list(curve.get_xdata()) == [1e3 * t for t in stats.timeline_s]
    assert sorted(curve.get_xdata()) == list(curve.get_xdata())  # a time axis
    assert max(stats.timeline_bytes) == stats.peak_resident_bytes > 0
    assert stats.timeline_bytes[-1] == 0  # backward freed everything it brought back
    assert set(peak.get_ydata()) == {stats.peak_resident_bytes / 2**20}
    assert set(keep_all.get_ydata()) == {stats.keep_all_bytes / 2**20}  # the baseline
    off.close()


def test_a_step_that_was_only_counted_says_so_instead_of_drawing_a_curve():
    stats = StepStats(7, untracked_tensors=12, untracked_bytes=3 * MiB)
    figure = memory_timeline(stats)
    assert figure.axes[0].get_lines() == []
    assert "12 saved tensors (3.0 MiB) kept or moved as the plan says" in figure.axes[0].get_title()
    assert "not tracked one by one: 12 saved tensors (3.0 MiB, each tensor's own bytes)" in (
        stats.table())
    assert stats.saved_bytes == stats.kept_bytes == 3 * MiB and stats.offloaded_bytes == 0


def test_summary_files_and_line_name_the_step_as_the_trainer_does(tmp_path):
    table, plot = write_summary(SECOND, tmp_path / "run", "global step 8")
    text = table.read_text()
    assert "rle" in text and "global step 8: autograd saved 2 tensors" in text
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "during global step 8" in memory_timeline(SECOND, "global step 8").axes[0].get_title()
    said = run_summary(SECOND, "global step 8", table, plot).splitlines()
    assert said[0] == "cswap: " + SECOND.summary("global step 8")[0]
    assert said[1:-1] == ["  " + line for line in SECOND.summary("global step 8")[1:]]
    assert said[-1] == f"  per-site summary in {table}, memory timeline in {plot}"
    assert ("  saved tensors resident at once: 4.0 MiB at the peak (measured), 57% of the 7.0 "
            "MiB that keeping them all holds (3.0 MiB less)") in said
    assert ("  moved out to host memory: 6.0 MiB, held there as 3.0 MiB (2.00x smaller: rle 6.0 "
            "MiB as 3.0 MiB); activations kept in place: 1.0 MiB") in said
