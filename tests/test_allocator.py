"""The allocator's counters read cheaply are the ones torch.cuda reads."""

from __future__ import annotations

import pytest
import torch

from cswap_lightning.allocator import allocated_bytes, peak_allocated_bytes
from cswap_lightning.commands.bench_overhead import allocator_reads


def test_without_cuda_in_use_nothing_is_allocated_and_nothing_is_timed():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert allocated_bytes() == peak_allocated_bytes() == 0
    assert allocator_reads(torch.device("cpu")) == {}


@pytest.mark.gpu
def test_on_cuda_the_counters_are_torchs():
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    gone = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    del gone
    assert allocated_bytes(device) == torch.cuda.memory_allocated(device)
    assert peak_allocated_bytes(device) == torch.cuda.max_memory_allocated(device)
    assert peak_allocated_bytes(device) >= allocated_bytes(device) + (32 << 20)
    reads = allocator_reads(device, calls=20)
    assert set(reads) == {"torch.cuda.memory_allocated", "allocator.allocated_bytes"}
    assert all(us > 0 for us in reads.values())
    del held
