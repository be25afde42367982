"""``InputStallMonitor``: the share of step time spent waiting for the next batch.

A measuring callback (it changes nothing): it times the gap between one training step's end and
the next one's start with the instrument's ``StepTimer`` and warns once, with a concrete fix,
when the loader holds training back. Also importable from
``lightning_efficient.techniques.dataloading`` (where it lived before).
"""

from __future__ import annotations

import math
from typing import Any

from torch.utils.data import DataLoader

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_float, check_int
from lightning_efficient.measure.speed.host import usable_cores
from lightning_efficient.measure.speed.timing import StepTimer

__all__ = ["InputStallMonitor"]


class InputStallMonitor(Technique):
    """Measure the share of step time spent waiting for the next batch; warn once past a threshold.

    The wait is the time from ``on_train_batch_end`` to the next ``on_train_batch_start`` (the
    next batch is fetched and moved to the device there), the step the time from
    ``on_train_batch_start`` to ``on_train_batch_end``; time spent in validation is
    skipped. Timed with the instrument's ``StepTimer`` (CUDA events on a GPU, so the wait is the
    time the GPU sat idle). After ``check_after`` steps (and again when training ends, if not
    decided yet) it warns once, with a concrete fix, when ``wait / (wait + step) > threshold``.
    The fraction goes to the efficiency report.

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
        self._waiting = False
        self._steps = 0
        self._decided = False
        self.stall_fraction: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._timer = StepTimer(trainer.strategy.root_device)
        self._waiting, self._steps, self._decided = False, 0, False
        self.stall_fraction = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._end_wait()
        if not self._decided and self._steps >= self.check_after:
            self._decide(trainer)  # no region is open here
        elif self._steps % 256 == 0:
            self._timer.totals()  # read pending CUDA events now and then, so they do not pile up
        self._timer.start("step")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._timer.stop("step")
        self._steps += 1
        self._timer.start("wait")
        self._waiting = True

    def _end_wait(self) -> None:
        if self._waiting:
            self._timer.stop("wait")
            self._waiting = False

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # what follows is validation, not waiting for data (only the short gap before it counts)
        if self._timer is not None:
            self._end_wait()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._end_wait()

    def measured(self) -> tuple[float, float]:
        """(wait seconds, step seconds) measured so far (call between steps)."""
        if self._timer is None:
            return 0.0, 0.0
        totals = self._timer.totals()
        return float(totals.get("wait", 0.0)), float(totals.get("step", 0.0))

    def _decide(self, trainer: Any) -> None:
        wait, step = self.measured()
        if wait + step <= 0:
            return
        self._decided = True
        self.stall_fraction = fraction = wait / (wait + step)
        if fraction > self.threshold:
            self.warn(
                f"{fraction:.0%} of the step time is spent waiting for the next batch "
                f"(threshold {self.threshold:.0%}). Fix: {self._fix(trainer, wait, step)}"
            )

    def _fix(self, trainer: Any, wait: float, step: float) -> str:
        loader = trainer.train_dataloader
        current = loader.num_workers if isinstance(loader, DataLoader) else 0
        # with w workers a batch takes about w*(wait+step) to load; hide it behind `step`
        need = math.ceil(wait / step) if current == 0 else math.ceil(current * (wait + step) / step)
        need = max(need, current + 1, 1)
        return (
            f"Trainer(callbacks=[DataLoaderTuning(num_workers={need})]) (now {current} workers; "
            f"this machine has {usable_cores()} usable cores), or DevicePreload() if the "
            "dataset fits in device memory."
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is None:
            return
        self._end_wait()
        if not self._decided:
            self._decide(trainer)
        wait, step = self.measured()
        fraction = wait / (wait + step) if wait + step > 0 else 0.0
        self.stall_fraction = fraction
        self.report(
            trainer,
            f"{fraction:.1%} of step time waiting for data over {self._steps} steps",
            stall_fraction=round(fraction, 4),
            wait_s=wait,
            step_s=step,
        )
