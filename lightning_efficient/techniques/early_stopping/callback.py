"""The early stopping callbacks: ``EarlyStopper`` (stop on a plateau, a threshold or a budget; put
the best weights back) and ``DivergenceGuard`` (no optimizer step from a NaN or a loss spike;
stop, skip or roll back)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_float, check_int
from lightning_efficient.measure.speed.tokens import batch_counts
from lightning_efficient.techniques.accumulation.window import windows_for
from lightning_efficient.techniques.early_stopping.best import BestWeights, not_kept_message
from lightning_efficient.techniques.early_stopping.budgets import parse_count, parse_duration
from lightning_efficient.techniques.early_stopping.decisions import (
    Budgets,
    best_checkpoint_callback,
    check_due,
    check_monitor,
    guard_summary,
    missing_metric_warning,
    no_check_message,
    plateau_tracker,
    reduce_over_ranks,
    seconds_per_step,
    snapshot_due,
    stops_now,
    trip_action,
    trip_message,
)
from lightning_efficient.techniques.early_stopping.divergence import DivergenceDetector
from lightning_efficient.techniques.early_stopping.plateau import stop_summary
from lightning_efficient.techniques.early_stopping.rollback import (
    drop_gradients,
    grad_norm,
    host_copy,
    restore_training_state,
    scale_lr_for_step,
)
from lightning_efficient.techniques.early_stopping.smoothing import check_half_life

__all__ = ["EarlyStopper", "DivergenceGuard", "ACTIONS"]


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


ACTIONS = ("stop", "skip", "rollback")


class DivergenceGuard(Technique):
    """Watch the training loss (and optionally the gradient norm) for non-finite values and
    spikes above ``spike_factor`` times a smoothed baseline, and keep the bad batch's update out
    of the weights.

    The check runs once per optimizer step, after backward and before ``optimizer.step()``
    (``on_before_optimizer_step``: after the gradients of every accumulated micro-batch, and
    after a ``GradScaler`` unscaled them). On a trip the update is dropped (every gradient set
    to ``None``: the optimizer changes no weight, moment or step count), then:

    - ``"stop"``: training stops; the weights are those before the bad batch, so whatever
      ``ModelCheckpoint`` saves at the end is the last good state.
    - ``"skip"``: training goes on with the next batch.
    - ``"rollback"``: the weights and optimizer states of the last snapshot (taken on host
      memory every ``snapshot_every`` good steps) come back, the learning rate is multiplied by
      ``lr_factor`` for the next ``cooldown_steps`` steps, and training goes on with the next
      batches (the offending ones are not replayed; ``global_step`` keeps counting).

    Under DDP the loss is averaged over the ranks before the check, so all ranks take the same
    decision. Costs one host sync per optimizer step (two under a ``GradScaler``). Under a
    ``GradScaler`` (``precision="16-mixed"``) non-finite gradients are the scaler's business
    (it skips that step and lowers its scale), so only the loss and finite gradient norms trip.

    Args:
        action: ``"stop"``, ``"skip"`` or ``"rollback"``.
        spike_factor: A loss above this many times its smoothed baseline is a spike (> 1;
            raise it for small, noisy losses); ``None`` watches for non-finite values only.
        half_life: Half-life of the baseline's moving average, in good steps (> 0).
        warmup_steps: Good steps before spikes are looked for (non-finite values always trip).
        watch_grad_norm: Also check the total gradient norm (non-finite, spikes).
        snapshot_every: ``rollback``: keep the weights and optimizer states every this many
            optimizer steps (after a resume: at the first good step, then every N).
        lr_factor: ``rollback``: learning-rate multiplier after a rollback, in (0, 1]; applied
            to each cooldown step only, so an LR scheduler's own schedule is unchanged.
        cooldown_steps: ``rollback``: steps the lowered learning rate lasts.
        max_trips: After this many trips training stops (a run that keeps diverging).
    """

    stacks = False
    vetoes_optimizer_step = True
    decision_figures = ("trips", "rollbacks")

    def __init__(
        self,
        action: str = "skip",
        spike_factor: float | None = 2.0,
        half_life: float = 20.0,
        warmup_steps: int = 10,
        watch_grad_norm: bool = False,
        snapshot_every: int = 50,
        lr_factor: float = 0.5,
        cooldown_steps: int = 100,
        max_trips: int = 10,
    ) -> None:
        super().__init__()
        self.action = check_choice("action", action, ACTIONS)
        self.spike_factor = check_float("spike_factor", spike_factor, allow_none=True)
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ValueError(f"`spike_factor` must be > 1 or None; got {spike_factor!r}.")
        if half_life is None:
            raise TypeError("`half_life` must be a number of steps > 0; got None.")
        self.half_life = check_half_life(half_life, "steps")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.watch_grad_norm = check_bool("watch_grad_norm", watch_grad_norm)
        self.snapshot_every = check_int("snapshot_every", snapshot_every, minimum=1)
        self.lr_factor = check_float("lr_factor", lr_factor, minimum=0.0, maximum=1.0)
        if self.lr_factor == 0:
            raise ValueError(f"`lr_factor` must be in (0, 1]; got {lr_factor!r}.")
        self.cooldown_steps = check_int("cooldown_steps", cooldown_steps, minimum=0)
        self.max_trips = check_int("max_trips", max_trips, minimum=1)
        self.detector = DivergenceDetector(self.spike_factor, self.half_life, self.warmup_steps)
        self.trips: list[dict[str, Any]] = []
        self.watched = 0
        self.cooldown_left = 0
        self._snapshot: tuple[int, Any, list[Any]] | None = None
        self._window: torch.Tensor | None = None
        self._batches = 0
        self._decided: tuple[int, bool] = (-1, False)
        self._cooldown_lr = Change("no cooldown")  # the factor on this step's learning rate

    # -- hooks ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._snapshot, self._window = None, None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        # Lightning divides by accumulate_grad_batches: the window's sum is its mean loss
        loss = loss.detach().float()
        self._window = loss if self._window is None else self._window + loss

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        batch, bad = self._decided
        if batch == self._batches:  # another optimizer of the same batch: same decision
            if bad:
                drop_gradients([optimizer])
            return
        window, self._window = self._window, None
        if window is None:  # no backward ran (the step returned None): nothing to judge
            return
        loss, norm = self._observe(trainer, window)
        reason = self.detector.check(loss, norm)
        self._decided = (self._batches, reason is not None)
        if reason is not None:
            self._trip(trainer, pl_module, loss, reason)
            return
        self.detector.accept(loss, norm)
        self.watched += 1
        step = trainer.global_step
        if snapshot_due(self.action, self._snapshot is not None, step, self.snapshot_every):
            # the weights of this step just gave a good loss: a verified-good state to return to
            old = self._snapshot
            weights = host_copy(pl_module.state_dict(), into=old[1] if old else None)
            states = host_copy(
                [o.state_dict() for o in trainer.optimizers], old[2] if old else None
            )
            self._snapshot = (step, weights, states)
        if self.cooldown_left > 0 and self._steps(trainer):
            self.cooldown_left -= 1
            # for this step only: put back right after it, before the LR scheduler steps
            self._cooldown_lr = self.record(
                trainer,
                Change("cooldown lr", scale_lr_for_step(trainer.optimizers, self.lr_factor)),
            )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._cooldown_lr.undo()  # a step that did not run leaves no factor behind

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._report(trainer)

    # -- decisions --------------------------------------------------------------------------
    @staticmethod
    def _steps(trainer: Any) -> bool:
        """Whether the coming optimizer step runs: a GradScaler skips it on non-finite
        gradients (then the cooldown neither applies nor counts)."""
        if getattr(trainer.precision_plugin, "scaler", None) is None:
            return True
        return math.isfinite(float(grad_norm(trainer.optimizers)))

    def _observe(self, trainer: Any, window: torch.Tensor) -> tuple[float, float | None]:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        exact = windows_for(trainer)  # weighted windows: their true loss, gradients final
        weighed = exact.close_window(trainer) if exact is not None else None
        if weighed is not None:
            window = weighed  # unscaled and over every rank already
        elif scaler is not None:  # the loss seen by backward was scaled
            window = window / scaler.get_scale()
        strategy = trainer.strategy
        if weighed is None and trainer.world_size > 1:
            window = strategy.reduce(window.to(strategy.root_device), reduce_op="mean")
        norm = None
        if self.watch_grad_norm:
            norm = float(grad_norm(trainer.optimizers))
            if scaler is not None and not math.isfinite(norm):
                norm = None  # an fp16 overflow: the scaler skips this step and lowers its scale
        return float(window), norm

    def _trip(self, trainer: Any, pl_module: Any, value: float, reason: str) -> None:
        drop_gradients(trainer.optimizers)
        step = trainer.global_step
        action = trip_action(
            self.action, len(self.trips), self.max_trips, self._snapshot is not None
        )
        if action == "stop":
            trainer.should_stop = True
        elif action == "rollback":
            snap_step, weights, states = self._snapshot
            restore_training_state(pl_module, trainer.optimizers, weights, host_copy(states))
            self.cooldown_left = self.cooldown_steps
            action = f"rollback to step {snap_step}"
        self.trips.append({"step": step, "value": value, "reason": reason, "action": action})
        self.warn(trip_message(step, reason, action, self.action, self.max_trips))

    # -- report and state -------------------------------------------------------------------
    def _report(self, trainer: Any) -> None:
        change, figures = guard_summary(self.trips, self.watched, self.action)
        self.report(trainer, change, **figures)

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state(),
            "trips": [dict(t) for t in self.trips],
            "watched": self.watched,
            "cooldown_left": self.cooldown_left,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load(state_dict.get("detector", {}))
        self.trips = [dict(t) for t in state_dict.get("trips", [])]
        self.watched = int(state_dict.get("watched", 0))
        self.cooldown_left = int(state_dict.get("cooldown_left", 0))
