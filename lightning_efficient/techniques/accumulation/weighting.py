"""The maths of exact gradient accumulation, on tensors (no trainer).

A micro-batch's loss is a mean over something: its samples, or the targets its loss counts
(tokens that differ from ``ignore_index``, after the shift of a causal LM). The window's update is
one step on its samples together when each micro-batch's gradient is weighted by its count
``n_i`` and the sum divided by the window's count ``N`` (torchtune #1917).

- :func:`batch_slice` / :func:`batch_size_of`: samples ``start:stop`` of a collated batch.
- :func:`count`: what one micro-batch's loss averages over, for a weighting (a 0-dim tensor on the
  batch's device: no synchronisation).
- :func:`probe_split` / :func:`measured_share` / :func:`weighting_of`: the weighting read from the
  loss of a batch against the losses of its two parts (the measurement, see
  :func:`~lightning_efficient.techniques.accumulation.probe.probe_weighting`).
- :func:`window_factor`: the factor on the accumulated gradients at the window's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_efficient.core.validate import check_choice
from lightning_efficient.measure.speed.tokens import batch_counts, targets_of

__all__ = [
    "WEIGHTINGS",
    "batch_size_of",
    "batch_slice",
    "count",
    "measured_share",
    "per_sample_counts",
    "probe_split",
    "weighting_of",
    "window_factor",
]

#: What a micro-batch's loss can average over: its samples, its targets (``!= ignore_index``), or
#: its targets after a causal LM's shift (the first position of each row is never a target).
WEIGHTINGS = ("samples", "tokens", "shifted tokens")


def batch_size_of(batch: Any) -> int:
    """Samples in a collated batch (see :mod:`lightning_efficient.measure.speed.tokens`)."""
    return batch_counts(batch)[0]


def batch_slice(batch: Any, start: int, stop: int, size: int | None = None) -> Any:
    """Samples ``start:stop`` of a collated batch of ``size`` samples (default
    :func:`batch_size_of`): tensors whose dim 0 is the batch size are sliced; tuples, lists,
    dicts and namedtuples recursively; anything else is kept whole."""
    size = batch_size_of(batch) if size is None else size

    def part(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x[start:stop] if x.dim() > 0 and x.shape[0] == size else x
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(part(v) for v in x))
        if isinstance(x, Mapping):
            return type(x)({k: part(v) for k, v in x.items()})
        if isinstance(x, (list, tuple)):
            return type(x)(part(v) for v in x)
        return x

    return part(batch)


def per_sample_counts(batch: Any, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """For each weighting that applies to ``batch``, the count of each sample (a 1-D tensor)."""
    size = batch_size_of(batch)
    target = targets_of(batch)
    counts = {"samples": torch.ones(size)}
    if target is not None and target.shape[0] == size and not target.is_floating_point():
        kept = (target != ignore_index).reshape(size, -1)
        counts["tokens"] = kept.sum(1).float().cpu()
        if target.dim() >= 2:
            counts["shifted tokens"] = (target[:, 1:] != ignore_index).reshape(size, -1).sum(1)
            counts["shifted tokens"] = counts["shifted tokens"].float().cpu()
    return counts


def count(batch: Any, weighting: str, ignore_index: int = -100) -> torch.Tensor:
    """What the loss of ``batch`` averages over under ``weighting`` (one of :data:`WEIGHTINGS`),
    as a 0-dim float tensor on the targets' device (no synchronisation)."""
    check_choice("weighting", weighting, WEIGHTINGS)
    if weighting == "samples":
        return torch.tensor(float(batch_size_of(batch)))
    target = targets_of(batch)
    if target is None:
        raise ValueError(
            f"{weighting} weighting: the batch has no targets (a 'labels' entry or a last tensor); "
            "pass `token_counter`"
        )
    if weighting == "shifted tokens":
        target = target[:, 1:]
    return (target != ignore_index).sum().float()


def probe_split(counts: Mapping[str, torch.Tensor]) -> tuple[int, float]:
    """Where to cut a batch in two so that the candidates' shares of the first part differ the
    most (samples against tokens): ``(index, gap between the shares)``."""
    size = len(next(iter(counts.values())))
    best, gap = 1, 0.0
    for k in range(1, size):
        shares = [float(c[:k].sum() / c.sum().clamp(min=1)) for c in counts.values()]
        if max(shares) - min(shares) > gap:
            best, gap = k, max(shares) - min(shares)
    return best, gap


def measured_share(whole: float, first: float, second: float) -> float | None:
    """The share of the first part in the whole batch's loss, if the loss is a weighted mean of
    its parts' losses (``whole = s * first + (1 - s) * second``); None when the parts' losses are
    too close to tell."""
    if abs(first - second) <= 1e-4 * max(abs(whole), 1e-6):
        return None
    return (whole - second) / (first - second)


def weighting_of(share: float, shares: Mapping[str, float]) -> list[str]:
    """The weightings whose share of the first part matches the measured ``share``: within a
    quarter of the gap between the samples' share and the nearest other (at most 0.02). Both
    token counts (with and without the shift) may match: their shares can be close."""
    others = [abs(v - shares["samples"]) for k, v in shares.items() if k != "samples"]
    tolerance = min([0.02] + [g / 4 for g in others if g > 1e-9])
    return [name for name, s in shares.items() if abs(s - share) <= tolerance]


def window_factor(total: torch.Tensor, accumulation: int, world_size: int = 1) -> torch.Tensor:
    """The factor on gradients accumulated as ``sum_i n_i * grad(loss_i) / accumulation`` (the
    micro-batch loss times its count; Lightning divides by ``accumulation``), averaged over
    ``world_size`` ranks by DDP, that makes them ``sum_i n_i * grad(loss_i) / N`` with ``N`` the
    window's ``total`` over every rank."""
    return accumulation * world_size / total.clamp(min=1e-12)
