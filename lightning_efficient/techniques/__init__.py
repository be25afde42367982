"""One module per technique: pure functions plus a thin Callback or Strategy.

``TECHNIQUES`` lists every technique class; the contract tests and the CLI use it.
"""

from lightning_efficient.techniques._base import NoEffectWarning, Technique

#: Every technique class of the package (callbacks and strategies), in documentation order.
TECHNIQUES: list[type] = []

from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing  # noqa: E402

TECHNIQUES.append(ActivationCheckpointing)

__all__ = ["Technique", "NoEffectWarning", "TECHNIQUES"]

# the instrument's tracking callback (lightning_efficient.measure.memory)
from lightning_efficient.measure.memory import MemoryBreakdown  # noqa: E402

TECHNIQUES.append(MemoryBreakdown)
__all__ += ["ActivationCheckpointing"]

from lightning_efficient.techniques.precision import Float8Training, MatmulPrecision  # noqa: E402
from lightning_efficient.techniques.compile import TorchCompile  # noqa: E402

TECHNIQUES += [MatmulPrecision, Float8Training, TorchCompile]
__all__ += ["MatmulPrecision", "Float8Training", "TorchCompile"]
