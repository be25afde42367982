"""``CurriculumSampler``: easiest samples first, the pool growing by a pacing function.

At training step ``t`` the pool is the ``pool_size(pacing_fraction(t))`` easiest samples; each
global batch (all ranks together) is drawn from the pool without repeats until the whole pool
was seen, then the pool is walked again in a new order. Samples that join the pool are mixed
uniformly into what is left of the current walk. Everything is a pure function of
``(seed, epoch, start_batch)``, so an epoch can be replayed exactly.

``with_sampler(loader, sampler)``: the same DataLoader with another sampler.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_float, check_int
from lightning_efficient.techniques._sharded_sampler import ShardedSampler
from lightning_efficient.techniques.curriculum.difficulty import check_seed, easiest_first
from lightning_efficient.techniques.curriculum.schedule import (
    check_pacing,
    pacing_fraction,
    pool_size,
)

__all__ = [
    "CurriculumSampler",
    "apply_sampler",
    "check_indexable",
    "own_sampler",
    "pool_walk",
    "why_not_replaced",
    "with_sampler",
]


def pool_walk(
    order: Sequence[int], steps: Iterable[tuple[int, int]], seed: int = 0
) -> Iterator[list[int]]:
    """Chunks of indices drawn from a growing pool; ``steps`` gives ``(pool size, chunk size)``.

    The pool is ``order[:pool size]`` (it never shrinks). Inside a chunk no index repeats (when
    the pool is at least as large as the chunk); across chunks an index repeats only after the
    whole pool was walked. Each walk is a random order: every index gets a uniform random key
    and the walk takes the smallest keys first; an index that joins the pool mid-walk gets a key
    uniform among the keys not taken yet, so it lands uniformly among the remaining ones.
    """
    g = torch.Generator().manual_seed(int(seed))
    heap: list[tuple[float, int]] = []
    pool, cursor = 0, 0.0

    def keys(count: int) -> list[float]:
        return torch.rand(count, generator=g, dtype=torch.float64).tolist()

    for size, chunk_size in steps:
        if size > pool:
            span = 1.0 - cursor if cursor < 1.0 else 1.0
            for key, i in zip(keys(size - pool), order[pool:size]):
                heapq.heappush(heap, (cursor + span * key, i))
            pool = size
        chunk: list[int] = []
        while len(chunk) < chunk_size:
            if not heap:  # a new walk over the pool; what this chunk already holds goes last
                taken = set(chunk)
                heap = [(k + (i in taken), i) for k, i in zip(keys(pool), order[:pool])]
                heapq.heapify(heap)
                cursor = 0.0
            cursor, i = heapq.heappop(heap)
            chunk.append(i)
        yield chunk


class CurriculumSampler(ShardedSampler):
    """Indices easiest first: at step t only the easiest ``fraction(t)`` of the dataset is drawn.

    Usable without Lightning (give it to a DataLoader with the same ``batch_size``); the
    ``Curriculum`` callback installs and drives it in a fit. Each epoch has as many indices as a
    plain epoch (``len(difficulty)`` over all ranks); samples are shuffled inside the pool,
    deterministically from ``(seed, epoch)``.

    DDP: it is a ``DistributedSampler``, so Lightning leaves it in place (it would otherwise wrap
    it in a ``DistributedSamplerWrapper`` and re-shuffle the curriculum away). All ranks walk the
    same pool; rank ``r`` takes every ``num_replicas``-th index of each global batch, so the
    ranks' batches of a step are disjoint and come from the same pool.

    Resume: ``state_dict()`` holds ``seed``, ``epoch``, ``position`` (this rank's indices handed
    out this epoch) and ``start_batch`` (batches trained before this epoch began); after
    ``load_state_dict`` the next iteration continues exactly there.

    Args:
        difficulty: One finite score per dataset index (higher is harder); see
            ``difficulty_scores`` to compute them.
        batch_size: Samples per batch on each rank (the DataLoader's ``batch_size``).
        pacing: ``"linear"``, ``"root"``, ``"geometric"`` or ``"step"`` (``pacing_fraction``).
        start_fraction: Share of the dataset available at step 0, in (0, 1].
        duration: Steps after which the whole dataset is available.
        stages: Stairs of the ``"step"`` pacing.
        seed: Seed of the tie-break and of the shuffles.
        num_replicas: Number of DDP processes (None: from the process group).
        rank: This process's rank (None: from the process group).
        drop_last: Drop the tail so that every rank gets the same count (else ``ceil``).
        batches_per_step: Batches per optimizer step (gradient accumulation): the pace is set
            per optimizer step.
    """

    def __init__(
        self,
        difficulty: Sequence[float],
        batch_size: int,
        *,
        pacing: str = "linear",
        start_fraction: float = 0.1,
        duration: int = 1000,
        stages: int = 4,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        batches_per_step: int = 1,
    ) -> None:
        if isinstance(difficulty, torch.Tensor):
            difficulty = difficulty.tolist()
        if isinstance(difficulty, (str, bytes)) or not isinstance(difficulty, Sequence):
            raise TypeError(
                "`difficulty` must be a sequence of scores, one per sample; got "
                f"{type(difficulty).__name__}."
            )
        if len(difficulty) == 0:
            raise ValueError("`difficulty` is empty; give one score per sample of the dataset.")
        bad = next((i for i, v in enumerate(difficulty) if not _finite(v)), None)
        if bad is not None:
            raise ValueError(
                f"`difficulty` must hold finite numbers, one per sample; found "
                f"{difficulty[bad]!r} at index {bad}."
            )
        self.difficulty = [float(v) for v in difficulty]
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.pacing = check_pacing(pacing)
        self.start_fraction = check_float(
            "start_fraction", start_fraction, minimum=0.0, maximum=1.0
        )
        if self.start_fraction <= 0:
            raise ValueError(f"`start_fraction` must be in (0, 1]; got {start_fraction!r}.")
        self.duration = check_int("duration", duration, minimum=0)
        self.stages = check_int("stages", stages, minimum=1)
        self.seed = check_seed(seed)
        self.sample_count = len(self.difficulty)
        self._init_ranks(num_replicas, rank, drop_last)
        self.batches_per_step = check_int("batches_per_step", batches_per_step, minimum=1)
        self.order = easiest_first(self.difficulty, self.seed)
        self.start_batch: int | None = None  # None: epoch x batches_per_epoch

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    # -- the schedule ------------------------------------------------------------------------
    def fraction_at(self, step: int) -> float:
        """Share of the dataset in the pool at optimizer step ``step``."""
        return pacing_fraction(
            self.pacing, step, self.duration, self.start_fraction, stages=self.stages
        )

    def pool_at(self, step: int) -> int:
        """Samples in the pool at ``step`` (at least one global batch)."""
        n = len(self.difficulty)
        return pool_size(self.fraction_at(step), n, min(n, self.batch_size * self.num_replicas))

    def _epoch_start(self, epoch: int, start_batch: int | None) -> int:
        return epoch * self.batches_per_epoch if start_batch is None else start_batch

    def global_batches(
        self, epoch: int | None = None, start_batch: int | None = None
    ) -> Iterator[list[int]]:
        """The epoch's global batches (all ranks), each drawn from the pool of its step."""
        epoch = self.epoch if epoch is None else epoch
        start = self._epoch_start(epoch, self.start_batch if start_batch is None else start_batch)
        world, per_rank = self.num_replicas, self.num_samples

        def steps() -> Iterator[tuple[int, int]]:
            for b in range(self.batches_per_epoch):
                k = min(self.batch_size, per_rank - b * self.batch_size)
                yield self.pool_at((start + b) // self.batches_per_step), k * world

        return pool_walk(self.order, steps(), seed=self.seed * 100_003 + epoch)

    def rank_order(self, epoch: int | None = None, start_batch: int | None = None) -> list[int]:
        """This rank's indices of an epoch, in order."""
        r, world = self.rank, self.num_replicas
        return [i for chunk in self.global_batches(epoch, start_batch) for i in chunk[r::world]]

    def __iter__(self) -> Iterator[int]:
        epoch, start, skip = self.epoch, self.start_batch, self.position
        r, world = self.rank, self.num_replicas
        done = 0
        for chunk in self.global_batches(epoch, start):
            mine = chunk[r::world]
            if done + len(mine) <= skip:
                done += len(mine)
                continue
            for i in mine[max(0, skip - done) :]:
                self.position += 1
                yield i
            done += len(mine)
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_batch = None
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "start_batch": self.start_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seed = self.seed
        super().load_state_dict(state)
        if self.seed != seed:
            self.order = easiest_first(self.difficulty, self.seed)
        start = state.get("start_batch")
        self.start_batch = None if start is None else int(start)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_indexable(loader: DataLoader) -> int:
    """The number of samples of ``loader``'s dataset, which a sampler orders by index.

    Raises:
        ValueError: the dataset is iterable-style, or map-style without ``__len__`` (no indices
            to order).
    """
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"the train DataLoader's dataset is an iterable-style dataset "
            f"({type(dataset).__name__}): it has no indices for a sampler to order; a curriculum "
            "needs a map-style Dataset (`__getitem__` and `__len__`)."
        )
    try:
        return len(dataset)
    except TypeError:
        raise ValueError(
            f"the train DataLoader's dataset ({type(dataset).__name__}) has no `__len__`: a "
            "curriculum orders a known number of samples; give the Dataset a `__len__`."
        ) from None


def own_sampler(loader: DataLoader) -> str | None:
    """Why the loader's sampler cannot be replaced by a curriculum without loss, or ``None``.

    Replaced without loss: ``shuffle=True``/``False`` (``SequentialSampler``, ``RandomSampler``
    over the whole dataset without replacement), a ``DistributedSampler`` (the curriculum shards
    the same way) and any sampler whose epoch is a permutation of the dataset (a shuffle of its
    own; checked by drawing one epoch of indices, never more than one index past the dataset's
    size, so an endless sampler is refused, not drawn for ever). Refused, with what would be
    lost: a ``WeightedRandomSampler`` (its weights), and any sampler that draws a subset, repeats
    or does not end.

    Raises:
        ValueError: the dataset has no indices to order (:func:`check_indexable`).
    """
    sampler, n = loader.sampler, check_indexable(loader)
    kind = type(sampler)
    if kind in (SequentialSampler, DistributedSampler):
        return None
    if isinstance(sampler, WeightedRandomSampler):
        return f"{kind.__name__} (its weights would be lost)"
    if kind is RandomSampler and not sampler.replacement and sampler.num_samples == n:
        return None
    try:  # at most one index more than a permutation holds: an endless sampler stops there
        drawn_list = list(itertools.islice(iter(sampler), n + 1))
        indices = torch.as_tensor(drawn_list, dtype=torch.long).flatten()
    except (TypeError, ValueError, RuntimeError):
        return f"{kind.__name__} (it yields something other than sample indices)"
    if len(drawn_list) > n:
        return (
            f"{kind.__name__} (an epoch draws more than the dataset's {n} samples, or never "
            "ends: which samples and how often would be lost)"
        )
    inside = len(indices) == 0 or (int(indices.min()) >= 0 and int(indices.max()) < n)
    if len(indices) == n and inside and torch.bincount(indices, minlength=n).eq(1).all():
        return None  # one epoch is a permutation: a shuffle the curriculum replaces
    drawn = len(indices.unique())
    return (
        f"{kind.__name__} (an epoch draws {len(indices)} indices, {drawn} distinct, from "
        f"{n} samples: which samples and how often would be lost)"
    )


def why_not_replaced(loader: DataLoader) -> str | None:
    """Why a curriculum may not replace ``loader``'s sampler (the dataset has no indices, or the
    sampler decides something the curriculum would drop: :func:`own_sampler`), or ``None``."""
    try:
        own = own_sampler(loader)
    except ValueError as err:
        return str(err)
    if own is None:
        return None
    return (
        f"the train DataLoader draws its samples with its own {own}; the curriculum decides the "
        "order itself and would drop it. Remove the sampler from the DataLoader (shuffle=True "
        "or False) to use Curriculum, or order the samples yourself (CurriculumSampler, "
        "lightning_efficient.functional)."
    )


def with_sampler(loader: DataLoader, sampler: Sampler) -> DataLoader:
    """The same DataLoader (dataset, batch_size, drop_last, collate_fn, workers, pinning,
    generator) drawing its indices from ``sampler``.

    Raises:
        ValueError: the loader batches with its own ``batch_sampler`` (or not at all), or its
            dataset is iterable-style (no indices to draw).
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    if isinstance(loader.dataset, IterableDataset):
        check_indexable(loader)  # raises, saying what is allowed
    if loader.batch_size is None:
        raise ValueError(
            "the DataLoader uses its own batch_sampler (or batch_size=None); a sampler can only "
            "be swapped into a loader that batches with `batch_size`."
        )
    kwargs: dict[str, Any] = dict(
        dataset=loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
    )
    if loader.num_workers > 0:
        kwargs.update(
            persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor
        )
        if loader.multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
    for name in ("pin_memory_device", "in_order"):
        if hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    cls = type(loader) if type(loader).__init__ is DataLoader.__init__ else DataLoader
    return cls(**kwargs)


def apply_sampler(loader: DataLoader, sampler: Sampler) -> Change:
    """:func:`with_sampler` as a change (e.g. with a :class:`CurriculumSampler` or a
    ``LengthBucketSampler``): its ``value`` is the loader drawing from ``sampler``. ``loader``
    itself is not changed, so there is nothing to undo."""
    new = with_sampler(loader, sampler)
    return Change(
        f"sampler {type(loader.sampler).__name__} -> {type(sampler).__name__}",
        figures={"batches": len(new)} if hasattr(sampler, "__len__") else {},
        value=new,
    )
