"""Batch size that fits and runs fastest, with the effective batch kept; OOM recovery mid-run.

Pure functions (no Lightning needed, exported from ``lightning_efficient.functional``):

- :func:`round_batch_size`: round a micro-batch down to what suits the hardware.
- :func:`accumulation_for`: gradient accumulation that reaches a target effective batch.
- :func:`choose_micro_batch`: the micro-batch (<= the largest that fits) that makes it exact.
- :func:`largest_fitting_batch`: search over batch sizes with a memory estimate (no OOM trials).
- :func:`longest_sample` / :func:`worst_case_batch`: the worst-case input for the estimate.
- :func:`split_batch` / :func:`micro_batch_step`: run one batch as several micro-batches with
  gradient accumulation, so that the accumulated gradient equals the full-batch gradient.
- :func:`is_out_of_memory` / :func:`free_memory`.

Callbacks (they only decide *when*): :class:`EfficientBatchSize` (acts in ``setup``, before the
optimizer and the train DataLoader exist) and :class:`OOMRecovery` (wraps the module's
``training_step``/``backward`` for the duration of training; the class itself is untouched, so
state_dict keys never change).
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    format_bytes,
    import_object,
    parse_bytes,
)
from lightning_efficient.measure.step import autocast_for, loss_of, silenced_logging

__all__ = [
    "round_batch_size",
    "is_large_tensor_core_device",
    "accumulation_for",
    "choose_micro_batch",
    "largest_fitting_batch",
    "batch_length",
    "sample_size",
    "longest_sample",
    "resize_batch",
    "worst_case_batch",
    "split_batch",
    "count_tokens",
    "chunk_weights",
    "micro_batch_step",
    "is_out_of_memory",
    "free_memory",
    "OutOfMemoryRecoveryError",
    "OOMRecovery",
    "EfficientBatchSize",
]

# Datacenter GPUs whose tensor cores prefer large multiples (A100: 8.0, H100/H200: 9.0, B200: 10.0)
_LARGE_TENSOR_CORE_CAPABILITIES = {(8, 0), (9, 0), (10, 0)}
_LARGE_TENSOR_CORE_NAMES = (
    "A100",
    "A800",
    "H100",
    "H200",
    "H800",
    "GH200",
    "B100",
    "B200",
    "GB200",
)
_HALF_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true", "16", "bf16")


# -- rounding ------------------------------------------------------------------------------------
def is_large_tensor_core_device(
    capability: tuple[int, int] | None = None, name: str | None = None
) -> bool:
    """True for A100/H100-class devices (compute capability 8.0, 9.0, 10.0 or such a name)."""
    if capability is not None and tuple(capability) in _LARGE_TENSOR_CORE_CAPABILITIES:
        return True
    return name is not None and any(tag in name.upper() for tag in _LARGE_TENSOR_CORE_NAMES)


def _largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def round_batch_size(
    n: int,
    multiple_of: int | str = "auto",
    *,
    precision: str = "32-true",
    device_type: str = "cpu",
    capability: tuple[int, int] | None = None,
    device_name: str | None = None,
) -> int:
    """Round the micro-batch ``n`` down to a size that suits the hardware (never below 1).

    ``multiple_of`` an int: the largest multiple of it <= ``n`` (the largest power of two when
    ``n`` is smaller than the multiple). ``"auto"``:

    - 64 on A100/H100-class CUDA devices when ``n >= 256`` (large enough that rounding costs
      less than a fifth of the batch);
    - else 8 for fp16/bf16 on a CUDA device (tensor cores) when ``n >= 8``;
    - else the largest power of two <= ``n``.
    """
    n = check_int("n", n, minimum=1)
    if multiple_of != "auto":
        m = check_int("multiple_of", multiple_of, minimum=1)
        return (n // m) * m if n >= m else _largest_power_of_two(n)
    cuda = device_type == "cuda"
    if cuda and is_large_tensor_core_device(capability, device_name) and n >= 4 * 64:
        return (n // 64) * 64
    if cuda and str(precision) in _HALF_PRECISIONS and n >= 8:
        return (n // 8) * 8
    return _largest_power_of_two(n)


def candidate_sizes(largest: int, multiple_of: int | str = "auto", **hardware: Any) -> list[int]:
    """Rounded micro-batch candidates <= ``largest``: powers of two and the rounded largest."""
    top = round_batch_size(largest, multiple_of, **hardware)
    sizes = {top}
    p = 1
    while p < top:
        sizes.add(round_batch_size(p, multiple_of, **hardware))
        p *= 2
    return sorted(sizes)


# -- target batch arithmetic ---------------------------------------------------------------------
def accumulation_for(target: int, micro: int, world_size: int = 1) -> tuple[int, int, bool]:
    """Accumulation steps so that ``micro * accumulation * world_size == target``.

    Returns ``(accumulation, effective, exact)``. When ``target`` is not a multiple of
    ``micro * world_size`` the accumulation is the nearest value (at least 1), ``effective`` is
    the batch that it gives and ``exact`` is False (the callback warns).
    """
    target = check_int("target_batch_size", target, minimum=1)
    micro = check_int("micro", micro, minimum=1)
    world_size = check_int("world_size", world_size, minimum=1)
    per_step = micro * world_size
    accumulation = max(1, round(target / per_step))
    # among equally near values prefer the one not above the target
    if accumulation > 1 and abs((accumulation - 1) * per_step - target) <= abs(
        accumulation * per_step - target
    ):
        accumulation -= 1
    effective = per_step * accumulation
    return accumulation, effective, effective == target


def choose_micro_batch(
    largest: int,
    target: int | None = None,
    world_size: int = 1,
    multiple_of: int | str = "auto",
    **hardware: Any,
) -> tuple[int, int, int, bool]:
    """The micro-batch to train with, given the ``largest`` that fits.

    Returns ``(micro, accumulation, effective, exact)``. Without a target: the rounded largest,
    accumulation 1. With a target: never more than ``target / world_size`` per process; the
    largest rounded size that reaches the target exactly, else the largest size in
    ``[top / 2, top]`` (any integer) that does, else the rounded size with the nearest
    accumulation (``exact`` False).
    """
    largest = check_int("largest", largest, minimum=1)
    if target is None:
        micro = round_batch_size(largest, multiple_of, **hardware)
        return micro, 1, micro * world_size, True
    per_process = max(1, target // world_size)
    cap = min(largest, per_process)
    top = round_batch_size(cap, multiple_of, **hardware)
    for m in sorted(candidate_sizes(cap, multiple_of, **hardware), reverse=True):
        if m * 2 <= top:
            break
        if accumulation_for(target, m, world_size)[2]:
            return (m, *accumulation_for(target, m, world_size))
    for m in range(cap, max(1, top // 2) - 1, -1):
        if accumulation_for(target, m, world_size)[2]:
            return (m, *accumulation_for(target, m, world_size))
    return (top, *accumulation_for(target, top, world_size))


# -- search --------------------------------------------------------------------------------------
def largest_fitting_batch(
    estimate_fn: Callable[[int], float],
    budget_bytes: int,
    max_batch_size: int = 8192,
) -> tuple[int, dict[int, float]]:
    """The largest batch size ``n <= max_batch_size`` with ``estimate_fn(n) <= budget_bytes``.

    ``estimate_fn(n)`` returns the peak bytes of a training step at batch size ``n`` (the
    instrument's estimate, or a real trial returning ``inf`` on OOM); it must not shrink as
    ``n`` grows. Memory is close to linear in the batch, so the search interpolates between
    the sizes known to fit and not to fit (falling back to bisection when that does not halve
    the interval): ``max_batch_size`` and 1, then typically two more calls. No OOM is needed.
    Returns ``(n, {size: bytes evaluated})``; ``n == 0`` when even 1 does not fit.
    """
    budget_bytes = check_int("budget_bytes", int(budget_bytes), minimum=1)
    max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
    seen: dict[int, float] = {}

    def fits(n: int) -> bool:
        if n not in seen:
            seen[n] = float(estimate_fn(n))
        return seen[n] <= budget_bytes

    if fits(max_batch_size):
        return max_batch_size, seen
    if not fits(1):
        return 0, seen
    lo, hi = 1, max_batch_size
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        slope = (seen[hi] - seen[lo]) / width if math.isfinite(seen[hi]) else 0.0
        interpolated = not bisect and slope > 0
        guess = lo + int((budget_bytes - seen[lo]) / slope) if interpolated else (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        if fits(guess):
            lo = guess
            if interpolated and hi - lo > 1:  # a linear model lands exactly: confirm with n + 1
                if fits(lo + 1):
                    lo += 1
                else:
                    hi = lo + 1
        else:
            hi = guess
        # an interpolation that did not halve the interval is followed by a bisection step
        bisect = interpolated and (hi - lo) * 2 > width
    return lo, seen


# -- worst-case input ----------------------------------------------------------------------------
def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def sample_size(sample: Any) -> int:
    """Default length of one sample: the number of elements in all its tensors."""
    return sum(t.numel() for t in _tensors(sample))


def batch_length(batch: Any) -> int:
    """Number of samples in a collated batch (size of dim 0 of its first tensor)."""
    for t in _tensors(batch):
        if t.dim() > 0:
            return int(t.shape[0])
    raise ValueError("the batch holds no tensor with a batch dimension; cannot tell its size")


def longest_sample(
    dataset: Any,
    length_fn: Callable[[Any], int] = sample_size,
    max_samples: int | None = 10_000,
) -> tuple[int, int]:
    """``(index, length)`` of the longest sample of a map-style dataset.

    Scans every sample, or ``max_samples`` evenly spaced indices of a larger dataset (the
    longest of those). ``length_fn`` defaults to the number of tensor elements in the sample.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError("the training dataset is empty; there is no sample to probe")
    if max_samples is None or n <= max_samples:
        indices: Sequence[int] = range(n)
    else:
        indices = sorted({int(i * (n - 1) / (max_samples - 1)) for i in range(max_samples)})
    best, best_len = 0, -1
    for i in indices:
        length = int(length_fn(dataset[i]))
        if length > best_len:
            best, best_len = i, length
    return best, best_len


def resize_batch(batch: Any, n: int) -> Any:
    """A batch of ``n`` rows made from ``batch`` by repeating its rows in order."""
    size = batch_length(batch)
    index = torch.arange(n) % size

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x[index.to(x.device)] if x.dim() > 0 and x.shape[0] == size else x
        if isinstance(x, Mapping):
            return type(x)({k: take(v) for k, v in x.items()}) if not hasattr(x, "_fields") else x
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(take(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(take(v) for v in x)
        return x

    return take(batch)


def worst_case_batch(
    dataset: Any, collate_fn: Callable[[list], Any], n: int, index: int | None = None, **probe: Any
) -> Any:
    """``n`` copies of the longest sample, collated: the largest batch of ``n`` the data can give."""
    if index is None:
        index, _ = longest_sample(dataset, **probe)
    return collate_fn([dataset[index]] * n)


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

    def part(x: Any, i: int) -> Any:
        if isinstance(x, torch.Tensor):
            return x[bounds[i] : bounds[i + 1]] if x.dim() > 0 and x.shape[0] == size else x
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(part(v, i) for v in x))
        if isinstance(x, Mapping):
            return type(x)({k: part(v, i) for k, v in x.items()})
        if isinstance(x, (list, tuple)):
            return type(x)(part(v, i) for v in x)
        return x

    return [part(batch, i) for i in range(parts)]


def count_tokens(batch: Any, ignore_index: int = -100, key: str = "labels") -> int:
    """Target tokens that count in the loss: entries of ``batch[key]`` (dict batches) or of the
    last tensor of a tuple/list batch that differ from ``ignore_index``."""
    if isinstance(batch, Mapping):
        if key not in batch:
            raise ValueError(
                f"token weighting: the batch has no {key!r} entry; keys are {list(batch)}"
            )
        target = batch[key]
    elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[-1], torch.Tensor):
        target = batch[-1]
    elif isinstance(batch, torch.Tensor):
        target = batch
    else:
        raise ValueError(
            "token weighting: cannot find the targets in the batch; pass `token_counter`"
        )
    return int((target != ignore_index).sum())


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
        counts = [(token_counter or count_tokens)(c) for c in chunks]
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


# -- out of memory -------------------------------------------------------------------------------
def is_out_of_memory(err: BaseException) -> bool:
    """True for CUDA OOM (``torch.OutOfMemoryError``), cuDNN's OOM-in-disguise and a CPU
    allocation failure (``DefaultCPUAllocator: can't allocate memory``)."""
    from lightning.pytorch.utilities.memory import is_oom_error

    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    if oom_type is not None and isinstance(err, oom_type):
        return True
    if isinstance(err, RuntimeError) and err.args and isinstance(err.args[0], str):
        message = err.args[0]
        if "out of memory" in message.lower() or "can't allocate memory" in message:
            return True
    return is_oom_error(err)


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OutOfMemoryRecoveryError(RuntimeError):
    """Out of memory and the batch cannot be split further (or not at this point of the step)."""


# -- callbacks -----------------------------------------------------------------------------------
def _check_weighting(weighting: str, token_counter: Any) -> None:
    check_choice("loss_weighting", weighting, ("samples", "tokens"))
    if (
        token_counter is not None
        and not isinstance(token_counter, str)
        and not callable(token_counter)
    ):
        raise TypeError(
            f"`token_counter` must be a callable, an import path or None; got {token_counter!r} "
            f"({type(token_counter).__name__})."
        )


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
        loss_weighting: How micro-batch losses combine: ``"samples"`` (the loss is a mean over
            samples, or over tokens with equal-length samples) or ``"tokens"`` (a token-mean
            over variable-length samples: each micro-batch is weighted by its target tokens).
        ignore_index: Target value that does not count as a token (``"tokens"`` weighting).
        token_counter: ``fn(batch) -> int`` (or its import path) counting the tokens of a
            micro-batch; default: targets (``batch["labels"]`` or the last tensor of a tuple)
            that differ from ``ignore_index``.
    """

    @property
    def recovers_from_oom(self) -> bool:  # read by the compatibility rules
        return self._recovery_enabled

    def __init__(
        self,
        loss_weighting: str = "samples",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__()
        _check_weighting(loss_weighting, token_counter)
        self.loss_weighting = loss_weighting
        self.ignore_index = check_int("ignore_index", ignore_index)
        self.token_counter = token_counter
        self.splits = 1
        self.recoveries = 0
        self._recovery_enabled = True
        self._armed: weakref.ref | None = None
        self._skip_zero_grad = False
        self._accumulated = 0
        self._current: tuple[Any, int] | None = None

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"splits": self.splits, "recoveries": self.recoveries}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.splits = int(state_dict.get("splits", 1))
        self.recoveries = int(state_dict.get("recoveries", 0))

    # -- arming --------------------------------------------------------------------------------
    def _counter(self) -> Callable[[Any], int]:
        if self.token_counter is None:
            return lambda b: count_tokens(b, self.ignore_index)
        if isinstance(self.token_counter, str):
            return import_object("token_counter", self.token_counter)
        return self.token_counter

    def _supported(self, trainer: Any, pl_module: Any) -> str | None:
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        if not pl_module.automatic_optimization:
            return "the module uses manual optimization; OOM recovery needs automatic optimization"
        if type(trainer.strategy) not in (SingleDeviceStrategy, DDPStrategy):
            return f"OOM recovery supports single-device and DDP strategies, not {type(trainer.strategy).__name__}"
        return None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._recovery_enabled:
            return
        reason = self._supported(trainer, pl_module)
        if reason:
            self.no_effect(reason)
            return
        self._arm(trainer, pl_module)
        self._report_recovery(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._disarm(pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._disarm(pl_module)

    def _report_recovery(self, trainer: Any) -> None:
        self.report(
            trainer,
            f"OOM recovery armed ({self.loss_weighting}-weighted split); batches split in {self.splits}",
            splits=self.splits,
            recoveries=self.recoveries,
        )

    def _arm(self, trainer: Any, module: Any) -> None:
        if self._armed is not None and self._armed() is module:
            return
        cls = type(module)
        orig_step = cls.training_step.__get__(module)
        orig_backward = cls.backward.__get__(module)
        orig_zero_grad = cls.optimizer_zero_grad.__get__(module)
        this = self

        def training_step(batch: Any, batch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            this._current = (batch, batch_idx)
            return this._run_step(
                trainer, module, orig_step, orig_zero_grad, batch, batch_idx, args, kwargs
            )

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            this._run_backward(
                trainer, module, orig_step, orig_backward, orig_zero_grad, loss, args, kwargs
            )

        def optimizer_zero_grad(*args: Any, **kwargs: Any) -> None:
            if this._skip_zero_grad:  # zeroed already, before this batch's first micro-batch
                this._skip_zero_grad = False
                return
            orig_zero_grad(*args, **kwargs)

        module.training_step = training_step
        module.backward = backward
        module.optimizer_zero_grad = optimizer_zero_grad
        self._armed = weakref.ref(module)

    def _disarm(self, module: Any) -> None:
        if self._armed is None or self._armed() is not module:
            return
        for name in ("training_step", "backward", "optimizer_zero_grad"):
            vars(module).pop(name, None)
        self._armed = None
        self._current = None

    # -- the step ------------------------------------------------------------------------------
    def _first_of_window(self, trainer: Any, batch_idx: int) -> bool:
        return batch_idx % trainer.accumulate_grad_batches == 0

    def _chunk_backward(self, trainer: Any, module: Any) -> Callable[[torch.Tensor], None]:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        ddp = isinstance(trainer.model, nn.parallel.DistributedDataParallel)
        params = [p for p in module.parameters() if p.requires_grad]

        def backward(t: torch.Tensor) -> None:
            self._accumulated += 1
            if scaler is not None:
                t = scaler.scale(t)
            if not ddp:
                t.backward()
                return
            # not through the DDP reducer: the last micro-batch's backward (Lightning's) reduces
            # the gradient accumulated locally, exactly as under `no_sync`
            grads = torch.autograd.grad(t, params, allow_unused=True)
            for p, g in zip(params, grads):
                if g is not None:
                    p.grad = g.contiguous() if p.grad is None else p.grad.add_(g)

        return backward

    def _split_step(
        self,
        trainer,
        module,
        orig_step,
        orig_zero_grad,
        batch,
        batch_idx,
        args,
        kwargs,
        *,
        backward_last,
    ):
        self._accumulated = 0  # micro-batches of this attempt whose gradient is already added
        if self._first_of_window(trainer, batch_idx):
            orig_zero_grad(trainer.current_epoch, batch_idx, trainer.optimizers[0])
            self._skip_zero_grad = not backward_last
        return micro_batch_step(
            lambda chunk: orig_step(chunk, batch_idx, *args, **kwargs),
            batch,
            self.splits,
            weighting=self.loss_weighting,
            token_counter=self._counter() if self.loss_weighting == "tokens" else None,
            scale=1.0 / trainer.accumulate_grad_batches,
            backward=self._chunk_backward(trainer, module),
            backward_last=backward_last,
        )

    def _run_step(
        self, trainer, module, orig_step, orig_zero_grad, batch, batch_idx, args, kwargs
    ) -> Any:
        while True:
            self._accumulated = 0
            try:
                if self.splits == 1:
                    return orig_step(batch, batch_idx, *args, **kwargs)
                return self._split_step(
                    trainer,
                    module,
                    orig_step,
                    orig_zero_grad,
                    batch,
                    batch_idx,
                    args,
                    kwargs,
                    backward_last=False,
                )
            except BaseException as err:  # noqa: BLE001 - only OOM is handled, the rest re-raised
                if not is_out_of_memory(err):
                    raise
                message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            # outside the except block: the traceback (and the activations it holds) is released
            self._skip_zero_grad = False
            if self._accumulated and not self._first_of_window(trainer, batch_idx):
                self._check_grads_recoverable(trainer, message, "forward")
            self._grow_split(trainer, batch, message, "forward")

    def _check_grads_recoverable(self, trainer: Any, message: str, where: str) -> None:
        # chunks already done added their gradient to a window that also holds earlier batches
        raise OutOfMemoryRecoveryError(
            f"Out of memory in the {where} of a micro-batch at step {trainer.global_step} while "
            "gradients of earlier micro-batches of the same accumulation window were held; they "
            f"cannot be separated again, so the step cannot be rerun exactly ({message}). Start "
            "with a smaller micro-batch (EfficientBatchSize) or save memory (ActivationCheckpointing, "
            "bf16-mixed)."
        )

    def _grow_split(self, trainer: Any, batch: Any, message: str, where: str) -> None:
        free_memory()
        size = batch_length(batch)
        chunk = math.ceil(size / self.splits)
        if chunk <= 1:
            raise OutOfMemoryRecoveryError(
                f"Out of memory in the {where} at step {trainer.global_step} even with micro-batch 1 "
                f"(the batch of {size} split into {self.splits}); the model does not fit this "
                f"device at any batch size ({message}). Save memory first: ActivationCheckpointing, "
                "precision='bf16-mixed', OptimizerSwap('adamw8bit') or ZeRO offload."
            )
        self.splits = min(size, self.splits * 2)
        self.recoveries += 1
        micro = math.ceil(size / self.splits)
        self.warn(
            f"out of memory in the {where} at step {trainer.global_step} ({message}); rerunning the "
            f"batch split in {self.splits}: micro-batch {micro}, accumulation x{self.splits}, "
            "effective batch unchanged."
        )
        self._report_recovery(trainer)

    def _run_backward(
        self, trainer, module, orig_step, orig_backward, orig_zero_grad, loss, args, kwargs
    ) -> None:
        try:
            orig_backward(loss, *args, **kwargs)
            return
        except BaseException as err:  # noqa: BLE001
            if not is_out_of_memory(err):
                raise
            message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        del loss
        if self._current is None:
            raise OutOfMemoryRecoveryError(
                f"Out of memory in backward outside a training step ({message})."
            )
        batch, batch_idx = self._current
        if isinstance(trainer.model, nn.parallel.DistributedDataParallel):
            raise OutOfMemoryRecoveryError(
                f"Out of memory in the backward at step {trainer.global_step} under DDP ({message}): "
                "the gradient reduction was interrupted on this process and cannot be resumed. "
                "Use a smaller micro-batch (EfficientBatchSize) or save memory before training."
            )
        if not self._first_of_window(trainer, batch_idx):
            self._check_grads_recoverable(trainer, message, "backward")
        while True:
            self._grow_split(trainer, batch, message, "backward")
            try:
                # the loss Lightning holds keeps its (full-batch) value; the gradient is recomputed
                with trainer.precision_plugin.train_step_context(), silenced_logging(module):
                    self._split_step(
                        trainer,
                        module,
                        orig_step,
                        orig_zero_grad,
                        batch,
                        batch_idx,
                        (),
                        {},
                        backward_last=True,
                    )
                return
            except BaseException as err:  # noqa: BLE001
                if not is_out_of_memory(err):
                    raise
                message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class EfficientBatchSize(OOMRecovery):
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
        loss_weighting, ignore_index, token_counter: see :class:`OOMRecovery`.
    """

    @property
    def sets_accumulation(self) -> bool:  # read by the compatibility rules
        return self.target_batch_size is not None

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
        loss_weighting: str = "samples",
        ignore_index: int = -100,
        token_counter: str | Callable[[Any], int] | None = None,
    ) -> None:
        super().__init__(
            loss_weighting=loss_weighting, ignore_index=ignore_index, token_counter=token_counter
        )
        self.target_batch_size = check_int(
            "target_batch_size", target_batch_size, minimum=1, allow_none=True
        )
        if multiple_of != "auto":
            if isinstance(multiple_of, str):
                raise ValueError(
                    f"`multiple_of` must be 'auto' or a positive integer; got {multiple_of!r}."
                )
            check_int("multiple_of", multiple_of, minimum=1)
        self.multiple_of = multiple_of
        self.mode = check_choice("mode", mode, ("max_fit", "throughput"))
        self.margin = check_float("margin", margin, minimum=0.0, maximum=0.9, max_exclusive=True)
        self.max_batch_size = check_int(
            "max_batch_size", max_batch_size, minimum=1, allow_none=True
        )
        self.budget = budget
        self._budget_bytes = parse_bytes("budget", budget, allow_none=True)
        if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
            raise ValueError(f"`batch_arg_name` must be an attribute name; got {batch_arg_name!r}.")
        self.batch_arg_name = batch_arg_name
        if not isinstance(optimizer, str) or not optimizer:
            raise TypeError(
                f"`optimizer` must be 'adamw', 'adam', 'sgd' or a class path; got {optimizer!r}."
            )
        self.optimizer = optimizer
        self.probe_samples = check_int("probe_samples", probe_samples, minimum=1)
        self.oom_recovery = check_bool("oom_recovery", oom_recovery)
        self._recovery_enabled = oom_recovery
        self.micro_batch_size: int | None = None
        self.accumulate_grad_batches: int | None = None
        self.world_size: int | None = None
        self._trainer: weakref.ref | None = None
        self._figures: dict[str, Any] = {}
        self._change = ""

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "micro_batch_size": self.micro_batch_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        micro = state_dict.get("micro_batch_size")
        if micro is None:
            return
        trainer = self._trainer() if self._trainer is not None else None
        accumulation = int(state_dict.get("accumulate_grad_batches") or 1)
        if (
            trainer is not None
            and self.target_batch_size is not None
            and trainer.world_size != state_dict.get("world_size")
        ):
            accumulation, _, _ = accumulation_for(self.target_batch_size, micro, trainer.world_size)
        self.micro_batch_size, self.accumulate_grad_batches = int(micro), accumulation
        if (
            trainer is not None
        ):  # restored after `setup`, before the optimizer and the loaders exist
            self._apply(trainer, trainer.lightning_module, note="restored from the checkpoint")

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._trainer = weakref.ref(trainer)
        self._choose(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._change:
            self.report(trainer, self._change, **self._figures)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if self._change:  # one row: the choice, plus the recovery figures
            self.report(
                trainer,
                self._change,
                **self._figures,
                splits=self.splits,
                recoveries=self.recoveries,
            )

    def _report_recovery(self, trainer: Any) -> None:
        if not self._change:
            return super()._report_recovery(trainer)
        micro = self.micro_batch_size or 0
        change = self._change
        if self.splits > 1:
            change += (
                f"; after OOM: micro-batch {math.ceil(micro / self.splits)} x {self.splits} splits"
            )
        self.report(
            trainer, change, **self._figures, splits=self.splits, recoveries=self.recoveries
        )

    # -- the choice ----------------------------------------------------------------------------
    def _holder_check(self, trainer: Any, pl_module: Any) -> int:
        from lightning.pytorch.utilities.model_helpers import is_overridden
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

        if not lightning_hasattr(pl_module, self.batch_arg_name):
            where = (
                type(trainer.datamodule).__name__
                if trainer.datamodule is not None
                else "no datamodule"
            )
            raise ValueError(
                f"EfficientBatchSize: no `{self.batch_arg_name}` found on the LightningModule "
                f"({type(pl_module).__name__}), its hparams, or the datamodule ({where}) or its "
                f"hparams. Add a `{self.batch_arg_name}` attribute that `train_dataloader()` uses, "
                "or set `batch_arg_name` to the attribute's name."
            )
        if trainer.datamodule is None and not is_overridden("train_dataloader", pl_module):
            raise ValueError(
                "EfficientBatchSize: the train DataLoader was passed to `trainer.fit` directly, so "
                "it cannot be rebuilt with a new batch size. Build it in a LightningDataModule's or "
                "the LightningModule's `train_dataloader()` from its `batch_size` attribute."
            )
        value = lightning_getattr(pl_module, self.batch_arg_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"EfficientBatchSize: `{self.batch_arg_name}` is {value!r}; expected a positive int."
            )
        return value

    def _train_loader(self, trainer: Any, pl_module: Any) -> Any:
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        return source.train_dataloader()

    def _hardware(self, trainer: Any) -> dict[str, Any]:
        device = trainer.strategy.root_device
        hw: dict[str, Any] = {"precision": str(trainer.precision), "device_type": device.type}
        if device.type == "cuda":
            hw["capability"] = torch.cuda.get_device_capability(device)
            hw["device_name"] = torch.cuda.get_device_name(device)
        return hw

    def _budget(self, trainer: Any) -> int:
        if self._budget_bytes is not None:
            return self._budget_bytes
        device = trainer.strategy.root_device
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        available = _available_host_memory()
        if available is None:
            raise ValueError(
                "EfficientBatchSize: cannot read the available memory; pass `budget=` (e.g. '16GiB')."
            )
        return available

    def _choose(self, trainer: Any, pl_module: Any) -> None:
        initial = self._holder_check(trainer, pl_module)
        self._figures = {}
        if trainer.train_dataloader is not None:
            self.no_effect(
                "the train DataLoader was built before EfficientBatchSize.setup; the batch size cannot change"
            )
            return
        world = trainer.world_size
        loader = self._train_loader(trainer, pl_module)
        dataset, collate = loader.dataset, loader.collate_fn
        hw = self._hardware(trainer)
        budget = self._budget(trainer)
        usable = int(budget * (1 - self.margin))
        try:
            n_data = len(dataset)
        except TypeError:
            n_data = None
        cap = self.max_batch_size or (max(1, n_data // world) if n_data else 8192)
        if self.target_batch_size is not None:
            cap = min(cap, max(1, self.target_batch_size // world))
        if n_data is not None:
            index, _ = longest_sample(dataset, max_samples=self.probe_samples)
            make_batch = lambda n: worst_case_batch(dataset, collate, n, index=index)  # noqa: E731
        else:  # iterable dataset: its first batch, rows repeated
            first = next(iter(loader))
            make_batch = lambda n: resize_batch(first, n)  # noqa: E731

        estimate_fn, how = self._estimator(trainer, pl_module, make_batch)
        largest, seen = largest_fitting_batch(estimate_fn, usable, cap)
        if largest == 0:
            raise OutOfMemoryRecoveryError(
                f"EfficientBatchSize: even a micro-batch of 1 needs {format_bytes(seen.get(1, 0))} "
                f"({how}), more than the budget {format_bytes(usable)} ({format_bytes(budget)} less "
                f"margin {self.margin:.0%}). Save memory first: ActivationCheckpointing, "
                "precision='bf16-mixed', OptimizerSwap('adamw8bit') or ZeRO offload."
            )
        micro, accumulation, effective, exact = choose_micro_batch(
            largest, self.target_batch_size, world, self.multiple_of, **hw
        )
        if hw["device_type"] == "cuda" and how == "estimate":
            micro = self._confirm_on_device(trainer, pl_module, make_batch, micro, largest, hw)
            if self.target_batch_size is not None:
                accumulation, effective, exact = accumulation_for(
                    self.target_batch_size, micro, world
                )
        timings: dict[int, float] = {}
        if self.mode == "throughput":
            micro, timings = self._fastest(trainer, pl_module, make_batch, largest, hw, world)
            if self.target_batch_size is not None:
                accumulation, effective, exact = accumulation_for(
                    self.target_batch_size, micro, world
                )
        if self.target_batch_size is None:
            accumulation = trainer.accumulate_grad_batches
            effective = micro * accumulation * world
        elif not exact:
            self.warn(
                f"target_batch_size={self.target_batch_size} cannot be reached exactly with world size "
                f"{world} and a micro-batch <= {largest}; using micro-batch {micro} x accumulation "
                f"{accumulation} x world size {world} = {effective}, the nearest."
            )
        if self.target_batch_size is not None and trainer.accumulate_grad_batches not in (
            1,
            accumulation,
        ):
            self.warn(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is replaced by {accumulation}."
            )
        # the same choice on every process (device trials may differ slightly between ranks)
        micro, accumulation = trainer.strategy.broadcast((micro, accumulation), src=0)
        self.micro_batch_size, self.accumulate_grad_batches, self.world_size = (
            micro,
            accumulation,
            world,
        )
        if how == "estimate" and micro not in seen:
            seen[micro] = estimate_fn(micro)
        peak = seen.get(micro)
        self._figures = {
            **self._figures,
            "micro_batch": micro,
            "accumulation": accumulation,
            "effective_batch": micro * accumulation * world,
            "largest_fitting": largest,
            "budget_bytes": usable,
            **(
                {"estimated_peak_bytes": int(peak)}
                if peak is not None and math.isfinite(peak)
                else {}
            ),
            **({"samples_per_s": round(timings[micro], 2)} if micro in timings else {}),
        }
        self._change = (
            f"{self.batch_arg_name} {initial} -> {micro} ({self.mode}, {how}), accumulation "
            f"{accumulation} x world {world} = effective {micro * accumulation * world}"
        )
        self._apply(trainer, pl_module)
        self.note(self._change)

    def _apply(self, trainer: Any, pl_module: Any, note: str | None = None) -> None:
        from lightning.pytorch.utilities.parsing import lightning_setattr

        lightning_setattr(pl_module, self.batch_arg_name, self.micro_batch_size)
        trainer.accumulate_grad_batches = self.accumulate_grad_batches
        if note:
            self._change = f"{self.batch_arg_name} {self.micro_batch_size}, accumulation {self.accumulate_grad_batches} ({note})"
            self._figures.update(
                micro_batch=self.micro_batch_size, accumulation=self.accumulate_grad_batches
            )

    # -- measuring -------------------------------------------------------------------------------
    def _estimator(self, trainer: Any, pl_module: Any, make_batch: Callable[[int], Any]):
        try:
            from lightning_efficient.measure.estimate import estimate_memory
        except ImportError:
            estimate_memory = None
        others = [
            cb for cb in trainer.callbacks if cb is not self and hasattr(cb, "configure_estimate")
        ]
        precision = str(trainer.precision)

        world = trainer.world_size

        def estimate(n: int) -> float:
            # with accumulation, gradients stay live through the next micro-batch's forward
            accumulating = (
                self.target_batch_size or 0
            ) > n * world or trainer.accumulate_grad_batches > 1
            result = estimate_memory(
                pl_module,
                make_batch(n),
                optimizer=self.optimizer,
                precision=precision,
                callbacks=others,
                cuda_rounding=trainer.strategy.root_device.type == "cuda",
                accumulate_grad_batches=2 if accumulating else 1,
            )
            return result.peak_bytes

        if estimate_memory is not None:
            try:
                estimate(1)
                return estimate, "estimate"
            except Exception as err:  # noqa: BLE001 - a model the fake-tensor estimate cannot run
                reason = f"{type(err).__name__}: {err}"
        else:
            reason = "the instrument's estimate is not available"
        if trainer.strategy.root_device.type == "cuda":
            self.note(f"estimate failed ({reason[:200]}); searching with real trial steps")
            return (lambda n: self._trial_peak(trainer, pl_module, make_batch(n))), "trial steps"
        raise RuntimeError(
            f"EfficientBatchSize: the memory estimate cannot run this model on CPU ({reason[:500]})."
        )

    def _trial_peak(self, trainer: Any, pl_module: Any, batch: Any) -> float:
        try:
            return float(trial_step(pl_module, batch, self.optimizer, trainer))
        except BaseException as err:  # noqa: BLE001
            if not is_out_of_memory(err):
                raise
        free_memory()
        return math.inf

    def _confirm_on_device(self, trainer, pl_module, make_batch, micro, largest, hw) -> int:
        """One real step on the worst-case input; step down through the candidates on OOM."""
        for m in sorted(
            (c for c in candidate_sizes(micro, self.multiple_of, **hw) if c <= micro), reverse=True
        ):
            peak = self._trial_peak(trainer, pl_module, make_batch(m))
            if math.isfinite(peak):
                self._figures["trial_peak_bytes"] = int(peak)
                return m
        raise OutOfMemoryRecoveryError(
            "EfficientBatchSize: a real step runs out of memory even at micro-batch 1."
        )

    def _fastest(
        self, trainer, pl_module, make_batch, largest, hw, world
    ) -> tuple[int, dict[int, float]]:
        from lightning_efficient.measure.timing import time_fn

        device = trainer.strategy.root_device
        rates: dict[int, float] = {}
        for m in candidate_sizes(largest, self.multiple_of, **hw):
            accumulation = 1
            if self.target_batch_size is not None:
                accumulation, _, _ = accumulation_for(self.target_batch_size, m, world)
            rate = throughput(
                pl_module, make_batch(m), self.optimizer, trainer, accumulation, time_fn, device
            )
            if rate is not None:
                rates[m] = rate
        if not rates:
            raise OutOfMemoryRecoveryError(
                "EfficientBatchSize: every candidate micro-batch ran out of memory."
            )
        best = max(rates, key=rates.get)
        self._figures["candidates"] = ", ".join(f"{m}: {r:.1f}/s" for m, r in rates.items())
        return best, rates


# -- real steps (GPU confirmation, throughput) -----------------------------------------------------
def _make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    cls = classes.get(name) or import_object("optimizer", name)
    return cls(params, lr=1e-3) if cls is torch.optim.SGD else cls(params)


@contextlib.contextmanager
def _scratch_step(module: nn.Module, device: torch.device) -> Iterator[Any]:
    """Run real steps on ``module`` and put it back exactly: weights, buffers, grads, device."""
    saved = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    home = next((p.device for p in module.parameters()), torch.device("cpu"))
    was_training = module.training
    module.to(device).train()
    try:
        with silenced_logging(module):
            yield
    finally:
        for p in module.parameters():
            p.grad = None
        module.load_state_dict(saved)
        module.to(home).train(was_training)
        free_memory()


def _to(batch: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)


def trial_step(module: nn.Module, batch: Any, optimizer: str, trainer: Any) -> int:
    """One real training step (forward, backward, optimizer step) on the trainer's device;
    returns its peak allocated bytes (CUDA) and leaves the module unchanged."""
    device = trainer.strategy.root_device
    precision = str(trainer.precision)
    with _scratch_step(module, device):
        batch = _to(batch, device)
        opt = _make_optimizer(optimizer, [p for p in module.parameters() if p.requires_grad])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with autocast_for(precision, device.type):
            loss = loss_of(module.training_step(batch, 0))
        loss.backward()
        opt.step()
        del loss, opt
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        return 0


def throughput(
    module: nn.Module,
    batch: Any,
    optimizer: str,
    trainer: Any,
    accumulation: int,
    time_fn: Callable[..., float],
    device: torch.device,
) -> float | None:
    """Samples/s of training with micro-batch ``batch``: (forward+backward) x accumulation +
    one optimizer step, timed with the instrument's ``time_fn``; None on OOM."""
    precision = str(trainer.precision)
    n = batch_length(batch)
    try:
        with _scratch_step(module, device):
            batch = _to(batch, device)
            opt = _make_optimizer(optimizer, [p for p in module.parameters() if p.requires_grad])

            def forward_backward() -> None:
                with autocast_for(precision, device.type):
                    loss = loss_of(module.training_step(batch, 0))
                loss.backward()

            t_fb = time_fn(forward_backward, warmup=1, repeats=3, device=device)
            t_opt = time_fn(opt.step, warmup=1, repeats=3, device=device)
            del opt
    except BaseException as err:  # noqa: BLE001
        if not is_out_of_memory(err):
            raise
        free_memory()
        return None
    return n * accumulation / (accumulation * t_fb + t_opt)
