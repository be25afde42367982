"""Building an optimizer by name over param groups, and swapping one for another.

- :func:`build_optimizer`: the optimizer ``name`` over param groups.
- :func:`swap_optimizer`: a new optimizer of another kind over the same param groups.
- :func:`replace_optimizer`: what ``OptimizerSwap`` does to one optimizer (also in backward).
- :func:`check_overrides`: overrides refused at construction, as the optimizer would refuse them;
  :func:`merge_overrides`: ``OptimizerSwap``'s ``overrides`` and keyword arguments, checked.
- :func:`swap_messages` / :func:`set_device_flags`: what a swap says, and the flags that follow
  the parameters' device.

How hyperparameters carry over (per param group, :func:`carry_param_groups`)
-----------------------------------------------------------------------------
Every key of an old param group is looked at once:

- a key the new optimizer's constructor accepts (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ...) is carried with its per-group value;
- a key that is an option of the *old* optimizer only (``foreach``, ``fused``, ``capturable``,
  ...) is dropped (the callback lists the dropped ones once);
- any other key (``initial_lr`` written by LR schedulers, ``max_lr`` of OneCycleLR, user keys)
  is carried as is, so schedulers keep working.

``overrides`` then replace a key in *every* group. An ``lr`` override keeps the schedule: each
group's current ``lr`` is scaled by ``override / initial_lr`` and ``initial_lr`` becomes the
override, so the scheduler's factor at the current step is kept.

Adafactor (``torch.optim.Adafactor``) is different: its ``lr`` is a *relative* step size. The
update of a parameter is scaled by ``max(eps2, RMS(parameter)) * min(lr, 1/sqrt(step))``, not by
``lr`` alone, so an AdamW ``lr`` of 3e-3 becomes "at most 0.3% of the parameter's RMS per step".
The carried ``lr`` (and any schedule on it) still caps the relative step; Adafactor's own default
is ``lr=1e-2`` (pass ``lr=1e-2`` as an override to get it, the schedule is kept). Adafactor has
no ``betas`` (it uses ``beta2_decay``) and its ``eps`` is a pair ``(eps1, eps2)`` with another
meaning, so neither is carried; ``weight_decay`` is decoupled as in AdamW and carries.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_efficient.core.change import Change
from lightning_efficient.measure.memory.optimizer_models import (
    DEFAULT_MIN_8BIT_SIZE,
    OPTIMIZER_NAMES,
    optimizer_class,
    state_model,
)
from lightning_efficient.techniques.optimizers.bf16 import compensation_options, swap_class
from lightning_efficient.techniques.optimizers.in_backward import attach_optimizer_in_backward

__all__ = [
    "NAMES",
    "EIGHT_BIT_NAMES",
    "optimizer_class",
    "accepted_options",
    "check_overrides",
    "merge_overrides",
    "carry_param_groups",
    "build_optimizer",
    "swap_optimizer",
    "apply_optimizer_swap",
    "replace_optimizer",
    "embedding_parameters",
    "kept_32bit_parameters",
    "swap_messages",
    "set_device_flags",
    "eight_bit_saves_nothing",
]

#: The names ``OptimizerSwap`` documents -> class paths (any name of
#: :data:`~lightning_efficient.measure.memory.optimizer_models.OPTIMIZER_NAMES` or class path
#: works).
NAMES: dict[str, str] = {
    name: OPTIMIZER_NAMES[name]
    for name in (
        "adamw8bit",
        "adam8bit",
        "paged_adamw8bit",
        "paged_adamw32bit",
        "lion8bit",
        "adafactor",
        "adamw_fused",
        "adamw_kahan",
        "adamw_sr",
        "adamw8bit_sr",
    )
}
#: Names whose states are 8-bit (and so take ``min_8bit_size`` and the embedding override).
EIGHT_BIT_NAMES = ("adamw8bit", "adam8bit", "paged_adamw8bit", "lion8bit")
#: constructor arguments that are not param-group keys (bitsandbytes' 8-bit options)
_CTOR_ONLY = frozenset(
    {"min_8bit_size", "optim_bits", "args", "is_paged", "percentile_clipping", "block_wise"}
)


def accepted_options(cls: type[Optimizer]) -> set[str] | None:
    """Constructor arguments of an optimizer class other than ``params`` (None: takes **kwargs)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        n
        for n, p in params.items()
        if n not in ("self", "params") and p.kind is not inspect.Parameter.VAR_POSITIONAL
    }


def _ctor_only(cls: type[Optimizer]) -> set[str]:
    return set(_CTOR_ONLY & (accepted_options(cls) or set()))


# -- overrides refused at construction -------------------------------------------------------
def _number(name: str, value: Any, *, low: float, strict: bool = False, high: float | None = None):
    """A finite real number ``>= low`` (``> low`` when ``strict``) and ``< high``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number; got {value!r} ({type(value).__name__}).")
    bad = not math.isfinite(value) or value < low or (strict and value == low)
    if bad or (high is not None and value >= high):
        allowed = f"in [{low}, {high})" if high is not None else f"{'>' if strict else '>='} {low}"
        raise ValueError(f"`{name}` must be a finite number {allowed}; got {value!r}.")


def _check_value(argument: str, key: str, value: Any, cls: type[Optimizer]) -> None:
    name = f"{argument}['{key}']"
    if key in ("lr", "weight_decay", "momentum"):
        _number(name, value, low=0.0)
    elif key == "betas":
        if not isinstance(value, (list, tuple)) or not value:
            raise TypeError(
                f"`{name}` must be a tuple of numbers in [0, 1) such as (0.9, 0.999); got "
                f"{value!r} ({type(value).__name__})."
            )
        for beta in value:
            _number(name, beta, low=0.0, high=1.0)
    elif key == "eps" and issubclass(cls, torch.optim.Adafactor):
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise TypeError(
                f"`{name}` of Adafactor must be a pair (eps1 or None, eps2) such as (None, 1e-3); "
                f"got {value!r} ({type(value).__name__})."
            )
        if value[0] is not None:
            _number(name, value[0], low=0.0)
        _number(name, value[1], low=0.0)
    elif key == "eps":
        _number(name, value, low=0.0, strict=True)
    elif key == "min_8bit_size" and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"`{name}` must be an integer; got {value!r} ({type(value).__name__}).")


def _dry_build(name: str, cls: type[Optimizer], overrides: dict[str, Any], argument: str) -> None:
    """Build ``cls`` over one small parameter with ``overrides``, so that the optimizer's own
    checks run now (only for torch's and bitsandbytes' classes: no side effects to fear)."""
    if not cls.__module__.startswith(("torch.", "bitsandbytes.")):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls([nn.Parameter(torch.zeros(1))], **overrides)
    except (ValueError, TypeError, RuntimeError) as err:
        raise ValueError(
            f"`{argument}` {overrides!r}: {name!r} ({cls.__module__}.{cls.__qualname__}) refuses "
            f"them: {err}"
        ) from err


def check_overrides(
    name: str, cls: type[Optimizer], overrides: dict[str, Any], argument: str = "overrides"
) -> None:
    """Refuse overrides ``cls`` does not take, values it would refuse (``lr``,
    ``weight_decay``, ``momentum`` finite and ``>= 0``; ``betas`` in ``[0, 1)``; ``eps`` finite
    and ``> 0``, a pair for Adafactor), then build ``cls`` once with them so its own checks run.
    Errors name the argument (``overrides['lr']``), what was given and what is allowed."""
    if "params" in overrides:
        raise ValueError(
            f"`{argument}` cannot set 'params': the parameters come from the module's optimizer."
        )
    accepted = accepted_options(cls)
    unknown = sorted(set(overrides) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(
            f"`{argument}`: {', '.join(repr(k) for k in unknown)} not accepted by {name!r} "
            f"({cls.__module__}.{cls.__qualname__}); it accepts: {', '.join(sorted(accepted))}."
        )
    for key, value in overrides.items():
        _check_value(argument, key, value, cls)
    _dry_build(name, cls, overrides, argument)


# -- carrying param groups -------------------------------------------------------------------
def merge_overrides(
    name: str, overrides: dict[str, Any] | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The new optimizer's arguments: ``overrides`` and the keyword arguments (a key given in
    both is refused), checked by :func:`check_overrides`."""
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(
            "`overrides` must be a dict of optimizer arguments or None; got "
            f"{overrides!r} ({type(overrides).__name__})."
        )
    both = sorted(set(overrides or {}) & set(kwargs))
    if both:
        raise ValueError(f"`overrides`: {both} given both in `overrides` and as keyword arguments.")
    merged = {**(overrides or {}), **kwargs}
    check_overrides(name, swap_class(name), merged)
    return merged


def _signature_defaults(cls: type | None) -> dict[str, Any]:
    if cls is None:
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _carry_group(
    group: dict[str, Any],
    name: str,
    target: type[Optimizer],
    source: type | None,
    source_options: set[str],
) -> tuple[dict[str, Any], set[str]]:
    """Split one param group into the options carried to ``target`` and the names of dropped
    options that were set away from ``source``'s default (those are worth a note)."""
    accepted = accepted_options(target)
    defaults = _signature_defaults(source)
    carried, dropped = {}, set()
    for key, value in group.items():
        if key == "params":
            continue
        if (
            target is torch.optim.Adafactor
            and source is not torch.optim.Adafactor
            and key in ("eps", "betas")
        ):
            dropped.add(key)  # Adafactor's eps is (eps1, eps2) with another meaning; no betas
        elif name == "adamw_fused" and key in ("fused", "foreach"):
            pass  # set from the device
        elif accepted is None or key in accepted:
            carried[key] = value
        elif key in source_options:
            if key in defaults and defaults[key] != value:
                dropped.add(key)
        else:
            carried[key] = value
    return carried, dropped


def _apply_overrides(group: dict[str, Any], overrides: dict[str, Any], ctor_only: set[str]) -> None:
    for key, value in overrides.items():
        if key in ctor_only:
            continue
        if key == "lr" and "initial_lr" in group and group["initial_lr"]:
            group["lr"] = value * (group.get("lr", group["initial_lr"]) / group["initial_lr"])
            group["initial_lr"] = value
        else:
            group[key] = value


def carry_param_groups(
    param_groups: Iterable[dict[str, Any]],
    name: str,
    target: type[Optimizer],
    *,
    source: Optimizer | None = None,
    overrides: dict[str, Any] | None = None,
    ctor_only: set[str] | None = None,
) -> tuple[list[dict[str, Any]], set[str]]:
    """The param groups for ``target`` (named ``name``): each group's options carried or dropped
    as the module docstring says (``source``: the optimizer they come from), ``overrides``
    applied to every group (except ``ctor_only`` keys, default: ``target``'s constructor-only
    ones), the same parameters. Returns the groups and the dropped option names worth a note."""
    overrides = overrides or {}
    ctor_only = _ctor_only(target) if ctor_only is None else ctor_only
    source_cls = type(source) if source is not None else None
    source_options: set[str] = set()
    if source is not None:
        source_options = set(source.defaults) | (accepted_options(type(source)) or set())
    groups, dropped = [], set()
    for group in param_groups:
        carried, gone = _carry_group(group, name, target, source_cls, source_options)
        dropped |= gone
        carried["params"] = list(group["params"])
        _apply_overrides(carried, overrides, ctor_only)
        groups.append(carried)
    return groups, dropped


# -- building --------------------------------------------------------------------------------
def _ctor_options(
    name: str,
    cls: type[Optimizer],
    overrides: dict[str, Any],
    on_cuda: bool,
    groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """Constructor arguments that are not group keys: bitsandbytes' 8-bit options, for
    ``adamw_fused`` ``fused`` on CUDA, ``foreach`` elsewhere, and the bf16 names' compensation."""
    ctor: dict[str, Any] = compensation_options(name, groups)
    if name in EIGHT_BIT_NAMES:
        ctor["min_8bit_size"] = overrides.get("min_8bit_size", DEFAULT_MIN_8BIT_SIZE)
    for key in _ctor_only(cls) & set(overrides):
        ctor[key] = overrides[key]
    if name == "adamw_fused":
        ctor["fused" if on_cuda else "foreach"] = True
    return ctor


def _build(
    name: str,
    param_groups: Sequence[dict[str, Any]],
    *,
    source: Optimizer | None = None,
    keep_32bit: Iterable[torch.Tensor] = (),
    overrides: dict[str, Any] | None = None,
) -> tuple[Optimizer, set[str]]:
    overrides = dict(overrides or {})
    cls = swap_class(name)
    check_overrides(name, cls, overrides)
    groups, dropped = carry_param_groups(
        param_groups, name, cls, source=source, overrides=overrides
    )
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    optimizer = cls(groups, **_ctor_options(name, cls, overrides, on_cuda, groups))
    keep = list(keep_32bit)
    if keep and name in EIGHT_BIT_NAMES:
        _keep_32bit_states(optimizer, keep)
    return optimizer, dropped


def _as_groups(param_groups: Iterable[Any]) -> list[dict[str, Any]]:
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return groups


def build_optimizer(
    name: str,
    param_groups: Iterable[Any],
    *,
    keep_32bit: Iterable[torch.Tensor] = (),
    **overrides: Any,
) -> Optimizer:
    """Build the optimizer ``name`` (a short name of :data:`NAMES` or a class path) over
    ``param_groups`` (dicts with ``"params"`` and per-group options, or plain tensors).

    Group keys the optimizer accepts are kept per group; ``overrides`` replace a key in every
    group (see the module docstring for ``lr``). For 8-bit names, tensors with fewer than
    ``min_8bit_size`` (default 4096) elements and the tensors in ``keep_32bit`` (e.g.
    :func:`embedding_parameters`) keep 32-bit states.
    """
    return _build(name, _as_groups(param_groups), keep_32bit=keep_32bit, overrides=overrides)[0]


def swap_optimizer(
    old: Optimizer, name: str, *, keep_32bit: Iterable[torch.Tensor] = (), **overrides: Any
) -> Optimizer:
    """A new optimizer ``name`` over the param groups of ``old``: same parameters, per-group
    ``lr``/``weight_decay``/options carried as the module docstring says. ``old`` is not changed;
    its state (moments) is not converted."""
    return _build(name, old.param_groups, source=old, keep_32bit=keep_32bit, overrides=overrides)[0]


def apply_optimizer_swap(
    optimizer: Optimizer,
    name: str,
    *,
    schedulers: Iterable[Any] = (),
    keep_32bit: Iterable[torch.Tensor] = (),
    model: nn.Module | None = None,
    in_backward: bool = False,
    **overrides: Any,
) -> Change:
    """:func:`replace_optimizer` (``in_backward`` needs ``model``), with the LR ``schedulers``
    that drive ``optimizer`` pointed at the new one. The change's ``value`` is the new optimizer
    and ``figures["dropped"]`` the old options it does not take; its ``undo()`` points the
    schedulers back at ``optimizer`` (which the swap did not change) and takes an in-backward
    optimizer's gradient hooks off the parameters."""
    from lightning_efficient.techniques.optimizers.schedulers import rebind_schedulers

    if in_backward and model is None:
        raise TypeError("`model` is needed with `in_backward=True` (its parameters get the hooks).")
    new, dropped = replace_optimizer(
        optimizer,
        name,
        model,  # type: ignore[arg-type]  # only read with in_backward
        keep_32bit=keep_32bit,
        overrides=overrides,
        in_backward=in_backward,
    )
    schedulers = list(schedulers)
    moved = rebind_schedulers(schedulers, optimizer, new)

    def undo() -> None:
        if moved:
            rebind_schedulers(schedulers, new, optimizer)
        if in_backward:
            new.detach()  # type: ignore[attr-defined]

    return Change(
        f"{type(optimizer).__name__} -> {name}" + (" (stepped in backward)" if in_backward else ""),
        undo if moved or in_backward else None,
        figures={
            "param_groups": len(new.param_groups),
            "schedulers": moved,
            "dropped": sorted(dropped),
        },
        value=new,
    )


def replace_optimizer(
    old: Optimizer,
    name: str,
    model: nn.Module,
    *,
    keep_32bit: Iterable[torch.Tensor] = (),
    overrides: dict[str, Any] | None = None,
    in_backward: bool = False,
) -> tuple[Optimizer, set[str]]:
    """What ``OptimizerSwap`` puts in place of ``old``: :func:`swap_optimizer`, or with
    ``in_backward`` an ``InBackwardOptimizer`` over ``model`` whose groups carry ``old``'s
    options and whose per-parameter optimizers are ``name``. Returns it and the dropped options."""
    overrides = dict(overrides or {})
    keep = list(keep_32bit)
    if not in_backward:
        return _build(name, old.param_groups, source=old, keep_32bit=keep, overrides=overrides)
    cls = swap_class(name)
    groups, dropped = carry_param_groups(
        old.param_groups, name, cls, source=old, overrides=overrides
    )
    # group options are in the groups now; the per-parameter optimizers get the rest
    ctor_overrides = {k: v for k, v in overrides.items() if k in _ctor_only(cls)}

    def factory(g: list[dict]) -> Optimizer:
        return _build(name, g, keep_32bit=keep, overrides=ctor_overrides)[0]

    return attach_optimizer_in_backward(model, factory, groups), dropped


def estimate_optimizer(
    name: str, keep: Sequence[torch.Tensor], overrides: dict[str, Any]
) -> Callable[[list[dict]], Optimizer]:
    """``factory(groups)`` for the estimate plan of a swap to ``name``: groups carried as a fit
    carries them; on fake tensors the estimate-only state model where ``name`` reads tensor
    values (bitsandbytes, Adafactor), otherwise the real optimizer."""
    from lightning_efficient.core._internals import FakeTensor

    cls = swap_class(name)
    # the state model takes bitsandbytes' 8-bit options as constructor arguments
    model_ctor = _ctor_only(cls) | (set(_CTOR_ONLY) | {"max_unorm", "skip_zeros"})

    def factory(groups: list[dict]) -> Optimizer:
        if any(isinstance(p, FakeTensor) for g in groups for p in g["params"]):
            carried, _ = carry_param_groups(
                groups, name, cls, overrides=overrides, ctor_only=model_ctor
            )
            ctor = {k: v for k, v in overrides.items() if k in model_ctor}
            model = state_model(
                cls, carried, keep_32bit=keep if name in EIGHT_BIT_NAMES else (), **ctor
            )
            if model is not None:
                return model
        return build_optimizer(name, groups, keep_32bit=keep, **overrides)

    return factory


# -- 32-bit states for some tensors ------------------------------------------------------------
def _keep_32bit_states(optimizer: Optimizer, params: Sequence[torch.Tensor]) -> None:
    """bitsandbytes' GlobalOptimManager override (``optim_bits=32``) for ``params``, scoped to
    this optimizer: a private manager instance instead of the process-wide singleton, so that no
    config leaks into other optimizers through reused ``id()``s."""
    from bitsandbytes.optim import GlobalOptimManager

    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    chosen = [p for p in params if id(p) in mine]
    if not chosen:
        return
    manager = GlobalOptimManager.__new__(GlobalOptimManager)
    manager.initialize()
    manager.override_config(chosen, key_value_dict={"optim_bits": 32})
    optimizer.mng = manager


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights of every ``nn.Embedding`` (and ``nn.EmbeddingBag``) of ``model``: the tensors
    whose 8-bit states hurt stability most (rare tokens get large, sparse updates)."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            seen[id(module.weight)] = module.weight
    return list(seen.values())


def kept_32bit_parameters(
    model: nn.Module, name: str, embeddings_32bit: bool
) -> list[nn.Parameter]:
    """The tensors a swap to ``name`` keeps 32-bit states for: the :func:`embedding_parameters`
    of ``model`` for 8-bit names with ``embeddings_32bit``, else none."""
    if embeddings_32bit and name in EIGHT_BIT_NAMES:
        return embedding_parameters(model)
    return []


# -- what a swap says, and the flags that follow the device ------------------------------------
def _params(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    return [p for o in optimizers for g in o.param_groups for p in g["params"]]


def eight_bit_saves_nothing(
    params: Iterable[torch.Tensor], min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
) -> bool:
    """Whether 8-bit optimizer states would save nothing on ``params`` (the trainable tensors):
    every one has fewer than ``min_8bit_size`` elements, so bitsandbytes keeps its state in 32
    bits (LoRA adapters on a small model); ``False`` when there is no tensor."""
    sizes = [p.numel() for p in params]
    return bool(sizes) and max(sizes) < min_8bit_size


def swap_messages(
    name: str, swapped: Sequence[Optimizer], overrides: dict[str, Any], dropped: Iterable[str]
) -> tuple[str | None, list[str]]:
    """``(no_effect, notes)`` of a swap to ``name`` that built ``swapped`` and ``dropped`` old
    options: ``no_effect`` when every tensor is under ``min_8bit_size`` for an 8-bit name (its
    state stays 32-bit), the notes on ``adamw_fused`` off CUDA and on the dropped options."""
    no_effect, notes = None, []
    small = (overrides or {}).get("min_8bit_size", DEFAULT_MIN_8BIT_SIZE)
    sizes = [p.numel() for p in _params(swapped)]
    if name in EIGHT_BIT_NAMES and eight_bit_saves_nothing(_params(swapped), small):
        no_effect = (  # e.g. LoRA adapters (issue 39)
            f"every trainable tensor has fewer than min_8bit_size={small:,} elements (largest "
            f"{max(sizes):,}): bitsandbytes keeps their state in 32 bits, so "
            f"{name!r} saves no memory here."
        )
    if name == "adamw_fused" and not all(p.is_cuda for p in _params(swapped)):
        notes.append(
            "'adamw_fused': parameters are not on CUDA, so AdamW runs with foreach=True "
            "(same maths) instead of fused."
        )
    if dropped:
        notes.append(
            f"options of the old optimizer that {name!r} does not take were "
            f"dropped: {', '.join(sorted(dropped))}."
        )
    return no_effect, notes


def set_device_flags(name: str, optimizers: Sequence[Optimizer]) -> None:
    """For ``adamw_fused``, each param group's ``fused`` on CUDA, ``foreach`` elsewhere (a param
    group restored from a checkpoint replaces the built one as a whole)."""
    if name != "adamw_fused":
        return
    for opt in optimizers:
        for group in opt.param_groups:
            on_cuda = all(p.is_cuda for p in group["params"])
            group["fused"], group["foreach"] = (True, None) if on_cuda else (None, True)
