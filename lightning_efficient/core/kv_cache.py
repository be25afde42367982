"""Training a Hugging Face model without its key/value cache.

A model built from its default config keeps ``config.use_cache=True``: every training forward
then builds a cache of all layers' keys and values, which holds them alive (through gradient
checkpointing too) and is never read. :func:`apply_training_without_cache` makes every training
forward of those models run with ``use_cache=False`` (unless the call passes ``use_cache``
itself): a forward pre-hook fills the argument while the model is in training mode with gradients
on. The config is not touched, so validation and generation (eval mode or no grad) keep the cache
as configured.

A technique says that it trains without the cache once, with its ``trains_without_cache`` flag
(:class:`~lightning_efficient.core.technique.Technique`), and the flag is read in two places: the
fit's (``Technique.on_train_start``: the first flagged technique switches it, once for all) and
the estimate's (``measure.memory.types.EstimatePlan.configure``). ``measure.memory.kv_cache``
names the caches a training forward still builds and their bytes.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_module

__all__ = ["apply_training_without_cache", "cache_models", "cache_switched_off"]

_OFF: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _takes_use_cache(module: nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` with a config whose ``use_cache`` is true and a forward that
    takes ``use_cache`` (a Hugging Face model and its inner base model), outermost first."""
    out = []
    for name, mod in model.named_modules():
        config = getattr(mod, "config", None)
        if getattr(config, "use_cache", False) is True and _takes_use_cache(mod):
            out.append((name, mod))
    return out


def _mark_cache_off(module: nn.Module) -> None:
    _OFF[module] = _OFF.get(module, 0) + 1


def _unmark_cache_off(module: nn.Module) -> None:
    left = _OFF.get(module, 0) - 1
    if left > 0:
        _OFF[module] = left
    else:
        _OFF.pop(module, None)


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
        _mark_cache_off(mod)

    def undo() -> None:
        for h in handles:
            h.remove()
        for _, mod in found:
            _unmark_cache_off(mod)

    names = [name or type(mod).__name__ for name, mod in found]
    return Change(
        f"key/value cache off while training ({found[0][0] or type(found[0][1]).__name__})",
        undo,
        value=names,
    )


def cache_switched_off(model: nn.Module) -> bool:
    """Whether the cache of a model in ``model`` is switched off for training
    (:func:`apply_training_without_cache`, not undone yet)."""
    return any(mod in _OFF for _, mod in cache_models(model))
