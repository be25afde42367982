"""Which implementation computes the loss: this package's chunked one, or a library's kernel.

- ``"chunked"``: :func:`~.kernel.chunked_linear_cross_entropy`, pure PyTorch, on every device.
- ``"liger"``: Liger-Kernel's fused linear cross-entropy (``liger_kernel``; Triton, CUDA only).
  It supports a bias, label smoothing and ``mean``/``sum``.
- ``"cce"``: Apple's Cut Cross-Entropy (``cut_cross_entropy``; Triton, CUDA only), run without
  its gradient filtering (``filter_eps=None``), so its gradients are exact. No bias, no label
  smoothing.

:func:`choose_backend` is the rule, pure (the libraries' availability is an argument), so it is
tested on a CPU: ``"auto"`` takes Liger, then Cut Cross-Entropy, on a CUDA device where the call
is one they compute exactly, and the chunked implementation otherwise. Both libraries get the
projection in the compute dtype (autocast's), as ``F.linear`` under autocast would, and return a
float32 loss.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_efficient.techniques.chunked_loss.kernel import chunked_linear_cross_entropy

__all__ = [
    "BACKENDS",
    "LIBRARIES",
    "Call",
    "available_libraries",
    "check_library",
    "choose_backend",
    "run",
]

#: What ``backend=`` accepts.
BACKENDS = ("auto", "chunked", "liger", "cce")
#: Library backends, in the order ``"auto"`` prefers them: name -> (module, pip package).
LIBRARIES = {
    "liger": ("liger_kernel", "liger-kernel"),
    "cce": ("cut_cross_entropy", "cut-cross-entropy"),
}


@dataclass(frozen=True)
class Call:
    """What one loss call needs from a backend (the facts ``choose_backend`` decides on)."""

    device_type: str
    has_bias: bool
    label_smoothing: float
    reduction: str


def available_libraries() -> dict[str, bool]:
    """Whether each library backend is importable here (without importing it)."""
    return {
        name: importlib.util.find_spec(module) is not None
        for name, (module, _) in LIBRARIES.items()
    }


def _unsupported(name: str, call: Call) -> str | None:
    """Why library ``name`` cannot compute ``call`` exactly (``None``: it can)."""
    if call.device_type != "cuda":
        return f"it runs on CUDA only (Triton), and this call is on {call.device_type!r}"
    if name == "cce" and call.has_bias:
        return "Cut Cross-Entropy takes no bias"
    if name == "cce" and call.label_smoothing:
        return "Cut Cross-Entropy has no label smoothing"
    return None


def choose_backend(requested: str, call: Call, available: Mapping[str, bool]) -> tuple[str, str]:
    """``(backend, why)`` for one loss call. ``requested``: one of :data:`BACKENDS`;
    ``available``: library name -> importable. A library asked for by name that cannot take the
    call falls back to ``"chunked"``, and ``why`` says so."""
    if requested == "chunked":
        return "chunked", "asked for"
    if requested in LIBRARIES:
        if not available.get(requested, False):
            return "chunked", f"{requested} is not installed"
        why = _unsupported(requested, call)
        return (requested, "asked for") if why is None else ("chunked", why)
    for name in LIBRARIES:  # auto
        if available.get(name, False) and _unsupported(name, call) is None:
            return name, "installed, and the call is on CUDA"
    if call.device_type != "cuda":
        return "chunked", "not on CUDA"
    return "chunked", "no library backend installed that computes this call"


def check_library(name: str) -> None:
    """An ``ImportError`` with the command that installs library backend ``name`` when it is
    missing (it is not a dependency of this package: it needs Triton and CUDA)."""
    module, package = LIBRARIES[name]
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"backend={name!r} needs `{package}`, which is not installed (it needs Triton and a "
            f"CUDA GPU). Install it with: pip install {package}; or use backend='auto'."
        )


def _liger(hidden, weight, bias, target, *, ignore_index, label_smoothing, reduction, dtype):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden.to(dtype),
        weight.to(dtype),
        target,
        bias.to(dtype) if bias is not None else None,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        accum_dtype=torch.float32,
    )


def _cce(hidden, weight, bias, target, *, ignore_index, label_smoothing, reduction, dtype):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(
        hidden.to(dtype),
        weight.to(dtype),
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        filter_eps=None,  # exact gradients (its default filters small softmax entries)
    )


_LIBRARY_CALLS: dict[str, Callable[..., torch.Tensor]] = {"liger": _liger, "cce": _cce}


def run(
    backend: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_dtype: torch.dtype,
    logit_casts: tuple[torch.dtype, ...],
    out_dtype: torch.dtype,
    chunk_bytes: int,
) -> Any:
    """The loss by ``backend`` (a name :func:`choose_backend` returned)."""
    if backend == "chunked":
        return chunked_linear_cross_entropy(
            hidden,
            weight,
            bias,
            target,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            compute_dtype=compute_dtype,
            logit_casts=logit_casts,
            out_dtype=out_dtype,
            chunk_bytes=chunk_bytes,
        )
    with torch.autocast(hidden.device.type, enabled=False):
        loss = _LIBRARY_CALLS[backend](
            hidden,
            weight,
            bias,
            target,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            dtype=compute_dtype,
        )
    return loss if loss.dtype == out_dtype else loss.to(out_dtype)
