"""AutoEfficient's view of a fit: what it reads from the trainer, and how it measures and applies.

- :func:`ladder_for`: the planner's ladder for the fit (shared, not copied), the chunked-loss
  rung included where the model's logits are wide.
- :func:`estimate_measure` / :func:`trial_runner`: the instrument's estimate of one rung at one
  micro-batch (for the trainer's device) and real trial steps within the budget.
- :func:`fixed_by_trainer`: why a rung cannot be applied by a callback (the precision plugin and
  the strategy are fixed when the Trainer is built) and the yaml line that would.
- :func:`apply_batch` / :func:`add_callbacks`: set the micro-batch and accumulation, put the
  rung's callbacks next to AutoEfficient; each a ``Change`` with its undo.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import SettingsError, check_choice, parse_bytes
from lightning_efficient.measure.memory.estimate import EstimateError
from lightning_efficient.measure.memory.settings import (
    configured_optimizer,
    configured_optimizer_class,
    estimate_settings,
)
from lightning_efficient.measure.memory.targets import resolve_target
from lightning_efficient.planning.decision import GOALS, Decision
from lightning_efficient.planning.ladder import (
    Rung,
    default_ladder,
    ladder_options,
    technique_class,
    trains_without_cache,
)
from lightning_efficient.planning.search import decide, estimate_rung, try_rung
from lightning_efficient.techniques.batch_size.choice import (
    read_batch_size,
    set_batch_size,
    worst_case_sampler,
)
from lightning_efficient.techniques.batch_size.sizing import epoch_end_step

__all__ = [
    "add_callbacks",
    "apply_batch",
    "check_one_sizer",
    "decide_for",
    "decide_stack",
    "device_memory",
    "effective_batch",
    "estimate_failure",
    "estimate_measure",
    "fixed_by_trainer",
    "ladder_for",
    "not_applied_by",
    "other_sizers",
    "quiet_restore_warning",
    "same_on_every_rank",
    "stack_callbacks",
    "own_accumulation",
    "trial_runner",
    "without_configured",
]


def ladder_for(
    model: Any,
    *,
    precision: str,
    bf16: bool,
    world_size: int = 1,
    sharding: str | None = None,
    configured: Sequence[Any] = (),
) -> list[Rung]:
    """The planner's ladder for ``model``, its 8-bit rungs in the family of the optimizer the
    module configures (none for SGD). The optimizer-in-backward rung is left out (the
    micro-batch may need accumulation, which it cannot do). ``configured``: the techniques the
    fit already has; a rung's part of the same class is left out (the configured one is used
    as given)."""
    optimizer = configured_optimizer_class(model)
    ladder = default_ladder(
        precision=precision,
        bf16=bf16,
        accumulate_grad_batches=2,
        world_size=world_size,
        configured_sharding=sharding,
        optimizer=optimizer if optimizer is not None else "adamw",
        **ladder_options(model),
    )
    # DeepSpeed's ZeRO sets the accumulation itself: never AutoEfficient's (`plan` offers it)
    return [r for r in without_configured(ladder, configured) if not own_accumulation(r)]


def without_configured(rungs: Sequence[Rung], configured: Sequence[Any]) -> list[Rung]:
    """``rungs`` with every part whose technique the fit already has taken out (the configured
    one is used as given: a technique given twice is refused), and the rungs that become the
    same stack as an earlier one dropped."""
    have = {type(obj).__name__ for obj in configured}
    out: list[Rung] = []
    seen: set[str] = set()
    for rung in rungs:
        parts = tuple(p for p in rung.callbacks if p.class_path not in have)
        strategy = (
            rung.strategy if rung.strategy is None or rung.strategy.class_path not in have else None
        )
        if parts != rung.callbacks or strategy is not rung.strategy:
            rung = replace(rung, callbacks=parts, strategy=strategy)
        key = repr((rung.precision, rung.callbacks, rung.strategy, rung.configured))
        if key not in seen:
            seen.add(key)
            out.append(rung)
    return out


def estimate_measure(
    model: Any,
    make_batch: Callable[[int], Any],
    budget_bytes: int,
    effective: int,
    settings: dict[str, Any],
) -> Callable[[Rung, int], tuple[bool, float, Any]]:
    """``measure(rung, micro) -> (fits, bytes, estimate)``: ``estimate_memory`` of ``model`` on
    the worst-case batch of ``micro`` samples with the rung's techniques on top of the ones the
    fit already has (``settings``: ``estimate_settings`` of the trainer, or the same keys), with
    two micro-batches per step where the micro-batch needs accumulation (the gradients stay live
    through the next forward), and without a Hugging Face key/value cache where AutoEfficient
    trains the rung without it (``trains_without_cache``). ``bytes``: what must fit (CUDA: what
    the allocator reserves)."""
    base = dict(settings)
    existing = list(base.pop("callbacks", ()))

    def measure(rung: Rung, micro: int) -> tuple[bool, float, Any]:
        try:
            return estimate_rung(
                model,
                make_batch(micro),
                rung,
                budget_bytes,
                accumulation=1 if micro >= effective else 2,
                existing=existing,
                without_cache=trains_without_cache(rung),  # as AutoEfficient trains it
                **base,
            )
        except Exception as err:
            if not rung.callbacks and rung.strategy is None:  # the fit's own step: not memory
                raise estimate_failure(err) from None
            # what the rung adds cannot be estimated (or cannot serve): the rung is passed over
            # as "cannot estimate" with the reason, never the whole decision lost
            return False, math.inf, err

    return measure


def estimate_failure(err: BaseException) -> BaseException:
    """What to raise when the estimate of the fit's own step (no technique added) fails: that is
    never "does not fit". The user's own error (raised in their code or by torch on their
    tensors, e.g. a shape mismatch) as it is; the estimate's refusal (a step that reads tensor
    values, manual optimization) as "the estimate cannot run this step because ...", with the
    fallback."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    refused = isinstance(err, EstimateError) or (
        bool(frames) and "/lightning_efficient/" in frames[-1]
    )
    if not refused:
        err.add_note("(raised by the module's own step, run by AutoEfficient's memory estimate)")
        return err
    return EstimateError(
        f"AutoEfficient: the estimate cannot run this step because {err} Fallback: configure "
        "the techniques and the batch size by hand (`lightning-efficient plan --config ...` "
        "prints a stack for a budget; `EfficientBatchSize` sizes the batch with real steps on a "
        "GPU)."
    )


def trial_runner(
    module: Any,
    make_batch: Callable[[int], Any],
    budget_bytes: int,
    effective: int,
    device: torch.device,
    existing: Sequence[Any] = (),
) -> Callable[[Rung, int], Any]:
    """``trial(rung, micro)``: two real training steps of ``module`` on ``device`` with the
    rung's techniques, within the budget (``measure.trials.trial.trial_within``: on CUDA under the
    allocator's cap, what it reserves compared). ``None`` for a rung with a strategy (it runs
    only inside a fit)."""
    factory, _ = configured_optimizer(module)

    def trial(rung: Rung, micro: int) -> Any:
        if rung.strategy is not None:  # it runs only inside a fit (and no batch is built)
            return None
        return try_rung(
            module,
            make_batch(micro),
            rung,
            budget_bytes,
            device=device,
            optimizer=factory or "adamw",
            existing=existing,
            accumulate_grad_batches=1 if micro >= effective else 2,
            without_cache=trains_without_cache(rung),
        )

    return trial


def fixed_by_trainer(rung: Rung, precision: str) -> str:
    """Why a callback cannot apply ``rung`` to a trainer built with ``precision`` ("" when it
    can): the precision plugin and the strategy are fixed when the Trainer is built. The reason
    carries the yaml that would apply it (or ``lightning-efficient fit --auto``)."""
    own = own_accumulation(rung)
    if own:
        return own
    lines = []
    if rung.precision != precision:
        lines.append(f"trainer.precision: {rung.precision}")
    if rung.strategy is not None:
        lines.append(f"trainer.strategy: {{class_path: {rung.strategy.class_path}}}")
    if not lines:
        return ""
    return "needs yaml (" + "; ".join(lines) + "), or `lightning-efficient fit --auto`"


def not_applied_by(trainer: Any, rung: Rung) -> str:
    """What of ``rung`` the built ``trainer`` does not have ("" when it has it all: a Trainer
    built from the plan by ``fit --auto`` has its precision and strategy)."""
    lines = []
    if rung.precision != str(trainer.precision):
        lines.append(f"trainer.precision: {rung.precision}")
    if rung.strategy is not None and not isinstance(
        trainer.strategy, technique_class(rung.strategy.class_path)
    ):
        lines.append(f"trainer.strategy: {{class_path: {rung.strategy.class_path}}}")
    if not lines:
        return ""
    return "needs yaml (" + "; ".join(lines) + "), or `lightning-efficient fit --auto`"


def own_accumulation(rung: Rung) -> str:
    """Why ``rung`` cannot be AutoEfficient's even in a Trainer built from the plan ("" when it
    can): its strategy sets the accumulation itself (DeepSpeed's ZeRO), so the micro-batch and
    accumulation that keep the effective batch cannot be set."""
    strategy = rung.strategy.build() if rung.strategy is not None else None
    if strategy is None or not getattr(strategy, "handles_gradient_accumulation", False):
        return ""
    return (
        f"{type(strategy).__name__} sets the accumulation itself, so the effective batch cannot "
        "be kept: `lightning-efficient plan` writes its yaml"
    )


def device_memory(trainer: Any, who: str) -> int:
    """The total memory of the trainer's CUDA device (a budget of ``None``); elsewhere it cannot
    be read: a clear error asking for ``budget=``."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        raise SettingsError(
            f"{who}: on a {device.type} device the budget cannot be read; pass "
            "`budget=` (e.g. '4GiB')."
        )
    return int(torch.cuda.get_device_properties(device).total_memory)


def same_on_every_rank(trainer: Any, decision: Decision) -> Decision:
    """Rank zero's decision on every rank (device trials may differ slightly between ranks)."""
    if trainer.world_size == 1:
        return decision
    state = trainer.strategy.broadcast(decision.state(), src=0)
    if state == decision.state():
        return decision
    shared = Decision.from_state(state, trainer.world_size, decision.goal)
    shared.restored = False
    return shared


def effective_batch(
    trainer: Any, module: Any, name: str, target_batch: int | None, who: str
) -> int:
    """The effective batch to keep (micro-batch x accumulation x ranks): ``target_batch``, else
    the batch size where ``train_dataloader()`` reads it (``read_batch_size``) x the trainer's
    accumulation x ranks; a multiple of the ranks."""
    world = trainer.world_size
    if target_batch is None:
        target_batch = read_batch_size(trainer, module, name, who=who)
        target_batch *= trainer.accumulate_grad_batches * world
    if target_batch % world:
        raise SettingsError(
            f"{who}: target_batch={target_batch} is not a multiple of {world} ranks."
        )
    return target_batch


def check_one_sizer(trainer: Any, me: Any) -> None:
    """Refuse a fit where a callback other than ``me`` sets the batch size too."""
    sizers = other_sizers(trainer, me)
    if sizers:
        raise SettingsError(
            f"{type(me).__name__} sets the micro-batch and the accumulation itself; "
            f"{', '.join(sizers)} would set the batch size too. Keep one of them."
        )


def other_sizers(trainer: Any, me: Any) -> list[str]:
    """The callbacks of ``trainer`` other than ``me`` that set the batch size (EfficientBatchSize,
    with or without a target; Lightning's BatchSizeFinder), by class name."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    from lightning_efficient.techniques.batch_size import EfficientBatchSize

    return [
        type(cb).__name__
        for cb in trainer.callbacks
        if cb is not me and isinstance(cb, (EfficientBatchSize, BatchSizeFinder))
    ]


def apply_batch(trainer: Any, module: Any, name: str, micro: int, accumulation: int) -> Change:
    """Set the batch size in every place it lives (the datamodule, the module, their hparams)
    and ``trainer.accumulate_grad_batches``; undo puts each back."""
    batch = set_batch_size(trainer, module, name, micro)
    before = trainer.accumulate_grad_batches
    trainer.accumulate_grad_batches = accumulation

    def undo() -> None:
        trainer.accumulate_grad_batches = before
        batch.undo()

    return Change(
        f"{batch.what}, accumulation {before} -> {accumulation}",
        undo,
        figures={"micro_batch": micro, "accumulation": accumulation},
    )


#: The callbacks AutoEfficient adds (a rung's, and ExactAccumulation; their default ``state_key`` is
#: the class name).
_STACK_CALLBACKS = (
    "ExactAccumulation",
    "ActivationCheckpointing",
    "ChunkedCrossEntropy",
    "OptimizerSwap",
    "FrozenWeights4bit",
)


def quiet_restore_warning() -> Change:
    """Lightning warns, before any callback's ``on_load_checkpoint``, of the checkpoint's
    callback entries that no given callback has ("Please add the following callbacks"): the
    stack AutoEfficient puts in place in its own ``on_load_checkpoint`` is not there yet. The
    warning is silenced while it names the ladder's callbacks alone; undo removes the filter."""
    import warnings

    names = "|".join(_STACK_CALLBACKS)
    warnings.filterwarnings(
        "ignore",
        message=r"Be aware that when using `ckpt_path`.*Please add the following callbacks: "
        rf"\[(?:'(?:{names})'(?:, )?)+\]\.?$",
    )
    entry = warnings.filters[0]

    def undo() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)

    return Change("the restore warning about the stack's own callbacks silenced", undo)


def stack_callbacks(trainer: Any, rung: Rung) -> list[Any]:
    """The rung's callbacks, built fresh, less those whose class the fit already has (a
    technique the fit has is used as given, never added twice)."""
    have = {type(cb) for cb in trainer.callbacks}
    return [cb for cb in rung.build()[0] if type(cb) not in have]


#: What AutoEfficient says on a trainer built with 32-true precision.
BF16_NEEDS_YAML = (
    "the ladder's bf16-mixed stacks need the trainer's precision "
    "(`trainer.precision: bf16-mixed`, or `lightning-efficient fit --auto`)"
)

#: What AutoEfficient says on full-weight training by a trainer not built with bf16-true.
BF16_WEIGHTS_NEED_YAML = (
    "the ladder's bf16-weights stacks (adamw_sr, adamw8bit_sr) need a trainer built with "
    "bf16-true, which a callback cannot change (`trainer.precision: bf16-true`, or "
    "`lightning-efficient fit --auto`)"
)


def add_callbacks(trainer: Any, after: Any, callbacks: Sequence[Any]) -> Change:
    """Put ``callbacks`` into ``trainer.callbacks`` right after ``after``: Lightning calls the
    hooks of the list as it stands, so they run their own ``setup`` (and every later hook, and
    their state is restored from a checkpoint) as if they had been given. Undo takes them out.
    In place, and before anything that sets a new list (``add_exact_accumulation``): Lightning's
    ``on_load_checkpoint`` loop walks the list it started with."""
    index = trainer.callbacks.index(after) + 1
    trainer.callbacks[index:index] = list(callbacks)
    added = list(callbacks)

    def undo() -> None:
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if all(cb is not a for a in added)]

    names = ", ".join(type(cb).__name__ for cb in added) or "none"
    return Change(f"callbacks added: {names}", undo if added else None, value=added)


def decide_for(
    trainer: Any,
    module: Any,
    source: Any,
    budget_bytes: int,
    effective: int,
    *,
    goal: str,
    trial: bool,
    bf16: bool = False,
    trainer_fixed: bool = True,
    exclude: Sequence[Any] = (),
    host_budget_bytes: int | None = None,
) -> Decision:
    """The decision for a fit of ``module`` by ``trainer`` (before the fit or in its ``setup``):
    the worst-case batch from ``source``'s train DataLoader (the datamodule, else the module),
    the estimate for the trainer's device with the techniques it already has (but ``exclude``),
    real trial steps on its device when ``trial``. ``trainer_fixed``: the Trainer stays as built
    (a callback), so rungs that need another precision or a strategy are not usable and the
    ladder keeps the trainer's precision (``bf16`` is ignored); otherwise (``fit --auto``) every
    rung is usable, and ``bf16`` adds the bf16-mixed rungs."""
    loader = source.train_dataloader()
    make_batch, n_data = worst_case_sampler(loader, 10_000)
    world = trainer.world_size
    share = None if n_data is None else n_data // world
    if share is not None and effective > share:  # a step would take more than the data holds
        raise SettingsError(
            f"AutoEfficient: the effective batch {effective * world} (micro-batch x accumulation "
            f"x {world} rank(s)) needs {effective} samples per rank for each step; the training "
            f"set has {n_data} ({share} per rank). Lower target_batch (or the batch size x "
            f"accumulate_grad_batches) to at most {share * world}."
        )
    settings = estimate_settings(trainer, exclude=list(exclude))
    settings["precision"] = str(trainer.precision)  # the ladder's (each rung estimates its own)
    decision = decide_stack(
        module,
        make_batch,
        budget_bytes,
        effective,
        goal=goal,
        bf16=bf16,
        trainer_fixed=trainer_fixed,
        trial_on=trainer.strategy.root_device if trial else None,
        host_budget_bytes=host_budget_bytes,
        **settings,
    )
    if share is not None:
        drop_last = bool(getattr(loader, "drop_last", False))
        last = epoch_end_step(share, decision.micro, decision.accumulation, drop_last)
        if last is not None:
            decision.warnings.append(
                f"the effective batch is not kept at epoch ends: {share} samples per rank give "
                f"steps of {decision.micro * decision.accumulation} and a last step of {last} "
                "(Lightning steps at every epoch end); an effective batch that divides the "
                "samples per rank keeps it"
            )
    return decision


def decide_stack(
    model: Any,
    make_batch: Callable[[int], Any],
    budget: int | str,
    effective: int,
    *,
    goal: str = "speed",
    precision: str = "32-true",
    bf16: bool = True,
    trainer_fixed: bool = False,
    trial_on: Any = None,
    host_budget_bytes: int | None = None,
    **settings: Any,
) -> Decision:
    """AutoEfficient's decision without a trainer: the stack and the micro-batch (an exact
    divisor of one rank's ``effective`` batch) for ``model``, its batches of ``n`` samples from
    ``make_batch(n)`` (the worst case: the longest samples), within ``budget`` (bytes or
    ``"24GiB"``), by ``goal`` (``"speed"`` or ``"memory"``). The ladder
    (:func:`ladder_for`, with the bf16-mixed rungs where ``bf16`` and the model trains in
    ``precision`` "32-true"), its estimates (:func:`estimate_measure`) and the one search
    (:func:`~lightning_efficient.planning.search.decide`); :func:`decide_for` is this for a fit.

    ``settings``: the estimate's keywords (``optimizer``, ``loss_fn``, ``device``: the target
    modelled, e.g. ``"cuda"`` or ``"cuda:a100"``; ``callbacks``: techniques the fit has;
    ``world_size``, ``sharding``). ``trainer_fixed``: a Trainer is built already (a callback),
    so rungs that need another precision or a strategy are unusable (and ``bf16`` is ignored).
    ``trial_on``: a device to confirm the pick with real steps on (``None``: estimates only).
    ``host_budget_bytes``: host memory the offloading rungs may keep (``None``: no limit).

    Example (GPT-2 small, nothing allocated: the model on the meta device)::

        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config())
        decision = decide_stack(
            model, lambda n: torch.zeros(n, 1024, dtype=torch.long), "24GiB", 64,
            loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss, device="cuda",
        )
        print(decision.summary(), decision.to_yaml("data"), sep="\n")
    """
    budget_bytes = parse_bytes("budget", budget)
    check_choice("goal", goal, GOALS)
    settings = {
        **settings,
        "precision": precision,
        "device": resolve_target(settings.get("device")),
    }
    configured = list(settings.get("callbacks", ()))
    rungs = ladder_for(
        model,
        precision=precision,
        bf16=bf16 and not trainer_fixed,
        world_size=settings.get("world_size", 1),
        sharding=settings.get("sharding"),
        configured=configured,
    )
    runner = None
    if trial_on is not None:
        device = torch.device(trial_on) if isinstance(trial_on, str) else trial_on
        runner = trial_runner(model, make_batch, budget_bytes, effective, device, configured)
    return decide(
        rungs,
        estimate_measure(model, make_batch, budget_bytes, effective, settings),
        budget_bytes,
        effective,
        goal=goal,
        world_size=settings.get("world_size", 1),
        unusable=(lambda rung: fixed_by_trainer(rung, precision))
        if trainer_fixed
        else own_accumulation,
        trial=runner,
        target=settings["device"].label,
        host_budget_bytes=host_budget_bytes,
    )
