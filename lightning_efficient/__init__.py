"""lightning-efficient: Lightning callbacks and strategies that make training fit and run fast."""

__version__ = "0.1.0"

from lightning_efficient.measure import EfficiencyReport, report_for  # noqa: E402
from lightning_efficient.techniques import TECHNIQUES, NoEffectWarning, Technique  # noqa: E402
from lightning_efficient.measure import (  # noqa: E402
    EstimatePlan,
    MemoryBreakdown,
    MemoryEstimate,
    StepTimer,
    estimate_memory,
)

__all__ = ["__version__", "TECHNIQUES", "Technique", "NoEffectWarning", "EfficiencyReport", "report_for",
           "estimate_memory", "MemoryEstimate", "EstimatePlan", "MemoryBreakdown", "StepTimer"]
