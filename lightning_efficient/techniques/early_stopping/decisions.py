"""The decisions of ``EarlyStopper`` and ``DivergenceGuard`` as functions: when a check is due,
whether a verdict stops the run, what a trip does, what the report says. The callbacks only
choose when to call them; everything here is usable (and testable) without a Trainer."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_efficient.core.validate import check_bool, check_choice, check_float, check_int
from lightning_efficient.techniques.early_stopping.budgets import budget_reason
from lightning_efficient.techniques.early_stopping.plateau import (
    MODES,
    PlateauTracker,
    matching_checkpoint,
    missing_metric_message,
)
from lightning_efficient.techniques.early_stopping.smoothing import check_half_life

__all__ = [
    "Budgets",
    "best_checkpoint_callback",
    "check_monitor",
    "check_due",
    "elapsed_seconds",
    "guard_summary",
    "missing_metric_warning",
    "no_check_message",
    "plateau_tracker",
    "reduce_over_ranks",
    "seconds_per_step",
    "snapshot_due",
    "stops_now",
    "trip_action",
    "trip_message",
]


# -- EarlyStopper ---------------------------------------------------------------------------
def check_monitor(monitor: Any) -> str:
    """``monitor`` when it is a metric name (a non-empty str), else a ``TypeError``."""
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"`monitor` must be a metric name (a non-empty str); got {monitor!r}.")
    return monitor


def plateau_tracker(
    mode: Any,
    patience: Any,
    min_delta: Any,
    relative_delta: Any,
    stopping_threshold: Any,
    half_life: Any,
    check_finite: Any,
) -> PlateauTracker:
    """The ``PlateauTracker`` of an ``EarlyStopper``'s arguments, each checked first (a
    ``ValueError``/``TypeError`` naming the argument)."""
    return PlateauTracker(
        mode=check_choice("mode", mode, MODES),
        patience=check_int("patience", patience, minimum=0),
        min_delta=check_float("min_delta", min_delta, minimum=0.0),
        relative=check_bool("relative_delta", relative_delta),
        stopping_threshold=check_float("stopping_threshold", stopping_threshold, allow_none=True),
        half_life=check_half_life(half_life, "checks"),
        check_finite=check_bool("check_finite", check_finite),
    )


def check_due(step: int, every_n_steps: int | None, last_checked: int) -> bool:
    """Whether a check every ``every_n_steps`` optimizer steps runs before step ``step`` (once
    per step, whatever the number of optimizers: ``last_checked`` is the step of the last)."""
    return every_n_steps is not None and (step + 1) % every_n_steps == 0 and step != last_checked


def stops_now(
    reason: str | None, value: float, step: int, min_steps: int, check_finite: bool
) -> bool:
    """Whether a check's verdict ``reason`` stops the run: from ``min_steps`` on, or at once
    for a non-finite value when ``check_finite``."""
    non_finite = check_finite and not math.isfinite(value)
    return reason is not None and (non_finite or step >= min_steps)


def elapsed_seconds(before_s: float, started: float | None, now: float) -> float:
    """Training seconds: ``before_s`` of earlier runs plus ``now - started`` of this one (none
    when it has not started)."""
    return before_s + (now - started if started else 0.0)


def seconds_per_step(started: float | None, now: float, steps_done: int) -> float | None:
    """Mean seconds per optimizer step of this run, or ``None`` when unknown."""
    if started is None or steps_done <= 0:
        return None
    return (now - started) / steps_done


def best_checkpoint_callback(
    callbacks: Iterable[Any], monitor: str, tracker: PlateauTracker, check_every_n_steps: int | None
) -> Any:
    """A ``ModelCheckpoint`` whose best file may hold the weights of the best check of
    ``tracker`` (on ``monitor``), or ``None`` (smoothing, a ``min_delta`` or step checks can
    make the two bests differ)."""
    if tracker.half_life is not None or tracker.min_delta or check_every_n_steps is not None:
        return None  # our best and its best can be different checks
    return matching_checkpoint(callbacks, monitor, tracker.mode)


def missing_metric_warning(
    monitor: str, logged: Iterable[str], step: int, every_n_steps: int | None, strict: bool
) -> str:
    """The warning for a monitored metric that was not logged; a ``ValueError`` when
    ``strict``."""
    message = missing_metric_message(monitor, logged, step, every_n_steps)
    if strict:
        raise ValueError(message + " (or strict=False to skip checks without it).")
    return message + "; checks without it are skipped (strict=False)."


class Budgets:
    """Time, token and sample budgets of a run, counted over resumed runs: the local counts
    of the batches since the last check, summed over the ranks at each check (``spend``).

    Args:
        max_time_s: Wall-clock budget in seconds (``None``: none).
        max_tokens: Token budget (``None``: none).
        max_samples: Sample budget (``None``: none).
    """

    def __init__(
        self,
        max_time_s: float | None = None,
        max_tokens: int | None = None,
        max_samples: int | None = None,
    ) -> None:
        self.max_time_s, self.max_tokens, self.max_samples = max_time_s, max_tokens, max_samples
        self.tokens = self.samples = 0
        self.elapsed_s = 0.0  # of the earlier runs (a resumed run counts on from it)
        self.pending = [0, 0]  # local tokens and samples since the last check
        self.started: float | None = None  # monotonic clock at the start of this run

    @property
    def counts_batches(self) -> bool:
        """Whether batches must be counted (a token or sample budget is set)."""
        return self.max_tokens is not None or self.max_samples is not None

    @property
    def any(self) -> bool:
        """Whether some budget can stop the run."""
        return bool(self.max_time_s or self.max_tokens or self.max_samples)

    def add(self, samples: int, tokens: int | None) -> None:
        """Count one local batch (``measure.speed.tokens.batch_counts``: samples, tokens or
        None)."""
        self.pending = [self.pending[0] + (tokens or 0), self.pending[1] + samples]

    def local(self, now: float) -> list[float]:
        """This rank's ``[tokens, samples, seconds]`` to sum over the ranks."""
        return [*self.pending, elapsed_seconds(self.elapsed_s, self.started, now)]

    def spend(self, summed: Sequence[float], world_size: int) -> str | None:
        """Add the ranks' summed ``local`` counts; which budget is spent, or ``None``."""
        tokens, samples, elapsed = summed
        self.pending = [0, 0]
        self.tokens += int(tokens)
        self.samples += int(samples)
        elapsed /= max(1, world_size)  # the ranks' mean clock: the same everywhere
        return budget_reason(
            elapsed, self.tokens, self.samples, max_time_s=self.max_time_s,
            max_tokens=self.max_tokens, max_samples=self.max_samples,
        )  # fmt: skip

    def state(self, now: float) -> dict[str, Any]:
        state: dict[str, Any] = {"tokens": self.tokens, "samples": self.samples}
        if self.max_time_s is not None:  # wall time is state only when it decides something
            state["elapsed_s"] = elapsed_seconds(self.elapsed_s, self.started, now)
        return state

    def load(self, state: Mapping[str, Any]) -> None:
        self.tokens = int(state.get("tokens", 0))
        self.samples = int(state.get("samples", 0))
        self.elapsed_s = float(state.get("elapsed_s", 0.0))


def no_check_message(monitor: str, check_every_n_steps: int | None) -> str:
    """The ``NoEffectWarning`` of a stopper that never checked and spent no budget."""
    when = f"every {check_every_n_steps} steps" if check_every_n_steps else ""
    return (
        f"no check of {monitor!r} ran ({when or 'at validation end'}) and no budget "
        "was spent; training was not shortened."
    )


def reduce_over_ranks(strategy: Any, values: Sequence[float], op: str) -> list[float]:
    """The same numbers on every rank: the ranks' ``"sum"`` or ``"mean"`` of ``values`` (a
    no-op on one process)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=strategy.root_device)
    return strategy.reduce(local, reduce_op=op).cpu().tolist()


# -- DivergenceGuard ------------------------------------------------------------------------
def trip_action(action: str, trips_before: int, max_trips: int, has_snapshot: bool) -> str:
    """What a trip does: ``action``, ``"stop"`` at the ``max_trips``-th trip, ``"skip"`` for a
    rollback with no snapshot yet to go back to."""
    if trips_before + 1 >= max_trips:
        return "stop"
    if action == "rollback" and not has_snapshot:
        return "skip"  # nothing kept yet to go back to
    return action


def trip_message(step: int, reason: str, done: str, action: str, max_trips: int) -> str:
    """The warning of a trip at ``step`` that did ``done`` (the guard's setting: ``action``)."""
    capped = done == "stop" and action != "stop"
    extra = f" (max_trips={max_trips} reached)" if capped else ""
    return f"step {step}: {reason} -> {done}{extra}."


def snapshot_due(action: str, has_snapshot: bool, step: int, every: int) -> bool:
    """Whether a good step ``step`` is kept as the state a rollback returns to."""
    return action == "rollback" and (not has_snapshot or step % every == 0)


def guard_summary(
    trips: Sequence[Mapping[str, Any]], watched: int, action: str
) -> tuple[str, dict[str, Any]]:
    """The report row of a divergence guard: ``("2 trips: step 5 loss nan -> skip; ...",
    figures)``."""
    n = len(trips)
    if n == 0:
        change = f"watched {watched} steps: no trip (action {action})"
    else:
        shown = "; ".join(f"step {t['step']} {t['reason']} -> {t['action']}" for t in trips[:3])
        change = f"{n} trip{'s' if n > 1 else ''}: {shown}" + ("; ..." if n > 3 else "")
    rollbacks = sum(t["action"].startswith("rollback") for t in trips)
    figures = {"trips": n, "updates_dropped": n, "rollbacks": rollbacks, "steps_watched": watched}
    return change, figures
