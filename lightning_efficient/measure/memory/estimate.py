"""Exact memory estimate of training steps, without allocating memory and without a GPU.

``estimate_memory`` runs real training steps (the LightningModule's ``training_step`` or a plain
module with a loss function; backward; optimizer step; zero_grad) on *fake* tensors (torch's
``FakeTensorMode``: shapes, dtypes and strides, no data) under the storage tracker of
:mod:`lightning_efficient.measure.memory.track`, which counts the bytes of every live storage by
category. The result is the peak, the bytes live at the peak per category and the phase of the peak.
Because storages are tracked directly, recomputed forwards (activation checkpointing) are counted as
they happen.

Techniques of this package take part through ``configure_estimate(plan)``: they change the
``EstimatePlan`` (the fake model, the optimizer factory, offloading, ...) before the steps run.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import (
    FakeTensorMode,
    fake_tensor_errors,
    module_tensor_slots,
)
from lightning_efficient.measure.memory.caching_allocator import replay
from lightning_efficient.measure.memory.cuda_kernels import cuda_kernels, workspace_hook
from lightning_efficient.measure.memory.hf_masks import hf_mask_checks_on_values
from lightning_efficient.measure.memory.kv_cache import cache_note
from lightning_efficient.measure.memory.per_rank import check_sharding, per_rank_for_model
from lightning_efficient.measure.memory.settings import configured_optimizer
from lightning_efficient.measure.memory.targets import DeviceTarget, resolve_target
from lightning_efficient.measure.memory.track import StorageTracker, run_steps
from lightning_efficient.measure.memory.types import (
    CATEGORIES,
    PHASES,
    PRECISIONS,
    AllocationLog,
    EstimateError,
    EstimatePlan,
    MemoryEstimate,
    check_common,
    check_unsharded,
    cuda_round,
    resolve_optimizer,
)
from lightning_efficient.measure.scratch import scratch

__all__ = [
    "CATEGORIES",
    "PRECISIONS",
    "PHASES",
    "MemoryEstimate",
    "EstimatePlan",
    "EstimateError",
    "estimate_memory",
    "resolve_optimizer",
    "cuda_round",
    "DeviceTarget",
    "resolve_target",
]


def _fake_like(t: torch.Tensor, fake_mode: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty fake CPU tensor with ``t``'s shape, strides and dtype (works for meta tensors)."""
    with fake_mode:
        return torch.empty_strided(
            tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device="cpu"
        )


def _param_dtype(t: torch.Tensor, precision: str) -> torch.dtype:
    if precision == "bf16-true" and t.is_floating_point():
        return torch.bfloat16
    return t.dtype


@contextlib.contextmanager
def swap_to_fake(
    model: nn.Module, fake_mode: Any, precision: str = "32-true"
) -> Iterator[nn.Module]:
    """Replace ``model``'s parameters and buffers in place by fake tensors; restore them on exit.

    A memo keeps shared (tied) parameters shared. Nothing real is allocated, so this works for
    models on the ``meta`` device. Inside, the model is in train mode with ``self.log`` muted;
    on exit it is put back as it was on entry (:func:`~lightning_efficient.measure.scratch.
    scratch`, references kept: nothing real changes): what a forward run inside registered or
    cached (a buffer, a tensor attribute, a hook, a submodule: fake tensors all) is removed,
    what it rebound is restored, its modes and the RNG are set back.
    """
    memo: dict[int, torch.Tensor] = {}
    with scratch(model, values=False):
        for mod in model.modules():
            for store, is_param in module_tensor_slots(mod):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    fake = memo.get(id(t))
                    if fake is None:
                        fake = _fake_like(t, fake_mode, _param_dtype(t, precision))
                        if is_param:
                            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                        memo[id(t)] = fake
                    store[name] = fake  # (the real one put back by scratch's undo)
        yield model


@contextlib.contextmanager
def faked(model: nn.Module, batch: Any, precision: str = "32-true") -> Iterator[Any]:
    """Inside: ``model``'s parameters and buffers are fake (swapped in place, restored on exit),
    a ``FakeTensorMode`` is active, and the fake version of ``batch`` is yielded.

    Code run inside (a forward, a backward, a counting mode) allocates nothing and changes no
    real tensor; tensors it creates are fake.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with swap_to_fake(model, fake_mode, precision):
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        fake = fake_batch(batch, fake_mode, precision, pairs)
        with hf_mask_checks_on_values(pairs), fake_mode:
            yield fake


def fake_batch(
    batch: Any,
    fake_mode: Any,
    precision: str = "32-true",
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> Any:
    """The batch with every tensor replaced by an empty fake CPU tensor (``torch.Size`` entries
    become float tensors of that shape). ``pairs``, when given, receives ``(fake, real)`` for
    every tensor (``real`` is ``None`` for a ``torch.Size``)."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            fake = _fake_like(x, fake_mode, _param_dtype(x, precision))
            if pairs is not None:
                pairs.append((fake, x))
            return fake
        if isinstance(x, torch.Size):
            fake = _fake_like(torch.empty(x, device="meta"), fake_mode)
            if pairs is not None:
                pairs.append((fake, None))
            return fake
        if isinstance(x, dict):
            return (
                type(x)((k, convert(v)) for k, v in x.items())
                if type(x) is dict
                else {k: convert(v) for k, v in x.items()}
            )
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(convert(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        if hasattr(x, "items") and hasattr(x, "keys"):  # Mapping-like (e.g. HF BatchEncoding)
            return {k: convert(v) for k, v in x.items()}
        return x

    return convert(batch)


# -- the error for models that need real values --------------------------------------------------
def _user_frame(tb: Any) -> str:
    """The innermost traceback frame outside torch and this package (the user's line)."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or "/lightning_efficient/measure/" in f or "/contextlib.py" in f:
            continue
        return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return ""


def explain_fake_failure(err: BaseException) -> EstimateError:
    func = getattr(err, "func", None)
    op = str(func) if func is not None else type(err).__name__
    why = {
        "aten._local_scalar_dense.default": (
            "it reads a tensor's value (`.item()`, `float(t)`, `bool(t)`, `if t > 0:` or other "
            "Python control flow on tensor values)"
        ),
    }.get(
        op,
        "its output shape or result depends on the tensor values (e.g. `nonzero`, boolean masking, `unique`)",
    )
    where = _user_frame(err.__traceback__)
    return EstimateError(
        f"estimate_memory could not run the model on fake tensors: the operation `{op}` needs real "
        f"values because {why}."
        + (f" It was called at {where}." if where else "")
        + " Fake tensors carry shapes, not values. Fallback: measure on the real device with a small "
        "batch, e.g. `lightning_efficient.measure.measure_step(model, small_batch)` or a "
        "short fit with the `MemoryBreakdown` callback, and scale the activations with the batch size."
    )


# -- the estimate ----------------------------------------------------------------------------------
def _check_initialised(model: nn.Module) -> None:
    """Lazy modules (``nn.LazyLinear``, ...) not initialised yet have no shapes to estimate."""
    from torch.nn.parameter import is_lazy

    lazy = [
        f"{type(mod).__name__} at {name or '<model>'!r}"
        for name, mod in model.named_modules()
        if any(is_lazy(t) for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)))
    ]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ValueError(
            f"`model` has lazy modules not initialised yet ({shown}): their weights have no "
            "shape until a first forward, so the estimate cannot count them. Run one forward on "
            "a real example batch first (e.g. `with torch.no_grad(): model(x)`, or "
            "`model.training_step(batch, 0)` for a LightningModule), or give the layer its "
            "input size (`nn.Linear(in_features, out_features)`)."
        )


def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: Any = None,
    precision: str = "32-true",
    callbacks: Any = (),
    steps: int = 2,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    cuda_rounding: bool | None = None,
    accumulate_grad_batches: int = 1,
    world_size: int = 1,
    sharding: str | None = None,
    block_bytes: int | None = None,
    device: Any = None,
) -> MemoryEstimate:
    """Device memory of ``steps`` training steps of ``model`` on ``batch``, without allocating.

    Args:
        model: A LightningModule (its ``training_step`` is run, with ``self.log`` silenced) or a
            plain ``nn.Module`` (then ``loss_fn(model, batch) -> loss`` is required). It may live
            on the ``meta`` device. It is restored unchanged afterwards.
        batch: An example batch: tensors (real or meta) or ``torch.Size`` shapes, nested in
            tuples/lists/dicts. Only shapes and dtypes are used.
        optimizer: ``None`` (default): what the LightningModule's ``configure_optimizers``
            returns, with its class, options and param groups, as a fit builds it
            (``foreach=None`` becomes the foreach path torch takes on CUDA); ``"adamw"`` for a
            plain module or when ``configure_optimizers`` needs a trainer. Or ``"adamw"``,
            ``"adam"``, ``"sgd"`` (momentum 0.9), a class path, an ``Optimizer`` class or a
            factory ``factory(param_groups) -> Optimizer``.
        precision: ``"32-true"``, ``"bf16-mixed"`` / ``"16-mixed"`` (autocast: fp32 weights,
            low-precision activations), or ``"bf16-true"`` (bf16 weights and optimizer state).
        callbacks: Techniques of this package; those with ``configure_estimate(plan)`` change the
            plan before the steps run.
        steps: Optimizer steps to run (2 sees the optimizer state live during a forward).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; required for a plain ``nn.Module``.
        cuda_rounding: Round every allocation the way the CUDA caching allocator does
            (512 bytes; 2 MiB blocks above 1 MiB). ``None`` (default): on a CUDA target.
        accumulate_grad_batches: Micro-batches per optimizer step.
        world_size: Ranks the training state is divided over (``batch`` is one rank's batch).
        sharding: How it is divided: ``"ddp"`` (the default when ``world_size > 1``),
            ``"full"`` / ``"grad_op"`` (FSDP), ``"zero1"``, ``"zero2"``, ``"zero3"``; the result
            is one rank's peak (:mod:`lightning_efficient.measure.memory.per_rank`).
        block_bytes: Parameter bytes of the largest block (gathered whole by FSDP / ZeRO-3);
            ``None``: the largest member of a ``ModuleList``.
        device: The device modelled
            (:func:`~lightning_efficient.measure.memory.targets.resolve_target`): ``None``
            (default): this machine's accelerator; ``"cpu"``: the CPU's own kernels; ``"cuda"``,
            ``"cuda:sm80"``, ``"cuda:a100"``, ...: CUDA's kernels, workspaces and allocator,
            modelled on any machine (:mod:`~lightning_efficient.measure.memory.cuda_kernels`). The
            result's ``target`` names it.
    """
    target = resolve_target(device)
    if cuda_rounding is None:
        cuda_rounding = target.cuda
    check_common(model, precision, steps, loss_fn, cuda_rounding, accumulate_grad_batches)
    check_sharding(world_size, sharding)
    _check_initialised(model)
    check_unsharded(model)
    notes = []
    if optimizer is None and hasattr(model, "configure_optimizers"):
        optimizer, note = configured_optimizer(model, foreach_default=True)
        notes.append(note if optimizer is not None else f"optimizer 'adamw' ({note})")
    factory = resolve_optimizer("adamw" if optimizer is None else optimizer)
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    with swap_to_fake(model, fake_mode, precision):
        plan = EstimatePlan(
            model=model,
            batch=fake_batch(batch, fake_mode, precision, pairs),
            optimizer=factory,
            precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            loss_fn=loss_fn,
            notes=notes,
            world_size=world_size,
            sharding=sharding,
            cuda_rounding=cuda_rounding,
            device=target,
        )
        try:
            plan.configure(callbacks)
            if cache := cache_note(model):  # a cache no technique switched off (issue 39)
                plan.note(cache)
            tracker = StorageTracker(
                rounding=cuda_round if cuda_rounding else None,
                fake=True,
                op_hook=workspace_hook(target) if target.cuda else None,
            )
            kernels = cuda_kernels(target) if target.cuda else contextlib.nullcontext([])
            try:
                # transformers' mask checks answer as on the real batch (see _internals)
                with hf_mask_checks_on_values(pairs) as assumed, kernels as backends, fake_mode:
                    run_steps(plan, tracker, steps=steps)
                plan.notes.extend(assumed)
                if backends:
                    plan.note(_attention_note(backends))
            except fake_tensor_errors() as err:
                raise explain_fake_failure(err) from err
        finally:
            plan.undo()
    result = tracker.summary(offload=plan.offload)
    result.notes = list(plan.notes)
    result.figures = dict(plan.figures)
    if target.cuda:  # what the caching allocator reserves for these allocations
        result.allocations = AllocationLog(tracker.requests(plan.offload))
        result.reserved_bytes = replay(result.allocations).reserved_peak
    if world_size > 1 or sharding is not None:  # one rank's share (measure/memory/per_rank.py)
        one = result
        result = per_rank_for_model(
            result,
            model,
            world_size=world_size,
            sharding=sharding,
            precision=precision,
            block_bytes=block_bytes,
        )
        if one.reserved_bytes:  # the one-device fragmentation, in proportion
            result.reserved_bytes = -(-result.peak_bytes * one.reserved_bytes // one.peak_bytes)
    result.target = target.label
    return result


def _attention_note(backends: list[str]) -> str:
    counts = {b: backends.count(b) for b in dict.fromkeys(backends)}
    calls = ", ".join(f"{b} x{n}" for b, n in counts.items())
    return f"attention on the CUDA target: {calls} (calls over the estimated steps)"


# -- the estimate of a running fit -----------------------------------------------------------------
