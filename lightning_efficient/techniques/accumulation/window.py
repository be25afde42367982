"""Exact accumulation inside a Lightning fit: :class:`AccumulationWeights`, held by the callbacks.

Not a callback: :class:`ExactAccumulation`, :class:`EfficientBatchSize` (with a target),
:class:`AutoEfficient` and the OOM split each hold one and hand it their hooks, so the maths lives
once. Per micro-batch (``on_train_batch_start``): its count ``n_i`` on the device; its loss's
gradient is multiplied by ``n_i`` (a hook on the loss Lightning backpropagates, registered in
``on_before_backward``, so the module is untouched). At the window's end
(``on_before_optimizer_step``: after AMP's unscale, before clipping) the gradients are multiplied
by ``A x W / N`` (:func:`~.weighting.window_factor`; ``N`` summed over the ranks with one
all-reduce of two scalars, with the window's loss). One instance per trainer weighs the windows
(:func:`windows_for`): a second holder defers to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_efficient.core._internals import foreach_mul_
from lightning_efficient.core.per_trainer import PerTrainer
from lightning_efficient.core.validate import check_choice, check_int, import_object
from lightning_efficient.measure.memory.types import cuda_round
from lightning_efficient.techniques.accumulation.probe import probe_weighting
from lightning_efficient.techniques.accumulation.weighting import (
    WEIGHTINGS,
    count,
    per_sample_counts,
    window_factor,
)

__all__ = ["AccumulationWeights", "HELD_TENSORS", "WINDOW_LOSS", "held_bytes", "windows_for"]

#: The name the window's weighted loss is logged under (beside the module's own per-batch loss).
WINDOW_LOSS = "window_loss"
#: Batches probed at most while they cannot tell the weighting apart.
MAX_PROBES = 8
_OWNERS: PerTrainer[list] = PerTrainer(list)
#: Tensors of one or two fp32 values held on the device across a step: the micro-batch's count,
#: the window's [N, sum of n_i x loss_i] and the pair being added, the least and most N, the
#: factor, the window's loss.
HELD_TENSORS = 6


def held_bytes(cuda_rounding: bool = False) -> int:
    """Device bytes exact accumulation holds across a step (each tensor rounded up to 512 bytes
    by the CUDA allocator with ``cuda_rounding``)."""
    return HELD_TENSORS * (cuda_round(8) if cuda_rounding else 8)


def windows_for(trainer: Any) -> AccumulationWeights | None:
    """The one :class:`AccumulationWeights` that weighs this trainer's windows, if any."""
    owners = _OWNERS(trainer)
    return owners[0]() if owners else None


def check_token_counter(token_counter: Any) -> None:
    if (
        token_counter is not None
        and not isinstance(token_counter, str)
        and not callable(token_counter)
    ):
        raise TypeError(
            f"`token_counter` must be a callable, an import path or None; got {token_counter!r} "
            f"({type(token_counter).__name__})."
        )


class AccumulationWeights:
    """Measures the loss's weighting and weighs each accumulation window by it.

    Args:
        weighting: ``"auto"`` (measured on the first batches), ``"samples"`` or ``"tokens"`` (the
            targets; whether a causal LM's shift applies is still measured).
        ignore_index: Target value that the loss does not count.
        token_counter: ``fn(batch) -> int | tensor`` (or its import path): the count of a
            micro-batch, for a loss the rules above do not describe (no probe then).
    """

    def __init__(
        self,
        weighting: str = "auto",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], Any] | None = None,
    ) -> None:
        self.requested = check_choice("loss_weighting", weighting, ("auto", "samples", "tokens"))
        self.ignore_index = check_int("ignore_index", ignore_index)
        check_token_counter(token_counter)
        self.token_counter = token_counter
        self.weighting: str | None = "token_counter" if token_counter is not None else None
        self.detail = "counted by token_counter" if token_counter is not None else ""
        self.probes = 0
        self.settled = token_counter is not None
        self.windows = 0
        self._n: torch.Tensor | None = None  # this micro-batch's count
        self._sums: torch.Tensor | None = None  # [N, sum of n_i x loss_i] of the open window
        self._range: torch.Tensor | None = None  # [least N, most N] over the windows
        self._decided = (-1, -1)  # (global step, batch) of the last window closed
        self.window_loss: float | torch.Tensor | None = None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "weighting": self.weighting,
            "detail": self.detail,
            "probes": self.probes,
            "settled": self.settled,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.token_counter is None and state.get("weighting") in WEIGHTINGS:
            self.weighting, self.detail = state["weighting"], state.get("detail", "")
            self.settled = bool(state.get("settled", True))
        self.probes = int(state.get("probes", 0))

    def tokens_per_window(self) -> tuple[float, float] | None:
        """(least, most) count of a window (summed over ranks) so far."""
        if self._range is None:
            return None
        least, most = self._range.tolist()
        return least, most

    # -- what a micro-batch counts -------------------------------------------------------------
    def count(self, batch: Any) -> torch.Tensor:
        """The count of ``batch`` under the weighting found (a 0-dim tensor, no synchronisation)."""
        if self.token_counter is not None:
            counter = self.token_counter
            if isinstance(counter, str):
                counter = import_object("token_counter", counter)
            return torch.as_tensor(counter(batch)).float()
        if self.weighting is None:
            raise RuntimeError("the loss's weighting is not measured yet")
        return count(batch, self.weighting, self.ignore_index)

    def measure(self, step: Callable[[Any], Any], module: Any, batch: Any, world: Any) -> None:
        """Probe ``batch`` while the weighting is not settled (at most :data:`MAX_PROBES`
        batches); ``world``: the strategy, whose rank 0 decides for every rank."""
        if self.settled:
            return
        self.probes += 1
        if self.requested == "samples":
            found, detail, settled = "samples", "samples (as asked)", True
        else:
            probe = probe_weighting(step, module, batch, self.ignore_index)
            found, detail, settled = probe.weighting, probe.detail, probe.settled
            guess = self._guess(batch)
            if self.requested == "tokens" and found not in ("tokens", "shifted tokens"):
                found, detail, settled = guess, f"{guess} (as asked; {detail})", True
            elif not settled:  # this batch could not tell: assume until a later one can
                found = found or guess
                detail = f"{found} (assumed; {detail})"
                settled = self.probes >= MAX_PROBES
        if world is not None and getattr(world, "world_size", 1) > 1:
            found, detail, settled = world.broadcast((found, detail, settled), src=0)
        self.weighting, self.detail, self.settled = found, detail, settled

    def _guess(self, batch: Any) -> str:
        return "tokens" if "tokens" in per_sample_counts(batch, self.ignore_index) else "samples"

    # -- the holder's hooks --------------------------------------------------------------------
    def attach(self, trainer: Any, weigh_windows: bool = True) -> bool:
        """For a fit: weigh the trainer's windows unless another holder does already (True if
        this one does); ``weigh_windows=False``: only measure (the OOM split's weights)."""
        self._sums, self._n, self._decided, self._spread = None, None, (-1, -1), []
        if not weigh_windows:
            return False
        owners = _OWNERS(trainer)
        owners[:] = [o for o in owners if o() is not None]
        if not owners:
            owners.append(weakref.ref(self))
        return owners[0]() is self

    def detach(self, trainer: Any) -> None:
        owners = _OWNERS(trainer)
        owners[:] = [o for o in owners if o() not in (None, self)]

    def batch_start(
        self, trainer: Any, module: Any, batch: Any, batch_idx: int, technique: Any
    ) -> None:
        """Measure the weighting while unsettled, then count this micro-batch (on the device)."""
        if not self.settled:
            step = type(module).training_step.__get__(module)
            self.measure(lambda b: step(b, batch_idx), module, batch, trainer.strategy)
        if self.weighting is not None:
            self._n = self.count(batch)
            return
        self._n = None
        if windows_for(trainer) is self:  # not determined: Lightning's weighting, said once
            if "tokens" in per_sample_counts(batch, self.ignore_index):
                self._spread.append(count(batch, "tokens", self.ignore_index))
            if len(self._spread) == trainer.accumulate_grad_batches:
                technique.warn(undetermined_message(self.detail, self._spread))

    @property
    def current_count(self) -> torch.Tensor | None:
        """The count of the micro-batch in progress (None: not weighed)."""
        return self._n

    def before_backward(self, loss: torch.Tensor) -> None:
        """Multiply the gradient of ``loss`` (what Lightning backpropagates) by the count."""
        n = self._n
        if n is None or not loss.requires_grad:
            return
        n = n.to(loss.device)
        loss.register_hook(lambda g: g * n.to(g.dtype))
        added = torch.stack([n, n * loss.detach().float()])
        self._sums = added if self._sums is None else self._sums + added

    def before_optimizer_step(self, trainer: Any, module: Any) -> None:
        """Close the window and log its loss beside the module's own."""
        loss = self.close_window(trainer)
        if loss is not None:
            module.log(WINDOW_LOSS, loss.detach(), on_step=True, on_epoch=False)

    def close_window(self, trainer: Any) -> torch.Tensor | None:
        """Rescale the window's gradients (once per optimizer step, whoever asks first: the
        holder or a technique that judges the loss) and return its loss, the mean over the
        window's targets (or samples) of every rank; None when nothing was weighed."""
        key = (trainer.global_step, trainer.fit_loop.total_batch_idx)
        if key == self._decided:
            return self.window_loss
        self._decided, sums, self._sums = key, self._sums, None
        if sums is None:
            self.window_loss = None
            return None
        strategy = trainer.strategy
        if trainer.world_size > 1:  # the one all-reduce of the step: [N, sum of n_i x loss_i]
            sums = strategy.reduce(sums.to(strategy.root_device), reduce_op="sum")
        accumulation = trainer.accumulate_grad_batches
        factor = window_factor(sums[0], accumulation, trainer.world_size)
        scale_gradients(trainer.optimizers, factor)
        loss = sums[1] * accumulation / sums[0].clamp(min=1e-12)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.window_loss = loss / scaler.get_scale() if scaler is not None else loss
        total = sums[0].detach().reshape(1)
        if self._range is None:
            self._range = total.repeat(2)
        else:
            self._range = torch.cat(
                [self._range[:1].minimum(total), self._range[1:].maximum(total)]
            )
        self.windows += 1
        return self.window_loss

    def describe(self) -> tuple[str, dict[str, Any]]:
        """The report's line and figures: the weighting found, the count per window."""
        span = self.tokens_per_window()
        figures: dict[str, Any] = {"weighting": self.weighting or "undetermined"}
        line = f"windows weighted by {self.weighting or 'nothing (undetermined)'}"
        if self.detail:
            line += f" [{self.detail}]"
        if span is not None:
            unit = "samples" if self.weighting == "samples" else "targets"
            figures.update(least_per_window=span[0], most_per_window=span[1], windows=self.windows)
            line += f"; {unit} per window {span[0]:g}..{span[1]:g} over {self.windows} steps"
        return line, figures


def undetermined_message(detail: str, tokens: list[torch.Tensor]) -> str:
    """The one warning when the loss's weighting could not be measured."""
    spread = ""
    if tokens:
        values = torch.stack([t.float().cpu() for t in tokens])
        spread = f"; targets per micro-batch {values.min():g}..{values.max():g}"
    return (
        f"the loss's weighting could not be measured ({detail}){spread}: the accumulated update "
        "is Lightning's (each micro-batch's loss divided by accumulate_grad_batches), which "
        "differs from one step on the window's samples when the micro-batches' counts differ. "
        "Pass `token_counter=fn(batch) -> count` (what the loss averages over) or "
        "loss_weighting='samples'/'tokens'."
    )


def scale_gradients(optimizers: Any, factor: torch.Tensor) -> None:
    """Multiply every gradient of ``optimizers`` by ``factor`` (a 0-dim tensor, moved once per
    device and dtype): one ``_foreach_mul_`` per device and dtype, no synchronisation."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for key, grads in groups.items():
        foreach_mul_(grads, factor.to(*key))
