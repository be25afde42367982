"""The new callbacks in real combinations (issue 33): EarlyStopper, DivergenceGuard and Curriculum
(with DataLoaderTuning after it) with Lightning's ModelCheckpoint, OnExceptionCheckpoint and an
LR scheduler, on 2 CPU processes under DDP and FullyShardedStrategy
(tests/multiprocess/ddp_combinations.py, in the session's one 2-process launch), two fits per
strategy (a fault at step 7, then a resume from the exception's checkpoint)."""

from __future__ import annotations

import json

import pytest

STRATEGIES = ("ddp", "fsdp")


@pytest.fixture
def ranks(ddp_case) -> list[dict]:
    """Both strategies' fits, in the session's 2-process launch
    (tests/multiprocess/ddp_combinations.py)."""
    return [json.loads((ddp_case / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.ddp_case("combinations")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_fault_then_a_resume_with_checkpoints_and_a_scheduler(ranks, strategy) -> None:
    r0, r1 = (r[strategy] for r in ranks)
    measured = ("tuning", "workers")  # each rank times its own loading and steps
    assert r0["a"] == r1["a"] and {k: v for k, v in r0["b"].items() if k not in measured} == {
        k: v for k, v in r1["b"].items() if k not in measured
    }  # every rank took the same decisions and saw the same weights
    a, b = r0["a"], r0["b"]
    # fit A: the NaN of step 3 was rolled back; the cooldown left StepLR's schedule alone
    assert a["trips"] == [3] and a["lrs_as_scheduled"] and len(a["lrs"]) == 7
    # the fault at step 7: OnExceptionCheckpoint holds the weights training reached (not the
    # best ones the stopper put back), with its step and optimizer state (5 Adam steps: the
    # NaN step was dropped and the rollback went back to step 2's state)
    assert a["fault"] == "a fault at step 7"
    assert a["ckpt_step"] == 7 and a["ckpt_adam_step"] == 5 and a["ckpt_holds_trained"]
    # ... and the module holds the best weights, read from ModelCheckpoint's best file (under
    # FSDP too: the strategy's load_checkpoint is not used for it)
    assert a["module_is_best"] and a["restored_from"].endswith(".ckpt")
    # fit B resumed from that checkpoint: same schedule, the guard's trips kept, the
    # curriculum continued, the best weights back at the end
    assert b["global_step"] == 12 and b["trips"] == [3] and b["lrs_as_scheduled"]
    assert b["sampler"] == "CurriculumSampler" and b["curriculum_batches"] == 12
    assert b["module_is_best"] and b["restored_from"]
    assert b["best_step"] >= a["best_step"]
    # DataLoaderTuning measured the workers from the fits' own steps: no extra training_step
    assert a["calls"] == 7 and b["calls"] == 5
    assert b["loader"] == "TunedInFit" and b["workers"] == b["tuning"]["num_workers"]
    assert b["tuning"]["step_rate_bound"] > 0
