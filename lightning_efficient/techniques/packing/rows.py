"""One packed row from its documents, and what a model needs to keep the documents apart.

- ``read_document(item)``: ``(input_ids, labels or None)`` of a dataset item (a dict with
  ``input_ids`` and optionally ``labels``, as Hugging Face datasets give them); an item's own
  ``attention_mask`` (padding to a fixed length) drops the padding it marks.
- ``build_row(documents, row_length, ...)``: the documents one after another, then padding:
  ``input_ids``, ``labels``, ``position_ids`` and ``attention_mask`` of ``row_length`` tokens (the
  mask: 1 on the documents, 0 on the padding, so that ``measure/speed/tokens.py`` counts the real
  tokens; the attention paths do not need it and drop it). ``position_ids`` restart at 0 for every
  document (and for the padding, which is its own document); ``labels`` are ``-100`` on the padding
  and, for labels the model shifts itself (Hugging Face's causal LMs: the logits at ``t`` predict
  ``labels[t + 1]``), on each document's first token, the one that would be predicted from the
  document before it. The loss over a row is then the token mean over the documents' own targets.
- ``document_ids(position_ids)``: which document each token belongs to (a new document where
  the position does not follow the one before, as ``transformers`` detects packed rows);
  ``document_mask`` the block-diagonal (causal) attention mask from it; ``cu_seqlens`` the
  cumulative document lengths of the flattened batch, for variable-length kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "IGNORE_INDEX",
    "read_document",
    "build_row",
    "document_ids",
    "document_mask",
    "cu_seqlens",
]

#: The label that a loss ignores (``F.cross_entropy``'s and Hugging Face's default).
IGNORE_INDEX = -100


def read_document(item: Any, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, labels or None)`` of one dataset item (number ``index``, for messages), as
    1-D int64 tensors. An item with an ``attention_mask`` (padded by its tokenizer) keeps only
    the tokens its mask marks, which must be one run: the padding is not a document's token."""
    name = "an item" if index is None else f"item #{index}"
    if not isinstance(item, Mapping) or "input_ids" not in item:
        kind = (
            f"a dict with keys {sorted(item)}" if isinstance(item, Mapping) else type(item).__name__
        )
        raise TypeError(
            f"sequence packing reads dataset items that are dicts with `input_ids` (and optionally "
            f"`labels`); {name} is {kind}."
        )
    ids = torch.as_tensor(item["input_ids"], dtype=torch.long).flatten()
    labels = item.get("labels")
    if labels is not None:
        labels = torch.as_tensor(labels, dtype=torch.long).flatten()
        if labels.shape != ids.shape:
            raise ValueError(
                f"{name}'s `labels` has {labels.numel()} entries but its `input_ids` "
                f"{ids.numel()}; packing needs one label per token."
            )
    mask = item.get("attention_mask")
    if mask is None:
        return ids, labels
    kept = torch.as_tensor(mask).flatten() != 0
    if kept.shape != ids.shape:
        raise ValueError(
            f"{name}'s `attention_mask` has {kept.numel()} entries but its `input_ids` "
            f"{ids.numel()}; packing needs one mask value per token."
        )
    where = kept.nonzero().flatten()
    if where.numel() and int(where[-1] - where[0]) + 1 != where.numel():
        raise ValueError(
            f"{name}'s `attention_mask` marks tokens that are not one run ({where.numel()} "
            f"between token {int(where[0])} and {int(where[-1])}); packing drops the padding a mask marks at the start or end of an item, and "
            "cannot tell which tokens of this item are one document."
        )
    return ids[kept], None if labels is None else labels[kept]


def build_row(
    documents: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    row_length: int,
    *,
    pad_id: int = 0,
    shifted_labels: bool = False,
) -> dict[str, torch.Tensor]:
    """One row of ``row_length`` tokens from ``documents`` (``(input_ids, labels or None)``
    pieces; ``None`` labels: the input ids). ``shifted_labels``: the labels are already the next
    tokens (``labels[t]`` is predicted at ``t``), so no target crosses a document boundary and
    none is masked."""
    ids = torch.full((row_length,), pad_id, dtype=torch.long)
    labels = torch.full((row_length,), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(row_length, dtype=torch.long)
    at = 0
    for doc_ids, doc_labels in documents:
        n = doc_ids.numel()
        if at + n > row_length:
            raise ValueError(f"documents of {at + n} tokens do not fit a row of {row_length}.")
        ids[at : at + n] = doc_ids
        labels[at : at + n] = doc_ids if doc_labels is None else doc_labels
        if not shifted_labels:
            labels[at] = IGNORE_INDEX  # predicted from the previous document's last token
        positions[at : at + n] = torch.arange(n)
        at += n
    positions[at:] = torch.arange(row_length - at)  # the padding: a document of its own
    mask = torch.zeros(row_length, dtype=torch.long)
    mask[:at] = 1
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """The document of every token (``batch x sequence``): a new one where a position is not
    the one before plus one."""
    first = position_ids[..., :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(position_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``batch x 1 x sequence x sequence`` boolean mask: a token attends to the tokens of its own
    document (and, ``causal``, only to the earlier ones)."""
    docs = document_ids(position_ids)
    mask = docs[:, None, :, None] == docs[:, None, None, :]
    if causal:
        n = position_ids.shape[-1]
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return mask


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document lengths of the flattened batch (``[0, n1, n1 + n2, ..., total]``,
    int32), what flash-attention's variable-length kernels take."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    if flat.numel() and (starts.numel() == 0 or int(starts[0]) != 0):
        starts = torch.cat([starts.new_zeros(1), starts])
    ends = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([starts, ends]).to(torch.int32)
