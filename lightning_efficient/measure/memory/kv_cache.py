"""Which Hugging Face models build a key/value cache while they train, and its bytes.

A model built from its default config keeps ``config.use_cache=True``: every training forward
then builds a cache of all layers' keys and values, which holds them alive (through gradient
checkpointing too) and is never read. :func:`training_caches` names those models,
:func:`cache_bytes` their cache's size, :func:`cache_note` the estimate's line. Switching it off
for training is ``core.kv_cache.apply_training_without_cache``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_efficient.core.kv_cache import cache_models, cache_switched_off

__all__ = ["cache_bytes", "cache_note", "training_caches"]


def training_caches(model: nn.Module) -> list[str]:
    """Names of the models in ``model`` that build a key/value cache in a training forward
    (``config.use_cache`` true, not switched off for training by a technique)."""
    if cache_switched_off(model):
        return []
    found = cache_models(model)
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
