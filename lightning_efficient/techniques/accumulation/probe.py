"""The loss's weighting, measured: a few forward passes outside training that change nothing.

:func:`probe_weighting` runs the module's step on a batch, on its two parts and (for targets of
two or more dimensions) on the batch with the first target of each row ignored, without
gradients, in eval mode, with ``self.log`` silenced, and puts the module back as it was (its
attributes, counters, modes and the random state: ``measure.scratch.scratch``). It reads:

- the share of the first part in the whole batch's loss: a mean over samples gives the first
  part the share of its samples; a token mean, the share of its targets (the cut is chosen where
  the two differ most);
- for a token mean, whether the first target of each row counts: a causal LM shifts its labels,
  so ignoring them leaves its loss unchanged; otherwise the loss changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.speed.tokens import targets_of
from lightning_efficient.measure.step import loss_of
from lightning_efficient.techniques.accumulation.weighting import (
    batch_size_of,
    batch_slice,
    measured_share,
    per_sample_counts,
    probe_split,
    weighting_of,
)

__all__ = ["Probe", "probe_weighting", "quiet_forward"]


@dataclass
class Probe:
    """What one probe found.

    Attributes:
        weighting: ``"samples"``, ``"tokens"``, ``"shifted tokens"``; ``None``: not determined.
        settled: False when the batch could not tell the candidates apart (equal lengths, a
            single sample): probe a later batch; ``weighting`` is then the best guess, if any.
        detail: One line saying what was measured.
    """

    weighting: str | None
    settled: bool
    detail: str


@contextlib.contextmanager
def quiet_forward(module: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients, ``self.log`` silenced; the module put back on exit as after
    every measurement (``measure.scratch.scratch``: its attributes, counters, modes and the RNG;
    references kept, as a forward without gradients changes no weight)."""
    with scratch(module, train=False, values=False), torch.no_grad():
        yield


def _first_targets_ignored(batch: Any, ignore_index: int) -> Any:
    target = targets_of(batch)
    masked = target.clone()
    masked[:, 0] = ignore_index
    if isinstance(batch, Mapping):
        return type(batch)({**batch, "labels": masked})
    return type(batch)([*batch[:-1], masked])


def probe_weighting(
    step: Callable[[Any], Any], module: nn.Module, batch: Any, ignore_index: int = -100
) -> Probe:
    """Measure what the loss of ``step(batch)`` averages over (see the module docstring)."""
    size = batch_size_of(batch)
    if size < 2:
        return Probe(None, False, "a batch of one sample cannot be split")
    counts = per_sample_counts(batch, ignore_index)
    pair = {k: v for k, v in counts.items() if k in ("samples", "tokens")}
    cut, gap = probe_split(pair) if len(pair) > 1 else (size // 2, 0.0)
    shares = {k: float(v[:cut].sum() / v.sum().clamp(min=1)) for k, v in counts.items()}
    with quiet_forward(module):
        loss = lambda b: float(loss_of(step(b)).float())  # noqa: E731
        whole = loss(batch)
        first, second = loss(batch_slice(batch, 0, cut)), loss(batch_slice(batch, cut, size))
        share = measured_share(whole, first, second)
        if share is None:
            return Probe(None, False, "the two parts of the batch had the same loss")
        shifts = "shifted tokens" in counts and _shifts(loss, batch, whole, ignore_index)
        if len(pair) > 1 and gap < 0.01:  # samples or targets: a later batch must tell
            guess = "shifted tokens" if shifts else "tokens"
            return Probe(guess, False, "every sample of the batch had as many targets")
        found = weighting_of(share, shares)
        measured = f"first {cut} of {size} samples: {share:.4f} of the loss"
        named = ", ".join(f"{k} {v:.4f}" for k, v in shares.items())
        if not found or ("samples" in found and len(found) > 1):
            return Probe(None, True, f"{measured}; no share fits ({named})")
        if "tokens" in found and shifts:
            found = ["shifted tokens"]
    return Probe(found[0], True, f"{measured} ({named})")


def _shifts(loss: Callable[[Any], float], batch: Any, whole: float, ignore_index: int) -> bool:
    """Whether the loss leaves the first target of each row out (a causal LM's shift): ignoring
    those targets leaves it unchanged."""
    shifted = loss(_first_targets_ignored(batch, ignore_index))
    return shifted == whole or abs(shifted - whole) <= 1e-6 * abs(whole)
