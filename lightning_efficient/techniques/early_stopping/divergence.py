"""Divergence: ``is_spike(value, baseline, factor)``, ``divergence_reason`` and
``DivergenceDetector`` (a smoothed baseline of the good values only)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lightning_efficient.techniques.early_stopping.smoothing import ema_update

__all__ = ["is_spike", "divergence_reason", "DivergenceDetector"]


def is_spike(value: float, baseline: float | None, factor: float) -> bool:
    """True when ``value`` is above ``factor`` times the baseline: ``value > baseline +
    (factor - 1) * |baseline|`` (the same as ``value > factor * baseline`` for a positive
    baseline, and meaningful for a negative one). No baseline: never a spike."""
    if baseline is None or not math.isfinite(value):
        return False
    return value > baseline + (factor - 1.0) * abs(baseline)


def divergence_reason(
    value: float, baseline: float | None, factor: float | None, name: str = "loss"
) -> str | None:
    """Why ``value`` trips the guard (``"non-finite loss (nan)"``, ``"loss spike: 9.1 > 3 x
    baseline 2.3"``), or ``None``. ``factor=None`` checks finiteness only."""
    if not math.isfinite(value):
        return f"non-finite {name} ({value})"
    if factor is not None and is_spike(value, baseline, factor):
        return f"{name} spike: {value:.4g} > {factor:g} x baseline {baseline:.4g}"
    return None


@dataclass
class DivergenceDetector:
    """Smoothed baselines of the loss (and optionally the gradient norm) over good steps only.

    ``check(loss, grad_norm)`` returns why a step trips the guard or ``None``; spikes count only
    after ``warmup`` accepted steps. ``accept(loss, grad_norm)`` adds a good step to the
    baselines. ``state()`` / ``load(state)`` checkpoint the mutable fields.
    """

    factor: float | None = 2.0
    half_life: float = 20.0
    warmup: int = 10
    baseline: float | None = None
    grad_baseline: float | None = None
    accepted: int = 0

    _STATE = ("baseline", "grad_baseline", "accepted")

    def check(self, loss: float, grad_norm: float | None = None) -> str | None:
        factor = self.factor if self.accepted >= self.warmup else None
        reason = divergence_reason(loss, self.baseline, factor, "loss")
        if reason is None and grad_norm is not None:
            reason = divergence_reason(grad_norm, self.grad_baseline, factor, "gradient norm")
        return reason

    def accept(self, loss: float, grad_norm: float | None = None) -> None:
        self.baseline = ema_update(self.baseline, loss, self.half_life)
        if grad_norm is not None:
            self.grad_baseline = ema_update(self.grad_baseline, grad_norm, self.half_life)
        self.accepted += 1

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in self._STATE}

    def load(self, state: Mapping[str, Any]) -> None:
        for key in self._STATE:
            if key in state:
                setattr(self, key, state[key])
