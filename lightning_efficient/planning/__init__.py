"""The planning floor: which stack of techniques to train with, between the techniques and the
commands.

- :mod:`.ladder`: the stacks to try, cheapest first, as data (``Part``, ``Rung``,
  :func:`default_ladder`); the technique classes imported directly.
- :mod:`.search`: the one search: estimate a rung, try a rung, and :func:`decide` (the largest
  exact-divisor micro-batch each rung fits, ranked by the goal, confirmed by real steps).
- :mod:`.plan`: :func:`plan_stack`, the planner's table at the batch it is given.
- :mod:`.decision`: AutoEfficient's ``Decision`` and its checkpoint form.
- :mod:`.fit`: what AutoEfficient reads from a fit, and how it measures and applies;
  :func:`~.fit.decide_stack`, its decision without a trainer.
- :mod:`.auto`: ``AutoEfficient``, the thin callback (``lightning_efficient.AutoEfficient``).
"""

from lightning_efficient.planning.auto import AutoEfficient
from lightning_efficient.planning.decision import GOALS, Decision, DecisionStateError, divisors
from lightning_efficient.planning.fit import decide_stack
from lightning_efficient.planning.ladder import (
    ADAM8BIT,
    ADAMW8BIT,
    ADAMW8BIT_IN_BACKWARD,
    CHECKPOINT_ALL,
    CHECKPOINT_FEWEST,
    CHUNKED_LOSS,
    FSDP_FULL,
    FSDP_GRAD_OP,
    ZERO2_OFFLOAD,
    ZERO3_OFFLOAD,
    Part,
    Rung,
    checkpoint_fewest,
    default_ladder,
)
from lightning_efficient.planning.plan import PlanResult, plan_stack
from lightning_efficient.planning.search import decide, estimate_rung, try_rung

__all__ = [
    "ADAM8BIT",
    "ADAMW8BIT",
    "ADAMW8BIT_IN_BACKWARD",
    "CHECKPOINT_ALL",
    "CHECKPOINT_FEWEST",
    "CHUNKED_LOSS",
    "FSDP_FULL",
    "FSDP_GRAD_OP",
    "GOALS",
    "ZERO2_OFFLOAD",
    "ZERO3_OFFLOAD",
    "AutoEfficient",
    "Decision",
    "DecisionStateError",
    "Part",
    "PlanResult",
    "Rung",
    "checkpoint_fewest",
    "decide",
    "decide_stack",
    "default_ladder",
    "divisors",
    "estimate_rung",
    "plan_stack",
    "try_rung",
]
