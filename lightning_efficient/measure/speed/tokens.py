"""What a sample and a token of a batch are: one definition, used everywhere.

- **Tokens**: the ones of the batch's attention mask when it has one (``attention_mask`` in a
  dict batch: the positions that are not padding), else the elements of its first integer tensor
  with two or more dimensions (``batch x sequence`` token ids: a batch without padding). A batch
  without such a tensor (images, features; a 1-D integer tensor is one class label per sample,
  not a sequence) has no tokens: ``None``. Boolean tensors are masks, not tokens.
- **Samples**: the first dimension of that token tensor, else of the batch's first tensor.
- **Loss tokens** (``count_loss_tokens``): what a token-mean loss divides by, the targets that
  differ from ``ignore_index`` (``labels`` in a dict, else the last tensor of a tuple); a batch
  without targets counts its tokens. For a padded batch whose labels mark the padding with
  ``ignore_index`` (the usual collate), the two counts agree.

``StepProfiler`` (tokens/s), ``EarlyStopper(max_tokens=)`` and the FLOP count per sample read
``batch_counts``; the OOM split weights micro-batch losses by ``count_loss_tokens``.
``BatchCounter`` sums the same counts over many batches at O(1) per batch and without a device
synchronisation (what ``StepProfiler`` does on every step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_efficient.core._internals import tree_flatten

__all__ = [
    "BatchCounter",
    "batch_counts",
    "count_tokens",
    "count_loss_tokens",
    "targets_of",
    "MASK_KEY",
]

#: The dict key of a batch's attention mask.
MASK_KEY = "attention_mask"


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]


def _is_token_ids(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _token_tensor(batch: Any) -> tuple[torch.Tensor | None, bool]:
    """(the tensor the tokens are read from, whether it is an attention mask)."""
    if isinstance(batch, Mapping) and isinstance(batch.get(MASK_KEY), torch.Tensor):
        return batch[MASK_KEY], True
    ids = next((t for t in _tensors(batch) if _is_token_ids(t)), None)
    return ids, False


def count_tokens(batch: Any) -> int | None:
    """The tokens of ``batch`` (see the module docstring); ``None``: it holds no token ids."""
    tensor, is_mask = _token_tensor(batch)
    if tensor is None:
        return None
    return int(tensor.count_nonzero()) if is_mask else int(tensor.numel())


def batch_counts(batch: Any) -> tuple[int, int | None]:
    """``(samples, tokens or None)`` of ``batch`` (see the module docstring)."""
    tensor, _ = _token_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        tensors = _tensors(batch)
        return (int(tensors[0].shape[0]) if tensors else 0), None
    return int(tensor.shape[0]), count_tokens(batch)


class BatchCounter:
    """Samples and tokens of many batches, as ``batch_counts`` counts them, at O(1) per batch.

    Where the token tensor sits (an attention mask under ``MASK_KEY``, or the first integer
    tensor of two or more dimensions) is found on the first batch and reused while the batches
    keep that structure (same type, keys or length, and tensors of the same dtypes and ranks at
    the top level); any other batch is counted by ``batch_counts``. An attention mask's ones are summed on the mask's
    device and read only by ``tokens``: no device synchronisation per batch.
    """

    def __init__(self) -> None:
        self.batches = self.samples = 0
        self._tokens = 0
        self._mask_ones: list[torch.Tensor] = []  # per-batch sums, folded every 64 batches
        self._no_tokens = False  # a batch had no tokens: ``tokens`` is None from then on
        self._shape: Any = None  # the structure the locator was found for
        self._where: tuple[Any, str] | None = None  # (index or key, "mask"/"ids"/"samples")

    @property
    def tokens(self) -> int | None:
        """Tokens of every batch counted; ``None`` once a batch had none."""
        if self._no_tokens:
            return None
        if self._mask_ones:
            self._tokens += int(torch.stack([t.to("cpu") for t in self._mask_ones]).sum())
            self._mask_ones.clear()
        return self._tokens

    def add(self, batch: Any) -> None:
        """Count one batch."""
        self.batches += 1
        shape = _structure(batch)
        if shape is None or shape != self._shape:
            self._shape, self._where = shape, _locate(batch) if shape is not None else None
            if shape is None:
                self._add_slow(batch)
                return
        where = self._where
        if where is None:  # no tensor with a batch dimension at the top level: the general rule
            self._add_slow(batch)
            return
        key, kind = where
        tensor = batch[key]
        self.samples += int(tensor.shape[0])
        if kind == "samples":  # no token ids in this batch
            self._no_tokens = True
        elif self._no_tokens:
            return
        elif kind == "mask":
            self._mask_ones.append(tensor.count_nonzero())
            if len(self._mask_ones) >= 64:
                self._mask_ones = [torch.stack(self._mask_ones).sum()]
        else:
            self._tokens += tensor.numel()

    def _add_slow(self, batch: Any) -> None:
        samples, tokens = batch_counts(batch)
        self.samples += samples
        if tokens is None:
            self._no_tokens = True
        elif not self._no_tokens:
            self._tokens += tokens


def _structure(batch: Any) -> Any:
    """A cheap key of what ``batch_counts``' rule reads of a flat batch (its type, keys or
    length, and each tensor's dtype and whether it has 0, 1 or 2+ dimensions), or None where the
    fast path does not apply (nested containers, other types)."""
    if isinstance(batch, Mapping):
        values: Any = batch.values()
        head: Any = (type(batch), tuple(batch))
    elif isinstance(batch, (list, tuple)):
        values, head = batch, type(batch)
    else:
        return None
    try:
        return head, tuple((v.dtype, min(v.dim(), 2)) for v in values)
    except AttributeError:  # not a tensor
        return None


def _locate(batch: Any) -> tuple[Any, str] | None:
    """Where ``batch_counts`` reads a flat batch: ``(key, "mask")`` (an attention mask),
    ``(key, "ids")`` (token ids) or ``(key, "samples")`` (no token ids: the first tensor with a
    batch dimension gives the samples); None when no tensor has a dimension."""
    if isinstance(batch, Mapping):
        if isinstance(batch.get(MASK_KEY), torch.Tensor) and batch[MASK_KEY].dim() > 0:
            return MASK_KEY, "mask"
        items = list(batch.items())
    else:
        items = list(enumerate(batch))
    items = [(key, t) for key, t in items if t.dim() > 0]
    for key, t in items:
        if _is_token_ids(t):
            return key, "ids"
    return (items[0][0], "samples") if items else None


def targets_of(batch: Any, key: str = "labels") -> torch.Tensor | None:
    """The targets of a batch: ``batch[key]`` of a dict, else the last tensor of a tuple/list
    (None when that is not a tensor with a dimension)."""
    if isinstance(batch, Mapping):
        target = batch.get(key)
    elif isinstance(batch, (list, tuple)) and batch:
        target = batch[-1]
    else:
        target = None
    return target if isinstance(target, torch.Tensor) and target.dim() > 0 else None


def count_loss_tokens(batch: Any, ignore_index: int = -100, key: str = "labels") -> int:
    """The targets a token-mean loss averages over: the entries of ``batch[key]`` (a dict
    batch) or of the last tensor of a tuple/list batch that differ from ``ignore_index``; a
    batch without targets counts its tokens (:func:`count_tokens`)."""
    target = batch if isinstance(batch, torch.Tensor) else targets_of(batch, key)
    if target is not None:
        return int((target != ignore_index).sum())
    tokens = count_tokens(batch)
    if tokens is None:
        keys = f"; keys are {list(batch)}" if isinstance(batch, Mapping) else ""
        raise ValueError(
            f"token weighting: the batch has no {key!r} targets and no token ids{keys}; pass "
            "`token_counter`"
        )
    return tokens
