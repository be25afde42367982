"""Smoothing a noisy metric: ``ema_alpha(half_life)`` and ``ema_update`` (an exponential moving
average whose weight halves every ``half_life`` observations), ``check_half_life``."""

from __future__ import annotations

import math
from typing import Any

from lightning_efficient.core.validate import check_float

__all__ = ["ema_alpha", "ema_update", "check_half_life"]


def ema_alpha(half_life: float) -> float:
    """Weight of a new observation in an EMA whose older observations' weight halves every
    ``half_life`` observations: ``1 - 0.5 ** (1 / half_life)``."""
    check_float("half_life", half_life, minimum=0.0)
    if half_life <= 0:
        raise ValueError(f"`half_life` must be > 0 (observations); got {half_life!r}.")
    return 1.0 - 0.5 ** (1.0 / half_life)


def ema_update(previous: float | None, value: float, half_life: float | None) -> float:
    """The next value of an exponential moving average (``half_life=None``: no smoothing).
    The first value starts the average; a non-finite value leaves it unchanged."""
    if half_life is None or previous is None:
        return value if (previous is None or math.isfinite(value)) else previous
    if not math.isfinite(value):
        return previous
    return previous + ema_alpha(half_life) * (value - previous)


def check_half_life(value: Any, unit: str, name: str = "half_life") -> float | None:
    """A half-life: ``None`` or a finite number > 0 (of ``unit``)."""
    value = check_float(name, value, allow_none=True)
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be a number of {unit} > 0; got {value!r}.")
    return value
