"""ZeRO optimizer state and weights in the layout of plain torch, and ZeRO checkpoints to files.

- :func:`zero_optimizer_state` / :func:`load_zero_optimizer_state`: a ZeRO optimizer's state in
  the layout of the original torch optimizer, and back (how checkpoints stay portable).
- :func:`full_state_dict`: the module's full fp32 ``state_dict`` from the ZeRO master weights.
- :func:`export_fp32`: a ZeRO checkpoint directory to a plain ``state_dict`` file, read without
  running code from it, never written over an input or an existing file unless asked.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_efficient.core._internals import link_zero_optimizer_states
from lightning_efficient.techniques.zero_offload.convert import _float, import_deepspeed
from lightning_efficient.techniques.zero_offload.loading import (
    CheckpointError,
    check_checkpoint_directory,
    load_checkpoint_file,
    weights_only_loading,
)

__all__ = [
    "load_plain_weights",
    "optimizer_template",
    "parameter_count",
    "zero_optimizer_state",
    "load_zero_optimizer_state",
    "full_state_dict",
    "export_fp32",
    "TRUST_HINT",
]

#: How a user opts in to loading a checkpoint that needs more than the allow-list.
TRUST_HINT = (
    "pass trusted=True to export_fp32 (or --trust-checkpoint to lightning-efficient export-zero)"
)

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
        link_zero_optimizer_states(zero_optimizer)
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
    link_zero_optimizer_states(zero_optimizer)
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
    deepspeed = import_deepspeed()
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


def export_fp32(
    checkpoint_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    overwrite: bool = False,
    trusted: bool = False,
) -> Path:
    """Consolidate a ZeRO checkpoint into one plain fp32 ``state_dict`` file (``torch.save``).

    ``checkpoint_dir`` is what ``ZeROOffload(save_format="zero")`` (or any Lightning DeepSpeed
    run) wrote with ``trainer.save_checkpoint``; a plain checkpoint file written by
    ``ZeROOffload`` is accepted too (its ``state_dict`` is extracted). The result has the
    module's own keys: ``module.load_state_dict(torch.load(out_path))`` works without DeepSpeed.

    Args:
        checkpoint_dir: The ZeRO checkpoint directory (or a plain checkpoint file).
        out_path: The file to write; an existing file is replaced only with ``overwrite``, and
            never when it is (inside) the input.
        overwrite: Replace an existing ``out_path``.
        trusted: Load the input with full unpickling (``weights_only=False``): only for a file
            you trust; by default it loads with ``weights_only=True`` and an allow-list of the
            types checkpoints hold, and a file that needs more is refused.
    """
    src, out = Path(checkpoint_dir), Path(out_path)
    if not src.exists():
        raise FileNotFoundError(f"`checkpoint_dir` does not exist: {str(src)!r}.")
    _check_output(src, out, overwrite)
    if src.is_file():
        ckpt = load_checkpoint_file(src, trusted=trusted, how_to_trust=TRUST_HINT)
        if not isinstance(ckpt, Mapping) or "state_dict" not in ckpt:
            raise CheckpointError(
                f"`checkpoint_dir` {str(src)!r} is a file but not a Lightning checkpoint "
                "(no 'state_dict' in it)."
            )
        state = dict(ckpt["state_dict"])
    else:
        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        if not any(src.glob("*/*model_states.pt")) and not any(src.glob("*model_states.pt")):
            raise CheckpointError(
                f"`checkpoint_dir` {str(src)!r} holds no DeepSpeed ZeRO checkpoint (no "
                "'*model_states.pt' inside)."
            )
        check_checkpoint_directory(src, trusted=trusted, how_to_trust=TRUST_HINT)
        tag = None if (src / "latest").exists() else _only_tag(src)
        # DeepSpeed's loader passes weights_only=False: force weights_only unless trusted
        with weights_only_loading(force=not trusted):
            state = dict(get_fp32_state_dict_from_zero_checkpoint(str(src), tag=tag))
        state = {
            _strip_prefix(k): v.float() if v.is_floating_point() else v for k, v in state.items()
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, out)  # a reader never sees a half-written file
    return out


def _check_output(src: Path, out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise ValueError(
            f"`out_path` {str(out)!r} is an existing directory; give the file to write, e.g. "
            f"{str(out / 'model.pt')!r}."
        )
    if not out.exists():
        return
    resolved, source = out.resolve(), src.resolve()
    if resolved == source or (src.is_dir() and source in resolved.parents):
        raise ValueError(
            f"`out_path` {str(out)!r} is the input checkpoint"
            + ("" if resolved == source else f" (a file inside {str(src)!r})")
            + "; write the consolidated weights to another file."
        )
    if not overwrite:
        raise FileExistsError(
            f"`out_path` {str(out)!r} exists; pass overwrite=True (--force for "
            "lightning-efficient export-zero) to replace it, or choose another file."
        )


def _only_tag(src: Path) -> str | None:
    tags = [d.name for d in src.iterdir() if d.is_dir() and any(d.glob("*model_states.pt"))]
    return tags[0] if len(tags) == 1 else None


def _strip_prefix(key: str) -> str:
    for prefix in ("_forward_module.", "module."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def optimizer_template(optimizer: Optimizer) -> dict[str, Any]:
    """The module's optimizer before DeepSpeed's: its groups' settings and parameters, the layout
    a plain checkpoint's optimizer state is written in and read from."""
    groups = optimizer.state_dict()["param_groups"]
    return {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
        "params": [list(g["params"]) for g in optimizer.param_groups],
    }


def parameter_count(module: nn.Module) -> int:
    """The module's parameter count, stage 3's partitioned parameters at their full size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def load_plain_weights(
    module: nn.Module, checkpoint: Mapping[str, Any], strict: bool, restore: Any = None
) -> None:
    """A plain checkpoint's ``state_dict`` into a module under a ZeRO engine: the modules' state
    (``restore(checkpoint, strict=)``: stage 3's, partitioned), then every trained parameter's
    fp32 master copy."""
    from deepspeed.utils import safe_set_full_fp32_param

    state = checkpoint["state_dict"]
    if restore is not None:
        restore(checkpoint, strict=strict)
    else:
        module.load_state_dict(state, strict=strict)
    for name, p in module.named_parameters():
        if name in state and p.requires_grad:
            safe_set_full_fp32_param(p, state[name].float().flatten())
