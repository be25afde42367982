"""Attention kept inside each document of a packed row, for a model as it is.

``apply_document_attention(model)`` picks the path and returns a ``Change`` (its ``value`` is
the ``DocumentAttention`` session that the caller points at each packed batch, with
``session.current(position_ids)``):

- ``"hf-position-ids"``: the model holds Hugging Face models. Their ``forward`` is wrapped: while
  a packed batch is current, a call on inputs of the batch's shape gets the batch's restarting
  ``position_ids`` (when it was not given them), ``use_cache=False`` and no ``attention_mask``
  (the rows' own marks only the padding at the end, a document of its own): transformers then builds its sdpa/eager/flex masks per document
  (``masking_utils.find_packed_sequence_indices``, which it skips when a cache is in use or a
  mask is passed). Under flash-attention (``attn_implementation="flash_attention_*"``) the
  call also gets ``cu_seq_lens_q/k`` and ``max_length_q/k``, its variable-length path
  (expected, not measured: no GPU here).
- ``"sdpa-document-mask"``: other modules. ``F.scaled_dot_product_attention`` is wrapped for
  the fit: a call whose query and key have the current batch's rows and sequence length gets a
  block-diagonal (causal, when it asked ``is_causal``) document mask, combined with its own.
  A module that imported the function under another name, or that has its own attention
  kernel, or that computes positions from ``arange`` in its forward, is not served:
  ``packing_error`` finds it before training.

``packing_error(step, batches)`` runs the user's own training step on one packed row and on its
documents one by one (no gradients, dropout off, logging silenced, the RNG put back): the packed
loss must equal the token mean of the documents' losses. Where it does not (documents mixed, or
a loss that is not a token mean), it says how far off, so training never starts on mixed rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.techniques.packing.rows import IGNORE_INDEX, cu_seqlens, document_mask

__all__ = ["DocumentAttention", "apply_document_attention", "hf_models", "packing_error"]

PATHS = ("hf-position-ids", "sdpa-document-mask")


class DocumentAttention:
    """The packed batch now in training (its ``position_ids`` and ``input_ids``), and what was
    served."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.position_ids: torch.Tensor | None = None
        self.input_ids: torch.Tensor | None = None
        # training calls given the documents (a forward, or an attention call); a call without
        # gradients (a measurement such as ExactAccumulation's probe) is served, not counted
        self.served = 0
        self.unmatched = 0  # attention calls during a packed batch of another shape

    def current(
        self, position_ids: torch.Tensor | None, input_ids: torch.Tensor | None = None
    ) -> None:
        """Point at the packed batch in training (``None``: none, e.g. validation)."""
        self.position_ids, self.input_ids = position_ids, input_ids

    def matches(self, rows: int, length: int) -> bool:
        pos = self.position_ids
        return pos is not None and tuple(pos.shape) == (rows, length)

    def split_off(self, rows: int, length: int) -> bool:
        """A call holds some of the packed batch's rows (a micro-batch of a split batch)."""
        pos = self.position_ids
        return pos is not None and length == pos.shape[1] and rows < pos.shape[0]

    def split_error(self, rows: int, where: str) -> RuntimeError:
        """Why a micro-batch whose rows cannot be told apart is not run (documents would mix)."""
        return RuntimeError(
            f"packed rows reached {where} {rows} of the batch's {self.position_ids.shape[0]} at a "
            "time (the batch was split into micro-batches, e.g. by OOMRecovery after an "
            "out-of-memory error), and the packing cannot tell which rows these are, so their "
            "documents would mix. Pass the batch's input_ids to the model, or turn the split off "
            "(EfficientBatchSize(oom_recovery=False)) and choose a smaller rows_per_batch."
        )

    def positions_of(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The ``position_ids`` of the rows ``input_ids`` holds: the whole batch, or (a batch
        split into micro-batches, e.g. after an out-of-memory error) the consecutive rows of the
        batch that equal them; ``None`` when they are not rows of the packed batch."""
        pos, ids = self.position_ids, self.input_ids
        if pos is None or input_ids.dim() != 2 or input_ids.shape[1] != pos.shape[1]:
            return None
        rows = input_ids.shape[0]
        if rows == pos.shape[0]:
            return pos
        if ids is None or rows > ids.shape[0]:
            return None
        given = input_ids.to(ids.device)
        for start in range(ids.shape[0] - rows + 1):
            if torch.equal(ids[start : start + rows], given):
                return pos[start : start + rows]
        return None


def hf_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models inside ``model`` (none unless transformers is loaded)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and not any(
            name.startswith(f"{outer}.") or outer == "" for outer, _ in found
        ):
            found.append((name, module))
    return found


def _hf_forward(original: Callable[..., Any], session: DocumentAttention, flash: bool) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            embeds = kwargs.get("inputs_embeds")
            ids = embeds[..., 0] if isinstance(embeds, torch.Tensor) else None
        pos = session.positions_of(ids) if isinstance(ids, torch.Tensor) else None
        if pos is None and isinstance(ids, torch.Tensor) and session.split_off(*ids.shape[:2]):
            raise session.split_error(ids.shape[0], "the model")
        if pos is not None:
            if kwargs.get("position_ids") is None:
                kwargs["position_ids"] = pos
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                # the rows' own mask (the padding at the end of each row) is not needed: the
                # padding is a document of its own, after every real token
                if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
                    raise ValueError(
                        "a packed batch reached the model with an attention_mask that is not "
                        "the rows' own (ones, then zeros on the padding at the end); packed rows "
                        "keep their documents apart by position_ids: pass the batch's mask or none."
                    )
                kwargs["attention_mask"] = None
            kwargs["use_cache"] = False
            if flash:
                cu = cu_seqlens(pos)
                longest = int((cu[1:] - cu[:-1]).max())
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
                kwargs.update(max_length_q=longest, max_length_k=longest)
            session.served += torch.is_grad_enabled()
        return original(*args, **kwargs)

    return forward


def _sdpa(original: Callable[..., Any], session: DocumentAttention) -> Any:
    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if session.position_ids is None:
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs
            )
        q_len, k_len = query.shape[-2], key.shape[-2]
        rows = query.shape[0]
        if query.dim() == 4 and q_len == k_len and session.split_off(rows, q_len):
            raise session.split_error(rows, "F.scaled_dot_product_attention")
        if query.dim() != 4 or q_len != k_len or not session.matches(rows, q_len):
            session.unmatched += 1
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs
            )
        mask = document_mask(session.position_ids.to(query.device), causal=is_causal)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                mask = mask & attn_mask
            else:
                mask = attn_mask.masked_fill(~mask, float("-inf"))
        session.served += torch.is_grad_enabled()
        return original(query, key, value, mask, dropout_p, False, scale=scale, **kwargs)

    return scaled_dot_product_attention


def apply_document_attention(model: nn.Module) -> Change:
    """Keep attention inside each document of the packed batches (see the module docstring).

    Returns a ``Change`` whose ``value`` is the ``DocumentAttention`` session; ``undo()`` puts
    back the wrapped ``forward`` methods or ``F.scaled_dot_product_attention``.
    """
    models = hf_models(model)
    if models:
        session = DocumentAttention("hf-position-ids")
        changes = []
        for _, hf in models:
            kind = str(getattr(hf.config, "_attn_implementation", "") or "")
            flash = kind.startswith("flash")
            wrapped = _hf_forward(hf.forward, session, flash)
            changes.append(patch_attribute(hf, "forward", wrapped))
        names = ", ".join(f"`{n or type(m).__name__}`" for n, m in models)
        what = f"documents kept apart by restarting position_ids in {names} (use_cache off)"
        return Change.of(what, changes, value=session)
    session = DocumentAttention("sdpa-document-mask")
    change = patch_attribute(
        F, "scaled_dot_product_attention", _sdpa(F.scaled_dot_product_attention, session)
    )
    what = "documents kept apart by a document mask on F.scaled_dot_product_attention"
    return Change(what, change.undo, value=session)


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"training_step returned {type(output).__name__}; packing checks the loss it returns "
            "(a tensor, or a dict with 'loss')."
        )
    return loss.detach().double()


def packing_error(
    step: Callable[[dict[str, torch.Tensor]], Any],
    packed: dict[str, torch.Tensor],
    alone: list[dict[str, torch.Tensor]],
    session: DocumentAttention,
) -> float:
    """Relative difference between ``step``'s loss on the ``packed`` batch and the token mean
    (weighted by each batch's targets, ``labels != -100``) of its losses on the batches of
    the documents ``alone``. ``step`` is called with the session pointed at each batch."""

    def loss_of(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        session.current(batch["position_ids"])
        try:
            return _loss(step(batch)), int((batch["labels"] != IGNORE_INDEX).sum())
        finally:
            session.current(None)

    together, count = loss_of(packed)
    parts = [loss_of(b) for b in alone]
    expected = sum(loss * n for loss, n in parts) / sum(n for _, n in parts)
    return float((together - expected).abs() / expected.abs().clamp_min(1e-12)) if count else 0.0
