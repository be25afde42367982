"""AutoEfficient: plan, apply and verify a stack of techniques when fit starts.

- :mod:`.decide`: the decision as pure functions (the largest exact-divisor micro-batch each rung
  of the planner's ladder fits, ranked by the goal, confirmed by trial steps).
- :mod:`.fit`: what it reads from a fit and how it measures and applies.
- :mod:`.callback`: the thin callback.
"""

from lightning_efficient.techniques.auto.callback import AutoEfficient
from lightning_efficient.techniques.auto.decide import GOALS, Decision, decide, divisors

__all__ = ["AutoEfficient", "Decision", "GOALS", "decide", "divisors"]
