"""FLOPs of a training step, the device's peak FLOP/s, and model FLOPs utilization (MFU).

- ``count_flops(model, batch)`` runs the forward of one training step (the LightningModule's
  ``training_step``, or ``loss_fn(model, batch)``: ``measure.step.run_step``) on *fake* tensors
  (the instrument's ``measure.memory.estimate.faked``: no data, no allocation, nothing trained,
  the module put back by ``measure.scratch.scratch``) under
  ``torch.utils.flop_counter.FlopCounterMode``, and returns the step's *model FLOPs*: three times
  the forward (backward = 2 x forward, the convention of the PaLM paper's MFU). A forward that
  activation checkpointing re-runs during backward is not counted (hardware FLOPs would count
  it). Only the operations ``FlopCounterMode`` knows are counted: matrix products, convolutions
  and attention (run as matrix products while counting), which is where a network's FLOPs are.
- ``peak_flops(device, dtype)`` is the dense peak of a GPU from ``GPU_PEAKS`` (NVIDIA's
  datasheets and architecture whitepapers, sparsity not counted), or, for a CPU, the matmul
  throughput measured once per process (``measured_peak_flops``).
- ``mfu(flops_per_s, peak)`` is their ratio; ``compute_dtype(precision)`` names the dtype whose
  peak applies to a Lightning precision.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_efficient.core.validate import check_module
from lightning_efficient.measure.memory.estimate import faked
from lightning_efficient.measure.memory.track import StorageTracker
from lightning_efficient.measure.step import loss_of, run_step

__all__ = [
    "GPU_PEAKS",
    "FlopCount",
    "compute_dtype",
    "count_flops",
    "gpu_peak",
    "measured_peak_flops",
    "mfu",
    "peak_flops",
]

#: Dense peak TFLOP/s of NVIDIA GPUs by compute dtype (tensor cores; "fp32" is the non-tensor
#: rate; "tf32" is float32 matmuls with TF32 allowed). Sparsity ("2:4") figures are halved.
#: GeForce cards are listed at their FP32-accumulate tensor rate, which is what PyTorch uses.
#: Sources: the datasheets and whitepapers named in ``GPU_SOURCES`` (docs/profiling.md).
GPU_PEAKS: dict[str, dict[str, float]] = {
    "GB200": {"fp32": 80, "tf32": 1250, "bf16": 2500, "fp16": 2500, "fp8": 5000},
    "B200": {"fp32": 75, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500},
    "H200 NVL": {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H100 NVL": {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378, "bf16": 756.5, "fp16": 756.5, "fp8": 1513},
    "H100 SXM": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "A100": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
    "A40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    "A30": {"fp32": 10.3, "tf32": 82, "bf16": 165, "fp16": 165},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
    "L40S": {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
    "L40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181, "fp16": 181, "fp8": 362},
    "L4": {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5},
    "V100 SXM2": {"fp32": 15.7, "fp16": 125},
    "V100 PCIe": {"fp32": 14, "fp16": 112},
    "T4": {"fp32": 8.1, "fp16": 65},
    "RTX 6000 Ada": {"fp32": 91.1, "tf32": 182.1, "bf16": 364.2, "fp16": 364.2, "fp8": 728.5},
    "RTX A6000": {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8},
    "RTX 5090": {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
    "RTX 4080": {"fp32": 48.7, "tf32": 48.7, "bf16": 97.5, "fp16": 97.5, "fp8": 194.9},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
    "RTX 3080": {"fp32": 29.8, "tf32": 29.8, "bf16": 59.5, "fp16": 59.5},
}

#: Where each row of ``GPU_PEAKS`` comes from.
GPU_SOURCES: dict[str, str] = {
    "GB200": "NVIDIA GB200 NVL72 datasheet (per GPU, sparse figures halved)",
    "B200": "NVIDIA HGX B200 datasheet (per GPU, 1000 W, sparse figures halved)",
    "H200 NVL": "NVIDIA H200 datasheet (NVL column, sparse figures halved)",
    "H200 SXM": "NVIDIA H200 datasheet (SXM column, sparse figures halved)",
    "H100 NVL": "NVIDIA H100 datasheet (NVL column, per GPU, sparse figures halved)",
    "H100 PCIe": "NVIDIA H100 datasheet (PCIe column, sparse figures halved)",
    "H100 SXM": "NVIDIA H100 datasheet (SXM column, sparse figures halved)",
    "A100": "NVIDIA A100 datasheet (SXM and PCIe are equal; dense)",
    "A40": "NVIDIA A40 datasheet (sparse figures halved)",
    "A30": "NVIDIA A30 datasheet (sparse figures halved)",
    "A10": "NVIDIA A10 datasheet (sparse figures halved)",
    "L40S": "NVIDIA L40S datasheet (sparse figures halved)",
    "L40": "NVIDIA L40 datasheet (sparse figures halved)",
    "L4": "NVIDIA L4 datasheet (sparse figures halved)",
    "V100 SXM2": "NVIDIA V100 datasheet (tensor FP16)",
    "V100 PCIe": "NVIDIA V100 datasheet (tensor FP16)",
    "T4": "NVIDIA T4 datasheet (tensor FP16)",
    "RTX 6000 Ada": "NVIDIA RTX 6000 Ada datasheet / Ada architecture whitepaper",
    "RTX A6000": "NVIDIA Ampere GA102 architecture whitepaper (RTX A6000)",
    "RTX 5090": "NVIDIA RTX Blackwell architecture whitepaper (FP32 accumulate)",
    "RTX 4090": "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate)",
    "RTX 4080": "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate)",
    "RTX 3090": "NVIDIA Ampere GA102 architecture whitepaper (FP32 accumulate)",
    "RTX 3080": "NVIDIA Ampere GA102 architecture whitepaper (FP32 accumulate)",
}

# device name (torch.cuda.get_device_name, lower case) -> GPU_PEAKS key; first match wins
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gb200", "GB200"),
    (r"\bb200", "B200"),
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200 SXM"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"a100", "A100"),
    (r"\ba40\b", "A40"),
    (r"\ba30\b", "A30"),
    (r"\ba10\b", "A10"),
    (r"l40s", "L40S"),
    (r"\bl40\b", "L40"),
    (r"\bl4\b", "L4"),
    (r"v100.*pcie", "V100 PCIe"),
    (r"v100", "V100 SXM2"),
    (r"\bt4\b", "T4"),
    (r"rtx 6000 ada", "RTX 6000 Ada"),
    (r"rtx a6000", "RTX A6000"),
    (r"rtx 5090", "RTX 5090"),
    (r"rtx 4090", "RTX 4090"),
    (r"rtx 4080(?! super)", "RTX 4080"),
    (r"rtx 3090(?! ti)", "RTX 3090"),
    (r"rtx 3080(?! ti)", "RTX 3080"),
)

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def gpu_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """``(peak FLOP/s, source)`` of a GPU by its name (``torch.cuda.get_device_name``) for
    ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``), or ``None`` when the
    GPU or the dtype is not in ``GPU_PEAKS`` (e.g. bf16 on a T4)."""
    name = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            tflops = GPU_PEAKS[key].get(dtype)
            if tflops is None:
                return None
            return tflops * 1e12, f"{key} {dtype} dense, {GPU_SOURCES[key]}"
    return None


def compute_dtype(precision: Any, device: torch.device | str = "cpu") -> str:
    """The dtype whose peak applies to a Lightning precision on ``device``: ``"fp32"`` (or
    ``"tf32"`` on CUDA when ``torch.get_float32_matmul_precision()`` allows it), ``"bf16"``,
    ``"fp16"``, or ``"fp8"`` (transformer-engine precisions)."""
    p = str(precision)
    if p.startswith("transformer-engine"):
        return "fp8"
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if torch.device(device).type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


@functools.cache
def measured_peak_flops(dtype: str = "fp32", threads: int | None = None) -> float:
    """FLOP/s of a 1024 x 1024 matrix product in ``dtype`` on this CPU, measured once per process
    and thread count: the CPU's practical peak.

    Measured warm and taken at its fastest: products run for at least 0.2 s first (caches,
    thread pool, clock ramp-up), then the fastest of 7 timed products is the peak. (A cold
    median undershot the peak on a loaded machine, and a run's MFU then passed 100%.)

    A dtype other than fp32 is first tried at 256 x 256; when that shows no hardware support
    (bf16 on a CPU without AVX512-BF16/AMX runs ~50x slower than fp32), the small product's
    figure is returned instead of spending seconds on the large one. ``threads`` is only the
    cache key (default: ``torch.get_num_threads()``).
    """
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"`dtype` must be one of 'fp32', 'bf16', 'fp16'; got {dtype!r}.")

    def fastest(size: int, warm_s: float, repeats: int) -> tuple[float, float]:
        a = torch.ones(size, size, dtype=torch_dtype)
        b = torch.ones(size, size, dtype=torch_dtype)
        start = time.perf_counter()
        torch.mm(a, b)
        while time.perf_counter() - start < warm_s:
            torch.mm(a, b)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        best = max(best, 1e-9)
        return 2.0 * size**3 / best, best

    if dtype != "fp32":
        flops, seconds = fastest(256, warm_s=0.0, repeats=1)
        if seconds * 64 > 0.25:  # a 1024 product would take more than a quarter second
            return flops
    return fastest(1024, warm_s=0.2, repeats=7)[0]


def peak_flops(device: torch.device | str, dtype: str) -> tuple[float | None, str]:
    """``(peak FLOP/s or None, source)`` of ``device`` for ``dtype``: the table for a CUDA device,
    a measured matmul for the CPU (``measured_peak_flops``)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        found = gpu_peak(name, dtype)
        if found is None:
            return None, f"no {dtype} peak known for {name!r} (pass peak_flops=...)"
        return found
    if dev.type == "cpu":
        if dtype not in ("fp32", "bf16", "fp16"):
            return None, f"no {dtype} matmul on a CPU"
        flops = measured_peak_flops(dtype, torch.get_num_threads())
        threads = torch.get_num_threads()
        return flops, f"measured: {dtype} matmul on this CPU, {threads} threads"
    return None, f"no peak known for device type {dev.type!r} (pass peak_flops=...)"


def mfu(flops_per_s: float | None, peak: float | None) -> float | None:
    """Achieved over peak FLOP/s, or ``None`` when either is unknown."""
    if not flops_per_s or not peak:
        return None
    return flops_per_s / peak


# -- counting ------------------------------------------------------------------------------------
@dataclass
class FlopCount:
    """What ``count_flops`` found for one batch.

    Attributes:
        forward: FLOPs of one forward (the training step's, up to the loss).
        step: Model FLOPs of a training step on this batch: ``3 * forward``.
        ops: Storages the forward allocates (operations that produce new data; views and
            in-place operations not counted): a proxy for the kernels a step launches.
        by_op: FLOPs of the forward by operator name.
    """

    forward: int
    step: int
    ops: int
    by_op: dict[str, int]


def count_flops(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    precision: str = "32-true",
) -> FlopCount:
    """Model FLOPs of one training step of ``model`` on ``batch``, counted on fake tensors.

    Args:
        model: A LightningModule (its ``training_step`` runs, ``self.log`` silenced) or a plain
            module with ``loss_fn``. It is restored unchanged; nothing is allocated or trained.
        batch: An example batch (real or meta tensors; only shapes and dtypes are used).
        loss_fn: ``loss_fn(model, batch) -> loss`` for a plain ``nn.Module``.
        precision: ``"bf16-true"`` makes weights bf16 (the count does not depend on dtype).

    Raises ``TypeError`` for a plain module without ``loss_fn``; whatever the model raises on fake
    tensors otherwise (``measure.memory.estimate.explain_fake_failure`` turns that into advice).
    """
    from torch.utils.flop_counter import FlopCounterMode

    check_module("model", model)
    if loss_fn is None and not hasattr(model, "training_step"):
        raise TypeError(
            "`loss_fn` is required for a plain nn.Module (loss_fn(model, batch) -> loss); a "
            "LightningModule's training_step is used when loss_fn is None."
        )
    counter = FlopCounterMode(display=False)
    tracker = StorageTracker(fake=True)  # counts the storages the forward allocates
    with contextlib.ExitStack() as stack:
        if hasattr(torch.compiler, "set_stance"):  # compiled regions run eagerly on fake tensors
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        # attention as matrix products: FlopCounterMode has no formula for some fused kernels
        # (the CPU flash kernel), and the fused ones count the same full QK^T and AV products
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        fake = stack.enter_context(faked(model, batch, precision))  # put back by its scratch
        with counter, tracker:
            loss_of(run_step(model, fake, loss_fn))
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    forward = int(counter.get_total_flops())
    return FlopCount(forward=forward, step=3 * forward, ops=tracker.allocations, by_op=by_op)
