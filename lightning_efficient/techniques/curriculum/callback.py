"""The thin callbacks: ``Curriculum`` (installs and drives a ``CurriculumSampler``) and
``SequenceLengthWarmup`` (cuts the training batches' sequences, growing to full length)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_choice, check_float, check_int
from lightning_efficient.techniques._loader_source import loader_source
from lightning_efficient.techniques.curriculum.difficulty import (
    check_difficulty,
    check_seed,
    difficulty_scores,
)
from lightning_efficient.techniques.curriculum.sampler import (
    CurriculumSampler,
    why_not_replaced,
    with_sampler,
)
from lightning_efficient.techniques.curriculum.schedule import (
    check_duration,
    check_pacing,
    duration_in_steps,
    reshape_length,
    sequence_length_at,
    total_steps,
)
from lightning_efficient.techniques.curriculum.sequence import CUT_MODES, cut_batch, sequence_shape

__all__ = ["Curriculum", "SequenceLengthWarmup"]


def _batch_hook_owner(trainer: Any, pl_module: Any) -> Any:
    """The object whose ``on_after_batch_transfer`` Lightning calls (the datamodule, unless only
    the module defines the hook); wrapping it there keeps Lightning's choice unchanged."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    dm = trainer.datamodule
    hook = "on_after_batch_transfer"
    if dm is not None and (is_overridden(hook, dm) or not is_overridden(hook, pl_module)):
        return dm
    return pl_module


class Curriculum(Technique):
    """Train on the easiest samples first; the pool of samples grows to the whole dataset.

    Wraps what Lightning calls for the train loader in ``setup`` (the datamodule's or module's
    ``train_dataloader``, or the loader given to ``trainer.fit``): the loader it returns is rebuilt with a ``CurriculumSampler`` (same dataset, batch_size, collate_fn, workers). The
    sampler is a ``DistributedSampler``, so under DDP Lightning keeps it, and it gives each rank a
    disjoint shard of the same pool. Its position is saved with the callback's state, so a run
    resumed mid-epoch sees the batches an uninterrupted run would. Put ``Curriculum`` before
    ``DataLoaderTuning``/``DevicePreload`` in the callbacks (they then keep its sampler).

    Args:
        difficulty: Where each sample's difficulty comes from (higher is harder): ``"entropy"``,
            ``"length"``, ``"attr:NAME"``, ``"field:NAME"``, ``"fn:package.module.function"``,
            ``"file:PATH"``, or (from Python) a list of scores or a callable ``sample -> float``.
            Scores are read when fit starts; non-finite values fail there.
        pacing: How the pool grows: ``"linear"``, ``"root"``, ``"geometric"`` or ``"step"``.
        start_fraction: Share of the easiest samples available at step 0, in (0, 1].
        duration: Optimizer steps until the whole dataset is available (int), or a fraction of
            the fit's steps (float in (0, 1]).
        stages: Stairs of the ``"step"`` pacing.
        seed: Seed of the tie-break between equal scores and of the shuffles inside the pool,
            in [0, 2**32 - 1].

    The loader's own sampler is replaced only when it is a plain one (``shuffle=True`` or
    ``False``, or a ``DistributedSampler``); any other (a ``WeightedRandomSampler``, a sampler
    with replacement, a custom order) is refused when fit starts, naming it: the curriculum
    would drop what it decides.
    """

    stacks = False
    orders_samples = True  # read by the compatibility rules

    def __init__(
        self,
        difficulty: str | Sequence[float] | Callable[[Any], float],
        pacing: str = "linear",
        start_fraction: float = 0.1,
        duration: int | float = 0.5,
        stages: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.difficulty = check_difficulty(difficulty)
        self.pacing = check_pacing(pacing)
        self.start_fraction = check_float(
            "start_fraction", start_fraction, minimum=0.0, maximum=1.0
        )
        if self.start_fraction <= 0:
            raise ValueError(f"`start_fraction` must be in (0, 1]; got {start_fraction!r}.")
        self.duration = check_duration(duration)
        self.stages = check_int("stages", stages, minimum=1)
        self.seed = check_seed(seed)
        self.sampler: CurriculumSampler | None = None
        self._wrapped = Change("train_dataloader not wrapped")
        self._state: dict[str, Any] | None = None
        self._batches = 0  # training batches run so far (all epochs)
        self._epoch_start = 0  # batches run before the current epoch began
        self._epoch_length = float("inf")  # batches Lightning runs per epoch
        self._figures: dict[str, Any] = {}

    # -- installing the sampler --------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit" or not self._wrapped.undone:
            return
        # a new fit: forget the last one (a checkpoint's state is loaded after setup)
        self.sampler, self._state, self._batches, self._epoch_start = None, None, 0, 0
        source = loader_source(trainer, pl_module)  # module, datamodule or fit's loaders
        if source is None:
            return  # Lightning refuses a fit without a train loader
        owner, attribute = source
        original = getattr(owner, attribute)

        def train_dataloader() -> Any:
            return self._install(trainer, original())

        change = patch_attribute(owner, attribute, train_dataloader, "train_dataloader wrapped")
        self._wrapped = self.record(trainer, change)

    def _install(self, trainer: Any, loader: Any) -> Any:
        if not isinstance(loader, DataLoader):
            self.no_effect(
                f"train_dataloader() returned a {type(loader).__name__}, not a DataLoader."
            )
            return loader
        refusal = why_not_replaced(loader)
        if refusal is not None:  # replaced, its weights or order would be lost without a word
            raise ValueError(f"{self.name}: {refusal}")
        try:
            scores = difficulty_scores(loader.dataset, self.difficulty)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from err
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        sampler = CurriculumSampler(
            scores, loader.batch_size or 1, pacing=self.pacing, start_fraction=self.start_fraction,
            duration=0, stages=self.stages, seed=self.seed, batches_per_step=accumulate,
        )  # fmt: skip
        try:
            new = with_sampler(loader, sampler)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from err
        total = total_steps(
            len(new),
            max_steps=trainer.max_steps,
            max_epochs=trainer.max_epochs,
            limit_train_batches=trainer.limit_train_batches,
            accumulate_grad_batches=accumulate,
        )
        sampler.duration = duration_in_steps(self.duration, total, self.name)
        # rebuilt loader (a reload, or another caller of train_dataloader): continue where the
        # current sampler is; else a resumed run's state
        state = self.state_dict() if self.sampler is not None else self._state
        if state is not None:
            self._batches = int(state.get("batches", 0))
            self._epoch_start = int(state.get("epoch_start", 0))
            sampler.load_state_dict(state)
        elif trainer.global_step > 0:  # resumed from a checkpoint written without it
            self._batches = self._epoch_start = trainer.global_step * accumulate
            sampler.epoch, sampler.start_batch = trainer.current_epoch, self._batches
        self.sampler = sampler
        self._describe(trainer, loader, scores, sampler)
        return new

    def _describe(
        self, trainer: Any, loader: Any, scores: list[float], s: CurriculumSampler
    ) -> None:
        n = len(scores)
        replaced = type(loader.sampler).__name__
        if min(scores) == max(scores):
            self.no_effect(
                f"every sample has the same difficulty ({scores[0]:g} by {self.difficulty!r}); "
                "the pool is a random subset, not the easiest samples."
            )
        if s.duration == 0 or s.pool_at(0) >= n:
            self.no_effect("the whole dataset is available from step 0; nothing is held back.")
        first = s.pool_at(0)
        self._figures = dict(samples=n, start_pool=first, duration_steps=s.duration)
        self._change = (
            f"easiest first by {self.difficulty if isinstance(self.difficulty, str) else 'given scores'}: "
            f"pool {first}/{n} ({first / n:.0%}) -> {n} over {s.duration} steps ({self.pacing}); "
            f"replaced the loader's {replaced}"
        )
        self.report(trainer, self._change, **self._figures)
        self.note(self._change)

    # -- driving it --------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.sampler is not None:
            self._epoch_start = self._batches
            self.sampler.set_epoch(trainer.current_epoch)
            self.sampler.start_batch = self._batches

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        self._epoch_length = trainer.num_training_batches

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.sampler is not None:
            step = self._batches // self.sampler.batches_per_step
            pool = self.sampler.pool_at(step)
            self.report(
                trainer,
                f"{self._change}; at the end {pool / len(self.sampler.difficulty):.0%} of the data",
                **self._figures,
                end_pool=pool,
            )
        super().on_fit_end(trainer, pl_module)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        if s is None:
            return dict(self._state or {})
        epoch, epoch_start = s.epoch, self._epoch_start
        in_epoch = self._batches - epoch_start
        # a complete epoch (Lightning's length may be cut by limit_train_batches): start the next
        if in_epoch >= min(s.batches_per_epoch, self._epoch_length):
            epoch, epoch_start, in_epoch = epoch + 1, self._batches, 0
        return {
            "seed": s.seed,
            "epoch": epoch,
            "position": in_epoch * s.batch_size,
            "start_batch": epoch_start,
            "epoch_start": epoch_start,
            "batches": self._batches,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)


class SequenceLengthWarmup(Technique):
    """Train on shorter sequences first; the length grows to the full length over ``duration``.

    The training batches are cut after they reach the device (the module's or datamodule's
    ``on_after_batch_transfer`` is wrapped for the fit), so any batch holding token tensors works
    on an unmodified module: a tensor, a tuple, or a dict whose ``input_ids``/``labels``/
    ``attention_mask``-like entries share a sequence dimension. Validation batches are never cut.
    The length follows ``sequence_length_at(global_step, ...)``, so a resumed run continues the
    schedule. The memory estimate and ``EfficientBatchSize`` size the batch at the full length
    (the worst case). With ``TorchCompile``, recompilations during the warm-up are counted and
    reported (each distinct length can cost one).

    Args:
        duration: Optimizer steps until the full length (int), or a fraction of the fit (float).
        start_length: Sequence length at step 0.
        multiple_of: Lengths move in multiples of this (fewer distinct shapes to compile); below
            the full length (refused at construction against ``full_length``, said once with a
            ``NoEffectWarning`` against a batch's own length).
        mode: ``"truncate"`` (keep the first tokens of each sample) or ``"reshape"`` (cut each
            sample into pieces stacked along the batch: tokens per step stay the same; only
            lengths that divide the full length are used).
        pacing: How the length grows: ``"linear"``, ``"root"``, ``"geometric"`` or ``"step"``.
        full_length: The full length (None: each batch's own sequence length).
    """

    stacks = False

    def __init__(
        self,
        duration: int | float = 0.3,
        start_length: int = 64,
        multiple_of: int = 64,
        mode: str = "truncate",
        pacing: str = "linear",
        full_length: int | None = None,
    ) -> None:
        super().__init__()
        self.duration = check_duration(duration)
        self.start_length = check_int("start_length", start_length, minimum=1)
        self.multiple_of = check_int("multiple_of", multiple_of, minimum=1)
        self.mode = check_choice("mode", mode, CUT_MODES)
        self.pacing = check_pacing(pacing)
        self.full_length = check_int("full_length", full_length, minimum=1, allow_none=True)
        if self.full_length is not None and self.multiple_of >= self.full_length:
            raise ValueError(
                f"`multiple_of` ({multiple_of}) must be below `full_length` ({full_length}): "
                "lengths move in multiples of it, so every batch would keep its full length."
            )
        self.lengths: dict[int, int] = {}  # length -> training batches cut to it
        self.warmup_steps: int | None = None
        self._wrapped = Change("on_after_batch_transfer not wrapped")
        self._watch: Any = None
        self._recompiles = 0
        self._before = 0
        self._cut_step = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit" or not self._wrapped.undone:
            return
        # a new fit (a checkpoint's state comes later)
        self.lengths, self._recompiles, self._watch = {}, 0, None
        owner = _batch_hook_owner(trainer, pl_module)
        original = owner.on_after_batch_transfer

        def on_after_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
            batch = original(batch, dataloader_idx)
            if trainer.training and not trainer.sanity_checking:
                batch = self._cut(trainer, batch)
            return batch

        self._wrapped = self.record(
            trainer, patch_attribute(owner, "on_after_batch_transfer", on_after_batch_transfer)
        )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_efficient.techniques.compile import CompileWatch, compiled_modules

        self.warmup_steps = duration_in_steps(
            self.duration, trainer.estimated_stepping_batches, self.name
        )
        if self.warmup_steps == 0:
            self.no_effect("duration is 0 steps: every batch is trained at its full length.")
        if compiled_modules(pl_module) and self._watch is None:
            self._watch = CompileWatch()
            self.record(trainer, self._watch.apply())  # removed after fit

    def _cut(self, trainer: Any, batch: Any) -> Any:
        try:
            _, seq = sequence_shape(batch)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from err
        full = self.full_length or seq
        warmup = self.warmup_steps if self.warmup_steps is not None else 0
        length = sequence_length_at(
            trainer.global_step, warmup, full, self.start_length, self.multiple_of, self.pacing
        )
        if self.mode == "reshape":
            length = reshape_length(length, seq, self.multiple_of)
            if length == seq and trainer.global_step < warmup and seq % self.multiple_of:
                self.no_effect(
                    f"reshape: no multiple of {self.multiple_of} divides the sequence length "
                    f"{seq}; batches keep their full length."
                )
        length = min(length, seq)
        if warmup and trainer.global_step < warmup and self.multiple_of >= min(full, seq):
            self.no_effect(
                f"multiple_of={self.multiple_of} is not below the sequence length {min(full, seq)}"
                ": lengths move in multiples of it, so every batch keeps its full length. Lower "
                "multiple_of."
            )
        self._cut_step = trainer.global_step
        self.lengths[length] = self.lengths.get(length, 0) + 1
        return cut_batch(batch, length, self.mode)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._before = self._watch.recompiles if self._watch is not None else 0

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._watch is not None and self._cut_step < (self.warmup_steps or 0):
            self._recompiles += self._watch.recompiles - self._before

    def configure_estimate(self, plan: Any) -> None:
        # the estimate runs training_step on its batch directly: nothing is cut (the worst case)
        plan.note(f"{self.name}: sized at the full sequence length (warm-up batches are shorter)")

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.lengths:
            shortest, longest = min(self.lengths), max(self.lengths)
            figures: dict[str, Any] = dict(
                start_length=shortest, full_length=longest, warmup_steps=self.warmup_steps,
                distinct_lengths=len(self.lengths),
            )  # fmt: skip
            change = (
                f"sequence length {shortest} -> {longest} over {self.warmup_steps} steps "
                f"({self.mode}, {self.pacing}, {len(self.lengths)} distinct lengths)"
            )
            if self._watch is not None:
                figures["warmup_recompiles"] = self._recompiles
                plural = "" if self._recompiles == 1 else "s"
                change += f"; {self._recompiles} recompilation{plural} during the warm-up"
            self.report(trainer, change, **figures)
        super().on_fit_end(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"lengths": dict(self.lengths), "warmup_recompiles": self._recompiles}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lengths = {int(k): int(v) for k, v in state_dict.get("lengths", {}).items()}
        self._recompiles = int(state_dict.get("warmup_recompiles", 0))
