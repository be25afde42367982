"""The in-place checkpointing wrapper, and what its recompute must not change.

A chosen block's instance ``forward`` is shadowed by ``_CheckpointedForward``, which runs the
original forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. The recompute
in backward leaves BatchNorm running statistics as the forward left them (updated once per
forward), and container arguments are copied so the recompute sees what the forward saw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_efficient.techniques.activation_checkpointing.offload import (
    BoundaryChain,
    pack_to_host,
    unpack_from_host,
)

__all__ = [
    "OnceStats",
    "shallow_copy",
    "SELECTIVE_SAVE_OPS",
    "ATTR",
    "HOST",
    "ShadowedForward",
    "unshadow",
    "wrap_block",
    "unwrap_block",
]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def shallow_copy(value: Any) -> Any:
    # plain containers only: a subclass (a model output class) may not rebuild from its items
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    return value


class OnceStats:
    """The function checkpoint runs: the first call is the forward; every later call is a
    recompute in backward, in which BatchNorm layers normalise with the same batch statistics
    but leave their running statistics (and ``num_batches_tracked``) as the forward left them."""

    def __init__(self, forward: Callable[..., Any], module: nn.Module) -> None:
        self.forward, self.module, self.calls = forward, module, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        norms = [
            m
            for m in self.module.modules()
            if isinstance(m, _BATCH_NORMS) and m.training and m.track_running_stats
        ]
        if not norms:
            return self.forward(*args, **kwargs)
        saved = [(m, m.momentum, m.num_batches_tracked) for m in norms]
        for m, _, tracked in saved:
            m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch: unchanged, exactly
            if tracked is not None:
                m.num_batches_tracked = tracked.clone()  # the increment lands on a copy
        try:
            return self.forward(*args, **kwargs)
        finally:
            for m, momentum, tracked in saved:
                m.momentum = momentum
                if tracked is not None:
                    m.num_batches_tracked = tracked


ATTR = "_le_activation_checkpointing"  # per-block settings; forward is shadowed while present


def _selective_save_ops() -> list[Any]:
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ]
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


#: The ops whose outputs ``selective=True`` keeps (matmuls and attention); all others recompute.
SELECTIVE_SAVE_OPS: list[Any] = _selective_save_ops()


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(SELECTIVE_SAVE_OPS)


# -- the in-place wrapper -------------------------------------------------------------------------
class ShadowedForward:
    """Shadows ``module.forward`` in place (an instance attribute); deep-copies and pickles with
    its module (a plain function closure would keep pointing at the original module after
    ``copy.deepcopy``). ``_forward`` runs the forward that was there before."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module = module
        self.inner = inner  # the instance forward that was there before us, if any

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)


def unshadow(module: nn.Module, cls: type[ShadowedForward], attr: str) -> None:
    """Put back the forward a ``cls`` wrapper of ``module`` shadows, and drop its ``attr``."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, cls) and wrapper.module is module:
        if wrapper.inner is not None:
            object.__setattr__(module, "forward", wrapper.inner)
        else:
            del module.__dict__["forward"]
    module.__dict__.pop(attr, None)


class _CheckpointedForward(ShadowedForward):
    """The checkpointing wrapper of one block."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.module.__dict__.get(ATTR)
        if state is None or state["wrapper"] is not self:
            # removed (or replaced) while another wrapper (e.g. a compiled forward) held on to us
            return self._forward(*args, **kwargs)
        mode, chain = state["mode"], state.get("host")
        if mode == "offload":
            with torch.autograd.graph.saved_tensors_hooks(pack_to_host, unpack_from_host):
                return self._forward(*args, **kwargs)
        if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to save
            return self._forward(*args, **kwargs)
        # context_fn only when selective: torch.compile cannot trace an explicit noop_context_fn
        extra = {"context_fn": _selective_context} if mode == "selective" else {}
        # containers are copied so the recompute sees what this forward saw (a DenseNet layer's
        # feature list grows after the call); BatchNorm statistics update once, not again in the
        # recompute
        args = tuple(shallow_copy(a) for a in args)
        kwargs = {k: shallow_copy(v) for k, v in kwargs.items()}
        if chain is not None:  # only the inputs checkpoint keeps are saved outside its own hooks
            with torch.autograd.graph.saved_tensors_hooks(chain.pack, chain.unpack):
                return self._checkpoint(args, kwargs, extra)
        return self._checkpoint(args, kwargs, extra)

    def _checkpoint(self, args: tuple, kwargs: dict, extra: dict) -> Any:
        return checkpoint(
            OnceStats(self._forward, self.module),
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            **extra,
            **kwargs,
        )


#: A mode's suffix for blocks whose saved inputs are kept in host memory (``"full+host"``).
HOST = "+host"


def wrap_block(block: nn.Module, mode: str, chain: BoundaryChain | None = None) -> None:
    """Wrap ``block`` in ``mode`` (``"full"``, ``"selective"``, ``"offload"``; ``"+host"``
    appended: its saved inputs in host memory through ``chain``, a new one if not given)."""
    host = None
    if mode.endswith(HOST):
        mode, host = mode[: -len(HOST)], chain or BoundaryChain()
    state = block.__dict__.get(ATTR)
    if state is not None:
        state["mode"], state["host"] = mode, host
        return
    inner = block.__dict__.get("forward")
    if isinstance(inner, _CheckpointedForward) and inner.module is block:
        wrapper = inner  # ours, left in place after a removal: reuse it rather than nest
    else:
        wrapper = _CheckpointedForward(block, inner)
        object.__setattr__(block, "forward", wrapper)
    object.__setattr__(block, ATTR, {"mode": mode, "wrapper": wrapper, "host": host})


def unwrap_block(block: nn.Module) -> None:
    unshadow(block, _CheckpointedForward, ATTR)
