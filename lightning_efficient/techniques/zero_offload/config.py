"""ZeRO-Offload configuration: the checked DeepSpeed config, bucket sizes, and what lives where.

Pure functions (no DeepSpeed, no Lightning):

- :func:`zero_offload_config`: the checked DeepSpeed config for the named arguments, with a user
  ``config`` merged in (a conflicting value is an error, never a silent override).
- :func:`scale_buckets`: bucket sizes for a model of a given size (single-GPU defaults).
- :func:`offloaded_categories`: which memory categories a config keeps in host memory.
- :func:`host_buffers`: what DeepSpeed allocates in host memory for a config, by buffer.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_efficient.core.validate import check_bool, check_choice

__all__ = [
    "zero_offload_config",
    "scale_buckets",
    "offloaded_categories",
    "host_buffers",
    "ESTIMATE_TRACKS",
    "SAVE_FORMATS",
    "SHORT_NAMES",
    "numbered_cpu_devices",
    "report_text",
]

#: The strategy registry's names for ``ZeROOffload``: (description, init arguments).
SHORT_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero_offload": ("lightning-efficient ZeRO-2 with the optimizer offloaded to CPU", {}),
    "zero_offload_stage_3": (
        "lightning-efficient ZeRO-3 with optimizer and parameters offloaded to CPU",
        {"stage": 3, "offload_parameters": True},
    ),
}

#: How ``ZeROOffload`` writes checkpoints (see the class docstring).
SAVE_FORMATS = ("auto", "plain", "zero")

# config paths that a named argument owns: a user config may repeat them only with equal values
_ZO = "zero_optimization"


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

    Optimizer offload keeps the optimizer state and the gradients' partition on the host (the
    device keeps one gradient bucket, which the estimate does not count); parameter offload
    (stage 3) keeps the parameters there too. DeepSpeed's other host buffers (the fp32 master
    copy, transfer buffers) are not a category of the estimate: see :func:`host_buffers`.
    """
    zero = config.get(_ZO, {}) or {}
    opt = (zero.get("offload_optimizer") or {}).get("device", "none") not in (None, "none")
    par = (zero.get("offload_param") or {}).get("device", "none") not in (None, "none")
    return {"optimizer_state": opt, "gradients": opt, "parameters": par and zero.get("stage") == 3}


#: Buffers of :func:`host_buffers` that the memory estimate already tracks as a category (the
#: gradients, the optimizer's own state, the parameters); the others are added to it.
ESTIMATE_TRACKS = {
    "fp32 gradients": "gradients",
    "optimizer state": "optimizer_state",
    "parameters": "parameters",
}


def host_buffers(
    config: Mapping[str, Any],
    parameters: int,
    *,
    largest_parameter: int = 0,
    param_bytes: int = 4,
    optimizer_state_bytes: int = 8,
    accumulate_grad_batches: int = 1,
) -> dict[str, int]:
    """Bytes DeepSpeed allocates in host memory for a ZeRO config, by buffer (one process).

    ``parameters`` trainable elements (this process's partition), the largest of them
    ``largest_parameter`` elements, ``param_bytes`` per element on the device (4 fp32, 2 bf16),
    ``optimizer_state_bytes`` per element of optimizer state (Adam 8, Adagrad 4). Read from
    DeepSpeed 0.19's ZeRO optimizers and checked against a real CPU run's live tensors and
    resident memory (``tests/techniques/test_zero_offload.py``, ``benchmarks/zero_offload.py``).
    With optimizer offload:

    - ``"fp32 master weights"``: 4 B each, a separate fp32 copy even when training in fp32;
    - ``"fp32 gradients"``: 4 B each, the gradient partition the host step reads;
    - ``"optimizer state"``: ``optimizer_state_bytes`` each;
    - stage 2: ``"transfer buffer"`` (``param_bytes`` each: the updated weights in the device
      dtype, copied back), ``"gradient buffer"`` (one largest parameter), and with
      ``accumulate_grad_batches > 1`` ``"accumulated gradients"`` (``param_bytes`` each);
    - stage 3: ``"gradient partitions"`` (4 B each: the flat buffer the reduction writes, beside
      the fp32 gradients), and with parameter offload ``"parameters"`` (``param_bytes`` each).

    fp32 AdamW: 20 B per parameter at stage 2 (plus one parameter), 20 at stage 3, 24 with
    parameter offload. Without optimizer offload nothing is on the host (``{}``).
    DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``) give 16 or 18 B
    per parameter times an ``additional_buffer_factor`` of 1.5, an upper bound.
    """
    categories = offloaded_categories(config)
    if not categories["optimizer_state"]:
        return {}
    n = parameters
    out = {
        "fp32 master weights": 4 * n,
        "fp32 gradients": 4 * n,
        "optimizer state": optimizer_state_bytes * n,
    }
    if (config.get(_ZO) or {}).get("stage") == 3:
        out["gradient partitions"] = 4 * n
        if categories["parameters"]:
            out["parameters"] = param_bytes * n
    else:
        out["transfer buffer"] = param_bytes * n
        out["gradient buffer"] = param_bytes * largest_parameter
        if accumulate_grad_batches > 1:
            out["accumulated gradients"] = param_bytes * n
    return out


def report_text(
    stage: int, offload_optimizer: str | None, offload_parameters: bool, converted: str
) -> str:
    """The efficiency report's line for a ZeRO run (``converted``: ``"AdamW -> DeepSpeedCPUAdam"``
    or "")."""
    text = f"ZeRO stage {stage}, optimizer state on {offload_optimizer or 'device'}"
    text += ", parameters offloaded" if offload_parameters else ""
    return text + (f" ({converted})" if converted else "")


def numbered_cpu_devices(devices: list[torch.device] | None) -> list[torch.device] | None:
    """``devices`` as DeepSpeed addresses them: by index, which CPU devices do not carry, so CPU
    devices are numbered ``cpu:0``, ``cpu:1``, ...; other devices as they are."""
    if devices is not None and all(d.type == "cpu" for d in devices):
        return [torch.device("cpu", i) for i in range(len(devices))]
    return devices
