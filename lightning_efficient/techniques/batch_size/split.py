"""The pure OOM splitter: run one batch as several micro-batches, and retry a step split on OOM.

No trainer and no module here: a step is given as callables (:class:`StepCalls`: the forward of
a chunk, the backward of a chunk's loss, zeroing the gradients), so the state machine is usable
and testable without Lightning.

- :func:`split_batch` / :func:`chunk_weights` / :func:`micro_batch_step`: one batch as ``parts``
  micro-batches with gradient accumulation; the accumulated gradient equals the full-batch one.
- :func:`chunk_backward`: the backward of one micro-batch's loss (grad scaler, DDP without the
  reducer).
- :class:`OOMSplitter`: the retry state machine (split in 2, 4, ... ; give up at micro-batch 1
  with :class:`OutOfMemoryRecoveryError`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_efficient.core.validate import check_choice, check_int
from lightning_efficient.measure.speed.tokens import count_loss_tokens
from lightning_efficient.measure.step import loss_of
from lightning_efficient.measure.trials.trial import free_memory, is_out_of_memory
from lightning_efficient.techniques.accumulation.weighting import batch_slice
from lightning_efficient.techniques.batch_size.sizing import batch_length

__all__ = [
    "OOMSplitter",
    "OutOfMemoryRecoveryError",
    "StepCalls",
    "chunk_backward",
    "chunk_weights",
    "micro_batch_step",
    "oom_message",
    "split_batch",
]


class OutOfMemoryRecoveryError(RuntimeError):
    """Out of memory and the batch cannot be split further (or not at this point of the step)."""


# -- micro-batch split ---------------------------------------------------------------------------
def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split a batch into ``parts`` micro-batches along dim 0 (sizes differ by at most one).

    Tensors whose dim 0 is the batch size are split; tuples, lists, dicts and namedtuples are
    split recursively; everything else is repeated in each part.
    """
    parts = check_int("parts", parts, minimum=1)
    size = batch_length(batch)
    if parts > size:
        raise ValueError(f"cannot split a batch of {size} samples into {parts} parts")
    bounds = [round(i * size / parts) for i in range(parts + 1)]
    return [batch_slice(batch, bounds[i], bounds[i + 1], size) for i in range(parts)]


def chunk_weights(
    chunks: Sequence[Any],
    weighting: str = "samples",
    token_counter: Callable[[Any], int] | None = None,
) -> list[float]:
    """Weight of each micro-batch's mean loss in the full-batch mean loss.

    ``"samples"``: samples in the chunk / samples in the batch (right for a loss that is a mean
    over samples, or over tokens when every sample has the same number of tokens).
    ``"tokens"``: counted target tokens in the chunk / in the batch (right for a token-mean loss
    over variable-length samples, where a plain mean over micro-batches is wrong).
    """
    check_choice("weighting", weighting, ("samples", "tokens"))
    if weighting == "samples":
        counts = [batch_length(c) for c in chunks]
    else:
        counts = [(token_counter or count_loss_tokens)(c) for c in chunks]
    total = sum(counts)
    if total == 0:
        return [1.0 / len(chunks)] * len(chunks)
    return [c / total for c in counts]


def micro_batch_step(
    step_fn: Callable[[Any], Any],
    batch: Any,
    parts: int,
    *,
    weighting: str = "samples",
    token_counter: Callable[[Any], int] | None = None,
    scale: float = 1.0,
    backward: Callable[[torch.Tensor], None] | None = None,
    backward_last: bool = True,
) -> Any:
    """Run ``batch`` as ``parts`` micro-batches, accumulating gradients; return the full-batch loss.

    ``step_fn(chunk)`` returns the chunk's (mean-reduced) loss or a dict with ``"loss"``.
    Each chunk's loss is weighted by :func:`chunk_weights` and multiplied by ``scale`` before
    ``backward`` (default ``loss.backward()``); the accumulated gradient then equals the
    gradient of ``scale *`` the full-batch loss. The returned loss has the full-batch value.
    With ``backward_last=False`` the last chunk is left for the caller: the returned loss is
    attached to its graph (gradient ``weight_last``) and carries the other chunks' values
    detached, so one ``backward()`` of it (times ``scale``) completes the accumulation.
    """
    backward = backward or (lambda t: t.backward())
    chunks = split_batch(batch, parts)
    weights = chunk_weights(chunks, weighting, token_counter)
    losses: list[torch.Tensor] = []
    output: Any = None
    for i, (chunk, w) in enumerate(zip(chunks, weights)):
        output = step_fn(chunk)
        loss = loss_of(output) * w
        if i < len(chunks) - 1 or backward_last:
            backward(loss * scale)
            loss = loss.detach()  # frees this micro-batch's graph before the next one runs
        losses.append(loss)
    done = losses[-1]
    for loss in losses[:-1]:
        done = done + loss
    if isinstance(output, Mapping):
        return {**output, "loss": done}
    return done


def chunk_backward(
    params: Sequence[torch.Tensor],
    *,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    bypass_reducer: bool = False,
) -> Callable[[torch.Tensor], None]:
    """The backward of one micro-batch's loss: ``scale(loss).backward()`` (``scale``: e.g. the
    AMP grad scaler's ``scale``).

    With ``bypass_reducer`` (under DDP) the gradient of ``params`` is computed with
    ``torch.autograd.grad`` and added to ``.grad`` by hand, bypassing the reducer's hooks: the
    last micro-batch's backward (Lightning's, through DDP) then reduces the gradient accumulated
    locally, exactly as under ``no_sync``.
    """

    def backward(t: torch.Tensor) -> None:
        if scale is not None:
            t = scale(t)
        if not bypass_reducer:
            t.backward()
            return
        grads = torch.autograd.grad(t, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g.contiguous() if p.grad is None else p.grad.add_(g)

    return backward


# -- the retry state machine ---------------------------------------------------------------------
def oom_message(err: BaseException) -> str:
    """The first line of an out-of-memory error (at most 300 characters), for messages."""
    return str(err).splitlines()[0][:300] if str(err) else type(err).__name__


@dataclass
class StepCalls:
    """One training step, as callables and the facts the splitter needs.

    Attributes:
        step: ``step(chunk) -> output``: the forward of a (micro-)batch (a loss, a dict with
            ``"loss"`` or an object with ``.loss``).
        backward: ``backward(weighted_loss)``: adds a chunk's gradient (see :func:`chunk_backward`).
        zero_grad: Zeroes the gradients (before the first part of a window's first batch).
        first_of_window: The batch is the first of its gradient-accumulation window (no
            gradient of an earlier batch is held).
        accumulation: Batches per optimizer step; each part's loss is divided by it.
        step_index: The optimizer step, for messages.
        on_split: Called with a one-line message each time the split grows.
    """

    step: Callable[[Any], Any]
    backward: Callable[[torch.Tensor], None]
    zero_grad: Callable[[], None]
    first_of_window: bool = True
    accumulation: int = 1
    step_index: int = 0
    on_split: Callable[[str], None] | None = None


class OOMSplitter:
    """Survive an out-of-memory error in a training step by rerunning the batch split.

    State: ``splits`` (parts each batch is run in; kept for the rest of the run) and
    ``recoveries``. On an OOM memory is freed and ``splits`` doubled, until a part would be a
    single sample: then :class:`OutOfMemoryRecoveryError`. A retry is exact only while no
    gradient of an earlier batch of the accumulation window is held; otherwise it raises a
    clear error instead of a wrong gradient.

    Args:
        weighting: ``"samples"`` or ``"tokens"`` (see :func:`chunk_weights`).
        token_counter: ``fn(chunk) -> int`` for ``"tokens"`` (default
            :func:`~lightning_efficient.measure.speed.tokens.count_loss_tokens`).
    """

    def __init__(
        self, weighting: str = "samples", token_counter: Callable[[Any], int] | None = None
    ) -> None:
        self.weighting = check_choice("loss_weighting", weighting, ("samples", "tokens"))
        self.token_counter = token_counter
        self.splits = 1
        self.recoveries = 0
        self.skip_zero_grad = False
        self._accumulated = 0  # parts of this attempt whose gradient is already added

    def run(self, batch: Any, calls: StepCalls) -> Any:
        """The step's output for ``batch``: ``calls.step(batch)`` whole, or once split, every
        part but the last run forward + backward here and the returned loss (full-batch value)
        attached to the last part's graph, so the caller's one backward completes the
        accumulation. An OOM frees memory and reruns the batch split in twice as many parts."""
        while True:
            self._accumulated = 0
            try:
                if self.splits == 1:
                    return calls.step(batch)
                return self._split_step(batch, calls, backward_last=False)
            except BaseException as err:  # noqa: BLE001 - only OOM is handled, the rest re-raised
                if not is_out_of_memory(err):
                    raise
                message = oom_message(err)
            # outside the except block: the traceback (and the activations it holds) is released
            self.skip_zero_grad = False
            if self._accumulated and not calls.first_of_window:
                raise self._held_gradients(calls, message, "forward")
            self._grow(batch, calls, message, "forward")

    def recover_backward(
        self,
        batch: Any,
        calls: StepCalls,
        message: str,
        context: Callable[[], Any] = contextlib.nullcontext,
    ) -> None:
        """After an OOM in the caller's backward of ``batch``'s loss: zero the partial gradients
        and recompute them split, every part's backward run here (inside ``context()``, e.g.
        the precision's step context); the loss the caller holds keeps its full-batch value.
        Exact only on the first batch of an accumulation window; a later one raises."""
        if not calls.first_of_window:
            raise self._held_gradients(calls, message, "backward")
        while True:
            self._grow(batch, calls, message, "backward")
            try:
                with context():
                    self._split_step(batch, calls, backward_last=True)
                return
            except BaseException as err:  # noqa: BLE001
                if not is_out_of_memory(err):
                    raise
                message = oom_message(err)

    def take_zero_grad(self) -> bool:
        """Whether the caller's next ``zero_grad`` should run: False once after a split step
        zeroed the gradients itself, before its first part."""
        if self.skip_zero_grad:
            self.skip_zero_grad = False
            return False
        return True

    def _split_step(self, batch: Any, calls: StepCalls, *, backward_last: bool) -> Any:
        self._accumulated = 0
        if calls.first_of_window:
            calls.zero_grad()
            self.skip_zero_grad = not backward_last

        def backward(t: torch.Tensor) -> None:
            self._accumulated += 1
            calls.backward(t)

        return micro_batch_step(
            calls.step,
            batch,
            self.splits,
            weighting=self.weighting,
            token_counter=self.token_counter if self.weighting == "tokens" else None,
            scale=1.0 / calls.accumulation,
            backward=backward,
            backward_last=backward_last,
        )

    def _held_gradients(
        self, calls: StepCalls, message: str, where: str
    ) -> OutOfMemoryRecoveryError:
        # parts already done added their gradient to a window that also holds earlier batches
        return OutOfMemoryRecoveryError(
            f"Out of memory in the {where} of a micro-batch at step {calls.step_index} while "
            "gradients of earlier micro-batches of the same accumulation window were held; they "
            f"cannot be separated again, so the step cannot be rerun exactly ({message}). Start "
            "with a smaller micro-batch (EfficientBatchSize) or save memory (ActivationCheckpointing, "
            "bf16-mixed)."
        )

    def _grow(self, batch: Any, calls: StepCalls, message: str, where: str) -> None:
        free_memory()
        size = batch_length(batch)
        if math.ceil(size / self.splits) <= 1:
            raise OutOfMemoryRecoveryError(
                f"Out of memory in the {where} at step {calls.step_index} even with micro-batch 1 "
                f"(the batch of {size} split into {self.splits}); the model does not fit this "
                f"device at any batch size ({message}). Save memory first: ActivationCheckpointing, "
                "precision='bf16-mixed', OptimizerSwap('adamw8bit') or ZeRO offload."
            )
        self.splits = min(size, self.splits * 2)
        self.recoveries += 1
        if calls.on_split is not None:
            calls.on_split(
                f"out of memory in the {where} at step {calls.step_index} ({message}); rerunning "
                f"the batch split in {self.splits}: micro-batch {math.ceil(size / self.splits)}, "
                f"accumulation x{self.splits}, effective batch unchanged."
            )
