"""The instrument: memory estimate, memory tracking, step timing, and the measuring callbacks.

``measure`` sits above ``core`` and below ``techniques``: it imports nothing from
``techniques``; techniques take part in an estimate through ``configure_estimate(plan)``.
"""

from lightning_efficient.core.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.measure.advice import Advice, Findings, advise
from lightning_efficient.measure.estimate import estimate_memory
from lightning_efficient.measure.flops import count_flops, peak_flops
from lightning_efficient.measure.input_stall import InputStallMonitor
from lightning_efficient.measure.memory import MemoryBreakdown
from lightning_efficient.measure.profiler import StepProfiler
from lightning_efficient.measure.targets import DeviceTarget, resolve_target
from lightning_efficient.measure.timing import StepTimer, time_fn
from lightning_efficient.measure.track import StorageTracker, measure_step
from lightning_efficient.measure.types import CATEGORIES, EstimatePlan, MemoryEstimate

__all__ = [
    "Advice",
    "CATEGORIES",
    "DeviceTarget",
    "EfficiencyReport",
    "EstimatePlan",
    "InputStallMonitor",
    "Findings",
    "MemoryBreakdown",
    "MemoryEstimate",
    "ReportEntry",
    "StepProfiler",
    "StepTimer",
    "StorageTracker",
    "advise",
    "count_flops",
    "estimate_memory",
    "measure_step",
    "peak_flops",
    "report_for",
    "resolve_target",
    "time_fn",
]
