"""The packer: a user's DataLoader of variable-length documents as a DataLoader of packed rows.

- ``document_lengths(dataset)``: the tokens of every item (read once).
- ``PackedRowSampler``: each epoch, the documents shuffled by ``(seed, epoch)`` and packed
  best-fit decreasing into rows (``bins.pack_rows``), the rows shuffled, and rank ``r`` of ``R``
  taking every ``R``-th row. The number of rows is the same every epoch (known from the
  lengths alone) and a multiple of ``R``, so every rank runs as many batches and ``len()``
  holds; the ranks' rows are disjoint and cover every document once. It yields rows (tuples of
  ``(document, start, stop)`` pieces), which ``PackedDocuments`` turns into tensors. It is a
  ``DistributedSampler``, so Lightning leaves it in place under DDP. ``state_dict`` holds
  ``seed``, ``epoch`` and ``position`` (rows of this rank handed out this epoch): a run resumed
  mid-epoch continues with the same rows.
- ``PackedDocuments``: the map-style dataset whose keys are those rows (``rows.build_row``).
- ``pack_dataloader(loader, row_length, ...)``: the same DataLoader settings (workers, pinning)
  over packed rows, ``rows_per_batch`` rows a batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_efficient.core.validate import check_bool, check_choice, check_int
from lightning_efficient.techniques._sharded_sampler import ShardedSampler
from lightning_efficient.techniques.packing.bins import OVERSIZE, Row, fill, pack_rows
from lightning_efficient.techniques.packing.rows import build_row, read_document

__all__ = ["document_lengths", "PackedRowSampler", "PackedDocuments", "pack_dataloader"]


def document_lengths(dataset: Any) -> list[int]:
    """The number of tokens of every item of a map-style ``dataset`` (items with ``input_ids``)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"sequence packing needs a map-style dataset (with __len__ and __getitem__); got "
            f"{type(dataset).__name__}."
        )
    return [int(read_document(dataset[i])[0].numel()) for i in range(len(dataset))]


class PackedRowSampler(ShardedSampler):
    """Packed rows of documents, shuffled per epoch and sharded over the ranks (see the module
    docstring).

    Args:
        lengths: Tokens of every document, one per dataset index.
        row_length: Tokens in a row (the documents' tokens plus padding).
        shuffle: Shuffle the documents before packing and the rows after (False: dataset order).
        seed: Seed of the shuffles; an epoch depends only on ``(seed, epoch)``.
        oversize: ``"split"`` (a document longer than a row becomes pieces of ``row_length``,
            each trained as its own document) or ``"refuse"`` (a ValueError naming them).
        num_replicas: Number of ranks (None: from the process group when iterated).
        rank: This rank (None: from the process group when iterated).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        row_length: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        oversize: str = "split",
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or any(n < 0 for n in self.lengths):
            raise ValueError("`lengths` must be a non-empty sequence of token counts >= 0.")
        self.row_length = check_int("row_length", row_length, minimum=1)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed)
        self.oversize = check_choice("oversize", oversize, OVERSIZE)
        self.sample_count = len(self.lengths)
        self._init_ranks(num_replicas, rank, drop_last=False)
        self.split = [i for i, n in enumerate(self.lengths) if n > self.row_length]
        self._row_count: dict[int, int] = {}
        pack_rows(self.lengths, self.row_length, oversize=self.oversize)  # refuses here

    # -- the epoch's rows ------------------------------------------------------------------------
    def global_rows(self, epoch: int | None = None) -> list[Row]:
        """Every row of an epoch, in order (before sharding)."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else None
        rows = pack_rows(
            self.lengths, self.row_length, order, oversize=self.oversize,
            multiple_of=self.num_replicas,
        )  # fmt: skip
        if self.shuffle:
            rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        return rows

    def rank_rows(self, epoch: int | None = None) -> list[Row]:
        """This rank's rows of an epoch, in order."""
        return self.global_rows(epoch)[self.rank :: self.num_replicas]

    def fill(self) -> float:
        """Tokens over slots of the packed rows (the same every epoch)."""
        return fill(self.global_rows(0), self.row_length)

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        world = self.num_replicas
        if world not in self._row_count:
            self._row_count[world] = len(self.global_rows(0))
        return self._row_count[world] // world

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[Row]:
        yield from self.walk(self.rank_rows(), self.position)


class PackedDocuments(Dataset):
    """The rows of ``dataset``'s documents: ``self[row]`` is ``build_row`` of its pieces.

    Args:
        dataset: The user's map-style dataset (items with ``input_ids``, optionally ``labels``).
        row_length: Tokens in a row.
        pad_id: The token id of the padding at the end of a row (its labels are -100).
        shifted_labels: The items' labels are already the next tokens (see ``build_row``).
    """

    def __init__(
        self, dataset: Any, row_length: int, *, pad_id: int = 0, shifted_labels: bool = False
    ) -> None:
        self.dataset = dataset
        self.row_length = row_length
        self.pad_id = pad_id
        self.shifted_labels = shifted_labels

    def __getitem__(self, row: Row) -> dict[str, torch.Tensor]:
        pieces = []
        for index, start, stop in row:
            ids, labels = read_document(self.dataset[index])
            pieces.append((ids[start:stop], None if labels is None else labels[start:stop]))
        return build_row(
            pieces, self.row_length, pad_id=self.pad_id, shifted_labels=self.shifted_labels
        )


def pack_dataloader(
    loader: DataLoader,
    row_length: int,
    *,
    rows_per_batch: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    oversize: str = "split",
    pad_id: int = 0,
    shifted_labels: bool = False,
    lengths: Sequence[int] | None = None,
) -> DataLoader:
    """A DataLoader of packed rows of ``loader``'s documents (same workers, pinning and
    timeout; ``rows_per_batch`` rows a batch, default the loader's ``batch_size``). Its sampler
    is a ``PackedRowSampler``; ``lengths`` (one per item) saves reading every item once."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    rows_per_batch = check_int(
        "rows_per_batch", rows_per_batch or loader.batch_size or 1, minimum=1
    )
    lengths = list(lengths) if lengths is not None else document_lengths(loader.dataset)
    sampler = PackedRowSampler(lengths, row_length, shuffle=shuffle, seed=seed, oversize=oversize)
    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
    )  # fmt: skip
    if loader.num_workers > 0:
        kwargs.update(
            persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor
        )
    packed = PackedDocuments(
        loader.dataset, row_length, pad_id=pad_id, shifted_labels=shifted_labels
    )
    return DataLoader(packed, batch_size=rows_per_batch, sampler=sampler, **kwargs)
