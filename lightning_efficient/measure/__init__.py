"""The instrument: memory estimate, memory tracking, step timing, and the measuring callbacks.

``measure`` sits above ``core`` and below ``techniques``: it imports nothing from
``techniques``; techniques take part in an estimate through ``configure_estimate(plan)``.
"""

from lightning_efficient.core.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.measure.estimate import estimate_memory
from lightning_efficient.measure.input_stall import InputStallMonitor
from lightning_efficient.measure.memory import MemoryBreakdown
from lightning_efficient.measure.timing import StepTimer, time_fn
from lightning_efficient.measure.track import StorageTracker, measure_step
from lightning_efficient.measure.types import CATEGORIES, EstimatePlan, MemoryEstimate

__all__ = [
    "CATEGORIES",
    "EfficiencyReport",
    "EstimatePlan",
    "InputStallMonitor",
    "MemoryBreakdown",
    "MemoryEstimate",
    "ReportEntry",
    "StepTimer",
    "StorageTracker",
    "estimate_memory",
    "measure_step",
    "report_for",
    "time_fn",
]
