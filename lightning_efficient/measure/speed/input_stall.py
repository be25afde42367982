"""``InputStallMonitor``: the share of the training loop's time spent waiting for the next batch.

A measuring callback (it changes nothing but the trainer's profiler, wrapped for the fit): it
times, with the instrument's ``StepTimer``, the loop's wait for each batch (from the start of the
train loader's ``next``, seen through ``FetchWatch``, to the batch's step; or, in a
``training_step`` that takes the ``dataloader_iter``, the ``next`` it calls), the step, and the
loop's own work between the two (callbacks, logging, schedulers), and warns once, with a concrete
fix, when the loader holds training back. Also importable from
``lightning_efficient.techniques.dataloading`` (where it lived before).
"""

from __future__ import annotations

import math
from typing import Any

from torch.utils.data import DataLoader

from lightning_efficient.core.change import patch_attribute
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_float, check_int
from lightning_efficient.measure.speed.fetch_watch import FetchWatch, StepFetch
from lightning_efficient.measure.speed.host import default_max_workers, usable_cores
from lightning_efficient.measure.speed.timing import StepTimer

__all__ = ["InputStallMonitor", "stall_fraction", "worker_advice", "workers_to_hide"]


def stall_fraction(wait: float, step: float, rest: float = 0.0) -> float | None:
    """The share of the loop's time spent waiting for batches: ``wait / (wait + step + rest)``
    (``None`` before anything was measured)."""
    total = wait + step + rest
    return wait / total if total > 0 else None


def worker_advice(wait: float, cycle: float, workers: int, devices: int = 1) -> str:
    """The fix for a measured ``wait`` over the loop's ``cycle`` with ``workers`` now: the
    workers that hide it (``workers_to_hide``), never more than ``default_max_workers`` (the cap
    ``DataLoaderTuning`` searches to); past the cap, faster loading as well."""
    need, most = workers_to_hide(wait, cycle, workers), default_max_workers(devices)
    cores = f"this machine has {usable_cores()} usable cores"
    if need <= most:
        return (
            f"Trainer(callbacks=[DataLoaderTuning(num_workers={need})]) (now {workers} workers; "
            f"{cores}), or DevicePreload() if the dataset fits in device memory."
        )
    return (
        f"DevicePreload() if the dataset fits in device memory, or faster loading (cheaper "
        f"decoding, pre-tokenized data): hiding this wait would take {need} workers, more than the "
        f"{most} worth running here ({cores}); Trainer(callbacks=[DataLoaderTuning("
        f"num_workers={most})]) shortens it (now {workers} workers)."
    )


def workers_to_hide(wait: float, cycle: float, workers: int) -> int:
    """Loader workers that hide a measured ``wait`` behind the loop's ``cycle`` (its step and its
    own work between steps, seconds over the same steps), from ``workers`` now: each batch takes
    about ``wait + cycle`` per worker with ``workers`` of them, ``wait`` with none, and ``n``
    workers deliver one per ``load / n``. At least one more than now."""
    load = wait if workers == 0 else workers * (wait + cycle)
    need = math.ceil(load / cycle) if cycle > 0 else workers + 1
    return max(need, workers + 1)


class InputStallMonitor(Technique):
    """Measure the share of the training loop's time spent waiting for the next batch; warn once
    past a threshold.

    Three regions per step, timed with the instrument's ``StepTimer`` (CUDA events on a GPU, so
    the wait is expected to be the time the GPU sat idle; not yet measured on a GPU): the *wait*,
    from the start of the train loader's ``next`` (Lightning's profiler action, seen through
    ``FetchWatch``) to ``on_train_batch_start`` (the batch is moved to the device in between);
    the *step*, from
    ``on_train_batch_start`` to ``on_train_batch_end``, less the wait for any batch the step
    fetches itself (a ``training_step(self, dataloader_iter)`` calls the loader's ``next``: that
    call counts as the wait); the *rest*, the loop's own work from a
    step's end to the next fetch (callbacks, logging, LR schedulers), which more loader workers
    would not shorten. Validation is cut out, the first batch and its step never counted. Where no fetch is
    seen (a loop that fetches without Lightning's profiler action), the whole gap between two
    steps counts as the wait: it holds the loop's own work and misses any fetch made inside the
    step, so it bounds the stall neither way, and the report says so. After ``check_after`` steps (and again when training
    ends, if not decided yet) it warns once, with a concrete fix, when
    ``wait / (wait + step + rest) > threshold``. The fraction goes to the efficiency report.

    Args:
        threshold: Stall fraction that triggers the warning, in [0, 1).
        check_after: Steps measured before the first decision (the first batch is never counted).
    """

    def __init__(self, threshold: float = 0.1, check_after: int = 20) -> None:
        super().__init__()
        self.threshold = check_float(
            "threshold", threshold, minimum=0.0, maximum=1.0, max_exclusive=True
        )
        self.check_after = check_int("check_after", check_after, minimum=1)
        self._timer: Any = None
        self._open: str | None = None  # the region running between two steps: "rest" or "wait"
        self._in_step = False
        self._step_fetch = StepFetch(self._switch)  # a fetch the step makes itself
        self._fetch_seen = False  # the train loader's next, seen
        self._steps = 0
        self._decided = False
        self.stall_fraction: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._timer = StepTimer(trainer.strategy.root_device)
        self._open, self._in_step, self._fetch_seen, self._steps = None, False, False, 0
        self._step_fetch, self._decided = StepFetch(self._switch), False
        self.stall_fraction = None
        watch = FetchWatch(trainer.profiler, lambda: self._on_fetch(trainer), self._on_fetched)
        self.record(trainer, patch_attribute(trainer, "profiler", watch))

    def _on_fetch(self, trainer: Any) -> None:
        if self._timer is None or self._steps == 0 or not trainer.training:
            return  # the first batch is never counted
        self._fetch_seen = True
        if self._in_step:  # the step fetches its batch itself (it takes the dataloader_iter)
            self._step_fetch.begin("step", "wait")
            return
        self._close()
        self._timer.start("wait")
        self._open = "wait"

    def _on_fetched(self) -> None:
        self._step_fetch.end()  # back to the step that fetched, if it did

    def _switch(self, old: str, new: str) -> None:
        self._timer.stop(old)
        self._timer.start(new)

    def _close(self) -> None:
        if self._open is not None:
            self._timer.stop(self._open)
            self._open = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._close()
        self._end_step()  # a step that never reached its end (it raised inside the loop)
        if not self._decided and self._steps >= self.check_after:
            self._decide(trainer)  # no region is open here
        elif self._steps % 256 == 0:
            self._timer.totals()  # read pending CUDA events now and then, so they do not pile up
        if self._steps:  # the first step (allocation, compilation, profilers starting) is not
            self._timer.start("step")  # the loop's steady work
            self._in_step = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._end_step()
        self._steps += 1
        self._timer.start("rest")
        self._open = "rest"

    def _end_step(self) -> None:
        self._on_fetched()
        if self._in_step:
            self._timer.stop("step")
            self._in_step = False

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # what follows is validation, not the loop's work between steps nor a wait for data
        if self._timer is not None:
            self._close()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._close()
            self._end_step()

    @property
    def fetch_seen(self) -> bool:
        """Whether the train loader's ``next`` was seen, between steps or inside them (else the
        wait is the whole gap between two steps)."""
        return self._fetch_seen

    def measured(self) -> tuple[float, float, float]:
        """(wait, step, rest) seconds measured so far (call between steps). Where the fetch was
        not seen, the rest is counted as the wait (the whole gap between steps) and is 0."""
        if self._timer is None:
            return 0.0, 0.0, 0.0
        totals = self._timer.totals()
        wait, step, rest = (float(totals.get(k, 0.0)) for k in ("wait", "step", "rest"))
        return (wait, step, rest) if self.fetch_seen else (wait + rest, step, 0.0)

    def _decide(self, trainer: Any) -> None:
        wait, step, rest = self.measured()
        fraction = stall_fraction(wait, step, rest)
        if fraction is None:
            return
        self._decided = True
        self.stall_fraction = fraction
        if fraction > self.threshold:
            self.warn(
                f"{fraction:.0%} of the step time is spent waiting for the next batch "
                f"(threshold {self.threshold:.0%}). Fix: {self._fix(trainer, wait, step + rest)}"
            )

    def _fix(self, trainer: Any, wait: float, cycle: float) -> str:
        loader = trainer.train_dataloader
        current = loader.num_workers if isinstance(loader, DataLoader) else 0
        return worker_advice(wait, cycle, current, max(1, trainer.num_devices))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is None:
            return
        self._close()
        self._end_step()
        if not self._decided:
            self._decide(trainer)
        wait, step, rest = self.measured()
        fraction = stall_fraction(wait, step, rest) or 0.0
        self.stall_fraction = fraction
        seen = "" if self.fetch_seen else " (fetch not seen: the whole gap between steps)"
        self.report(
            trainer,
            f"{fraction:.1%} of step time waiting for data over {self._steps} steps{seen}",
            stall_fraction=round(fraction, 4),
            wait_s=wait,
            step_s=step,
            rest_s=rest,
        )
