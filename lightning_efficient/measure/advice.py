"""The verdict: rules that turn a profile's measurements into advice naming a technique.

Each rule reads ``Findings`` (plain numbers measured by ``StepProfiler``, or given by hand) and
returns ``Advice``: the technique of this package to turn on, why (the measured figure and the
threshold it crossed), and the yaml lines that turn it on. ``advise(findings)`` runs the rules in
order of what to fix first (a run that waits for data gains nothing from faster kernels), and
drops advice for techniques already on (``Findings.active``: the class names of the trainer's
callbacks and strategy, plus ``"precision"`` when a low precision is already in use).

The rules are pure functions over numbers: no trainer, no torch, no import of ``techniques``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.validate import format_bytes

__all__ = [
    "Advice",
    "Findings",
    "RULES",
    "THRESHOLDS",
    "advise",
]

#: The thresholds of the rules (fractions of the step, of memory, of the peak; seconds; counts).
THRESHOLDS: dict[str, float] = {
    "data_wait": 0.10,  # share of the step spent waiting for the next batch
    "near_capacity": 0.85,  # peak memory over capacity above this: memory advice
    "headroom": 0.30,  # free memory share above this: a larger batch fits
    "bf16_gain": 1.3,  # bf16 matmuls this much faster than fp32: use bf16
    "low_mfu": 0.30,  # MFU below this ...
    "small_op_s": 20e-6,  # ... with compute seconds per operation below this: launch-bound
    "recompiles": 8,  # recompilations above this: shapes vary
}


@dataclass
class Advice:
    """One thing to turn on: a technique of this package, the measured reason, the yaml."""

    technique: str
    reason: str
    yaml: str

    def to_dict(self) -> dict[str, str]:
        return {"technique": self.technique, "reason": self.reason, "yaml": self.yaml}


@dataclass
class Findings:
    """What the rules read. Unknown figures are ``None`` and the rules that need them stay silent.

    Attributes:
        data_wait_fraction: Share of the step time spent waiting for the next batch.
        precision: The Lightning precision in use (``"32-true"``, ``"bf16-mixed"``, ...).
        bf16_speedup: How much faster bf16 matmuls run than fp32 on this device (measured on a
            CPU; from the device's capability on CUDA); ``None``: unknown.
        mfu: Model FLOPs utilization.
        seconds_per_op: Compute time (forward + backward) per operation the step runs.
        peak_bytes: Peak memory of a training step.
        capacity_bytes: Memory the run must fit in (the device's, or a budget).
        by_category: Bytes at the peak by category (``parameters``, ``gradients``,
            ``optimizer_state``, ``activations``, ``temporaries``).
        recompiles: Recompilations during the fit (``TorchCompile``).
        active: Names of what is already on (technique class names, ``"precision"``).
    """

    data_wait_fraction: float | None = None
    precision: str = "32-true"
    bf16_speedup: float | None = None
    mfu: float | None = None
    seconds_per_op: float | None = None
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    by_category: dict[str, int] | None = None
    recompiles: int | None = None
    active: frozenset[str] = field(default_factory=frozenset)


def _callback_yaml(name: str, init_args: dict[str, Any] | None = None) -> str:
    lines = ["trainer:", "  callbacks:", f"    - class_path: {name}"]
    if init_args:
        lines.append("      init_args:")
        lines += [f"        {k}: {v}" for k, v in init_args.items()]
    return "\n".join(lines)


Rule = Callable[[Findings], "list[Advice]"]
#: The rules, in the order their advice is given (what to fix first).
RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@_rule
def data_loading(f: Findings) -> list[Advice]:
    """Waiting for data above 10% of the step: load in worker processes, or preload."""
    wait = f.data_wait_fraction
    if wait is None or wait <= THRESHOLDS["data_wait"]:
        return []
    why = (
        f"{wait:.0%} of each step waits for the next batch "
        f"(above {THRESHOLDS['data_wait']:.0%}): the model idles while data loads"
    )
    return [
        Advice(
            "DataLoaderTuning",
            f"{why}; load batches in worker processes",
            _callback_yaml("DataLoaderTuning", {"num_workers": "auto"}),
        ),
        Advice(
            "DevicePreload",
            f"{why}; if the dataset fits in device memory, serve it from there",
            _callback_yaml("DevicePreload"),
        ),
    ]


def _share(f: Findings, *categories: str) -> float:
    cats = f.by_category or {}
    total = sum(cats.values())
    return sum(cats.get(c, 0) for c in categories) / total if total else 0.0


@_rule
def memory_pressure(f: Findings) -> list[Advice]:
    """Peak memory near capacity: cut what dominates the peak."""
    if not f.peak_bytes or not f.capacity_bytes:
        return []
    used = f.peak_bytes / f.capacity_bytes
    if used < THRESHOLDS["near_capacity"]:
        return []
    head = (
        f"peak memory {format_bytes(f.peak_bytes)} is {used:.0%} of "
        f"{format_bytes(f.capacity_bytes)} (above {THRESHOLDS['near_capacity']:.0%})"
    )
    checkpointing = Advice(
        "ActivationCheckpointing",
        f"{head}; activations and temporaries are "
        f"{_share(f, 'activations', 'temporaries'):.0%} of it: recompute blocks in backward",
        _callback_yaml("ActivationCheckpointing", {"policy": "auto"}),
    )
    eight_bit = Advice(
        "OptimizerSwap",
        f"{head}; optimizer state is {_share(f, 'optimizer_state'):.0%} of it: 8-bit states "
        "take a quarter of the bytes",
        _callback_yaml("OptimizerSwap", {"name": "adamw8bit"}),
    )
    zero = Advice(
        "ZeROOffload",
        f"{head}; model state (parameters, gradients, optimizer state) is "
        f"{_share(f, 'parameters', 'gradients', 'optimizer_state'):.0%} of it: keep the "
        "optimizer state in host memory",
        "trainer:\n  strategy: zero_offload",
    )
    if not f.by_category:
        return [checkpointing, eight_bit]
    activations = _share(f, "activations", "temporaries")
    if activations >= 0.5:
        return [checkpointing, eight_bit]
    if _share(f, "optimizer_state") >= _share(f, "parameters", "gradients"):
        return [eight_bit, zero]
    return [zero, eight_bit]


@_rule
def precision(f: Findings) -> list[Advice]:
    """fp32 where bf16 matmuls run faster: ``precision: auto``."""
    if not str(f.precision).startswith("32") or f.bf16_speedup is None:
        return []
    if f.bf16_speedup < THRESHOLDS["bf16_gain"]:
        return []
    return [
        Advice(
            "precision",
            f"training in fp32 where bf16 matmuls run {f.bf16_speedup:.1f}x faster: mixed "
            "precision (best_precision picks bf16-mixed here)",
            "trainer:\n  precision: auto",
        )
    ]


@_rule
def small_kernels(f: Findings) -> list[Advice]:
    """Low MFU with many short operations: launch overhead dominates; compile fuses them."""
    if f.mfu is None or f.seconds_per_op is None:
        return []
    if f.mfu >= THRESHOLDS["low_mfu"] or f.seconds_per_op >= THRESHOLDS["small_op_s"]:
        return []
    return [
        Advice(
            "TorchCompile",
            f"MFU {f.mfu:.0%} with {f.seconds_per_op * 1e6:.1f} us of compute per operation "
            f"(below {THRESHOLDS['low_mfu']:.0%} and {THRESHOLDS['small_op_s'] * 1e6:.0f} us): "
            "time goes to launching many small kernels; compiling fuses them",
            _callback_yaml("TorchCompile"),
        )
    ]


@_rule
def recompilations(f: Findings) -> list[Advice]:
    """Many recompilations: batch shapes vary; bucket lengths to a few shapes."""
    if f.recompiles is None or f.recompiles <= THRESHOLDS["recompiles"]:
        return []
    return [
        Advice(
            "LengthBucketSampler",
            f"{f.recompiles} recompilations (above {THRESHOLDS['recompiles']:.0f}): batch shapes "
            "vary; batch samples of similar length (and pad to a few lengths), or compile "
            "with dynamic shapes",
            "# in the DataModule: DataLoader(dataset, batch_size=B,\n"
            "#     sampler=LengthBucketSampler(lengths, bucket_size=50 * B))\n"
            "# or: TorchCompile init_args: {dynamic: true}",
        )
    ]


@_rule
def headroom(f: Findings) -> list[Advice]:
    """More than 30% of memory free: a larger micro-batch fits (and usually runs faster)."""
    if not f.peak_bytes or not f.capacity_bytes:
        return []
    free = 1 - f.peak_bytes / f.capacity_bytes
    if free <= THRESHOLDS["headroom"]:
        return []
    return [
        Advice(
            "EfficientBatchSize",
            f"{free:.0%} of {format_bytes(f.capacity_bytes)} is free at the peak (above "
            f"{THRESHOLDS['headroom']:.0%}): the largest micro-batch that fits uses the device "
            "better",
            _callback_yaml("EfficientBatchSize"),
        )
    ]


def advise(findings: Findings) -> list[Advice]:
    """Every rule's advice, first things first, without techniques already on (one entry per
    technique: the first reason given wins)."""
    out: list[Advice] = []
    seen = set(findings.active)
    for rule in RULES:
        for advice in rule(findings):
            if advice.technique not in seen:
                seen.add(advice.technique)
                out.append(advice)
    return out
