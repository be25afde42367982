"""``measure.memory.peak.PeakMemory``: the peak of a block, measured by the instrument (CPU
here; the CUDA test runs where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from lightning_efficient.measure.memory.peak import PeakMemory


def test_peak_counts_the_given_tensors_and_what_the_block_allocates() -> None:
    model = torch.nn.Linear(256, 256)  # 263,168 bytes of parameters
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakMemory("cpu", model.parameters()) as meter:
        big = torch.ones(1024, 1024)  # 4 MiB, freed before the block ends
        del big
        small = torch.ones(1024)
    assert params + 4 * 2**20 <= meter.peak < params + 5 * 2**20, meter.peak
    assert small.numel() == 1024
    assert meter.reserved is None  # no caching allocator on a CPU


def test_peak_disabled_measures_nothing_and_keeps_the_error() -> None:
    with PeakMemory("cpu", enabled=False) as meter:
        torch.ones(1024)
    assert meter.peak is None and meter.reserved is None
    try:
        with PeakMemory("cpu") as meter:
            torch.ones(256)
            raise KeyError("the block's own error")
    except KeyError:
        pass
    else:  # pragma: no cover
        raise AssertionError("the block's error was swallowed")
    assert meter.peak is not None and meter.peak >= 1024


def test_peak_allocated_on_a_cpu_is_the_peak_with_the_given_tensors() -> None:
    model = torch.nn.Linear(256, 256)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with PeakMemory("cpu", model.parameters()) as meter:
        torch.ones(1024 * 1024)
    assert meter.peak_allocated == meter.peak >= params + 4 * 2**20


@pytest.mark.gpu
def test_peak_on_cuda_is_above_the_start_and_peak_allocated_the_allocators() -> None:
    before = torch.ones(2**20, device="cuda")  # 4 MiB allocated before the block
    with PeakMemory("cuda") as meter:
        block = torch.ones(2**18, device="cuda")  # 1 MiB
        del block
    assert meter.peak is not None and 2**20 <= meter.peak < 2 * 2**20
    assert meter.peak_allocated == torch.cuda.max_memory_allocated() >= 5 * 2**20
    assert meter.reserved is not None and meter.reserved >= meter.peak_allocated
    assert before.numel() == 2**20
