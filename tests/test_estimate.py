"""The memory estimate (fake tensors) against the same steps tracked on real CPU tensors."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import tiny_model
from lightning_efficient.measure import CATEGORIES, MemoryEstimate, estimate_memory, measure_step


def _batch(b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, t), generator=g)
    return x, torch.roll(x, -1, 1)


def _close(est: MemoryEstimate, real: MemoryEstimate, rel: float = 0.05) -> None:
    assert abs(est.peak_bytes - real.peak_bytes) <= rel * real.peak_bytes, (str(est), str(real))


def test_tinygpt_fp32_adamw_matches_real_steps() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = estimate_memory(model, _batch())
    # the model is restored untouched (real tensors, same values, tied weights still tied)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.head.weight is model.tok_emb.weight
    assert set(est.by_category) == set(CATEGORIES)
    assert sum(est.by_category.values()) == est.peak_bytes
    n_params = sum(p.numel() for p in model.parameters()) * 4
    assert est.by_category["parameters"] >= n_params
    assert est.by_category["optimizer_state"] == pytest.approx(2 * n_params, rel=0.01)
    real = measure_step(copy.deepcopy(model), _batch())
    _close(est, real, 0.01)
    assert est.peak_phase == real.peak_phase
