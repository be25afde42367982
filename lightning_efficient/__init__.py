"""lightning-efficient: Lightning callbacks and strategies that make training fit and run fast.

Every technique is importable from here (``from lightning_efficient import
ActivationCheckpointing``); ``lightning_efficient.functional`` holds the functions a user composes
without Lightning (``apply_*``, each returning a ``Change`` with its ``undo()``).
"""

__version__ = "0.1.0"

from lightning_efficient.measure import (  # noqa: E402
    EfficiencyReport,
    EstimatePlan,
    MemoryEstimate,
    StepTimer,
    estimate_memory,
    report_for,
)
from lightning_efficient.planning import AutoEfficient  # noqa: E402
from lightning_efficient.techniques import *  # noqa: E402,F401,F403
from lightning_efficient.techniques import TECHNIQUES as _FLOOR  # noqa: E402
from lightning_efficient.techniques import __all__ as _techniques_all  # noqa: E402
from lightning_efficient.techniques.precision import best_precision  # noqa: E402

#: Every technique class of the package (callbacks and strategies), in documentation order:
#: the techniques' floor, then AutoEfficient (the planning floor's callback).
TECHNIQUES: list[type] = [*_FLOOR, AutoEfficient]

__all__ = [
    "AutoEfficient",
    "__version__",
    "EfficiencyReport",
    "report_for",
    "estimate_memory",
    "MemoryEstimate",
    "EstimatePlan",
    "StepTimer",
    "best_precision",
    *_techniques_all,
]
