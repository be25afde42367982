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

from typing import Any

import torch
from lightning.pytorch.profilers import Profiler

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_int,
    check_output_path,
    parse_bytes,
)
from lightning_efficient.measure import profile_steps as _methods
from lightning_efficient.measure.profile_report import (
    PHASES,
    _change,
    _figures,
    _metrics,
    _positive_or_none,
    phase_summary,
    profile_png,
    profile_table,
)
from lightning_efficient.measure.timing import StepTimer
from lightning_efficient.measure.tokens import batch_counts

__all__ = ["PHASES", "StepProfiler", "profile_table", "profile_png", "phase_summary"]

#: The phases of a training step, in the order they run.
_FETCH = "train_dataloader_next"  # suffix of Lightning's profiler action around the train fetch


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
            are not measured. Under several ranks each writes its own file, ``.rank<r>`` before
            the suffix (``trace.rank1.json``). Its folder must exist.
        trace_steps: Steps in the trace.
        png: Path of a PNG with the phases per step (stacked) and memory by category (its folder
            must exist; written by rank zero).
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
        self.trace = check_output_path("trace", trace)
        self.trace_steps = check_int("trace_steps", trace_steps, minimum=1)
        self.png = check_output_path("png", png)
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

    # measuring and summarising, as functions of the profiler's state (below the class)
    _hook_optimizers = _methods._hook_optimizers
    _count_once = _methods._count_once
    _plain_estimate = _methods._plain_estimate
    _start_trace = _methods._start_trace
    _stop_trace = _methods._stop_trace
    _summarize = _methods._summarize
    _memory = _methods._memory
