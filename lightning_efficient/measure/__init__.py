"""The instrument: memory estimate, memory tracking, step timing, and the measuring callbacks.

``measure`` sits above ``core`` and below ``techniques``: it imports nothing from
``techniques``; techniques take part in an estimate through ``configure_estimate(plan)``.

The floor, by subject (each room imports the root and the rooms listed before it, never one
after; ``tests/test_layers.py`` reads it):

- the root: what every room runs on: ``step`` (the pieces of a training step, the one
  ``forward_backward``), ``scratch`` (run steps and put the module back: one ``Change``) and
  ``plots`` (the measuring callbacks' pictures);
- ``memory/``: the estimate on fake tensors and what it models, the storage tracker, the peak
  meter, ``MemoryBreakdown``;
- ``speed/``: the timer, FLOPs and MFU, tokens, the step rate, the host, ``InputStallMonitor``;
- ``trials/``: real steps on the device (a step's peak, samples/s, a stack within a budget, the
  compile trial);
- ``profiling/``: ``StepProfiler`` and its parts, the advice.

Before the rooms, the modules lay flat in ``measure/``. Their old paths
(``lightning_efficient.measure.estimate``, ...) are deprecated and still import: each is
registered below as the same module object as its new path. ``lightning_efficient.measure.memory``
is now the memory room, which still exports ``MemoryBreakdown`` (from ``memory.breakdown``).
"""

import sys

from lightning_efficient.core.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.measure.memory import (
    CATEGORIES,
    DeviceTarget,
    EstimatePlan,
    MemoryBreakdown,
    MemoryEstimate,
    StorageTracker,
    allocator,
    caching_allocator,
    cuda_kernels,
    estimate,
    estimate_memory,
    heads,
    hf_masks,
    kv_cache,
    measure_step,
    optimizer_models,
    peak,
    per_rank,
    resolve_target,
    settings,
    targets,
    track,
    types,
)
from lightning_efficient.measure.profiling import (
    Advice,
    Findings,
    StepProfiler,
    advice,
    advise,
    profile_report,
    profile_summary,
    profiler,
    step_phases,
    trace_window,
)
from lightning_efficient.measure.speed import (
    InputStallMonitor,
    StepTimer,
    count_flops,
    flops,
    host,
    input_stall,
    peak_flops,
    step_rate,
    time_fn,
    timing,
    tokens,
)
from lightning_efficient.measure.trials import compile_trial, trial

#: The deprecated flat paths: ``lightning_efficient.measure.<name>`` is the module listed here.
_MOVED = {
    module.__name__.rpartition(".")[2]: module
    for module in (
        *(allocator, caching_allocator, cuda_kernels, estimate, heads, hf_masks, kv_cache),
        *(optimizer_models, peak, per_rank, settings, targets, track, types),
        *(flops, host, input_stall, step_rate, timing, tokens),
        *(compile_trial, trial),
        *(advice, profile_report, profile_summary, profiler, step_phases, trace_window),
    )
}
for _name, _module in _MOVED.items():
    sys.modules[f"{__name__}.{_name}"] = _module

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
