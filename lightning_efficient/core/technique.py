"""What every technique callback shares: the report, rank-zero notes, the compatibility check."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_efficient.core import compat
from lightning_efficient.core.change import Change, changes_for, undo_last_first
from lightning_efficient.core.kv_cache import apply_training_without_cache, cache_switched_off
from lightning_efficient.core.report import report_for

__all__ = [
    "NoEffectWarning",
    "Technique",
    "techniques_of",
    "ChangesEstimate",
    "ReportsCompile",
    "ReportsCheckpointing",
]


@runtime_checkable
class ChangesEstimate(Protocol):
    """Takes part in the memory estimate (a technique or a strategy): ``configure_estimate(plan)``
    changes the estimate's plan as the fit would (the optimizer, the blocks checkpointed, the
    sharding, ...) and records each change to the plan's model with ``plan.record(change)``. The
    estimate and ``measure.memory.settings`` ask for it with ``isinstance``."""

    def configure_estimate(self, plan: Any) -> None: ...


@runtime_checkable
class ReportsCompile(Protocol):
    """Compiles during the fit and says what: ``compile_state()`` -> ``scope`` (``"regional"``,
    ``"whole"`` or ``None``), ``mode`` and the steady step of each scope measured. Read by the
    profiler's summary."""

    def compile_state(self) -> dict[str, Any]: ...


@runtime_checkable
class ReportsCheckpointing(Protocol):
    """Recomputes activations during the fit and says how much: ``checkpoint_state()`` ->
    ``{"blocks": checkpointed, "of": selected}``. Read by the profiler's advice."""

    def checkpoint_state(self) -> dict[str, int]: ...


class NoEffectWarning(UserWarning):
    """A technique was asked for but could not change anything (said once, instead of silence)."""


class Technique(Callback):
    """Base class of this package's callbacks. Subclasses hold no maths; they decide *when*.

    - ``self.record(trainer, change)`` keeps a ``Change`` (what an ``apply_*`` returned) to be
      undone. ``restore`` undoes the recorded changes, last first, together with the changes
      other techniques made after them (``core.change.ChangeLog``), at teardown after a fit and
      when a fit raises or is interrupted (``on_exception``: Lightning calls it for a
      ``KeyboardInterrupt`` too, and does not call ``teardown`` then). This is the one path every
      undo takes: subclasses record their changes and do not override ``restore``; their own
      ``teardown`` or ``on_exception`` calls the base's (``tests/test_layers.py`` checks it).
    - ``self.report(trainer, change, **figures)`` adds the technique's row to the efficiency
      report (``change``: a ``Change``, whose ``what`` and figures make the row, or a line),
      which is shown once at the end of fit on rank zero (by the last technique among the
      trainer's callbacks; subclasses that override ``on_fit_end`` call ``super()`` last).
      Under several ranks every rank reaches that point and the figures are gathered first.
    - ``self.note(message)`` / ``self.no_effect(message)`` log once, on rank zero.
    - ``setup`` runs the package's compatibility rules once per fit (``compat.check``).

    What the compatibility rules (and the profiler's advice) need to know about a technique is
    declared here, as class attributes or properties that subclasses override (never read from
    private state). The methods the instrument asks some techniques for are declared as
    protocols of this module, checked with ``isinstance``: ``ChangesEstimate``
    (``configure_estimate(plan)``, strategies too), ``ReportsCompile`` (``compile_state()``) and
    ``ReportsCheckpointing`` (``checkpoint_state()``).
    """

    #: Two instances may be used in one fit (False: the second would replace the first).
    stacks: bool = True
    #: Changes ``trainer.accumulate_grad_batches`` during the fit.
    sets_accumulation: bool = False
    #: Weighs each gradient-accumulation window by what its micro-batches' losses average over
    #: (``techniques.accumulation``): needs Lightning's automatic loop to run each backward.
    weighs_windows: bool = False
    #: Catches out-of-memory errors and retries the step.
    recovers_from_oom: bool = False
    #: Steps the optimizer from gradient hooks during backward.
    steps_in_backward: bool = False
    #: Replaces the optimizers that ``configure_optimizers`` returned.
    swaps_optimizer: bool = False
    #: Sets the data loaders' worker processes.
    loads_in_workers: bool = False
    #: Serves batches that already live on the device.
    preloads_to_device: bool = False
    #: Decides which samples an epoch trains on and in what order (its own sampler).
    orders_samples: bool = False
    #: Builds its own batches of documents packed into rows, anew each epoch.
    packs_documents: bool = False
    #: Recompilations seen during the fit (``None``: the technique does not compile). Read by
    #: the profiler's advice (many recompilations: bucket the batch shapes).
    recompiles: int | None = None
    #: Drops optimizer steps from ``on_before_optimizer_step`` (so the step must come after that
    #: hook and use the gradients it sees).
    vetoes_optimizer_step: bool = False
    #: Why the technique cannot run when a strategy shards the parameters (DTensors under FSDP2,
    #: ``strategy.shards_parameters``) and what to use instead; ``None``: it works sharded.
    sharding_conflict: str | None = None
    #: Uses a module's parameters after that module's call returned (the output projection's
    #: weight in a loss computed later, from lazy logits): a strategy that holds a module's
    #: parameters only during its call (ZeRO-3, ``gathers_parameters_per_call``) cannot serve it.
    uses_parameters_after_call: bool = False
    #: Trains without a Hugging Face model's key/value cache (a training forward never reads it):
    #: switched off once for all such techniques, in the fit by the first of them
    #: (:meth:`on_train_start`, after ``configure_model`` built the layers) and in the estimate by
    #: its plan (``measure.memory.types.EstimatePlan.configure``).
    trains_without_cache: bool = False
    #: Report figures that are decisions every rank must take alike (e.g. ``stopped_step``):
    #: under several ranks the report says "same on N ranks", or warns that the ranks differ.
    decision_figures: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()
        self._recorded: list[Change] = []

    # -- reporting -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return type(self).__name__

    def report(self, trainer: Any, change: Change | str, **figures: Any) -> None:
        if isinstance(change, Change):
            change, figures = change.what, {**change.figures, **figures}
        entry = report_for(trainer).add(self.name, change, **figures)
        entry.decisions = tuple(self.decision_figures)

    def note(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            rank_zero_info(f"{self.name}: {message}")

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        if message not in self._said:
            self._said.add(message)
            rank_zero_warn(f"{self.name}: {message}", category=category)

    def no_effect(self, message: str) -> None:
        self.warn(message, NoEffectWarning)

    # -- hooks -----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        compat.check(trainer, techniques_of(trainer))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The one reader of ``trains_without_cache`` in the fit: the first technique that
        declares it switches the cache off for training (``core.kv_cache``), undone with the
        technique's other changes; the others find it off. A technique that overrides this hook
        calls it."""
        if self.trains_without_cache and not cache_switched_off(pl_module):
            self.record(trainer, apply_training_without_cache(pl_module))

    # -- changes and their undo ---------------------------------------------------------------
    def record(self, trainer: Any, change: Change) -> Change:
        """Keep ``change`` to be undone by ``restore``; returns it. A change the technique
        undoes itself during the fit (``change.undo()``) is simply let go."""
        self._recorded = [c for c in self._recorded if not c.undone]
        if not change.undone:
            self._recorded.append(change)
            if trainer is not None:
                changes_for(trainer).record(change)
        return change

    def restore(self, trainer: Any, pl_module: Any) -> None:
        """Undo the recorded changes, last first, after the changes other techniques made on
        top of them; safe to call twice."""
        live = [c for c in self._recorded if not c.undone]
        self._recorded = []
        try:
            if live and trainer is not None:
                changes_for(trainer).undo_from(live[0])
        finally:
            undo_last_first(live)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # shown by the last technique among the callbacks, once every row is in (a technique
        # that adds its row in its own on_fit_end would otherwise make the table print twice)
        techniques = techniques_of(trainer)
        if not techniques or techniques[-1] is self:
            report_for(trainer).show(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.restore(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.restore(trainer, pl_module)


def techniques_of(trainer: Any) -> list[Technique]:
    """The techniques of this package among the trainer's callbacks."""
    return [cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, Technique)]
