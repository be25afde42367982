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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_efficient.core._internals import tree_flatten

__all__ = ["batch_counts", "count_tokens", "count_loss_tokens", "MASK_KEY"]

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


def count_loss_tokens(batch: Any, ignore_index: int = -100, key: str = "labels") -> int:
    """The targets a token-mean loss averages over: the entries of ``batch[key]`` (a dict
    batch) or of the last tensor of a tuple/list batch that differ from ``ignore_index``; a
    batch without targets counts its tokens (:func:`count_tokens`)."""
    target = None
    if isinstance(batch, Mapping):
        target = batch.get(key)
    elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[-1], torch.Tensor):
        target = batch[-1]
    elif isinstance(batch, torch.Tensor):
        target = batch
    if isinstance(target, torch.Tensor):
        return int((target != ignore_index).sum())
    tokens = count_tokens(batch)
    if tokens is None:
        keys = f"; keys are {list(batch)}" if isinstance(batch, Mapping) else ""
        raise ValueError(
            f"token weighting: the batch has no {key!r} targets and no token ids{keys}; pass "
            "`token_counter`"
        )
    return tokens
