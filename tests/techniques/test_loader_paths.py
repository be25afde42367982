"""A new user's three ways of giving the train loader, for every technique that changes it
(issue 49): the module's ``train_dataloader()``, a datamodule's, and
``trainer.fit(model, train_dataloaders=loader)``. Each technique's effect is asserted on the
loader the fit iterates and on the batches it trains, on each path. ``SequencePacking``'s paths are
tested in ``tests/techniques/test_packing.py``."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import no_collector, tiny_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from benchmarks.workloads import TINY_MODEL, tiny_data, tiny_model
from lightning_efficient import Curriculum, DataLoaderTuning, DevicePreload
from lightning_efficient.core.report import report_for
from lightning_efficient.techniques.curriculum.difficulty import difficulty_scores, easiest_first
from lightning_efficient.techniques.curriculum.sampler import CurriculumSampler
from lightning_efficient.techniques.dataloading.buckets import LengthBucketSampler
from lightning_efficient.techniques.dataloading.preload import PreloadedBatches

PATHS = ("module", "datamodule", "fit")
STEPS = 3


class Inputs(Callback):
    """The inputs of every training batch, as the module receives them."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(batch[0].detach().cpu().clone())


class OwnLoaderGPT(type(tiny_model())):
    """TinyGPT whose ``train_dataloader()`` is its own."""

    make: Callable[[], DataLoader]

    def train_dataloader(self) -> DataLoader:
        return self.make()


class LoaderData(pl.LightningDataModule):
    def __init__(self, make: Callable[[], DataLoader]) -> None:
        super().__init__()
        self.make = make

    def train_dataloader(self) -> DataLoader:
        return self.make()


def train_set() -> Any:
    data = tiny_data()
    data.setup("fit")
    return data.train_set


def fit_by(path: str, make: Callable[[], DataLoader], callbacks: list, tmp_path) -> Any:
    """A 3-step fit whose train loader (``make()``) is given by ``path``; returns the trainer
    and the inputs it trained on."""
    pl.seed_everything(0, verbose=False)
    inputs = Inputs()
    trainer = tiny_trainer(tmp_path, [*callbacks, inputs], max_steps=STEPS, limit_val_batches=0)
    with no_collector():
        if path == "module":
            model = OwnLoaderGPT(**TINY_MODEL)
            model.make = make
            trainer.fit(model)
        elif path == "datamodule":
            trainer.fit(tiny_model(), datamodule=LoaderData(make))
        else:
            trainer.fit(tiny_model(), train_dataloaders=make())
    return trainer, inputs.seen


def plain_inputs(make: Callable[[], DataLoader]) -> list[torch.Tensor]:
    return [x for (x, _), _ in zip(make(), range(STEPS))]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("path", PATHS)
def test_loader_tuning_on_every_path(path, tmp_path) -> None:
    def make() -> DataLoader:
        return DataLoader(train_set(), batch_size=4)

    trainer, seen = fit_by(path, make, [DataLoaderTuning(num_workers=1)], tmp_path)
    assert trainer.train_dataloader.num_workers == 1  # the loader the fit iterated
    assert same(seen, plain_inputs(make))  # the same batches in the same order
    assert "num_workers 0->1" in report_for(trainer)["DataLoaderTuning"].change


@pytest.mark.parametrize("path", PATHS)
def test_preloading_on_every_path(path, tmp_path) -> None:
    def make() -> DataLoader:
        return DataLoader(train_set(), batch_size=4)

    trainer, seen = fit_by(path, make, [DevicePreload()], tmp_path)
    assert isinstance(trainer.train_dataloader.dataset, PreloadedBatches)
    assert same(seen, plain_inputs(make))


@pytest.mark.parametrize("path", PATHS)
def test_curriculum_on_every_path(path, tmp_path) -> None:
    data = train_set()
    ranked = easiest_first(difficulty_scores(data, "entropy"))
    index = {tuple(data[i][0].tolist()): i for i in range(len(data))}

    def make() -> DataLoader:
        return DataLoader(data, batch_size=4)

    cb = Curriculum("entropy", start_fraction=0.25, duration=8)
    trainer, seen = fit_by(path, make, [cb], tmp_path)
    assert isinstance(trainer.train_dataloader.sampler, CurriculumSampler)
    assert len(seen) == STEPS and not same(seen, plain_inputs(make))  # the order changed
    for step, x in enumerate(seen):  # every batch from the easiest pool of its step
        ids = {index[tuple(row.tolist())] for row in x}
        assert ids <= set(ranked[: cb.sampler.pool_at(step)]), (path, step)


@pytest.mark.parametrize("path", PATHS)
def test_length_bucketing_on_every_path(path, tmp_path) -> None:
    data = train_set()
    lengths = [random.Random(i).randint(1, 200) for i in range(len(data))]
    sampler = LengthBucketSampler(lengths, bucket_size=16, seed=3)
    bucketed = list(sampler)  # epoch 0's order

    def make() -> DataLoader:
        return DataLoader(data, batch_size=4, sampler=sampler)

    trainer, seen = fit_by(path, make, [], tmp_path)
    assert trainer.train_dataloader.sampler is sampler  # kept, never replaced
    expected = [torch.stack([data[i][0] for i in bucketed[s * 4 : s * 4 + 4]]) for s in range(3)]
    assert same(seen, expected)  # the bucketed order
    for s in range(STEPS):  # each batch from one bucket: lengths sorted, longest first
        batch_lengths = [lengths[i] for i in bucketed[s * 4 : s * 4 + 4]]
        assert batch_lengths == sorted(batch_lengths, reverse=True)
