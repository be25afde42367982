"""The instrument: memory estimate, memory tracking, step timing, and the measuring callbacks.

``measure`` sits above ``core`` and below ``techniques``: it imports nothing from
``techniques``; techniques take part in an estimate through ``configure_estimate(plan)``.

The floor, by subject (each room imports the root and the rooms listed before it, never one
after; ``tests/test_layers.py`` reads it):

- the root: what every room runs on: ``step`` (the pieces of a training step; ``run_step``, the
  one call of the user's step), ``scratch`` (the one put-back: every run of the user's step is
  inside it) and ``plots`` (the measuring callbacks' pictures);
- ``memory/``: the estimate on fake tensors and what it models, the storage tracker, the peak
  meter, ``MemoryBreakdown``;
- ``speed/``: the timer, FLOPs and MFU, tokens, the step rate, the host, ``InputStallMonitor``;
- ``trials/``: real steps on the device (a step's peak, samples/s, a stack within a budget, the
  compile trial);
- ``profiling/``: ``StepProfiler`` and its parts, the advice.

A module is imported from its room (``lightning_efficient.measure.memory.estimate``); the public
names from here. ``tests/measure/test_measure_paths.py`` checks that no other path to a module
exists.
"""

from lightning_efficient.core.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.measure.memory import (
    CATEGORIES,
    DeviceTarget,
    EstimatePlan,
    MemoryBreakdown,
    MemoryEstimate,
    StorageTracker,
    estimate_memory,
    measure_step,
    resolve_target,
)
from lightning_efficient.measure.profiling import (
    Advice,
    Findings,
    StepProfiler,
    advise,
)
from lightning_efficient.measure.speed import (
    InputStallMonitor,
    StepTimer,
    count_flops,
    peak_flops,
    time_fn,
)

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
