"""Checkpoints of a frozen-base fit (adapters, a frozen backbone) that hold the trainable state
only, and their loading with the base read from where it came.

- :func:`trainable_state`: the entries of a ``state_dict`` that are not frozen parameters, with a
  manifest of the frozen ones left out (shape, dtype and a fingerprint of sampled values) in the
  state's module metadata (``state._metadata[""]``, where ``load_state_dict`` hands it to the
  root module's hooks). A QLoRA checkpoint becomes the size of its adapters.
- :func:`apply_frozen_base_loading`: a ``load_state_dict`` pre-hook on the module that fills the
  entries such a state left out from the module's own (the base as the module built it: from its
  pretrained files), after checking each against the manifest; a state without a manifest loads
  exactly as before. Its ``Change`` removes the hook.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change

__all__ = ["MANIFEST", "apply_frozen_base_loading", "frozen_parameter_names", "trainable_state"]

#: The key of the manifest in a trainable-only state's root metadata.
MANIFEST = "frozen_base_manifest"
_SAMPLES = 256


def frozen_parameter_names(module: nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``module``'s frozen parameters (every name of a shared one)."""
    return {
        name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad
    }


def _fingerprint(t: torch.Tensor) -> list[Any]:
    """``[shape, dtype, digest]``: the digest of up to 256 evenly spaced values' bytes (exact:
    the same values on any device give the same digest)."""
    flat = t.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLES)].contiguous().cpu()
    digest = hashlib.sha1(sample.view(torch.uint8).numpy().tobytes()).hexdigest()
    return [list(t.shape), str(t.dtype).removeprefix("torch."), digest]


def trainable_state(module: nn.Module, state: dict[str, Any]) -> OrderedDict[str, Any]:
    """``state`` (``module.state_dict()``, a checkpoint's ``state_dict``) without the entries of
    ``module``'s frozen parameters, with their manifest in the root metadata; buffers and
    trainable parameters are kept. ``state`` itself is not changed."""
    frozen = frozen_parameter_names(module)
    kept: OrderedDict[str, Any] = OrderedDict((k, v) for k, v in state.items() if k not in frozen)
    metadata = OrderedDict(getattr(state, "_metadata", None) or {})
    root = dict(metadata.get("", {}))
    root[MANIFEST] = {k: _fingerprint(v) for k, v in state.items() if k in frozen}
    metadata[""] = root
    kept._metadata = metadata  # type: ignore[attr-defined]
    return kept


def apply_frozen_base_loading(module: nn.Module) -> Change:
    """Let ``module.load_state_dict`` take a :func:`trainable_state`: the frozen entries it left
    out are the module's own, checked against the manifest (a base that differs from the one the
    state was saved with raises ``ValueError`` naming the entry). Undo: the hook is removed."""

    def fill(
        mod: nn.Module, state: dict[str, Any], prefix: str, metadata: dict[str, Any], *_: Any
    ) -> None:
        manifest = (metadata or {}).get(MANIFEST)
        missing = [k for k in manifest or () if prefix + k not in state]
        if not missing:
            return
        own = mod.state_dict()
        for key in missing:
            if key not in own:
                raise ValueError(
                    f"The checkpoint holds the trainable state only and leaves the frozen "
                    f"`{key}` to the module, which has no such entry: build the module the "
                    "checkpoint was saved from."
                )
            if _fingerprint(own[key]) != manifest[key]:
                raise ValueError(
                    f"The checkpoint holds the trainable state only; the module's frozen `{key}` "
                    f"is not the one it was saved with ({manifest[key][:2]}, sampled values "
                    f"differ; the module has {_fingerprint(own[key])[:2]}): build the module "
                    "with the same base weights (the same pretrained files) before loading."
                )
            state[prefix + key] = own[key]

    handle = module.register_load_state_dict_pre_hook(fill)
    return Change("frozen base read from the module when a checkpoint leaves it out", handle.remove)
