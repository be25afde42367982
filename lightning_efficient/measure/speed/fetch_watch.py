"""``FetchWatch``: when the training loop starts waiting for its next batch.

Lightning wraps the train loader's ``next`` (and, with its prefetching fetcher, the loading of
the batch after it) in a profiler action whose name ends with ``train_dataloader_next``; no
callback hook marks that moment. ``FetchWatch`` wraps the trainer's profiler (the user's, or
Lightning's pass-through), calls ``on_fetch`` when that action starts and forwards every call to
the profiler it wraps (and ``on_fetched``, when given, when it stops). Installed with ``core.change.patch_attribute(trainer, "profiler", ...)``,
so the fit's end puts the trainer's own back (two watches stack, undone last first). Used by
``StepProfiler`` (its ``data`` phase) and ``InputStallMonitor`` (its wait).

``StepFetch``: a fetch the step makes itself (a ``training_step(self, dataloader_iter)`` calls the
loader's ``next`` inside the step) is timed as the wait, and the step's own region goes on when it
has returned; both measuring callbacks time it so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.profilers import Profiler

__all__ = ["FETCH_ACTION", "FetchWatch", "StepFetch"]

#: suffix of Lightning's profiler action around the train loader's ``next``
FETCH_ACTION = "train_dataloader_next"


class FetchWatch(Profiler):
    """The trainer's profiler, wrapped: tells ``on_fetch`` when the train loader's ``next`` starts
    (``on_fetched``, if given, when it has returned) and forwards every call to the profiler it
    wraps (the user's, or Lightning's pass-through)."""

    def __init__(
        self,
        inner: Profiler,
        on_fetch: Callable[[], None],
        on_fetched: Callable[[], None] | None = None,
    ) -> None:
        # no Profiler.__init__: its attributes (dirpath, _stage, ...) are the wrapped profiler's
        self.inner = inner
        self.on_fetch = on_fetch
        self.on_fetched = on_fetched
        self.seen = False

    def start(self, action_name: str) -> None:
        if action_name.endswith(FETCH_ACTION):
            self.seen = True
            self.on_fetch()
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        if self.on_fetched is not None and action_name.endswith(FETCH_ACTION):
            self.on_fetched()

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank=local_rank, log_dir=log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __del__(self) -> None:  # the wrapped profiler's files belong to it, not to us
        pass

    def __getattr__(self, name: str) -> Any:  # e.g. ``dirpath`` of a user's profiler
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class StepFetch:
    """A fetch made inside a step, timed as the wait: ``begin(step, wait)`` (when the train
    loader's ``next`` starts while region ``step`` runs) switches to region ``wait``; ``end()``
    (when it has returned) switches back to ``step``. ``switch(old, new)`` stops region ``old``
    and starts ``new`` (a ``StepTimer``'s regions, ``StepProfiler``'s phases)."""

    def __init__(self, switch: Callable[[str, str], None]) -> None:
        self.switch = switch
        self.regions: tuple[str, str] | None = None  # (the step's, the wait's) while it fetches

    def begin(self, step: str, wait: str) -> None:
        if self.regions is None:
            self.switch(step, wait)
            self.regions = (step, wait)

    def end(self) -> None:
        if self.regions is not None:
            step, wait = self.regions
            self.regions = None
            self.switch(wait, step)
