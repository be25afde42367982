"""DivergenceGuard: no optimizer step from a NaN or a loss spike; stop, skip or roll back."""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_float, check_int
from lightning_efficient.techniques.accumulation.window import windows_for
from lightning_efficient.techniques.early_stopping.decisions import (
    guard_summary,
    snapshot_due,
    trip_action,
    trip_message,
)
from lightning_efficient.techniques.early_stopping.functions import (
    DivergenceDetector,
    check_half_life,
    drop_gradients,
    grad_norm,
    host_copy,
    restore_training_state,
    scale_lr_for_step,
)

__all__ = ["DivergenceGuard", "ACTIONS"]

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
