"""``StepProfiler``: where each training step's time goes, how close it is to the hardware, and
what to turn on next.

Per optimizer step it times five phases with the instrument's ``StepTimer`` (CUDA events on a
GPU, so asynchronous work is timed on the device; ``perf_counter`` on a CPU):

- ``data``: waiting for the next batch (the train loader's ``next``, then the transfer to the
  device), seen through the trainer's profiler hooks;
- ``forward``: ``training_step`` up to the loss;
- ``backward``;
- ``optimizer``: ``zero_grad``, gradient clipping and the optimizer step (until the optimizer's
  step post-hook);
- ``rest``: callbacks, logging, LR schedulers, until the next fetch.

Validation is timed apart. FLOPs are counted once on fake tensors (``measure.flops``), the peak
comes from the GPU table or a measured CPU matmul, memory from ``MemoryBreakdown`` when it is on
(else the CUDA allocator's peak). ``measure.advice`` turns the figures into advice. At the end of
fit the callback prints one table, logs ``profiler/*`` metrics, adds its row to the efficiency
report, and keeps everything in ``summary`` (a plain dict).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.profilers import Profiler

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_float,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.advice import Findings, advise
from lightning_efficient.measure.flops import (
    batch_counts,
    compute_dtype,
    count_flops,
    measured_peak_flops,
    mfu,
    peak_flops,
)
from lightning_efficient.measure.memory import MemoryBreakdown
from lightning_efficient.measure.timing import StepTimer

__all__ = ["PHASES", "StepProfiler", "profile_table", "profile_png", "phase_summary"]

#: The phases of a training step, in the order they run.
PHASES = ("data", "forward", "backward", "optimizer", "rest")
_FETCH = "train_dataloader_next"  # suffix of Lightning's profiler action around the train fetch


def phase_summary(totals: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per step of each phase from ``StepTimer`` totals over ``steps`` optimizer steps."""
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1; got {steps}.")
    return {p: float(totals.get(p, 0.0)) / steps for p in PHASES}


class _FetchWatch(Profiler):
    """The trainer's profiler, wrapped: tells ``on_fetch`` when the train loader's ``next`` starts
    and forwards every call to the profiler it wraps (the user's, or Lightning's pass-through)."""

    def __init__(self, inner: Profiler, on_fetch: Any) -> None:
        # no Profiler.__init__: its attributes (dirpath, _stage, ...) are the wrapped profiler's
        self.inner = inner
        self.on_fetch = on_fetch
        self.seen = False

    def start(self, action_name: str) -> None:
        if action_name.endswith(_FETCH):
            self.seen = True
            self.on_fetch()
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank=local_rank, log_dir=log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __del__(self) -> None:  # the wrapped profiler's files belong to it, not to us
        pass

    def __getattr__(self, name: str) -> Any:  # e.g. ``dirpath`` of a user's profiler
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class StepProfiler(Technique):
    """Time each phase of a training step, count its FLOPs, compute MFU, and name the fix.

    Args:
        skip_steps: Optimizer steps not measured at the start (warm-up: lazy initialisation,
            compilation, allocator growth).
        flops_per_step: Model FLOPs of one optimizer step, if you know them better; ``None``:
            counted once on fake tensors (3 x the forward's FLOPs).
        peak_flops: Peak FLOP/s of the device for the precision in use; ``None``: the GPU table
            (dense figures of NVIDIA datasheets) or a matmul measured on the CPU.
        memory_budget: Memory the run must fit in (bytes or a string such as ``"24GiB"``) for the
            memory advice; ``None``: the device's total memory on CUDA, no memory advice on a CPU.
        compare_plain: Estimate (on fake tensors, when fit starts) the peak memory of the plain
            run (fp32, AdamW, none of this package's techniques) to compare with this run's peak.
        trace: Path of a Chrome trace (``torch.profiler``) of ``trace_steps`` steps after the
            warm-up (open it in ``chrome://tracing`` or Perfetto); ``None``: no trace. Traced steps
            are not measured.
        trace_steps: Steps in the trace.
        png: Path of a PNG with the phases per step (stacked) and memory by category.
        print_table: Print the profile table at the end of fit (rank zero).
        log_metrics: Log ``profiler/*`` metrics to the trainer's logger at the end of fit.

    After fit, ``summary`` holds the profile as a plain dict (``phases``, ``samples_per_s``,
    ``tokens_per_s``, ``flops_per_step``, ``mfu``, ``data_wait_fraction``, ``memory``,
    ``advice``, ...).
    """

    stacks = False

    def __init__(
        self,
        skip_steps: int = 2,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        memory_budget: int | str | None = None,
        compare_plain: bool = False,
        trace: str | None = None,
        trace_steps: int = 2,
        png: str | None = None,
        print_table: bool = True,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        self.skip_steps = check_int("skip_steps", skip_steps, minimum=0)
        self.flops_per_step = _positive_or_none("flops_per_step", flops_per_step)
        self.peak_flops = _positive_or_none("peak_flops", peak_flops)
        self.memory_budget = parse_bytes("memory_budget", memory_budget, allow_none=True)
        self.compare_plain = check_bool("compare_plain", compare_plain)
        self.trace = _path_or_none("trace", trace)
        self.trace_steps = check_int("trace_steps", trace_steps, minimum=1)
        self.png = _path_or_none("png", png)
        self.print_table = check_bool("print_table", print_table)
        self.log_metrics = check_bool("log_metrics", log_metrics)
        self.summary: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._timer: StepTimer | None = None
        self._phase: str | None = None
        self._measuring = False
        self._start_step = self._end_step = 0
        self._batches = self._samples = 0
        self._tokens: int | None = 0
        self._counted = False
        self._count: Any = None  # FlopCount of the first batch
        self._count_samples = 0
        self._count_error: str | None = None
        self._hooked: dict[int, Any] = {}
        self._watch: _FetchWatch | None = None
        self._trainer: Any = None
        self._tracer: Any = None
        self._traced = False
        self._plain: int | None = None

    # -- the phase machine ------------------------------------------------------------------
    def _switch(self, phase: str | None) -> None:
        timer = self._timer
        if timer is None or phase == self._phase:
            return
        if self._phase is not None:
            timer.stop(self._phase)
        if phase is not None:
            timer.start(phase)
        self._phase = phase

    @property
    def _first_measured(self) -> int:
        return self.skip_steps + (self.trace_steps if self.trace else 0)

    def _begin(self, trainer: Any, phase: str) -> None:
        self._measuring = True
        self._start_step = trainer.global_step
        self._switch(phase)

    def _on_fetch(self) -> None:
        trainer = self._trainer
        if trainer is None or not trainer.training or trainer.sanity_checking:
            return
        if self._measuring:
            self._switch("data")
        elif self._tracer is None and trainer.global_step >= self._first_measured:
            self._begin(trainer, "data")

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset()
        self.summary = None
        if stage == "fit" and self.compare_plain:
            self._plain = self._plain_estimate(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        self._timer = StepTimer(trainer.strategy.root_device)
        self._watch = _FetchWatch(trainer.profiler, self._on_fetch)
        trainer.profiler = self._watch

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        if not self._counted:
            paused, self._phase = self._phase, None  # the count is no part of any phase
            if paused is not None:
                self._timer.stop(paused)
            self._count_once(trainer, pl_module, batch)
            if paused is not None:
                self._switch(paused)
        self._hook_optimizers(trainer)
        step = trainer.global_step
        if self.trace and not self._traced and self._tracer is None and step >= self.skip_steps:
            self._start_trace(trainer)
        if not self._measuring and self._tracer is None and step >= self._first_measured:
            self._begin(trainer, "forward")  # the fetch was not seen (another fetcher)
        if self._measuring:
            self._switch("forward")
            samples, tokens = batch_counts(batch)
            self._batches += 1
            self._samples += samples
            if self._tokens is not None:
                self._tokens = None if tokens is None else self._tokens + tokens
            if self._batches % 256 == 0:
                self._timer.totals()  # read pending CUDA events now and then

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._measuring and self._phase == "forward":
            self._switch("optimizer")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._measuring:
            self._switch("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._measuring:
            self._switch("optimizer")

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._measuring and self._phase == "optimizer":
            self._switch("rest")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring and self._phase in ("forward", "backward", "optimizer"):
            self._switch("rest")  # no optimizer step this batch (accumulation) or no hook
        if self._tracer is not None and trainer.global_step >= self.skip_steps + self.trace_steps:
            self._stop_trace()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._measuring and not trainer.sanity_checking:
            self._switch("validation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._measuring and self._phase == "validation":
            self._switch("rest")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._measuring:
            self._switch(None)
            self._measuring = False
            self._end_step = trainer.global_step
        if self._tracer is not None:
            self._stop_trace()
        steps = self._end_step - self._start_step
        if self._timer is None or steps < 1:
            return
        # summarised here, before any on_fit_end shows the efficiency report (with this row)
        self.summary = summary = self._summarize(trainer, pl_module, steps)
        self.report(trainer, _change(summary), **_figures(summary))
        if self.log_metrics and trainer.logger is not None:
            trainer.logger.log_metrics(_metrics(summary), step=trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        summary = self.summary
        if summary is None:
            self.no_effect(
                f"no step was measured (skip_steps={self.skip_steps}"
                + (f", trace_steps={self.trace_steps}" if self.trace else "")
                + f"; the fit ran {trainer.global_step} steps)."
            )
        super().on_fit_end(trainer, pl_module)  # the efficiency report first, then the verdict
        if summary is not None and trainer.is_global_zero:
            if self.print_table:
                from rich.console import Console

                Console().print(profile_table(summary))
            if self.png:
                profile_png(summary, self.png)

    def restore(self, trainer: Any, pl_module: Any) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        if self._watch is not None and getattr(trainer, "profiler", None) is self._watch:
            trainer.profiler = self._watch.inner
        self._watch = None
        if self._tracer is not None:
            self._stop_trace()
        self._measuring, self._phase = False, None

    # -- helpers ----------------------------------------------------------------------------
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

        try:
            batch = _example_batch(trainer)
            if batch is None:
                self.note("compare_plain needs a datamodule with a train_dataloader; skipped.")
                return None
            cuda = trainer.strategy.root_device.type == "cuda"
            est = estimate_memory(pl_module, batch, optimizer="adamw", cuda_rounding=cuda)
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
        path = Path(self.trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        tracer.export_chrome_trace(str(path))
        self.note(f"Chrome trace of {self.trace_steps} steps written to {path}")

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
def _positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    value = check_float(name, value, minimum=0.0)
    if not value > 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number > 0 or None; got {value!r}.")
    return float(value)


def _path_or_none(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value):
        raise TypeError(
            f"`{name}` must be a file path (str) or None; got {value!r} ({type(value).__name__})."
        )
    return str(value)


def _precision(trainer: Any) -> str:
    return str(getattr(trainer, "precision", "32-true"))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _bf16_speedup(device: torch.device, precision: str) -> float | None:
    """How much faster bf16 matmuls run than fp32 ones (only asked for fp32 runs)."""
    if not precision.startswith("32"):
        return None
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            return None
        bf16, _ = peak_flops(device, "bf16")
        fp32, _ = peak_flops(device, compute_dtype(precision, device))
        return bf16 / fp32 if bf16 and fp32 else 2.0
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return measured_peak_flops("bf16", threads) / measured_peak_flops("fp32", threads)
    return None


def _recompiles(trainer: Any) -> int | None:
    counts = [
        cb.recompiles
        for cb in trainer.callbacks
        if isinstance(getattr(cb, "recompiles", None), int) and not isinstance(cb.recompiles, bool)
    ]
    return sum(counts) if counts else None


def _active(trainer: Any, precision: str) -> frozenset[str]:
    names = {type(cb).__name__ for cb in trainer.callbacks}
    names.add(type(trainer.strategy).__name__)
    if not precision.startswith(("32", "64")):
        names.add("precision")
    return frozenset(names)


def _example_batch(trainer: Any) -> Any:
    """One training batch of the trainer's datamodule, built without worker processes."""
    from torch.utils.data import DataLoader, IterableDataset

    data = getattr(trainer, "datamodule", None)
    if data is None or not hasattr(data, "train_dataloader"):
        return None
    loader = data.train_dataloader()
    if (
        isinstance(loader, DataLoader)
        and loader.batch_size
        and not isinstance(loader.dataset, IterableDataset)
    ):
        items = [loader.dataset[i] for i in range(min(loader.batch_size, len(loader.dataset)))]
        return loader.collate_fn(items)
    return next(iter(loader))


# -- rendering ---------------------------------------------------------------------------------
def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _change(s: dict[str, Any]) -> str:
    shares = ", ".join(f"{p} {s['phases'][p] / s['step_s']:.0%}" for p in PHASES if s["step_s"] > 0)
    text = f"step {s['step_s'] * 1e3:.1f} ms ({shares}); {s['samples_per_s']:.1f} samples/s"
    if s["mfu"] is not None:
        text += f"; MFU {s['mfu']:.1%}"
    advice = s["advice"]
    text += f"; advice: {', '.join(a['technique'] for a in advice)}" if advice else "; no advice"
    return text


def _figures(s: dict[str, Any]) -> dict[str, Any]:
    # (``*_s`` figures are seconds in the report: throughputs are named ``*_per_sec``)
    figures: dict[str, Any] = {
        "step_s": s["step_s"],
        "samples_per_sec": round(s["samples_per_s"], 2),
    }
    if s["tokens_per_s"] is not None:
        figures["tokens_per_sec"] = round(s["tokens_per_s"], 1)
    if s["mfu"] is not None:
        figures["mfu"] = round(s["mfu"], 4)
    figures["data_wait"] = round(s["data_wait_fraction"] or 0.0, 4)
    return figures


def _metrics(s: dict[str, Any]) -> dict[str, float]:
    out = {f"profiler/{p}_s": v for p, v in s["phases"].items()}
    out["profiler/step_s"] = s["step_s"]
    out["profiler/samples_per_s"] = s["samples_per_s"]
    for key in ("tokens_per_s", "flops_per_step", "mfu", "data_wait_fraction"):
        if s[key] is not None:
            out[f"profiler/{key}"] = float(s[key])
    return out


def profile_table(s: dict[str, Any]):  # -> rich.table.Table
    """The profile as one rich table: speed, time per phase, memory, and the verdict."""
    from rich.table import Table

    table = Table(
        title=f"StepProfiler: {s['model']} on {s['device']}, {s['precision']}, "
        f"{s['steps']} steps measured",
        show_lines=False,
    )
    table.add_column("", style="bold")
    table.add_column("per step", justify="right")
    table.add_column("", overflow="fold")
    speed = f"{s['samples_per_s']:.1f} samples/s"
    if s["tokens_per_s"] is not None:
        speed += f", {_si(s['tokens_per_s'], 'tokens/s')}"
    table.add_row("step", f"{s['step_s'] * 1e3:.1f} ms", speed)
    for p in PHASES:
        share = s["phases"][p] / s["step_s"] if s["step_s"] > 0 else 0.0
        bar = "#" * round(share * 30)
        table.add_row(f"  {p}", f"{s['phases'][p] * 1e3:.1f} ms", f"{share:5.1%} {bar}")
    if s["flops_per_step"]:
        detail = f"{_si(s['flops_per_s'] or 0, 'FLOP/s')}"
        if s["mfu"] is not None:
            detail += (
                f" = MFU {s['mfu']:.1%} of {_si(s['peak_flops'], 'FLOP/s')} ({s['peak_source']})"
            )
        else:
            detail += f"; MFU unknown: {s['peak_source']}"
        table.add_row("FLOPs", _si(s["flops_per_step"], "FLOP"), detail)
    mem = s["memory"]
    if mem["peak_bytes"] is not None:
        cats = mem["by_category"] or {}
        top = sorted(cats.items(), key=lambda kv: -kv[1])[:3]
        detail = f"this run ({mem['source']})"
        if top and mem["peak_bytes"]:
            detail += ": " + ", ".join(
                f"{k.replace('_', ' ')} {v / mem['peak_bytes']:.0%}" for k, v in top
            )
        table.add_row("memory peak", format_bytes(mem["peak_bytes"]), detail)
    if s["plain_peak_bytes"]:
        detail = "plain run, fp32 AdamW, no techniques (estimated)"
        if mem["peak_bytes"]:
            detail += f"; this run {mem['peak_bytes'] / s['plain_peak_bytes'] - 1:+.0%}"
        table.add_row("  vs plain", format_bytes(s["plain_peak_bytes"]), detail)
    if mem["capacity_bytes"]:
        table.add_row("  capacity", format_bytes(mem["capacity_bytes"]), "")
    if s["advice"]:
        for i, a in enumerate(s["advice"], 1):
            table.add_row(
                f"{i}. {a['technique']}", "", f"{a['reason']}\n[dim]{_escape(a['yaml'])}[/dim]"
            )
    else:
        table.add_row(
            "verdict", "", "no rule fired: no input stall, memory or precision issue found"
        )
    return table


def _escape(text: str) -> str:
    return text.replace("[", "\\[")


def profile_png(s: dict[str, Any], path: str | Path) -> Path:
    """A PNG of the profile: the phases of a step stacked (ms), and memory by category."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        from lightning_efficient.core.validate import missing_extra

        raise missing_extra("matplotlib", "plot", "profile_png") from err
    cats = s["memory"]["by_category"]
    fig, axes = plt.subplots(1, 2 if cats else 1, figsize=(9 if cats else 5, 2.8), squeeze=False)
    ax = axes[0][0]
    left = 0.0
    for p in PHASES:
        ms = s["phases"][p] * 1e3
        ax.barh([0], [ms], left=left, label=p)
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("ms per step")
    ax.set_title("where a step's time goes")
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if cats:
        ax2 = axes[0][1]
        ax2.bar(range(len(cats)), [v / 2**20 for v in cats.values()], color="#4c72b0")
        ax2.set_xticks(range(len(cats)), [c.replace("_", "\n") for c in cats], fontsize=7)
        ax2.set_ylabel("MiB at the peak")
        ax2.set_title("memory by category")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
