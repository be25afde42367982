"""Length bucketing: samples of similar length share a batch, so less padding.

``LengthBucketSampler`` (a ``DistributedSampler``, so Lightning leaves it in place under DDP and
it shards itself) and ``padding_stats``, which counts the padding a batching costs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lightning_efficient.core.validate import check_bool, check_int
from lightning_efficient.techniques._sharded_sampler import ShardedSampler

__all__ = ["LengthBucketSampler", "padding_stats"]


class LengthBucketSampler(ShardedSampler):
    """Indices grouped by length: samples of similar length land in the same batch, so less padding.

    Each epoch the indices are shuffled by ``(seed, epoch)``, cut into buckets of ``bucket_size``
    and sorted by length (longest first) inside each bucket; a DataLoader with
    ``batch_size`` then cuts consecutive indices into batches of similar length (HF Trainer's
    ``group_by_length``). Pick ``bucket_size`` as a multiple of ``batch_size x world size``
    (e.g. 50x): larger buckets cut more padding but order the samples less randomly.

    DDP: it is a ``DistributedSampler``, so Lightning (``use_distributed_sampler=True``) leaves it
    in place instead of wrapping it in a ``DistributedSamplerWrapper`` that would re-shuffle the
    buckets away. It shards itself: rank ``r`` takes every ``num_replicas``-th index of the global
    bucketed order (each rank's batches stay sorted, and all ranks see similar lengths at the same
    step); the ranks are disjoint and cover the dataset (``drop_last=False`` pads by repeating the
    first indices, as DistributedSampler does). ``num_replicas``/``rank`` default to the process
    group's at iteration time (1 and 0 without one).

    Resume: ``state_dict()`` holds ``seed``, ``epoch`` and ``position`` (this rank's indices
    already handed out this epoch); after ``load_state_dict`` the next iteration continues from
    there. A DataLoader with workers (and Lightning's one-batch prefetch) asks for indices ahead of
    training; save ``position = batches_trained x batch_size`` when checkpointing mid-epoch.

    Args:
        lengths: Length of every sample (e.g. tokens), one per dataset index.
        bucket_size: Samples sorted together.
        shuffle: Shuffle before bucketing (False: buckets in dataset order).
        seed: Seed of the shuffle; the order depends only on ``(seed, epoch)``.
        num_replicas: Number of DDP processes (None: from the process group).
        rank: This process's rank (None: from the process group).
        drop_last: Drop the tail instead of padding so that every rank gets as many indices.
        dataset: When given, ``len(dataset)`` must equal ``len(lengths)``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        bucket_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        dataset: Any = None,
    ) -> None:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise TypeError(
                f"`lengths` must be a sequence of sample lengths; got {type(lengths).__name__}."
            )
        if len(lengths) == 0:
            raise ValueError("`lengths` is empty; give one length per sample of the dataset.")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in lengths):
            bad = next(
                x
                for x in lengths
                if not (isinstance(x, int) and not isinstance(x, bool) and x >= 0)
            )
            raise ValueError(f"`lengths` must hold non-negative integers; found {bad!r}.")
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.bucket_size = check_int("bucket_size", bucket_size, minimum=1)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed)
        self.sample_count = len(self.lengths)
        self._init_ranks(num_replicas, rank, drop_last)
        self.dataset = dataset
        if dataset is not None:
            self.check_dataset(dataset)

    def check_dataset(self, dataset: Any) -> None:
        """Raise a ValueError when ``dataset`` has another number of samples than ``lengths``."""
        try:
            size = len(dataset)
        except TypeError:
            return
        if size != len(self.lengths):
            raise ValueError(
                f"`lengths` has {len(self.lengths)} entries but the dataset has {size} samples; "
                "give exactly one length per dataset index."
            )

    # -- order -------------------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> list[int]:
        """All indices of an epoch in bucketed order (before sharding)."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.lengths)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(n, generator=g)
        else:
            perm = torch.arange(n)
        out: list[int] = []
        for start in range(0, n, self.bucket_size):
            bucket = perm[start : start + self.bucket_size]
            by_length = torch.argsort(self.lengths[bucket], descending=True, stable=True)
            out.extend(bucket[by_length].tolist())
        return out

    def rank_order(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of an epoch, in order."""
        order = self.global_order(epoch)
        total = self.total_size
        if self.drop_last:
            order = order[:total]
        else:
            while len(order) < total:
                order += order[: total - len(order)]
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return self.walk(self.rank_order(), self.position)


def padding_stats(
    lengths: Sequence[int], batches: Iterator[Sequence[int]] | Sequence[Sequence[int]]
) -> dict[str, float]:
    """Tokens of real data and of padding when each batch is padded to its longest sample.

    Returns ``real_tokens``, ``padded_tokens`` (real + padding) and ``padding_fraction``
    (padding / padded_tokens).
    """
    lengths = torch.as_tensor(list(lengths), dtype=torch.long)
    real = padded = 0
    for batch in batches:
        ls = lengths[torch.as_tensor(list(batch), dtype=torch.long)]
        real += int(ls.sum())
        padded += int(ls.max()) * len(ls) if len(ls) else 0
    return {
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_fraction": (padded - real) / padded if padded else 0.0,
    }
