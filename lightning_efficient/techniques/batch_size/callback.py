"""The batch-size callbacks; they only decide *when*.

:class:`EfficientBatchSize` chooses in ``setup`` (before the optimizer and the train DataLoader
exist) with :func:`~.choice.choose_batch_size`; :class:`OOMRecovery` arms an :class:`~.guard.OOMGuard`
for the duration of training. ``EfficientBatchSize`` holds an ``OOMGuard`` of its own (it does
not inherit from ``OOMRecovery``), and says so to the compatibility rules through the public
``recovers_from_oom`` and ``sets_accumulation``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool
from lightning_efficient.techniques.accumulation.callback import add_exact_accumulation
from lightning_efficient.techniques.batch_size.choice import (
    SizingSettings,
    choose_batch_size,
    describe_choice,
    describe_restored,
    read_batch_size,
    sizing_settings,
)
from lightning_efficient.techniques.batch_size.guard import OOMGuard
from lightning_efficient.techniques.batch_size.sizing import restored_accumulation

__all__ = ["EfficientBatchSize", "OOMRecovery"]


class OOMRecovery(Technique):
    """Survive an out-of-memory error mid-training without losing a sample.

    When a training step runs out of memory (CUDA OOM, or a CPU allocation failure), the
    callback frees memory, halves the micro-batch and doubles the accumulation: the same batch
    is rerun split in two, with gradients accumulated inside the step, so no sample is skipped
    and the effective batch (and the maths, for mean-reduced losses) is unchanged. The split
    stays for the rest of the run (and across a resume). At micro-batch 1 it gives up with
    :class:`OutOfMemoryRecoveryError`.

    Recoverable: an OOM in the forward (``training_step``) anywhere; an OOM in the backward of
    the first micro-batch of an accumulation window (always, with no accumulation) on a single
    device. An OOM inside the backward of a later micro-batch, or under DDP, leaves partial
    gradients (or a DDP reducer mid-reduction) behind, so it raises a clear error instead.

    Args:
        loss_weighting: What the loss averages over, so that the parts of a split batch weigh as
            in the whole batch: ``"auto"`` (measured on the first batch: the loss of a batch
            against the losses of its parts, see :class:`ExactAccumulation`), ``"samples"`` or
            ``"tokens"`` (targets that differ from ``ignore_index``).
        ignore_index: Target value that does not count as a token.
        token_counter: ``fn(batch) -> int`` (or its import path) counting what the loss of a
            micro-batch averages over, for a loss the measurement cannot read.
    """

    recovers_from_oom = True  # read by the compatibility rules
    sharding_conflict = (  # read by the compatibility rules
        "OOM recovery splits a batch through the module's steps on single-device and DDP "
        "strategies only, and would do nothing here. Use EfficientBatchSize (it sizes one rank's "
        "micro-batch by the estimate before training), or DDP to keep OOM recovery"
    )

    def __init__(
        self,
        loss_weighting: str = "auto",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        self.recovery = OOMGuard(loss_weighting, ignore_index, token_counter)
        self.loss_weighting = loss_weighting
        self.ignore_index = ignore_index
        self.token_counter = token_counter

    splits = property(lambda self: self.recovery.splits, doc="Parts each batch is run in.")
    recoveries = property(lambda self: self.recovery.recoveries, doc="OOM errors recovered from.")

    def state_dict(self) -> dict[str, Any]:
        return self.recovery.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state_dict)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.recovery.weights.batch_start(trainer, pl_module, batch, batch_idx, self)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        armed = self.recovery.start(trainer, pl_module, self, lambda: self._report(trainer))
        if armed is not None:
            self.record(trainer, armed)  # the module's own methods back after fit
            self._report(trainer)

    def _report(self, trainer: Any) -> None:
        self.report(
            trainer, self.recovery.describe(), splits=self.splits, recoveries=self.recoveries
        )


class EfficientBatchSize(Technique):
    """The largest micro-batch that fits (or the fastest), with the effective batch kept.

    Acts in ``setup``, before the optimizer, the LR schedule and the train DataLoader exist:
    estimates the peak memory of a training step on the worst-case input (the longest sample)
    with the instrument (fake tensors: no allocation, no OOM trial and error), finds the largest
    micro-batch within the budget, rounds it for the hardware, optionally times the candidates,
    sets ``batch_size`` where Lightning's BatchSizeFinder finds it (the LightningModule, its
    hparams, the datamodule or its hparams) and ``trainer.accumulate_grad_batches`` so that
    micro-batch x accumulation x world size equals ``target_batch_size``. On a CUDA device the
    choice is confirmed with one real step on the worst-case input. Also recovers from OOM
    mid-training (see :class:`OOMRecovery`) unless ``oom_recovery=False``.

    Args:
        target_batch_size: Effective batch (micro-batch x accumulation x world size) to keep;
            None: accumulation stays as the Trainer has it.
        multiple_of: ``"auto"`` (64 on A100/H100-class GPUs for large batches, 8 for fp16/bf16
            tensor cores, else a power of two) or an integer the micro-batch is a multiple of.
        mode: ``"max_fit"`` (largest rounded micro-batch that fits) or ``"throughput"``
            (measure samples/s of the rounded candidates that fit and keep the fastest).
        margin: Share of the budget kept free, in [0, 0.9).
        max_batch_size: Largest micro-batch to consider (default: the training set size).
        budget: Device memory budget (bytes or "24GiB"); default: free CUDA memory, or on a
            CPU the available host memory.
        batch_arg_name: Name of the batch-size attribute.
        optimizer: Optimizer of the estimate and trials ("adamw", "adam", "sgd" or a class path).
        probe_samples: Samples scanned to find the longest one (evenly spaced when more).
        oom_recovery: Also recover from OOM errors mid-training.
        loss_weighting, ignore_index, token_counter: What the loss averages over (see
            :class:`OOMRecovery`): with a target the accumulation windows are weighted by it (an
            :class:`ExactAccumulation` is added for the fit), so micro-batch x accumulation
            gives the update of one step on the whole batch, and so is the OOM split.
    """

    @property
    def sets_accumulation(self) -> bool:  # read by the compatibility rules
        return self.target_batch_size is not None

    @property
    def recovers_from_oom(self) -> bool:  # read by the compatibility rules
        return self.oom_recovery

    def __init__(
        self,
        target_batch_size: int | None = None,
        multiple_of: int | str = "auto",
        mode: str = "max_fit",
        margin: float = 0.1,
        max_batch_size: int | None = None,
        budget: int | str | None = None,
        batch_arg_name: str = "batch_size",
        optimizer: str = "adamw",
        probe_samples: int = 10_000,
        oom_recovery: bool = True,
        loss_weighting: str = "auto",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        self.recovery = OOMGuard(loss_weighting, ignore_index, token_counter)
        self.loss_weighting, self.ignore_index = loss_weighting, ignore_index
        self.token_counter = token_counter
        s = sizing_settings(
            target_batch_size, multiple_of, mode, margin, max_batch_size, budget,
            batch_arg_name, optimizer, probe_samples,
        )  # fmt: skip
        self.target_batch_size, self.mode = s.target_batch_size, s.mode
        self.multiple_of = multiple_of
        self.margin, self.max_batch_size, self.budget = s.margin, s.max_batch_size, budget
        self._budget_bytes, self.batch_arg_name = s.budget_bytes, batch_arg_name
        self.optimizer, self.probe_samples = optimizer, s.probe_samples
        self.oom_recovery = check_bool("oom_recovery", oom_recovery)
        self.micro_batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.world_size: int | None = None
        self._trainer: weakref.ref | None = None
        self._figures: dict[str, Any] = {}
        self._change = ""

    splits = property(lambda self: self.recovery.splits, doc="Parts each batch is run in.")
    recoveries = property(lambda self: self.recovery.recoveries, doc="OOM errors recovered from.")

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.recovery.state_dict(),
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recovery.load_state_dict(state_dict)
        micro = state_dict.get("micro_batch_size")
        if micro is None:
            return
        trainer = self._trainer() if self._trainer is not None else None
        accumulation = restored_accumulation(
            self.target_batch_size,
            micro,
            int(state_dict.get("accumulate_grad_batches") or 1),
            state_dict.get("world_size"),
            trainer.world_size if trainer is not None else None,
        )
        self.micro_batch_size, self.accumulate_grad_batches = int(micro), accumulation
        if trainer is not None:  # restored after `setup`, before the optimizer and the loaders
            self._apply(trainer, trainer.lightning_module, note="restored from the checkpoint")

    # -- hooks -----------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._trainer = weakref.ref(trainer)
        self._choose(trainer, pl_module)
        if self.target_batch_size is not None:  # micro-batch x accumulation: one step's update
            weighting = (self.loss_weighting, self.ignore_index, self.token_counter)
            self.record(trainer, add_exact_accumulation(trainer, pl_module, *weighting))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.oom_recovery:
            self.recovery.weights.batch_start(trainer, pl_module, batch, batch_idx, self)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._change:
            self.report(trainer, self._change, **self._figures)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        report = lambda: self._report(trainer)  # noqa: E731
        armed = self.recovery.start(trainer, pl_module, self, report) if self.oom_recovery else None
        if armed is not None:
            self.record(trainer, armed)  # the module's own methods back after fit
        if self._change or armed is not None:  # one row: the choice, plus the recovery figures
            report()

    def _report(self, trainer: Any) -> None:
        change = self._change or self.recovery.describe()
        if self._change and self.splits > 1:
            micro = math.ceil((self.micro_batch_size or 0) / self.splits)
            change += f"; after OOM: micro-batch {micro} x {self.splits} splits"
        self.report(
            trainer, change, **self._figures, splits=self.splits, recoveries=self.recoveries
        )

    # -- the choice ------------------------------------------------------------------------------
    def _choose(self, trainer: Any, pl_module: Any) -> None:
        initial = read_batch_size(trainer, pl_module, self.batch_arg_name)
        self._figures = {}
        if trainer.train_dataloader is not None:
            self.no_effect(
                "the train DataLoader was built before EfficientBatchSize.setup; the batch size cannot change"
            )
            return
        settings = SizingSettings(
            self.target_batch_size,
            self.multiple_of,
            self.mode,
            self.margin,
            self.max_batch_size,
            self._budget_bytes,
            self.batch_arg_name,
            self.optimizer,
            self.probe_samples,
        )
        choice = choose_batch_size(trainer, pl_module, settings, exclude=self)
        for message in choice.notes:
            self.note(message)
        for message in choice.warnings:
            self.warn(message)
        self.micro_batch_size, self.accumulate_grad_batches = choice.micro, choice.accumulation
        self.world_size = choice.world
        self._figures = choice.figures
        self._change = describe_choice(self.batch_arg_name, initial, choice, self.mode)
        self._apply(trainer, pl_module)
        self.note(self._change)

    def _apply(self, trainer: Any, pl_module: Any, note: str | None = None) -> None:
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr

        name = self.batch_arg_name
        before = lightning_getattr(pl_module, name)
        lightning_setattr(pl_module, name, self.micro_batch_size)
        undo = lambda: lightning_setattr(pl_module, name, before)  # noqa: E731
        self.record(trainer, Change(f"{name} {before} -> {self.micro_batch_size}", undo))
        # the accumulation is the trainer's setting for this fit (not the user's module): it
        # stays as the fit ran, as the trainer's optimizers do
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        if note:
            self._change = describe_restored(
                name, self.micro_batch_size, self.accumulate_grad_batches, note
            )
            self._figures.update(
                micro_batch=self.micro_batch_size, accumulation=self.accumulate_grad_batches
            )
