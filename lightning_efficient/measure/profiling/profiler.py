"""``StepProfiler``: where each training step's time goes, how close it is to the hardware, and
what to turn on next.

Per optimizer step it times five phases with the instrument's ``StepTimer`` (CUDA events on a
GPU, so asynchronous work is timed on the device; ``perf_counter`` on a CPU):

- ``data``: waiting for the next batch (the train loader's ``next``, then the transfer to the
  device), seen through the trainer's profiler hooks; in a ``training_step(self,
  dataloader_iter)``, the ``next`` the step calls;
- ``forward``: ``training_step`` up to the loss;
- ``backward``;
- ``optimizer``: ``zero_grad``, gradient clipping and the optimizer step (until the optimizer's
  step post-hook);
- ``rest``: callbacks, logging, LR schedulers, until the next fetch.

Validation is timed apart. FLOPs are counted once on fake tensors (``measure.speed.flops``), the
peak comes from the GPU table or a measured CPU matmul, memory from ``MemoryBreakdown`` when it is
on (else the CUDA allocator's peak). ``measure.profiling.advice`` turns the figures into advice. At
the end of fit the callback prints one table, logs ``profiler/*`` metrics, adds its row to the
efficiency report, and keeps everything in ``summary`` (a plain dict).

The callback only decides when: ``measure.profiling.step_phases.StepPhases`` keeps the phases and
counts, ``measure.profiling.trace_window.TraceWindow`` the trace,
``measure.profiling.profile_summary`` works the figures out and ``measure.profiling.profile_report``
renders them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.report import print_table
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_float,
    check_int,
    check_output_path,
    parse_bytes,
)
from lightning_efficient.measure.plots import check_plot_path
from lightning_efficient.measure.profiling.profile_report import (
    PHASES,
    logger_metrics,
    nothing_measured,
    phase_summary,
    profile_png,
    profile_table,
    report_figures,
    report_line,
)
from lightning_efficient.measure.profiling.profile_summary import (
    first_batch_count,
    plain_peak,
    summarize,
)
from lightning_efficient.measure.profiling.step_phases import StepPhases, StepPostHooks
from lightning_efficient.measure.profiling.trace_window import TraceWindow
from lightning_efficient.measure.speed.fetch_watch import FetchWatch

__all__ = ["PHASES", "StepProfiler", "profile_table", "profile_png", "phase_summary"]


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
            are not measured. Under several ranks each writes its own file, ``.rank<r>`` before
            the suffix (``trace.rank1.json``). Its folder must exist.
        trace_steps: Steps in the trace.
        plot: Path of a picture (``.png`` or ``.svg``) of the phases per step (stacked) and
            memory by category, written at the end of fit by rank zero (its folder must exist;
            needs matplotlib: ``pip install 'lightning-efficient[plot]'``).
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
        plot: str | None = None,
        print_table: bool = True,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        self.skip_steps = check_int("skip_steps", skip_steps, minimum=0)
        self.flops_per_step = _positive_or_none("flops_per_step", flops_per_step)
        self.peak_flops = _positive_or_none("peak_flops", peak_flops)
        self.memory_budget = parse_bytes("memory_budget", memory_budget, allow_none=True)
        self.compare_plain = check_bool("compare_plain", compare_plain)
        self.trace = check_output_path("trace", trace)
        self.trace_steps = check_int("trace_steps", trace_steps, minimum=1)
        self.plot = check_output_path("plot", plot)
        check_plot_path("plot", self.plot)
        self.print_table = check_bool("print_table", print_table)
        self.log_metrics = check_bool("log_metrics", log_metrics)
        self.summary: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        self._phases: StepPhases | None = None
        self._watch: FetchWatch | None = None
        self._trace: TraceWindow | None = None
        self._trainer: Any = None
        self._count: Any = None  # FlopCount of the first batch
        self._count_samples: int | None = None  # its samples (None: not counted yet)
        self._step_hooks = StepPostHooks(self._after_optimizer_step)
        self._plain: int | None = None

    def _measures(self, step: int) -> bool:
        """Whether optimizer step ``step`` is measured: after the warm-up and the trace."""
        tracing = self._trace is not None and self._trace.recording
        return not tracing and step >= self.skip_steps + (self.trace_steps if self.trace else 0)

    def _on_fetch(self) -> None:
        trainer, phases = self._trainer, self._phases
        if trainer is None or phases is None or not trainer.training or trainer.sanity_checking:
            return
        phases.fetch(trainer.global_step, self._measures(trainer.global_step))

    # -- hooks ------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._reset()
        self.summary = None
        if stage == "fit" and self.compare_plain:
            self._plain, why_not = plain_peak(trainer, pl_module)
            if why_not:
                self.note(why_not)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        self._phases = StepPhases(trainer.strategy.root_device)
        self._watch = FetchWatch(trainer.profiler, self._on_fetch, self._phases.fetched)
        self.record(trainer, patch_attribute(trainer, "profiler", self._watch))
        if self.trace:
            self._trace = TraceWindow(self.trace, self.trace_steps, first=self.skip_steps)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        phases = self._phases
        if phases is None:
            return
        if self._count_samples is None:  # once; the count is no part of any phase
            flops = self.flops_per_step is None
            count = phases.paused(lambda: first_batch_count(trainer, pl_module, batch, flops))
            self._count, self._count_samples, why_not = count
            if why_not:
                self.note(why_not)
        for change in self._step_hooks.new(trainer.optimizers):
            self.record(trainer, change)
        step, trace = trainer.global_step, self._trace
        if trace is not None and trace.starts_at(step):
            trace.start(trainer.strategy.root_device)
            self.record(trainer, Change("trace recording", self._stop_trace))
        phases.enter("forward", step, self._measures(step))  # begins here: the fetch was unseen
        if phases.measuring:
            phases.count(batch)

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._switch_from("forward", "optimizer")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._switch_from(None, "backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._switch_from(None, "optimizer")

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._switch_from("optimizer", "rest")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # no optimizer step this batch (accumulation) or no hook: the rest of the batch
        self._switch_from(("forward", "backward", "optimizer"), "rest")
        if self._trace is not None and self._trace.ends_at(trainer.global_step):
            self._stop_trace()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._switch_from(None, "validation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._switch_from("validation", "rest")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        phases = self._phases
        if phases is not None:
            phases.end(trainer.global_step)
        self._stop_trace()
        if phases is None or phases.steps < 1:
            return
        # summarised here, before any on_fit_end shows the efficiency report (with this row)
        self.summary = summary = summarize(
            trainer,
            pl_module,
            phases,
            count=self._count,
            count_samples=self._count_samples or 0,
            flops_per_step=self.flops_per_step,
            given_peak_flops=self.peak_flops,
            memory_budget=self.memory_budget,
            plain_peak_bytes=self._plain,
            fetch_seen=bool(self._watch is not None and self._watch.seen),
        )
        self.report(trainer, report_line(summary), **report_figures(summary))
        if self.log_metrics and trainer.logger is not None:
            trainer.logger.log_metrics(logger_metrics(summary), step=trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        summary = self.summary
        if summary is None:
            traced = self.trace_steps if self.trace else None
            self.no_effect(nothing_measured(self.skip_steps, traced, trainer.global_step))
        super().on_fit_end(trainer, pl_module)  # the efficiency report first, then the verdict
        if summary is not None and trainer.is_global_zero:
            if self.print_table:
                print_table(profile_table(summary))
            if self.plot:
                profile_png(summary, self.plot)

    # -- helpers ----------------------------------------------------------------------------
    def _switch_from(self, current: str | tuple[str, ...] | None, phase: str) -> None:
        if self._phases is not None:
            self._phases.switch_from(current, phase)

    def _stop_trace(self) -> None:
        written, error = self._trace.stop(self._trainer) if self._trace else ("", None)
        if error is not None:  # every rank says its own (a note on rank zero would hide rank 1's)
            warnings.warn(f"StepProfiler: {error}", stacklevel=2)
        elif written:
            self.note(written)


def _positive_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    value = check_float(name, value, minimum=0.0)
    if not value > 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number > 0 or None; got {value!r}.")
    return float(value)
