"""The micro-batch and accumulation for a running fit: what :class:`EfficientBatchSize` decides.

Reads what the trainer knows (the batch-size holder, the train DataLoader's dataset, the device,
the precision, the world size), measures with the instrument (the fake-tensor estimate; real
trial steps on a GPU) and combines the pure maths of :mod:`.sizing` into a :class:`Choice`. The
callback only decides when to call :func:`choose_batch_size` and applies the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import (
    check_choice,
    check_float,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.memory.budget import compared_bytes, step_within, usable_bytes
from lightning_efficient.measure.memory.settings import estimate_settings
from lightning_efficient.measure.speed.host import available_bytes
from lightning_efficient.measure.trials.trial import throughput, trial_within
from lightning_efficient.techniques.batch_size.sizing import (
    MAX_TARGET_BATCH,
    candidate_sizes,
    choose_micro_batch,
    epoch_end_step,
    fastest,
    first_fitting,
    largest_fitting_batch,
    longest_sample,
    resize_batch,
    search_cap,
    settle_accumulation,
    worst_case_batch,
)
from lightning_efficient.techniques.batch_size.split import OutOfMemoryRecoveryError

__all__ = [
    "Choice",
    "batch_size_holders",
    "batch_size_of",
    "SizingSettings",
    "sizing_settings",
    "describe_choice",
    "describe_restored",
    "choose_batch_size",
    "read_batch_size",
    "set_batch_size",
    "worst_case_sampler",
]


@dataclass(frozen=True)
class SizingSettings:
    """What the user asked for (the arguments of :class:`EfficientBatchSize`)."""

    target_batch_size: int | None = None
    multiple_of: int | str = "auto"
    mode: str = "max_fit"
    margin: float = 0.1
    max_batch_size: int | None = None
    budget_bytes: int | None = None
    batch_arg_name: str = "batch_size"
    optimizer: str = "adamw"
    probe_samples: int = 10_000


def sizing_settings(
    target_batch_size: int | None = None,
    multiple_of: int | str = "auto",
    mode: str = "max_fit",
    margin: float = 0.1,
    max_batch_size: int | None = None,
    budget: int | str | None = None,
    batch_arg_name: str = "batch_size",
    optimizer: str = "adamw",
    probe_samples: int = 10_000,
) -> SizingSettings:
    """The arguments of :class:`EfficientBatchSize`, checked in order (a ``ValueError`` or
    ``TypeError`` naming the first refused one), with ``budget`` parsed to bytes."""
    target_batch_size = check_int(
        "target_batch_size", target_batch_size, minimum=1, maximum=MAX_TARGET_BATCH,
        allow_none=True,
    )  # fmt: skip
    if multiple_of != "auto":
        if isinstance(multiple_of, str):
            raise ValueError(
                f"`multiple_of` must be 'auto' or a positive integer; got {multiple_of!r}."
            )
        check_int("multiple_of", multiple_of, minimum=1)
    mode = check_choice("mode", mode, ("max_fit", "throughput"))
    margin = check_float("margin", margin, minimum=0.0, maximum=0.9, max_exclusive=True)
    max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1, allow_none=True)
    budget_bytes = parse_bytes("budget", budget, allow_none=True)
    if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
        raise ValueError(f"`batch_arg_name` must be an attribute name; got {batch_arg_name!r}.")
    if not isinstance(optimizer, str) or not optimizer:
        raise TypeError(
            f"`optimizer` must be 'adamw', 'adam', 'sgd' or a class path; got {optimizer!r}."
        )
    probe_samples = check_int("probe_samples", probe_samples, minimum=1)
    return SizingSettings(
        target_batch_size, multiple_of, mode, margin, max_batch_size, budget_bytes,
        batch_arg_name, optimizer, probe_samples,
    )  # fmt: skip


@dataclass
class Choice:
    """The decision: micro-batch x accumulation x world size, how it was found, and what to say."""

    micro: int
    accumulation: int
    world: int
    how: str  # "estimate" or "trial steps"
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def describe_choice(name: str, initial: int, choice: Choice, mode: str) -> str:
    """The line that says what :func:`choose_batch_size` chose (``initial``: the batch size before)."""
    effective = choice.micro * choice.accumulation * choice.world
    return (
        f"{name} {initial} -> {choice.micro} ({mode}, {choice.how}), "
        f"accumulation {choice.accumulation} x world {choice.world} = effective {effective}"
    )


def describe_restored(name: str, micro: int | None, accumulation: int | None, note: str) -> str:
    """The line that says what a restored (not chosen) micro-batch and accumulation are."""
    return f"{name} {micro}, accumulation {accumulation} ({note})"


def _holders(trainer: Any, pl_module: Any, name: str) -> list[Any]:
    return batch_size_holders(getattr(trainer, "datamodule", None), pl_module, name)


def batch_size_holders(datamodule: Any, pl_module: Any, name: str) -> list[Any]:
    """Where ``name`` lives, the one ``train_dataloader()`` reads first: the datamodule's
    attribute, its hparams, then the module's attribute, its hparams (without a datamodule, the
    module's alone). Lightning's ``lightning_getattr`` reads the last holder (an hparams entry
    that a later change of the attribute left stale)."""
    owners = [datamodule, pl_module]
    found: list[Any] = []
    for owner in owners:
        if owner is None:
            continue
        if hasattr(owner, name):
            found.append(owner)
        hparams = getattr(owner, "hparams", None)
        if hparams is not None and name in hparams:
            found.append(hparams)
    return found


def batch_size_of(datamodule: Any, pl_module: Any, name: str) -> Any:
    """The value of ``name`` where ``train_dataloader()`` reads it (the first of
    :func:`batch_size_holders`); ``None`` where it lives nowhere. The one reading of the batch
    size: :func:`read_batch_size` (in a fit), ``fit --auto`` (before one)."""
    holders = batch_size_holders(datamodule, pl_module, name)
    return _get(holders[0], name) if holders else None


def _get(holder: Any, name: str) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def _put(holder: Any, name: str, value: Any) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


def set_batch_size(trainer: Any, pl_module: Any, name: str, value: int) -> Change:
    """Set ``name`` to ``value`` in every place it lives (as Lightning's BatchSizeFinder does);
    undo puts each place's own value back."""
    holders = _holders(trainer, pl_module, name)
    before = [(holder, _get(holder, name)) for holder in holders]
    for holder in holders:
        _put(holder, name, value)

    def undo() -> None:
        for holder, old in before:
            _put(holder, name, old)

    old = before[0][1] if before else None
    return Change(f"{name} {old} -> {value}", undo, figures={name: value})


def read_batch_size(
    trainer: Any, pl_module: Any, name: str, who: str = "EfficientBatchSize"
) -> int:
    """The current batch size where ``train_dataloader()`` reads it (the datamodule's attribute
    first, an hparams entry last: one changed after construction is read as it is now); a
    clear error when there is none, or when the train DataLoader cannot be rebuilt with a new
    one."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    holders = _holders(trainer, pl_module, name)
    if not holders:
        where = (
            type(trainer.datamodule).__name__ if trainer.datamodule is not None else "no datamodule"
        )
        raise ValueError(
            f"{who}: no `{name}` found on the LightningModule "
            f"({type(pl_module).__name__}), its hparams, or the datamodule ({where}) or its "
            f"hparams. Add a `{name}` attribute that `train_dataloader()` uses, "
            "or set `batch_arg_name` to the attribute's name."
        )
    if trainer.datamodule is None and not is_overridden("train_dataloader", pl_module):
        raise ValueError(
            f"{who}: the train DataLoader was passed to `trainer.fit` directly, so "
            "it cannot be rebuilt with a new batch size. Build it in a LightningDataModule's or "
            "the LightningModule's `train_dataloader()` from its `batch_size` attribute."
        )
    value = batch_size_of(trainer.datamodule, pl_module, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: `{name}` is {value!r}; expected a positive int.")
    return value


def _hardware(trainer: Any) -> dict[str, Any]:
    device = trainer.strategy.root_device
    hw: dict[str, Any] = {"precision": str(trainer.precision), "device_type": device.type}
    if device.type == "cuda":
        hw["capability"] = torch.cuda.get_device_capability(device)
        hw["device_name"] = torch.cuda.get_device_name(device)
    return hw


def _budget(trainer: Any, budget_bytes: int | None) -> int:
    if budget_bytes is not None:
        return budget_bytes
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = available_bytes()
    if available is None:
        raise ValueError(
            "EfficientBatchSize: cannot read the available memory; pass `budget=` (e.g. '16GiB')."
        )
    return available


def worst_case_sampler(loader: Any, probe_samples: int) -> tuple[Callable[[int], Any], int | None]:
    """``make_batch(n)``: the largest batch of ``n`` the data can give; and the dataset size."""
    dataset, collate = loader.dataset, loader.collate_fn
    try:
        n_data = len(dataset)
    except TypeError:
        n_data = None
    if n_data is not None:
        index, _ = longest_sample(dataset, max_samples=probe_samples)
        return (lambda n: worst_case_batch(dataset, collate, n, index=index)), n_data
    first = next(iter(loader))  # iterable dataset: its first batch, rows repeated
    return (lambda n: resize_batch(first, n)), n_data


def choose_batch_size(
    trainer: Any, pl_module: Any, settings: SizingSettings, exclude: Any = None
) -> Choice:
    """Search, round, confirm and (``mode="throughput"``) time; the same choice on every
    process. ``exclude``: a callback not to apply to the estimate (the caller itself)."""
    s = settings
    world = trainer.world_size
    source = trainer.datamodule if trainer.datamodule is not None else pl_module
    loader = source.train_dataloader()
    hw = _hardware(trainer)
    budget = _budget(trainer, s.budget_bytes)
    usable = usable_bytes(budget, s.margin)
    make_batch, n_data = worst_case_sampler(loader, s.probe_samples)
    cap = search_cap(s.max_batch_size, n_data, world, s.target_batch_size)
    notes: list[str] = []
    estimate_fn, how = _estimator(trainer, pl_module, make_batch, s, exclude, notes, budget)
    largest, seen = largest_fitting_batch(estimate_fn, usable, cap)
    if largest == 0:
        raise OutOfMemoryRecoveryError(
            f"EfficientBatchSize: even a micro-batch of 1 needs {format_bytes(seen.get(1, 0))} "
            f"({how}), more than the budget {format_bytes(usable)} ({format_bytes(budget)} less "
            f"margin {s.margin:.0%}). Save memory first: ActivationCheckpointing, "
            "precision='bf16-mixed', OptimizerSwap('adamw8bit') or ZeRO offload."
        )
    figures: dict[str, Any] = {}
    micro = choose_micro_batch(largest, s.target_batch_size, world, s.multiple_of, **hw)[0]
    if hw["device_type"] == "cuda" and how == "estimate":  # one real step confirms it
        below = [c for c in candidate_sizes(micro, s.multiple_of, **hw) if c <= micro]
        found = first_fitting(
            below, lambda m: _trial_peak(trainer, pl_module, make_batch(m), s, usable)
        )
        if found is None:
            raise OutOfMemoryRecoveryError(
                "EfficientBatchSize: a real step runs out of memory even at micro-batch 1."
            )
        micro, figures["trial_peak_bytes"] = found[0], int(found[1])
    timings: dict[int, float] = {}
    if s.mode == "throughput":
        best, timings = fastest(
            candidate_sizes(largest, s.multiple_of, **hw),
            lambda m: _rate(trainer, pl_module, make_batch(m), m, s, world),
        )
        if best is None:
            raise OutOfMemoryRecoveryError(
                "EfficientBatchSize: every candidate micro-batch ran out of memory."
            )
        micro = best
        figures["candidates"] = ", ".join(f"{m}: {r:.1f}/s" for m, r in timings.items())
    accumulation, effective, exact = settle_accumulation(
        s.target_batch_size, micro, world, trainer.accumulate_grad_batches
    )
    warnings = []
    if not exact:
        warnings.append(
            f"target_batch_size={s.target_batch_size} cannot be reached exactly with world size "
            f"{world} and a micro-batch <= {largest}; using micro-batch {micro} x accumulation "
            f"{accumulation} x world size {world} = {effective}, the nearest."
        )
    if n_data is not None:
        share = n_data // world
        last = epoch_end_step(share, micro, accumulation, bool(getattr(loader, "drop_last", False)))
        if last is not None:
            warnings.append(
                f"the effective batch {effective} is not kept at epoch ends: {share} samples per "
                f"rank give steps of {micro * accumulation} and a last step of {last} (Lightning "
                "steps at every epoch end); an effective batch that divides the samples per rank "
                "keeps it."
            )
    if s.target_batch_size is not None and trainer.accumulate_grad_batches not in (1, accumulation):
        warnings.append(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is replaced by {accumulation}."
        )
    # the same choice on every process (device trials may differ slightly between ranks)
    micro, accumulation = trainer.strategy.broadcast((micro, accumulation), src=0)
    if how == "estimate" and micro not in seen:
        seen[micro] = estimate_fn(micro)
    peak = seen.get(micro)
    figures = {
        **figures,
        "micro_batch": micro,
        "accumulation": accumulation,
        "effective_batch": micro * accumulation * world,
        "largest_fitting": largest,
        "budget_bytes": usable,
        **({"estimated_peak_bytes": int(peak)} if peak is not None and math.isfinite(peak) else {}),
        **({"samples_per_s": round(timings[micro], 2)} if micro in timings else {}),
    }
    return Choice(micro, accumulation, world, how, figures, notes, warnings)


# -- measuring -----------------------------------------------------------------------------------
def _estimator(
    trainer: Any,
    pl_module: Any,
    make_batch: Callable[[int], Any],
    s: SizingSettings,
    exclude: Any,
    notes: list[str],
    budget: int,
) -> tuple[Callable[[int], float], str]:
    settings = estimate_settings(trainer, exclude=[] if exclude is None else [exclude])
    settings["optimizer"] = s.optimizer  # the sizing's optimizer (before the fit builds one)
    world = trainer.world_size

    def estimate(n: int) -> float:
        # with accumulation, gradients stay live through the next micro-batch's forward
        accumulating = (s.target_batch_size or 0) > n * world or trainer.accumulate_grad_batches > 1
        fits, used, _ = step_within(
            pl_module, make_batch(n), budget, accumulation=2 if accumulating else 1,
            margin=s.margin, **settings,
        )  # fmt: skip
        return compared_bytes(fits, used, usable_bytes(budget, s.margin))

    try:
        estimate(1)
        return estimate, "estimate"
    except Exception as err:  # noqa: BLE001 - a model the fake-tensor estimate cannot run
        reason = f"{type(err).__name__}: {err}"
    if trainer.strategy.root_device.type == "cuda":
        notes.append(f"estimate failed ({reason[:200]}); searching with real trial steps")
        usable = usable_bytes(budget, s.margin)
        return (lambda n: _trial_peak(trainer, pl_module, make_batch(n), s, usable)), "trial steps"
    raise RuntimeError(
        f"EfficientBatchSize: the memory estimate cannot run this model on CPU ({reason[:500]})."
    )


def _trial_peak(trainer: Any, pl_module: Any, batch: Any, s: SizingSettings, budget: int) -> float:
    """Peak bytes of one real step under the budget (on CUDA the allocator is capped there, and
    what it reserves must fit); ``inf`` when it runs out of memory or reserves more."""
    result = trial_within(
        pl_module,
        batch,
        budget,
        optimizer=s.optimizer,
        precision=str(trainer.precision),
        device=trainer.strategy.root_device,
        steps=1,
    )
    return float(result.allocated_bytes) if result.ok else math.inf


def _rate(
    trainer: Any, pl_module: Any, batch: Any, micro: int, s: SizingSettings, world: int
) -> float | None:
    """Samples/s of micro-batch ``micro`` with the accumulation the target needs; None on OOM."""
    return throughput(
        pl_module,
        batch,
        s.optimizer,
        device=trainer.strategy.root_device,
        precision=str(trainer.precision),
        samples=micro,
        accumulation=settle_accumulation(s.target_batch_size, micro, world)[0],
    )
