"""The module's torch optimizer as the DeepSpeed CPU optimizer that offloading runs.

- :func:`to_deepspeed_optimizer`: a torch Adam/AdamW/Adagrad to its DeepSpeed CPU counterpart,
  keeping every group's lr, betas, eps and weight decay.
- :func:`rebind_schedulers`: points the LR schedulers at it.
- :func:`convert_with_schedulers`: both, with the DeepSpeed CPU extension built first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_efficient.core.validate import check_choice, missing_requirement
from lightning_efficient.techniques.optimizers.schedulers import rebind_schedulers  # noqa: F401
from lightning_efficient.techniques.zero_offload.extensions import ensure_extensions

__all__ = [
    "convert_with_schedulers",
    "to_deepspeed_optimizer",
    "rebind_schedulers",
    "import_deepspeed",
    "SUPPORTED_OPTIMIZERS",
    "CPU_EXTENSIONS",
]

#: torch optimizers that have a DeepSpeed CPU counterpart (what offloading can run).
SUPPORTED_OPTIMIZERS: dict[str, str] = {
    "torch.optim.Adam": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=False)",
    "torch.optim.AdamW": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)",
    "torch.optim.Adagrad": "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
}
#: The DeepSpeed CPU extension each convertible optimizer's counterpart needs (built on first use).
CPU_EXTENSIONS: dict[type, str] = {
    torch.optim.Adam: "cpu_adam",
    torch.optim.AdamW: "cpu_adam",
    torch.optim.Adagrad: "cpu_adagrad",
}


def _purpose() -> str:
    return "ZeROOffload (DeepSpeed ZeRO-Offload)"


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as err:
        raise missing_requirement("deepspeed", _purpose()) from err
    return deepspeed


def _is_deepspeed_cpu_optimizer(optimizer: Any) -> bool:
    return type(optimizer).__module__.startswith("deepspeed.ops.") and type(
        optimizer
    ).__name__.startswith("DeepSpeedCPU")


def _unsupported(optimizer: Optimizer, why: str = "") -> TypeError:
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    allowed = ", ".join(SUPPORTED_OPTIMIZERS)
    return TypeError(
        f"ZeROOffload cannot offload the optimizer {name}{why}: offloading runs the optimizer step "
        f"on the CPU, which needs a DeepSpeed CPU optimizer. Supported: {allowed} (and DeepSpeed's "
        "DeepSpeedCPUAdam/DeepSpeedCPUAdagrad/DeepSpeedCPULion as they are). Return one of these "
        "from configure_optimizers, or use offload_optimizer=None."
    )


def to_deepspeed_optimizer(optimizer: Optimizer, offload: str | None = "cpu") -> Optimizer:
    """The optimizer DeepSpeed runs: the DeepSpeed CPU counterpart of ``optimizer`` when offloading.

    Keeps every parameter group (its parameters, ``lr``, ``betas``, ``eps``, ``weight_decay`` and
    an ``initial_lr`` that an LR scheduler already set) and the decoupled (AdamW) or L2 (Adam)
    weight decay. Without offload the optimizer is returned unchanged (DeepSpeed runs torch
    optimizers on the device). Raises ``TypeError`` for optimizers without a CPU counterpart
    (listing those supported) and ``ValueError`` for settings the counterpart lacks.
    """
    check_choice("offload", offload, ("cpu", "nvme", None))
    if offload is None or _is_deepspeed_cpu_optimizer(optimizer):
        return optimizer
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize", "differentiable"):
                if group.get(flag):
                    raise ValueError(
                        f"ZeROOffload: DeepSpeedCPUAdam has no `{flag}`; the optimizer's group uses "
                        f"{flag}=True. Set {flag}=False or use offload_optimizer=None."
                    )
        import_deepspeed()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = [
            _group_copy(g, ("lr", "betas", "eps", "weight_decay")) for g in optimizer.param_groups
        ]
        d = optimizer.defaults
        new = DeepSpeedCPUAdam(
            groups,
            lr=_float(d["lr"]),
            betas=tuple(d["betas"]),
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            adamw_mode=type(optimizer) is torch.optim.AdamW,
            bias_correction=True,
        )
    elif type(optimizer) is torch.optim.Adagrad:
        for group in optimizer.param_groups:
            for key in ("lr_decay", "initial_accumulator_value"):
                if group.get(key):
                    raise ValueError(
                        f"ZeROOffload: DeepSpeedCPUAdagrad has no `{key}`; the optimizer's group uses "
                        f"{key}={group[key]!r}. Set it to 0 or use offload_optimizer=None."
                    )
        import_deepspeed()
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        groups = [_group_copy(g, ("lr", "eps", "weight_decay")) for g in optimizer.param_groups]
        d = optimizer.defaults
        new = DeepSpeedCPUAdagrad(
            groups, lr=_float(d["lr"]), eps=d["eps"], weight_decay=d["weight_decay"]
        )
    else:
        raise _unsupported(optimizer)
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "ZeROOffload: the optimizer already holds state (it has stepped); convert it before "
            "the first step, or its state would be lost."
        )
    return new


def _float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _group_copy(group: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"params": list(group["params"])}
    for key in (*keys, "initial_lr"):
        if key in group:
            value = group[key]
            out[key] = _float(value) if key in ("lr", "initial_lr") else value
    if "betas" in out:
        out["betas"] = tuple(_float(b) for b in out["betas"])
    return out


def convert_with_schedulers(
    optimizer: Optimizer, scheduler_config: Any, offload: str | None
) -> tuple[Optimizer, str]:
    """``optimizer`` as its DeepSpeed CPU counterpart (its extension built first when offloading),
    the LR schedulers of ``scheduler_config`` pointed at it; and what changed
    (``"AdamW -> DeepSpeedCPUAdam"``, "" when nothing did)."""
    if offload is not None and type(optimizer) in CPU_EXTENSIONS:
        ensure_extensions([CPU_EXTENSIONS[type(optimizer)]])
    new = to_deepspeed_optimizer(optimizer, offload)
    if new is optimizer:
        return new, ""
    if scheduler_config is not None:
        rebind_schedulers([scheduler_config.scheduler], optimizer, new)
    return new, f"{type(optimizer).__name__} -> {type(new).__name__}"
