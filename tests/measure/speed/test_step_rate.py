"""The model's step rate, estimated from a timed forward pass, changes nothing in the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.workloads import tiny_model
from lightning_efficient.measure.speed.step_rate import STEP_PER_FORWARD, estimated_step_rate


def test_step_rate_leaves_weights_buffers_rng_and_mode_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    batch = torch.randn(32, 8)
    rng = torch.get_rng_state()
    rate = estimated_step_rate(model, batch, repeats=2)
    assert 0 < rate < float("inf")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN stats too
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(p.grad is None for p in model.parameters())


def test_step_rate_of_a_lightning_module_times_its_training_step() -> None:
    model = tiny_model()
    x = torch.randint(0, 256, (4, 32))
    rate = estimated_step_rate(model, (x, x), repeats=2)
    # one step is STEP_PER_FORWARD forwards: the rate is below the forward rate
    assert 0 < rate and STEP_PER_FORWARD == 3.0
    with pytest.raises(ValueError, match="repeats"):
        estimated_step_rate(model, (x, x), repeats=0)
