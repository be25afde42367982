"""What ``StepProfiler`` works out from the measured steps, as functions of their inputs: the
FLOPs of a step (counted once on fake tensors), the plain run's estimated peak, the memory
figures, and the summary (a plain dict) that the report, the table and the advice read; with the
small readings of the trainer they need (precision, device, active techniques)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_efficient.core.technique import ReportsCheckpointing, ReportsCompile
from lightning_efficient.core.validate import error_text
from lightning_efficient.measure.memory.breakdown import MemoryBreakdown
from lightning_efficient.measure.memory.heads import find_output_head
from lightning_efficient.measure.memory.kv_cache import cache_bytes, training_caches
from lightning_efficient.measure.profiling.advice import Findings, advise
from lightning_efficient.measure.profiling.step_phases import StepPhases
from lightning_efficient.measure.speed.flops import (
    FlopCount,
    compute_dtype,
    count_flops,
    measured_peak_flops,
    mfu,
    peak_flops,
)
from lightning_efficient.measure.speed.tokens import batch_counts

__all__ = [
    "compile_state",
    "count_step_flops",
    "example_batch",
    "first_batch_count",
    "memory_figures",
    "optimizer_of",
    "output_head",
    "plain_peak",
    "summarize",
]


# -- readings of the trainer -------------------------------------------------------------------
def precision_of(trainer: Any) -> str:
    return str(getattr(trainer, "precision", "32-true"))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def bf16_speedup(device: torch.device, precision: str) -> float | None:
    """How much faster bf16 matmuls run than fp32 ones (only asked for fp32 runs)."""
    if not precision.startswith("32"):
        return None
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            return None
        bf16, _ = peak_flops(device, "bf16")
        fp32, _ = peak_flops(device, compute_dtype(precision, device))
        return bf16 / fp32 if bf16 and fp32 else 2.0
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return measured_peak_flops("bf16", threads) / measured_peak_flops("fp32", threads)
    return None


def recompiles_of(trainer: Any) -> int | None:
    """Recompilations the trainer's techniques saw (``Technique.recompiles``), or None."""
    counts = [
        cb.recompiles
        for cb in trainer.callbacks
        if isinstance(getattr(cb, "recompiles", None), int) and not isinstance(cb.recompiles, bool)
    ]
    return sum(counts) if counts else None


def compile_state(trainer: Any) -> dict[str, Any]:
    """What the trainer's compile technique compiled (``compile_state()`` of a callback that has
    it, e.g. ``TorchCompile``): ``scope`` (``"regional"``, ``"whole"`` or None), ``mode``, and
    the steady step of each scope where ``scope="auto"`` measured them; ``{}`` without one."""
    for cb in trainer.callbacks:
        if isinstance(cb, ReportsCompile):
            return dict(cb.compile_state())
    return {}


def checkpointed_share(trainer: Any) -> float | None:
    """The share of the repeated blocks a checkpointing technique recomputes
    (``checkpoint_state()`` of a callback that has it, e.g. ``ActivationCheckpointing``);
    ``None`` without one or with no block checkpointed."""
    for cb in trainer.callbacks:
        if isinstance(cb, ReportsCheckpointing):
            figures = cb.checkpoint_state()
            blocks, total = figures.get("blocks", 0), figures.get("of", 0)
            return blocks / total if blocks and total else None
    return None


def optimizer_of(trainer: Any) -> tuple[str | None, bool | None]:
    """The first optimizer's class name and whether its step is fused (``None``: not told)."""
    optimizers = getattr(trainer, "optimizers", None) or []
    if not optimizers:
        return None, None
    opt = getattr(optimizers[0], "optimizer", optimizers[0])
    defaults = getattr(opt, "defaults", {}) or {}
    return type(opt).__name__, bool(defaults.get("fused")) if "fused" in defaults else None


def output_head(module: Any) -> tuple[int | None, int | None]:
    """A language model's ``(vocabulary, hidden size)``: its output head by the one rule
    (``measure.memory.heads.find_output_head``: a Linear as wide as the largest ``Embedding``, or
    tied to it, or a Hugging Face model's output embeddings; a classifier's few outputs are not a
    vocabulary); ``(None, None)`` otherwise."""
    head = find_output_head(module)
    if head is None:
        return None, None
    return head.linear.out_features, head.linear.in_features


def active_techniques(trainer: Any, precision: str) -> frozenset[str]:
    names = {type(cb).__name__ for cb in trainer.callbacks}
    names.add(type(trainer.strategy).__name__)
    if not precision.startswith(("32", "64")):
        names.add("precision")
    return frozenset(names)


def example_batch(trainer: Any) -> Any:
    """One training batch of the trainer's datamodule, built without worker processes."""
    from torch.utils.data import DataLoader, IterableDataset

    data = getattr(trainer, "datamodule", None)
    if data is None or not hasattr(data, "train_dataloader"):
        return None
    loader = data.train_dataloader()
    if (
        isinstance(loader, DataLoader)
        and loader.batch_size
        and not isinstance(loader.dataset, IterableDataset)
    ):
        items = [loader.dataset[i] for i in range(min(loader.batch_size, len(loader.dataset)))]
        return loader.collate_fn(items)
    return next(iter(loader))


# -- what is worked out once ---------------------------------------------------------------------
def count_step_flops(trainer: Any, pl_module: Any, batch: Any) -> tuple[FlopCount | None, str]:
    """The FLOPs of a training step on ``batch`` (fake tensors), or ``None`` and why not."""
    sharder = trainer.strategy if getattr(trainer.strategy, "shards_parameters", False) else None
    if sharder is not None:  # a fake forward would run the strategy's gather hooks on fake tensors
        name = type(sharder).__name__
        return None, (
            f"FLOPs are not counted on fake tensors when {name} shards the parameters; MFU is "
            "unknown. Pass StepProfiler(flops_per_step=...) to set them."
        )
    try:
        return count_flops(pl_module, batch, precision=precision_of(trainer)), ""
    except Exception as err:  # a model that needs real values; MFU is then unknown
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return None, (
            f"could not count FLOPs on fake tensors ({error}); MFU is unknown. "
            "Pass StepProfiler(flops_per_step=...) to set them."
        )


def first_batch_count(
    trainer: Any, pl_module: Any, batch: Any, flops: bool = True
) -> tuple[FlopCount | None, int, str]:
    """The first batch's count: its step's FLOPs (``flops=False``: not counted, given instead),
    its samples, and why the FLOPs are unknown ("" when they are known or not counted)."""
    samples = batch_counts(batch)[0]
    if not flops:
        return None, samples, ""
    count, why_not = count_step_flops(trainer, pl_module, batch)
    return count, samples, why_not


def plain_peak(trainer: Any, pl_module: Any) -> tuple[int | None, str]:
    """The estimated peak bytes of the plain run (fp32, AdamW, no techniques), or ``None`` and
    why not."""
    from lightning_efficient.measure.memory.estimate import estimate_memory

    if getattr(trainer.strategy, "shards_parameters", False):
        return (
            None,
            "compare_plain: not estimated when the strategy shards the parameters; skipped.",
        )
    try:
        batch = example_batch(trainer)
        if batch is None:
            return None, "compare_plain needs a datamodule with a train_dataloader; skipped."
        device = trainer.strategy.root_device  # its kernels, workspaces and rounding
        est = estimate_memory(pl_module, batch, optimizer="adamw", device=device)
    except Exception as err:
        return None, f"compare_plain: the plain estimate failed ({error_text(err)})."
    return int(est.peak_bytes), ""


def memory_figures(trainer: Any, device: torch.device, budget: int | None) -> dict[str, Any]:
    """This run's peak and categories (``MemoryBreakdown`` when it is on, else the CUDA
    allocator's peak) and the capacity the advice compares with (``budget``, else the GPU's)."""
    out: dict[str, Any] = {
        "peak_bytes": None,
        "by_category": None,
        "capacity_bytes": budget,
        "source": None,
    }
    breakdown = next((cb for cb in trainer.callbacks if isinstance(cb, MemoryBreakdown)), None)
    measured = breakdown.measurement if breakdown is not None else None
    if measured is not None:
        out["peak_bytes"] = int(measured.peak_bytes)
        out["by_category"] = {k: int(v) for k, v in measured.by_category.items()}
        out["source"] = f"MemoryBreakdown, step {max(breakdown.measurements)}"
    elif device.type == "cuda":
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["source"] = "CUDA allocator peak over the fit"
    if out["capacity_bytes"] is None and device.type == "cuda":
        out["capacity_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    return out


def _cache_findings(module: Any, phases: StepPhases, precision: str) -> dict[str, Any]:
    """The key/value cache a training forward builds (issue 39): the models and, from their
    configs and the tokens per micro-batch, its bytes (2 per element in a 16-bit precision)."""
    names = training_caches(module) if isinstance(module, torch.nn.Module) else []
    if not names:
        return {}
    tokens = phases.tokens // phases.batches if phases.tokens and phases.batches else 0
    first = next((p for p in module.parameters() if p.is_floating_point()), None)
    size = 2 if "16" in precision else (first.element_size() if first is not None else 4)
    return {"kv_cache": ", ".join(names), "kv_cache_bytes": cache_bytes(module, tokens, size)}


# -- the summary -------------------------------------------------------------------------------
def summarize(
    trainer: Any,
    pl_module: Any,
    phases: StepPhases,
    *,
    count: FlopCount | None,
    count_samples: int,
    flops_per_step: float | None = None,
    given_peak_flops: float | None = None,
    memory_budget: int | None = None,
    plain_peak_bytes: int | None = None,
    fetch_seen: bool = False,
) -> dict[str, Any]:
    """The profile of the measured steps as a plain dict (``phases``, ``samples_per_s``,
    ``tokens_per_s``, ``flops_per_step``, ``mfu``, ``data_wait_fraction``, ``memory``,
    ``advice``, ...). ``count``: the FLOPs of one step of ``count_samples`` samples;
    ``flops_per_step``/``given_peak_flops``: the user's figures, which take precedence."""
    device = trainer.strategy.root_device
    precision = precision_of(trainer)
    steps = phases.steps
    per_step = phases.phases()
    step_s = sum(per_step.values())
    seconds = step_s * steps
    if flops_per_step is None and count is not None and count_samples:
        flops_per_step = count.step / count_samples * (phases.samples / steps)
    if given_peak_flops is not None:
        peak, peak_source = given_peak_flops, "given (peak_flops)"
    else:
        peak, peak_source = peak_flops(device, compute_dtype(precision, device))
    achieved = flops_per_step / step_s if flops_per_step and step_s > 0 else None
    utilization = mfu(achieved, peak)
    micro = phases.batches / steps
    ops = count.ops * 3 * micro if count is not None and count.ops else None
    memory = memory_figures(trainer, device, memory_budget)
    compiled = compile_state(trainer)
    optimizer, fused = optimizer_of(trainer)
    vocab, hidden = output_head(pl_module)
    tokens_per_step = phases.tokens / steps if phases.tokens else None
    logits_share = (
        6 * vocab * hidden * tokens_per_step / flops_per_step
        if vocab and hidden and tokens_per_step and flops_per_step
        else None
    )
    steps_by_scope = {
        k: compiled[k] for k in ("regional_step_s", "whole_step_s") if compiled.get(k)
    }
    findings = Findings(
        data_wait_fraction=per_step["data"] / step_s if step_s > 0 else None,
        precision=precision,
        bf16_speedup=bf16_speedup(device, precision),
        mfu=utilization,
        seconds_per_op=(per_step["forward"] + per_step["backward"]) / ops if ops else None,
        peak_bytes=memory["peak_bytes"],
        capacity_bytes=memory["capacity_bytes"],
        by_category=memory["by_category"],
        recompiles=recompiles_of(trainer),
        active=active_techniques(trainer, precision),
        device_type=device.type,
        tf32=torch.get_float32_matmul_precision() != "highest" if device.type == "cuda" else None,
        compile_scope=compiled.get("scope"),
        compile_mode=compiled.get("mode"),
        compile_steps=steps_by_scope or None,
        optimizer=optimizer,
        fused_optimizer=fused,
        optimizer_fraction=per_step["optimizer"] / step_s if step_s > 0 else None,
        micro_batch=round(phases.samples / phases.batches) if phases.batches else None,
        accumulate=int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
        vocab_size=vocab,
        hidden_size=hidden,
        logits_flops_fraction=logits_share,
        forward_fraction=per_step["forward"] / step_s if step_s > 0 else None,
        checkpointed_share=checkpointed_share(trainer),
        **_cache_findings(pl_module, phases, precision),
    )
    tokens = phases.tokens
    return {
        "model": type(pl_module).__name__,
        "device": device_name(device),
        "precision": precision,
        "steps": steps,
        "phases": per_step,
        "step_s": step_s,
        "validation_s": phases.seconds("validation"),
        "samples_per_s": phases.samples / seconds if seconds > 0 else 0.0,
        "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
        "flops_per_step": flops_per_step,
        "flops_per_s": achieved,
        "peak_flops": peak,
        "peak_source": peak_source,
        "mfu": utilization,
        "data_wait_fraction": findings.data_wait_fraction,
        "memory": memory,
        "plain_peak_bytes": plain_peak_bytes,
        "fetch_seen": fetch_seen,
        "advice": [a.to_dict() for a in advise(findings)],
    }
