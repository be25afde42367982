"""The memory of one rank when a strategy divides the training state across ranks.

Pure functions on a one-device :class:`~lightning_efficient.measure.types.MemoryEstimate` (the
fake-tensor estimate of one step at the per-rank batch): each category live at the peak is
divided as the strategy divides it, and the communication buffers the strategy adds are counted.

======================  ==========  ==========  ===========  =====================================
sharding                parameters  gradients   optimizer    buffers added
======================  ==========  ==========  ===========  =====================================
``ddp``                 P           G           O            G (DDP's gradient buckets)
``zero1``               P           G           O / N        one block's gradients (reduce bucket)
``zero2``               P           G / N       O / N        one block's gradients (reduce bucket)
``zero3``, ``full``     P / N       G / N       O / N        2 blocks' parameters gathered (the
                                                             current and the prefetched one) + one
                                                             block's gradients (reduce-scatter)
``grad_op``             P / N       G / N       O / N        P - P / N (every block stays gathered
                                                             from forward to backward) + one
                                                             block's gradients
======================  ==========  ==========  ===========  =====================================

Activations and temporaries are those of the per-rank batch, unchanged. ``full`` and
``grad_op`` are FSDP's FULL_SHARD and SHARD_GRAD_OP (``FullyShardedStrategy(sharding=...)``);
``zero1/2/3`` are DeepSpeed's stages. A block is the largest repeated module (the caller passes
its parameter bytes; :func:`largest_block_bytes` is the fallback).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from torch import nn

from lightning_efficient.core.validate import check_choice, check_int
from lightning_efficient.measure.types import MemoryEstimate

__all__ = [
    "SHARDINGS",
    "shard_factors",
    "buffer_bytes",
    "per_rank_estimate",
    "largest_block_bytes",
    "parameter_bytes",
    "world_size_of",
    "check_sharding",
    "per_rank_for_model",
]

#: Strategies the per-rank estimate knows, and what each divides.
SHARDINGS = ("ddp", "zero1", "zero2", "zero3", "full", "grad_op")


def world_size_of(devices: int = 1, num_nodes: int = 1) -> int:
    """Ranks of a run on ``num_nodes`` machines with ``devices`` processes each."""
    return check_int("devices", devices, minimum=1) * check_int("num_nodes", num_nodes, minimum=1)


def shard_factors(sharding: str, world_size: int) -> dict[str, float]:
    """The share of each state category one rank keeps (1: all of it; 1/N: a shard)."""
    check_choice("sharding", sharding, SHARDINGS)
    check_int("world_size", world_size, minimum=1)
    shard = 1.0 / world_size
    params = shard if sharding in ("zero3", "full", "grad_op") else 1.0
    grads = 1.0 if sharding in ("ddp", "zero1") else shard
    optim = 1.0 if sharding == "ddp" else shard
    return {"parameters": params, "gradients": grads, "optimizer_state": optim}


def buffer_bytes(
    sharding: str, world_size: int, *, param_bytes: int, grad_bytes: int, block_bytes: int
) -> dict[str, int]:
    """The communication buffers one rank holds at the peak, by the category they belong to:
    gathered parameters count as ``parameters``, reduce buffers as ``gradients``."""
    check_choice("sharding", sharding, SHARDINGS)
    if world_size == 1:
        return {"parameters": 0, "gradients": 0}
    if sharding == "ddp":
        return {"parameters": 0, "gradients": grad_bytes}
    block_grads = min(block_bytes, grad_bytes)
    if sharding in ("zero1", "zero2"):
        return {"parameters": 0, "gradients": block_grads}
    if sharding == "grad_op":
        gathered = param_bytes - math.ceil(param_bytes / world_size)
        return {"parameters": gathered, "gradients": block_grads}
    return {"parameters": min(2 * block_bytes, param_bytes), "gradients": block_grads}


def per_rank_estimate(
    estimate: MemoryEstimate,
    *,
    world_size: int,
    sharding: str = "ddp",
    param_bytes: int,
    block_bytes: int,
) -> MemoryEstimate:
    """One rank's peak from the one-device ``estimate`` (see the module's table).

    ``param_bytes`` is the model's parameter bytes (its gradients are as many);
    ``block_bytes`` the parameter bytes of its largest block.
    """
    factors = shard_factors(sharding, world_size)
    extra = buffer_bytes(
        sharding,
        world_size,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        block_bytes=block_bytes,
    )
    by_category = {}
    for category, value in estimate.by_category.items():
        divided = math.ceil(value * factors.get(category, 1.0))
        by_category[category] = divided + extra.get(category, 0)
    peak = sum(by_category.values())
    added = peak - estimate.peak_bytes
    phases = {phase: max(0, value + added) for phase, value in estimate.phase_peaks.items()}
    host = estimate.host_bytes
    if host:  # offloaded state is divided like the device state
        host = math.ceil(host * factors["optimizer_state"])
    note = (
        f"per rank: {sharding} over {world_size} ranks (parameters x{factors['parameters']:.3g}, "
        f"gradients x{factors['gradients']:.3g}, optimizer state x{factors['optimizer_state']:.3g}; "
        f"buffers +{extra['parameters'] + extra['gradients']} bytes)"
    )
    return replace(
        estimate,
        peak_bytes=peak,
        by_category=by_category,
        phase_peaks=phases,
        host_bytes=host,
        notes=[*estimate.notes, note],
    )


def parameter_bytes(model: nn.Module, precision: str = "32-true") -> int:
    """Bytes of the model's parameters as training holds them (``bf16-true``: 2 per element)."""
    size = 2 if precision == "bf16-true" else None
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * (size or p.element_size())
    return total


def largest_block_bytes(model: nn.Module, precision: str = "32-true") -> int:
    """Parameter bytes of the largest member of a ``ModuleList``/``Sequential`` of at least two
    modules (the layer stack of a transformer); the whole model when there is none."""
    best = 0
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            best = max([best, *(parameter_bytes(m, precision) for m in module)])
    return best or parameter_bytes(model, precision)


def check_sharding(world_size: Any, sharding: Any) -> None:
    """Refuse a bad ``world_size`` / ``sharding`` pair (names the argument)."""
    check_int("world_size", world_size, minimum=1)
    if sharding is not None:
        check_choice("sharding", sharding, SHARDINGS)


def per_rank_for_model(
    estimate: MemoryEstimate,
    model: nn.Module,
    *,
    world_size: int,
    sharding: str | None,
    precision: str = "32-true",
    block_bytes: int | None = None,
) -> MemoryEstimate:
    """:func:`per_rank_estimate` with the parameter and block bytes read from ``model``
    (``sharding=None``: ``"ddp"``)."""
    return per_rank_estimate(
        estimate,
        world_size=world_size,
        sharding=sharding or "ddp",
        param_bytes=parameter_bytes(model, precision),
        block_bytes=block_bytes
        if block_bytes is not None
        else largest_block_bytes(model, precision),
    )
