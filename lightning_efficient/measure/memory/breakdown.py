"""``MemoryBreakdown``: what the memory of a real training step is spent on, measured during fit.

On CUDA it reads the caching allocator's statistics (peak allocated bytes of the step) and
attributes them: parameters, gradients and optimizer state from the tensors themselves,
activations from the memory still allocated when the forward ends, temporaries the rest. On a
CPU it runs the instrument's storage tracker (``measure.memory.track.StorageTracker``) on the real
tensors, with the same categories as ``estimate_memory``. Only sampled steps are measured
(default: the second step, after one warm-up step), so the other steps run at full speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_output_path, format_bytes
from lightning_efficient.measure.memory.optimizer_models import (
    optimizer_state_bytes,
    optimizer_state_tensors,
)
from lightning_efficient.measure.memory.track import StorageTracker, _tensors, _unique_params
from lightning_efficient.measure.memory.types import CATEGORIES, MemoryEstimate
from lightning_efficient.measure.plots import check_plot_path, memory_figure, save_figure

__all__ = ["MemoryBreakdown", "check_steps", "plot_measurement"]


def plot_measurement(measured: MemoryEstimate, step: int, path: str) -> None:
    """Write ``measured``'s memory by category as a bar chart to ``path`` (PNG or SVG)."""
    title = (
        f"MemoryBreakdown, step {step}: peak {format_bytes(measured.peak_bytes)} "
        f"({measured.peak_phase}, measured)"
    )
    save_figure(memory_figure(measured.by_category, title), path)


def check_steps(name: str, value: Any) -> tuple[int, ...]:
    """A non-empty sequence of step indices (ints >= 0), as a sorted tuple without repeats."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"`{name}` must be a list of step indices (ints >= 0); got {value!r} ({type(value).__name__})."
        )
    if not value:
        raise ValueError(f"`{name}` must name at least one step index; got {value!r}.")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(
                f"`{name}` must contain ints >= 0; got {v!r} ({type(v).__name__}) in {value!r}."
            )
        if v < 0:
            raise ValueError(f"`{name}` must contain ints >= 0; got {v!r} in {value!r}.")
    return tuple(sorted(set(value)))


def _bytes_of(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in _tensors(tensors):
        st = t.untyped_storage()
        if id(st) not in seen:  # count a shared storage once (tied weights, views)
            seen.add(id(st))
            total += st.nbytes()
    return total


class MemoryBreakdown(Technique):
    """Measures the memory of sampled training steps by category and reports it.

    Args:
        sample_steps: Indices of the optimizer steps to measure (0 is the first step). The
            default ``(1,)`` measures one step after a warm-up step (optimizer state exists).
        print_table: Print the breakdown table at the end of fit (rank zero).
        log_metrics: Log ``memory/peak_bytes`` and ``memory/<category>_bytes`` to the
            trainer's logger at each measured step.
        plot: Path of a picture (``.png`` or ``.svg``) of the last measured step's memory by
            category (a bar each), written at the end of fit by rank zero (its folder must exist;
            needs matplotlib: ``pip install 'lightning-efficient[plot]'``).

    The last measurement is ``self.measurement`` (a ``MemoryEstimate``); all of them are in
    ``self.measurements`` (step index -> ``MemoryEstimate``).
    """

    def __init__(
        self,
        sample_steps: Sequence[int] = (1,),
        print_table: bool = True,
        log_metrics: bool = True,
        plot: str | None = None,
    ) -> None:
        super().__init__()
        self.sample_steps = check_steps("sample_steps", sample_steps)
        self.print_table = check_bool("print_table", print_table)
        self.log_metrics = check_bool("log_metrics", log_metrics)
        self.plot = check_output_path("plot", plot)
        check_plot_path("plot", self.plot)
        self.measurements: dict[int, MemoryEstimate] = {}
        self._step: int | None = None
        self._tracker: StorageTracker | None = None
        self._tracking = Change("no storage tracker")
        self._cuda: dict[str, Any] | None = None

    @property
    def measurement(self) -> MemoryEstimate | None:
        return self.measurements[max(self.measurements)] if self.measurements else None

    # -- when to measure -------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.measurements, self._step, self._cuda = {}, None, None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._step is not None or step not in self.sample_steps or step in self.measurements:
            return
        self._step = step
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._cuda = {"device": device, "forward_end": None, "grads": 0}
            return
        tracker = StorageTracker(fake=False)
        tracker.__enter__()
        self._tracker = tracker
        # the tracker is a dispatch mode: it leaves the mode stack when fit raises mid-step too
        self._tracking = self.record(trainer, Change("storage tracker entered", self._exit_tracker))
        tracker.phase = "forward"
        params = _unique_params(pl_module)
        tracker.label(params, "parameters")
        tracker.label(list(pl_module.buffers()), "parameters")
        tracker.label([p.grad for p in params if p.grad is not None], "gradients")
        for opt in trainer.optimizers:
            tracker.label(optimizer_state_tensors(opt), "optimizer_state")
        tracker.label(batch, "activations")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._tracker is not None:
            self._tracker.end_forward()
            self._tracker.phase = "backward"
        elif self._cuda is not None:
            self._cuda["forward_end"] = torch.cuda.memory_allocated(self._cuda["device"])

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in _unique_params(pl_module) if p.grad is not None]
        if self._tracker is not None:
            self._tracker.label(grads, "gradients")
            self._tracker.phase = "optimizer"
        elif self._cuda is not None:
            self._cuda["grads"] = max(self._cuda["grads"], _bytes_of(grads))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None or trainer.global_step <= self._step:
            return  # not measuring, or still accumulating gradients
        step = self._step
        if self._tracker is not None:
            for opt in trainer.optimizers:
                self._tracker.label(optimizer_state_tensors(opt), "optimizer_state")
            result = self._stop_tracker()
        else:
            result = self._cuda_result(trainer, pl_module)
        self._step = None
        self.measurements[step] = result
        self.report(
            trainer,
            f"measured step {step}: peak {format_bytes(result.peak_bytes)} in {result.peak_phase}",
            peak_bytes=result.peak_bytes,
            **{f"{c}_bytes": result.by_category[c] for c in CATEGORIES},
        )
        logger = trainer.logger
        if self.log_metrics and logger is not None:
            metrics = {"memory/peak_bytes": float(result.peak_bytes)}
            metrics.update({f"memory/{c}_bytes": float(v) for c, v in result.by_category.items()})
            logger.log_metrics(metrics, step=step)

    def _exit_tracker(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)

    def _stop_tracker(self) -> MemoryEstimate:
        tracker = self._tracker
        assert tracker is not None
        self._tracking.undo()
        return tracker.summary()

    def _cuda_result(self, trainer: Any, pl_module: Any) -> MemoryEstimate:
        info, self._cuda = self._cuda, None
        assert info is not None
        device = info["device"]
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        params = _bytes_of(list(_unique_params(pl_module)) + list(pl_module.buffers()))
        states = sum(optimizer_state_bytes(opt) for opt in trainer.optimizers)
        grads = info["grads"]
        forward_end = info["forward_end"] if info["forward_end"] is not None else params + states
        activations = max(0, forward_end - params - states)
        temporaries = max(0, peak - params - states - grads - activations)
        cats = {
            "parameters": params,
            "gradients": grads,
            "optimizer_state": states,
            "activations": activations,
            "temporaries": temporaries,
            "workspaces": 0,  # cuBLAS's: not told apart from temporaries by the allocator
        }
        return MemoryEstimate(
            peak_bytes=sum(cats.values()),
            by_category=cats,
            peak_phase="backward" if grads else "forward",
            phase_peaks={"step": peak},
            notes=[
                "CUDA allocator statistics; categories attributed from tensor sizes; library "
                "workspaces (cuBLAS) are counted among the temporaries"
            ],
        )

    # -- end of fit ------------------------------------------------------------------------
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._tracker is not None:  # the fit ended inside a measured step
            self._stop_tracker()
            self._step = None
        if not self.measurements:
            self.no_effect(
                f"no sampled step ran (sample_steps={list(self.sample_steps)}, the fit ended after "
                f"{trainer.global_step} steps); nothing was measured."
            )
        elif trainer.is_global_zero:
            step = max(self.measurements)
            if self.print_table:
                from lightning_efficient.core.report import print_table

                print_table(self.measurements[step].table(title=f"MemoryBreakdown: step {step}"))
            if self.plot:
                plot_measurement(self.measurements[step], step, self.plot)
        super().on_fit_end(trainer, pl_module)
