"""The data-pipeline callbacks: they only decide *when* the loaders are rebuilt.

``DataLoaderTuning`` and ``DevicePreload`` rebuild the fit's train and validation loaders, however
they were given (a datamodule's or the module's ``train_dataloader``/``val_dataloader``, or
``trainer.fit(train_dataloaders=..., val_dataloaders=...)``), by wrapping what Lightning calls to
read them (``techniques._loader_source``) in ``setup``: Lightning reads them later (the train
loader after ``on_fit_start``), inside its argument-capturing context, so the rebuilt loader still
gets Lightning's ``DistributedSampler`` under DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_float, parse_bytes
from lightning_efficient.measure.speed.host import available_bytes
from lightning_efficient.techniques._loader_source import loader_source
from lightning_efficient.techniques.dataloading.in_fit import StepClock, TunedInFit, WorkerChoice
from lightning_efficient.techniques.dataloading.preload import PreloadRefused, preloaded_loader
from lightning_efficient.techniques.dataloading.rebuild import (
    _check_num_workers,
    _check_pin,
    _check_prefetch,
    _rebuild_kwargs,
    auto_num_workers,
    loader_change,
    rebuild_dataloader,
)
from lightning_efficient.techniques.dataloading.workers import (
    TuneResult,
    default_max_workers,
    tune_num_workers,
)

__all__ = ["DataLoaderTuning", "DevicePreload"]

_HOOKS = ("train_dataloader", "val_dataloader")


class _LoaderRebuilder(Technique):
    """Wraps what Lightning calls to read the fit's loaders (``loader_source``: a datamodule's or
    the module's hook, or the loaders given to ``trainer.fit``) in ``setup`` so that every loader
    passes through ``self._rebuild(trainer, loader, hook)``; all is put back after fit (and when
    it raises or is interrupted)."""

    def __init__(self) -> None:
        super().__init__()
        self._wrapped: dict[str, Change] = {}  # hook -> its wrapping

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._wrapped = {h: c for h, c in self._wrapped.items() if not c.undone}
        if self._wrapped:
            return
        self._start()
        for hook in _HOOKS:
            source = loader_source(trainer, pl_module, hook)
            if source is None:
                continue
            owner, attribute = source
            original = getattr(owner, attribute)

            def wrapped(_original: Callable[[], Any] = original, _hook: str = hook) -> Any:
                return self._rebuild_all(trainer, _original(), _hook)

            change = patch_attribute(owner, attribute, wrapped, f"{hook} wrapped")
            self._wrapped[hook] = self.record(trainer, change)

    def _start(self) -> None:
        """Forget what an earlier fit decided (a new trainer may differ)."""

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

    By default (``num_workers="auto"``) the worker count is measured (``tune_num_workers``):
    0, 1, 2, 4, ... workers while loading gets faster, bounded by host memory, by
    ``default_max_workers`` and by the rate training consumes batches (x 1.5 headroom), which is
    timed on the fit's own first steps: the train loader starts in the main process, the search
    runs after the first 3 steps (between two steps), and the rest of the epoch and every later
    one load with the chosen count, the same batches in the same order (``TunedInFit``). Nothing
    of the module runs out of band. Loads that wait (storage, network, decoding that releases
    the GIL) get more workers than cores; CPU-bound ones about the core count. Validation
    loaders get the train loader's count once it is known (before that, the rule).

    Args:
        num_workers: Worker processes per loader: an integer >= 0, or ``"auto"`` (measured, or
            with ``tune=False`` the rule ``auto_num_workers(trainer.num_devices)``: the CPU
            cores per device minus one).
        pin_memory: Page-locked host batches for faster copies to the GPU; ``"auto"``: on when
            training on CUDA.
        persistent_workers: Keep the workers alive between epochs (only with workers).
        prefetch_factor: Batches each worker loads ahead (None: PyTorch's default of 2); needs
            workers.
        tune: Measure the worker count when fit starts. ``None`` (default): when
            ``num_workers="auto"``; ``True``: always (``num_workers`` is then not used);
            ``False``: never (``"auto"`` is the rule).
        tune_time_s: Cap on the time spent measuring.
    """

    loads_in_workers = True
    #: The loading rate kept above the model's estimated step rate (the estimate is rough, and
    #: workers load slower next to training than alone).
    TARGET_HEADROOM = 1.5

    def __init__(
        self,
        num_workers: int | str = "auto",
        pin_memory: bool | str = "auto",
        persistent_workers: bool = True,
        prefetch_factor: int | None = None,
        tune: bool | None = None,
        tune_time_s: float = 10.0,
    ) -> None:
        super().__init__()
        self.num_workers = _check_num_workers("num_workers", num_workers, allow_auto=True)
        self.pin_memory = _check_pin(pin_memory)
        self.persistent_workers = check_bool("persistent_workers", persistent_workers)
        self.prefetch_factor = _check_prefetch(prefetch_factor, num_workers)
        self.tune = tune if tune is None else check_bool("tune", tune)
        self.tune_time_s = check_float("tune_time_s", tune_time_s, minimum=0.0)
        if self.tune_time_s <= 0:
            raise ValueError(f"`tune_time_s` must be > 0 seconds; got {tune_time_s!r}.")
        self._chosen: int | None = None
        self._tuned: TuneResult | None = None
        self._changes: dict[str, str] = {}
        self._clock: StepClock | None = None  # times the fit's first steps
        self._choice: WorkerChoice | None = None  # the train loader's count, once decided

    @property
    def measures(self) -> bool:
        """Whether the worker count is measured (``tune``, or ``None`` with ``"auto"``)."""
        return self.num_workers == "auto" if self.tune is None else self.tune

    def _start(self) -> None:
        self._chosen, self._tuned, self._changes = None, None, {}
        self._clock, self._choice = None, None

    # -- the train loader's count, measured between the fit's first steps
    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self._clock is not None and not self._choice.decided:
            self._clock.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self._clock is None or self._choice.decided:
            return
        self._clock.stop()
        if self._clock.ready and self._choice.source is not None:
            self._choice.decide()  # here, between two steps: no batch waits on the search

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._choice is not None and not self._choice.decided:
            self.no_effect(
                f"the fit ended after {trainer.global_step} steps, before the worker count was "
                f"measured (after {self._clock.warmup + self._clock.steps} steps); the train "
                "loader loaded in the main process."
            )
            self.report(trainer, "train_dataloader: not measured (the fit was too short)")

    def _tune_in_fit(self, trainer: Any, loader: DataLoader) -> DataLoader:
        if self._clock is None:  # kept over a reload: the steps timed so far still count
            self._clock = StepClock(trainer.strategy.root_device, steps=2, warmup=1)
        self._choice = WorkerChoice(lambda source: self._decide(trainer, loader, source))
        kwargs = _rebuild_kwargs(
            loader, num_workers=0, pin_memory=self._pin(trainer), rank=trainer.global_rank
        )
        return TunedInFit(choice=self._choice, **kwargs)

    def _decide(self, trainer: Any, given: DataLoader, source: DataLoader) -> dict[str, Any]:
        """The worker search, bounded by the timed steps; the chosen loader's arguments."""
        rate = self._clock.batches_per_s()
        if rate is None:
            self.note("no training step was timed before the worker search: it is bounded by "
                      "loading speed and memory only.")  # fmt: skip
        devices = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        free = available_bytes()
        self._tuned = tune_num_workers(
            source,
            None,
            self.tune_time_s,
            rank=trainer.global_rank,
            max_workers=default_max_workers(devices),
            target_batches_per_s=None if rate is None else self.TARGET_HEADROOM * rate,
            max_worker_bytes=None if free is None else free // (2 * devices),
        )
        self._chosen = workers = self._tuned.best
        kwargs = _rebuild_kwargs(
            source,
            num_workers=workers,
            pin_memory=self._pin(trainer),
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            rank=trainer.global_rank,
        )
        chosen = SimpleNamespace(**{"persistent_workers": False, **kwargs})
        self._describe(trainer, given, chosen, "train_dataloader")
        return kwargs

    def _workers(self, trainer: Any, loader: DataLoader, hook: str) -> int:
        if self._chosen is not None:
            return self._chosen
        if isinstance(loader.dataset, IterableDataset):  # keeps its workers: nothing to measure
            return loader.num_workers
        devices = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        if self.measures or self.num_workers == "auto":  # measured later, with the train loader
            workers = auto_num_workers(devices)
            if not self.measures:
                self._chosen = workers
            return workers
        self._chosen = int(self.num_workers)
        return self._chosen

    def _rebuild(self, trainer: Any, loader: DataLoader, hook: str) -> DataLoader:
        if isinstance(loader.dataset, IterableDataset):
            self.no_effect(
                f"{hook}: an iterable-style dataset keeps its {loader.num_workers} workers (more "
                "workers would each replay the whole stream unless the dataset shards itself)."
            )
        elif hook == "train_dataloader" and self.measures and self._chosen is None:
            return self._tune_in_fit(trainer, loader)  # measured after the fit's first steps
        new = self._rebuilt(trainer, loader, self._workers(trainer, loader, hook))
        self._describe(trainer, loader, new, hook)
        return new

    def _pin(self, trainer: Any) -> bool:
        if self.pin_memory == "auto":
            return getattr(trainer.strategy.root_device, "type", "cpu") == "cuda"
        return bool(self.pin_memory)

    def _rebuilt(self, trainer: Any, loader: DataLoader, workers: int) -> DataLoader:
        return rebuild_dataloader(
            loader,
            num_workers=workers,
            pin_memory=self._pin(trainer),
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            rank=trainer.global_rank,
        )

    def _describe(self, trainer: Any, loader: DataLoader, new: Any, hook: str) -> None:
        changed = (loader.num_workers, loader.pin_memory) != (new.num_workers, new.pin_memory)
        self._changes[hook] = f"{hook}: {loader_change(loader, new)}"
        figures: dict[str, Any] = {"num_workers": new.num_workers}
        tuned = self._tuned
        if tuned is not None:
            figures.update(
                {f"batches_per_s_w{w}": round(r, 2) for w, r in tuned.batches_per_s.items()}
            )
            figures["tune_s"] = tuned.measured_s
            if tuned.target_batches_per_s is not None:
                figures["step_rate_bound"] = round(tuned.target_batches_per_s, 2)
            if hook == "train_dataloader":
                rates = ", ".join(f"{w}: {r:.1f}" for w, r in tuned.batches_per_s.items())
                self._changes[hook] += f" (measured batches/s by workers {rates}; {tuned.stopped})"
        self.report(trainer, "; ".join(self._changes.values()), **figures)
        if changed:  # a loader kept as it was is in the report, not printed
            self.note(self._changes[hook])


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
            change = preloaded_loader(loader, device, max(1, limit - used))
        except PreloadRefused as err:
            if "more than max_bytes" in str(err):
                raise PreloadRefused(f"DevicePreload ({hook}): {err}") from err
            self.no_effect(f"{hook} is loaded as before: {err}")
            return loader
        new = change.value
        self._used[hook] = change.figures["preloaded_bytes"]
        self.report(
            trainer,
            f"{', '.join(self._used)} preloaded onto {device}; batches served by index",
            preloaded_bytes=sum(self._used.values()),
            max_bytes=limit,
        )
        return new
