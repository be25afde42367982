"""The new callbacks in real combinations (issue 33): EarlyStopper, DivergenceGuard and Curriculum
(with DataLoaderTuning after it) with Lightning's ModelCheckpoint, OnExceptionCheckpoint and an
LR scheduler, on 2 CPU processes under DDP and FullyShardedStrategy: one launch
(tests/_combinations.py), two fits per strategy (a fault at step 7, then a resume from the
exception's checkpoint)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import once_per_session, subprocess_timeout

HERE = Path(__file__).parent
STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One 2-process launch for both strategies, once per session (under pytest-xdist too: both
    parametrized tests would otherwise each start one on their worker)."""
    result = once_per_session(tmp_path_factory, "combinations", _launch)
    assert result["returncode"] == 0, result["stderr"]
    return result["ranks"]


def _launch(out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "_combinations.py"), ",".join(STRATEGIES), str(out)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=subprocess_timeout(900),
    )
    if proc.returncode != 0:
        return {"returncode": proc.returncode, "stderr": proc.stderr[-4000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {"returncode": 0, "stderr": "", "ranks": ranks}


@pytest.mark.slow
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
