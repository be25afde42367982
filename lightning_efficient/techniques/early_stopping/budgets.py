"""Budgets of time, tokens and samples: ``parse_duration("1h30m") == 5400.0``,
``parse_count("2.5M") == 2_500_000``, ``format_duration``, ``budget_reason`` (which budget is
spent) and ``steps_saved``."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any

__all__ = ["parse_duration", "format_duration", "parse_count", "budget_reason", "steps_saved"]


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


_DURATION_UNITS = {
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "ms": 1e-3,
}


_DURATION_PART = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)")


_CLOCK = re.compile(r"^\s*(?:(\d+):)?(?:(\d+):)?(\d+):(\d+(?:\.\d*)?)\s*$")


def parse_duration(value: Any, name: str = "max_time") -> float | None:
    """Seconds from a duration: a number of seconds, a ``timedelta``, a string of number+unit
    parts (``"1h30m"``, ``"90s"``, ``"2.5h"``, ``"1d 2h"``; units d, h, m/min, s, ms) or a clock
    string ``"[DD:]HH:MM:SS"`` / ``"MM:SS"`` (Lightning's ``max_time`` form). ``None`` stays
    ``None``. Anything else, or a duration <= 0, raises a ``ValueError``/``TypeError`` naming
    ``name``."""
    allowed = "a number of seconds, or a string like '1h30m', '90s', '2.5h' or 'DD:HH:MM:SS'"
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration_str(value)
        if seconds is None:
            raise ValueError(f"`{name}` is not a duration: {value!r}. Use {allowed}.")
    else:
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"`{name}` must be a duration > 0; got {value!r}.")
    return seconds


def _parse_duration_str(text: str) -> float | None:
    clock = _CLOCK.match(text)
    if clock:
        parts = [p for p in clock.groups() if p is not None]
        scales = [86400.0, 3600.0, 60.0, 1.0][-len(parts) :]
        return sum(float(p) * s for p, s in zip(parts, scales))
    pos, total, found = 0, 0.0, False
    stripped = text.strip()
    while pos < len(stripped):
        match = _DURATION_PART.match(stripped, pos)
        if match is None or match.group(2).lower() not in _DURATION_UNITS:
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
        pos, found = match.end(), True
        while pos < len(stripped) and stripped[pos] in " ,":
            pos += 1
    return total if found else None


def format_duration(seconds: float) -> str:
    """``5400 -> '1h30m'``, ``90 -> '1m30s'``, ``2.5 -> '2.5s'``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    total = int(round(seconds))
    d, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{u}" for n, u in ((d, "d"), (h, "h"), (m, "m"), (s, "s")) if n) or "0s"


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]?)\s*$")


_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: Any, name: str) -> int | None:
    """A count of tokens or samples: an int, or a string like ``"2.5M"``, ``"500k"``, ``"10B"``
    or ``"1e9"`` (k = 10^3, M = 10^6, B/G = 10^9, T = 10^12). ``None`` stays ``None``."""
    allowed = "a positive integer or a string like '500k', '2.5M' or '10B'"
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if isinstance(value, (int, float)):
        count = value
    elif isinstance(value, str):
        match = _COUNT.match(value)
        if match is None or match.group(2).lower() not in _COUNT_UNITS:
            raise ValueError(f"`{name}` is not a count: {value!r}. Use {allowed}.")
        count = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    else:
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if not math.isfinite(count) or count < 1:
        raise ValueError(f"`{name}` must be >= 1; got {value!r}.")
    return int(count)


def budget_reason(
    elapsed_s: float,
    tokens: int,
    samples: int,
    *,
    max_time_s: float | None = None,
    max_tokens: int | None = None,
    max_samples: int | None = None,
) -> str | None:
    """Which budget is spent (``"time budget 1h30m spent"``), or ``None``."""
    if max_time_s is not None and elapsed_s >= max_time_s:
        return f"time budget {format_duration(max_time_s)} spent"
    if max_tokens is not None and tokens >= max_tokens:
        return f"token budget {max_tokens:,} spent ({tokens:,} tokens)"
    if max_samples is not None and samples >= max_samples:
        return f"sample budget {max_samples:,} spent ({samples:,} samples)"
    return None


def steps_saved(stopped_step: int, total_steps: float | None) -> tuple[int, float] | None:
    """``(steps saved, fraction saved)`` of a run stopped at ``stopped_step`` out of
    ``total_steps`` (``None`` or infinite: unknown, ``None``)."""
    if total_steps is None or not math.isfinite(total_steps) or total_steps <= 0:
        return None
    saved = max(0, int(total_steps) - stopped_step)
    return saved, saved / total_steps
