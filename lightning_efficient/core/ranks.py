"""Figures of several ranks: gathering them once, and how their spread reads.

At the end of a distributed fit every rank holds its own report (its own tracked peak, its own
step time). :func:`gather_objects` is the one collective that brings them together (nothing on
one process); the pure functions below say how a figure's values on the ranks read:

- ``*_bytes``: the worst rank, ``803 KiB (worst rank 1; ranks 790-803 KiB)``;
- ``*_s``: the slowest rank, ``0.0123 s (slowest rank 1; ranks 0.0118-0.0123 s)``;
- decisions (figures a technique names in ``Technique.decision_figures``, e.g. an early
  stopper's ``stopped_step``): whether every rank took the same, ``13 (same on 2 ranks)`` or
  ``13 (ranks differ: 13, 14)``;
- any other figure: rank zero's value, as on one process.

Values equal on every rank read as one process's value (nothing to compare).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Spread",
    "is_number",
    "spread_of",
    "agree",
    "spread_kind",
    "annotate",
    "spread_dict",
    "distributed_world",
    "gather_objects",
]


@dataclass(frozen=True)
class Spread:
    """The numeric values of one figure over the ranks that have it."""

    low: float
    high: float
    #: The rank holding ``high`` (the lowest such rank on a tie).
    high_rank: int
    #: The rank holding ``low``.
    low_rank: int
    #: Ranks that have a numeric value.
    ranks: int

    @property
    def equal(self) -> bool:
        return self.low == self.high


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def spread_of(values: Sequence[Any]) -> Spread | None:
    """The spread of ``values`` (one per rank, in rank order; non-numbers are skipped), or
    ``None`` when no rank has a number."""
    ranked = [(float(v), r) for r, v in enumerate(values) if is_number(v)]
    if not ranked:
        return None
    high, high_rank = max(ranked, key=lambda vr: (vr[0], -vr[1]))
    low, low_rank = min(ranked, key=lambda vr: (vr[0], vr[1]))
    return Spread(low, high, high_rank, low_rank, len(ranked))


def agree(values: Sequence[Any]) -> bool:
    """Every rank has the same value (a rank without the figure counts as ``None``)."""
    return all(v == values[0] for v in values[1:])


def spread_kind(name: str, decisions: Sequence[str] = ()) -> str | None:
    """How a figure's ranks are compared: ``"worst"`` (bytes), ``"slowest"`` (seconds),
    ``"agree"`` (a decision), or ``None`` (rank zero's value stands)."""
    if name in decisions:
        return "agree"
    if name.endswith("_bytes"):
        return "worst"
    if name.endswith("_s"):
        return "slowest"
    return None


def annotate(
    name: str,
    values: Sequence[Any],
    fmt: Callable[[str, Any], str],
    decisions: Sequence[str] = (),
) -> str | None:
    """The figure as read over the ranks (``values``: one per rank, in rank order), formatted
    with ``fmt(name, value)``; ``None`` when there is nothing to say beyond rank zero's value
    (one rank, a figure whose ranks are not compared, or equal sizes and times)."""
    if len(values) < 2:
        return None
    kind = spread_kind(name, decisions)
    if kind == "agree":
        first = "-" if values[0] is None else fmt(name, values[0])
        if agree(values):
            return f"{first} (same on {len(values)} ranks)"
        shown = ", ".join("-" if v is None else fmt(name, v) for v in values)
        return f"{first} (ranks differ: {shown})"
    if kind is None:
        return None
    spread = spread_of(values)
    if spread is None or spread.equal:
        return None
    word = "worst" if kind == "worst" else "slowest"
    low, high = fmt(name, spread.low), fmt(name, spread.high)
    return f"{high} ({word} rank {spread.high_rank}; ranks {_span(low, high)})"


def _span(low: str, high: str) -> str:
    """``"790-803 KiB"`` from ``"790 KiB"`` and ``"803 KiB"`` (a shared unit written once)."""
    lo, hi = low.rsplit(" ", 1), high.rsplit(" ", 1)
    if len(lo) == 2 and len(hi) == 2 and lo[1] == hi[1]:
        return f"{lo[0]}-{hi[0]} {hi[1]}"
    return f"{low}-{high}"


def spread_dict(name: str, values: Sequence[Any], decisions: Sequence[str] = ()) -> dict | None:
    """The spread as plain data (for ``to_dict``): ``{"min", "max", "worst_rank"}`` for sizes,
    ``{"min", "max", "slowest_rank"}`` for times, ``{"same", "values"}`` for decisions."""
    kind = spread_kind(name, decisions)
    if kind == "agree":
        return {"same": agree(values), "values": list(values)}
    spread = spread_of(values) if kind is not None else None
    if spread is None:
        return None
    return {"min": spread.low, "max": spread.high, f"{kind}_rank": spread.high_rank}


def distributed_world(trainer: Any) -> int:
    """Ranks of the trainer's default process group, or 1 when there is no collective to run
    (no trainer, no group, one rank, or a trainer of one process in a process with a group)."""
    import torch.distributed as dist

    if trainer is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    world = dist.get_world_size()
    if world < 2 or getattr(trainer, "world_size", world) != world:
        return 1
    return world


def gather_objects(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``torch.distributed.all_gather_object``): a
    collective, so every rank must call it at the same point."""
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out
