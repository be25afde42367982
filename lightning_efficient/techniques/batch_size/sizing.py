"""Pure sizing maths of the batch-size technique: no Lightning, no trainer.

- :func:`round_batch_size` / :func:`candidate_sizes`: micro-batches that suit the hardware.
- :func:`accumulation_for` / :func:`choose_micro_batch`: accumulation that reaches a target
  effective batch, and the micro-batch (<= the largest that fits) that makes it exact.
- :func:`largest_fitting_batch`: search over batch sizes with a memory estimate (no OOM trials);
  :func:`first_fitting` / :func:`fastest`: walk candidates with a real measurement.
- :func:`longest_sample` / :func:`worst_case_batch` / :func:`resize_batch`: the worst-case input.
- :func:`batch_length` / :func:`sample_size`: reading a batch (its tokens:
  :mod:`lightning_efficient.measure.speed.tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_efficient.core.validate import check_int
from lightning_efficient.measure.memory.budget import largest_within

__all__ = [
    "round_batch_size",
    "is_large_tensor_core_device",
    "candidate_sizes",
    "accumulation_for",
    "settle_accumulation",
    "restored_accumulation",
    "choose_micro_batch",
    "largest_fitting_batch",
    "first_fitting",
    "fastest",
    "search_cap",
    "epoch_end_step",
    "MAX_TARGET_BATCH",
    "batch_length",
    "sample_size",
    "longest_sample",
    "resize_batch",
    "worst_case_batch",
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


def settle_accumulation(
    target: int | None, micro: int, world_size: int = 1, current: int = 1
) -> tuple[int, int, bool]:
    """``(accumulation, effective, exact)`` for micro-batch ``micro``: :func:`accumulation_for`
    the ``target``, or without one the ``current`` accumulation kept as it is."""
    if target is None:
        return current, micro * current * world_size, True
    return accumulation_for(target, micro, world_size)


def restored_accumulation(
    target: int | None, micro: int, accumulation: int, saved_world: Any, world_size: int | None
) -> int:
    """The accumulation a resumed run uses: the ``accumulation`` saved with ``micro``, or, with a
    ``target`` and a ``world_size`` other than the ``saved_world``, the one that reaches it."""
    if world_size is not None and target is not None and world_size != saved_world:
        return accumulation_for(target, micro, world_size)[0]
    return accumulation


# -- search --------------------------------------------------------------------------------------
def largest_fitting_batch(
    estimate_fn: Callable[[int], float],
    budget_bytes: int,
    max_batch_size: int = 8192,
) -> tuple[int, dict[int, float]]:
    """The largest batch size ``n <= max_batch_size`` with ``estimate_fn(n) <= budget_bytes``:
    :func:`~lightning_efficient.measure.memory.budget.largest_within` over every size from 1 to
    ``max_batch_size`` (1 and ``max_batch_size`` estimated first, then typically two more).

    ``estimate_fn(n)`` returns the peak bytes of a training step at batch size ``n`` (the
    instrument's estimate, or a real trial returning ``inf`` on OOM); it must not shrink as
    ``n`` grows. No OOM is needed. Returns ``(n, {size: bytes evaluated})``; ``n == 0`` when
    even 1 does not fit.
    """
    budget_bytes = check_int("budget_bytes", int(budget_bytes), minimum=1)
    max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1)
    seen: dict[int, float] = {}

    def bytes_at(n: int) -> float:
        seen[n] = float(estimate_fn(n))
        return seen[n]

    return largest_within(range(1, max_batch_size + 1), bytes_at, budget_bytes), seen


def search_cap(
    max_batch_size: int | None, n_data: int | None, world_size: int = 1, target: int | None = None
) -> int:
    """The largest micro-batch worth searching: ``max_batch_size``, else the samples per process
    (8192 for a dataset without a length), never more than ``target / world_size``."""
    cap = max_batch_size or (max(1, n_data // world_size) if n_data else 8192)
    if target is not None:
        cap = min(cap, max(1, target // world_size))
    return cap


#: The largest effective batch the sizers take (a bound on the search: far above any real one).
MAX_TARGET_BATCH = 2**24


def epoch_end_step(samples: int, micro: int, accumulation: int, drop_last: bool) -> int | None:
    """Samples in an epoch's last optimizer step when it is short of ``micro * accumulation``
    (``None`` when every step holds the whole effective batch). Lightning steps at every epoch
    end, so an accumulation window that the epoch's micro-batches do not fill is cut there (and
    without ``drop_last`` the last micro-batch itself may be short). ``samples``: one rank's."""
    batches = samples // micro if drop_last else -(-samples // micro)
    if batches == 0:
        return 0
    in_epoch = batches * micro if drop_last else samples
    per_step = micro * accumulation
    steps = -(-batches // accumulation)
    last = in_epoch - (steps - 1) * per_step
    return None if last == per_step else last


def first_fitting(
    candidates: Iterable[int], peak_fn: Callable[[int], float]
) -> tuple[int, float] | None:
    """The largest candidate whose ``peak_fn(n)`` is finite (``inf``: it ran out of memory),
    trying them largest first; ``None`` when none fits."""
    for n in sorted(candidates, reverse=True):
        peak = float(peak_fn(n))
        if math.isfinite(peak):
            return n, peak
    return None


def fastest(
    candidates: Iterable[int], rate_fn: Callable[[int], float | None]
) -> tuple[int | None, dict[int, float]]:
    """``(best, {n: rate})``: the candidate with the highest ``rate_fn(n)`` (samples/s; ``None``:
    it ran out of memory), and every rate measured; ``best`` is None when none ran."""
    rates: dict[int, float] = {}
    for n in candidates:
        rate = rate_fn(n)
        if rate is not None:
            rates[n] = rate
    return (max(rates, key=rates.get) if rates else None), rates


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
