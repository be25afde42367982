"""Deprecated path: the planner lives in :mod:`lightning_efficient.planning` (this module
re-exports its public names: ``plan_stack``, ``PlanResult``, ``default_ladder``, ``Rung``,
``Part`` and the ladder's parts)."""

from lightning_efficient.planning import (
    ADAM8BIT,
    ADAMW8BIT,
    ADAMW8BIT_IN_BACKWARD,
    CHECKPOINT_ALL,
    CHUNKED_LOSS,
    FSDP_FULL,
    FSDP_GRAD_OP,
    ZERO2_OFFLOAD,
    ZERO3_OFFLOAD,
    Part,
    PlanResult,
    Rung,
    checkpoint_fewest,
    default_ladder,
    plan_stack,
)

__all__ = [
    "ADAM8BIT",
    "ADAMW8BIT",
    "ADAMW8BIT_IN_BACKWARD",
    "CHECKPOINT_ALL",
    "CHUNKED_LOSS",
    "FSDP_FULL",
    "FSDP_GRAD_OP",
    "ZERO2_OFFLOAD",
    "ZERO3_OFFLOAD",
    "Part",
    "PlanResult",
    "Rung",
    "checkpoint_fewest",
    "default_ladder",
    "plan_stack",
]
