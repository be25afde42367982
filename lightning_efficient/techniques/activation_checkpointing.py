"""Activation checkpointing for any model, with no opt-in from the model.

Blocks are chosen by ``techniques._blocks.select_modules`` (``"auto"``: the repeated blocks,
or a class, class name, name glob or ``"re:<regex>"``). A chosen block is wrapped *in place*:
its instance ``forward`` is shadowed by a callable that runs the original forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG state preserved. No
module is replaced or renamed, so ``state_dict`` keys never change, and
``remove_activation_checkpointing`` restores the model exactly.

Modes:

- full: a checkpointed block keeps only its inputs; its activations are recomputed in backward.
- ``selective=True``: a checkpointed block keeps the outputs of matmuls and attention and
  recomputes only the cheap ops (norms, activations, dropout, adds), through
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
- ``offload_activations=True``: the blocks that are *not* checkpointed keep their saved
  activations in pinned host memory (copied on a side CUDA stream, brought back in backward)
  through ``torch.autograd.graph.saved_tensors_hooks``. CPU tensors are left where they are.
- budget: ``blocks_for_budget`` uses the memory estimate to find the fewest blocks to
  checkpoint that bring the estimated peak under a budget.

``ActivationCheckpointing`` is the Lightning callback: it decides when to apply these.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    SettingsError,
    check_bool,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.settings import estimate_settings
from lightning_efficient.techniques._block_savings import (
    LITTLE,
    BlockRanking,
    GroupSaving,
    little_saving,
    rank_groups,
)
from lightning_efficient.techniques._blocks import (
    BlockGroup,
    candidate_groups,
    check_policy,
    select_modules,
)
from lightning_efficient.techniques._kv_cache import apply_training_without_cache
from lightning_efficient.techniques._recompute import ATTR as _ATTR
from lightning_efficient.techniques._recompute import SELECTIVE_SAVE_OPS
from lightning_efficient.techniques._recompute import unwrap_block as _unwrap
from lightning_efficient.techniques._recompute import wrap_block as _wrap

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "blocks_for_budget",
    "BudgetChoice",
    "rank_blocks",
    "BlockRanking",
    "SELECTIVE_SAVE_OPS",
]


def checkpointed_blocks(module: nn.Module) -> dict[str, str]:
    """The wrapped blocks of ``module``: name -> ``"full"``, ``"selective"`` or ``"offload"``."""
    return {n: m.__dict__[_ATTR]["mode"] for n, m in module.named_modules() if _ATTR in m.__dict__}


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo ``apply_activation_checkpointing`` on every block of ``module``; returns the names of
    the blocks that were checkpointed (not those that were only offloading)."""
    names = []
    for name, m in module.named_modules():
        if _ATTR in m.__dict__:
            if m.__dict__[_ATTR]["mode"] != "offload":
                names.append(name)
            _unwrap(m)
    return names


def _choose(
    module: nn.Module, policy: Any, every_n: int, num_blocks: int | None
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(blocks to checkpoint, the other selected blocks) in forward order."""
    blocks = select_modules(module, policy, argument="policy")
    chosen = [b for i, b in enumerate(blocks) if i % every_n == 0]
    if num_blocks is not None:
        chosen = chosen[:num_blocks]
    ids = {id(m) for _, m in chosen}
    return chosen, [b for b in blocks if id(b[1]) not in ids]


def apply_activation_checkpointing(
    module: nn.Module,
    policy: Any = "auto",
    *,
    every_n: int = 1,
    selective: bool = False,
    offload_activations: bool = False,
    num_blocks: int | None = None,
) -> Change:
    """Checkpoint blocks of ``module`` in place; returns the ``Change``: its ``value`` is the
    names of the checkpointed blocks, its ``undo()`` puts back the wrapping ``module`` had.

    Args:
        module: Any ``nn.Module`` (a LightningModule, a HF model, ...). It is not replaced and
            its ``state_dict`` keys do not change.
        policy: Which blocks: ``"auto"`` (the repeated blocks), a module class, a class name,
            a name glob (``"transformer.h.*"``), ``"re:<regex>"``, or a list of these. A policy
            that matches nothing raises a ``ValueError`` listing candidate blocks.
        every_n: Checkpoint every n-th of the selected blocks (the 1st, the (n+1)-th, ...).
        selective: Keep matmul and attention outputs and recompute only the cheap ops.
        offload_activations: Keep the saved activations of the selected blocks that are *not*
            checkpointed in pinned host memory (CUDA tensors only; CPU tensors stay).
        num_blocks: Checkpoint only the first ``num_blocks`` of them (used by the budget mode).

    Applying again replaces the previous settings (idempotent for the same arguments);
    ``remove_activation_checkpointing`` removes every block's.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module; got {type(module).__name__}.")
    check_policy(policy, argument="policy")
    check_int("every_n", every_n, minimum=1)
    check_bool("selective", selective)
    check_bool("offload_activations", offload_activations)
    check_int("num_blocks", num_blocks, minimum=0, allow_none=True)
    chosen, others = _choose(module, policy, every_n, num_blocks)
    before = checkpointed_blocks(module)
    remove_activation_checkpointing(module)
    mode = "selective" if selective else "full"
    for _, block in chosen:
        _wrap(block, mode)
    if offload_activations:
        for _, block in others:
            _wrap(block, "offload")
    names = [n for n, _ in chosen]
    what = f"{mode} checkpointing of {len(names)}/{len(chosen) + len(others)} blocks"
    if not chosen and num_blocks == 0:  # a budget the plain run meets: nothing was needed
        what = "no block checkpointed: the plain run fits the budget"
    elif not chosen and not others:
        what = "no block checkpointed: " + (
            "the model has no repeated blocks" if policy == "auto" else "no block selected"
        )
    if names:
        what += f" ({type(chosen[0][1]).__name__}: {_span(names)})"
    if offload_activations and others:
        what += f"; saved activations of {len(others)} other blocks offloaded to host"
    return Change(
        what,
        functools.partial(_restore, module, before),
        figures={"blocks_wrapped": len(names)},
        value=names,
    )


# -- auto: blocks ranked by the activation memory they free ----------------------------------------
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
            _wrap(modules[name], mode)

    restore = functools.partial(_restore, model, before)
    return rank_groups(model, batch, groups, checkpoint, restore, **estimate_kwargs)


def _measured(
    model: nn.Module, batch: Any, policy: Any, selective: bool, settings: dict[str, Any]
) -> tuple[BlockRanking, GroupSaving | None]:
    """The ranking for ``policy`` and, when the policy's blocks free little, a group that frees
    more than twice as much (or ``None``)."""
    ranking = rank_blocks(model, batch, policy, selective=selective, **settings)
    chosen = ranking.best
    if policy == "auto" or chosen is None or ranking.share(chosen) >= LITTLE:
        return ranking, None
    others = rank_blocks(model, batch, "auto", selective=selective, **settings)
    best = others.best
    return ranking, best if best is not None and best.saved_bytes > 2 * chosen.saved_bytes else None


#: What a nested estimate repeats of the plan (world size and sharding: the budget bounds one
#: rank's peak, ``measure/per_rank.py``; the allocator rounding of the outer estimate).
_PLAN_SETTINGS = (
    "optimizer",
    "precision",
    "accumulate_grad_batches",
    "loss_fn",
    "world_size",
    "sharding",
    "cuda_rounding",
    "device",
)


# -- budget mode ----------------------------------------------------------------------------------
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
    allocation) for a binary search over the number of checkpointed blocks: about
    ``2 + log2(blocks)`` estimates (one if the plain run fits). Raises ``ValueError`` giving the smallest achievable peak if
    even checkpointing every candidate block does not fit.
    """
    from lightning_efficient.measure.estimate import estimate_memory

    budget_bytes = parse_bytes("budget", budget)
    check_int("every_n", every_n, minimum=1)
    chosen, _ = _choose(model, policy, every_n, None)
    total = len(chosen)
    before = checkpointed_blocks(model)
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
                cache[k] = estimate_memory(model, batch, **estimate_kwargs)
            finally:
                _restore(model, before)
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
        activation_bytes=_activations(best),
        plain_activation_bytes=_activations(plain),
        peaks={k: e.peak_bytes for k, e in sorted(cache.items())},
    )


def _activations(est: Any) -> int:
    """Activation bytes of an estimate: at its peak, or the phase peak if recorded."""
    return int(est.by_category.get("activations", 0))


def _restore(module: nn.Module, state: dict[str, str]) -> None:
    remove_activation_checkpointing(module)
    mods = dict(module.named_modules())
    for name, mode in state.items():
        _wrap(mods[name], mode)


# -- the callback ---------------------------------------------------------------------------------
class ActivationCheckpointing(Technique):
    """Activation checkpointing for an unmodified LightningModule: fewer activations kept for
    backward, recomputed instead (same maths, including dropout).

    Args:
        policy: Which blocks to checkpoint: ``"auto"`` (of the model's candidate block groups,
            the one whose checkpointing frees the most activation memory, measured by the
            estimate on the first batch), a class name (``"GPT2Block"``), a module class, a name
            glob (``"model.layers.*"``), ``"re:<regex>"`` over qualified names, or a list of
            these. Blocks that free less than 5% of the activation memory are reported.
        every_n: Checkpoint every n-th selected block (1 = all of them).
        selective: Keep matmul/attention outputs and recompute only cheap ops (less memory
            saved, less recompute time).
        offload_activations: Move the saved activations of the selected blocks that are not
            checkpointed to pinned host memory (CUDA only; on CPU it changes nothing).
        budget: A peak-memory budget (bytes or a string like ``"12GiB"``). When set, the memory
            estimate picks the fewest blocks to checkpoint (every ``every_n``-th, from the first)
            that bring the estimated peak under it; fit fails if even all of them cannot.

    The blocks are wrapped in place when fit starts (``on_fit_start``, so layers built in
    ``configure_model`` are seen; under DDP the inner module's blocks are wrapped); with
    ``"auto"`` or a budget, at the first training batch (the estimate needs a batch). They are
    unwrapped at the end of fit, and when fit raises or is interrupted. ``state_dict`` keys
    never change.
    """

    stacks = False

    def __init__(
        self,
        policy: str | list[str] | type = "auto",
        every_n: int = 1,
        selective: bool = False,
        offload_activations: bool = False,
        budget: int | str | None = None,
    ) -> None:
        super().__init__()
        check_policy(policy, argument="policy")
        self.policy = list(policy) if isinstance(policy, tuple) else policy
        self.every_n = check_int("every_n", every_n, minimum=1)
        self.selective = check_bool("selective", selective)
        self.offload_activations = check_bool("offload_activations", offload_activations)
        parse_bytes("budget", budget, allow_none=True)
        self.budget = budget
        self.wrapped: list[str] = []
        self.choice: BudgetChoice | None = None
        self.ranking: BlockRanking | None = None  # the measured saving (auto: of each candidate)
        self._better: GroupSaving | None = None
        self._policy: Any = self.policy  # "auto" resolved to the measured best group
        self._pending = False
        self._check = False
        self._change = Change("no block checkpointed")
        self._selected = 0  # the blocks the policy selects (of which ``wrapped`` are checkpointed)

    # -- the estimate -------------------------------------------------------------------------
    def configure_estimate(self, plan: Any) -> None:
        """Make ``estimate_memory(..., callbacks=[self])`` run with these blocks checkpointed.

        With ``"auto"`` the candidate groups are ranked first, and with a budget the budget
        search runs, on the plan's model and batch (nested estimates), so the estimate shows the
        blocks a fit would checkpoint."""
        model = plan.model
        plan.on_exit(apply_training_without_cache(model).undo)  # no key/value cache (issue 39)
        num_blocks = None
        settings = {k: getattr(plan, k) for k in _PLAN_SETTINGS}
        self._policy = self.policy
        if self.policy == "auto":
            self._measure(model, plan.batch, settings)
        if self.budget is not None:
            choice = blocks_for_budget(
                model,
                plan.batch,
                self.budget,
                self._policy,
                every_n=self.every_n,
                selective=self.selective,
                **settings,
            )
            num_blocks = choice.num_blocks
        # offload is not run on fake tensors (no streams, no pinned memory): counted on device
        change = self._apply(model, num_blocks, offload=False)
        plan.on_exit(change.undo)
        plan.note(f"{self.name}: {change.what}")
        if self.offload_activations:
            others = len(_choose(model, self._policy, self.every_n, num_blocks)[1])
            plan.note(
                f"{self.name}: offload_activations is not modelled by the estimate; the saved "
                f"activations of the {others} blocks that would offload are counted on the device "
                "(an upper bound)."
            )

    # -- hooks ----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.record(trainer, apply_training_without_cache(pl_module))
        own = [n for n, m in pl_module.named_modules() if _checkpoints_itself(m)]
        if own:
            self.warn(_OWN.format(span=_span(own)))
        self._policy, self.ranking, self._better = self.policy, None, None
        if self.budget is not None or self.policy == "auto":
            # the estimate needs a batch: rank the blocks / search the budget at the first batch
            self._pending = True
            self._select(pl_module)  # fail now if the policy matches nothing
            return
        self._change = self.record(trainer, self._apply(pl_module, None))
        self._report(trainer, pl_module)
        self._check = True  # measure what the chosen blocks save at the first batch

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (self._pending or self._check):
            return
        settings = estimate_settings(trainer, exclude=[self])
        if self._check:  # explicit policy, no budget: already applied; measure what it saves
            self._check = False
            self._measure(pl_module, batch, settings)
            if self.ranking is not None:
                self._report(trainer, pl_module)  # again, with what the blocks save
            return
        self._pending = False
        if self.policy == "auto":
            self._measure(pl_module, batch, settings)
        if self.budget is not None:
            self.choice = blocks_for_budget(
                pl_module,
                batch,
                self.budget,
                self._policy,
                every_n=self.every_n,
                selective=self.selective,
                **settings,
            )
        num_blocks = self.choice.num_blocks if self.choice else None
        self._change = self.record(trainer, self._apply(pl_module, num_blocks))
        self._report(trainer, pl_module)

    # -- helpers ----------------------------------------------------------------------------
    def _measure(self, model: nn.Module, batch: Any, settings: dict[str, Any]) -> None:
        """Rank the candidate groups (``"auto"``: take the best; nothing to rank with one) or
        measure the policy's blocks."""
        self.ranking, self._better = None, None
        if self.policy == "auto" and len(candidate_groups(model, limit=2)) < 2:
            return
        try:
            self.ranking, self._better = _measured(
                model, batch, self.policy, self.selective, settings
            )
        except Exception as err:  # noqa: BLE001 - e.g. a model the fake estimate cannot run
            auto = " auto takes the repeated blocks with the most parameters." * (
                self.policy == "auto"
            )
            self.note(
                f"could not measure what the blocks save ({type(err).__name__}: {err});{auto}"
            )
            return
        if self.policy == "auto" and self.ranking.best is not None:
            self._policy = self.ranking.best.group.policy

    def _select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return _choose(model, self._policy, self.every_n, None)[0]

    def _apply(self, model: nn.Module, num_blocks: int | None, offload: bool = True) -> Change:
        return apply_activation_checkpointing(
            model,
            self._policy,
            every_n=self.every_n,
            selective=self.selective,
            offload_activations=self.offload_activations and offload,
            num_blocks=num_blocks,
        )

    def _savings(self, figures: dict[str, Any]) -> str:
        """What the measured ranking says the chosen blocks save (``figures`` get its numbers)."""
        ranking = self.ranking
        chosen = ranking.best if ranking is not None else None
        if ranking is None or chosen is None or self.every_n > 1:
            return ""
        figures.update(
            activations_before_bytes=ranking.plain_activation_bytes,
            activations_saved_bytes=chosen.saved_bytes,
        )
        little = little_saving(ranking, chosen, self._better)
        if little is None:
            return f"; {ranking.describe(chosen)}"
        self.no_effect(little)
        return f"; saves little: {ranking.describe(chosen)}"

    def checkpoint_state(self) -> dict[str, int]:
        """For the profiler's advice: blocks checkpointed, of the blocks the policy selects."""
        return {"blocks": len(self.wrapped), "of": self._selected}

    def _report(self, trainer: Any, pl_module: Any) -> None:
        change = self._change
        self.wrapped = list(change.value)
        self._selected = (
            len(select_modules(pl_module, self._policy, argument="policy")) if self.wrapped else 0
        )
        figures: dict[str, Any] = {}
        what = change.what
        plain_fits = self.choice is not None and self.choice.num_blocks == 0
        if not self.wrapped and self.policy == "auto" and not plain_fits:
            self.no_effect(
                "no block to checkpoint: the model has no repeated blocks and no block in a "
                "ModuleList/Sequential/ModuleDict. Pass `policy=` a module class, a class name or a "
                "name glob."
            )
        if self.choice is not None:
            c = self.choice
            if c.num_blocks == 0:
                what = (
                    f"no block checkpointed: the plain peak {format_bytes(c.plain_peak_bytes)} fits"
                )
                self.note("the plain run already fits the budget; no block is checkpointed.")
            what += (
                f" (budget {format_bytes(c.budget_bytes)}, estimated peak "
                f"{format_bytes(c.plain_peak_bytes)} -> {format_bytes(c.peak_bytes)})"
            )
            figures.update(
                blocks_total=c.total,
                budget_bytes=c.budget_bytes,
                peak_before_bytes=c.plain_peak_bytes,
                peak_after_bytes=c.peak_bytes,
                activations_before_bytes=c.plain_activation_bytes,
                activations_after_bytes=c.activation_bytes,
            )
        elif self.wrapped:
            what += self._savings(figures)
        self.report(trainer, what, **{**change.figures, **figures})
        self.note(what)
        if self.offload_activations:
            device = getattr(getattr(trainer, "strategy", None), "root_device", None)
            if getattr(device, "type", None) != "cuda":
                self.note(
                    "offload_activations=True changes nothing on a CPU device: activations are "
                    "already in host memory."
                )


_OWN = (
    "the model's own gradient checkpointing is on ({span}); with this callback the blocks would "
    "be recomputed twice. Turn one off (e.g. `model.gradient_checkpointing_disable()` for a "
    "transformers model)."
)


def _checkpoints_itself(module: nn.Module) -> bool:
    return getattr(module, "gradient_checkpointing", False) is True


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
