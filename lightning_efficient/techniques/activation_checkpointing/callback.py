"""``ActivationCheckpointing``: the Lightning callback. It decides *when*: the blocks are chosen
by ``choose.choose_blocks`` and wrapped by ``apply.apply_activation_checkpointing``."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_int, parse_bytes
from lightning_efficient.measure.memory.settings import estimate_settings
from lightning_efficient.techniques._blocks import check_policy, select_modules
from lightning_efficient.techniques.activation_checkpointing.apply import (
    apply_activation_checkpointing,
    span,
    split_blocks,
)
from lightning_efficient.techniques.activation_checkpointing.choose import (
    PLAN_SETTINGS,
    BlockChoice,
    BudgetChoice,
    choose_blocks,
)
from lightning_efficient.techniques.activation_checkpointing.savings import BlockRanking
from lightning_efficient.techniques.activation_checkpointing.tiling import apply_tiling, check_tile

__all__ = ["ActivationCheckpointing"]


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
        offload_boundaries: Keep the inputs the checkpointed blocks save for their recompute
            (one hidden state per block: what sets the peak at long sequences) in host memory
            between the forward and the recompute; on CUDA pinned, copied on a side stream and
            prefetched one block ahead (overlap expected, not measured). Same maths; the
            estimate counts them as host bytes.
        tile_sequence: Run each selected block's position-wise layers (MLP / feed-forward,
            layer / RMS norms) in tiles along the sequence, in the forward and the recompute, so
            their wide intermediates exist for one tile at a time: ``True`` (tiles of the layer's input width in tokens; shorter
            sequences run untiled), a number of tokens, or ``False``. Same maths (gradients
            summed over tiles).

    The blocks are wrapped in place when fit starts (``on_fit_start``, so layers built in
    ``configure_model`` are seen; under DDP the inner module's blocks are wrapped); with
    ``"auto"`` or a budget, at the first training batch (the estimate needs a batch). They are
    unwrapped at the end of fit, and when fit raises or is interrupted. ``state_dict`` keys
    never change.
    """

    stacks = False
    trains_without_cache = True

    def __init__(
        self,
        policy: str | list[str] | type = "auto",
        every_n: int = 1,
        selective: bool = False,
        offload_activations: bool = False,
        budget: int | str | None = None,
        offload_boundaries: bool = False,
        tile_sequence: bool | int = False,
    ) -> None:
        super().__init__()
        check_policy(policy, argument="policy")
        self.policy = list(policy) if isinstance(policy, tuple) else policy
        self.every_n = check_int("every_n", every_n, minimum=1)
        self.selective = check_bool("selective", selective)
        self.offload_activations = check_bool("offload_activations", offload_activations)
        parse_bytes("budget", budget, allow_none=True)
        self.budget = budget
        self.sharding_conflict = _BUDGET_SHARDED if budget is not None else None  # core.compat
        self.offload_boundaries = check_bool("offload_boundaries", offload_boundaries)
        check_tile(tile_sequence)
        self.tile_sequence = tile_sequence
        self.wrapped: list[str] = []
        self.blocks = BlockChoice(self.policy)  # the decision (and what it measured)
        self._pending = False
        self._check = False
        self._change = Change("no block checkpointed")
        self._selected = 0  # the blocks the policy selects (of which ``wrapped`` are checkpointed)
        self._tiling: Change | None = None

    @property
    def choice(self) -> BudgetChoice | None:
        """What the budget search found (``None`` without a budget)."""
        return self.blocks.budget

    @property
    def tiled(self) -> list[str]:
        """The layers run in tiles (``tile_sequence``)."""
        return list(self._tiling.value) if self._tiling is not None else []

    @property
    def ranking(self) -> BlockRanking | None:
        """The measured saving (``"auto"``: of each candidate group)."""
        return self.blocks.ranking

    def _choose(self, model: nn.Module, batch: Any, settings: dict[str, Any], rank: bool) -> None:
        self.blocks = choose_blocks(
            model,
            batch,
            self.policy,
            budget=self.budget,
            every_n=self.every_n,
            selective=self.selective,
            rank=rank,
            **settings,
        )
        for message in self.blocks.notes:
            self.note(message)

    # -- the estimate -------------------------------------------------------------------------
    def configure_estimate(self, plan: Any) -> None:
        """Make ``estimate_memory(..., callbacks=[self])`` run with these blocks checkpointed:
        ``choose_blocks`` on the plan's model and batch (nested estimates), as at a fit's first
        batch."""
        if tiling := self._tile(plan.model):
            plan.record(tiling)
            plan.note(f"{self.name}: {tiling.what}")
        settings = {k: getattr(plan, k) for k in PLAN_SETTINGS}
        self._choose(plan.model, plan.batch, settings, rank=False)
        # offload is not run on fake tensors (no streams, no pinned memory): counted on device
        change = self._apply(plan.model, offload=False)
        plan.record(change)
        plan.note(f"{self.name}: {change.what}")
        plan.figures["checkpointed_blocks"] = len(change.value)
        if self.offload_activations:
            others = split_blocks(plan.model, self.blocks.policy, self.every_n, None)[1]
            plan.note(
                f"{self.name}: offload_activations is not modelled by the estimate; the saved "
                f"activations of the {len(others)} blocks that would offload are counted on the "
                "device (an upper bound)."
            )

    # -- hooks ----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._tiling = self._tile(pl_module)
        if self._tiling is not None:
            self.record(trainer, self._tiling)
        own = [n for n, m in pl_module.named_modules() if _checkpoints_itself(m)]
        if own:
            self.warn(_OWN.format(span=span(own)))
        self.blocks = BlockChoice(self.policy)
        if self.budget is not None or self.policy == "auto":
            # the estimate needs a batch: choose at the first batch; fail now if nothing matches
            self._pending = True
            select_modules(pl_module, self.policy, argument="policy")
            return
        self._change = self.record(trainer, self._apply(pl_module))
        self._report(trainer, pl_module)
        self._check = True  # measure what the given blocks save at the first batch

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (self._pending or self._check):
            return
        settings = estimate_settings(trainer, exclude=[self])
        self._choose(pl_module, batch, settings, rank=self._check)
        if self._check:  # explicit policy, no budget: already applied; report what it saves
            self._check = False
            if self.ranking is not None:
                self._report(trainer, pl_module)
            return
        self._pending = False
        self._change = self.record(trainer, self._apply(pl_module))
        self._report(trainer, pl_module)

    # -- helpers ----------------------------------------------------------------------------
    def _apply(self, model: nn.Module, offload: bool = True) -> Change:
        return apply_activation_checkpointing(
            model,
            self.blocks.policy,
            every_n=self.every_n,
            selective=self.selective,
            offload_activations=self.offload_activations and offload,
            offload_boundaries=self.offload_boundaries,
            num_blocks=self.blocks.num_blocks,
        )

    def _tile(self, model: nn.Module) -> Change | None:
        tile = check_tile(self.tile_sequence)
        return None if tile is None else apply_tiling(model, self.policy, tile)

    def checkpoint_state(self) -> dict[str, int]:
        """For the profiler's advice: blocks checkpointed, of the blocks the policy selects."""
        return {"blocks": len(self.wrapped), "of": self._selected}

    def _report(self, trainer: Any, pl_module: Any) -> None:
        change = self._change
        self.wrapped = list(change.value)
        policy = self.blocks.policy
        self._selected = len(select_modules(pl_module, policy)) if self.wrapped else 0
        auto = self.policy == "auto"
        said = self.blocks.describe(change.what, len(self.wrapped), auto=auto, every_n=self.every_n)
        for message in said.no_effect:
            self.no_effect(message)
        for message in said.notes:
            self.note(message)
        what, figures = said.what, {**change.figures, **said.figures}
        if self._tiling is not None:
            what, figures = f"{what}; {self._tiling.what}", {**figures, **self._tiling.figures}
        self.report(trainer, what, **figures)
        self.note(what)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if self.offload_activations and getattr(device, "type", None) != "cuda":
            self.note(
                "offload_activations=True changes nothing on a CPU device: activations are "
                "already in host memory."
            )


_BUDGET_SHARDED = (
    "`budget` finds the fewest blocks by estimating the module at the first batch, and FSDP2 "
    "has sharded it by then (the estimate cannot run a sharded module). Choose the blocks with "
    "`policy` and `every_n` instead, sized before the fit with estimate_memory(model, batch, "
    "world_size=<ranks>, sharding='full', callbacks=[ActivationCheckpointing(...)])."
)
_OWN = (
    "the model's own gradient checkpointing is on ({span}); with this callback the blocks would "
    "be recomputed twice. Turn one off (e.g. `model.gradient_checkpointing_disable()` for a "
    "transformers model)."
)


def _checkpoints_itself(module: nn.Module) -> bool:
    return getattr(module, "gradient_checkpointing", False) is True
