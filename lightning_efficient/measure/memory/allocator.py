"""The CPU allocator's own peak, from ``torch.profiler``'s memory events: an instrument that does
not share the storage tracker's view.

The storage tracker (``measure.memory.track``) sees the tensors that operations return; the
allocator also sees what kernels allocate inside an operation and free before returning (oneDNN
convolution workspaces, the attention matrix of SDPA's math path). ``torch.profiler.profile(
profile_memory=True)`` records one event per allocation and free with its size; the running total of
those sizes, on top of what was live when profiling began, is the allocator's peak. Comparing the
estimate with it judges the instrument by something other than itself.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.memory.types import MemoryEstimate
from lightning_efficient.measure.scratch import scratch

__all__ = ["running_peak", "memory_events", "profiled_peak", "live_bytes", "allocator_step_peak"]

#: ``Device Type`` of the CPU in the profiler's memory events (``c10::DeviceType::CPU``).
CPU = 0


def running_peak(sizes: Iterable[int], start: int = 0) -> int:
    """The highest running total of signed allocation sizes (``+n`` allocated, ``-n`` freed),
    starting from ``start`` bytes (the total before the first event counts too)."""
    total = peak = int(start)
    for n in sizes:
        total += int(n)
        peak = max(peak, total)
    return peak


def memory_events(trace: Mapping[str, Any] | list[Any], device_type: int = CPU) -> list[int]:
    """The signed sizes of the allocator events of one device in a Chrome trace (what
    ``torch.profiler.profile.export_chrome_trace`` writes), in time order."""
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    found = []
    for i, ev in enumerate(events):
        args = ev.get("args") or {}
        if ev.get("name") != "[memory]" or "Bytes" not in args:
            continue
        if int(args.get("Device Type", CPU)) != device_type:
            continue
        found.append((float(ev.get("ts", 0.0)), i, int(args["Bytes"])))
    found.sort()  # by time; events of one instant keep their order in the trace
    return [n for _, _, n in found]


def profiled_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under ``torch.profiler`` with memory profiling; return its result and the
    CPU allocator's peak above what was allocated when it started (blocks allocated before and
    freed inside are not seen by the profiler, so they do not lower it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    return result, running_peak(memory_events(trace))


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            seen[st.data_ptr()] = int(st.nbytes())
    return sum(seen.values())


def allocator_step_peak(
    model: torch.nn.Module, batch: Any, **kwargs: Any
) -> tuple[MemoryEstimate, int]:
    """``measure_step(model, batch, **kwargs)`` (real steps on the CPU) under the profiler: the
    storage tracker's result, and the allocator's peak in bytes (the parameters, buffers and
    batch live before the steps, plus the profiled peak above them). The model is put back
    after, its copies taken before the profiler starts. Start from a model without gradients or
    optimizer state, so that nothing allocated before is freed inside."""
    from lightning_efficient.core._internals import tree_flatten

    before = [*model.parameters(), *model.buffers(), *tree_flatten(batch)[0]]
    base = live_bytes(t for t in before if isinstance(t, torch.Tensor))
    with scratch(model):  # its copies made before the profiler starts
        tracked, peak = profiled_peak(lambda: measure_step(model, batch, copies=False, **kwargs))
    return tracked, base + peak
