"""The memory of one rank when a strategy divides the training state across ranks.

Pure functions on a one-device :class:`~lightning_efficient.measure.memory.types.MemoryEstimate`
(the fake-tensor estimate of one step at the per-rank batch). Each phase's peak (forward, backward,
optimizer step) is divided as the strategy divides the state, the whole (gathered or not yet
reduced) tensors and communication buffers the strategy holds in that phase are added, and the
largest phase is the rank's peak: dividing finished gradients moves an FSDP rank's peak earlier in
backward than the one device's, so every backward moment the estimate kept
(``MemoryEstimate.backward_levels``) is a candidate.

======================  ==========  ==========  ===========  =====================================
sharding                parameters  gradients   optimizer    held whole / buffers added
======================  ==========  ==========  ===========  =====================================
``ddp``                 P           G           O            G (DDP's gradient buckets)
``zero1``               P           G           O / N        one block's gradients (reduce bucket)
``zero2``               P           G / N       O / N        one block's gradients (reduce bucket)
``zero3``               P / N       G / N       O / N        2 blocks' parameters gathered + one
                                                             block's gradients (not checked
                                                             against a real run)
``full``                P / N       G / N       O / N        see below (FSDP2, measured)
``grad_op``             P / N       G / N       O / N        see below (FSDP2, measured)
======================  ==========  ==========  ===========  =====================================

FSDP2 as ``FullyShardedStrategy`` applies it (``fully_shard`` on each block, then the root with
``reshard_after_forward=False``), by phase; R is the root's parameters (embeddings, final norm,
head: everything outside the blocks), B one block's:

==============================  =================================================================
what a rank holds               why (read in torch's ``_fully_shard``; each checked on the tracked
                                peak of a real 2-process run)
==============================  =================================================================
R gathered, forward and         the root is not resharded after forward; its gathered parameters
backward                        are freed only when its own backward ends, the last of all
B gathered (``full``): the      ``reshard_after_forward=True``; in backward the next block is
current block; + B prefetched   all-gathered (prefetched) when the current one starts, except
in backward                     after the first block (nothing left); during the head's backward
                                (no gradients yet) no block is gathered
P - finished blocks gathered    ``reshard_after_forward=False`` keeps every block gathered from
(``grad_op``)                   its forward until its backward ends (then it is resharded)
gradients whole: the head's     autograd writes each gradient whole into the gathered parameter;
and the current block's         a block's are reduce-scattered when its backward ends, the
                                root's at the end of backward. The head's come first (their
                                amount is the first gradient level of the one-device backward);
                                beyond them whole blocks are finished (1 / N), the remainder is
                                the current block's
B: the reduce-scatter input     the finished block's gradients, concatenated (padded, reduce
                                dtype), are kept until the next block's reduce-scatter
                                (``reduce_scatter_states``, one in flight)
optimizer step: nothing whole   every block resharded and reduced; the step's temporaries are
                                those of the shards (1 / N)
==============================  =================================================================

The real run this is checked against is measured by the same storage tracker on real tensors,
which follows FSDP2's ``untyped_storage().resize_`` frees (``measure/memory/track.py``); padding of
shards to a multiple of N rows is not counted. Activations and temporaries are those of the
per-rank batch, unchanged. ``zero1/2/3`` are DeepSpeed's stages. A block is the largest
repeated module (the caller passes its parameter bytes; :func:`largest_block_bytes` is the
fallback, :func:`root_parameter_bytes` gives R).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from torch import nn

from lightning_efficient.core.validate import check_choice, check_int
from lightning_efficient.measure.memory.types import MemoryEstimate

__all__ = [
    "SHARDINGS",
    "shard_factors",
    "buffer_bytes",
    "per_rank_estimate",
    "largest_block_bytes",
    "root_parameter_bytes",
    "per_rank_phase",
    "fsdp_whole_gradients",
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
    sharding: str,
    world_size: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    block_bytes: int,
    root_bytes: int = 0,
    phase: str = "backward",
    grads_live: int | None = None,
    head_grad_bytes: int | None = None,
) -> dict[str, int]:
    """The communication buffers and gathered (whole) tensors one rank holds at the peak of
    ``phase``, by the category they belong to: gathered parameters count as ``parameters``,
    reduce buffers and unsharded gradients as ``gradients``. ``grads_live`` is the gradient
    bytes the one-device step holds at that peak (default: all of them)."""
    check_choice("sharding", sharding, SHARDINGS)
    if world_size == 1:
        return {"parameters": 0, "gradients": 0}
    if sharding == "ddp":
        return {"parameters": 0, "gradients": grad_bytes}
    block_grads = min(block_bytes, grad_bytes)
    if sharding in ("zero1", "zero2", "zero3"):
        gathered = min(2 * block_bytes, param_bytes) if sharding == "zero3" else 0
        return {"parameters": gathered, "gradients": block_grads}
    grads_live = grad_bytes if grads_live is None else grads_live
    if phase == "optimizer":  # every block resharded, gradients reduced
        return {"parameters": 0, "gradients": 0}
    if phase == "forward":
        # FULL_SHARD: the root (gathered until the end of backward) and the current block;
        # SHARD_GRAD_OP: every block stays gathered until its backward
        gathered = param_bytes if sharding == "grad_op" else root_bytes + block_bytes
        return {"parameters": min(gathered, param_bytes), "gradients": 0}
    whole, done = fsdp_whole_gradients(
        grads_live, block_bytes=block_bytes, root_bytes=root_bytes, head_grad_bytes=head_grad_bytes
    )
    blocks = max(0, param_bytes - root_bytes)
    if done > blocks:  # the rest is the root's (e.g. the embeddings', the last of backward)
        whole, done = whole + done - blocks, blocks
    if sharding == "grad_op":  # blocks are resharded as their backward ends
        gathered = max(param_bytes - done, root_bytes + block_bytes)
    elif grads_live == 0:  # the head's backward: the root only (the last block is gathered
        gathered = root_bytes  # when its own backward starts)
    else:  # the root, the current block and the prefetched next one (none after the first)
        left = param_bytes - root_bytes - done - block_bytes  # blocks still to run backward
        gathered = root_bytes + block_bytes + (block_bytes if left >= block_bytes else 0)
    reduce_input = block_bytes if done > 0 else 0
    return {
        "parameters": min(gathered, param_bytes),
        "gradients": whole - math.ceil(whole / world_size) + reduce_input,
    }


def fsdp_whole_gradients(
    grads_live: int, *, block_bytes: int, root_bytes: int, head_grad_bytes: int | None = None
) -> tuple[int, int]:
    """FSDP2 in backward: of ``grads_live`` gradient bytes (one device), those still whole and
    those of finished blocks (reduce-scattered: each rank keeps ``1 / world_size``).

    The root's gradients that backward makes first (the head's, ``head_grad_bytes``; default:
    the root's) stay whole until the end of backward; after them the blocks finish one by one,
    so the gradients beyond the head's are whole blocks already reduced plus the current
    block's, still whole.
    """
    head = min(grads_live, root_bytes if head_grad_bytes is None else head_grad_bytes)
    rest = grads_live - head
    done = (rest // block_bytes) * block_bytes if block_bytes else 0
    return grads_live - done, done


def per_rank_phase(
    categories: dict[str, int],
    phase: str,
    *,
    world_size: int,
    sharding: str,
    param_bytes: int,
    block_bytes: int,
    root_bytes: int = 0,
    head_grad_bytes: int | None = None,
) -> dict[str, int]:
    """One rank's bytes by category at the peak of ``phase``, from the one-device ``categories``
    at that phase's peak (see the module's table)."""
    factors = shard_factors(sharding, world_size)
    extra = buffer_bytes(
        sharding,
        world_size,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        block_bytes=block_bytes,
        root_bytes=root_bytes,
        phase=phase,
        grads_live=categories.get("gradients", 0),
        head_grad_bytes=head_grad_bytes,
    )
    out = {}
    for category, value in categories.items():
        factor = factors.get(category, 1.0)
        if category == "temporaries" and phase == "optimizer":
            factor = factors["optimizer_state"]  # the step runs on this rank's shards
        out[category] = math.ceil(value * factor) + extra.get(category, 0)
    return out


def per_rank_estimate(
    estimate: MemoryEstimate,
    *,
    world_size: int,
    sharding: str = "ddp",
    param_bytes: int,
    block_bytes: int,
    root_bytes: int = 0,
) -> MemoryEstimate:
    """One rank's peak from the one-device ``estimate`` (see the module's table).

    ``param_bytes`` is the model's parameter bytes (its gradients are as many);
    ``block_bytes`` the parameter bytes of its largest block; ``root_bytes`` those outside the
    repeated blocks (embeddings, final norm, head: FSDP2's root keeps them gathered).
    Each phase's peak (forward, backward, optimizer step) is divided by its own rule and the
    largest is the rank's peak: sharding can move the peak to another phase.
    """
    factors = shard_factors(sharding, world_size)
    kwargs = dict(
        world_size=world_size,
        sharding=sharding,
        param_bytes=param_bytes,
        block_bytes=block_bytes,
        root_bytes=root_bytes,
        head_grad_bytes=min(
            (m["gradients"] for m in estimate.backward_levels if m["gradients"] > 0), default=None
        ),
    )
    phases_in = dict(estimate.phase_by_category or {estimate.peak_phase: estimate.by_category})
    by_phase = {ph: per_rank_phase(cats, ph, **kwargs) for ph, cats in phases_in.items()}
    for moment in estimate.backward_levels:  # divided gradients can move the peak earlier
        candidate = per_rank_phase(moment, "backward", **kwargs)
        if sum(candidate.values()) > sum(by_phase.get("backward", {}).values()):
            by_phase["backward"], phases_in["backward"] = candidate, moment
    peak_phase = max(by_phase, key=lambda ph: sum(by_phase[ph].values()))
    by_category = by_phase[peak_phase]
    peak = sum(by_category.values())
    if estimate.phase_by_category:
        phases = {ph: sum(cats.values()) for ph, cats in by_phase.items()}
    else:  # only the peak's categories are known: move every phase by the peak's change
        added = peak - estimate.peak_bytes
        phases = {ph: max(0, value + added) for ph, value in estimate.phase_peaks.items()}
    host = estimate.host_bytes
    if host:  # offloaded state is divided like the device state
        host = math.ceil(host * factors["optimizer_state"])
    extra = sum(by_category.values()) - sum(
        math.ceil(v * factors.get(c, 1.0)) for c, v in phases_in[peak_phase].items()
    )
    note = (
        f"per rank: {sharding} over {world_size} ranks (parameters x{factors['parameters']:.3g}, "
        f"gradients x{factors['gradients']:.3g}, optimizer state x{factors['optimizer_state']:.3g}; "
        f"gathered and communication buffers +{extra} bytes; peak in {peak_phase})"
    )
    return replace(
        estimate,
        peak_bytes=peak,
        by_category=by_category,
        peak_phase=peak_phase,
        phase_peaks=phases,
        host_bytes=host,
        notes=[*estimate.notes, note],
        phase_by_category=by_phase if estimate.phase_by_category else {},
        backward_levels=[],
        # the one device's allocation log does not describe a rank's: not replayed per rank
        reserved_bytes=0,
        allocations=None,
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


def _layer_stack(model: nn.Module, precision: str) -> list[int]:
    """Parameter bytes of each member of the ``ModuleList``/``Sequential`` (of at least two
    modules) whose largest member is largest: the layer stack of a transformer."""
    best: list[int] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            sizes = [parameter_bytes(m, precision) for m in module]
            if max(sizes) > max(best, default=0):
                best = sizes
    return best


def largest_block_bytes(model: nn.Module, precision: str = "32-true") -> int:
    """Parameter bytes of the largest member of a ``ModuleList``/``Sequential`` of at least two
    modules (the layer stack of a transformer); the whole model when there is none."""
    return max(_layer_stack(model, precision), default=0) or parameter_bytes(model, precision)


def root_parameter_bytes(model: nn.Module, precision: str = "32-true") -> int:
    """Parameter bytes outside the layer stack (embeddings, final norm, head): what FSDP2's root
    module holds; 0 when there is no layer stack (the whole model is then one block)."""
    stack = _layer_stack(model, precision)
    return max(0, parameter_bytes(model, precision) - sum(stack)) if stack else 0


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
        root_bytes=root_parameter_bytes(model, precision),
    )
