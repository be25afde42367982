"""The one place for compatibility rules between techniques, strategies and the trainer.

A rule is a function ``rule(trainer, techniques) -> str | None`` registered with ``@rule``; it
returns a message saying what conflicts and what to do instead, or ``None``. ``check(trainer,
techniques)`` runs every rule once per fit (the first technique's ``setup`` calls it) and raises
one ``ValueError`` listing every conflict found.

Rules never look at a technique's class name or private state: they read what each technique
declares (``Technique.sets_accumulation``, ``steps_in_backward``, ... in
:mod:`lightning_efficient.core.technique`), and they read the *intended* settings, so a rule also
holds for a setting that another technique changes only later in the fit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from lightning_efficient.core.validate import SettingsError

__all__ = ["RULES", "check", "rule", "keyed_by_class", "stateful_twice"]

Rule = Callable[[Any, Sequence[Any]], "str | None"]
RULES: list[Rule] = []
_checked: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def rule(fn: Rule) -> Rule:
    """Register a compatibility rule."""
    RULES.append(fn)
    return fn


def check(trainer: Any, techniques: Sequence[Any]) -> None:
    """Run every rule once per trainer and set of techniques; raise one ValueError listing all
    conflicts found."""
    key = tuple(id(t) for t in techniques)
    if _checked.get(trainer) == key:
        return
    problems = [msg for fn in RULES if (msg := fn(trainer, techniques))]
    if problems:
        raise SettingsError("Incompatible settings:\n- " + "\n- ".join(problems))
    _checked[trainer] = key


def _names(techniques: Sequence[Any]) -> str:
    return ", ".join(type(t).__name__ for t in techniques)


def keyed_by_class(cls: type) -> bool:
    """A callback class that keeps state in checkpoints (``state_dict``) under Lightning's default
    ``state_key``, its class name: every instance of it uses the same key."""
    from lightning.pytorch import Callback

    return (
        isinstance(cls, type)
        and issubclass(cls, Callback)
        and cls.state_dict is not Callback.state_dict
        and cls.state_key is Callback.state_key
    )


def stateful_twice(classes: Sequence[type]) -> str | None:
    """The message for stateful callback classes without a ``state_key`` of their own that are
    given more than once (``None``: none is)."""
    counts: dict[type, int] = {}
    for cls in classes:
        if keyed_by_class(cls):
            counts[cls] = counts.get(cls, 0) + 1
    doubled = [cls.__name__ for cls, n in counts.items() if n > 1]
    if not doubled:
        return None
    names = ", ".join(doubled)
    return (
        f"{names} is given more than once. It keeps its state in the checkpoint under one key, "
        "its class name, so a checkpoint would hold the state of only one of the instances, and "
        "a resumed run would give that state to both; the second would also redo what the first "
        "did (swap the optimizer again, choose the batch size again). Keep one instance with "
        "the settings you want (several settings of one technique go in one instance, e.g. one "
        "OptimizerSwap(name=..., overrides={...}))."
    )


@rule
def _stateful_twice(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """A stateful technique without a ``state_key`` of its own, given twice. Lightning refuses
    that at ``Trainer(callbacks=[...])`` with a generic message; callbacks appended later
    (``trainer.callbacks.append``) it does not check, and a checkpoint then keeps one instance's
    state silently. The CLI checks a config's callbacks with this message before the Trainer is
    built (``cli.py``)."""
    return stateful_twice([type(t) for t in techniques])


@rule
def _duplicates(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """Two instances of a technique that does not stack: the second would silently replace the
    first. (Stateful ones are said by ``_stateful_twice``.)"""
    seen: dict[type, int] = {}
    for t in techniques:
        if not getattr(t, "stacks", True) and not keyed_by_class(type(t)):
            seen[type(t)] = seen.get(type(t), 0) + 1
    doubled = [cls.__name__ for cls, n in seen.items() if n > 1]
    if doubled:
        return (
            f"{', '.join(doubled)} is given more than once: a second instance would replace what the "
            "first applied. Keep one (combine their settings, e.g. one policy listing both block "
            "classes)."
        )
    return None


@rule
def _fp16_on_cpu(trainer: Any, techniques: Sequence[Any]) -> str | None:
    precision = str(getattr(getattr(trainer, "precision_plugin", None), "precision", ""))
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if precision.startswith("16") and getattr(device, "type", None) == "cpu":
        return (
            f"precision={precision!r} (float16) on a CPU-only machine: CPUs have no fast fp16 "
            "path and Lightning's grad scaler needs CUDA. Use precision='bf16-mixed' (or "
            "'32-true') instead."
        )
    return None


@rule
def _preload_with_workers(trainer: Any, techniques: Sequence[Any]) -> str | None:
    loaders = [t for t in techniques if getattr(t, "loads_in_workers", False)]
    preloads = [t for t in techniques if getattr(t, "preloads_to_device", False)]
    if loaders and preloads:
        return (
            f"{_names(loaders)} with {_names(preloads)}: preloaded batches already live on the "
            "device and are served in the main process, so worker processes have nothing to load "
            "(and cannot hold device tensors). Keep DevicePreload for datasets that fit, "
            "DataLoaderTuning for the others."
        )
    return None


@rule
def _packing_with_loader_changes(trainer: Any, techniques: Sequence[Any]) -> str | None:
    packers = [t for t in techniques if getattr(t, "packs_documents", False)]
    others = [
        t
        for t in techniques
        if t not in packers
        and (getattr(t, "orders_samples", False) or getattr(t, "preloads_to_device", False))
    ]
    if packers and others:
        return (
            f"{_names(packers)} with {_names(others)}: packing builds its own batches of rows, "
            "its documents shuffled by its seed each epoch; another order of the samples would be "
            "dropped by it (or would drop it), and rows that change every epoch cannot be "
            "preloaded once. Use one of them."
        )
    return None


@rule
def _batch_size_accumulation(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """EfficientBatchSize sets accumulate_grad_batches; nothing else may change it."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    sizers = [t for t in techniques if getattr(t, "sets_accumulation", False)]
    problems = []
    if len(sizers) > 1:
        problems.append(
            f"{', '.join(type(t).__name__ for t in sizers)} each set the micro-batch and "
            "accumulate_grad_batches to keep the effective batch. Keep one of them (AutoEfficient "
            "sizes the micro-batch with the stack it picks)."
        )
    if sizers and any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        problems.append(
            f"{_names(sizers)} sets accumulate_grad_batches to keep the effective batch, and "
            "GradientAccumulationScheduler changes it per epoch. Remove one of them."
        )
    if sizers and getattr(trainer.strategy, "handles_gradient_accumulation", False):
        problems.append(
            f"{_names(sizers)} cannot set the accumulation of "
            f"{type(trainer.strategy).__name__}, which handles gradient accumulation itself (e.g. "
            "DeepSpeed's gradient_accumulation_steps). Set the accumulation in the strategy's config "
            "(and leave EfficientBatchSize's target_batch_size=None, or AutoEfficient out)."
        )
    recoveries = [t for t in techniques if getattr(t, "recovers_from_oom", False)]
    if len(recoveries) > 1:
        problems.append(
            "OOM recovery is on twice (" + ", ".join(type(t).__name__ for t in recoveries) + "): "
            "EfficientBatchSize recovers from OOM already; remove OOMRecovery or pass "
            "EfficientBatchSize(oom_recovery=False)."
        )
    return " ".join(problems) or None


@rule
def _weighed_windows(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """Exact accumulation weighs each micro-batch's gradient in Lightning's automatic loop and
    rescales the window's gradients before the optimizer step."""
    weighers = [t for t in techniques if getattr(t, "weighs_windows", False)]
    if not weighers:
        return None
    who, problems = _names(weighers), []
    module = getattr(trainer, "lightning_module", None)
    if module is not None and not getattr(module, "automatic_optimization", True):
        problems.append(
            f"{who} weighs accumulated gradients in Lightning's automatic optimization, but the "
            "module uses manual optimization (it calls backward and step itself): multiply each "
            "micro-batch's loss by its target count and divide the gradients by the window's "
            "total before your step, or leave it out"
        )
    strategy = getattr(trainer, "strategy", None)
    if getattr(strategy, "handles_gradient_accumulation", False):
        problems.append(
            f"{who} cannot weigh the accumulation of {type(strategy).__name__}, which accumulates "
            "gradients itself (DeepSpeed's gradient_accumulation_steps): its micro-batch losses "
            "are averaged with equal weights. Leave it out, or use DDP"
        )
    if any(getattr(t, "steps_in_backward", False) for t in techniques):
        problems.append(
            f"{who} rescales the window's gradients before the optimizer step, but the optimizer "
            "steps inside backward (optimizer_in_backward=True), before that: leave one out"
        )
    return "; ".join(problems) or None


@rule
def _optimizer_in_backward(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """Stepping each parameter from its gradient hook (OptimizerSwap(optimizer_in_backward=True))
    needs every gradient to be final when it arrives and to be used alone."""
    users = [t for t in techniques if getattr(t, "steps_in_backward", False)]
    if not users:
        return None
    who = f"{type(users[0]).__name__}(optimizer_in_backward=True)"
    problems = []
    accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
    raisers = [t for t in techniques if getattr(t, "sets_accumulation", False)]
    if raisers:  # the accumulation it will set at fit start is not known yet, but may exceed 1
        problems.append(
            f"{_names(raisers)}, which sets accumulate_grad_batches during the fit: gradients "
            "cannot be accumulated over micro-batches because each one is used and freed as soon "
            "as backward produces it. Leave EfficientBatchSize's target_batch_size=None (or "
            "AutoEfficient out) or set optimizer_in_backward=False"
        )
    elif accumulate > 1:
        problems.append(
            f"accumulate_grad_batches={accumulate}: gradients cannot be accumulated over micro-batches "
            "because each one is used and freed as soon as backward produces it. Use "
            "accumulate_grad_batches=1 (a larger batch, e.g. with activation checkpointing) or "
            "optimizer_in_backward=False"
        )
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip:
        problems.append(
            f"gradient_clip_val={clip}: clipping needs all gradients at once (their total norm), but they "
            "never all exist. Remove gradient_clip_val or set optimizer_in_backward=False"
        )
    precision = str(getattr(trainer, "precision", ""))
    if precision.startswith("16"):
        problems.append(
            f"precision={precision!r}: the fp16 grad scaler must unscale all gradients before the step. "
            "Use precision='bf16-mixed' or optimizer_in_backward=False"
        )
    world = getattr(trainer, "world_size", 1) or 1
    if world > 1:
        problems.append(
            f"world_size={world}: each parameter would be stepped with its local gradient before DDP "
            "averages it across processes. Use optimizer_in_backward=False for multi-process training"
        )
    if not problems:
        return None
    return f"{who} cannot be combined with " + "; and with ".join(problems) + "."


@rule
def _optimizer_swap_under_deepspeed(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """DeepSpeed wraps the optimizer in its engine during strategy.setup; a later swap is ignored."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    swaps = [t for t in techniques if getattr(t, "swaps_optimizer", False)]
    strategy = getattr(trainer, "strategy", None)
    if swaps and isinstance(strategy, DeepSpeedStrategy):
        return (
            f"{_names(swaps)} under {type(strategy).__name__}: DeepSpeed builds its engine around the module's optimizer "
            "before callbacks can swap it, so the swap would not take effect. Configure the optimizer in "
            "the module (or DeepSpeed's config) instead, or use a non-DeepSpeed strategy"
        )
    return None


@rule
def _optimizer_step_veto(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """DivergenceGuard drops a bad update by clearing the gradients before ``optimizer.step()``;
    that needs the step to follow ``on_before_optimizer_step`` and to read ``param.grad``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    vetoes = [t for t in techniques if getattr(t, "vetoes_optimizer_step", False)]
    if not vetoes:
        return None
    problems = []
    in_backward = [t for t in techniques if getattr(t, "steps_in_backward", False)]
    if in_backward:
        problems.append(
            f"{_names(in_backward)} steps each parameter during backward, before the guard sees "
            "the loss, so a bad update cannot be dropped. Set optimizer_in_backward=False"
        )
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, DeepSpeedStrategy):
        problems.append(
            f"{type(strategy).__name__} steps from its own gradient partitions, so clearing "
            "param.grad does not drop the update. Use a non-DeepSpeed strategy, or DeepSpeed's "
            "own loss-scale overflow skipping"
        )
    if not problems:
        return None
    return f"{_names(vetoes)} cannot be combined: " + "; and ".join(problems) + "."


@rule
def _sharded_parameters(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """A strategy that shards parameters (``shards_parameters``, e.g. FullyShardedStrategy)
    hands techniques DTensor parameters; the ones that declare they cannot handle them stop."""
    strategy = getattr(trainer, "strategy", None)
    if not getattr(strategy, "shards_parameters", False):
        return None
    problems = [
        f"{type(t).__name__} under {type(strategy).__name__}: {t.sharding_conflict}"
        for t in techniques
        if getattr(t, "sharding_conflict", None)
    ]
    return "; ".join(problems) or None


@rule
def _parameters_after_call(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """A strategy whose modules hold their parameters only during their own call
    (``gathers_parameters_per_call``: ZeRO stage 3) cannot serve a technique that uses a
    module's parameters after that call returned (``uses_parameters_after_call``)."""
    strategy = getattr(trainer, "strategy", None)
    if not getattr(strategy, "gathers_parameters_per_call", False):
        return None
    late = [t for t in techniques if getattr(t, "uses_parameters_after_call", False)]
    if not late:
        return None
    return (
        f"{_names(late)} under {type(strategy).__name__} with stage 3: ZeRO-3 gathers a "
        "module's parameters only while the module runs, and the output projection's weight is "
        "used after its call, in the loss (a ZeRO-3 run computed the full logits every step and "
        f"its losses parted from the plain run's). Use stage 2 (or FullyShardedStrategy) with "
        f"{_names(late)}, or remove it."
    )


@rule
def _quantized_weights_sharded(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """Techniques that store frozen weights quantized (``quantizes_frozen_weights``) keep packed
    uint8 weights with their scales beside them: FSDP and DeepSpeed flatten or shard them."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy = getattr(trainer, "strategy", None)
    quantized = [t for t in techniques if getattr(t, "quantizes_frozen_weights", False)]
    if not quantized or not isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy)):
        return None
    return (
        f"{_names(quantized)} under {type(strategy).__name__}: the 4-bit weights are packed "
        "uint8 tensors whose scales live beside them, which FSDP and DeepSpeed flatten or shard. "
        "Use strategy='ddp' or a single device (4-bit frozen weights are what lets a model fit "
        "one GPU), or remove the callback."
    )


@rule
def _quantized_weights_averaged(trainer: Any, techniques: Sequence[Any]) -> str | None:
    """Lightning's ``WeightAveraging`` (EMA, SWA) keeps a copy of every parameter, frozen ones
    included, and averages it from the model's: a frozen weight stored in 4 bits is a packed uint8
    tensor of another size (a raw size mismatch at the first update)."""
    from lightning.pytorch import callbacks

    averaging = getattr(callbacks, "WeightAveraging", None)  # Lightning >= 2.5
    quantized = [t for t in techniques if getattr(t, "quantizes_frozen_weights", False)]
    found = [
        cb for cb in getattr(trainer, "callbacks", []) if averaging and isinstance(cb, averaging)
    ]
    if not quantized or not found:
        return None
    return (
        f"{_names(quantized)} with {type(found[0]).__name__}: weight averaging keeps a "
        "full-precision copy of every parameter, the frozen ones too, and averages it from the "
        "model's, whose frozen weights are packed 4-bit tensors of another size (and the copy "
        "would hold the whole base in full precision, the memory 4 bits saves). Average the "
        "adapters after the fit, or remove one of the two."
    )
