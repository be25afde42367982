"""LR schedulers that drive a new optimizer: the one implementation, used by ``OptimizerSwap``
and by ``ZeROOffload``'s optimizer conversion."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.optim import Optimizer

from lightning_efficient.core._internals import (
    inner_schedulers,
    mark_step_called,
    step_was_called,
    track_step_calls,
)

__all__ = ["repoint_scheduler", "rebind_schedulers"]


def repoint_scheduler(scheduler: Any, new_optimizer: Optimizer) -> Any:
    """Make ``scheduler`` drive ``new_optimizer`` (which has the same param groups, in order).

    Works for ``LRScheduler`` subclasses, ``ReduceLROnPlateau`` and the composite
    ``SequentialLR``/``ChainedScheduler``; ``base_lrs`` are re-read from the groups'
    ``initial_lr`` (so an ``lr`` override moves the whole schedule). ``new_optimizer.step`` is
    wrapped as torch's schedulers expect, and a step the old optimizer already took is carried
    over, so the scheduler does not warn about the order of ``optimizer.step()`` and
    ``lr_scheduler.step()``. Returns ``scheduler``.
    """
    old = getattr(scheduler, "optimizer", None)
    if old is not None and len(old.param_groups) != len(new_optimizer.param_groups):
        raise ValueError(
            f"repoint_scheduler: the new optimizer has {len(new_optimizer.param_groups)} param "
            f"groups, the scheduler's has {len(old.param_groups)}; they must match."
        )
    for inner in inner_schedulers(scheduler):
        repoint_scheduler(inner, new_optimizer)
    scheduler.optimizer = new_optimizer
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in new_optimizer.param_groups]
    track_step_calls(new_optimizer)
    if old is not None and step_was_called(old):
        mark_step_called(new_optimizer)
    return scheduler


def rebind_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> int:
    """Point every scheduler of ``schedulers`` that drives ``old`` at ``new`` (same group order),
    with :func:`repoint_scheduler`; returns how many."""
    count = 0
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            repoint_scheduler(scheduler, new)
            count += 1
    return count
