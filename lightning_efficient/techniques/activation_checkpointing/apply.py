"""Checkpoint blocks of a module in place, and put them back.

A chosen block's instance ``forward`` is shadowed by a callable that runs the original forward
under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG state preserved
(``recompute.py``). No module is replaced or renamed, so ``state_dict`` keys never change, and
``remove_activation_checkpointing`` restores the model exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_efficient.core._internals import class_before_fsdp
from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_bool, check_int, check_module
from lightning_efficient.techniques._blocks import check_policy, select_modules
from lightning_efficient.techniques.activation_checkpointing.offload import BoundaryChain
from lightning_efficient.techniques.activation_checkpointing.recompute import (
    ATTR,
    HOST,
    unwrap_block,
    wrap_block,
)

__all__ = [
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "restore_blocks",
    "split_blocks",
]


def checkpointed_blocks(module: nn.Module) -> dict[str, str]:
    """The wrapped blocks of ``module``: name -> ``"full"``, ``"selective"`` or ``"offload"``
    (``"+host"`` appended when the block's saved inputs are kept in host memory)."""
    return {n: _mode(m.__dict__[ATTR]) for n, m in module.named_modules() if ATTR in m.__dict__}


def _mode(state: dict[str, Any]) -> str:
    return state["mode"] + (HOST if state.get("host") is not None else "")


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo ``apply_activation_checkpointing`` on every block of ``module``; returns the names of
    the blocks that were checkpointed (not those that were only offloading)."""
    names = []
    for name, m in module.named_modules():
        if ATTR in m.__dict__:
            if m.__dict__[ATTR]["mode"] != "offload":  # offloading only: not checkpointed
                names.append(name)
            unwrap_block(m)
    return names


def restore_blocks(module: nn.Module, state: dict[str, str]) -> None:
    """Put back the wrapping ``checkpointed_blocks(module)`` returned as ``state``."""
    remove_activation_checkpointing(module)
    mods = dict(module.named_modules())
    chain = BoundaryChain()
    for name, mode in state.items():
        wrap_block(mods[name], mode, chain)


def split_blocks(
    module: nn.Module, policy: Any, every_n: int, num_blocks: int | None
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(blocks to checkpoint, the other selected blocks) in forward order: every ``every_n``-th
    block ``policy`` selects, the first ``num_blocks`` of them (``None``: all)."""
    blocks = select_modules(module, policy, argument="policy")
    chosen = [b for i, b in enumerate(blocks) if i % every_n == 0]
    if num_blocks is not None:
        chosen = chosen[:num_blocks]
    ids = {id(m) for _, m in chosen}
    return chosen, [b for b in blocks if id(b[1]) not in ids]


def apply_activation_checkpointing(
    module: nn.Module,
    policy: Any = "auto",
    *,
    every_n: int = 1,
    selective: bool = False,
    offload_activations: bool = False,
    offload_boundaries: bool = False,
    num_blocks: int | None = None,
) -> Change:
    """Checkpoint blocks of ``module`` in place; returns the ``Change``: its ``value`` is the
    names of the checkpointed blocks, its ``undo()`` puts back the wrapping ``module`` had.

    Args:
        module: Any ``nn.Module`` (a LightningModule, a HF model, ...). It is not replaced and
            its ``state_dict`` keys do not change.
        policy: Which blocks: ``"auto"`` (the repeated blocks), a module class, a class name,
            a name glob (``"transformer.h.*"``), ``"re:<regex>"``, or a list of these. A policy
            that matches nothing raises a ``ValueError`` listing candidate blocks.
        every_n: Checkpoint every n-th of the selected blocks (the 1st, the (n+1)-th, ...).
        selective: Keep matmul and attention outputs and recompute only the cheap ops.
        offload_activations: Keep the saved activations of the selected blocks that are *not*
            checkpointed in pinned host memory (CUDA tensors only; CPU tensors stay).
        offload_boundaries: Keep the inputs the checkpointed blocks save for their recompute
            in host memory between the forward and the recompute (pinned, copied on a side
            stream and prefetched one block ahead on CUDA; elsewhere a copy, counted as host
            bytes by the memory estimate).
        num_blocks: Checkpoint only the first ``num_blocks`` of them (used by the budget mode).

    Applying again replaces the previous settings (idempotent for the same arguments);
    ``remove_activation_checkpointing`` removes every block's.
    """
    check_module("module", module)
    check_policy(policy, argument="policy")
    check_int("every_n", every_n, minimum=1)
    check_bool("selective", selective)
    check_bool("offload_activations", offload_activations)
    check_bool("offload_boundaries", offload_boundaries)
    check_int("num_blocks", num_blocks, minimum=0, allow_none=True)
    chosen, others = split_blocks(module, policy, every_n, num_blocks)
    before = checkpointed_blocks(module)
    remove_activation_checkpointing(module)
    mode = "selective" if selective else "full"
    chain = BoundaryChain()
    for _, block in chosen:
        wrap_block(block, mode + (HOST if offload_boundaries else ""), chain)
    if offload_activations:
        for _, block in others:
            wrap_block(block, "offload")
    names = [n for n, _ in chosen]
    what = f"{mode} checkpointing of {len(names)}/{len(chosen) + len(others)} blocks"
    if not chosen and num_blocks == 0:  # a budget the plain run meets: nothing was needed
        what = "no block checkpointed: the plain run fits the budget"
    elif not chosen and not others:
        what = "no block checkpointed: " + (
            "the model has no repeated blocks" if policy == "auto" else "no block selected"
        )
    if names:
        what += f" ({class_before_fsdp(chosen[0][1]).__name__}: {span(names)})"
    if offload_activations and others:
        what += f"; saved activations of {len(others)} other blocks offloaded to host"
    if offload_boundaries and names:
        what += "; their saved inputs kept in host memory"
    return Change(
        what,
        functools.partial(restore_blocks, module, before),
        figures={"blocks_wrapped": len(names)},
        value=names,
    )


def span(names: Sequence[str]) -> str:
    """``"a"`` or ``"a .. z"``: the first and last of ``names``."""
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
