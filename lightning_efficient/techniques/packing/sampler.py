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
- ``items_of(loader)``: the loader's documents as packing reads them (a custom ``collate_fn``
  applied to each document alone, ``CollatedItems``); a sampler that decides which documents
  (a subset, weights) or a batch sampler is refused, never dropped.
- ``pack_dataloader(loader, row_length, ...)``: the same DataLoader settings (workers, pinning)
  over packed rows, ``rows_per_batch`` rows a batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    default_collate,
)

from lightning_efficient.core.validate import check_bool, check_choice, check_int
from lightning_efficient.techniques._sharded_sampler import ShardedSampler
from lightning_efficient.techniques.curriculum.difficulty import check_seed
from lightning_efficient.techniques.curriculum.sampler import own_sampler
from lightning_efficient.techniques.packing.bins import OVERSIZE, Row, fill, pack_rows
from lightning_efficient.techniques.packing.rows import build_row, read_document

__all__ = [
    "document_lengths",
    "PackedRowSampler",
    "PackedDocuments",
    "CollatedItems",
    "items_of",
    "pack_dataloader",
]

#: The largest token id (``pad_id``) accepted: an int32 index.
MAX_TOKEN_ID = 2**31 - 1


def document_lengths(dataset: Any) -> list[int]:
    """The number of tokens of every item of a map-style ``dataset`` (items with ``input_ids``)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"sequence packing needs a map-style dataset (with __len__ and __getitem__); got "
            f"{type(dataset).__name__}."
        )
    return [int(read_document(dataset[i], i)[0].numel()) for i in range(len(dataset))]


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
        self.seed = check_seed(seed)
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict``, checked: ``seed`` in [0, 2**32 - 1], ``epoch`` >= 0,
        ``position`` within the epoch's rows of this rank."""
        if not isinstance(state, dict):
            raise TypeError(f"the packer's state must be a dict; got {type(state).__name__}.")
        seed = check_seed(state.get("seed", self.seed), "state['seed']")
        epoch = check_int("state['epoch']", state.get("epoch", self.epoch), minimum=0)
        position = check_int(
            "state['position']", state.get("position", 0), minimum=0, maximum=len(self)
        )
        self.seed, self.epoch, self.position = seed, epoch, position


class PackedDocuments(Dataset):
    """The rows of ``dataset``'s documents: ``self[row]`` is ``build_row`` of its pieces.

    Args:
        dataset: The user's map-style dataset (items with ``input_ids``, optionally ``labels``).
        row_length: Tokens in a row.
        pad_id: The token id of the padding at the end of a row (its labels are -100).
        shifted_labels: The items' labels are already the next tokens (see ``build_row``).
        lengths: The tokens of every item the rows were packed from (None: not checked); an
            item whose tokens differ fails naming it, instead of a row cut or padded silently.
    """

    def __init__(
        self,
        dataset: Any,
        row_length: int,
        *,
        pad_id: int = 0,
        shifted_labels: bool = False,
        lengths: Sequence[int] | None = None,
    ) -> None:
        self.dataset = dataset
        self.row_length = row_length
        self.pad_id = pad_id
        self.shifted_labels = shifted_labels
        self.lengths = lengths

    def __getitem__(self, row: Row) -> dict[str, torch.Tensor]:
        pieces = []
        for index, start, stop in row:
            ids, labels = read_document(self.dataset[index], index)
            if self.lengths is not None and ids.numel() != self.lengths[index]:
                raise ValueError(
                    f"item #{index} has {ids.numel()} tokens but `lengths` gave "
                    f"{self.lengths[index]}; pass the items' own lengths (or none)."
                )
            pieces.append((ids[start:stop], None if labels is None else labels[start:stop]))
        return build_row(
            pieces, self.row_length, pad_id=self.pad_id, shifted_labels=self.shifted_labels
        )


class CollatedItems(Dataset):
    """``dataset``'s items each passed alone through the loader's ``collate_fn`` (a collate that
    masks prompts, adds labels or special tokens keeps doing so, per document): item ``i`` is
    ``collate_fn([dataset[i]])`` without its batch dimension."""

    def __init__(self, dataset: Any, collate_fn: Any) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        batch = self.collate_fn([self.dataset[i]])
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            name = getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__)
            kind = f"{type(batch).__name__}" + (
                f" with input_ids of shape {tuple(ids.shape)}"
                if isinstance(ids, torch.Tensor)
                else ""
            )
            raise TypeError(
                f"the loader's collate_fn {name!r} made a {kind} of one item; packing passes each "
                "document alone through a custom collate_fn and needs a dict whose `input_ids` "
                "(and `labels`, `attention_mask`) are 1 x tokens tensors. Return such a dict, or "
                "do the collate's work in the dataset."
            )
        return {
            k: v[0] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 1 else v
            for k, v in batch.items()
        }


def items_of(loader: DataLoader) -> Any:
    """The documents of ``loader`` as packing reads them: its dataset, each item through the
    loader's ``collate_fn`` when that is not torch's ``default_collate``.

    Raises:
        ValueError: the loader draws its samples in a way packing would drop (a subset, weights,
            repeats; ``curriculum.sampler.own_sampler`` says which) or batches with its own
            ``batch_sampler``.
    """
    if loader.batch_size is None:
        raise ValueError(
            f"the loader batches with its own {type(loader.batch_sampler).__name__}; packing "
            "builds the batches of rows itself and would drop it. Give the DataLoader a "
            "batch_size (and no batch_sampler) to pack it."
        )
    own = own_sampler(loader)
    if own is not None:
        raise ValueError(
            f"the loader draws its documents with its own {own}; packing orders the documents "
            "itself and would drop it. Give the DataLoader the documents to train on (e.g. a "
            "Subset) with shuffle=True or False to pack them."
        )
    if loader.collate_fn is default_collate:
        return loader.dataset
    return CollatedItems(loader.dataset, loader.collate_fn)


def pack_dataloader(
    loader: DataLoader,
    row_length: int,
    *,
    rows_per_batch: int | None = None,
    seed: int = 0,
    shuffle: bool | None = None,
    oversize: str = "split",
    pad_id: int = 0,
    shifted_labels: bool = False,
    lengths: Sequence[int] | None = None,
) -> DataLoader:
    """A DataLoader of packed rows of ``loader``'s documents (same workers, pinning and
    timeout; ``rows_per_batch`` rows a batch, default the loader's ``batch_size``). Its sampler
    is a ``PackedRowSampler``, shuffled unless ``shuffle`` is False (None: as the loader, whose
    ``shuffle=False`` keeps the dataset's order); a custom ``collate_fn`` is applied to each
    document alone (``items_of``). ``lengths`` (one per item) saves reading every item once;
    a row whose item has other lengths fails naming it."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    rows_per_batch = check_int("rows_per_batch", rows_per_batch, minimum=1, allow_none=True)
    rows_per_batch = rows_per_batch or loader.batch_size or 1
    if shuffle is None:
        shuffle = not isinstance(loader.sampler, SequentialSampler)
    shuffle = check_bool("shuffle", shuffle)
    pad_id = check_int("pad_id", pad_id, minimum=0, maximum=MAX_TOKEN_ID)
    shifted_labels = check_bool("shifted_labels", shifted_labels)
    dataset = items_of(loader)
    if lengths is None:
        lengths = document_lengths(dataset)
    elif isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"`lengths` must be a sequence of ints; got {type(lengths).__name__}.")
    elif len(lengths) != len(dataset):
        raise ValueError(
            f"`lengths` has {len(lengths)} entries but the loader's dataset {len(dataset)} items; "
            "give one length per item (or none: they are read from the items)."
        )
    lengths = [check_int(f"lengths[{i}]", n, minimum=0) for i, n in enumerate(lengths)]
    if not any(lengths):
        raise ValueError(
            f"every one of the {len(lengths)} documents has 0 tokens (after dropping the padding "
            "their attention_mask marks): there is nothing to pack."
        )
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
        dataset, row_length, pad_id=pad_id, shifted_labels=shifted_labels, lengths=lengths
    )
    return DataLoader(packed, batch_size=rows_per_batch, sampler=sampler, **kwargs)
