"""The per-rank estimate: pure functions against an analytic count, and the estimate of a tiny
model under each sharding."""

from __future__ import annotations

import pytest
import torch

from benchmarks.workloads import tiny_model
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.per_rank import (
    SHARDINGS,
    buffer_bytes,
    fsdp_whole_gradients,
    largest_block_bytes,
    parameter_bytes,
    per_rank_estimate,
    per_rank_phase,
    root_parameter_bytes,
    shard_factors,
    world_size_of,
)
from lightning_efficient.measure.memory.types import MemoryEstimate

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
        # FSDP2 at the end of backward (every gradient there, every block finished): the last
        # block gathered, its reduce-scatter input kept (the moments before: below)
        ("full", (P / 4 + B, P / 4 + B, OPT / 4)),
        ("grad_op", (P / 4 + B, P / 4 + B, OPT / 4)),
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


# FSDP2 by moment: a root of R (head gradients H come first) and 4 blocks of B2
R, B2, H = 200, 100, 50
P2 = R + 4 * B2
FSDP = dict(world_size=4, param_bytes=P2, block_bytes=B2, root_bytes=R, head_grad_bytes=H)


def _moment(grads: int) -> dict[str, int]:
    return {
        "parameters": P2,
        "gradients": grads,
        "optimizer_state": 2 * P2,
        "activations": A,
        "temporaries": T,
    }


def test_fsdp_gradients_whole_and_finished() -> None:
    # the head's gradients, then the last block finished, 30 bytes of the next one
    assert fsdp_whole_gradients(H + B2 + 30, block_bytes=B2, root_bytes=R, head_grad_bytes=H) == (
        H + 30,
        B2,
    )
    assert fsdp_whole_gradients(H, block_bytes=B2, root_bytes=R, head_grad_bytes=H) == (H, 0)
    # no first level known: the root's gradients are taken as the head's
    assert fsdp_whole_gradients(R + 10, block_bytes=B2, root_bytes=R) == (R + 10, 0)


@pytest.mark.parametrize(
    "grads,gathered,grad_bytes",
    [
        (0, R, 0),  # the head's backward: the root only
        (H + 30, R + 2 * B2, 20 + 60),  # last block: + the prefetched next one; all whole
        # one block finished: its gradients 1/4, its reduce-scatter input B2 kept
        (H + B2 + 30, R + 2 * B2, 45 + (80 - 20) + B2),
        (H + 3 * B2 + 10, R + B2, 90 + (60 - 15) + B2),  # the first block: nothing to prefetch
    ],
)
def test_fsdp_full_shard_backward_moments(grads: int, gathered: int, grad_bytes: int) -> None:
    got = per_rank_phase(_moment(grads), "backward", sharding="full", **FSDP)
    assert got["parameters"] == P2 / 4 + gathered
    assert got["gradients"] == grad_bytes
    assert got["optimizer_state"] == 2 * P2 / 4
    assert (got["activations"], got["temporaries"]) == (A, T)


def test_fsdp_shard_grad_op_and_other_phases() -> None:
    # grad_op: every block gathered until its backward ends
    got = per_rank_phase(_moment(H + B2 + 30), "backward", sharding="grad_op", **FSDP)
    assert got["parameters"] == P2 / 4 + P2 - B2
    fwd = {"full": R + B2, "grad_op": P2}
    for sharding, gathered in fwd.items():
        got = per_rank_phase(_moment(P2), "forward", sharding=sharding, **FSDP)
        assert got["parameters"] == P2 / 4 + gathered
        assert got["gradients"] == P2 / 4  # the last step's, sharded
        step = per_rank_phase(_moment(P2), "optimizer", sharding=sharding, **FSDP)
        assert step["parameters"] == P2 / 4 and step["temporaries"] == T / 4


def test_the_rank_peak_is_the_largest_moment() -> None:
    """Dividing finished gradients moves the rank's peak to an earlier moment of backward."""
    early = {**_moment(0), "temporaries": 1400}
    late = {**_moment(P2), "temporaries": 850}
    one = MemoryEstimate(
        sum(late.values()),
        late,
        "backward",
        {"backward": sum(late.values())},
        phase_by_category={"backward": late},
        backward_levels=[early, {**_moment(H), "temporaries": 100}, late],
    )
    assert sum(early.values()) < one.peak_bytes
    est = per_rank_estimate(
        one, world_size=4, sharding="full", param_bytes=P2, block_bytes=B2, root_bytes=R
    )
    assert est.by_category["temporaries"] == 1400 and est.by_category["gradients"] == 0
    assert est.peak_phase == "backward" and "peak in backward" in est.notes[-1]
    assert est.peak_bytes == sum(est.by_category.values()) < one.peak_bytes


def test_tracker_follows_storage_resizes() -> None:
    """FSDP2 frees gathered parameters with ``untyped_storage().resize_(0)``, no operation a
    dispatch mode sees: the tracker hears of it while active, and puts the method back."""
    from lightning_efficient.measure.memory.track import StorageTracker

    tracker = StorageTracker(fake=False)
    with tracker:
        gathered = torch.ones(1000)  # 4000 bytes
        gathered.untyped_storage().resize_(0)  # freed
        other = torch.ones(1000) * 2  # peak without the resize: 12000
        gathered.untyped_storage().resize_(4000)  # again
        del other
    result = tracker.summary()
    assert result.peak_bytes == 8000
    assert "resize_" not in vars(torch.UntypedStorage)


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
    assert root_parameter_bytes(model) == whole - 2 * block  # embeddings and the final norm
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
    # activations are not divided: those of the one-device moment the rank's peak is at
    moments = [*one.backward_levels, *one.phase_by_category.values()]
    assert results["full"].by_category["activations"] in {m["activations"] for m in moments}


def test_estimate_command_per_rank(capsys) -> None:
    import re
    from pathlib import Path

    from lightning_efficient.commands import main

    demo = str(Path(__file__).parents[3] / "configs" / "demo_plain.yaml")
    peaks = {}
    for flags in (
        [],
        ["--devices", "4", "--sharding", "full"],
        ["--devices", "2", "--num-nodes", "2", "--sharding", "zero2"],
    ):
        # one block of the demo's model: the division per rank is the subject, not the depth
        args = ["--batch-size", "2", "--markdown", "--model.init_args.n_layer=1", *flags]
        assert main(["estimate", "--config", demo, *args]) == 0
        out = capsys.readouterr().out
        peaks[" ".join(flags)] = re.search(r"\*\*peak \(\w+\)\*\* \| \*\*([0-9.]+ \w+)\*\*", out)[1]
        if flags:
            assert f"one rank of 4 ({flags[-1]})" in out
    assert len(set(peaks.values())) == 3  # each strategy divides the state differently
    with pytest.raises(SystemExit):
        main(["estimate", "--config", demo, "--sharding", "hybrid"])
