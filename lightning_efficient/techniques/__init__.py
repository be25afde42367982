"""One module per technique: pure functions plus a thin Callback or Strategy.

``TECHNIQUES`` lists every technique class; the contract tests and the CLI use it.
"""

from lightning_efficient.techniques._base import NoEffectWarning, Technique

#: Every technique class of the package (callbacks and strategies), in documentation order.
TECHNIQUES: list[type] = []

__all__ = ["Technique", "NoEffectWarning", "TECHNIQUES"]

# the instrument's tracking callback (lightning_efficient.measure.memory)
from lightning_efficient.measure.memory import MemoryBreakdown  # noqa: E402

TECHNIQUES.append(MemoryBreakdown)

from lightning_efficient.techniques.optimizers import OptimizerSwap  # noqa: E402

TECHNIQUES.append(OptimizerSwap)
__all__ += ["OptimizerSwap"]
