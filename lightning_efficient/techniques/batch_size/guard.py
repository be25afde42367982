"""OOM recovery inside a Lightning fit: the :class:`OOMSplitter` wired to a LightningModule.

:class:`OOMGuard` is not a callback: :class:`OOMRecovery` and :class:`EfficientBatchSize` each
hold one. For the duration of training it wraps the module's ``training_step``, ``backward`` and
``optimizer_zero_grad`` *on the instance* (the class and the state_dict keys are untouched) and
hands each step to the splitter as callables; ``arm`` returns the ``Change`` that puts the
module's own methods back.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.measure.step import silenced_logging
from lightning_efficient.measure.trials.trial import is_out_of_memory
from lightning_efficient.techniques.accumulation.weighting import batch_size_of
from lightning_efficient.techniques.accumulation.window import AccumulationWeights, windows_for
from lightning_efficient.techniques.batch_size.split import (
    OOMSplitter,
    OutOfMemoryRecoveryError,
    StepCalls,
    chunk_backward,
    oom_message,
)

__all__ = ["OOMGuard"]


class OOMGuard:
    """Reruns a training step split when it runs out of memory (see :class:`OOMSplitter`).

    The parts of a split batch are weighted by what the loss averages over, as measured by
    ``weights`` (:class:`~lightning_efficient.techniques.accumulation.AccumulationWeights`; its
    holder hands it ``on_train_batch_start``), and each part's gradient by the window's weight
    of the whole batch where a technique weighs the accumulation windows.

    Args:
        loss_weighting: ``"auto"`` (measured), ``"samples"`` or ``"tokens"``.
        ignore_index: Target value that does not count as a token.
        token_counter: ``fn(batch) -> int`` or its import path (resolved when first used).
    """

    def __init__(
        self,
        loss_weighting: str = "auto",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], int] | None = None,
    ) -> None:
        self.weights = AccumulationWeights(loss_weighting, ignore_index, token_counter)
        self.splitter = OOMSplitter("tokens", token_counter=self._count)
        self._armed = Change("not armed")
        self._module: weakref.ref | None = None  # the module armed
        self._current: tuple[Any, int] | None = None

    def _count(self, batch: Any) -> int:
        """What the loss of a part averages over (its samples while not measured)."""
        if self.weights.weighting is None:
            return batch_size_of(batch)
        return int(self.weights.count(batch))

    # -- state ---------------------------------------------------------------------------------
    @property
    def splits(self) -> int:
        """Parts each batch is run in (1 until an out-of-memory error)."""
        return self.splitter.splits

    @property
    def recoveries(self) -> int:
        """Out-of-memory errors recovered from."""
        return self.splitter.recoveries

    def state_dict(self) -> dict[str, Any]:
        return {"splits": self.splits, "recoveries": self.recoveries, **self.weights.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weights.load_state_dict(state_dict)
        self.splitter.splits = int(state_dict.get("splits", 1))
        self.splitter.recoveries = int(state_dict.get("recoveries", 0))

    def describe(self) -> str:
        """The report's line for recovery alone."""
        weighting = self.weights.weighting or "samples (not measured)"
        return f"OOM recovery armed ({weighting}-weighted split); batches split in {self.splits}"

    @staticmethod
    def unsupported(trainer: Any, pl_module: Any) -> str | None:
        """Why recovery cannot work in this fit, or None."""
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        if not pl_module.automatic_optimization:
            return "the module uses manual optimization; OOM recovery needs automatic optimization"
        if type(trainer.strategy) not in (SingleDeviceStrategy, DDPStrategy):
            return f"OOM recovery supports single-device and DDP strategies, not {type(trainer.strategy).__name__}"
        return None

    # -- arming ----------------------------------------------------------------------------------
    def start(
        self, trainer: Any, module: Any, technique: Any, report: Callable[[], None]
    ) -> Change | None:
        """Arm for this fit where recovery can work (the change to record); else say why once
        through ``technique.no_effect`` (None). After each split: ``technique.warn(message)``,
        ``report()``."""
        reason = self.unsupported(trainer, module)
        if reason:
            technique.no_effect(reason)
            return None

        def on_split(message: str) -> None:
            technique.warn(message)
            report()

        return self.arm(trainer, module, on_split)

    def arm(self, trainer: Any, module: Any, on_split: Callable[[str], None]) -> Change:
        """Wrap ``module``'s step methods on the instance; ``on_split(message)`` after each split.
        The change's ``undo()`` puts the module's own methods back."""
        if not self._armed.undone and self._module is not None and self._module() is module:
            return self._armed
        cls = type(module)
        orig_step = cls.training_step.__get__(module)
        orig_backward = cls.backward.__get__(module)
        orig_zero_grad = cls.optimizer_zero_grad.__get__(module)
        splitter = self.splitter

        def calls(batch_idx: int, args: tuple, kwargs: dict) -> StepCalls:
            accumulation = trainer.accumulate_grad_batches
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            windows = windows_for(trainer)  # the whole batch's weight in its window
            weight = windows.current_count if windows is not None else None
            scale = scaler.scale if scaler is not None else None
            if weight is not None:
                scale = _weighted(weight, scale)
            return StepCalls(
                step=lambda chunk: orig_step(chunk, batch_idx, *args, **kwargs),
                backward=chunk_backward(
                    [p for p in module.parameters() if p.requires_grad],
                    scale=scale,
                    bypass_reducer=isinstance(trainer.model, nn.parallel.DistributedDataParallel),
                ),
                zero_grad=lambda: orig_zero_grad(
                    trainer.current_epoch, batch_idx, trainer.optimizers[0]
                ),
                first_of_window=batch_idx % accumulation == 0,
                accumulation=accumulation,
                step_index=trainer.global_step,
                on_split=on_split,
            )

        @contextlib.contextmanager
        def rerun_context() -> Iterator[None]:
            with trainer.precision_plugin.train_step_context(), silenced_logging(module):
                yield

        def training_step(batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            self._current = (batch, batch_idx)
            return splitter.run(batch, calls(batch_idx, args, kwargs))

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            try:
                orig_backward(loss, *args, **kwargs)
                return
            except BaseException as err:  # noqa: BLE001
                if not is_out_of_memory(err):
                    raise
                message = oom_message(err)
            del loss
            if self._current is None:
                raise OutOfMemoryRecoveryError(
                    f"Out of memory in backward outside a training step ({message})."
                )
            if isinstance(trainer.model, nn.parallel.DistributedDataParallel):
                raise OutOfMemoryRecoveryError(
                    f"Out of memory in the backward at step {trainer.global_step} under DDP "
                    f"({message}): the gradient reduction was interrupted on this process and "
                    "cannot be resumed. Use a smaller micro-batch (EfficientBatchSize) or save "
                    "memory before training."
                )
            batch, batch_idx = self._current
            splitter.recover_backward(batch, calls(batch_idx, (), {}), message, rerun_context)

        def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            if splitter.take_zero_grad():  # else zeroed already, before the batch's first part
                orig_zero_grad(*args, **kwargs)

        wrappers = {
            "training_step": training_step,
            "backward": backward,
            "optimizer_zero_grad": optimizer_zero_grad,
        }
        patches = [patch_attribute(module, name, fn) for name, fn in wrappers.items()]
        patches.append(Change("the step in progress forgotten", self._forget))
        self._armed, self._module = Change.of(self.describe(), patches), weakref.ref(module)
        return self._armed

    def _forget(self) -> None:
        self._current = None


def _weighted(
    weight: torch.Tensor, scale: Callable[[torch.Tensor], torch.Tensor] | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A part's loss times the whole batch's window weight, then the grad scaler's ``scale``."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        t = t * weight.to(t.device, t.dtype)
        return scale(t) if scale is not None else t

    return apply
