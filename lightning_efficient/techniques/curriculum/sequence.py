"""Cut the sequences of a batch to a shorter length: the maths of a sequence-length warm-up.

A batch is a tensor, a tuple/list (namedtuples too) or a dict (``input_ids``, ``labels``,
``attention_mask``, ...), nested as deep as needed. Its *sequence dimension* is dim 1 of the
token tensor: ``input_ids`` in a dict, else the first tensor with at least two dimensions. Every
tensor with the same batch size (dim 0) and sequence length (dim 1) is cut; everything else is
left as it is (``reshape`` repeats per-sample tensors of shape ``(batch, ...)`` once per piece).

- ``truncate``: keep the first ``length`` tokens of each sample; tokens per step shrink.
- ``reshape``: cut each sample into ``full // length`` pieces of ``length`` tokens and stack
  them along the batch dimension, so a batch of ``B x S`` becomes ``(B * S/length) x length``;
  tokens per step stay the same (exactly, when ``length`` divides ``S``; a remainder is dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_efficient.core.validate import check_choice, check_int

__all__ = ["CUT_MODES", "sequence_shape", "cut_batch", "describe_batch"]

CUT_MODES: tuple[str, ...] = ("truncate", "reshape")


def _leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _leaves(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _leaves(v)]
    return []


def describe_batch(batch: Any, depth: int = 0) -> str:
    """A short description of a batch's structure and tensor shapes (for error messages)."""
    if isinstance(batch, torch.Tensor):
        return f"tensor{tuple(batch.shape)}"
    if depth > 2:
        return type(batch).__name__
    if isinstance(batch, Mapping):
        items = ", ".join(
            f"{k!r}: {describe_batch(v, depth + 1)}" for k, v in list(batch.items())[:6]
        )
        return "{" + items + "}"
    if isinstance(batch, (tuple, list)):
        inner = ", ".join(describe_batch(v, depth + 1) for v in list(batch)[:6])
        return f"{type(batch).__name__}({inner})"
    return type(batch).__name__


def sequence_shape(batch: Any) -> tuple[int, int]:
    """``(batch_size, sequence_length)`` of the batch's token tensor.

    Raises:
        ValueError: no tensor with a sequence dimension (at least two dimensions); the message
            says what the batch holds.
    """
    token = None
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        token = batch["input_ids"]
    if token is None or token.dim() < 2:
        token = next((t for t in _leaves(batch) if t.dim() >= 2), None)
    if token is None:
        raise ValueError(
            "the batch has no sequence dimension to cut: no tensor with at least two dimensions "
            f"(batch, sequence, ...); found {describe_batch(batch)}."
        )
    return int(token.shape[0]), int(token.shape[1])


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, Mapping):
        mapped = {k: _map(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def cut_batch(batch: Any, length: int, mode: str = "truncate") -> Any:
    """The batch with its sequences cut to ``length`` tokens (see the module docstring).

    A batch whose sequences are already at most ``length`` long is returned unchanged.
    """
    check_int("length", length, minimum=1)
    check_choice("mode", mode, CUT_MODES)
    size, seq = sequence_shape(batch)
    if length >= seq:
        return batch
    pieces = seq // length

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[0] == size and t.shape[1] == seq:
            if mode == "truncate":
                return t[:, :length].contiguous()
            kept = t[:, : pieces * length]
            return kept.reshape(size * pieces, length, *t.shape[2:])
        if mode == "reshape" and t.dim() >= 1 and t.shape[0] == size:
            return t.repeat_interleave(pieces, dim=0)
        return t

    return _map(batch, cut)
