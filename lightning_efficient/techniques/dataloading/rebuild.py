"""Rebuild a DataLoader with other worker settings, and seed its workers per rank.

``rebuild_dataloader`` keeps everything that decides which samples come in which order
(dataset, sampler or batch sampler, collate_fn, batch_size, drop_last, generator), so the
rebuilt loader yields the same samples in the same order; ``WorkerSeeder`` seeds each worker
from the loader's base seed, the worker id and the DDP rank. Other techniques that need a loader
like the user's with one thing changed (a sampler, a worker count) build on it.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_efficient.core._internals import kept_iterator
from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_bool, check_choice, check_int
from lightning_efficient.measure.speed.host import usable_cores
from lightning_efficient.techniques.dataloading.buckets import LengthBucketSampler

__all__ = [
    "WorkerSeeder",
    "tuned_loader",
    "auto_num_workers",
    "rebuild_dataloader",
]


# ---------------------------------------------------------------------------------------------
# argument checks shared by the functions and the callbacks
# ---------------------------------------------------------------------------------------------
def _check_num_workers(name: str, value: Any, *, allow_auto: bool) -> int | str:
    if allow_auto and value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, str) or isinstance(value, bool) or not isinstance(value, int):
        allowed = "a non-negative integer" + (" or 'auto'" if allow_auto else "")
        raise TypeError(f"`{name}` must be {allowed}; got {value!r} ({type(value).__name__}).")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0 (0 loads in the main process); got {value!r}.")
    return value


def _check_prefetch(prefetch_factor: Any, num_workers: Any) -> int | None:
    check_int("prefetch_factor", prefetch_factor, minimum=1, allow_none=True)
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError(
            f"`prefetch_factor`={prefetch_factor!r} needs worker processes, but `num_workers`=0 "
            "loads in the main process. Set num_workers > 0 (or 'auto'), or prefetch_factor=None."
        )
    return prefetch_factor


def _check_pin(value: Any) -> bool | str:
    if isinstance(value, bool):
        return value
    return check_choice("pin_memory", value, ("auto", True, False))


# ---------------------------------------------------------------------------------------------
# rebuild_dataloader
# ---------------------------------------------------------------------------------------------
class WorkerSeeder:
    """``worker_init_fn`` that seeds ``torch``, ``random`` and ``numpy`` in each worker from the
    loader's base seed (drawn from the global RNG, or the loader's ``generator``), the worker id and
    the process rank: reproducible for a given seed, and different on every rank and worker
    (PyTorch alone gives every DDP rank the same worker seeds)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = check_int("rank", rank, minimum=0)

    def __call__(self, worker_id: int) -> None:
        # inside a worker, torch.initial_seed() is base_seed + worker_id
        seed = (torch.initial_seed() + 1_000_003 * self.rank) % 2**63
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy ships with torch here
            return
        np.random.seed(seed % 2**32)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerSeeder) and other.rank == self.rank

    def __repr__(self) -> str:
        return f"WorkerSeeder(rank={self.rank})"


class _RNGParityDataLoader(DataLoader):
    """A DataLoader whose persistent workers draw the same per-epoch base seed as a plain loader.

    A plain DataLoader draws one number from the global RNG (or its ``generator``) every time an
    iterator is created; with ``persistent_workers`` the iterator is reused and nothing is drawn
    after the first epoch. That shifts the global RNG stream, so a generator-less
    ``RandomSampler`` (``shuffle=True``) or dropout would differ from the plain run from epoch 2.
    Drawing the number here keeps the stream, and therefore the sample order, identical.
    """

    def __iter__(self):  # type: ignore[override]
        if self.persistent_workers and self.num_workers > 0 and kept_iterator(self) is not None:
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return super().__iter__()


def rebuild_dataloader(
    loader: DataLoader,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    seed_workers: bool = True,
    rank: int = 0,
) -> DataLoader:
    """The same DataLoader with other worker settings; it yields the same samples in the same order.

    Kept: dataset, sampler (so ``shuffle`` semantics), a custom ``batch_sampler``, batch_size,
    drop_last, collate_fn, timeout, worker_init_fn, multiprocessing_context, generator. ``None``
    keeps the loader's own value. ``persistent_workers`` and ``prefetch_factor`` apply only when
    there are workers. ``seed_workers`` installs ``WorkerSeeder(rank)`` when the loader has no
    ``worker_init_fn``. Iterable-style datasets keep their worker count (each worker would replay
    the whole stream unless the dataset shards itself by ``get_worker_info()``).

    Raises:
        TypeError: ``loader`` is not a DataLoader, or an argument has the wrong type.
        ValueError: a negative worker count, or ``prefetch_factor`` with zero workers.
    """
    return _RNGParityDataLoader(
        **_rebuild_kwargs(
            loader,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            seed_workers=seed_workers,
            rank=rank,
        )
    )


def _rebuild_kwargs(
    loader: DataLoader,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    seed_workers: bool = True,
    rank: int = 0,
) -> dict[str, Any]:
    """The constructor arguments of ``rebuild_dataloader``'s loader (checked as it says)."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    if num_workers is not None:
        _check_num_workers("num_workers", num_workers, allow_auto=False)
    if pin_memory is not None:
        check_bool("pin_memory", pin_memory)
    if persistent_workers is not None:
        check_bool("persistent_workers", persistent_workers)
    check_bool("seed_workers", seed_workers)
    check_int("rank", rank, minimum=0)
    workers = loader.num_workers if num_workers is None else num_workers
    if isinstance(loader.dataset, IterableDataset):
        workers = loader.num_workers
    _check_prefetch(prefetch_factor, workers)
    _check_sampler_fits(loader)

    kwargs: dict[str, Any] = dict(
        dataset=loader.dataset,
        num_workers=workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory if pin_memory is None else pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
    )
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is not None:  # the batch sampler was made from these three
        kwargs.update(
            batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last
        )
    elif loader.batch_sampler is not None:  # a custom batch sampler
        kwargs.update(batch_sampler=loader.batch_sampler)
    else:  # batch_size=None: no automatic batching
        kwargs.update(batch_size=None, sampler=loader.sampler)
    if workers > 0:
        if seed_workers and kwargs["worker_init_fn"] is None:
            kwargs["worker_init_fn"] = WorkerSeeder(rank)
        kwargs["persistent_workers"] = (
            loader.persistent_workers if persistent_workers is None else persistent_workers
        )
        kwargs["prefetch_factor"] = (
            prefetch_factor if prefetch_factor is not None else loader.prefetch_factor
        )
        if loader.multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
    for name in ("pin_memory_device", "in_order"):
        if hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    return kwargs


def tuned_loader(
    loader: DataLoader,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    rank: int = 0,
) -> Change:
    """:func:`rebuild_dataloader` with its report line: a ``Change`` whose ``value`` is the new
    loader (the same samples in the same order) and whose ``what`` is the settings that
    differ. ``loader`` itself is not changed, so there is nothing to undo (not an ``apply_*``:
    it applies nothing)."""
    new = rebuild_dataloader(
        loader,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        rank=rank,
    )
    return Change(loader_change(loader, new), figures={"num_workers": new.num_workers}, value=new)


def loader_change(old: Any, new: Any) -> str:
    """What rebuilding ``old`` as ``new`` (a loader, or its arguments) changed, or kept."""
    if (old.num_workers, old.pin_memory) == (new.num_workers, new.pin_memory):
        return f"kept num_workers {new.num_workers}, pin_memory {new.pin_memory}"
    return (
        f"num_workers {old.num_workers}->{new.num_workers}, pin_memory "
        f"{old.pin_memory}->{new.pin_memory}, persistent_workers {new.persistent_workers}"
    )


def _check_sampler_fits(loader: DataLoader) -> None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, LengthBucketSampler):
            sampler.check_dataset(loader.dataset)


def auto_num_workers(devices: int = 1) -> int:
    """Worker processes per device: the CPU cores this process may use, divided by the local
    devices, minus one core for the main (training) process; at least 1."""
    check_int("devices", devices, minimum=1)
    return max(1, usable_cores() // devices - 1)
