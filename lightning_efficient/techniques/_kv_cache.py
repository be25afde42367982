"""Training without a Hugging Face model's key/value cache (``config.use_cache``).

:func:`apply_training_without_cache` makes every training forward of the Hugging Face models
inside a module run with ``use_cache=False`` (unless the call passes ``use_cache`` itself):
a forward pre-hook fills the argument while the model is in training mode with gradients on.
The config is not touched, so validation and generation (eval mode or no grad) keep the cache as
configured. The techniques that change memory (ActivationCheckpointing, ChunkedCrossEntropy,
FrozenWeights4bit, AutoEfficient's stacks) record this change; its undo removes the hooks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_module
from lightning_efficient.measure.memory.kv_cache import (
    cache_models,
    mark_cache_off,
    unmark_cache_off,
)

__all__ = ["apply_training_without_cache"]


def _no_cache_in_training(
    module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None


def apply_training_without_cache(model: nn.Module) -> Change:
    """Switch the key/value cache off for the training forwards of the Hugging Face models in
    ``model`` (those whose config has ``use_cache=True``); validation and generation keep it.

    Returns a ``Change`` (``value``: the names of the models) whose ``undo()`` removes the hooks;
    a module with no such model gets a change with nothing to undo.
    """
    check_module("model", model)
    found = cache_models(model)
    if not found:
        return Change("no key/value cache built while training", value=[])
    handles = []
    for _, mod in found:
        handles.append(mod.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True))
        mark_cache_off(mod)

    def undo() -> None:
        for h in handles:
            h.remove()
        for _, mod in found:
            unmark_cache_off(mod)

    names = [name or type(mod).__name__ for name, mod in found]
    return Change(
        f"key/value cache off while training ({found[0][0] or type(found[0][1]).__name__})",
        undo,
        value=names,
    )
