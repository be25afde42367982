"""What ``StepProfiler`` does between its hooks: hooking the optimizers, counting FLOPs once,
the plain-run estimate, the trace window and the summary of the measured steps. Functions of the
profiler's state (``self``), kept out of the callback class so that it only decides when."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_efficient.measure.advice import Findings, advise
from lightning_efficient.measure.flops import (
    compute_dtype,
    count_flops,
    mfu,
    peak_flops,
)
from lightning_efficient.measure.memory import MemoryBreakdown
from lightning_efficient.measure.profile_report import (
    _active,
    _bf16_speedup,
    _device_name,
    _example_batch,
    _precision,
    _recompiles,
    phase_summary,
)
from lightning_efficient.measure.tokens import batch_counts


def _hook_optimizers(self, trainer: Any) -> None:
    for opt in trainer.optimizers:
        opt = getattr(opt, "optimizer", opt)
        if id(opt) not in self._hooked and hasattr(opt, "register_step_post_hook"):
            self._hooked[id(opt)] = opt.register_step_post_hook(self._after_optimizer_step)


def _count_once(self, trainer: Any, pl_module: Any, batch: Any) -> None:
    self._counted = True
    self._count_samples = batch_counts(batch)[0]
    if self.flops_per_step is not None:
        return
    sharder = trainer.strategy if getattr(trainer.strategy, "shards_parameters", False) else None
    if sharder is not None:  # a fake forward would run the strategy's gather hooks on fake tensors
        self._count_error = f"parameters sharded by {type(sharder).__name__}"
        self.note(
            f"FLOPs are not counted on fake tensors when {type(sharder).__name__} shards the "
            "parameters; MFU is unknown. Pass StepProfiler(flops_per_step=...) to set them."
        )
        return
    try:
        self._count = count_flops(pl_module, batch, precision=_precision(trainer))
    except Exception as err:  # a model that needs real values; MFU is then unknown
        self._count_error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        self.note(
            f"could not count FLOPs on fake tensors ({self._count_error}); MFU is unknown. "
            "Pass StepProfiler(flops_per_step=...) to set them."
        )


def _plain_estimate(self, trainer: Any, pl_module: Any) -> int | None:
    from lightning_efficient.measure.estimate import estimate_memory

    if getattr(trainer.strategy, "shards_parameters", False):
        self.note("compare_plain: not estimated when the strategy shards the parameters; skipped.")
        return None
    try:
        batch = _example_batch(trainer)
        if batch is None:
            self.note("compare_plain needs a datamodule with a train_dataloader; skipped.")
            return None
        device = trainer.strategy.root_device  # its kernels, workspaces and rounding
        est = estimate_memory(pl_module, batch, optimizer="adamw", device=device)
    except Exception as err:
        self.note(f"compare_plain: the plain estimate failed ({type(err).__name__}: {err}).")
        return None
    return int(est.peak_bytes)


def _start_trace(self, trainer: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.strategy.root_device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    self._tracer = profile(activities=activities, record_shapes=False)
    self._tracer.start()


def _stop_trace(self) -> None:
    tracer, self._tracer = self._tracer, None
    self._traced = True
    tracer.stop()
    trainer = self._trainer
    world = getattr(trainer, "world_size", 1) if trainer is not None else 1
    rank = getattr(trainer, "global_rank", 0) if trainer is not None else 0
    path = rank_trace_path(self.trace, rank, world)
    error = export_trace(tracer, path)
    if error is not None:  # every rank says its own (a note on rank zero would hide rank 1's)
        message = f"StepProfiler: the Chrome trace was not written to {path}: {error}"
        warnings.warn(message, stacklevel=2)
        return
    where = path if world == 1 else rank_trace_path(self.trace, "<rank>", world)
    self.note(
        f"Chrome trace of {self.trace_steps} steps written to {where}"
        + (f" (one file per rank, {world} ranks)" if world > 1 else "")
    )


def rank_trace_path(path: str, rank: Any, world: int) -> Path:
    """The trace file of ``rank``: ``path`` itself on one process, else ``.rank<r>`` before its
    suffix (``trace.json`` -> ``trace.rank1.json``, ``trace.json.gz`` -> ``trace.rank1.json.gz``),
    so that ranks never write one file."""
    path = Path(path)
    if world <= 1:
        return path
    name = path.name
    suffix = ".json.gz" if name.endswith(".json.gz") else path.suffix
    stem = name[: len(name) - len(suffix)] if suffix else name
    return path.with_name(f"{stem}.rank{rank}{suffix}")


def export_trace(tracer: Any, path: Path) -> str | None:
    """Write ``tracer``'s Chrome trace to ``path`` through a file next to it (a reader never sees
    half a trace, and a folder at ``path`` is never replaced); ``None`` when written, else why
    not."""
    suffix = ".json.gz" if path.name.endswith(".gz") else ".json"
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial{suffix}")
    try:
        tracer.export_chrome_trace(str(partial))
        if not partial.is_file() or partial.stat().st_size == 0:
            return "the profiler wrote nothing"
        if path.is_dir():
            return "it is a folder"
        os.replace(partial, path)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        partial.unlink(missing_ok=True)
    return None


def _summarize(self, trainer: Any, pl_module: Any, steps: int) -> dict[str, Any]:
    device = trainer.strategy.root_device
    precision = _precision(trainer)
    phases = phase_summary(self._timer.totals(), steps)
    validation_s = float(self._timer.totals().get("validation", 0.0))
    step_s = sum(phases.values())
    seconds = step_s * steps
    samples_per_step = self._samples / steps
    count = self._count
    if self.flops_per_step is not None:
        flops_per_step: float | None = self.flops_per_step
    elif count is not None and self._count_samples:
        flops_per_step = count.step / self._count_samples * samples_per_step
    else:
        flops_per_step = None
    dtype = compute_dtype(precision, device)
    if self.peak_flops is not None:
        peak, peak_source = self.peak_flops, "given (peak_flops)"
    else:
        peak, peak_source = peak_flops(device, dtype)
    achieved = flops_per_step / step_s if flops_per_step and step_s > 0 else None
    utilization = mfu(achieved, peak)
    micro = self._batches / steps
    ops = count.ops * 3 * micro if count is not None and count.ops else None
    memory = self._memory(trainer, device)
    findings = Findings(
        data_wait_fraction=phases["data"] / step_s if step_s > 0 else None,
        precision=precision,
        bf16_speedup=_bf16_speedup(device, precision),
        mfu=utilization,
        seconds_per_op=(phases["forward"] + phases["backward"]) / ops if ops else None,
        peak_bytes=memory["peak_bytes"],
        capacity_bytes=memory["capacity_bytes"],
        by_category=memory["by_category"],
        recompiles=_recompiles(trainer),
        active=_active(trainer, precision),
    )
    return {
        "model": type(pl_module).__name__,
        "device": _device_name(device),
        "precision": precision,
        "steps": steps,
        "phases": phases,
        "step_s": step_s,
        "validation_s": validation_s,
        "samples_per_s": self._samples / seconds if seconds > 0 else 0.0,
        "tokens_per_s": self._tokens / seconds if self._tokens and seconds > 0 else None,
        "flops_per_step": flops_per_step,
        "flops_per_s": achieved,
        "peak_flops": peak,
        "peak_source": peak_source,
        "mfu": utilization,
        "data_wait_fraction": findings.data_wait_fraction,
        "memory": memory,
        "plain_peak_bytes": self._plain,
        "fetch_seen": bool(self._watch is not None and self._watch.seen),
        "advice": [a.to_dict() for a in advise(findings)],
    }


def _memory(self, trainer: Any, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "peak_bytes": None,
        "by_category": None,
        "capacity_bytes": self.memory_budget,
        "source": None,
    }
    breakdown = next((cb for cb in trainer.callbacks if isinstance(cb, MemoryBreakdown)), None)
    measured = breakdown.measurement if breakdown is not None else None
    if measured is not None:
        out["peak_bytes"] = int(measured.peak_bytes)
        out["by_category"] = {k: int(v) for k, v in measured.by_category.items()}
        out["source"] = f"MemoryBreakdown, step {max(breakdown.measurements)}"
    elif device.type == "cuda":
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["source"] = "CUDA allocator peak over the fit"
    if out["capacity_bytes"] is None and device.type == "cuda":
        out["capacity_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    return out


# -- small pure helpers ----------------------------------------------------------------------
