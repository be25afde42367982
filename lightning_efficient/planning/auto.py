"""``AutoEfficient``: the callback that plans, applies and verifies a stack when fit starts."""

from __future__ import annotations

import weakref
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_choice,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.planning import fit as on_fit
from lightning_efficient.planning.decision import GOALS, Decision
from lightning_efficient.planning.ladder import trains_full_weights, trains_without_cache
from lightning_efficient.planning.search import resolve_host_budget
from lightning_efficient.techniques.accumulation.callback import add_exact_accumulation
from lightning_efficient.techniques.batch_size.sizing import MAX_TARGET_BATCH

__all__ = ["AutoEfficient"]


class AutoEfficient(Technique):
    """Plan, apply and verify a stack of techniques when fit starts: one switch.

    After every ``setup`` hook and a checkpoint's restore, and before the strategy's setup (the
    device move, the optimizers and LR schedule) and the train DataLoader, it walks the planner's
    ladder (the chunked loss included where the logits are wide), finds with the instrument's
    estimate for the trainer's device the largest micro-batch each stack fits within ``budget``
    among the exact divisors of the effective batch, picks by ``goal``, confirms the pick with two
    real training steps within the budget (on out-of-memory: a size down, then the next stack),
    adds the stack's callbacks to the trainer and sets the micro-batch and
    ``accumulate_grad_batches`` so that the effective batch is unchanged. It prints once the yaml
    that reproduces the decision without it, keeps the decision in the checkpoint (a resume makes
    the same choice), and reports the choice, the estimate, the trial's peak and the time taken.

    The precision plugin and the strategy are fixed when the Trainer is built: stacks that need
    another precision or a strategy are reported as "needs yaml" with the line that would apply
    them; ``lightning-efficient fit --auto`` builds the Trainer from the plan instead.

    Args:
        budget: Device memory for one rank (bytes or ``"24GiB"``); ``None``: the CUDA device's
            total memory (said in the log); required on a CPU.
        goal: ``"speed"``: the largest micro-batch, the cheapest stack reaching it;
            ``"memory"``: the cheapest stack that fits, at its largest micro-batch.
        target_batch: Effective batch (micro-batch x accumulation x ranks) to keep; ``None``:
            the loader's batch size x the trainer's accumulation x ranks as configured.
        trial: Confirm the pick with real steps before training.
        batch_arg_name: Name of the batch-size attribute (module, hparams or datamodule).
        host_budget: Host memory the offloading stacks may keep (bytes or ``"64GiB"``);
            ``None``: what this machine has available. A stack whose estimated host bytes exceed
            it is not chosen (the report says why).
    """

    stacks = False
    sets_accumulation = True  # read by the compatibility rules

    def __init__(
        self,
        budget: int | str | None = None,
        goal: str = "speed",
        target_batch: int | None = None,
        trial: bool = True,
        batch_arg_name: str = "batch_size",
        host_budget: int | str | None = None,
    ) -> None:
        super().__init__()
        self.budget = budget
        self._budget_bytes = parse_bytes("budget", budget, allow_none=True)
        self.goal = check_choice("goal", goal, GOALS)
        self.target_batch = check_int(
            "target_batch", target_batch, minimum=1, maximum=MAX_TARGET_BATCH, allow_none=True
        )
        self.trial = check_bool("trial", trial)
        if not isinstance(batch_arg_name, str) or not batch_arg_name.isidentifier():
            raise ValueError(f"`batch_arg_name` must be an attribute name; got {batch_arg_name!r}.")
        self.batch_arg_name = batch_arg_name
        self.host_budget = host_budget
        self._host_budget_bytes = parse_bytes("host_budget", host_budget, allow_none=True)
        self.decision: Decision | None = None
        self._preset: Decision | None = None  # decided before the Trainer was built (fit --auto)
        self._added: Change | None = None
        self._trainer: weakref.ref | None = None
        self._module: weakref.ref | None = None
        self._effective = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(goal=self.goal, target_batch=self.target_batch)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"decision": self.decision.state() if self.decision is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing: the decision is read in :meth:`on_load_checkpoint`, which Lightning calls
        first, so that the stack it puts in place gets its own ``on_load_checkpoint`` and
        ``load_state_dict`` (OptimizerSwap's 8-bit state) like a callback given by hand."""

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # after every `setup`, before the strategy's setup (optimizers, loaders). Lightning calls
        # this hook, then `load_state_dict`, on each callback of the list as it stands: the
        # checkpoint's stack, put right after this callback now, is restored next
        entry = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        saved = entry.get("decision") if isinstance(entry, dict) else None
        if not saved or self._trainer is None or self._module is None:
            return
        saved = Decision.from_state(saved, trainer.world_size, self.goal)
        if self.decision is not None:  # a strategy that restores after its setup (rare)
            if (self.decision.rung.name, self.decision.micro) != (saved.rung.name, saved.micro):
                self.warn(
                    f"the checkpoint's decision ({saved.describe()}) was restored after the "
                    f"strategy's setup; training goes on with {self.decision.describe()}."
                )
            return
        self._settle(trainer, pl_module, saved)

    # -- hooks ------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        on_fit.check_one_sizer(trainer, self)
        if self._added is not None:  # a previous fit's stack on this trainer
            self._added.undo()
        self.decision, self._added = None, None
        self._trainer, self._module = weakref.ref(trainer), weakref.ref(pl_module)
        if trainer.train_dataloader is not None:
            self.no_effect("the train DataLoader was built before AutoEfficient.setup; nothing set")
            return
        self._effective = on_fit.effective_batch(
            trainer, pl_module, self.batch_arg_name, self.target_batch, self.name
        )
        # a checkpoint's stack is added in on_load_checkpoint (the path is not known here yet)
        self.record(trainer, on_fit.quiet_restore_warning())
        # decide after a checkpoint's state is restored (a resume keeps its decision) and before
        # the strategy moves the module and builds the optimizers and the LR schedule
        strategy = trainer.strategy
        original = strategy.setup

        def setup_after_deciding(*args: Any, **kwargs: Any) -> Any:
            if self.decision is None:
                self._settle(trainer, pl_module, self._preset)
            return original(*args, **kwargs)

        self.record(trainer, patch_attribute(strategy, "setup", setup_after_deciding))

    def _settle(self, trainer: Any, pl_module: Any, decision: Decision | None) -> None:
        """Decide (unless ``decision`` is given), then apply: the micro-batch, accumulation and
        the stack's callbacks next to this one (their ``setup`` run here; kept off the change log,
        undone while Lightning still calls their hooks: the next fit's ``setup`` removes them)."""
        if decision is None:
            decision = self._decide(trainer, pl_module, self._effective // trainer.world_size)
            decision = on_fit.same_on_every_rank(trainer, decision)
        self.decision = decision
        why = on_fit.not_applied_by(trainer, decision.rung)
        if why:  # a decision made for another trainer (a checkpoint)
            self.warn(f"cannot apply {decision.rung.name} here: {why}")
        callbacks = on_fit.stack_callbacks(trainer, decision.rung)
        self.record(
            trainer,
            on_fit.apply_batch(
                trainer, pl_module, self.batch_arg_name, decision.micro, decision.accumulation
            ),
        )
        self._added = on_fit.add_callbacks(trainer, self, callbacks)  # first: see add_callbacks
        if decision.accumulation > 1 or trainer.world_size > 1:  # one step on the whole batch
            self.record(trainer, add_exact_accumulation(trainer, pl_module))
        # as estimated: no Hugging Face key/value cache (switched in the base's on_train_start)
        self.trains_without_cache = trains_without_cache(decision.rung)
        for callback in callbacks:
            callback.setup(trainer, pl_module, "fit")
        if decision is not self._preset:  # fit --auto printed its decision already
            self.note(decision.summary())
        if trainer.is_global_zero and not decision.restored:
            holder = "data" if trainer.datamodule is not None else "model"
            rank_zero_info(
                f"{self.name}: the yaml that reproduces this without AutoEfficient "
                f"(add to your config):\n{decision.to_yaml(holder, self.batch_arg_name)}"
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.decision is not None:
            figures = {**self.decision.figures(), "restored": self.decision.restored}
            self.report(trainer, self.decision.summary(), **figures)

    # -- the decision -----------------------------------------------------------------------------
    def budget_for(self, trainer: Any) -> int:
        """``budget`` in bytes; ``None``: the CUDA device's total memory (said once)."""
        if self._budget_bytes is not None:
            return self._budget_bytes
        total = on_fit.device_memory(trainer, self.name)
        self.note(f"budget: the device's total memory, {format_bytes(total)}")
        return total

    def _decide(self, trainer: Any, pl_module: Any, effective: int) -> Decision:
        decision = on_fit.decide_for(
            trainer,
            pl_module,
            trainer.datamodule if trainer.datamodule is not None else pl_module,
            self.budget_for(trainer),
            effective,
            goal=self.goal,
            trial=self.trial,
            exclude=[self],
            host_budget_bytes=resolve_host_budget(self._host_budget_bytes),
        )
        for note in decision.notes:
            self.note(note)
        for warning in decision.warnings:
            self.warn(warning)
        if str(trainer.precision) == "32-true":
            self.note(on_fit.BF16_NEEDS_YAML)
        if str(trainer.precision) != "bf16-true" and trains_full_weights(pl_module):
            self.note(on_fit.BF16_WEIGHTS_NEED_YAML)
        return decision

    def preset(self, decision: Decision) -> AutoEfficient:
        """Use ``decision`` (made before the Trainer was built: ``fit --auto``) instead of
        deciding in ``setup``; a checkpoint's decision still comes first."""
        self._preset = decision
        return self
