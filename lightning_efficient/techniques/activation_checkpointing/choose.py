"""Which blocks to checkpoint, measured by the memory estimate: one decision, ``choose_blocks``.

- ``rank_blocks``: block groups ranked by the activation memory checkpointing them frees (one
  estimate without checkpointing and one per group, ``savings.py``).
- ``blocks_for_budget``: the fewest blocks to checkpoint that bring the estimated peak under a
  budget (a binary search over the number of blocks).
- ``choose_blocks``: the callback's decision, the same in ``configure_estimate`` (on the plan's
  model and batch) and at the first training batch: ``"auto"`` resolved to the group that frees
  the most, then the budget search. ``BlockChoice.describe`` says what a fit reports.

Each estimate runs at most two micro-batches of an accumulation window: the peak of a window is
reached by its second micro-batch (the first one's gradients live through its forward and
backward); later micro-batches repeat it. So the decision costs the same at any
``accumulate_grad_batches``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_efficient.core.validate import (
    SettingsError,
    check_int,
    error_text,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.techniques._blocks import BlockGroup, candidate_groups, select_modules
from lightning_efficient.techniques.activation_checkpointing.apply import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    remove_activation_checkpointing,
    restore_blocks,
    split_blocks,
)
from lightning_efficient.techniques.activation_checkpointing.recompute import wrap_block
from lightning_efficient.techniques.activation_checkpointing.savings import (
    LITTLE,
    BlockRanking,
    GroupSaving,
    little_saving,
    rank_groups,
)

__all__ = [
    "rank_blocks",
    "blocks_for_budget",
    "BudgetChoice",
    "BlockChoice",
    "Summary",
    "choose_blocks",
    "PLAN_SETTINGS",
    "window_of_two",
]

#: What a nested estimate repeats of the plan (world size and sharding: the budget bounds one
#: rank's peak, ``measure/memory/per_rank.py``; the allocator rounding of the outer estimate).
PLAN_SETTINGS = (
    "optimizer",
    "precision",
    "accumulate_grad_batches",
    "loss_fn",
    "world_size",
    "sharding",
    "cuda_rounding",
    "device",
)


def window_of_two(estimate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``estimate_kwargs`` with at most two micro-batches per step: the same peak as the whole
    accumulation window, at a cost that does not grow with it."""
    accumulation = int(estimate_kwargs.get("accumulate_grad_batches", 1) or 1)
    return {**estimate_kwargs, "accumulate_grad_batches": min(accumulation, 2)}


def rank_blocks(
    model: nn.Module,
    batch: Any,
    policy: Any = "auto",
    *,
    selective: bool = False,
    limit: int = 6,
    **estimate_kwargs: Any,
) -> BlockRanking:
    """Block groups of ``model`` ranked by the activation memory checkpointing them frees on
    ``batch``, best first, measured by the estimate (fake tensors: one estimate per group and one
    without checkpointing).

    ``policy="auto"`` ranks ``candidate_groups(model, limit)`` (sibling groups, block classes,
    single blocks); any other policy measures the blocks it selects, as one group.
    ``estimate_kwargs`` as ``estimate_memory``'s (precision, callbacks, loss_fn, ...); the ranking
    runs one step with a stateless optimizer, whatever ``optimizer`` is given.
    """
    if policy == "auto":
        groups = candidate_groups(model, limit)
    else:
        found = select_modules(model, policy)
        cls = "/".join(dict.fromkeys(type(m).__name__ for _, m in found))
        size = sum(p.numel() for _, m in found for p in m.parameters())
        groups = [BlockGroup([n for n, _ in found], cls, "policy", size)]
    before = checkpointed_blocks(model)
    mode = "selective" if selective else "full"

    def checkpoint(names: list[str]) -> None:
        remove_activation_checkpointing(model)
        modules = dict(model.named_modules())
        for name in names:
            wrap_block(modules[name], mode)

    restore = functools.partial(restore_blocks, model, before)
    kwargs = window_of_two(estimate_kwargs)
    return rank_groups(model, batch, groups, checkpoint, restore, **kwargs)


@dataclass
class BudgetChoice:
    """What ``blocks_for_budget`` found: checkpoint the first ``num_blocks`` of ``total`` blocks.

    ``peaks`` maps every number of blocks that was estimated to its estimated peak bytes.
    """

    num_blocks: int
    total: int
    budget_bytes: int
    peak_bytes: int
    plain_peak_bytes: int
    activation_bytes: int = 0
    plain_activation_bytes: int = 0
    peaks: dict[int, int] = field(default_factory=dict)


def blocks_for_budget(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    policy: Any = "auto",
    *,
    every_n: int = 1,
    selective: bool = False,
    **estimate_kwargs: Any,
) -> BudgetChoice:
    """The fewest blocks to checkpoint so that the estimated peak memory is at most ``budget``.

    Runs the instrument's ``estimate_memory(model, batch, **estimate_kwargs)`` (fake tensors, no
    allocation; at most two micro-batches of an accumulation window, which hold its peak) for a
    binary search over the number of checkpointed blocks: about ``2 + log2(blocks)`` estimates
    (one if the plain run fits). Raises ``ValueError`` giving the smallest achievable peak if
    even checkpointing every candidate block does not fit.
    """
    from lightning_efficient.measure.memory.estimate import estimate_memory

    budget_bytes = parse_bytes("budget", budget)
    check_int("every_n", every_n, minimum=1)
    total = len(split_blocks(model, policy, every_n, None)[0])
    before = checkpointed_blocks(model)
    kwargs = window_of_two(estimate_kwargs)
    cache: dict[int, Any] = {}

    def estimate(k: int) -> Any:
        if k not in cache:
            try:
                if k:
                    apply_activation_checkpointing(
                        model, policy, every_n=every_n, selective=selective, num_blocks=k
                    )
                else:
                    remove_activation_checkpointing(model)
                cache[k] = estimate_memory(model, batch, **kwargs)
            finally:
                restore_blocks(model, before)
        return cache[k]

    plain = estimate(0)
    lo, hi = 0, 0  # invariant: estimate(hi) fits the budget; the answer is in [lo, hi]
    if not plain.fits(budget_bytes):
        full = estimate(total)
        if not full.fits(budget_bytes):
            hint = " Without `selective` more is recomputed and less kept." if selective else ""
            hint += " With every_n=1 every block is checkpointed." if every_n > 1 else ""
            raise SettingsError(
                f"`budget`={budget!r} ({format_bytes(budget_bytes)}) cannot be reached by activation "
                f"checkpointing: the smallest achievable peak is {format_bytes(full.required_bytes)} "
                f"({full.required_bytes} bytes) with all {total} blocks checkpointed"
                f"{' selectively' if selective else ''} (without: {format_bytes(plain.peak_bytes)}).{hint} "
                "Raise the budget or add a technique that saves other memory (optimizer state, "
                "parameters, a smaller batch)."
            )
        lo, hi = 1, total
    while lo < hi:
        mid = (lo + hi) // 2
        if estimate(mid).fits(budget_bytes):
            hi = mid
        else:
            lo = mid + 1
    best = estimate(hi)
    return BudgetChoice(
        num_blocks=hi,
        total=total,
        budget_bytes=budget_bytes,
        peak_bytes=best.peak_bytes,
        plain_peak_bytes=plain.peak_bytes,
        activation_bytes=int(best.by_category.get("activations", 0)),
        plain_activation_bytes=int(plain.by_category.get("activations", 0)),
        peaks={k: e.peak_bytes for k, e in sorted(cache.items())},
    )


@dataclass
class Summary:
    """What a fit says about a choice: the report's row and figures, notes, no-effect warnings."""

    what: str
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    no_effect: list[str] = field(default_factory=list)


_NOTHING_REPEATED = (
    "no block to checkpoint: the model has no repeated blocks and no block in a "
    "ModuleList/Sequential/ModuleDict. Pass `policy=` a module class, a class name or a "
    "name glob."
)


@dataclass
class BlockChoice:
    """The decision ``choose_blocks`` made.

    ``policy``: the blocks to select (``"auto"`` resolved to the measured best group);
    ``num_blocks``: how many of every ``every_n``-th selected block to checkpoint (``None``:
    all); ``ranking``/``better``: what was measured (``better``: a group that frees more than
    twice what an explicit policy's blocks free); ``budget``: the budget search;
    ``notes``: what could not be measured.
    """

    policy: Any
    num_blocks: int | None = None
    ranking: BlockRanking | None = None
    better: GroupSaving | None = None
    budget: BudgetChoice | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self, what: str, wrapped: int, *, auto: bool, every_n: int) -> Summary:
        """The report's row for the blocks applied (``what``: the change's line, ``wrapped``:
        how many blocks it checkpointed); ``auto``: the policy was ``"auto"``."""
        out = Summary(what)
        c = self.budget
        if not wrapped and auto and not (c is not None and c.num_blocks == 0):
            out.no_effect.append(_NOTHING_REPEATED)
        if c is not None:
            if c.num_blocks == 0:
                out.what = (
                    f"no block checkpointed: the plain peak {format_bytes(c.plain_peak_bytes)} fits"
                )
                out.notes.append("the plain run already fits the budget; no block is checkpointed.")
            out.what += (
                f" (budget {format_bytes(c.budget_bytes)}, estimated peak "
                f"{format_bytes(c.plain_peak_bytes)} -> {format_bytes(c.peak_bytes)})"
            )
            out.figures.update(
                blocks_total=c.total,
                budget_bytes=c.budget_bytes,
                peak_before_bytes=c.plain_peak_bytes,
                peak_after_bytes=c.peak_bytes,
                activations_before_bytes=c.plain_activation_bytes,
                activations_after_bytes=c.activation_bytes,
            )
            return out
        ranking = self.ranking
        chosen = ranking.best if ranking is not None else None
        if not wrapped or ranking is None or chosen is None or every_n > 1:
            return out
        out.figures.update(
            activations_before_bytes=ranking.plain_activation_bytes,
            activations_saved_bytes=chosen.saved_bytes,
        )
        little = little_saving(ranking, chosen, self.better)
        if little is None:
            out.what += f"; {ranking.describe(chosen)}"
        else:
            out.no_effect.append(little)
            out.what += f"; saves little: {ranking.describe(chosen)}"
        return out


def choose_blocks(
    model: nn.Module,
    batch: Any,
    policy: Any = "auto",
    *,
    budget: int | str | None = None,
    every_n: int = 1,
    selective: bool = False,
    rank: bool = False,
    **estimate_kwargs: Any,
) -> BlockChoice:
    """Which blocks of ``model`` to checkpoint for ``batch``; ``model`` is left as given.

    ``"auto"`` ranks the candidate groups (``rank_blocks``) and takes the one that frees the most
    (the repeated blocks when the estimate cannot run, said in ``notes``); ``rank=True``
    measures an explicit policy's blocks too (and a group that frees far more). With a
    ``budget`` the fewest blocks that bring the estimated peak under it (``blocks_for_budget``;
    raises ``SettingsError`` when none do). ``estimate_kwargs`` as ``estimate_memory``'s.
    """
    choice = BlockChoice(policy)
    if policy == "auto" or rank:
        _measure(choice, model, batch, selective, estimate_kwargs)
    if budget is not None:
        choice.budget = blocks_for_budget(
            model,
            batch,
            budget,
            choice.policy,
            every_n=every_n,
            selective=selective,
            **estimate_kwargs,
        )
        choice.num_blocks = choice.budget.num_blocks
    return choice


def _frozen(model: nn.Module, group: BlockGroup) -> bool:
    """Every parameter of ``group``'s blocks is frozen (a frozen backbone): whether checkpointing
    them frees anything depends on their inputs needing a gradient, so it is measured."""
    params = [p for name in group.names for p in model.get_submodule(name).parameters()]
    return bool(params) and not any(p.requires_grad for p in params)


def _measure(
    choice: BlockChoice, model: nn.Module, batch: Any, selective: bool, settings: dict[str, Any]
) -> None:
    """Rank the candidate groups (``"auto"``: take the best; nothing to rank with one) or
    measure the policy's blocks, into ``choice``."""
    auto = choice.policy == "auto"
    groups = candidate_groups(model, limit=2)
    if auto and len(groups) < 2 and not (groups and _frozen(model, groups[0])):
        return  # nothing to rank; a frozen group is measured (it may free nothing: said so)
    try:
        ranking = rank_blocks(model, batch, choice.policy, selective=selective, **settings)
        best = ranking.best
        if not auto and best is not None and ranking.share(best) < LITTLE:
            others = rank_blocks(model, batch, "auto", selective=selective, **settings).best
            if others is not None and others.saved_bytes > 2 * best.saved_bytes:
                choice.better = others
    except Exception as err:  # noqa: BLE001 - e.g. a model the fake estimate cannot run
        fallback = " auto takes the repeated blocks with the most parameters." * auto
        choice.notes.append(
            f"could not measure what the blocks save ({error_text(err)});{fallback}"
        )
        return
    choice.ranking = ranking
    if auto and best is not None:
        choice.policy = best.group.policy
