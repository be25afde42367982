"""Which Hugging Face models build a key/value cache while they train, and training without it.

A model built from its default config keeps ``config.use_cache=True``: every training forward
then builds a cache of all layers' keys and values, which holds them alive (through gradient
checkpointing too) and is never read. :func:`training_caches` names those models.

:func:`apply_training_without_cache` makes every training forward of those models run with
``use_cache=False`` (unless the call passes ``use_cache`` itself): a forward pre-hook fills the
argument while the model is in training mode with gradients on. The config is not touched, so
validation and generation (eval mode or no grad) keep the cache as configured. A technique says
that it trains without the cache once, with its ``trains_without_cache`` flag
(``core.technique.Technique``); the estimate's plan (``EstimatePlan.configure``) reads it.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_module

__all__ = [
    "apply_training_without_cache",
    "cache_bytes",
    "cache_models",
    "cache_note",
    "mark_cache_off",
    "training_caches",
    "unmark_cache_off",
]

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


def mark_cache_off(module: nn.Module) -> None:
    _OFF[module] = _OFF.get(module, 0) + 1


def unmark_cache_off(module: nn.Module) -> None:
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


def training_caches(model: nn.Module) -> list[str]:
    """Names of the models in ``model`` that build a key/value cache in a training forward
    (``config.use_cache`` true, not switched off for training by a technique)."""
    found = cache_models(model)
    if any(mod in _OFF for _, mod in found):
        return []
    seen: set[int] = set()
    names = []
    for name, mod in found:
        if id(mod.config) not in seen:
            seen.add(id(mod.config))
            names.append(name or type(mod).__name__)
    return names


def cache_bytes(model: nn.Module, tokens: int, element_size: int) -> int | None:
    """Bytes of the keys and values that one training forward over ``tokens`` tokens (micro-batch
    x sequence) caches in the models that :func:`training_caches` names: layers x 2 x key/value
    heads x head size x tokens x ``element_size`` (2 in bf16/fp16 autocast); ``None`` where none
    builds a cache or a config does not state those sizes."""
    if not training_caches(model):
        return None
    total, seen = 0, set()
    for _, mod in cache_models(model):
        config = mod.config
        if id(config) in seen:
            continue
        seen.add(id(config))
        layers = getattr(config, "num_hidden_layers", None)
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)):
            return None
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        total += layers * 2 * kv_heads * head_dim * tokens * element_size
    return total


def cache_note(model: Any) -> str | None:
    """The estimate's line naming the caches a training forward builds, or ``None``."""
    names = training_caches(model) if isinstance(model, nn.Module) else []
    if not names:
        return None
    return (
        f"key/value cache built while training: {', '.join(names)} (config.use_cache=True; "
        "ActivationCheckpointing, ChunkedCrossEntropy, FrozenWeights4bit and AutoEfficient switch "
        "it off for training, or set model.config.use_cache = False)"
    )
