"""Preload a whole (small) dataset onto the training device and serve batches by index.

``preload_to_device`` collates the dataset once into device tensors; the returned DataLoader
keeps the sampler, batch_size and drop_last (so the same samples in the same order) and copies
only the batch's indices to the device per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from lightning_efficient.core._internals import tree_flatten, tree_unflatten
from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_int, format_bytes, parse_bytes
from lightning_efficient.techniques.dataloading.rebuild import _check_sampler_fits

__all__ = [
    "PreloadRefused",
    "PreloadedBatches",
    "preloaded_loader",
    "preload_to_device",
]


class PreloadedBatches(Dataset):
    """A whole dataset collated into device tensors (leading dimension = sample index).

    ``__getitems__(indices)`` returns the batch by one ``index_select`` per tensor on the device;
    the DataLoader's collate step then passes it through. Only the indices (8 bytes per sample)
    travel to the device each step.
    """

    def __init__(self, leaves: list[torch.Tensor], spec: Any, length: int) -> None:
        self.leaves, self.spec, self.length = leaves, spec, length
        self.device = leaves[0].device if leaves else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        idx = torch.as_tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
        return tree_unflatten([t.index_select(0, idx) for t in self.leaves], self.spec)


def _already_collated(batch: Any) -> Any:
    return batch


class PreloadRefused(ValueError):
    """The dataset cannot be preloaded (too large, or not a map-style tensor dataset)."""


def _leaves_of(batch: Any, n: int) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = tree_flatten(batch)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != n:
            what = (
                type(leaf).__name__
                if not isinstance(leaf, torch.Tensor)
                else f"tensor of shape {tuple(leaf.shape)}"
            )
            raise PreloadRefused(
                f"a collated batch holds a {what}, not a tensor with one row per sample; only "
                "batches of tensors (default_collate of tensors/numbers) can be served by index."
            )
    return leaves, spec


def preloaded_loader(
    loader: DataLoader, device: torch.device | str, max_bytes: int | str = "2GiB"
) -> Change:
    """:func:`preload_to_device` with its report line: a ``Change`` whose ``value`` is the new,
    preloaded loader and whose figures are the bytes preloaded. ``loader`` itself is not
    changed, so there is nothing to undo (not an ``apply_*``: it applies nothing)."""
    new = preload_to_device(loader, device, max_bytes)
    nbytes = new.dataset.nbytes
    return Change(
        f"{format_bytes(nbytes)} preloaded onto {torch.device(device)}; batches served by index",
        figures={"preloaded_bytes": nbytes},
        value=new,
    )


def preload_to_device(
    loader: DataLoader,
    device: torch.device | str,
    max_bytes: int | str = "2GiB",
    *,
    chunk_size: int = 1024,
) -> DataLoader:
    """Collate the whole dataset of ``loader`` once onto ``device`` and serve batches by index.

    The returned DataLoader keeps the sampler (shuffle semantics, a custom batch sampler),
    batch_size and drop_last, so it yields the same samples in the same order; under DDP,
    Lightning injects its DistributedSampler into it as into the original. It loads in the main
    process (no workers, no pinning): the data already lives on the device.

    Raises:
        PreloadRefused (a ValueError): the dataset is larger than ``max_bytes`` (the message gives
            both), is iterable-style, has no length, uses a custom ``collate_fn`` (a collate that
            pads to the longest sample of each batch cannot be served by index), or collates into
            something other than tensors with one row per sample.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    limit = parse_bytes("max_bytes", max_bytes)
    check_int("chunk_size", chunk_size, minimum=1)
    device = torch.device(device)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise PreloadRefused("an iterable-style dataset has no indices to serve batches by.")
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise PreloadRefused("the dataset has no length.") from err
    if loader.batch_size is None and loader.batch_sampler is None:
        raise PreloadRefused("the loader does not batch (batch_size=None).")
    if loader.collate_fn is not default_collate:
        name = getattr(loader.collate_fn, "__name__", type(loader.collate_fn).__name__)
        raise PreloadRefused(
            f"the loader's collate_fn is {name!r}, not torch's default_collate; a custom collate "
            "(e.g. padding to the longest sample of the batch) cannot be replaced by indexing a "
            "dataset collated once."
        )
    _check_sampler_fits(loader)
    if n == 0:
        raise PreloadRefused("the dataset is empty.")
    # size from a few samples, before anything large is built
    probe_n = min(n, 8)
    probe, _ = _leaves_of(default_collate([dataset[i] for i in range(probe_n)]), probe_n)
    per_sample = sum(t[0].numel() * t.element_size() for t in probe)
    total = per_sample * n
    if total > limit:
        raise PreloadRefused(
            f"the dataset needs {format_bytes(total)} ({n} samples x {format_bytes(per_sample)}) "
            f"on the device, more than max_bytes={format_bytes(limit)}. Raise max_bytes if the "
            "device has room, or use DataLoaderTuning to load it with worker processes instead."
        )
    leaves: list[torch.Tensor] = []
    spec = None
    for start in range(0, n, chunk_size):
        stop = min(n, start + chunk_size)
        chunk_leaves, chunk_spec = _leaves_of(
            default_collate([dataset[i] for i in range(start, stop)]), stop - start
        )
        if spec is None:
            spec = chunk_spec
            leaves = [
                torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=device) for t in chunk_leaves
            ]
        elif chunk_spec != spec or any(
            t.shape[1:] != d.shape[1:] for t, d in zip(chunk_leaves, leaves)
        ):
            raise PreloadRefused(
                "samples differ in structure or shape; only same-shaped samples can be collated once."
            )
        for dst, src in zip(leaves, chunk_leaves):
            dst[start:stop].copy_(src)
    data = PreloadedBatches(leaves, spec, n)
    kwargs: dict[str, Any] = dict(
        dataset=data, num_workers=0, collate_fn=_already_collated, generator=loader.generator
    )
    if loader.batch_size is not None:
        kwargs.update(
            batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last
        )
    else:
        kwargs.update(batch_sampler=loader.batch_sampler)
    return DataLoader(**kwargs)
