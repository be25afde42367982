"""Cross-entropy of a linear projection, in chunks of rows, never holding the full logits.

``chunked_linear_cross_entropy(hidden, weight, bias, target)`` equals
``F.cross_entropy(F.linear(hidden, weight, bias), target)`` (with ``ignore_index``, mean or sum
reduction and label smoothing as torch defines them) in value and gradients, but it computes the
logits ``rows`` at a time. Each chunk's logits serve three purposes before they are dropped:
the chunk's log-sum-exp and target logit (the loss), and its gradient ``softmax - target``,
which is multiplied right away into the gradients of the hidden states and of the weight. So
the forward computes the gradients too, and keeps only them for backward: the gradient of the
hidden states (the size of the hidden states), of the weight (created here instead of in the
head's backward, where the plain step creates it) and of the bias. Backward only scales them by
the incoming gradient. Three matrix products per chunk, as in the plain step's forward and
backward of the projection; no recomputation.

The gradients are formed *unscaled* (``softmax - target`` is within [-1, 1]) and the reduction's
``1 / count`` and the incoming gradient (the loss scale of ``16-mixed``, ``1 /
accumulate_grad_batches``) are applied in backward in float32, so fp16 chunks cannot underflow.

Mixed precision follows what the plain step computes: the projection runs in ``compute_dtype``
(autocast's dtype under autocast, where ``F.linear`` casts both operands), its logits are rounded
to that dtype and then through ``logit_casts`` (``logits.float()`` in Hugging Face's loss), and
the log-sum-exp, the softmax and every reduction are computed in float32 (as CUDA's and the CPU's
autocast policies compute ``cross_entropy``). The weight's gradient is accumulated over the
chunks in float32 and returned in the weight's own dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_efficient.core._internals import fake_tensor_errors

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "LOGITS_FRACTION",
    "MIN_ROWS",
    "REDUCTIONS",
    "chunk_rows",
    "chunked_linear_cross_entropy",
]

#: The largest chunk by default: 128 MiB of float32 logits (at most about 4x that live in a
#: chunk: its logits in the compute dtype, in float32, and the gradient in the compute dtype).
DEFAULT_CHUNK_BYTES = 128 * 2**20
#: A chunk never holds more than this fraction of the logits' rows, so the loss phase stays a
#: small share of the step at every shape (moderate logits included, which ``chunk_bytes``
#: alone would hold whole): at most 1/16 of the rows, as Liger-Kernel sizes its chunks from the
#: batch rather than from a fixed byte count.
LOGITS_FRACTION = 16
#: ... but not fewer rows than this (narrow matrix products are slow), unless the cap in bytes
#: says so.
MIN_ROWS = 16
#: The reductions the chunked loss computes (``"none"`` needs each row's gradient before the
#: weight's gradient can be summed, which this forward-time gradient cannot know).
REDUCTIONS = ("mean", "sum")


def chunk_rows(vocab: int, rows: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk: ``1 / LOGITS_FRACTION`` of ``rows`` (at least ``MIN_ROWS``), and never
    more than keep one chunk's float32 logits within ``chunk_bytes`` (at least 1, at most
    ``rows``)."""
    by_bytes = chunk_bytes // (4 * max(1, vocab))
    share = max(MIN_ROWS, -(-rows // LOGITS_FRACTION))
    return max(1, min(rows, by_bytes, share))


def _autocast_off(device_type: str) -> torch.autocast:
    return torch.autocast(device_type, enabled=False)


def _chunk(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    t: torch.Tensor,
    keep: torch.Tensor,
    label_smoothing: float,
    logit_casts: tuple[torch.dtype, ...],
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> torch.Tensor:
    """One chunk: its summed loss (float32), and its gradients added to ``grad_h`` (the chunk's
    rows), ``grad_w`` and ``grad_b`` in place (unscaled). Every (rows x vocabulary) temporary is
    freed on return, before the next chunk's logits are made."""
    logits = F.linear(h, w, b)
    for dtype in logit_casts:  # e.g. Hugging Face's logits.float()
        logits = logits.to(dtype)
    z = logits.float()
    del logits
    target_logit = z.gather(1, t).squeeze(1)
    mean_logit = z.mean(1) if label_smoothing else None
    top = z.amax(1, keepdim=True)
    p = z.sub_(top).exp_()  # in place: z's storage holds the softmax from here
    total = p.sum(1, keepdim=True)
    lse = total.log().add_(top).squeeze(1)
    row_loss = lse - target_logit
    if label_smoothing:
        row_loss = row_loss * (1 - label_smoothing) + (lse - mean_logit) * label_smoothing
    loss = (row_loss * keep).sum()
    if grad_h is None and grad_w is None and grad_b is None:
        return loss
    # d loss_row / d logits = softmax - (1 - eps) onehot - eps / V, and 0 on the ignored rows
    p.div_(total)
    if label_smoothing:
        p.sub_(label_smoothing / p.shape[1])
    p.scatter_add_(1, t, torch.full_like(t, -(1 - label_smoothing), dtype=p.dtype))
    p.mul_(keep[:, None])
    g = p.to(w.dtype)  # rounded as the plain step rounds the logits' gradient
    del z, p
    if grad_h is not None:
        grad_h.copy_(g @ w)
    if grad_w is not None:
        if grad_w.dtype == g.dtype:
            grad_w.addmm_(g.t(), h)
        else:
            grad_w += g.t() @ h
    if grad_b is not None:
        grad_b += g.sum(0, dtype=torch.float32)
    return loss


def _check_targets(target: torch.Tensor, valid: torch.Tensor, vocab: int) -> None:
    """F.cross_entropy's ``IndexError`` ("Target 256 is out of bounds.") for a class index
    outside ``[0, vocab)`` that is not ignored, where it can be read without a device sync: on
    a CPU, outside a compiled region and not on fake tensors (the estimate's). Elsewhere an
    out-of-range target fails in the gather, as the plain loss fails in its kernel."""
    if target.device.type != "cpu" or torch.compiler.is_compiling():
        return
    try:
        bad = valid & ((target < 0) | (target >= vocab))
        if not bool(bad.any()):
            return
        value = int(target[bad][0])
    except fake_tensor_errors():
        return
    raise IndexError(f"Target {value} is out of bounds.")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss in forward, gradients in forward (see the module's docstring), scaled in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        ignore_index: int,
        label_smoothing: float,
        reduction: str,
        compute_dtype: torch.dtype,
        logit_casts: tuple[torch.dtype, ...],
        rows: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with _autocast_off(hidden.device.type):
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            valid = target != ignore_index
            _check_targets(target, valid, weight.shape[0])
            safe = torch.where(valid, target, torch.zeros_like(target))
            keep = valid.to(torch.float32)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            for start in range(0, n, rows):
                rows_ = slice(start, min(n, start + rows))
                loss += _chunk(
                    hidden[rows_].to(compute_dtype),
                    w,
                    b,
                    safe[rows_, None],
                    keep[rows_],
                    label_smoothing,
                    logit_casts,
                    grad_h[rows_] if grad_h is not None else None,
                    grad_w,
                    grad_b,
                )
            count = keep.sum()
            if reduction == "mean":
                # no row counted (a fully padded batch): the loss is 0 / 0 = NaN and every
                # gradient 0, as F.cross_entropy gives
                out = loss / count
                scale = torch.where(count > 0, 1 / count.clamp(min=1), torch.zeros_like(count))
            else:
                out, scale = loss, torch.ones_like(count)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.scale = scale
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "ChunkedCrossEntropy's loss was backpropagated twice: its gradients are formed "
                "in the forward and handed over once (backward with retain_graph=True through "
                "it is not supported)."
            )
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None  # handed over: autograd may keep the tensors as .grad without a copy
        scale = ctx.scale * grad_loss.float()
        w_dtype, b_dtype = ctx.dtypes
        if grad_h is not None:
            grad_h = grad_h.mul_(scale.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(w_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(scale).to(b_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    compute_dtype: torch.dtype | None = None,
    logit_casts: Sequence[torch.dtype] = (),
    out_dtype: torch.dtype = torch.float32,
    rows: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` in chunks of ``rows``
    rows (default: :func:`chunk_rows` for ``chunk_bytes``).

    Args:
        hidden: ``(N, H)`` hidden states (any float dtype; the gradient comes back in it).
        weight: ``(V, H)`` the projection's weight; ``bias``: ``(V,)`` or ``None``.
        target: ``(N,)`` class indices; rows equal to ``ignore_index`` count for nothing.
        label_smoothing: As ``F.cross_entropy``'s.
        reduction: ``"mean"`` (over the rows not ignored) or ``"sum"``.
        compute_dtype: The dtype the projection runs in (default: ``hidden``'s; autocast's
            dtype to reproduce ``F.linear`` under autocast).
        logit_casts: Dtypes the logits are converted to, in order, before the loss (e.g.
            ``(torch.float32,)`` for ``logits.float()``); the loss itself is computed in float32.
        out_dtype: The dtype of the returned loss (what the plain ``F.cross_entropy`` returns).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}; got {reduction!r}.")
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            f"`hidden` must be (N, H) and `target` (N,); got {tuple(hidden.shape)} and "
            f"{tuple(target.shape)}."
        )
    n = hidden.shape[0]
    rows = rows if rows is not None else chunk_rows(weight.shape[0], n, chunk_bytes)
    loss = _ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        bias,
        target,
        int(ignore_index),
        float(label_smoothing),
        reduction,
        compute_dtype or hidden.dtype,
        tuple(logit_casts),
        max(1, int(rows)),
    )
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)
