"""The instrument: memory estimate, memory tracking, step timing and the efficiency report."""

from lightning_efficient.measure.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.measure.estimate import CATEGORIES, EstimatePlan, MemoryEstimate, estimate_memory
from lightning_efficient.measure.timing import StepTimer, time_fn
from lightning_efficient.measure.track import StorageTracker, measure_step

__all__ = [
    "EfficiencyReport",
    "ReportEntry",
    "report_for",
    "CATEGORIES",
    "EstimatePlan",
    "MemoryEstimate",
    "estimate_memory",
    "StepTimer",
    "time_fn",
    "StorageTracker",
    "measure_step",
    "MemoryBreakdown",
]

# last: MemoryBreakdown is a Technique, and the techniques package imports from measure
import lightning_efficient.techniques  # noqa: E402,F401
from lightning_efficient.measure.memory import MemoryBreakdown  # noqa: E402
