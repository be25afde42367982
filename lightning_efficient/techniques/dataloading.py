"""The data pipeline: DataLoader tuning, device preloading, input-stall detection, length bucketing.

Pure functions (no Lightning needed, exported from ``lightning_efficient.functional``):

- ``rebuild_dataloader(loader, num_workers=..., ...)``: the same loader (dataset, sampler or batch
  sampler, collate_fn, batch_size, drop_last, generator) with other worker/pinning settings and
  deterministic worker seeding; it yields the same samples in the same order.
- ``auto_num_workers(devices)``: the usable CPU cores per device, minus one for the main process.
- ``tune_num_workers(loader, candidates, time_cap_s)``: batches/s per worker count, fastest kept.
- ``preload_to_device(loader, device, max_bytes)``: the whole dataset collated once onto the
  device; batches are served by indexing device tensors (no per-step host-to-device copy).
- ``LengthBucketSampler`` and ``padding_stats``: batches of similar length, less padding.

Callbacks (they only decide *when*): ``DataLoaderTuning``, ``DevicePreload`` and
``InputStallMonitor``. The first two rebuild the loaders that the datamodule's (or module's)
``train_dataloader``/``val_dataloader`` return, by wrapping those hooks in ``setup``: Lightning
calls them later (the train loader after ``on_fit_start``), inside its argument-capturing context,
so the rebuilt loader still gets Lightning's ``DistributedSampler`` under DDP.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    format_bytes,
    parse_bytes,
)

__all__ = [
    "rebuild_dataloader",
    "auto_num_workers",
    "tune_num_workers",
    "TuneResult",
    "preload_to_device",
    "PreloadedBatches",
    "WorkerSeeder",
    "LengthBucketSampler",
    "padding_stats",
    "DataLoaderTuning",
    "DevicePreload",
    "InputStallMonitor",
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
        if self.persistent_workers and self.num_workers > 0 and self._iterator is not None:
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
    return _RNGParityDataLoader(**kwargs)


def _check_sampler_fits(loader: DataLoader) -> None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, LengthBucketSampler):
            sampler.check_dataset(loader.dataset)


def auto_num_workers(devices: int = 1) -> int:
    """Worker processes per device: the CPU cores this process may use, divided by the local
    devices, minus one core for the main (training) process; at least 1."""
    check_int("devices", devices, minimum=1)
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    return max(1, cores // devices - 1)


# ---------------------------------------------------------------------------------------------
# tune_num_workers
# ---------------------------------------------------------------------------------------------
@dataclass
class TuneResult:
    """What ``tune_num_workers`` measured: steady-state batches/s per worker count."""

    best: int
    batches_per_s: dict[int, float]
    batches: dict[int, int]
    measured_s: float
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = ["| num_workers | batches/s | batches timed |", "|---:|---:|---:|"]
        for w, rate in self.batches_per_s.items():
            mark = " (kept)" if w == self.best else ""
            lines.append(f"| {w}{mark} | {rate:.1f} | {self.batches[w]} |")
        return "\n".join(lines)


def tune_num_workers(
    loader: DataLoader,
    candidates: Sequence[int] | None = None,
    time_cap_s: float = 10.0,
    *,
    max_batches: int = 50,
    tolerance: float = 0.05,
    pin_memory: bool | None = None,
    rank: int = 0,
) -> TuneResult:
    """Measure batches/s of ``loader`` for each worker count and return the fastest.

    Each candidate gets an equal share of ``time_cap_s`` (the first batch, which includes worker
    start-up, is not timed; then up to ``max_batches`` batches). The smallest count within
    ``tolerance`` of the best rate wins (fewer processes for the same speed). The global RNG
    states and a stateful sampler's position are restored afterwards, so tuning does not change
    what training sees. Timing uses the instrument's ``StepTimer``.
    """
    from lightning_efficient.measure.timing import StepTimer

    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    if candidates is None:
        auto = auto_num_workers()
        candidates = sorted({0, 1, auto, 2 * auto})
    if (
        isinstance(candidates, (str, bytes))
        or not isinstance(candidates, Sequence)
        or not candidates
    ):
        raise TypeError(
            f"`candidates` must be a non-empty list of worker counts; got {candidates!r}."
        )
    for c in candidates:
        _check_num_workers("candidates", c, allow_auto=False)
    check_float("time_cap_s", time_cap_s, minimum=0.0)
    if time_cap_s <= 0:
        raise ValueError(f"`time_cap_s` must be > 0 seconds; got {time_cap_s!r}.")
    check_int("max_batches", max_batches, minimum=1)
    check_float("tolerance", tolerance, minimum=0.0, maximum=1.0)

    states = _rng_states()
    sampler_states = _sampler_states(loader)
    share = time_cap_s / len(candidates)
    rates: dict[int, float] = {}
    counts: dict[int, int] = {}
    notes: list[str] = []
    start_all = time.perf_counter()
    try:
        for c in dict.fromkeys(candidates):
            trial = rebuild_dataloader(
                loader, num_workers=c, persistent_workers=False, pin_memory=pin_memory, rank=rank
            )
            timer = StepTimer("cpu")
            deadline = time.perf_counter() + share
            it = iter(trial)
            n = 0
            try:
                next(it)  # worker start-up and the first batch: not steady state
                while n < max_batches and time.perf_counter() < deadline:
                    timer.start("fetch")
                    try:
                        next(it)
                    except StopIteration:
                        timer.stop("fetch")
                        it = iter(trial)
                        continue
                    timer.stop("fetch")
                    n += 1
            except StopIteration:
                pass
            finally:
                del it
            spent = timer.totals().get("fetch", 0.0)
            counts[c] = n
            rates[c] = n / spent if n and spent > 0 else 0.0
            if n < 3:
                notes.append(
                    f"num_workers={c}: only {n} batches fit in {share:.2g} s; its rate is rough"
                )
    finally:
        _restore_rng_states(states)
        _restore_sampler_states(loader, sampler_states)
    top = max(rates.values())
    best = min(c for c, r in rates.items() if r >= (1 - tolerance) * top)
    return TuneResult(best, rates, counts, time.perf_counter() - start_all, notes)


def _rng_states() -> tuple[Any, ...]:
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_state = None
    return torch.get_rng_state(), random.getstate(), np_state


def _restore_rng_states(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if states[2] is not None:
        import numpy as np

        np.random.set_state(states[2])


def _sampler_states(loader: DataLoader) -> list[tuple[Any, Any]]:
    out = []
    for s in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        if (
            s is not None
            and callable(getattr(s, "state_dict", None))
            and callable(getattr(s, "load_state_dict", None))
        ):
            out.append((s, s.state_dict()))
    return out


def _restore_sampler_states(loader: DataLoader, states: list[tuple[Any, Any]]) -> None:
    for sampler, state in states:
        sampler.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# preload_to_device
# ---------------------------------------------------------------------------------------------
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
        from torch.utils._pytree import tree_unflatten

        idx = torch.as_tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
        return tree_unflatten([t.index_select(0, idx) for t in self.leaves], self.spec)


def _already_collated(batch: Any) -> Any:
    return batch


class PreloadRefused(ValueError):
    """The dataset cannot be preloaded (too large, or not a map-style tensor dataset)."""


def _leaves_of(batch: Any, n: int) -> tuple[list[torch.Tensor], Any]:
    from torch.utils._pytree import tree_flatten

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
    from torch.utils.data import default_collate

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


# ---------------------------------------------------------------------------------------------
# LengthBucketSampler
# ---------------------------------------------------------------------------------------------
class LengthBucketSampler(DistributedSampler):
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
        self._num_replicas = check_int("num_replicas", num_replicas, minimum=1, allow_none=True)
        self._rank = check_int("rank", rank, minimum=0, allow_none=True)
        if num_replicas is not None and rank is not None and rank >= num_replicas:
            raise ValueError(f"`rank` must be < num_replicas={num_replicas}; got {rank}.")
        self.drop_last = check_bool("drop_last", drop_last)
        self.epoch = 0
        self.position = 0
        self.dataset = dataset
        if dataset is not None:
            self.check_dataset(dataset)

    # -- DDP ---------------------------------------------------------------------------------
    @staticmethod
    def _group() -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self._num_replicas if self._num_replicas is not None else self._group()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = value

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._rank if self._rank is not None else self._group()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        n, r = len(self.lengths), self.num_replicas
        return n // r if self.drop_last else math.ceil(n / r)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self.num_samples * self.num_replicas

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
        order = self.rank_order()
        start = self.position
        return self._walk(order, start)

    def _walk(self, order: list[int], start: int) -> Iterator[int]:
        self.position = start
        for i in order[start:]:
            self.position += 1
            yield i
        self.position = 0

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state.get("epoch", self.epoch))
        self.position = int(state.get("position", 0))


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


# ---------------------------------------------------------------------------------------------
# the callbacks
# ---------------------------------------------------------------------------------------------
_HOOKS = ("train_dataloader", "val_dataloader")


class _LoaderRebuilder(Technique):
    """Wraps the datamodule's (or module's) dataloader hooks in ``setup`` so that every loader they
    return passes through ``self._rebuild(trainer, loader, hook)``; restored in ``teardown``."""

    def __init__(self) -> None:
        super().__init__()
        self._wrapped: list[tuple[Any, str]] = []

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if self._wrapped:
            return
        self._start()
        datamodule = trainer.datamodule
        for hook in _HOOKS:
            source = None
            if datamodule is not None and is_overridden(hook, datamodule):
                source = datamodule
            elif datamodule is None and is_overridden(hook, pl_module):
                source = pl_module
            if source is None:
                continue
            original = getattr(source, hook)

            def wrapped(_original: Callable[[], Any] = original, _hook: str = hook) -> Any:
                return self._rebuild_all(trainer, _original(), _hook)

            setattr(source, hook, wrapped)
            self._wrapped.append((source, hook))
        if not any(h == "train_dataloader" for _, h in self._wrapped) and stage == "fit":
            self.no_effect(
                "the train DataLoader was not returned by a LightningDataModule or LightningModule "
                "`train_dataloader()` (loaders passed to trainer.fit directly cannot be rebuilt); "
                "return it from `train_dataloader()`, or rebuild it yourself with "
                "lightning_efficient.functional."
            )

    def _start(self) -> None:
        """Forget what an earlier fit decided (a new trainer may differ)."""

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for source, hook in self._wrapped:
            if hook in vars(source):
                delattr(source, hook)
        self._wrapped = []

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # a failed fit leaves the hooks as they were

    def _rebuild_all(self, trainer: Any, loaders: Any, hook: str) -> Any:
        if isinstance(loaders, DataLoader):
            return self._rebuild(trainer, loaders, hook)
        if isinstance(loaders, (list, tuple)):
            return type(loaders)(self._rebuild_all(trainer, x, hook) for x in loaders)
        if isinstance(loaders, dict):
            return {k: self._rebuild_all(trainer, v, hook) for k, v in loaders.items()}
        return loaders

    def _rebuild(
        self, trainer: Any, loader: DataLoader, hook: str
    ) -> DataLoader:  # pragma: no cover
        raise NotImplementedError


class DataLoaderTuning(_LoaderRebuilder):
    """Rebuild the train and validation DataLoaders with worker processes, pinning and prefetching.

    The loaders that the datamodule's (or module's) ``train_dataloader``/``val_dataloader`` return
    are rebuilt with ``rebuild_dataloader``: same dataset, sampler, batch sampler, collate_fn,
    batch_size and drop_last, so the same samples in the same order; workers are seeded per rank.

    Args:
        num_workers: Worker processes per loader: an integer >= 0, or ``"auto"``
            (``auto_num_workers(trainer.num_devices)``: the CPU cores per device minus one).
        pin_memory: Page-locked host batches for faster copies to the GPU; ``"auto"``: on when
            training on CUDA.
        persistent_workers: Keep the workers alive between epochs (only with workers).
        prefetch_factor: Batches each worker loads ahead (None: PyTorch's default of 2); needs
            workers.
        tune: Measure batches/s for a few worker counts when fit starts and keep the fastest
            (``tune_num_workers``); ``num_workers`` is then only the fallback.
        tune_time_s: Cap on the time spent measuring.
    """

    loads_in_workers = True

    def __init__(
        self,
        num_workers: int | str = "auto",
        pin_memory: bool | str = "auto",
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        tune: bool = False,
        tune_time_s: float = 10.0,
    ) -> None:
        super().__init__()
        self.num_workers = _check_num_workers("num_workers", num_workers, allow_auto=True)
        self.pin_memory = _check_pin(pin_memory)
        self.persistent_workers = check_bool("persistent_workers", persistent_workers)
        self.prefetch_factor = _check_prefetch(prefetch_factor, num_workers)
        self.tune = check_bool("tune", tune)
        self.tune_time_s = check_float("tune_time_s", tune_time_s, minimum=0.0)
        if self.tune_time_s <= 0:
            raise ValueError(f"`tune_time_s` must be > 0 seconds; got {tune_time_s!r}.")
        self._chosen: int | None = None
        self._tuned: TuneResult | None = None
        self._changes: dict[str, str] = {}

    def _start(self) -> None:
        self._chosen, self._tuned, self._changes = None, None, {}

    def _workers(self, trainer: Any, loader: DataLoader) -> int:
        if self._chosen is None:
            if self.tune:
                devices = max(1, int(getattr(trainer, "num_devices", 1) or 1))
                auto = auto_num_workers(devices)
                candidates = sorted({0, 1, auto, 2 * auto})
                self._tuned = tune_num_workers(
                    loader, candidates, self.tune_time_s, rank=trainer.global_rank
                )
                self._chosen = self._tuned.best
            elif self.num_workers == "auto":
                self._chosen = auto_num_workers(
                    max(1, int(getattr(trainer, "num_devices", 1) or 1))
                )
            else:
                self._chosen = int(self.num_workers)
        return self._chosen

    def _rebuild(self, trainer: Any, loader: DataLoader, hook: str) -> DataLoader:
        if isinstance(loader.dataset, IterableDataset):
            self.no_effect(
                f"{hook}: an iterable-style dataset keeps its {loader.num_workers} workers (more "
                "workers would each replay the whole stream unless the dataset shards itself)."
            )
        workers = self._workers(trainer, loader)
        pin = self.pin_memory
        if pin == "auto":
            pin = getattr(trainer.strategy.root_device, "type", "cpu") == "cuda"
        new = rebuild_dataloader(
            loader,
            num_workers=workers,
            pin_memory=bool(pin),
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            rank=trainer.global_rank,
        )
        self._changes[hook] = (
            f"{hook}: num_workers {loader.num_workers}->{new.num_workers}, pin_memory "
            f"{loader.pin_memory}->{new.pin_memory}, persistent_workers {new.persistent_workers}"
        )
        figures: dict[str, Any] = {"num_workers": new.num_workers}
        if self._tuned is not None:
            figures.update(
                {f"batches_per_s_w{w}": round(r, 2) for w, r in self._tuned.batches_per_s.items()}
            )
            figures["tune_s"] = self._tuned.measured_s
        self.report(trainer, "; ".join(self._changes.values()), **figures)
        self.note(self._changes[hook])
        return new


class DevicePreload(_LoaderRebuilder):
    """Collate the whole (small) dataset onto the training device once; serve batches by index.

    The train and validation loaders are replaced by ``preload_to_device`` loaders: same sampler,
    batch_size and drop_last, so the same samples in the same order (and Lightning's
    DistributedSampler under DDP); no worker processes and no host-to-device copy of the data per
    step. Each DDP rank holds the whole dataset. A dataset larger than ``max_bytes`` (all
    preloaded loaders together) is refused with its size and the limit.

    Args:
        max_bytes: Most device memory the preloaded data may take, e.g. ``"2GiB"`` or bytes.
    """

    preloads_to_device = True

    def __init__(self, max_bytes: int | str = "2GiB") -> None:
        super().__init__()
        parse_bytes("max_bytes", max_bytes)
        self.max_bytes = max_bytes
        self._used: dict[str, int] = {}

    def _start(self) -> None:
        self._used = {}

    def _rebuild(self, trainer: Any, loader: DataLoader, hook: str) -> DataLoader:
        limit = parse_bytes("max_bytes", self.max_bytes)
        used = sum(b for h, b in self._used.items() if h != hook)
        device = trainer.strategy.root_device
        try:
            new = preload_to_device(loader, device, max(1, limit - used))
        except PreloadRefused as err:
            if "more than max_bytes" in str(err):
                raise PreloadRefused(f"DevicePreload ({hook}): {err}") from err
            self.no_effect(f"{hook} is loaded as before: {err}")
            return loader
        self._used[hook] = new.dataset.nbytes
        self.report(
            trainer,
            f"{', '.join(self._used)} preloaded onto {device}; batches served by index",
            preloaded_bytes=sum(self._used.values()),
            max_bytes=limit,
        )
        return new


class InputStallMonitor(Technique):
    """Measure the share of step time spent waiting for the next batch; warn once past a threshold.

    The wait is the time from ``on_train_batch_end`` to the next ``on_train_batch_start`` (the
    next batch is fetched and moved to the device there), the step the time from
    ``on_train_batch_start`` to ``on_train_batch_end``; time spent in validation is
    skipped. Timed with the instrument's ``StepTimer`` (CUDA events on a GPU, so the wait is the
    time the GPU sat idle). After ``check_after`` steps (and again when training ends, if not
    decided yet) it warns once, with a concrete fix, when ``wait / (wait + step) > threshold``.
    The fraction goes to the efficiency report.

    Args:
        threshold: Stall fraction that triggers the warning, in [0, 1).
        check_after: Steps measured before the first decision (the first batch is never counted).
    """

    def __init__(self, threshold: float = 0.1, check_after: int = 20) -> None:
        super().__init__()
        self.threshold = check_float(
            "threshold", threshold, minimum=0.0, maximum=1.0, max_exclusive=True
        )
        self.check_after = check_int("check_after", check_after, minimum=1)
        self._timer: Any = None
        self._waiting = False
        self._steps = 0
        self._decided = False
        self.stall_fraction: float | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_efficient.measure.timing import StepTimer

        self._timer = StepTimer(trainer.strategy.root_device)
        self._waiting, self._steps, self._decided = False, 0, False
        self.stall_fraction = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._end_wait()
        if not self._decided and self._steps >= self.check_after:
            self._decide(trainer)  # no region is open here
        elif self._steps % 256 == 0:
            self._timer.totals()  # read pending CUDA events now and then, so they do not pile up
        self._timer.start("step")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._timer.stop("step")
        self._steps += 1
        self._timer.start("wait")
        self._waiting = True

    def _end_wait(self) -> None:
        if self._waiting:
            self._timer.stop("wait")
            self._waiting = False

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # what follows is validation, not waiting for data (only the short gap before it counts)
        if self._timer is not None:
            self._end_wait()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is not None:
            self._end_wait()

    def measured(self) -> tuple[float, float]:
        """(wait seconds, step seconds) measured so far (call between steps)."""
        if self._timer is None:
            return 0.0, 0.0
        totals = self._timer.totals()
        return float(totals.get("wait", 0.0)), float(totals.get("step", 0.0))

    def _decide(self, trainer: Any) -> None:
        wait, step = self.measured()
        if wait + step <= 0:
            return
        self._decided = True
        self.stall_fraction = fraction = wait / (wait + step)
        if fraction > self.threshold:
            self.warn(
                f"{fraction:.0%} of the step time is spent waiting for the next batch "
                f"(threshold {self.threshold:.0%}). Fix: {self._fix(trainer, wait, step)}"
            )

    def _fix(self, trainer: Any, wait: float, step: float) -> str:
        loader = trainer.train_dataloader
        current = loader.num_workers if isinstance(loader, DataLoader) else 0
        # with w workers a batch takes about w*(wait+step) to load; hide it behind `step`
        need = math.ceil(wait / step) if current == 0 else math.ceil(current * (wait + step) / step)
        need = max(need, current + 1, 1)
        return (
            f"Trainer(callbacks=[DataLoaderTuning(num_workers={need})]) (now {current} workers; "
            f"this machine has {auto_num_workers() + 1} usable cores), or DevicePreload() if the "
            "dataset fits in device memory."
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._timer is None:
            return
        self._end_wait()
        if not self._decided:
            self._decide(trainer)
        wait, step = self.measured()
        fraction = wait / (wait + step) if wait + step > 0 else 0.0
        self.stall_fraction = fraction
        self.report(
            trainer,
            f"{fraction:.1%} of step time waiting for data over {self._steps} steps",
            stall_fraction=round(fraction, 4),
            wait_s=wait,
            step_s=step,
        )
