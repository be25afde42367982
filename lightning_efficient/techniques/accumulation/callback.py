"""ExactAccumulation: the accumulated update equals one step on the window's samples together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.techniques.accumulation.window import AccumulationWeights, held_bytes

__all__ = ["ExactAccumulation", "add_exact_accumulation"]


class ExactAccumulation(Technique):
    """Gradient accumulation whose update is the whole window's, for a token-mean loss too.

    Lightning divides each micro-batch's loss by ``accumulate_grad_batches``: with a loss that is
    a mean over each micro-batch's targets (Hugging Face's ``.loss``, ``F.cross_entropy`` with
    ``ignore_index``), a short micro-batch's targets weigh more than a long one's, and the
    epoch's short last window is divided by the full count. This callback measures what the loss
    averages over (samples, targets, or targets after a causal LM's shift: the loss of a batch
    against the losses of its parts, a few forward passes without gradients on the first batch,
    which change nothing), multiplies each micro-batch's gradient by its count, and before
    clipping (after AMP's unscale) divides the window's gradients by the window's count, summed
    over the ranks (one all-reduce per optimizer step). Any ``accumulate_grad_batches`` (an
    int, a dict schedule, ``GradientAccumulationScheduler``) and the epoch's short last window
    are exact. The window's weighted loss is logged as ``window_loss``.

    Refused before training (with the reason) under manual optimization, a strategy that owns
    its accumulation (DeepSpeed) and an optimizer stepped in backward.

    Args:
        loss_weighting: ``"auto"`` (measured), ``"samples"`` or ``"tokens"`` (the targets;
            whether a causal LM's shift applies is measured).
        ignore_index: Target value the loss does not count.
        token_counter: ``fn(batch) -> count`` (or its import path): what the loss of a
            micro-batch averages over, for a loss the measurement cannot read.
    """

    weighs_windows = True  # read by the compatibility rules

    def __init__(
        self,
        loss_weighting: str = "auto",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.weights = AccumulationWeights(loss_weighting, ignore_index, token_counter)
        self.loss_weighting, self.ignore_index = loss_weighting, ignore_index
        self.token_counter = token_counter
        self._active = False

    def state_dict(self) -> dict[str, Any]:
        return self.weights.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weights.load_state_dict(state_dict)

    def configure_estimate(self, plan: Any) -> None:
        """Nothing changes in the estimated step: the few scalars held per step are said with
        their bytes (below the estimate's resolution; not added), and the count's comparison of
        the targets is freed before the forward, so it is no part of the peak."""
        size = held_bytes(plan.cuda_rounding)
        plan.note(f"{self.name}: {size:,} bytes of scalars per step (not added: negligible)")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self._active = self.weights.attach(trainer)
            if not self._active:
                self.no_effect("another technique weighs the accumulation windows already")

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active:
            self.weights.batch_start(trainer, pl_module, batch, batch_idx, self)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._active:
            self.weights.before_backward(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._active:
            self.weights.before_optimizer_step(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._active:
            line, figures = self.weights.describe()
            self.report(trainer, line, **figures)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.weights.detach(trainer)
        self._active = False
        super().teardown(trainer, pl_module, stage)


def add_exact_accumulation(
    trainer: Any,
    pl_module: Any,
    loss_weighting: str = "auto",
    ignore_index: int = -100,
    token_counter: str | Callable[[Any], Any] | None = None,
) -> Change:
    """Put an :class:`ExactAccumulation` among the trainer's callbacks for this fit (from a
    technique's ``setup``: it is set up here), unless one is there; the change takes it out."""
    if any(isinstance(c, ExactAccumulation) for c in trainer.callbacks):
        return Change("exact accumulation already among the callbacks")
    exact = ExactAccumulation(loss_weighting, ignore_index, token_counter)
    trainer.callbacks = [*trainer.callbacks, exact]
    exact.setup(trainer, pl_module, "fit")

    def undo() -> None:  # a new list: a hook loop running over the old one is not disturbed
        exact.weights.detach(trainer)
        trainer.callbacks = [c for c in trainer.callbacks if c is not exact]

    return Change("exact accumulation added", undo, value=exact)
