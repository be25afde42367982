"""The decisions of EarlyStopper and DivergenceGuard, as functions, without a Trainer."""

from __future__ import annotations

import math

import pytest

from lightning_efficient.techniques.early_stopping.decisions import (
    Budgets,
    check_due,
    guard_summary,
    plateau_tracker,
    snapshot_due,
    stops_now,
    trip_action,
    trip_message,
)


def test_budgets_sum_ranks_stop_and_resume() -> None:
    budgets = Budgets(max_time_s=None, max_tokens=100, max_samples=None)
    budgets.add(4, 30)  # samples, tokens of one local batch
    budgets.add(4, None)  # a batch without tokens counts its samples only
    assert budgets.local(now=0.0) == [30, 8, 0.0]
    assert budgets.spend([60, 16, 0.0], world_size=2) is None  # two ranks' sums
    assert budgets.pending == [0, 0] and (budgets.tokens, budgets.samples) == (60, 16)
    assert budgets.spend([40, 8, 0.0], world_size=2) == "token budget 100 spent (100 tokens)"
    resumed = Budgets(max_tokens=100)
    resumed.load(budgets.state(now=5.0))
    assert (resumed.tokens, resumed.samples, resumed.elapsed_s) == (100, 24, 0.0)


def test_time_budget_counts_earlier_runs_and_is_state_only_when_set() -> None:
    budgets = Budgets(max_time_s=10.0)
    budgets.elapsed_s, budgets.started = 8.0, 100.0
    assert budgets.state(now=101.0)["elapsed_s"] == 9.0
    assert budgets.spend(budgets.local(now=103.0), world_size=1) == "time budget 10s spent"
    assert "elapsed_s" not in Budgets(max_samples=3).state(now=1.0)


def test_checks_and_stops() -> None:
    assert [s for s in range(8) if check_due(s, 3, last_checked=-1)] == [2, 5]
    assert not check_due(2, 3, last_checked=2) and not check_due(2, None, -1)
    assert not stops_now("patience", 1.0, step=4, min_steps=5, check_finite=True)
    assert stops_now("nan", math.nan, step=4, min_steps=5, check_finite=True)
    assert stops_now("patience", 1.0, step=5, min_steps=5, check_finite=True)


def test_plateau_tracker_names_the_bad_argument() -> None:
    tracker = plateau_tracker("max", 2, 0.1, True, 0.9, 4.0, False)
    assert (tracker.mode, tracker.patience, tracker.relative, tracker.half_life) == (
        "max", 2, True, 4.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="patience"):
        plateau_tracker("min", -1, 0.0, False, None, None, True)


def test_trip_action_caps_and_falls_back() -> None:
    assert trip_action("rollback", 0, max_trips=3, has_snapshot=False) == "skip"
    assert trip_action("rollback", 0, max_trips=3, has_snapshot=True) == "rollback"
    assert trip_action("skip", 2, max_trips=3, has_snapshot=True) == "stop"
    assert trip_message(7, "loss nan", "stop", "skip", 3) == (
        "step 7: loss nan -> stop (max_trips=3 reached)."
    )
    assert snapshot_due("rollback", False, 3, 50) and not snapshot_due("rollback", True, 3, 50)
    assert not snapshot_due("skip", False, 0, 1)


def test_guard_summary_shows_three_trips() -> None:
    trips = [{"step": s, "reason": "spike", "action": "rollback to step 0"} for s in range(4)]
    change, figures = guard_summary(trips, watched=10, action="rollback")
    assert change.startswith("4 trips: step 0 spike -> rollback to step 0;")
    assert change.endswith("; ...") and figures["rollbacks"] == 4 and figures["trips"] == 4
    assert guard_summary([], 5, "skip")[0] == "watched 5 steps: no trip (action skip)"
