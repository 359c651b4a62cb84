"""The prefetch window: as small as hiding the link allows, so that offloading everything
lowers the peak on models smaller than any fixed window."""

import math

import pytest
import torch

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.planning.prefetch import lookahead_bytes, resident_window

MiB = 1 << 20


def test_without_a_link_to_hide_the_window_is_two_of_the_largest():
    moved = {0: 4 * MiB, 1: 2 * MiB, 2: 4 * MiB, 3: 4 * MiB, 4: 3 * MiB, 5: 4 * MiB}
    assert lookahead_bytes([5, 4, 3, 2, 1, 0], moved, dict.fromkeys(moved, 1.0),
                           math.inf) == 8 * MiB
    assert lookahead_bytes([], {}, {}, 1e9) == 0


def test_a_slow_link_needs_what_backward_uses_meanwhile_back_first():
    """Each 4 MiB site takes 4 ms on a 1 GB/s-ish link; backward spends 1 ms before each use,
    so a restore starts four uses ahead: those four are back (or coming) at once."""
    order = list(range(11, -1, -1))
    moved = {site: 4 * MiB for site in order}
    backward_s = {site: 1e-3 for site in order}
    window = lookahead_bytes(order, moved, backward_s, h2d=4 * MiB / 4e-3)
    assert window == 5 * 4 * MiB  # itself and the four used during its restore
    # kept sites in between count for their compute, not their bytes
    kept_between = [9, 100, 8, 101, 7, 102, 6, 103, 5, 104, 4, 105, 3]
    window = lookahead_bytes(kept_between, {s: 4 * MiB for s in range(3, 10)},
                             dict.fromkeys(kept_between, 1e-3), h2d=4 * MiB / 4e-3)
    assert window == 3 * 4 * MiB


# A language model's logits (GPT-2's 50257 words, batch 8 x 128, float32: 196 MiB) against
# its layers' tensors (4 layers of 256: 36 of at most 4 MiB), used first in backward.
LOGITS = 8 * 128 * 50257 * 4
LAYERS = [4 * MiB] * 24 + [MiB] * 12


def test_the_largest_tensor_comes_back_alone():
    """Two of the largest were the window: twice the logits, more than everything moved."""
    moved = {0: LOGITS} | {k + 1: n for k, n in enumerate(LAYERS)}
    order = list(moved)
    assert resident_window(list(moved.values())) == 8 * MiB
    assert lookahead_bytes(order, moved, dict.fromkeys(order, 1e-3), math.inf) == 8 * MiB
    # On a link slow enough that the logits' restore would need all of backward's compute
    # so far, the layers' restores still set the window.
    slow = lookahead_bytes(order, moved, dict.fromkeys(order, 1e-3), h2d=4 * MiB / 2e-3)
    assert slow == 3 * 4 * MiB


def test_the_window_never_holds_more_than_half_of_the_others():
    """A link far slower than backward's compute would bring everything back at once."""
    order = list(range(11, -1, -1))
    moved = {site: 4 * MiB for site in order}
    window = lookahead_bytes(order, moved, dict.fromkeys(order, 1e-3), h2d=1e6)
    assert window == 11 * 4 * MiB // 2  # the largest (one of them) comes back alone
    assert resident_window([4 * MiB, 2 * MiB, 4 * MiB]) == 3 * MiB  # of 2 and 4 MiB


def peak(model: torch.nn.Module, ids: torch.Tensor, config: CSwapConfig) -> tuple[int, int]:
    """The measured peak of the saved tensors after three steps under ``config`` (on the
    CPU, the engine's ledger), and the bytes moved."""
    off = Offloader(config)
    for _ in range(3):
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    stats = off.tracked_step()
    off.close()
    return stats.peak_resident_bytes, stats.offloaded_bytes


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

    keep, _ = peak(model, ids, CSwapConfig(plan="keep"))
    fixed, moved = peak(model, ids, CSwapConfig(budget=None, prefetch_bytes=512 * MiB))
    auto, moved_auto = peak(model, ids, CSwapConfig(budget=None))
    assert moved == moved_auto > 0.8 * keep
    assert fixed >= 0.95 * keep  # everything back at once: nothing saved at the peak
    assert auto <= 0.25 * keep, (auto, keep)


@pytest.mark.slow
def test_offloading_everything_lowers_the_peak_of_a_model_with_a_large_vocabulary():
    """GPT-2, 4 layers of 256, its 50257-word vocabulary, batch 8 x 128, budget=None: the
    window was two of the largest moved tensors, twice the logits (196 MiB), more than all
    343 MiB moved; backward brought everything back at once and the measured peak was
    keeping everything's. Now the logits come back alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=50257,
                                     n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50257, (8, 128), generator=torch.Generator().manual_seed(0))
    keep, _ = peak(model, ids, CSwapConfig(plan="keep"))
    auto, moved = peak(model, ids, CSwapConfig(budget=None))
    assert moved > 0.95 * keep
    assert auto <= 0.6 * keep, (auto, keep)
