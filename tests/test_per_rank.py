"""The per-rank estimate: pure functions against an analytic count, and the estimate of a tiny
model under each sharding."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from lightning_efficient.measure.estimate import estimate_memory
from lightning_efficient.measure.per_rank import (
    SHARDINGS,
    buffer_bytes,
    largest_block_bytes,
    parameter_bytes,
    per_rank_estimate,
    shard_factors,
    world_size_of,
)
from lightning_efficient.measure.types import MemoryEstimate

P, OPT, A, T, B = (
    1000,
    2000,
    5000,
    300,
    100,
)  # params (= grads), optimizer, activations, temps, block


def _one_device() -> MemoryEstimate:
    by = {
        "parameters": P,
        "gradients": P,
        "optimizer_state": OPT,
        "activations": A,
        "temporaries": T,
    }
    return MemoryEstimate(sum(by.values()), by, "backward", {"backward": sum(by.values())})


@pytest.mark.parametrize(
    "sharding,expected",
    [
        # parameters, gradients, optimizer state of one of 4 ranks, buffers included
        ("ddp", (P, P + P, OPT)),
        ("zero1", (P, P + B, OPT / 4)),
        ("zero2", (P, P / 4 + B, OPT / 4)),
        ("zero3", (P / 4 + 2 * B, P / 4 + B, OPT / 4)),
        ("full", (P / 4 + 2 * B, P / 4 + B, OPT / 4)),
        ("grad_op", (P, P / 4 + B, OPT / 4)),  # P/4 shard + 3P/4 kept gathered
    ],
)
def test_one_rank_of_four_analytic(sharding: str, expected: tuple) -> None:
    est = per_rank_estimate(
        _one_device(), world_size=4, sharding=sharding, param_bytes=P, block_bytes=B
    )
    got = tuple(est.by_category[c] for c in ("parameters", "gradients", "optimizer_state"))
    assert got == tuple(int(x) for x in expected)
    assert est.by_category["activations"] == A and est.by_category["temporaries"] == T
    assert est.peak_bytes == sum(est.by_category.values())
    assert sharding in est.notes[-1]


def test_one_rank_is_the_device() -> None:
    for sharding in SHARDINGS:
        est = per_rank_estimate(
            _one_device(), world_size=1, sharding=sharding, param_bytes=P, block_bytes=B
        )
        assert est.peak_bytes == _one_device().peak_bytes
    assert shard_factors("full", 8)["parameters"] == 1 / 8
    assert buffer_bytes("ddp", 1, param_bytes=P, grad_bytes=P, block_bytes=B)["gradients"] == 0


def test_bad_input_named() -> None:
    with pytest.raises(ValueError, match="sharding"):
        shard_factors("hybrid", 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_factors("ddp", 0)
    with pytest.raises(ValueError, match="num_nodes"):
        world_size_of(2, 0)
    assert world_size_of(4, 2) == 8
    with pytest.raises(ValueError, match="sharding"):
        estimate_memory(tiny_model(), (torch.zeros(2, 8, dtype=torch.long),) * 2, sharding="x")


def test_estimate_of_a_model_per_rank() -> None:
    model = tiny_model()
    batch = (torch.zeros(4, 32, dtype=torch.long),) * 2
    whole = 4 * sum(p.numel() for p in model.parameters())
    assert parameter_bytes(model) == whole
    block = largest_block_bytes(model)
    assert block == 4 * sum(p.numel() for p in model.blocks[0].parameters())
    one = estimate_memory(model, batch, optimizer="adamw")
    results = {
        s: estimate_memory(model, batch, optimizer="adamw", world_size=2, sharding=s)
        for s in ("ddp", "full", "zero2")
    }
    # DDP adds its gradient buckets; sharding divides the optimizer state
    assert results["ddp"].peak_bytes > one.peak_bytes
    assert results["full"].by_category["optimizer_state"] == pytest.approx(
        one.by_category["optimizer_state"] / 2, abs=1
    )
    assert max(results["full"].peak_bytes, results["zero2"].peak_bytes) < results["ddp"].peak_bytes
    assert results["full"].by_category["activations"] == one.by_category["activations"]


def test_estimate_command_per_rank(capsys) -> None:
    import re
    from pathlib import Path

    from lightning_efficient.cli import main

    demo = str(Path(__file__).parents[1] / "configs" / "demo_plain.yaml")
    peaks = {}
    for flags in (
        [],
        ["--devices", "4", "--sharding", "full"],
        ["--devices", "2", "--num-nodes", "2", "--sharding", "zero2"],
    ):
        assert main(["estimate", "--config", demo, "--batch-size", "2", "--markdown", *flags]) == 0
        out = capsys.readouterr().out
        peaks[" ".join(flags)] = re.search(r"\*\*peak \(\w+\)\*\* \| \*\*([0-9.]+ \w+)\*\*", out)[1]
        if flags:
            assert f"one rank of 4 ({flags[-1]})" in out
    assert len(set(peaks.values())) == 3  # each strategy divides the state differently
    with pytest.raises(SystemExit):
        main(["estimate", "--config", demo, "--sharding", "hybrid"])
