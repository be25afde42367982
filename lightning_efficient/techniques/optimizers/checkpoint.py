"""Checkpoints of a swapped optimizer, as pure functions: what the checkpoint's
``optimizer_states`` holds (a state the module's own optimizer can load) and what a resumed run
restores (the swap's own state, the checkpoint's, a fresh one, or a clear error)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_efficient.techniques.optimizers.in_backward import InBackwardOptimizer

__all__ = [
    "class_path",
    "describe_swap",
    "fresh_states",
    "portable_state",
    "make_portable",
    "swap_entry",
    "reconcile_optimizer_states",
    "swapped_classes",
]

_LR_KEYS = ("lr", "initial_lr")


def class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def swapped_classes(swapped: Sequence[Optimizer]) -> list[str]:
    """The class path of each swapped optimizer (the per-parameter class when in backward)."""
    return [
        class_path(o.inner[0] if isinstance(o, InBackwardOptimizer) and o.inner else o)
        for o in swapped
    ]


def describe_swap(name: Any, in_backward: bool) -> str:
    return f"OptimizerSwap({name!r}" + (", optimizer_in_backward=True)" if in_backward else ")")


def portable_state(original: Optimizer, swapped: Optimizer) -> dict[str, Any] | None:
    """What the module's own optimizer ``original`` can load in place of ``swapped``'s state:
    its param groups at ``swapped``'s current learning rates, no moments. ``None`` when the two
    are the same class (the native state loads as is)."""
    if type(original) is type(swapped):
        return None
    portable = original.state_dict()
    for g_orig, g_new in zip(portable["param_groups"], swapped.param_groups):
        for key in _LR_KEYS:
            if key in g_new:  # torchao keeps its lr as a tensor
                value = g_new[key]
                g_orig[key] = float(value) if isinstance(value, torch.Tensor) else value
    portable["state"] = {}
    return portable


def make_portable(
    states: list[dict[str, Any]], originals: Sequence[Optimizer], swapped: Sequence[Optimizer]
) -> None:
    """Replace, in the checkpoint's ``states``, each swapped optimizer's state by its
    :func:`portable_state` (the module's own optimizer loads it)."""
    for i, (orig, new) in enumerate(zip(originals, swapped)):
        portable = portable_state(orig, new)
        if portable is not None:
            states[i] = portable


def swap_entry(name: str, swapped: Sequence[Optimizer], in_backward: bool) -> dict[str, Any]:
    """The swap's own checkpoint entry: what :func:`reconcile_optimizer_states` reads back."""
    return {
        "name": name,
        "classes": swapped_classes(swapped),
        "optimizer_in_backward": in_backward,
        "optimizer_states": [o.state_dict() for o in swapped],
    }


def fresh_states(saved: Sequence[dict[str, Any]], swapped: Sequence[Optimizer]) -> list[dict]:
    """States for ``swapped`` with no moments and the learning rates of the ``saved`` states."""
    fresh = []
    for state, new in zip(saved, swapped):
        sd = {**new.state_dict(), "state": {}}
        if isinstance(new, InBackwardOptimizer):
            sd["per_parameter"] = [{**s, "state": {}} for s in sd["per_parameter"]]
        for g_new, g_saved in zip(sd["param_groups"], state.get("param_groups", [])):
            for key in _LR_KEYS:
                if key in g_saved:
                    g_new[key] = g_saved[key]
        fresh.append(sd)
    return fresh


def reconcile_optimizer_states(
    saved: Sequence[dict[str, Any]],
    entry: dict[str, Any] | None,
    originals: Sequence[Optimizer],
    swapped: Sequence[Optimizer],
    *,
    name: str,
    in_backward: bool,
    on_mismatch: str,
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """What a resumed run restores its ``swapped`` optimizers from.

    ``saved`` is the checkpoint's ``optimizer_states``, ``entry`` the swap's own checkpoint entry
    (``None`` when the checkpoint was written without ``OptimizerSwap``). Returns
    ``(states, warning)``: ``states`` replaces the checkpoint's ``optimizer_states`` (``None``:
    keep them), ``warning`` is to be shown once. Raises ``ValueError`` when the states are not
    interchangeable and ``on_mismatch == "error"``.
    """
    current = describe_swap(name, in_backward)
    if entry and entry.get("optimizer_states") is not None:
        same = entry.get("classes") == swapped_classes(swapped) and (
            bool(entry.get("optimizer_in_backward")) == in_backward
        )
        if same and len(entry["optimizer_states"]) == len(swapped):
            return list(entry["optimizer_states"]), None
        written = describe_swap(entry.get("name"), bool(entry.get("optimizer_in_backward")))
        written += f" ({', '.join(entry.get('classes') or [])})"
        written_name = entry.get("name")
    elif all(type(o) is type(n) for o, n in zip(originals, swapped)):
        return None, None  # the module's own optimizer class: its state loads as is
    else:
        classes = ", ".join(sorted({class_path(o) for o in originals}))
        written = f"the module's own optimizer ({classes}), without OptimizerSwap"
        written_name = None
    if on_mismatch == "reset":
        return fresh_states(saved, swapped), (
            f"the checkpoint's optimizer state was written by {written}; {current} starts its "
            "state afresh (on_mismatch='reset'), keeping the learning rates."
        )
    swap_back = (
        f"OptimizerSwap({written_name!r})"
        if written_name
        else "no OptimizerSwap (or one whose optimizer is that class)"
    )
    raise ValueError(
        f"Cannot resume the optimizer: the checkpoint's optimizer state was written by {written}, "
        f"but this run uses {current}; the states are not interchangeable (loading one into the "
        "other fails, e.g. bitsandbytes' KeyError: 'state1'). Choose one:\n"
        f"  - reset the optimizer state: OptimizerSwap({name!r}, on_mismatch='reset') "
        "(model, loops and LR schedule resume; the optimizer's moments start afresh), or\n"
        f"  - swap to the matching optimizer: resume with {swap_back}."
    )
