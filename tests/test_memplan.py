"""The host-memory planner: placements are valid, tight, and lifetime-aware."""

import pytest
import torch
from conftest import model_and_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from cswap_lightning import CSwapConfig, Offloader
from cswap_lightning.core.arena import payload_buffers
from cswap_lightning.planning import memplan
from cswap_lightning.planning.memplan import Buffer
from cswap_lightning.recipes.nets import build_cnn


@st.composite
def buffer_sets(draw):
    n = draw(st.integers(0, 40))
    buffers = []
    for key in range(n):
        start = draw(st.integers(0, 60))
        buffers.append(Buffer(key, draw(st.integers(0, 5000)), start,
                              start + draw(st.integers(0, 30))))
    return buffers


@settings(max_examples=300, deadline=None)
@given(buffer_sets(), st.sampled_from([1, 16, 512, 4096]))
def test_no_two_buffers_alive_together_share_bytes(buffers, alignment):
    layout = memplan.plan(buffers, alignment)
    assert set(layout.regions) == {b.key for b in buffers}
    for b in buffers:
        at, size = layout.regions[b.key]
        assert size == b.size and at % alignment == 0
        assert 0 <= at and at + size <= layout.arena_bytes
    for i, a in enumerate(buffers):
        a_at = layout.regions[a.key][0]
        for b in buffers[i + 1 :]:
            b_at = layout.regions[b.key][0]
            if a.lives_with(b) and a.size and b.size:
                assert a_at + a.size <= b_at or b_at + b.size <= a_at, (a, b, layout)
    bound = memplan.lower_bound(buffers)
    assert layout.arena_bytes >= bound
    assert memplan.per_tensor_bytes(buffers) >= bound


def test_lower_bound_and_per_tensor_bytes_of_a_small_case():
    # Ticks 3-5: a and b live (100 + 200); ticks 6-8: b and c (200 + 300).
    buffers = [Buffer(0, 100, 0, 5), Buffer(1, 200, 3, 8), Buffer(2, 300, 6, 9)]
    assert memplan.lower_bound(buffers) == 500
    assert memplan.per_tensor_bytes(buffers) == 256 + 512
    # A buffer ending at tick 5 and one starting at tick 6 are never live together.
    assert memplan.lower_bound([Buffer(0, 100, 0, 5), Buffer(1, 100, 6, 7)]) == 100


def test_buffers_with_disjoint_lifetimes_share_memory():
    layout = memplan.plan([Buffer(0, 1000, 0, 1), Buffer(1, 1000, 2, 3)], alignment=512)
    assert layout.regions == {0: (0, 1000), 1: (0, 1000)}
    assert layout.arena_bytes == 1000
    layout = memplan.plan([Buffer(0, 1000, 0, 2), Buffer(1, 1000, 1, 3)], alignment=512)
    assert layout.regions[1] == (1024, 1000)  # aligned past buffer 0
    assert layout.arena_bytes == 2024


def test_best_fit_takes_the_smallest_gap_that_holds_the_buffer():
    buffers = [
        Buffer(0, 300, 0, 2),  # placed at 0, gone after tick 2
        Buffer(1, 250, 0, 9),  # at 300
        Buffer(2, 200, 0, 2),  # at 550, gone after tick 2
        Buffer(3, 150, 0, 9),  # at 750
        Buffer(4, 100, 5, 9),  # gaps left for it: [0, 300) and [550, 750)
    ]
    layout = memplan.plan(buffers, alignment=1)
    assert [layout.regions[k][0] for k in range(4)] == [0, 300, 550, 750]
    assert layout.regions[4][0] == 550  # first fit would have taken 0
    assert layout.arena_bytes == 900


@pytest.mark.parametrize(
    ("buffers", "alignment", "error"),
    [
        ([Buffer(0, 1, 0, 0)], 3, "power of two"),
        ([Buffer(0, 1, 0, 0), Buffer(0, 2, 0, 0)], 1, "unique"),
    ],
)
def test_bad_input_is_named(buffers, alignment, error):
    with pytest.raises(ValueError, match=error):
        memplan.plan(buffers, alignment)


def test_bad_buffers_are_named():
    with pytest.raises(ValueError, match="size must be >= 0"):
        Buffer(7, -1, 0, 0)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        Buffer(7, 1, 5, 4)


def _demo_step(name, plan):
    if name == "demo":
        torch.manual_seed(0)
        model, x, y = build_cnn(), torch.rand(128, 1, 8, 8), torch.randint(0, 10, (128,))
    else:
        model, x, y = model_and_batch(name)
    off = Offloader(CSwapConfig(plan=plan, min_bytes=0))
    with off:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    step = off.last_step()
    off.close()
    return step


@pytest.mark.parametrize("plan", ["raw", "zvc"])
@pytest.mark.parametrize("name", ["demo", "transformer"])
def test_arena_is_within_ten_percent_of_the_lower_bound_on_real_steps(name, plan):
    buffers = payload_buffers(_demo_step(name, plan))
    assert len(buffers) > 5
    layout = memplan.plan(buffers)
    bound = memplan.lower_bound(buffers)
    assert bound <= layout.arena_bytes <= 1.10 * bound
