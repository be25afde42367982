"""What a fit must leave as the user gave it: a snapshot of a module, its datamodule and the
process-wide flags, and the differences between two snapshots.

Captured (what a technique might change and forget to undo):

- the module tree: every submodule's name, identity and class (a wrapper or a class swap shows);
- every submodule's hooks (forward, forward pre-, backward, state_dict and load hooks) and the
  callables set on the instance (a shadowed ``forward``, a wrapped ``training_step``, a compiled
  call), and attributes of this package (``_le_*``);
- parameters: identity, class, dtype, device, shape, ``requires_grad`` and their tensor hooks
  (post-accumulate-grad, backward); buffers: class, dtype, device, shape. Values are not
  compared: the steps before the error train them;
- the datamodule's instance callables (wrapped ``train_dataloader``, ``on_after_batch_transfer``);
- the module's and the datamodule's public attributes of simple values and their
  hyperparameters (a ``batch_size`` set where Lightning's BatchSizeFinder finds it);
- global flags: float32 matmul precision, cuDNN and CUDA matmul flags, deterministic algorithms,
  default dtype, grad mode, saved-tensor hooks, Dynamo's compile callbacks and module-wide hooks.

``Snapshot.take(model, datamodule)`` then ``before.diff(after)`` lists what differs (empty: as
given). ``layout()`` is the snapshot without identities, to compare two models built alike (a
strategy that shards leaves its sharding: compare with a model only it has sharded).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
#: set by a module's own ``compile()``: what it runs instead of ``forward`` (None: eager)
_COMPILED = "_compiled_call_impl"


def _own_method(obj: Any, name: str, value: Any) -> bool:
    """``value`` is the class's own method bound to ``obj``: it shadows nothing. (Lightning's
    forward redirection, used by its DDP/DeepSpeed/FSDP strategies, leaves ``forward`` set on
    the instance to exactly that.)"""
    return getattr(value, "__self__", None) is obj and getattr(value, "__func__", None) is getattr(
        type(obj), name, None
    )


def _instance_callables(obj: Any) -> dict[str, int]:
    """Callables set on the instance (shadowing the class's methods), by identity, and this
    package's own attributes."""
    out = {}
    for name, value in vars(obj).items():
        if isinstance(value, (nn.Module, torch.Tensor)) or value is None:
            continue
        if name == _COMPILED or name.startswith("_le_") or callable(value):
            if not _own_method(obj, name, value):
                out[name] = id(value)
    return out


def _hooks(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(id(h) for h in getattr(module, name).values())
        for name in _HOOK_DICTS
        if getattr(module, name, None)
    }


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    return (type(t).__name__, t.dtype, t.device, tuple(t.shape))


def _param(p: torch.Tensor) -> tuple[Any, ...]:
    hooks = (
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
        len(getattr(p, "_backward_hooks", None) or {}),
    )
    return (id(p), *_tensor(p), p.requires_grad, hooks)


_SIMPLE = (int, float, str, bool)  # None is left out: a datamodule fills its sets in setup


def _attributes(obj: Any) -> dict[str, Any]:
    """Public attributes of ``obj`` with simple values, and its hyperparameters."""
    out = {k: v for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, _SIMPLE)}
    hparams = vars(obj).get("_hparams")  # Lightning's store behind ``hparams``
    if isinstance(hparams, Mapping):
        out.update({f"hparams.{k}": v for k, v in hparams.items() if isinstance(v, _SIMPLE)})
    return out


def _global_flags() -> dict[str, Any]:
    from torch._dynamo.callback import callback_handler
    from torch.nn.modules import module as nn_module

    flags: dict[str, Any] = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda.matmul.allow_bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False)
        is not None,
        "dynamo.compile_start_callbacks": len(callback_handler.start_callbacks),
        "dynamo.compile_end_callbacks": len(callback_handler.end_callbacks),
    }
    for name in dir(nn_module):
        if name.startswith("_global_") and name.endswith("hooks"):
            flags[f"nn.module.{name}"] = len(getattr(nn_module, name))
    return flags


@dataclass
class Snapshot:
    modules: dict[str, tuple[int, str]] = field(default_factory=dict)
    hooks: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    instance: dict[str, dict[str, int]] = field(default_factory=dict)
    parameters: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    buffers: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    datamodule: dict[str, int] = field(default_factory=dict)
    attributes: dict[str, dict[str, Any]] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, model: nn.Module, datamodule: Any = None) -> Snapshot:
        snap = cls()
        for name, m in model.named_modules(remove_duplicate=False):
            key = name or "<model>"
            snap.modules[key] = (id(m), type(m).__qualname__)
            snap.hooks[key] = _hooks(m)
            snap.instance[key] = _instance_callables(m)
        snap.parameters = {n: _param(p) for n, p in model.named_parameters(remove_duplicate=False)}
        snap.buffers = {n: _tensor(b) for n, b in model.named_buffers(remove_duplicate=False)}
        snap.attributes["module"] = _attributes(model)
        if datamodule is not None:
            snap.datamodule = _instance_callables(datamodule)
            snap.attributes["datamodule"] = _attributes(datamodule)
        snap.flags = _global_flags()
        return snap

    def layout(self) -> Snapshot:
        """The same snapshot with every identity left out (classes, counts and names stay)."""
        return Snapshot(
            modules={k: cls for k, (_, cls) in self.modules.items()},
            hooks={k: {d: len(ids) for d, ids in v.items()} for k, v in self.hooks.items()},
            instance={k: dict.fromkeys(v, 0) for k, v in self.instance.items()},
            parameters={k: v[1:] for k, v in self.parameters.items()},
            buffers=dict(self.buffers),
            datamodule=dict.fromkeys(self.datamodule, 0),
            attributes={k: dict(v) for k, v in self.attributes.items()},
            flags=dict(self.flags),
        )

    def diff(self, after: Snapshot) -> list[str]:
        """What ``after`` has that differs from this snapshot, one line per difference."""
        out: list[str] = []
        for part in ("modules", "parameters", "buffers", "datamodule", "flags"):
            out += _diff(part, getattr(self, part), getattr(after, part))
        for part in ("hooks", "instance", "attributes"):
            given, now = getattr(self, part), getattr(after, part)
            for key in sorted(set(given) | set(now)):
                out += _diff(f"{part}[{key}]", given.get(key, {}), now.get(key, {}))
        return out


def _diff(part: str, given: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(given) | set(now), key=str):
        if key not in now:
            out.append(f"{part}: {key} removed (was {given[key]!r})")
        elif key not in given:
            out.append(f"{part}: {key} added ({now[key]!r})")
        elif given[key] != now[key]:
            out.append(f"{part}: {key} {given[key]!r} -> {now[key]!r}")
    return out
