"""Is the monitored metric still improving: ``is_improvement`` (absolute or relative
``min_delta``), ``threshold_reached``, ``PlateauTracker`` (best value and step, patience, optional
smoothing) that ``EarlyStopper`` feeds one value per check, and what the stopper says about it:
``stop_summary`` (the report row), ``missing_metric_message``, ``matching_checkpoint`` (a
ModelCheckpoint whose best file of the metric can be restored)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_efficient.techniques.early_stopping.budgets import steps_saved
from lightning_efficient.techniques.early_stopping.smoothing import ema_update

__all__ = [
    "MODES",
    "is_improvement",
    "threshold_reached",
    "PlateauTracker",
    "stop_summary",
    "matching_checkpoint",
    "missing_metric_message",
]


MODES = ("min", "max")


def is_improvement(
    value: float,
    best: float | None,
    *,
    mode: str = "min",
    min_delta: float = 0.0,
    relative: bool = False,
) -> bool:
    """True when ``value`` beats ``best`` by more than ``min_delta`` (in the direction of
    ``mode``). With ``relative=True`` the margin is ``min_delta * |best|`` (``0.01``: 1%).
    A non-finite value never improves; anything finite improves on ``best=None``."""
    if not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    margin = min_delta * abs(best) if relative else min_delta
    return value < best - margin if mode == "min" else value > best + margin


def threshold_reached(value: float, threshold: float | None, mode: str = "min") -> bool:
    """True when ``value`` is at least as good as ``threshold`` ("good enough: stop")."""
    if threshold is None or not math.isfinite(value):
        return False
    return value <= threshold if mode == "min" else value >= threshold


@dataclass
class PlateauTracker:
    """Best value, patience and smoothing of one monitored quantity, one ``observe`` per check.

    ``observe(value, step)`` returns ``(improved, reason)``: ``reason`` says why training should
    stop (patience used up, threshold reached, non-finite value) or is ``None``. The decision
    reads the smoothed value when ``half_life`` is set. The mutable fields (``best`` ...
    ``smoothed``) are the state to checkpoint: ``state()`` / ``load(state)``.
    """

    mode: str = "min"
    min_delta: float = 0.0
    relative: bool = False
    patience: int = 3
    half_life: float | None = None
    stopping_threshold: float | None = None
    check_finite: bool = True
    best: float | None = None
    best_step: int = -1
    wait: int = 0
    checks: int = 0
    smoothed: float | None = None

    _STATE = ("best", "best_step", "wait", "checks", "smoothed")

    def observe(self, value: float, step: int) -> tuple[bool, str | None]:
        self.checks += 1
        if not math.isfinite(value):
            self.wait += 1
            if self.check_finite:
                return False, f"the value is {value}"
            return False, self._patience_reason()
        self.smoothed = ema_update(self.smoothed, value, self.half_life)
        current = self.smoothed
        improved = is_improvement(
            current, self.best, mode=self.mode, min_delta=self.min_delta, relative=self.relative
        )
        if improved:
            self.best, self.best_step, self.wait = current, step, 0
        else:
            self.wait += 1
        if threshold_reached(current, self.stopping_threshold, self.mode):
            sign = "<=" if self.mode == "min" else ">="
            return improved, (
                f"reached the stopping threshold ({current:.4g} {sign} "
                f"{self.stopping_threshold:.4g})"
            )
        return improved, self._patience_reason()

    def _patience_reason(self) -> str | None:
        if self.wait >= self.patience:
            return f"no improvement in {self.wait} checks (patience {self.patience})"
        return None

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in self._STATE}

    def load(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            if f.name in self._STATE and f.name in state:
                setattr(self, f.name, state[f.name])


def stop_summary(
    monitor: str,
    tracker: PlateauTracker,
    *,
    stopped_step: int | None = None,
    reason: str | None = None,
    total_steps: float | None = None,
    restored_from: str = "",
    seconds_per_step: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """The report row of an early stopper: ``("stopped at step 140 of 300 (-53%): val_loss: no
    improvement in 3 checks (patience 3); best val_loss 2.31 at step 120 (restored from host
    copy)", figures)``."""
    figures: dict[str, Any] = {"checks": tracker.checks}
    best = f"no finite {monitor}"
    if tracker.best is not None:
        figures.update(best_value=tracker.best, best_step=tracker.best_step)
        best = f"best {monitor} {tracker.best:.4g} at step {tracker.best_step}"
        best += f" (restored from {restored_from})" if restored_from else ""
    if stopped_step is None:
        return f"did not stop ({tracker.checks} checks); {best}", figures
    change = f"stopped at step {stopped_step}"
    figures["stopped_step"] = stopped_step
    saved = steps_saved(stopped_step, total_steps)
    if saved is not None:
        change += f" of {int(total_steps)} (-{100 * saved[1]:.0f}%)"
        figures["steps_saved"] = saved[0]
        if seconds_per_step is not None:
            figures["est_time_saved_s"] = seconds_per_step * saved[0]
    return f"{change}: {reason}; {best}", figures


def matching_checkpoint(callbacks: Iterable[Any], monitor: str, mode: str) -> Any:
    """The first ``ModelCheckpoint``-like callback that keeps a best file of ``monitor`` in
    ``mode`` (``save_top_k != 0``), or ``None``."""
    for cb in callbacks:
        same = getattr(cb, "monitor", None) == monitor and getattr(cb, "mode", None) == mode
        if same and getattr(cb, "save_top_k", 0) != 0:
            return cb
    return None


def missing_metric_message(
    monitor: str, logged: Iterable[str], step: int, every_n_steps: int | None = None
) -> str:
    """What to say when the monitored metric is not among the logged ones."""
    names = ", ".join(sorted(logged)) or "none yet"
    message = (
        f"`monitor={monitor!r}` is not among the logged metrics at step {step} (logged: "
        f"{names}). Log it with `self.log({monitor!r}, ...)` or set `monitor` to one of the "
        "logged metrics"
    )
    if every_n_steps is not None:
        message += "; with `check_every_n_steps`, monitor a metric logged in training_step"
    return message
