"""What an estimate needs to know about a fit, taken from the fit itself: the optimizer the module
configures (class, options and param groups), the precision, the accumulation, the techniques
that change the plan, whether the device rounds allocations like CUDA, and the world size and
sharding of the strategy (the estimate is one rank's peak).

One place for it, used by the ``estimate``/``plan`` commands, the planner, activation
checkpointing's budget search and the batch-size search, so that they all estimate the run the
user configured.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.technique import ChangesEstimate
from lightning_efficient.core.validate import error_text
from lightning_efficient.measure.memory.targets import resolve_target
from lightning_efficient.measure.memory.types import PRECISIONS

__all__ = [
    "configured_optimizer",
    "configured_optimizer_class",
    "estimate_settings",
    "optimizer_factory_like",
    "strategy_sharding",
]


def _first_optimizer(config: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in whatever ``configure_optimizers`` returned (any of Lightning's
    forms: an optimizer, a list/tuple of them, a dict with ``"optimizer"``, ``([opts], [scheds])``
    or a list of dicts)."""
    if isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, Mapping):
        return _first_optimizer(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        for item in config:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None


def optimizer_factory_like(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    *,
    foreach_default: bool | None = None,
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A factory ``factory(param_groups) -> Optimizer`` that builds ``optimizer``'s class with its
    options and puts each parameter it is given into the group its namesake had in
    ``optimizer`` (matched by parameter name in ``model``, so the factory also serves the
    fake-tensor copies of the parameters that the estimate swaps into ``model``).

    Parameters ``optimizer`` did not train are left out (a fit would not step them).
    ``foreach_default`` replaces ``foreach=None`` (torch's choice by device: on CUDA it picks the
    list-wide foreach path, whose temporaries count at the peak).
    """
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if "foreach" in accepted and defaults.get("foreach") is None and foreach_default is not None:
        defaults["foreach"] = foreach_default
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    group_of: dict[str, int] = {}
    options: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer.param_groups):
        options.append({k: v for k, v in group.items() if k != "params" and k in accepted})
        for p in group["params"]:
            if id(p) in names:
                group_of[names[id(p)]] = index

    def factory(param_groups: list[dict]) -> torch.optim.Optimizer:
        current = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        grouped: dict[int, list[torch.Tensor]] = {}
        for group in param_groups:
            for p in group["params"]:
                index = group_of.get(current.get(id(p), ""))
                if index is not None:
                    grouped.setdefault(index, []).append(p)
        if not grouped:  # parameters the configured optimizer does not know: its defaults
            return cls(param_groups, **defaults)
        groups = [{**options[i], "params": ps} for i, ps in sorted(grouped.items())]
        return cls(groups, **defaults)

    factory.optimizer_class = cls  # type: ignore[attr-defined]
    return factory


def configured_optimizer(
    model: nn.Module, *, foreach_default: bool | None = None
) -> tuple[Callable[[list[dict]], torch.optim.Optimizer] | None, str]:
    """The optimizer a fit of ``model`` would build, as an estimate factory, and a note.

    Calls the LightningModule's ``configure_optimizers`` (an optimizer holds no state until it
    steps, so this allocates nothing but the object). Returns ``(None, reason)`` when the module
    has none, configures none, or needs a trainer to configure one.
    """
    configure = getattr(model, "configure_optimizers", None)
    if configure is None:
        return None, "the model has no configure_optimizers"
    try:
        config = configure()
    except Exception as err:  # noqa: BLE001 - e.g. it reads self.trainer, which is not attached
        return None, f"configure_optimizers failed without a trainer ({error_text(err)})"
    optimizer = _first_optimizer(config)
    if optimizer is None:
        return None, "configure_optimizers returned no optimizer"
    factory = optimizer_factory_like(optimizer, model, foreach_default=foreach_default)
    return factory, f"optimizer as configured: {type(optimizer).__name__}"


def configured_optimizer_class(model: nn.Module) -> type | None:
    """The class of the first optimizer the module's ``configure_optimizers`` builds (``None``:
    none, or it needs a trainer): the family a swap must keep."""
    configure = getattr(model, "configure_optimizers", None)
    if configure is None:
        return None
    try:
        optimizer = _first_optimizer(configure())
    except Exception:  # noqa: BLE001 - e.g. it reads self.trainer, which is not attached
        return None
    return type(optimizer) if optimizer is not None else None


def strategy_sharding(strategy: Any) -> str | None:
    """How ``strategy`` divides the training state across ranks, as ``estimate_memory``'s
    ``sharding`` names it, or ``None`` when it divides nothing (one device).

    A strategy of this package declares it (``estimate_sharding``: ``FullyShardedStrategy`` gives
    ``"full"``/``"grad_op"``, ``ZeROOffload`` ``"zero2"``/``"zero3"``). Lightning's own: DDP (and
    its subclasses) ``"ddp"``; ``FSDPStrategy`` by its sharding strategy (FULL_SHARD: ``"full"``,
    SHARD_GRAD_OP: ``"grad_op"``, NO_SHARD: ``"ddp"``; hybrid sharding is not modelled and counts
    as ``"full"``); ``DeepSpeedStrategy`` by its ZeRO stage (0: ``"ddp"``).
    """
    declared = getattr(strategy, "estimate_sharding", None)
    if isinstance(declared, str):
        return declared
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        config = getattr(strategy, "config", None) or {}
        stage = int((config.get("zero_optimization") or {}).get("stage", 0) or 0)
        return f"zero{stage}" if stage in (1, 2, 3) else "ddp"
    if isinstance(strategy, FSDPStrategy):
        name = getattr(getattr(strategy, "sharding_strategy", None), "name", "FULL_SHARD")
        return {"SHARD_GRAD_OP": "grad_op", "NO_SHARD": "ddp"}.get(name, "full")
    if isinstance(strategy, DDPStrategy):
        return "ddp"
    return None


def estimate_settings(trainer: Any, *, exclude: Iterable[Any] = ()) -> dict[str, Any]:
    """``estimate_memory`` keyword arguments for the fit ``trainer`` runs (or will run).

    - ``precision``: the trainer's (``"32-true"`` when the estimate does not know it);
    - ``accumulate_grad_batches``;
    - ``callbacks``: every callback (and the strategy) with ``configure_estimate``, except those
      in ``exclude`` (a technique searching over its own setting excludes itself);
    - ``optimizer``: during a fit, the trainer's optimizer (class, options, groups); before a
      fit, ``None`` (the module's ``configure_optimizers``); when a technique swaps optimizers,
      its ``configure_estimate`` sets the estimate's optimizer as it does for the fit;
    - ``device``: the device the trainer runs on (its ``DeviceTarget``: on a CUDA device, that
      GPU's kernels, workspaces and allocator rounding);
    - ``world_size``: the trainer's ranks, and ``sharding``: how its strategy divides the state
      (:func:`strategy_sharding`; ``"ddp"`` for an unknown strategy on several ranks, ``None``
      on one rank without a sharding strategy), so the estimate is one rank's peak. A module
      whose parameters are already sharded (DTensors, during an FSDP2 fit) gets ``world_size``
      1 and no second division (its tensors are this rank's shards); ``estimate_memory`` itself
      refuses to run a module ``fully_shard`` sharded (``types.check_unsharded``).
    """
    skip = {id(t) for t in exclude}
    callbacks = [
        cb
        for cb in getattr(trainer, "callbacks", [])
        if isinstance(cb, ChangesEstimate) and id(cb) not in skip
    ]
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, ChangesEstimate) and id(strategy) not in skip:
        callbacks.append(strategy)
    root = getattr(strategy, "root_device", None)
    device = getattr(root, "type", "cpu")
    precision = str(getattr(trainer, "precision", "32-true"))
    settings: dict[str, Any] = {
        "precision": precision if precision in PRECISIONS else "32-true",
        "accumulate_grad_batches": int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
        "callbacks": callbacks,
        "device": resolve_target(str(root) if device == "cuda" else "cpu"),
        "optimizer": None,
        **_world_and_sharding(trainer, strategy),
    }
    optimizers: Sequence[Any] = getattr(trainer, "optimizers", None) or []
    swapped = any(getattr(cb, "swaps_optimizer", False) for cb in callbacks)
    model = getattr(trainer, "lightning_module", None)
    if swapped:  # the swapping technique's configure_estimate sets the estimate's optimizer
        settings["optimizer"] = "adamw"
    elif optimizers and model is not None:
        settings["optimizer"] = optimizer_factory_like(
            optimizers[0], model, foreach_default=device == "cuda"
        )
    return settings


def _world_and_sharding(trainer: Any, strategy: Any) -> dict[str, Any]:
    world = int(getattr(trainer, "world_size", 1) or 1)
    model = getattr(trainer, "lightning_module", None)
    if model is not None and any(
        callable(getattr(p, "to_local", None)) for p in model.parameters()
    ):
        # already sharded (FSDP2 DTensors, during a fit): the tracker counts this rank's shards,
        # so the state must not be divided again (the gathered blocks are not counted then)
        return {"world_size": 1, "sharding": None}
    sharding = strategy_sharding(strategy) if strategy is not None else None
    if sharding is None and world > 1:
        sharding = "ddp"  # several ranks, state not divided: every rank holds all of it
    return {"world_size": world, "sharding": sharding}
