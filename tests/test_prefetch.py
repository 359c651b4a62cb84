"""The prefetch window: as small as hiding the link allows, so that offloading everything
lowers the peak on models smaller than any fixed window."""

import math

import pytest
import torch

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.planning.prefetch import lookahead_bytes

MiB = 1 << 20


def test_without_a_link_to_hide_the_window_is_two_of_the_largest():
    moved = {0: 4 * MiB, 1: 2 * MiB, 2: 4 * MiB}
    assert lookahead_bytes([2, 1, 0], moved, {0: 1.0, 1: 1.0, 2: 1.0}, math.inf) == 8 * MiB
    assert lookahead_bytes([], {}, {}, 1e9) == 0


def test_a_slow_link_needs_what_backward_uses_meanwhile_back_first():
    """Each 4 MiB site takes 4 ms on a 1 GB/s-ish link; backward spends 1 ms before each use,
    so a restore starts four uses ahead: those four are back (or coming) at once."""
    order = list(range(9, -1, -1))
    moved = {site: 4 * MiB for site in order}
    backward_s = {site: 1e-3 for site in order}
    window = lookahead_bytes(order, moved, backward_s, h2d=4 * MiB / 4e-3)
    assert window == 5 * 4 * MiB  # itself and the four used during its restore
    # kept sites in between count for their compute, not their bytes
    kept_between = [9, 100, 8, 101, 7, 102, 6]
    window = lookahead_bytes(kept_between, {9: 4 * MiB, 8: 4 * MiB, 7: 4 * MiB, 6: 4 * MiB},
                             dict.fromkeys(kept_between, 1e-3), h2d=4 * MiB / 4e-3)
    assert window == 3 * 4 * MiB


@pytest.mark.slow
def test_offloading_everything_lowers_the_peak_of_a_model_smaller_than_a_fixed_window():
    """GPT-2, 4 layers of 256, batch 8 x 128, budget=None: with a fixed 512 MiB window every
    moved tensor came back at the start of backward and the peak was keep-everything's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000,
                                     n_positions=128, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (8, 128))

    def peak(config: CSwapConfig) -> tuple[int, int]:
        off = Offloader(config)
        for _ in range(3):
            with off:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
        stats = off.tracked_step()
        off.close()
        return stats.peak_resident_bytes, stats.offloaded_bytes

    keep, _ = peak(CSwapConfig(plan="keep"))
    fixed, moved = peak(CSwapConfig(budget=None, prefetch_bytes=512 * MiB))
    auto, moved_auto = peak(CSwapConfig(budget=None))
    assert moved == moved_auto > 0.8 * keep
    assert fixed >= 0.95 * keep  # everything back at once: nothing saved at the peak
    assert auto <= 0.25 * keep, (auto, keep)
