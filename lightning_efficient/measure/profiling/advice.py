"""The verdict: rules that turn a profile's measurements into advice naming a technique.

Each rule reads ``Findings`` (plain numbers measured by ``StepProfiler``, or given by hand, e.g.
a recorded GPU profile) and returns ``Advice``: the technique of this package to turn on (and
the setting, where the technique is on but set otherwise), why (the measured figure and the
threshold it crossed), the yaml lines that turn it on, and the gain to expect (from this run's
figures where they say it, else from a record that is named). ``advise(findings)`` runs the
rules in order of what to fix first (a run that waits for data gains nothing from faster
kernels), and drops advice for techniques already on (``Findings.active``: the class names of
the trainer's callbacks and strategy, plus ``"precision"`` when a low precision is already in
use), unless the advice is a setting of it (``TorchCompile`` with ``scope: whole``).

The GPU speed levers (issue 29), in order: bf16-mixed precision and TF32, whole-model compile
where compile is regional or off, a fused AdamW step, CUDA graphs where the host's launches
dominate, a larger micro-batch (the effective batch kept by accumulation), the loss without the
full logits where the vocabulary is wide, sizes that are multiples of 64.

The rules are pure functions over numbers: no trainer, no torch, no import of ``techniques``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.stack import Stack, spec
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
    "recompute_used": 0.50,  # blocks checkpointed with the peak below this share of capacity
    "bf16_gain": 1.3,  # bf16 matmuls this much faster than fp32: use bf16
    "low_mfu": 0.30,  # MFU below this ...
    "small_op_s": 20e-6,  # ... with compute seconds per operation below this: launch-bound
    "recompiles": 8,  # recompilations above this: shapes vary
    "whole_faster": 1.03,  # whole-model compile this much faster than regional: advise it
    "wide_vocab": 8192,  # a vocabulary at least this wide ...
    "logits_flops": 0.15,  # ... whose head is this share of the step's FLOPs: chunk the loss
}

#: Figures recorded on a GPU that the advice quotes where this run does not measure the gain
#: (issue 29: an NVIDIA H200, torch 2.11.0+cu130, TinyGPT at GPT-2 124M shape, batch 8 x 1024;
#: ``benchmarks/recorded/h200_speed_2026-12-04.json``).
RECORDED = {
    "source": "issue 29's H200 record",
    "regional_vs_eager": 1.05,
    "whole_vs_eager": 1.54,
    "stack_vs_plain": 4.28,  # bf16-mixed + TF32 + regional compile + fused AdamW + loader tuning
}


@dataclass
class Advice:
    """One thing to turn on: a technique of this package (``setting``: how, where the technique
    may already be on but set otherwise), the measured reason, the yaml, the expected gain."""

    technique: str
    reason: str
    yaml: str
    gain: str = ""
    setting: str = ""

    @property
    def lever(self) -> str:
        return f"{self.technique} ({self.setting})" if self.setting else self.technique

    def to_dict(self) -> dict[str, str]:
        return {
            "technique": self.technique,
            "setting": self.setting,
            "lever": self.lever,
            "reason": self.reason,
            "yaml": self.yaml,
            "gain": self.gain,
        }


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
        device_type: ``"cuda"`` or ``"cpu"`` (the GPU levers apply on CUDA).
        tf32: float32 matrix products may use TF32 (``torch.get_float32_matmul_precision()``
            is not ``"highest"``); ``None``: unknown.
        compile_scope: ``None`` (not compiled), ``"regional"`` or ``"whole"``.
        compile_mode: ``TorchCompile``'s mode (``"reduce-overhead"``: CUDA graphs).
        compile_steps: Steady step seconds of each scope, measured by
            ``TorchCompile(scope="auto")`` (``regional_step_s``, ``whole_step_s``).
        optimizer: The optimizer's class name; ``fused_optimizer``: whether its step is fused.
        optimizer_fraction: Share of the step in the optimizer phase.
        micro_batch: Samples per micro-batch; ``accumulate``: micro-batches per optimizer step.
        vocab_size, hidden_size: The output head's width and its input width (a language
            model's vocabulary and hidden size), when the model has such a head.
        logits_flops_fraction: Share of the step's FLOPs in that head.
        forward_fraction: Share of the step in the forward phase.
        checkpointed_share: Share of the model's repeated blocks that activation checkpointing
            recomputes in backward (``None``: no checkpointing).
        kv_cache: The Hugging Face models that build a key/value cache while training;
            ``kv_cache_bytes``: its keys and values per micro-batch, where the config says.
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
    device_type: str = "cpu"
    tf32: bool | None = None
    compile_scope: str | None = None
    compile_mode: str | None = None
    compile_steps: dict[str, float] | None = None
    optimizer: str | None = None
    fused_optimizer: bool | None = None
    optimizer_fraction: float | None = None
    micro_batch: int | None = None
    accumulate: int = 1
    vocab_size: int | None = None
    hidden_size: int | None = None
    logits_flops_fraction: float | None = None
    forward_fraction: float | None = None
    checkpointed_share: float | None = None
    kv_cache: str | None = None
    kv_cache_bytes: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device_type == "cuda"

    @classmethod
    def from_dict(cls, figures: dict[str, Any]) -> Findings:
        """Findings from plain figures (a recorded profile's ``findings``); unknown keys are an
        error, missing ones stay unknown."""
        names = set(cls.__dataclass_fields__)
        extra = sorted(set(figures) - names)
        if extra:
            raise ValueError(f"unknown Findings fields {extra}; known: {sorted(names)}.")
        values = dict(figures)
        if "active" in values:
            values["active"] = frozenset(values["active"])
        return cls(**values)


def _callback_yaml(name: str, init_args: dict[str, Any] | None = None) -> str:
    return _yaml(Stack(callbacks=[spec(name, init_args)]))


def _yaml(stack: Stack) -> str:
    """The advice's yaml: :meth:`Stack.to_yaml` (the planner's and AutoEfficient's writer)."""
    return stack.to_yaml().rstrip("\n")


Rule = Callable[[Findings], "list[Advice]"]
#: The rules, in the order their advice is given (what to fix first).
RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


@_rule
def data_loading(f: Findings) -> list[Advice]:
    """Waiting for data above 10% of the step: load in worker processes (pinned memory, so the
    copy to the GPU is asynchronous), or preload."""
    wait = f.data_wait_fraction
    if wait is None or wait <= THRESHOLDS["data_wait"]:
        return []
    why = (
        f"{wait:.0%} of each step waits for the next batch "
        f"(above {THRESHOLDS['data_wait']:.0%}): the model idles while data loads"
    )
    gain = f"up to {1 / (1 - wait):.2f}x (the {wait:.0%} of the step spent waiting)"
    pinned = (
        "; pinned host memory makes the copy to the GPU asynchronous (non-blocking)"
        if f.cuda
        else ""
    )
    return [
        Advice(
            "DataLoaderTuning",
            f"{why}; load batches in worker processes{pinned}",
            _callback_yaml(
                "DataLoaderTuning",
                {"num_workers": "auto", "pin_memory": "auto"}
                if f.cuda
                else {"num_workers": "auto"},
            ),
            gain,
        ),
        Advice(
            "DevicePreload",
            f"{why}; if the dataset fits in device memory, serve it from there",
            _callback_yaml("DevicePreload"),
            gain,
        ),
    ]


def _share(f: Findings, *categories: str) -> float:
    cats = f.by_category or {}
    total = sum(cats.values())
    return sum(cats.get(c, 0) for c in categories) / total if total else 0.0


@_rule
def key_value_cache(f: Findings) -> list[Advice]:
    """A key/value cache built in every training forward (``config.use_cache=True``), never read."""
    if not f.kv_cache:
        return []
    size = f"; {format_bytes(f.kv_cache_bytes)} of keys and values" if f.kv_cache_bytes else ""
    size += f", {f.kv_cache_bytes / f.peak_bytes:.0%} of the peak" if size and f.peak_bytes else ""
    fix = "ActivationCheckpointing, ChunkedCrossEntropy, FrozenWeights4bit and AutoEfficient"
    reason = f"{f.kv_cache} builds a key/value cache in every training forward, never read{size}"
    yaml = f"# {fix} switch it off for training;\n# or before fit: model.config.use_cache = False"
    return [Advice("use_cache=False", reason, yaml, "the cache's memory freed; the same loss")]


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
        "room below the capacity (most of the activations freed), at about a third more compute",
    )
    eight_bit = Advice(
        "OptimizerSwap",
        f"{head}; optimizer state is {_share(f, 'optimizer_state'):.0%} of it: 8-bit states "
        "take a quarter of the bytes",
        _callback_yaml("OptimizerSwap", {"name": "adamw8bit"}),
        "three quarters of the optimizer state freed",
    )
    zero = Advice(
        "ZeROOffload",
        f"{head}; model state (parameters, gradients, optimizer state) is "
        f"{_share(f, 'parameters', 'gradients', 'optimizer_state'):.0%} of it: keep the "
        "optimizer state in host memory",
        _yaml(Stack(strategy="zero_offload")),
        "the optimizer state moves to host memory",
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
def needless_recompute(f: Findings) -> list[Advice]:
    """Blocks checkpointed while the peak is far below capacity: the recompute buys memory the
    run does not need. ``ActivationCheckpointing(budget=...)`` checkpoints only the blocks the
    budget needs (none where the plain run fits)."""
    share, forward = f.checkpointed_share, f.forward_fraction
    if not share or forward is None or not f.peak_bytes or not f.capacity_bytes:
        return []
    used = f.peak_bytes / f.capacity_bytes
    if used >= THRESHOLDS["recompute_used"]:
        return []
    recompute = share * forward  # the checkpointed blocks' forward, run again in backward
    capacity = format_bytes(f.capacity_bytes).replace(" ", "")
    return [
        Advice(
            "ActivationCheckpointing",
            f"{share:.0%} of the blocks are recomputed in backward while the peak "
            f"{format_bytes(f.peak_bytes)} is {used:.0%} of {format_bytes(f.capacity_bytes)} "
            f"(below {THRESHOLDS['recompute_used']:.0%}): the recompute buys memory this run "
            "does not need; with a budget only the blocks it needs are checkpointed",
            _callback_yaml("ActivationCheckpointing", {"budget": capacity}),
            f"up to {1 / (1 - recompute):.2f}x (the checkpointed blocks' forward, about "
            f"{recompute:.0%} of the step, is no longer run twice)",
            f"budget: {capacity}",
        )
    ]


@_rule
def precision(f: Findings) -> list[Advice]:
    """fp32 where bf16 matmuls run faster: ``precision: auto`` (bf16-mixed)."""
    if not str(f.precision).startswith("32") or f.bf16_speedup is None:
        return []
    if f.bf16_speedup < THRESHOLDS["bf16_gain"]:
        return []
    gain = f"up to {f.bf16_speedup:.1f}x on the matrix products (bf16 peak over this run's)"
    if f.cuda:
        gain += (
            f"; with TF32, compile and a fused AdamW, {RECORDED['stack_vs_plain']:.2f}x "
            f"tokens/s in {RECORDED['source']}"
        )
    return [
        Advice(
            "precision",
            f"training in fp32 where bf16 matmuls run {f.bf16_speedup:.1f}x faster: mixed "
            "precision (best_precision picks bf16-mixed here)",
            _yaml(Stack(precision="auto")),
            gain,
        )
    ]


@_rule
def tf32(f: Findings) -> list[Advice]:
    """On CUDA, fp32 matrix products without TF32: ``MatmulPrecision("high")``."""
    if not f.cuda or f.tf32 is not False:
        return []
    what = "the fp32 run's" if str(f.precision).startswith("32") else "what stays fp32 under mixed"
    return [
        Advice(
            "MatmulPrecision",
            f"float32 matrix products run at full fp32 (no TF32): {what} precision matrix "
            "products use the tensor cores with TF32",
            _callback_yaml("MatmulPrecision", {"level": "high"}),
            "up to 7.4x on the fp32 matrix products (TF32 over fp32 peak on an H100/H200 SXM: "
            "494.7 / 66.9 TFLOP/s)",
        )
    ]


@_rule
def whole_compile(f: Findings) -> list[Advice]:
    """Compile regional or off where the whole model runs faster: ``scope: whole`` (on CUDA; on
    a CPU when ``TorchCompile(scope="auto")`` measured it faster)."""
    steps = f.compile_steps or {}
    regional, whole = steps.get("regional_step_s"), steps.get("whole_step_s")
    measured = regional / whole if regional and whole else None
    if f.compile_scope == "whole" or (f.compile_scope is None and not f.cuda):
        return []  # a CPU without compile: small_kernels says it, by its own measure
    if measured is not None and measured <= THRESHOLDS["whole_faster"]:
        return []
    if measured is None and not f.cuda:
        return []
    if measured is not None:
        gain = (
            f"{measured:.2f}x (steady step measured: regional {regional * 1e3:.1f} ms, whole "
            f"model {whole * 1e3:.1f} ms)"
        )
    elif f.compile_scope == "regional":
        ratio = RECORDED["whole_vs_eager"] / RECORDED["regional_vs_eager"]
        gain = (
            f"about {ratio:.2f}x ({RECORDED['source']}: whole {RECORDED['whole_vs_eager']:.2f}x "
            f"eager, regional {RECORDED['regional_vs_eager']:.2f}x)"
        )
    else:
        gain = f"about {RECORDED['whole_vs_eager']:.2f}x over eager ({RECORDED['source']})"
    now = "regional compile" if f.compile_scope == "regional" else "no compile"
    return [
        Advice(
            "TorchCompile",
            f"{now} on a GPU: whole-model compile fuses across the blocks and runs one graph "
            "per direction (at about twice regional's compile time); scope auto times both on "
            "the device and keeps the faster",
            _callback_yaml("TorchCompile", {"scope": "auto"}),
            gain,
            "scope: whole",
        )
    ]


@_rule
def small_kernels(f: Findings) -> list[Advice]:
    """Low MFU with many short operations: launch overhead dominates; compile fuses them (when
    nothing is compiled yet; else ``cuda_graphs``)."""
    if f.mfu is None or f.seconds_per_op is None or f.compile_scope is not None:
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
            "fewer, fused kernels: the launch time saved",
        )
    ]


_ADAM = ("Adam", "AdamW")


@_rule
def fused_optimizer(f: Findings) -> list[Advice]:
    """On CUDA, an Adam/AdamW step that is not fused: ``OptimizerSwap("adamw_fused")``."""
    if not f.cuda or f.optimizer not in _ADAM or f.fused_optimizer is not False:
        return []
    share = f.optimizer_fraction
    gain = (
        f"most of the optimizer phase, {share:.0%} of the step"
        if share is not None
        else "most of the optimizer phase (a few fused kernels instead of several per tensor)"
    )
    return [
        Advice(
            "OptimizerSwap",
            f"{f.optimizer} steps without fused kernels: the fused step updates every parameter "
            "in a few kernels",
            _callback_yaml("OptimizerSwap", {"name": "adamw_fused"}),
            gain,
            "name: adamw_fused",
        )
    ]


@_rule
def cuda_graphs(f: Findings) -> list[Advice]:
    """On CUDA, compiled but still launch-bound: CUDA graphs (``mode: reduce-overhead``)."""
    if not f.cuda or f.compile_scope is None or f.compile_mode == "reduce-overhead":
        return []
    if f.mfu is None or f.seconds_per_op is None:
        return []
    if f.mfu >= THRESHOLDS["low_mfu"] or f.seconds_per_op >= THRESHOLDS["small_op_s"]:
        return []
    return [
        Advice(
            "TorchCompile",
            f"compiled, yet {f.seconds_per_op * 1e6:.1f} us of compute per operation at MFU "
            f"{f.mfu:.0%}: the host's kernel launches set the pace; CUDA graphs replay the "
            "step's kernels in one launch (static shapes needed)",
            _callback_yaml("TorchCompile", {"scope": "whole", "mode": "reduce-overhead"}),
            "the launch time of the step's kernels (the device runs back to back)",
            "mode: reduce-overhead",
        )
    ]


@_rule
def gpu_batch(f: Findings) -> list[Advice]:
    """On CUDA, low MFU with memory to spare (or unknown): a larger micro-batch, the effective
    batch kept by gradient accumulation (``EfficientBatchSize``)."""
    if not f.cuda or f.mfu is None or f.mfu >= THRESHOLDS["low_mfu"]:
        return []
    free = 1 - f.peak_bytes / f.capacity_bytes if f.peak_bytes and f.capacity_bytes else None
    if free is not None and free <= THRESHOLDS["headroom"]:
        return []
    effective = f.micro_batch * f.accumulate if f.micro_batch else None
    room = f"{free:.0%} of memory free" if free is not None else "memory to spare"
    batch = f"micro-batch {f.micro_batch}, " if f.micro_batch else ""
    init = {"target_batch_size": effective} if effective else {}
    return [
        Advice(
            "EfficientBatchSize",
            f"MFU {f.mfu:.0%} ({batch}{room}): small matrix products leave the GPU under-filled; "
            "the largest micro-batch that fits, with gradient accumulation keeping the "
            "effective batch"
            + (f" ({effective} samples; raise target_batch_size to grow it)" if effective else ""),
            _callback_yaml("EfficientBatchSize", init),
            "more tokens per kernel launch and per optimizer step; the same maths per effective "
            "batch (measured per device by part 5 of benchmarks/gpu/suite.py)",
        )
    ]


@_rule
def chunked_loss(f: Findings) -> list[Advice]:
    """A wide vocabulary whose head is a large share of the step: the loss without the full
    logits (``ChunkedCrossEntropy``)."""
    if not f.vocab_size or f.vocab_size < THRESHOLDS["wide_vocab"]:
        return []
    share = f.logits_flops_fraction
    if share is None or share < THRESHOLDS["logits_flops"]:
        return []
    tokens = f"{f.micro_batch} x seq x {f.vocab_size}" if f.micro_batch else f"{f.vocab_size}-wide"
    return [
        Advice(
            "ChunkedCrossEntropy",
            f"the output head ({f.vocab_size} wide) is {share:.0%} of the step's FLOPs: its "
            f"{tokens} logits (and their fp32 copy in the loss) are among the largest tensors "
            "of the step; chunked, the loss never holds them whole",
            _callback_yaml("ChunkedCrossEntropy"),
            "the full logits' memory freed: room for a larger micro-batch (same loss)",
        )
    ]


@_rule
def multiple_of_64(f: Findings) -> list[Advice]:
    """On CUDA, a vocabulary or hidden size that is not a multiple of 64: tensor-core tiles run
    partly empty (advice: a model setting, no technique of this package changes it)."""
    if not f.cuda:
        return []
    odd = {n: v for n, v in (("vocab_size", f.vocab_size), ("hidden_size", f.hidden_size)) if v}
    odd = {n: v for n, v in odd.items() if v % 64}
    if not odd:
        return []
    padded = {n: -(-v // 64) * 64 for n, v in odd.items()}
    return [
        Advice(
            "multiple of 64",
            ", ".join(f"{n} {v}" for n, v in odd.items())
            + " is not a multiple of 64: the matrix products on it use partial tensor-core tiles;"
            " pad it (the extra vocabulary rows are never targets, so the loss is unchanged)",
            "# in the model's config (a model setting, not a callback):\n"
            + "\n".join(f"#   {n}: {padded[n]}  # {odd[n]} rounded up to 64" for n in odd),
            "a few percent on the head's matrix products (not measured here)",
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
            "a full compile saved per new shape",
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
            "more samples per step in the same memory",
        )
    ]


def advise(findings: Findings) -> list[Advice]:
    """Every rule's advice, first things first, without techniques already on (unless the
    advice is a setting of one, ``Advice.setting``, which its rule checks) and one entry per
    lever (the first reason given wins; a technique advised as such takes no settings after)."""
    out: list[Advice] = []
    given: dict[str, set[str]] = {}  # technique -> settings advised ("": the technique itself)
    for rule in RULES:
        for advice in rule(findings):
            if advice.technique in findings.active and not advice.setting:
                continue
            settings = given.setdefault(advice.technique, set())
            if "" in settings or advice.setting in settings or (settings and not advice.setting):
                continue
            settings.add(advice.setting)
            out.append(advice)
    return out
