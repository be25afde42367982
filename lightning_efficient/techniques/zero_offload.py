"""ZeRO-Offload: DeepSpeed ZeRO stage 2/3 with the optimizer (and parameters) in host memory.

ZeRO-Offload keeps the fp32 master weights, the gradients' fp32 partition and the optimizer state
on the CPU (or NVMe) and runs the optimizer step there (DeepSpeed's ``DeepSpeedCPUAdam``), so the
GPU holds only the parameters it computes with, one gradient bucket and the activations. At
stage 3 with ``offload_parameters`` the parameters live on the host too and are fetched layer by
layer.

Pure functions (no Lightning needed), exported from :mod:`lightning_efficient.functional`:

- :func:`zero_offload_config`: the checked DeepSpeed config for the named arguments, with a user
  ``config`` merged in (a conflicting value is an error, never a silent override).
- :func:`scale_buckets`: bucket sizes for a model of a given size (single-GPU defaults).
- :func:`to_deepspeed_optimizer`: a torch Adam/AdamW/Adagrad to its DeepSpeed CPU counterpart,
  keeping every group's lr, betas, eps and weight decay; :func:`rebind_schedulers` points the LR
  schedulers at it.
- :func:`zero_optimizer_state` / :func:`load_zero_optimizer_state`: a ZeRO optimizer's state in
  the layout of the original torch optimizer, and back (how checkpoints stay portable).
- :func:`export_fp32`: a ZeRO checkpoint directory to a plain ``state_dict`` file.

:class:`ZeROOffload` is Lightning's ``DeepSpeedStrategy`` with these decisions made, usable on a
CPU (gloo) so that tests run the real DeepSpeed.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_efficient.core.validate import check_bool, check_choice, format_bytes, missing_extra

__all__ = [
    "ZeROOffload",
    "zero_offload_config",
    "scale_buckets",
    "to_deepspeed_optimizer",
    "rebind_schedulers",
    "zero_optimizer_state",
    "load_zero_optimizer_state",
    "full_state_dict",
    "export_fp32",
    "offloaded_categories",
    "SUPPORTED_OPTIMIZERS",
    "SAVE_FORMATS",
]

#: torch optimizers that have a DeepSpeed CPU counterpart (what offloading can run).
SUPPORTED_OPTIMIZERS: dict[str, str] = {
    "torch.optim.Adam": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=False)",
    "torch.optim.AdamW": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)",
    "torch.optim.Adagrad": "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
}
#: How ``ZeROOffload`` writes checkpoints (see the class docstring).
SAVE_FORMATS = ("auto", "plain", "zero")

# config paths that a named argument owns: a user config may repeat them only with equal values
_ZO = "zero_optimization"
# what Lightning and DeepSpeed export to os.environ when they start the process group
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")


def _purpose() -> str:
    return "ZeROOffload (DeepSpeed ZeRO-Offload)"


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as err:
        raise missing_extra("deepspeed", "deepspeed", _purpose()) from err
    return deepspeed


# -- configuration --------------------------------------------------------------------------
def _check_nvme_path(nvme_path: Any, needed: bool) -> str | None:
    if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
        raise TypeError(
            f"`nvme_path` must be a directory path (str) or None; got {nvme_path!r} "
            f"({type(nvme_path).__name__})."
        )
    if not needed:
        if nvme_path is not None:
            raise ValueError(
                f"`nvme_path` ({str(nvme_path)!r}) is only used with offload_optimizer='nvme'; "
                "set offload_optimizer='nvme' or drop `nvme_path`."
            )
        return None
    if nvme_path is None:
        raise ValueError(
            "`nvme_path` is required with offload_optimizer='nvme': give a writable directory "
            "on a fast local NVMe drive, e.g. nvme_path='/local_nvme'."
        )
    path = os.fspath(nvme_path)
    if not os.path.isdir(path):
        raise ValueError(f"`nvme_path` must be an existing directory; {path!r} is not one.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"`nvme_path` must be writable; {path!r} is not writable by this user.")
    return path


def _named_settings(
    stage: int,
    offload_optimizer: str | None,
    offload_parameters: bool,
    nvme_path: str | None,
    pin_memory: bool,
) -> dict[tuple[str, ...], tuple[str, Any]]:
    """Config path -> (argument name, value) for every setting a named argument owns."""
    owned: dict[tuple[str, ...], tuple[str, Any]] = {
        (_ZO, "stage"): ("stage", stage),
        (_ZO, "offload_optimizer", "device"): ("offload_optimizer", offload_optimizer or "none"),
        (_ZO, "offload_param", "device"): (
            "offload_parameters",
            ("nvme" if offload_optimizer == "nvme" else "cpu") if offload_parameters else "none",
        ),
    }
    for section, active in (
        ("offload_optimizer", offload_optimizer is not None),
        ("offload_param", offload_parameters),
    ):
        if active:
            owned[(_ZO, section, "pin_memory")] = ("pin_memory", pin_memory)
            if nvme_path is not None:
                owned[(_ZO, section, "nvme_path")] = ("nvme_path", nvme_path)
    return owned


def _get(cfg: Mapping[str, Any], path: Sequence[str]) -> tuple[bool, Any]:
    node: Any = cfg
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _set(cfg: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def zero_offload_config(
    stage: int = 2,
    offload_optimizer: str | None = "cpu",
    offload_parameters: bool = False,
    nvme_path: str | None = None,
    pin_memory: bool = True,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config for ZeRO-Offload on one GPU (or several), checked and merged.

    The named arguments own their config entries (``zero_optimization.stage``, the
    ``offload_optimizer``/``offload_param`` devices, ``nvme_path`` and ``pin_memory``): ``config``
    may repeat them only with the same value, otherwise a ``ValueError`` names both. Every other
    entry of ``config`` is merged in and wins over this function's defaults (``overlap_comm``,
    ``contiguous_gradients``, bucket sizes, ...). Bucket sizes that depend on the model are added
    later by :func:`scale_buckets`.
    """
    if stage == 1 and not isinstance(stage, bool):
        raise ValueError(
            "`stage` must be 2 or 3; got 1. ZeRO stage 1 partitions only the optimizer state and "
            "DeepSpeed cannot offload at stage 1 to a useful extent on one GPU: use stage=2 "
            "(optimizer state and gradients offloaded) or stage=3 (parameters too)."
        )
    check_choice("stage", stage, (2, 3))
    check_choice("offload_optimizer", offload_optimizer, ("cpu", "nvme", None))
    check_bool("offload_parameters", offload_parameters)
    check_bool("pin_memory", pin_memory)
    if offload_parameters and stage != 3:
        raise ValueError(
            f"`offload_parameters`=True needs stage=3 (only ZeRO-3 partitions the parameters); "
            f"got stage={stage}."
        )
    nvme = _check_nvme_path(nvme_path, needed=offload_optimizer == "nvme")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"`config` must be a dict of DeepSpeed settings or None; got {type(config).__name__}."
        )

    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if stage == 2:
        zero.update(allgather_partitions=True, reduce_scatter=True, round_robin_gradients=False)
    if offload_optimizer is not None:
        zero["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": pin_memory}
        if nvme is not None:
            zero["offload_optimizer"].update(nvme_path=nvme, buffer_count=4)
    if offload_parameters:
        zero["offload_param"] = {"device": "nvme" if nvme else "cpu", "pin_memory": pin_memory}
        if nvme is not None:
            zero["offload_param"].update(nvme_path=nvme, buffer_count=5)
    built: dict[str, Any] = {"zero_allow_untested_optimizer": True, _ZO: zero}
    if nvme is not None:
        built["aio"] = {
            "block_size": 1048576,
            "queue_depth": 8,
            "single_submit": False,
            "overlap_events": True,
        }

    if config:
        owned = _named_settings(stage, offload_optimizer, offload_parameters, nvme, pin_memory)
        conflicts = []
        for path, (arg, value) in owned.items():
            present, given = _get(config, path)
            if (
                present
                and given != value
                and not (path[-1] == "nvme_path" and os.fspath(given) == value)
            ):
                where = "config" + "".join(f"[{k!r}]" for k in path)
                conflicts.append(f"{where}={given!r} conflicts with `{arg}`={value!r}")
        if conflicts:
            raise ValueError(
                "`config` conflicts with named arguments of ZeROOffload (set each setting in one "
                "place: drop it from `config` or change the argument): "
                + "; ".join(conflicts)
                + "."
            )
        if "gradient_accumulation_steps" in config:
            raise ValueError(
                "`config['gradient_accumulation_steps']` conflicts with the Trainer's "
                "`accumulate_grad_batches`, which sets it; drop it from `config`."
            )
        built = _deep_merge(built, config)
    return built


def scale_buckets(config: Mapping[str, Any], num_parameters: int) -> dict[str, Any]:
    """Bucket sizes for a model of ``num_parameters`` elements (entries already set are kept).

    One bucket is about 1/16 of the model, between 1M and 200M elements: with ``overlap_comm``
    the device holds about two buckets of gradients in flight (an eighth of the gradient bytes),
    while each host transfer stays large enough (>= 4 MB in fp32) to use the PCIe bandwidth.
    DeepSpeed's own default (500M elements, 2 GB of fp32 buffer per bucket) is sized for
    clusters, not for a 24 GB card. At stage 3, parameters under ``num_parameters / 10_000``
    elements (between 10K and 1M; biases, norms) stay on the device instead of being fetched.
    """
    if (
        isinstance(num_parameters, bool)
        or not isinstance(num_parameters, int)
        or num_parameters < 1
    ):
        raise ValueError(f"`num_parameters` must be a positive int; got {num_parameters!r}.")
    bucket = int(min(2e8, max(1e6, math.ceil(num_parameters / 16))))
    out = copy.deepcopy(dict(config))
    zero = out.setdefault(_ZO, {})
    if zero.get("stage") == 3:
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("stage3_prefetch_bucket_size", bucket)
        zero.setdefault(
            "stage3_param_persistence_threshold", int(min(1e6, max(1e4, num_parameters // 10_000)))
        )
    else:
        zero.setdefault("reduce_bucket_size", bucket)
        zero.setdefault("allgather_bucket_size", bucket)
    return out


def offloaded_categories(config: Mapping[str, Any]) -> dict[str, bool]:
    """Which memory categories a ZeRO config keeps in host memory (for the memory estimate).

    Optimizer offload keeps the optimizer state, the fp32 master weights' partition and the
    gradients' partition on the host (the device keeps one gradient bucket, which the estimate
    does not count). Parameter offload (stage 3) keeps the parameters there too.
    """
    zero = config.get(_ZO, {}) or {}
    opt = (zero.get("offload_optimizer") or {}).get("device", "none") not in (None, "none")
    par = (zero.get("offload_param") or {}).get("device", "none") not in (None, "none")
    return {"optimizer_state": opt, "gradients": opt, "parameters": par and zero.get("stage") == 3}


# -- optimizer conversion -------------------------------------------------------------------
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
        _import_deepspeed()
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
        _import_deepspeed()
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


def _track_step_calls(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` the way torch's LR schedulers do, so that they see it called."""
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def rebind_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> int:
    """Point every LR scheduler of ``old`` at ``new`` (same group order); returns how many."""
    count = 0
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            if len(new.param_groups) != len(old.param_groups):
                raise ValueError(
                    "rebind_schedulers: the optimizers have different numbers of param groups."
                )
            scheduler.optimizer = new
            _track_step_calls(new)
            count += 1
    return count


# -- optimizer state in the original torch layout ---------------------------------------------
_STATE_KEYS = {
    "DeepSpeedCPUAdam": ("exp_avg", "exp_avg_sq"),
    "DeepSpeedCPUAdagrad": ("exp_avg_sq",),
}
_HYPER_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _inner(zero_optimizer: Any) -> Optimizer:
    return getattr(zero_optimizer, "optimizer", zero_optimizer)


def _shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _step_of(inner: Optimizer) -> int:
    steps = [int(s["step"]) for s in inner.state.values() if isinstance(s, Mapping) and "step" in s]
    return max(steps, default=0)


def _link_states(zero_optimizer: Any) -> None:
    # ZeRO-1/2 link each parameter to its slice of the optimizer state after the first step, but
    # DeepSpeed steps one param group at a time and links all groups after the first one, so
    # groups 2+ stay unlinked: link again now that every group's state exists.
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def zero_optimizer_state(zero_optimizer: Any, template: Mapping[str, Any]) -> dict[str, Any]:
    """The state of a DeepSpeed ZeRO optimizer as the torch optimizer ``template`` would hold it.

    ``template`` is the original torch optimizer's ``state_dict()`` layout plus its parameters:
    ``{"param_groups": [...hyperparameters...], "params": [[param, ...] per group]}``. The result
    loads with ``torch.optim.AdamW.load_state_dict`` (per-parameter ``step``, ``exp_avg``,
    ``exp_avg_sq``; groups with the current lr, betas, eps, weight decay). Collective under ZeRO:
    every rank calls it.
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = _inner(zero_optimizer)
    keys = _STATE_KEYS.get(type(inner).__name__)
    if keys is None:
        raise TypeError(f"zero_optimizer_state: no state layout known for {type(inner).__name__}.")
    stepped = any(len(s) for s in inner.state.values())
    if stepped:
        _link_states(zero_optimizer)
    step = _step_of(inner)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group_t, params, live in zip(
        template["param_groups"], template["params"], inner.param_groups
    ):
        group = {k: v for k, v in group_t.items() if k != "params"}
        group.update({k: copy.deepcopy(live[k]) for k in _HYPER_KEYS if k in live})
        ids = []
        for p in params:
            if stepped and p.requires_grad:
                entry: dict[str, Any] = {"step": torch.tensor(float(step))}
                for key in keys:
                    entry[key] = (
                        safe_get_full_optimizer_state(p, key)
                        .detach()
                        .reshape(_shape(p))
                        .float()
                        .cpu()
                        .clone()
                    )
                state[index] = entry
            ids.append(index)
            index += 1
        group["params"] = ids
        groups.append(group)
    return {"state": state, "param_groups": groups}


def load_zero_optimizer_state(
    zero_optimizer: Any, template: Mapping[str, Any], state_dict: Mapping[str, Any]
) -> None:
    """Load a torch optimizer ``state_dict`` (the layout of ``template``) into a ZeRO optimizer.

    The inverse of :func:`zero_optimizer_state`: a plain run's AdamW checkpoint resumes under
    ZeRO with the same moments, step count and group hyperparameters. Collective under ZeRO.
    """
    from deepspeed.utils import safe_set_full_optimizer_state

    inner = _inner(zero_optimizer)
    keys = _STATE_KEYS.get(type(inner).__name__)
    if keys is None:
        raise TypeError(
            f"load_zero_optimizer_state: no state layout known for {type(inner).__name__}."
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(template["params"]) or any(
        len(g["params"]) != len(ps) for g, ps in zip(saved_groups, template["params"])
    ):
        raise ValueError(
            "The checkpoint's optimizer has a different parameter-group layout than the module's "
            "optimizer; it cannot be loaded."
        )
    for saved, live in zip(saved_groups, inner.param_groups):
        for k in _HYPER_KEYS:
            if k in saved:
                live[k] = tuple(saved[k]) if k == "betas" else saved[k]
    saved_state = state_dict.get("state", {})
    if not saved_state:
        return
    # create the (lazily created) per-partition states, then link them to the parameters
    step = 0
    for entry in saved_state.values():
        step = max(step, int(_float(entry.get("step", 0))))
    # stage 1/2 key the state by the groups' flat partitions, stage 3 by its fp32 sub-group flats
    flats = [flat for group in inner.param_groups for flat in group["params"]]
    flats += list(getattr(zero_optimizer, "fp32_partitioned_groups_flat", None) or [])
    for flat in {id(f): f for f in flats}.values():
        st = inner.state[flat]
        if not st:
            for key in keys:
                st[key] = torch.zeros_like(flat.data, dtype=torch.float32)
        st["step"] = step
    _link_states(zero_optimizer)
    for saved, params in zip(saved_groups, template["params"]):
        for idx, p in zip(saved["params"], params):
            entry = saved_state.get(idx)
            if entry is None or not p.requires_grad:
                continue
            for key in keys:
                safe_set_full_optimizer_state(p, entry[key].float().flatten(), key)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full ``state_dict`` (same keys) with every trained parameter taken from the
    ZeRO optimizer's fp32 master copy, gathered across ranks (collective under ZeRO)."""
    deepspeed = _import_deepspeed()
    from deepspeed.utils import safe_get_full_fp32_param

    stage3 = any(hasattr(p, "ds_id") for p in module.parameters())
    masters: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        if id(p) in masters:
            continue
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is not None:
            masters[id(p)] = full.detach().reshape(_shape(p)).float().cpu().clone()
    if stage3:
        missing = [p for p in module.parameters() if id(p) not in masters]
        with deepspeed.zero.GatheredParameters(missing):
            for p in missing:
                masters[id(p)] = p.detach().cpu().clone()
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, nn.Parameter) and id(t) in masters:
            out[name] = masters[id(t)]
        else:
            out[name] = t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t
    return out


def export_fp32(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Consolidate a ZeRO checkpoint into one plain fp32 ``state_dict`` file (``torch.save``).

    ``checkpoint_dir`` is what ``ZeROOffload(save_format="zero")`` (or any Lightning DeepSpeed
    run) wrote with ``trainer.save_checkpoint``; a plain checkpoint file written by
    ``ZeROOffload`` is accepted too (its ``state_dict`` is extracted). The result has the
    module's own keys: ``module.load_state_dict(torch.load(out_path))`` works without DeepSpeed.
    """
    src, out = Path(checkpoint_dir), Path(out_path)
    if not src.exists():
        raise FileNotFoundError(f"`checkpoint_dir` does not exist: {str(src)!r}.")
    if src.is_file():
        ckpt = torch.load(src, map_location="cpu", weights_only=False)
        if not isinstance(ckpt, Mapping) or "state_dict" not in ckpt:
            raise ValueError(
                f"`checkpoint_dir` {str(src)!r} is a file but not a Lightning checkpoint."
            )
        state = dict(ckpt["state_dict"])
    else:
        _import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if not any(src.glob("*/*model_states.pt")) and not any(src.glob("*model_states.pt")):
            raise ValueError(
                f"`checkpoint_dir` {str(src)!r} holds no DeepSpeed ZeRO checkpoint (no "
                "'*model_states.pt' inside)."
            )
        tag = None if (src / "latest").exists() else _only_tag(src)
        state = dict(get_fp32_state_dict_from_zero_checkpoint(str(src), tag=tag))
        state = {
            _strip_prefix(k): v.float() if v.is_floating_point() else v for k, v in state.items()
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out


def _only_tag(src: Path) -> str | None:
    tags = [d.name for d in src.iterdir() if d.is_dir() and any(d.glob("*model_states.pt"))]
    return tags[0] if len(tags) == 1 else None


def _strip_prefix(key: str) -> str:
    for prefix in ("_forward_module.", "module."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def export_zero_command(argv: Sequence[str]) -> int:
    """``lightning-efficient export-zero CKPT_DIR OUT``: consolidate a ZeRO checkpoint."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="lightning-efficient export-zero",
        description="Consolidate a ZeRO (DeepSpeed) checkpoint directory into one plain fp32 "
        "state_dict file that the unmodified module loads without DeepSpeed.",
    )
    parser.add_argument("checkpoint_dir", help="the directory trainer.save_checkpoint wrote")
    parser.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(list(argv))
    try:
        out = export_fp32(args.checkpoint_dir, args.out)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = torch.load(out, map_location="cpu", weights_only=True)
    n = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    print(f"wrote {out}: {len(state)} tensors, {n:,} elements ({format_bytes(out.stat().st_size)})")
    return 0


# -- the strategy ------------------------------------------------------------------------------
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402  (importable without deepspeed)


class ZeROOffload(DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 2/3 with the optimizer (and parameters) offloaded to host memory.

    ``Trainer(strategy=ZeROOffload())`` trains an unmodified LightningModule: its Adam/AdamW (or
    Adagrad) becomes ``DeepSpeedCPUAdam`` (``DeepSpeedCPUAdagrad``) with the same param groups,
    lr, betas, eps and weight decay, and its LR schedulers keep driving it. In yaml:
    ``strategy: zero_offload`` (stage 2, CPU offload) or ``class_path: ZeROOffload``. With
    ``devices > 1`` the same strategy partitions the state across the processes (ZeRO's data
    parallelism); nothing else changes. Runs on a CPU too (gloo), which is how it is tested.

    Args:
        stage: ZeRO stage, 2 (optimizer state and gradients partitioned/offloaded) or 3
            (parameters too). Stage 1 is refused.
        offload_optimizer: Where the optimizer state, fp32 master weights and gradient partition
            live: ``"cpu"``, ``"nvme"`` (needs ``nvme_path``) or ``None`` (stay on the device).
        offload_parameters: Stage 3 only: keep the parameters in host memory (on NVMe when
            ``offload_optimizer="nvme"``) and fetch them layer by layer.
        nvme_path: Writable directory on a local NVMe drive, for ``offload_optimizer="nvme"``.
        pin_memory: Page-locked host buffers (faster transfers, more host memory pinned).
        config: Extra DeepSpeed settings merged into the built config; it may not contradict a
            named argument (a conflict raises and names both). ``"optimizer"`` here makes
            DeepSpeed build its config optimizer instead of converting the module's.
        save_format: ``"plain"`` writes one Lightning checkpoint file with the full fp32
            ``state_dict`` and the optimizer state in the original optimizer's layout, loadable
            and resumable without DeepSpeed; ``"zero"`` writes DeepSpeed's sharded checkpoint
            directory (consolidate with :func:`export_fp32` / ``lightning-efficient
            export-zero``); ``"auto"``: plain on one process, zero on several.
    """

    strategy_name = "zero_offload"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: str | None = "cpu",
        offload_parameters: bool = False,
        nvme_path: str | None = None,
        pin_memory: bool = True,
        config: dict[str, Any] | None = None,
        save_format: str = "auto",
    ) -> None:
        built = zero_offload_config(
            stage, offload_optimizer, offload_parameters, nvme_path, pin_memory, config
        )
        check_choice("save_format", save_format, SAVE_FORMATS)
        _import_deepspeed()
        import logging

        super().__init__(config=copy.deepcopy(built), logging_level=logging.WARN)
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self.nvme_path = None if nvme_path is None else os.fspath(nvme_path)
        self.pin_memory = pin_memory
        self.user_config = copy.deepcopy(dict(config)) if config else None
        self.save_format = save_format
        self._template: dict[str, Any] | None = None
        self._loaded_plain = False
        self._converted = ""

    # -- registry -----------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "zero_offload",
            cls,
            description="lightning-efficient ZeRO-2 with the optimizer offloaded to CPU",
            override=True,
        )
        strategy_registry.register(
            "zero_offload_stage_3",
            cls,
            description="lightning-efficient ZeRO-3 with optimizer and parameters offloaded to CPU",
            stage=3,
            offload_parameters=True,
            override=True,
        )

    # -- devices: DeepSpeed runs on a CPU too (gloo) ----------------------------------------------
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # DeepSpeed addresses processes by device index; CPU devices carry none, so number them
        if devices is not None and all(d.type == "cpu" for d in devices):
            devices = [torch.device("cpu", i) for i in range(len(devices))]
        self._parallel_devices = devices

    def setup_environment(self) -> None:
        from lightning.pytorch.accelerators import CPUAccelerator
        from lightning.pytorch.strategies import DDPStrategy

        if isinstance(self.accelerator, CPUAccelerator):
            DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check
        else:
            super().setup_environment()

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # before fit's launch exports the group's address, port and ranks to os.environ
        self._env_before = {k: os.environ.get(k) for k in _DIST_ENV}

    def teardown(self) -> None:
        super().teardown()
        if self.world_size == 1 and getattr(self, "_env_before", None) is not None:
            # one process: the launcher and DeepSpeed exported the group's address, port and
            # ranks to os.environ, where processes started later (a DDP launch, tests) would
            # inherit a port this process still listens on. Put the environment back.
            for key, value in self._env_before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def setup(self, trainer: Any) -> None:
        if self.config is not None and self.lightning_module is not None:
            n = sum(getattr(p, "ds_numel", p.numel()) for p in self.lightning_module.parameters())
            self.config = scale_buckets(self.config, max(1, n))
        super().setup(trainer)

    def _auto_select_batch_size(self) -> int:
        # Lightning reads batch_sampler.batch_size, which loaders without a batch sampler lack
        try:
            return super()._auto_select_batch_size() or 1
        except (AttributeError, TypeError):
            return 1

    # -- optimizer: the module's torch optimizer -> its DeepSpeed CPU counterpart ------------------
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler_config = super()._init_optimizers()
        self._template = {
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"}
                for g in optimizer.state_dict()["param_groups"]
            ],
            "params": [list(g["params"]) for g in optimizer.param_groups],
        }
        new = to_deepspeed_optimizer(optimizer, self.offload_optimizer)
        if new is not optimizer:
            if scheduler_config is not None:
                rebind_schedulers([scheduler_config.scheduler], optimizer, new)
            self._converted = f"{type(optimizer).__name__} -> {type(new).__name__}"
        return new, scheduler_config

    # -- checkpoints ----------------------------------------------------------------------------
    def _plain_format(self) -> bool:
        return self.save_format == "plain" or (self.save_format == "auto" and self.world_size == 1)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._plain_format() and self.lightning_module is not None:
            return full_state_dict(self.lightning_module)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._plain_format() and self._template is not None:
            return zero_optimizer_state(optimizer, self._template)
        return super().optimizer_state(optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._plain_format():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from lightning.pytorch.strategies import Strategy

        checkpoint["zero_offload"] = {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
        }
        Strategy.save_checkpoint(self, checkpoint, self.broadcast(filepath), storage_options)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if os.path.isdir(checkpoint_path):
            self._loaded_plain = False
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.pytorch.strategies import Strategy

        self._loaded_plain = True
        return Strategy.load_checkpoint(self, checkpoint_path, weights_only=False)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self._loaded_plain or super().lightning_restore_optimizer

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._loaded_plain:
            return super().load_model_state_dict(checkpoint, strict)
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.lightning_module
        state = checkpoint["state_dict"]
        if self.zero_stage_3:
            self._restore_zero_state(checkpoint, strict=strict)
        else:
            module.load_state_dict(state, strict=strict)
        params = dict(module.named_parameters())
        for name, p in params.items():
            if name in state and p.requires_grad:
                safe_set_full_fp32_param(p, state[name].float().flatten())

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._loaded_plain or self._template is None:
            return super().load_optimizer_state_dict(checkpoint)
        load_zero_optimizer_state(
            self.optimizers[0], self._template, checkpoint["optimizer_states"][0]
        )

    # -- the efficiency report and the memory estimate ------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        where = self.offload_optimizer or "device"
        change = f"ZeRO stage {self.stage}, optimizer state on {where}"
        if self.offload_parameters:
            change += ", parameters offloaded"
        if self._converted:
            change += f" ({self._converted})"
        from lightning_efficient.core.report import report_for

        n = sum(getattr(p, "ds_numel", p.numel()) for p in self.lightning_module.parameters())
        report_for(trainer).add(
            type(self).__name__, change, world_size=self.world_size, parameters=n
        )

    def on_train_end(self) -> None:
        super().on_train_end()
        from lightning_efficient.core.report import report_for

        trainer = self.lightning_module.trainer
        report_for(trainer).show(trainer)

    def configure_estimate(self, plan: Any) -> None:
        """Count what this strategy keeps in host memory as host bytes in the memory estimate."""
        offload = getattr(plan, "offload", None)
        if offload is None:
            offload = plan.offload = {}
        moved = [c for c, on in offloaded_categories(self.config or {}).items() if on]
        for category in moved:
            offload[category] = True
        if "optimizer_state" in moved:
            # the step runs on the host (DeepSpeedCPUAdam, element-wise): the device sees none of
            # a foreach step's whole-model temporaries; step one tensor at a time instead, so the
            # temporaries left (counted on the device) are one parameter's worth at most
            make = plan.optimizer
            plan.optimizer = lambda groups: _per_tensor(make(groups))
        if moved and hasattr(plan, "note"):
            plan.note(
                f"ZeROOffload: {', '.join(moved)} counted in host memory, optimizer step per tensor "
                "(it runs on the host); DeepSpeed also keeps fp32 master weights there (4 B/parameter) "
                "and one gradient bucket on the device; with parameter offload each layer's weights "
                "visit the device while it runs."
            )


def _per_tensor(optimizer: Optimizer) -> Optimizer:
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = False
        if group.get("fused"):
            group["fused"] = False
    return optimizer


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    ZeROOffload.register_strategies(StrategyRegistry)


_register()
