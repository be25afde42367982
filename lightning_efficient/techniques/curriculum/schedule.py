"""Pacing: how much of the data (or of the sequence) is available at training step t.

Pure maths, no tensors and no trainer:

- ``pacing_fraction(pacing, step, duration, start)``: the fraction available at ``step``, from
  ``start`` at step 0 to 1.0 at ``duration`` (and after), by a named function:

  ==============  ==========================================================================
  ``linear``      ``start + (1 - start) * p``                       (p = step / duration)
  ``root``        ``sqrt(start**2 + (1 - start**2) * p)``: the square-root competence of
                  Platanios et al. (2019), fast at first, slow near the end
  ``geometric``   ``start * (1 / start) ** p``: doubles at a constant rate, slow at first
  ``step``        ``start + (1 - start) * floor(p * stages) / stages``: a staircase
  ==============  ==========================================================================

- ``pool_size(fraction, n, minimum)``: how many of the ``n`` easiest samples that is.
- ``sequence_length_at(step, duration, full_length, start_length, multiple_of, pacing)``: the
  sequence length of a warm-up, moved in multiples of ``multiple_of`` so that a compiled model
  sees few distinct shapes.
- ``reshape_length(target, full_length, multiple_of)``: the length a ``reshape`` warm-up uses (one
  that divides the full length, so tokens per step stay exactly constant).
- ``total_steps(...)``: optimizer steps a fit will run, from the Trainer's limits (used to turn a
  fractional ``duration`` into steps before the train loader exists).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_efficient.core.validate import check_choice, check_float, check_int

__all__ = [
    "PACINGS",
    "check_pacing",
    "check_duration",
    "pacing_fraction",
    "pool_size",
    "sequence_length_at",
    "reshape_length",
    "total_steps",
    "duration_in_steps",
]

#: The named pacing functions.
PACINGS: tuple[str, ...] = ("linear", "root", "geometric", "step")


def check_pacing(pacing: Any) -> str:
    """``pacing`` if it names a pacing function; else a ValueError that lists the valid ones."""
    if not isinstance(pacing, str):
        raise TypeError(
            f"`pacing` must be one of {', '.join(map(repr, PACINGS))}; got {pacing!r} "
            f"({type(pacing).__name__})."
        )
    return check_choice("pacing", pacing, PACINGS)


def check_duration(duration: Any, name: str = "duration") -> int | float:
    """A duration is a number of optimizer steps (int >= 0) or a fraction of training in (0, 1]."""
    if isinstance(duration, bool) or not isinstance(duration, (int, float)):
        raise TypeError(
            f"`{name}` must be a number of steps (int >= 0) or a fraction of training (float in "
            f"(0, 1]); got {duration!r} ({type(duration).__name__})."
        )
    if isinstance(duration, int):
        return check_int(name, duration, minimum=0)
    if not (0.0 < duration <= 1.0):
        raise ValueError(
            f"`{name}` as a float is a fraction of training and must be in (0, 1]; got "
            f"{duration!r}. Give an int for a number of steps."
        )
    return duration


def pacing_fraction(
    pacing: str, step: int, duration: int, start: float = 0.1, *, stages: int = 4
) -> float:
    """Fraction available at ``step``: ``start`` at step 0, 1.0 from ``duration`` on."""
    check_pacing(pacing)
    check_int("step", step)
    check_int("duration", duration, minimum=0)
    check_float("start", start, minimum=0.0, maximum=1.0)
    check_int("stages", stages, minimum=1)
    if start <= 0.0:
        raise ValueError(f"`start` must be > 0 (a fraction of the data); got {start!r}.")
    if duration == 0 or step >= duration:
        return 1.0
    p = max(0, step) / duration
    if pacing == "linear":
        value = start + (1.0 - start) * p
    elif pacing == "root":
        value = math.sqrt(start**2 + (1.0 - start**2) * p)
    elif pacing == "geometric":
        value = start * (1.0 / start) ** p
    else:  # step
        value = start + (1.0 - start) * math.floor(p * stages) / stages
    return min(1.0, max(start, value))


def pool_size(fraction: float, n: int, minimum: int = 1) -> int:
    """Number of samples in the pool: ``ceil(fraction * n)``, at least ``minimum``, at most n."""
    check_float("fraction", fraction, minimum=0.0, maximum=1.0)
    check_int("n", n, minimum=0)
    check_int("minimum", minimum, minimum=0)
    return min(n, max(minimum, math.ceil(fraction * n - 1e-9)))


def sequence_length_at(
    step: int,
    duration: int,
    full_length: int,
    start_length: int = 64,
    multiple_of: int = 64,
    pacing: str = "linear",
    *,
    stages: int = 4,
) -> int:
    """The warm-up's sequence length at ``step``.

    ``start_length`` at step 0 growing by ``pacing`` to ``full_length`` at ``duration``; rounded
    down to a multiple of ``multiple_of`` (never below ``multiple_of``, never above the full
    length). From ``duration`` on it is exactly ``full_length``.
    """
    check_int("full_length", full_length, minimum=1)
    check_int("start_length", start_length, minimum=1)
    check_int("multiple_of", multiple_of, minimum=1)
    if duration == 0 or step >= duration:
        return full_length
    start = min(start_length, full_length) / full_length
    fraction = pacing_fraction(pacing, step, duration, start, stages=stages)
    length = int(fraction * full_length + 1e-9) // multiple_of * multiple_of
    return min(full_length, max(length, multiple_of))


def reshape_length(target: int, full_length: int, multiple_of: int = 64) -> int:
    """The largest length <= ``target`` that divides ``full_length`` and is a multiple of
    ``multiple_of`` (else the smallest such length above it; ``full_length`` if none): cutting
    a sequence into pieces of it keeps every token."""
    check_int("target", target, minimum=1)
    check_int("full_length", full_length, minimum=1)
    check_int("multiple_of", multiple_of, minimum=1)
    candidates = [
        d for d in range(multiple_of, full_length + 1, multiple_of) if full_length % d == 0
    ]
    candidates.append(full_length)
    fitting = [d for d in candidates if d <= target]
    return max(fitting) if fitting else min(candidates)


def total_steps(
    batches_per_epoch: int,
    *,
    max_steps: int = -1,
    max_epochs: int | None = None,
    limit_train_batches: int | float = 1.0,
    accumulate_grad_batches: int = 1,
) -> int | None:
    """Optimizer steps a fit will run (None: unbounded), as Lightning counts them.

    ``batches_per_epoch`` is ``len(train_loader)``; ``limit_train_batches`` cuts it (an int:
    batches, a float: a fraction); each epoch ends with a step even if it does not fill the last
    accumulation.
    """
    batches = batches_per_epoch
    if isinstance(limit_train_batches, int) and not isinstance(limit_train_batches, bool):
        batches = min(batches, limit_train_batches)
    elif isinstance(limit_train_batches, float):
        batches = int(batches * limit_train_batches)
    per_epoch = math.ceil(batches / max(1, accumulate_grad_batches))
    by_epochs = None
    if max_epochs is not None and max_epochs >= 0:
        by_epochs = per_epoch * max(max_epochs, 1)
    by_steps = max_steps if max_steps is not None and max_steps >= 0 else None
    if by_epochs is None:
        return by_steps
    return by_epochs if by_steps is None else min(by_epochs, by_steps)


def duration_in_steps(duration: int | float, total: int | float | None, owner: str) -> int:
    """An int ``duration`` as it is; a fraction of ``total`` steps rounded to the nearest step."""
    if isinstance(duration, int):
        return duration
    if total is None or not math.isfinite(total):
        raise ValueError(
            f"{owner}: `duration`={duration!r} is a fraction of training, but this fit has no "
            "known length (max_steps=-1 and max_epochs=-1, or an iterable dataset without a "
            "length). Set max_steps or max_epochs, or give `duration` as a number of steps."
        )
    return max(1, round(duration * total))
