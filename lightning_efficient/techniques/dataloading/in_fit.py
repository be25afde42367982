"""The train loader's worker count, decided from the fit's own first steps.

How fast training consumes batches bounds the worker search (loading faster gains nothing). It
is measured on the fit's own steps, never by running the module's ``training_step`` out of band
(which would update whatever state the step touches: metrics, counters, caches). So the train
loader starts loading in the main process, as a ``TunedInFit`` loader: same dataset, sampler,
batch sampler, collate_fn and batch size as the user's. ``StepClock`` times the first training
steps; then the search runs (``DataLoaderTuning``, between two steps) and one loader built with
the chosen count takes over: the rest of that epoch from the same index iterator (so the batches
and their order are the user's), then every later epoch (its workers start once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_efficient.measure.speed.timing import StepTimer
from lightning_efficient.techniques.dataloading.rebuild import _RNGParityDataLoader

__all__ = ["StepClock", "TunedInFit", "WorkerChoice"]


class StepClock:
    """The fastest of the training steps after ``warmup`` (their compute only: from a batch's
    start to its end, so without the wait for the batch), as batches per second."""

    def __init__(self, device: Any, steps: int = 2, warmup: int = 1) -> None:
        self.timer, self.steps, self.warmup = StepTimer(device), steps, warmup
        self.seen = 0
        self._open: str | None = None

    def start(self) -> None:
        if self.seen >= self.warmup and self.timed < self.steps:
            self._open = f"step{self.seen}"
            self.timer.start(self._open)

    def stop(self) -> None:
        if self._open is not None:
            self.timer.stop(self._open)
            self._open = None
        self.seen += 1

    @property
    def timed(self) -> int:
        return max(0, min(self.seen - self.warmup, self.steps))

    @property
    def ready(self) -> bool:
        return self.timed >= self.steps

    def batches_per_s(self) -> float | None:
        """Batches per second of the fastest timed step (``None``: none timed yet)."""
        times = [t for t in self.timer.totals().values() if t > 0]
        return 1.0 / min(times) if times else None


class WorkerChoice:
    """What a ``TunedInFit`` loader shares with its callback: ``decide()`` runs the callback's
    search once and keeps the constructor arguments of the loader to go on with (``kwargs``,
    as ``rebuild_dataloader`` takes them); ``loader`` is that loader once built."""

    def __init__(self, decide: Any) -> None:
        self._decide = decide
        self.kwargs: dict[str, Any] | None = None
        self.loader: DataLoader | None = None
        self.source: DataLoader | None = None  # the TunedInFit loader being iterated

    @property
    def decided(self) -> bool:
        return self.kwargs is not None

    def decide(self) -> None:
        if self.kwargs is None:
            self.kwargs = self._decide(self.source)


class _Shared:
    """One index iterator shared by the loaders of one epoch (created on first use, so the
    sampler draws its order when a plain loader's iterator would)."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source, self.it = source, None

    def __iter__(self) -> Iterator[Any]:
        if self.it is None:
            self.it = iter(self.source)
        return self.it


class _Continued:
    """A (batch) sampler whose first epoch is what is left of ``rest``, an epoch already begun,
    and then the epochs of ``source``: one loader (one start of its workers) takes over an
    epoch mid-way and goes on."""

    def __init__(self, source: Any, rest: _Shared | None) -> None:
        self.source, self.rest = source, rest

    def __iter__(self) -> Iterator[Any]:
        # a loader's iterator may ask twice as it starts (torch's worker iterator resets once):
        # the begun epoch is the first epoch until it is used up
        return self._rest() if self.rest is not None else iter(self.source)

    def _rest(self) -> Iterator[Any]:
        yield from self.rest
        self.rest = None

    def __len__(self) -> int:
        return len(self.source)


class TunedInFit(_RNGParityDataLoader):
    """A DataLoader that loads in the main process until ``choice`` decides the worker count (once
    the fit has timed its first steps; see the module docstring), then with that count: the rest
    of the epoch from the same indices, and later epochs, through one loader built with it.
    ``choice`` is a constructor argument so that a copy Lightning makes (to add its
    ``DistributedSampler``) keeps it."""

    def __init__(self, *args: Any, choice: WorkerChoice | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choice = choice

    def __iter__(self):  # type: ignore[override]
        choice = self.choice
        if choice is None:
            return super().__iter__()
        choice.source = self
        if choice.loader is None and choice.decided:  # decided between two epochs
            choice.loader = self._tuned(choice.kwargs, None)
            self.num_workers = choice.loader.num_workers  # what the trainer's loader says
        if choice.loader is not None:
            return iter(choice.loader)
        return self._until_decided(choice)

    def _until_decided(self, choice: WorkerChoice) -> Iterator[Any]:
        """One epoch: in the main process until the count is decided, then with it."""
        auto = self.batch_sampler is not None
        indices = _Shared(self.batch_sampler if auto else self.sampler)
        head = iter(self._in_process(indices))  # draws the epoch's base seed, as any epoch does
        while not choice.decided:
            try:
                batch = next(head)
            except StopIteration:
                return
            yield batch
        choice.loader = self._tuned(choice.kwargs, indices)
        self.num_workers = choice.loader.num_workers
        # the rest of the epoch: its iterator's seed is no draw of the epoch's
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        state = self.generator.get_state() if self.generator is not None else None
        with torch.random.fork_rng(devices=devices):
            rest = iter(choice.loader)
        if state is not None:
            self.generator.set_state(state)
        yield from rest

    def _in_process(self, indices: _Shared) -> DataLoader:
        """A loader without workers over what is left of the epoch's indices."""
        kwargs: dict[str, Any] = dict(
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            generator=self.generator,
        )
        if self.batch_sampler is not None:
            kwargs["batch_sampler"] = indices
        else:
            kwargs.update(batch_size=None, sampler=indices)
        return DataLoader(self.dataset, **kwargs)

    def _tuned(self, kwargs: dict[str, Any], rest: _Shared | None) -> DataLoader:
        """The loader of the chosen settings, over this loader's (batch) sampler, taking over
        ``rest`` first when an epoch is under way."""
        kwargs = dict(kwargs)
        if self.batch_sampler is not None:
            for key in ("batch_size", "sampler", "drop_last"):
                kwargs.pop(key, None)
            kwargs["batch_sampler"] = _Continued(self.batch_sampler, rest)
        else:
            kwargs["sampler"] = _Continued(self.sampler, rest)
        return _RNGParityDataLoader(**kwargs)
