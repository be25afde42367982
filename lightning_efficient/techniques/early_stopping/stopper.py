"""EarlyStopper: stop on a plateau, a threshold or a budget; put the best weights back."""

from __future__ import annotations

import time
from typing import Any

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_int
from lightning_efficient.measure.speed.tokens import batch_counts
from lightning_efficient.techniques.early_stopping.best import BestWeights, not_kept_message
from lightning_efficient.techniques.early_stopping.decisions import (
    Budgets,
    best_checkpoint_callback,
    check_due,
    check_monitor,
    missing_metric_warning,
    no_check_message,
    plateau_tracker,
    reduce_over_ranks,
    seconds_per_step,
    stops_now,
)
from lightning_efficient.techniques.early_stopping.functions import (
    parse_count,
    parse_duration,
    stop_summary,
)

__all__ = ["EarlyStopper"]


class EarlyStopper(Technique):
    """Stop training when a logged metric stops improving, reaches a threshold, or a time,
    token or sample budget is spent; at the end put back the best weights seen.

    It can check every N training steps and smooth a noisy metric; its state (best weights
    included) is in the checkpoint, so a run resumed with ``ckpt_path=`` decides as an
    uninterrupted one; under DDP the value is averaged and budgets summed over the ranks first.

    Args:
        monitor: Name of a logged metric (``trainer.callback_metrics``), e.g. ``"val_loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: Checks without improvement before stopping (0: at the first one).
        min_delta: Smallest change that counts as an improvement (>= 0).
        relative_delta: Read ``min_delta`` as a fraction of the best value (0.01: 1%).
        check_every_n_steps: Check every N optimizer steps, before the step, on a metric logged
            in ``training_step`` (the kept weights are the ones that gave the value);
            ``None``: check at the end of every validation.
        min_steps: No plateau or threshold decision before this optimizer step (budgets and
            non-finite values still stop).
        stopping_threshold: Stop as soon as the (smoothed) value is this good.
        half_life: Smooth the metric with an exponential moving average whose weight halves
            every ``half_life`` checks (``None``: the raw value).
        max_time: Wall-clock budget of training, e.g. ``"1h30m"``, ``"90s"``, ``"00:10:00"`` or
            seconds; counted over resumed runs too.
        max_tokens: Token budget (summed over ranks, as ``measure.speed.tokens`` counts), e.g.
            ``"2B"``.
        max_samples: Sample budget (summed over ranks), e.g. ``"1M"``.
        restore_best: At the end of fit (however it ended) load the best weights seen: from the
            best file of a ``ModelCheckpoint`` on the same metric when it saved them, else from a
            copy kept on host memory (also saved in checkpoints, for exact resume). Checkpoints
            written after that in the fit hold the trained weights (their step's).
        strict: A missing metric is an error listing the logged ones (``False``: a warning).
        check_finite: Stop when the monitored value is NaN or infinite.
    """

    decision_figures = ("stopped_step", "best_step")

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        relative_delta: bool = False,
        check_every_n_steps: int | None = None,
        min_steps: int = 0,
        stopping_threshold: float | None = None,
        half_life: float | None = None,
        max_time: str | float | None = None,
        max_tokens: int | str | None = None,
        max_samples: int | str | None = None,
        restore_best: bool = True,
        strict: bool = True,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.monitor = check_monitor(monitor)
        self.tracker = t = plateau_tracker(
            mode, patience, min_delta, relative_delta, stopping_threshold, half_life, check_finite
        )
        self.mode, self.patience, self.min_delta = t.mode, t.patience, t.min_delta
        self.relative_delta, self.half_life = t.relative, t.half_life
        self.stopping_threshold, self.check_finite = t.stopping_threshold, t.check_finite
        self.check_every_n_steps = check_int(
            "check_every_n_steps", check_every_n_steps, minimum=1, allow_none=True
        )
        self.min_steps = check_int("min_steps", min_steps, minimum=0)
        self.max_time = max_time
        self.max_time_s = parse_duration(max_time, "max_time")
        self.max_tokens = parse_count(max_tokens, "max_tokens")
        self.max_samples = parse_count(max_samples, "max_samples")
        self.restore_best = check_bool("restore_best", restore_best)
        self.strict = check_bool("strict", strict)
        self.budgets = Budgets(self.max_time_s, self.max_tokens, self.max_samples)
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None
        self._best = BestWeights()
        self._last_step = self._first_step = self._last_checked = -1
        self._restored_from = ""

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode}!r}"

    @property
    def tokens(self) -> int:  # counted so far, summed over the ranks and resumed runs
        return self.budgets.tokens

    @property
    def samples(self) -> int:  # counted so far, summed over the ranks and resumed runs
        return self.budgets.samples

    # -- hooks ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.stopped_step, self.stop_reason, self._restored_from = None, None, ""
        self._best.last = None
        self.budgets.started = time.monotonic()
        self._first_step = self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # the weights of the last check are about to change: decide where the best ones live
        self._best.settle(trainer.strategy, pl_module, self._checkpoint_callback(trainer))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if check_due(trainer.global_step, self.check_every_n_steps, self._last_checked):
            self._last_checked = trainer.global_step
            self._check(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.budgets.counts_batches:
            self.budgets.add(*batch_counts(batch))
        if trainer.global_step != self._last_step:  # not inside an accumulation window
            self._last_step = trainer.global_step
            if self.budgets.any:
                self._check_budgets(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.check_every_n_steps is None and not trainer.sanity_checking:
            self._check(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.stopped_step is not None:  # the step the run ended at, after the decision
            self.stopped_step = trainer.global_step
        self._restore_best(trainer, pl_module)
        self._report(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore_best(trainer, pl_module)
        super().on_exception(trainer, pl_module, exception)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        self._best.into_checkpoint(checkpoint)  # after the best came back: the trained weights

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._best.last = None
        super().teardown(trainer, pl_module, stage)

    # -- decisions and best weights ---------------------------------------------------------
    def _check_budgets(self, trainer: Any) -> None:
        summed = reduce_over_ranks(trainer.strategy, self.budgets.local(time.monotonic()), "sum")
        reason = self.budgets.spend(summed, trainer.world_size)
        if reason is not None:
            self._stop(trainer, reason)

    def _check(self, trainer: Any, pl_module: Any) -> None:
        metrics, step = trainer.callback_metrics, trainer.global_step
        if self.monitor not in metrics:
            logged, every = list(metrics), self.check_every_n_steps
            self.warn(missing_metric_warning(self.monitor, logged, step, every, self.strict))
            return
        value = reduce_over_ranks(trainer.strategy, [float(metrics[self.monitor])], "mean")[0]
        improved, reason = self.tracker.observe(value, step)
        if improved and self.restore_best:
            self._best.improved(pl_module, self._checkpoint_callback(trainer))
        if stops_now(reason, value, step, self.min_steps, self.check_finite):
            self._stop(trainer, f"{self.monitor}: {reason}")

    def _stop(self, trainer: Any, reason: str) -> None:
        trainer.should_stop = True
        if self.stopped_step is None:
            self.stopped_step, self.stop_reason = trainer.global_step, reason

    def _checkpoint_callback(self, trainer: Any) -> Any:
        """A ModelCheckpoint whose best file may hold the weights of our best check, or None."""
        callbacks, every = getattr(trainer, "checkpoint_callbacks", []), self.check_every_n_steps
        return best_checkpoint_callback(callbacks, self.monitor, self.tracker, every)

    def _restore_best(self, trainer: Any, pl_module: Any) -> None:
        if not self.restore_best or self.tracker.best is None or self._restored_from:
            return
        cb, step = self._checkpoint_callback(trainer), self.tracker.best_step
        self._restored_from = self._best.restore(trainer, pl_module, step, cb)
        if not self._restored_from:
            self.warn(not_kept_message(step))

    # -- report and state -------------------------------------------------------------------
    def _report(self, trainer: Any) -> None:
        if self.tracker.checks == 0 and self.stopped_step is None:
            self.no_effect(no_check_message(self.monitor, self.check_every_n_steps))
            self.report(trainer, f"no effect: no check of {self.monitor} ran")
            return
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        done = (self.stopped_step or 0) - self._first_step
        per_step = seconds_per_step(self.budgets.started, time.monotonic(), done)
        change, figures = stop_summary(
            self.monitor, self.tracker, stopped_step=self.stopped_step, reason=self.stop_reason,
            total_steps=total, restored_from=self._restored_from, seconds_per_step=per_step,
        )  # fmt: skip
        self.report(trainer, change, **figures)

    def state_dict(self) -> dict[str, Any]:
        budgets = self.budgets.state(time.monotonic())
        return {"tracker": self.tracker.state(), **budgets, **self._best.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load(state_dict.get("tracker", {}))
        self.budgets.load(state_dict)
        self._best.load(state_dict)
