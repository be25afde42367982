"""EarlyStopper: stop on a plateau, a threshold or a budget; put the best weights back."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_float, check_int
from lightning_efficient.measure.tokens import batch_counts
from lightning_efficient.techniques.early_stopping.best import BestWeights, not_kept_message
from lightning_efficient.techniques.early_stopping.functions import (
    MODES,
    PlateauTracker,
    budget_reason,
    check_half_life,
    matching_checkpoint,
    missing_metric_message,
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
        max_tokens: Token budget (summed over ranks, as ``measure.tokens`` counts), e.g. ``"2B"``.
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
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"`monitor` must be a metric name (a non-empty str); got {monitor!r}.")
        self.monitor = monitor
        self.mode = check_choice("mode", mode, MODES)
        self.patience = check_int("patience", patience, minimum=0)
        self.min_delta = check_float("min_delta", min_delta, minimum=0.0)
        self.relative_delta = check_bool("relative_delta", relative_delta)
        self.check_every_n_steps = check_int(
            "check_every_n_steps", check_every_n_steps, minimum=1, allow_none=True
        )
        self.min_steps = check_int("min_steps", min_steps, minimum=0)
        self.stopping_threshold = check_float(
            "stopping_threshold", stopping_threshold, allow_none=True
        )
        self.half_life = check_half_life(half_life, "checks")
        self.max_time = max_time
        self.max_time_s = parse_duration(max_time, "max_time")
        self.max_tokens = parse_count(max_tokens, "max_tokens")
        self.max_samples = parse_count(max_samples, "max_samples")
        self.restore_best = check_bool("restore_best", restore_best)
        self.strict = check_bool("strict", strict)
        self.check_finite = check_bool("check_finite", check_finite)
        self.tracker = PlateauTracker(
            self.mode, self.min_delta, self.relative_delta, self.patience, self.half_life,
            self.stopping_threshold, self.check_finite,
        )  # fmt: skip
        self.tokens = self.samples = 0
        self.elapsed_s = 0.0
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None
        self._best = BestWeights()
        self._pending = [0, 0]  # local tokens and samples since the last budget check
        self._last_step = self._first_step = self._last_checked = -1
        self._train_start: float | None = None
        self._restored_from = ""

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode}!r}"

    # -- hooks ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.stopped_step, self.stop_reason, self._restored_from = None, None, ""
        self._best.last = None
        self._train_start = time.monotonic()
        self._first_step = self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # the weights of the last check are about to change: decide where the best ones live
        self._best.settle(trainer.strategy, pl_module, self._checkpoint_callback(trainer))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        n, step = self.check_every_n_steps, trainer.global_step
        if n is not None and (step + 1) % n == 0 and step != self._last_checked:
            self._last_checked = step  # once per step, whatever the number of optimizers
            self._check(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.max_tokens is not None or self.max_samples is not None:
            samples, tokens = batch_counts(batch)
            self._pending = [self._pending[0] + (tokens or 0), self._pending[1] + samples]
        if trainer.global_step != self._last_step:  # not inside an accumulation window
            self._last_step = trainer.global_step
            if self.max_time_s or self.max_tokens or self.max_samples:
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
    def _reduce(self, trainer: Any, values: list[float], op: str) -> list[float]:
        """The same numbers on every rank: the ranks' sum or mean (a no-op on one process)."""
        strategy = trainer.strategy
        local = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
        return strategy.reduce(local, reduce_op=op).cpu().tolist()

    def _check_budgets(self, trainer: Any) -> None:
        now = self.elapsed_s + time.monotonic() - (self._train_start or time.monotonic())
        tokens, samples, elapsed = self._reduce(trainer, [*self._pending, now], "sum")
        self._pending = [0, 0]
        self.tokens += int(tokens)
        self.samples += int(samples)
        elapsed /= max(1, trainer.world_size)  # the ranks' mean clock: the same everywhere
        reason = budget_reason(
            elapsed, self.tokens, self.samples, max_time_s=self.max_time_s,
            max_tokens=self.max_tokens, max_samples=self.max_samples,
        )  # fmt: skip
        if reason is not None:
            self._stop(trainer, reason)

    def _value(self, trainer: Any) -> float | None:
        metrics = trainer.callback_metrics
        if self.monitor in metrics:
            return self._reduce(trainer, [float(metrics[self.monitor])], "mean")[0]
        message = missing_metric_message(
            self.monitor, list(metrics), trainer.global_step, self.check_every_n_steps
        )
        if self.strict:
            raise ValueError(message + " (or strict=False to skip checks without it).")
        self.warn(message + "; checks without it are skipped (strict=False).")
        return None

    def _check(self, trainer: Any, pl_module: Any) -> None:
        value = self._value(trainer)
        if value is None:
            return
        step = trainer.global_step
        improved, reason = self.tracker.observe(value, step)
        if improved and self.restore_best:
            self._best.improved(pl_module, self._checkpoint_callback(trainer))
        non_finite = self.check_finite and not math.isfinite(value)
        if reason is not None and (non_finite or step >= self.min_steps):
            self._stop(trainer, f"{self.monitor}: {reason}")

    def _stop(self, trainer: Any, reason: str) -> None:
        trainer.should_stop = True
        if self.stopped_step is None:
            self.stopped_step, self.stop_reason = trainer.global_step, reason

    def _checkpoint_callback(self, trainer: Any) -> Any:
        """A ModelCheckpoint whose best file may hold the weights of our best check, or None."""
        if self.half_life is not None or self.min_delta or self.check_every_n_steps is not None:
            return None  # our best and its best can be different checks
        callbacks = getattr(trainer, "checkpoint_callbacks", [])
        return matching_checkpoint(callbacks, self.monitor, self.mode)

    def _restore_best(self, trainer: Any, pl_module: Any) -> None:
        if not self.restore_best or self.tracker.best is None or self._restored_from:
            return
        cb, step = self._checkpoint_callback(trainer), self.tracker.best_step
        self._best.settle(trainer.strategy, pl_module, cb)
        self._restored_from = self._best.restore(trainer, pl_module, step, cb)
        if not self._restored_from:
            self.warn(not_kept_message(step))

    # -- report and state -------------------------------------------------------------------
    def _report(self, trainer: Any) -> None:
        t = self.tracker
        if t.checks == 0 and self.stopped_step is None:
            when = f"every {self.check_every_n_steps} steps" if self.check_every_n_steps else ""
            self.no_effect(
                f"no check of {self.monitor!r} ran ({when or 'at validation end'}) and no budget "
                "was spent; training was not shortened."
            )
            self.report(trainer, f"no effect: no check of {self.monitor} ran")
            return
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        per_step = None
        done = (self.stopped_step or 0) - self._first_step
        if self._train_start is not None and done > 0:
            per_step = (time.monotonic() - self._train_start) / done
        change, figures = stop_summary(
            self.monitor, t, stopped_step=self.stopped_step, reason=self.stop_reason,
            total_steps=total, restored_from=self._restored_from, seconds_per_step=per_step,
        )  # fmt: skip
        self.report(trainer, change, **figures)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "tracker": self.tracker.state(),
            "tokens": self.tokens,
            "samples": self.samples,
        }
        if self.max_time_s is not None:  # wall time is state only when it decides something
            since = time.monotonic() - self._train_start if self._train_start else 0.0
            state["elapsed_s"] = self.elapsed_s + since
        state.update(self._best.state())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load(state_dict.get("tracker", {}))
        self.tokens = int(state_dict.get("tokens", 0))
        self.samples = int(state_dict.get("samples", 0))
        self.elapsed_s = float(state_dict.get("elapsed_s", 0.0))
        self._best.load(state_dict)
