"""The data pipeline: rebuilt loaders yield the same samples in the same order, preloading too,
the stall monitor warns once on slow data only, the bucket sampler cuts padding, is deterministic,
partitions across ranks and resumes mid-epoch; bad input fails clearly."""

from __future__ import annotations

import random
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, no_collector
from lightning.pytorch import Callback
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from benchmarks.workloads import tiny_data, tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.functional import (
    LengthBucketSampler,
    padding_stats,
    tune_num_workers,
)
from lightning_efficient.measure.speed.input_stall import (
    InputStallMonitor,
    stall_fraction,
    workers_to_hide,
)
from lightning_efficient.techniques import NoEffectWarning
from lightning_efficient.techniques.dataloading import (
    DataLoaderTuning,
    DevicePreload,
    PreloadedBatches,
    PreloadRefused,
    WorkerSeeder,
    auto_num_workers,
    preload_to_device,
    rebuild_dataloader,
)


class Numbered(Dataset):
    """Sample i is (i, a random number drawn in __getitem__, a vector); ``delay_s`` per sample."""

    def __init__(self, n: int = 24, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.tensor(i), torch.full((3,), float(i))


def ids_per_epoch(loader: DataLoader, epochs: int) -> list[list[int]]:
    return [[int(x) for b in loader for x in b[0]] for _ in range(epochs)]


# -- rebuild_dataloader ---------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [True, False])
def test_rebuilt_loader_same_samples_same_order_across_epochs(persistent: bool) -> None:
    def run(make):
        torch.manual_seed(0)
        loader = make()
        order = ids_per_epoch(loader, 3)
        return order, torch.rand(1).item()  # the global RNG stream after the epochs

    plain = lambda: DataLoader(Numbered(), batch_size=4, shuffle=True, drop_last=True)  # noqa: E731
    tuned = lambda: rebuild_dataloader(plain(), num_workers=2, persistent_workers=persistent)  # noqa: E731
    (order_plain, after_plain), (order_tuned, after_tuned) = run(plain), run(tuned)
    assert order_plain == order_tuned
    assert order_plain[0] != order_plain[1]  # it does shuffle per epoch, so the test can fail
    assert after_plain == after_tuned  # persistent workers draw the per-epoch seed like plain ones
    assert len(order_plain[0]) == 24


def test_rebuild_keeps_batch_sampler_collate_and_settings() -> None:
    def collate(samples):
        return [torch.stack([s[0] for s in samples]), "custom"]

    batch_sampler = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    loader = DataLoader(Numbered(10), batch_sampler=batch_sampler, collate_fn=collate)
    new = rebuild_dataloader(loader, num_workers=1, prefetch_factor=3, persistent_workers=False)
    assert new.batch_sampler is batch_sampler and new.collate_fn is collate
    assert (new.num_workers, new.prefetch_factor, new.persistent_workers) == (1, 3, False)
    assert new.worker_init_fn == WorkerSeeder(0)
    assert (
        [b[0].tolist() for b in new]
        == [b[0].tolist() for b in loader]
        == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    )
    assert all(b[1] == "custom" for b in new)
    kept = DataLoader(Numbered(10), batch_size=4, drop_last=True)
    again = rebuild_dataloader(kept)
    assert (again.batch_size, again.drop_last, again.num_workers) == (4, True, 0)
    assert isinstance(again.sampler, SequentialSampler)


def test_worker_seeding_is_reproducible_and_rank_dependent() -> None:
    class Noisy(Numbered):
        def __getitem__(self, i: int):
            return torch.tensor(i), torch.rand(1)

    def noise(rank: int) -> list[float]:
        torch.manual_seed(0)
        loader = rebuild_dataloader(DataLoader(Noisy(8), batch_size=2), num_workers=2, rank=rank)
        return [float(x) for b in loader for x in b[1]]

    assert noise(0) == noise(0)
    assert noise(0) != noise(1)


def test_rebuild_bad_input() -> None:
    loader = DataLoader(Numbered(), batch_size=2)
    with pytest.raises(ValueError, match="num_workers"):
        rebuild_dataloader(loader, num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor"):
        rebuild_dataloader(loader, num_workers=0, prefetch_factor=2)
    with pytest.raises(TypeError, match="loader"):
        rebuild_dataloader([1, 2, 3])  # type: ignore[arg-type]
    bad = DataLoader(
        Numbered(24), batch_size=2, sampler=LengthBucketSampler([1] * 10, bucket_size=4)
    )
    with pytest.raises(ValueError, match=r"`lengths` has 10 entries but the dataset has 24"):
        rebuild_dataloader(bad)
    with pytest.raises(ValueError, match="num_workers"):
        DataLoaderTuning(num_workers=-2)
    with pytest.raises(TypeError, match="num_workers"):
        DataLoaderTuning(num_workers="many")
    with pytest.raises(ValueError, match="prefetch_factor.*num_workers"):
        DataLoaderTuning(num_workers=0, prefetch_factor=4)
    assert auto_num_workers() >= 1


# -- tune_num_workers -----------------------------------------------------------------------
def test_tune_measures_each_count_and_restores_state() -> None:
    sampler = LengthBucketSampler(list(range(40)), bucket_size=8)
    loader = DataLoader(Numbered(40, delay_s=0.01), batch_size=4, sampler=sampler)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    result = tune_num_workers(loader, [0, 2], time_cap_s=3.0, max_batches=6)
    assert torch.equal(torch.get_rng_state(), before)  # training sees the same random stream
    assert sampler.position == 0  # and the sampler starts the epoch where it was
    assert set(result.batches_per_s) == {0, 2} and all(result.batches[w] >= 1 for w in (0, 2))
    rates = result.batches_per_s
    assert all(r > 0 for r in rates.values())
    # the kept count is the smallest within 5% of the fastest (no timed assert: which one is
    # faster depends on the machine's load)
    within = [w for w, r in rates.items() if r >= 0.95 * max(rates.values())]
    assert result.best == min(within)
    assert f"| {result.best} (kept) |" in result.table()
    with pytest.raises(ValueError, match="candidates"):
        tune_num_workers(loader, [0, -1])
    with pytest.raises(ValueError, match="time_cap_s"):
        tune_num_workers(loader, [0], time_cap_s=0)


def test_tune_search_doubles_and_stops_at_each_bound() -> None:
    # a loader whose samples wait (like storage): more workers load faster, so the search climbs
    sampler = RandomSampler(range(48), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(Numbered(48, delay_s=0.01), batch_size=4, sampler=sampler)
    order = [b[0].tolist() for b in loader]
    sampler.generator.manual_seed(7)
    climb = tune_num_workers(loader, time_cap_s=6.0, max_workers=4, max_batches=12)
    assert list(climb.batches_per_s) == [0, 1, 2, 4][: len(climb.batches_per_s)]
    assert len(climb.batches_per_s) >= 3, climb.stopped  # 2 workers load twice as fast as 1
    assert climb.best > 1 and climb.worker_bytes and climb.worker_bytes > 0
    assert [b[0].tolist() for b in loader] == order  # the sampler's own generator was restored
    # loading as fast as training consumes batches: more workers gain nothing
    bound = tune_num_workers(loader, time_cap_s=3.0, target_batches_per_s=1.0, max_batches=6)
    assert list(bound.batches_per_s) == [0, 1] and "as fast as training" in bound.stopped
    assert bound.in_training(1) == 1.0 and bound.in_training(0) < 1.0  # 0 workers: in turns
    # memory: one worker's private memory times the next count exceeds the budget
    tight = tune_num_workers(loader, time_cap_s=3.0, max_worker_bytes=1, max_batches=6)
    assert list(tight.batches_per_s) == [0, 1] and tight.stopped.startswith("memory")
    with pytest.raises(ValueError, match="max_workers"):
        tune_num_workers(loader, max_workers=0)
    with pytest.raises(ValueError, match="max_worker_bytes"):
        tune_num_workers(loader, max_worker_bytes="lots")


def test_tune_argument_decides_when_counts_are_measured() -> None:
    assert DataLoaderTuning().measures  # the default: measured
    assert not DataLoaderTuning(tune=False).measures  # the rule, cores - 1
    assert not DataLoaderTuning(num_workers=2).measures  # a count given is used as given
    assert DataLoaderTuning(num_workers=2, tune=True).measures
    with pytest.raises(TypeError, match="tune"):
        DataLoaderTuning(tune="yes")  # type: ignore[arg-type]


# -- DataLoaderTuning and DevicePreload in a real fit ---------------------------------------
class BatchRecorder(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.loader = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].detach().cpu().clone())
        self.loader = trainer.train_dataloader


def _fit_batches(tmp_path, callbacks, **kw):
    rec = BatchRecorder()
    trainer, _, losses = fit(
        tmp_path, [*callbacks, rec], data=tiny_data(max_train_samples=16), max_steps=8, **kw
    )
    return trainer, rec, losses.losses


def test_tuning_in_fit_same_batches_as_plain(tmp_path) -> None:
    _, plain, plain_losses = _fit_batches(tmp_path / "plain", [])
    trainer, tuned, tuned_losses = _fit_batches(
        tmp_path / "tuned", [DataLoaderTuning(num_workers=1, pin_memory=False)]
    )
    assert len(plain.batches) == 8  # two epochs of 4 batches
    assert all(torch.equal(a, b) for a, b in zip(plain.batches, tuned.batches))
    assert not torch.equal(plain.batches[0], plain.batches[4])  # epoch 2 is shuffled differently
    assert tuned.loader.num_workers == 1 and tuned.loader.persistent_workers
    assert plain.loader.num_workers == 0
    torch.testing.assert_close(torch.tensor(tuned_losses), torch.tensor(plain_losses))
    entry = report_for(trainer)["DataLoaderTuning"]
    assert "num_workers 0->1" in entry.change and entry.figures["num_workers"] == 1
    # the hooks are restored after fit: the datamodule is unchanged for the next user
    assert "train_dataloader" not in vars(trainer.datamodule)


def test_tuning_with_tune_picks_a_measured_count(tmp_path) -> None:
    trainer, rec, _ = _fit_batches(
        tmp_path, [DataLoaderTuning(tune=True, tune_time_s=1.0, pin_memory=False)]
    )
    figures = report_for(trainer)["DataLoaderTuning"].figures
    measured = {
        int(k.removeprefix("batches_per_s_w")) for k in figures if k.startswith("batches_per_s_w")
    }
    assert len(measured) >= 2 and rec.loader.num_workers in measured


class WhoLoads(Numbered):
    """Numbered samples that also say which worker loaded them (-1: the main process)."""

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([i, -1 if info is None else info.id])


def test_tuned_in_fit_switches_workers_mid_epoch_on_the_same_batches() -> None:
    from lightning_efficient.techniques.dataloading.in_fit import TunedInFit, WorkerChoice
    from lightning_efficient.techniques.dataloading.rebuild import _rebuild_kwargs

    data = WhoLoads(20)
    torch.manual_seed(3)
    plain = [b[:, 0].tolist() for _ in range(2) for b in DataLoader(data, 3, shuffle=True)]
    stream = torch.rand(1)  # the global RNG after the epochs: the same draws, no more
    choice = WorkerChoice(
        lambda source: _rebuild_kwargs(source, num_workers=2, persistent_workers=True)
    )
    loader = TunedInFit(data, batch_size=3, shuffle=True, choice=choice)
    torch.manual_seed(3)
    seen, where = [], []
    for epoch in range(2):
        for k, batch in enumerate(loader):
            seen.append(batch[:, 0].tolist())
            where.append(set(batch[:, 1].tolist()))
            if epoch == 0 and k == 2:
                choice.decide()  # as the callback does after the fit's timed steps
    assert seen == plain  # the same batches in the same order, over the switch and the epoch
    assert torch.equal(torch.rand(1), stream)
    assert where[:3] == [{-1}] * 3 and all(-1 not in w for w in where[3:])
    assert loader.choice is choice and loader.num_workers == choice.loader.num_workers == 2
    assert choice.loader.persistent_workers  # one start of the workers: epoch 1 reuses them


class Counted(type(tiny_model())):
    """TinyGPT whose training_step updates a torchmetrics metric and a plain counter."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from torchmetrics import MeanMetric

        self.train_mean = MeanMetric()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_mean.update(loss.detach())
        self.calls += 1
        return loss


def test_tuning_runs_no_training_step_of_its_own(tmp_path) -> None:
    """Issue 33 item 9: the step rate that bounds the worker search comes from the fit's own
    steps; no training_step runs out of band (a metric it updates counts the real steps)."""
    from benchmarks.workloads import TINY_MODEL

    model = Counted(**TINY_MODEL)
    trainer, rec, _ = _fit_batches(
        tmp_path, [DataLoaderTuning(tune=True, tune_time_s=1.0, pin_memory=False)], model=model
    )
    assert trainer.global_step == 8
    assert model.train_mean.update_count == model.calls == 8
    figures = report_for(trainer)["DataLoaderTuning"].figures
    assert figures["step_rate_bound"] > 0 and rec.loader.num_workers == figures["num_workers"]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:.*worker processes in total")
def test_tuning_on_cuda_pins_times_the_fit_and_keeps_the_batches(tmp_path) -> None:
    """On CUDA: steps timed with CUDA events, pinned batches, the switch to workers mid-epoch on
    the plain run's batches, and no training_step of its own."""
    from benchmarks.workloads import TINY_MODEL

    def run(callbacks):
        pl.seed_everything(0, verbose=False)  # the same initial weights in both runs
        model, rec = Counted(**TINY_MODEL), BatchRecorder()
        trainer, _, losses = fit(
            tmp_path, [*callbacks, rec], model=model, data=SleepyData(0.005), max_steps=20,
            limit_val_batches=0, accelerator="gpu",
        )  # fmt: skip
        return trainer, model, rec, losses.losses

    _, _, plain, plain_losses = run([])
    trainer, model, tuned, tuned_losses = run([DataLoaderTuning(tune_time_s=3.0)])
    assert model.train_mean.update_count == model.calls == 20
    assert all(torch.equal(a, b) for a, b in zip(plain.batches, tuned.batches))
    losses = torch.tensor(tuned_losses), torch.tensor(plain_losses)
    torch.testing.assert_close(*losses, rtol=1e-4, atol=1e-5)  # cuBLAS may differ in the last bits
    figures = report_for(trainer)["DataLoaderTuning"].figures
    assert figures["step_rate_bound"] > 0 and tuned.loader.num_workers == figures["num_workers"]
    assert "pin_memory False->True" in report_for(trainer)["DataLoaderTuning"].change


class SleepyData(pl.LightningDataModule):
    """The tiny corpus behind a ``__getitem__`` that waits (like storage; releases the GIL),
    shuffled by the global RNG."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        inner = tiny_data()
        inner.setup("fit")
        data, delay = inner.train_set, self.delay_s

        class Waits(Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int):
                time.sleep(delay)
                return data[i]

        return DataLoader(Waits(), batch_size=4, shuffle=True)


@pytest.mark.filterwarnings("ignore:.*InputStallMonitor")
@pytest.mark.filterwarnings("ignore:.*worker processes in total")
def test_default_tuning_fixes_a_waiting_loader_same_batches(tmp_path) -> None:
    # issue 20, item 3: by rule DataLoaderTuning() gave 1 worker on 2 cores to a loader whose
    # samples wait; the default now measures and takes more workers than cores
    def run(callbacks):
        rec, monitor = BatchRecorder(), InputStallMonitor(check_after=100)
        trainer, _, losses = fit(
            tmp_path,
            [*callbacks, monitor, rec],
            data=SleepyData(0.01),
            max_steps=20,
            limit_val_batches=0,
        )
        return trainer, rec, monitor.measured()[0], losses.losses

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark: 2 threads on 2 busy cores make steps erratic
    try:
        _, plain, plain_wait, plain_losses = run([])
        trainer, tuned, tuned_wait, tuned_losses = run([DataLoaderTuning(tune_time_s=5.0)])
    finally:
        torch.set_num_threads(threads)
    assert plain.loader.num_workers == 0 and tuned.loader.num_workers > 1
    assert len(plain.batches) == len(tuned.batches) == 20  # over an epoch boundary (16 a epoch)
    assert all(torch.equal(a, b) for a, b in zip(plain.batches, tuned.batches))
    torch.testing.assert_close(torch.tensor(tuned_losses), torch.tensor(plain_losses))
    # not slower: plain waits 4 x 10 ms of sleep for most batches; the workers hide most of it
    assert plain_wait >= 10 * 4 * 0.01
    assert tuned_wait < plain_wait
    entry = report_for(trainer)["DataLoaderTuning"]
    assert entry.figures["num_workers"] == tuned.loader.num_workers
    assert "measured batches/s by workers 0:" in entry.change
    assert entry.figures["step_rate_bound"] > 0  # the model's step rate bounded the search


def test_preload_same_batches_as_plain_and_served_from_device(tmp_path) -> None:
    _, plain, plain_losses = _fit_batches(tmp_path / "plain", [])
    trainer, pre, pre_losses = _fit_batches(tmp_path / "pre", [DevicePreload()])
    assert (
        all(torch.equal(a, b) for a, b in zip(plain.batches, pre.batches)) and len(pre.batches) == 8
    )
    assert isinstance(pre.loader.dataset, PreloadedBatches)
    assert pre.loader.num_workers == 0 and pre.loader.dataset.device == trainer.strategy.root_device
    # 16 samples x (input + target) x 32 int64 tokens
    assert report_for(trainer)["DevicePreload"].figures["preloaded_bytes"] >= 16 * 2 * 32 * 8
    torch.testing.assert_close(torch.tensor(pre_losses), torch.tensor(plain_losses))


def test_preload_function_keeps_shuffle_and_batch_sampler() -> None:
    data = Numbered(20)
    torch.manual_seed(1)
    plain = ids_per_epoch(DataLoader(data, batch_size=3, shuffle=True), 2)
    torch.manual_seed(1)
    loader = preload_to_device(DataLoader(data, batch_size=3, shuffle=True), "cpu")
    assert ids_per_epoch(loader, 2) == plain
    batch = next(iter(loader))
    assert isinstance(batch, list) and batch[1].shape == (3, 3)  # default_collate's structure
    bs = BatchSampler(RandomSampler(range(20), generator=torch.Generator().manual_seed(5)), 4, True)
    want = [b[0].tolist() for b in DataLoader(data, batch_sampler=bs)]
    bs.sampler.generator.manual_seed(5)
    assert [
        b[0].tolist() for b in preload_to_device(DataLoader(data, batch_sampler=bs), "cpu")
    ] == want


def test_preload_refuses_too_large_with_size_and_limit(tmp_path) -> None:
    loader = DataLoader(Numbered(100), batch_size=4)
    with pytest.raises(
        PreloadRefused, match=r"needs 1.95 KiB \(100 samples x 20 B\).*more than max_bytes=1000 B"
    ):
        preload_to_device(loader, "cpu", max_bytes=1000)
    data = tiny_data()
    with pytest.raises(ValueError, match="more than max_bytes"):
        fit(tmp_path, [DevicePreload(max_bytes="1KiB")], data=data, max_steps=2)
    assert "train_dataloader" not in vars(data)  # the failed fit restored the datamodule's hooks
    with pytest.raises(PreloadRefused, match="collate_fn"):
        preload_to_device(DataLoader(Numbered(4), batch_size=2, collate_fn=lambda s: s), "cpu")
    with pytest.raises(ValueError, match="max_bytes"):
        DevicePreload(max_bytes="a lot")


def test_dataloader_tuning_with_preload_is_a_conflict(tmp_path) -> None:
    with pytest.raises(ValueError, match="DataLoaderTuning with DevicePreload"):
        fit(tmp_path, [DataLoaderTuning(num_workers=1), DevicePreload()], max_steps=1)


def test_loaders_given_to_fit_directly_are_rebuilt_and_put_back(tmp_path) -> None:
    """Issue 49: loaders given to ``trainer.fit`` (train and validation) are rebuilt as a
    module's are (they were left as given, with a NoEffectWarning); the fit loop reads them as
    given again after the fit. The three ways of giving a loader:
    tests/techniques/test_loader_paths.py."""
    dm = tiny_data()
    dm.setup("fit")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        callbacks=[DataLoaderTuning(num_workers=1)],
        default_root_dir=str(tmp_path),
    )
    train, val = dm.train_dataloader(), dm.val_dataloader()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoEffectWarning)
        trainer.fit(tiny_model(), train_dataloaders=train, val_dataloaders=val)
    assert trainer.train_dataloader.num_workers == 1 and trainer.val_dataloaders.num_workers == 1
    assert train.num_workers == val.num_workers == 0  # the user's loaders, as given
    source = trainer.fit_loop._data_source
    assert "dataloader" not in vars(source) and source.dataloader() is train


# -- InputStallMonitor ----------------------------------------------------------------------
class DelayedData(pl.LightningDataModule):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        inner = tiny_data()
        inner.setup("fit")
        data = inner.train_set
        delay = self.delay_s

        class Slow(Dataset):
            def __len__(self) -> int:
                return len(data)

            def __getitem__(self, i: int):
                if delay:
                    time.sleep(delay)
                return data[i]

        return DataLoader(Slow(), batch_size=4)


class StepCost(Callback):
    """Makes every training step last at least ``seconds`` (slept before the backward, inside the
    monitor's step window), as a real model's step would: the tiny model's own step is about a
    millisecond, the size of Lightning's work between two steps, so a busy machine's scheduling
    alone could tip its stall fraction past the threshold (it did once in CI: 14%)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        time.sleep(self.seconds)


def _stall_warnings(
    tmp_path, delay_s: float, *callbacks: Callback, step_s: float = 0.05, **trainer_kwargs
) -> tuple[list[str], InputStallMonitor, pl.Trainer]:
    """A 6-step fit with the monitor (deciding after 3 steps), ``delay_s`` of loading per sample,
    steps of ``step_s`` and ``callbacks`` after the monitor's: its warnings, itself, the trainer."""
    monitor = InputStallMonitor(check_after=3)
    with no_collector(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = fit(
            tmp_path,
            [monitor, StepCost(step_s), *callbacks],
            data=DelayedData(delay_s),
            max_steps=6,
            limit_val_batches=0,
            **trainer_kwargs,
        )
    msgs = [str(w.message) for w in caught if "InputStallMonitor" in str(w.message)]
    return msgs, monitor, trainer


def test_stall_monitor_warns_once_on_slow_data_with_the_fix(tmp_path) -> None:
    msgs, monitor, _ = _stall_warnings(tmp_path, delay_s=0.1)  # 400 ms of loading per batch
    assert len(msgs) == 1, msgs
    assert "waiting for the next batch" in msgs[0] and "DataLoaderTuning(num_workers=" in msgs[0]
    assert monitor.stall_fraction is not None and monitor.stall_fraction > 0.1


def test_stall_monitor_quiet_on_fast_data(tmp_path) -> None:
    msgs, monitor, _ = _stall_warnings(tmp_path, delay_s=0.0)
    assert msgs == []
    assert monitor.stall_fraction is not None and monitor.stall_fraction < 0.1


class SlowLoopWork(Callback):
    """``seconds`` of the loop's own work after each step (a logger, a checkpoint of metrics),
    after the monitor's ``on_train_batch_end``: more loader workers would not shorten it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


def test_stall_monitor_does_not_blame_the_loader_for_the_loops_own_work(tmp_path) -> None:
    # 50 ms of callback work per step on fast data: the whole gap between two steps is 50 ms
    # against a step of 1-50 ms (the old measure read it all as waiting for data and warned)
    msgs, monitor, trainer = _stall_warnings(tmp_path, 0.0, SlowLoopWork(0.05), step_s=0.0)
    assert msgs == []
    wait, step, rest = monitor.measured()
    assert monitor.fetch_seen and rest > 5 * 0.05 > 10 * wait, (wait, step, rest)
    assert monitor.stall_fraction is not None and monitor.stall_fraction < 0.1
    figures = report_for(trainer)["InputStallMonitor"].figures
    assert figures["rest_s"] == rest and figures["wait_s"] == wait
    assert trainer.profiler is not None and type(trainer.profiler).__name__ != "FetchWatch"


@pytest.mark.filterwarnings("ignore:.*InputStallMonitor")
def test_stall_monitor_beside_the_step_profiler_both_see_the_fetch(tmp_path) -> None:
    # both wrap the trainer's profiler for the fit; each sees the fetch, the waits agree, and the
    # trainer's own profiler is back after the fit
    from helpers import tiny_trainer

    from lightning_efficient.measure.profiling.profiler import StepProfiler

    monitor = InputStallMonitor(check_after=2)
    profiler = StepProfiler(skip_steps=1, print_table=False)
    trainer = tiny_trainer(tmp_path, [profiler, monitor], max_steps=6, limit_val_batches=0)
    own = trainer.profiler
    with no_collector():
        trainer.fit(tiny_model(), datamodule=DelayedData(0.01))  # 40 ms of loading per batch
    assert trainer.profiler is own
    assert monitor.fetch_seen and profiler.summary["fetch_seen"]
    wait, step, rest = monitor.measured()
    # the same region (the fetch to the step), 40 ms per batch: 5 waits (the first batch is
    # never counted) against the profiler's data phase per measured step
    assert wait / 5 == pytest.approx(profiler.summary["phases"]["data"], rel=0.2)
    assert wait > 5 * 0.04 and monitor.stall_fraction > 0.1


@pytest.mark.gpu
def test_stall_monitor_on_cuda_times_the_idle_device(tmp_path) -> None:
    """On CUDA the regions are CUDA events: slow data (400 ms of loading per batch) warns, fast
    data with 50 ms steps stays quiet, and the wait equals StepProfiler's data phase."""
    from lightning_efficient.measure.profiling.profiler import StepProfiler

    profiler = StepProfiler(skip_steps=1, print_table=False)
    msgs, monitor, _ = _stall_warnings(tmp_path, 0.1, profiler, accelerator="gpu")
    assert len(msgs) == 1 and monitor.fetch_seen and monitor.stall_fraction > 0.5, msgs
    wait, _, _ = monitor.measured()
    assert wait / 5 == pytest.approx(profiler.summary["phases"]["data"], rel=0.2)
    msgs, monitor, _ = _stall_warnings(tmp_path, 0.0, accelerator="gpu")
    assert msgs == [] and monitor.stall_fraction < 0.1


def test_stall_fraction_and_workers_to_hide() -> None:
    assert stall_fraction(1.0, 2.0, 1.0) == 0.25 and stall_fraction(0.0, 0.0) is None
    # 0 workers: a wait of 3 s over a cycle of 1 s takes 3 workers; 1 worker and a wait of 1 s
    # over 1 s: each batch takes 2 s to load, so 2; never fewer than one more than now
    assert workers_to_hide(3.0, 1.0, 0) == 3
    assert workers_to_hide(1.0, 1.0, 1) == 2
    assert workers_to_hide(0.01, 1.0, 4) == 5


def test_the_stall_advice_never_passes_the_worker_cap() -> None:
    """Issue 49: the monitor suggested 21 workers on 2 cores where DataLoaderTuning searches to 8;
    one cap now (``default_max_workers``), and past it the advice says loading must get faster."""
    from lightning_efficient.measure.speed.input_stall import worker_advice
    from lightning_efficient.techniques.dataloading import default_max_workers

    most = default_max_workers()
    many = worker_advice(float(4 * most), 1.0, 0)  # hiding this wait takes 4x the cap
    assert f"DataLoaderTuning(num_workers={most})" in many and f"take {4 * most} workers" in many
    assert "DevicePreload()" in many and f"num_workers={4 * most}" not in many
    assert "DataLoaderTuning(num_workers=1)" in worker_advice(1.0, 1.0, 0)


# -- LengthBucketSampler --------------------------------------------------------------------
def _lengths(n: int = 512, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 200) for _ in range(n)]


def _batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def test_bucketing_cuts_padding() -> None:
    lengths = _lengths()
    shuffled = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    plain = padding_stats(lengths, _batches(shuffled, 8))
    bucketed = padding_stats(
        lengths, _batches(list(LengthBucketSampler(lengths, bucket_size=128)), 8)
    )
    assert bucketed["real_tokens"] == plain["real_tokens"] == sum(lengths)
    assert plain["padding_fraction"] > 0.3
    assert bucketed["padding_fraction"] < 0.25 * plain["padding_fraction"]


def test_bucket_order_deterministic_per_seed_and_epoch() -> None:
    lengths = _lengths(100)
    a, b = LengthBucketSampler(lengths, 20, seed=1), LengthBucketSampler(lengths, 20, seed=1)
    assert list(a) == list(b)
    e0 = list(a)
    a.set_epoch(1)
    assert list(a) != e0 and sorted(a) == sorted(e0) == list(range(100))
    assert list(LengthBucketSampler(lengths, 20, seed=2)) != e0
    # inside each bucket the lengths are sorted, longest first
    for bucket in _batches(e0, 20):
        ls = [lengths[i] for i in bucket]
        assert ls == sorted(ls, reverse=True)


@pytest.mark.parametrize("n,drop_last", [(99, False), (100, False), (100, True), (101, True)])
def test_bucket_ddp_partition(n: int, drop_last: bool) -> None:
    lengths = _lengths(n)
    shards = [
        list(LengthBucketSampler(lengths, 60, num_replicas=3, rank=r, drop_last=drop_last))
        for r in range(3)
    ]
    assert len({len(s) for s in shards}) == 1  # every rank takes as many steps
    flat = [i for s in shards for i in s]
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // 3) * 3  # disjoint
    else:
        assert set(flat) == set(range(n))  # covering
        if n % 3 == 0:
            assert len(flat) == n  # and disjoint
    # each rank's run is sorted within its share of a bucket, so batches stay homogeneous
    rank0 = padding_stats(lengths, _batches(shards[0], 4))["padding_fraction"]
    unbucketed = padding_stats(lengths, _batches(list(range(n))[0::3], 4))["padding_fraction"]
    assert rank0 < 0.5 * unbucketed
    assert len(shards[0]) == len(
        LengthBucketSampler(lengths, 60, num_replicas=3, rank=0, drop_last=drop_last)
    )


def test_bucket_resumes_mid_epoch() -> None:
    lengths = _lengths(60)
    full = LengthBucketSampler(lengths, 16, seed=4)
    full.set_epoch(2)
    whole = list(full)
    first = LengthBucketSampler(lengths, 16, seed=4)
    first.set_epoch(2)
    it = iter(first)
    head = [next(it) for _ in range(23)]
    state = first.state_dict()
    assert state == {"seed": 4, "epoch": 2, "position": 23}
    resumed = LengthBucketSampler(lengths, 16, seed=0)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning calls this at the start of the resumed epoch
    assert head + list(resumed) == whole
    assert resumed.state_dict()["position"] == 0  # the next epoch starts from the beginning
    # and through a DataLoader
    loader = DataLoader(Numbered(60), batch_size=5, sampler=resumed)
    resumed.load_state_dict({"seed": 4, "epoch": 2, "position": 20})
    assert [int(x) for b in loader for x in b[0]] == whole[20:]


def test_bucket_is_left_alone_by_lightning_distributed_injection() -> None:
    from torch.utils.data.distributed import DistributedSampler

    sampler = LengthBucketSampler(_lengths(10), 4)
    assert isinstance(sampler, DistributedSampler)  # Lightning only injects into other samplers
    assert (sampler.num_replicas, sampler.rank) == (1, 0)  # no process group here


def test_bucket_bad_input() -> None:
    with pytest.raises(ValueError, match=r"`lengths` has 3 entries but the dataset has 5"):
        LengthBucketSampler([1, 2, 3], bucket_size=2, dataset=list(range(5)))
    with pytest.raises(ValueError, match="bucket_size"):
        LengthBucketSampler([1, 2, 3], bucket_size=0)
    with pytest.raises(ValueError, match="lengths"):
        LengthBucketSampler([1, -2, 3], bucket_size=2)
    with pytest.raises(TypeError, match="lengths"):
        LengthBucketSampler("abc", bucket_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        LengthBucketSampler([1, 2, 3], bucket_size=2, num_replicas=2, rank=2)


@pytest.mark.ddp_case("bucket")  # tests/multiprocess/ddp_bucket.py
def test_bucket_sampler_under_lightning_ddp_shards_itself(ddp_case) -> None:
    """Lightning leaves the sampler in place (no DistributedSamplerWrapper re-shuffling it) and
    each of 2 ranks trains on its own bucketed shard: disjoint, covering, batches sorted."""
    import json

    from ddp_bucket import LENGTHS

    ranks = [json.loads((ddp_case / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sampler"] == "LengthBucketSampler" and r["world"] == 2 for r in ranks)
    seen = [[i for batch in r["seen"] for i in batch] for r in ranks]
    assert set(seen[0]).isdisjoint(seen[1]) and set(seen[0]) | set(seen[1]) == set(
        range(len(LENGTHS))
    )
    for r in range(2):
        assert (
            seen[r] == LengthBucketSampler(LENGTHS, 16, seed=3, num_replicas=2, rank=r).rank_order()
        )


class StepFetchesItsBatch(type(tiny_model())):
    """A ``training_step(self, dataloader_iter)``: the step calls the loader's ``next`` itself."""

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return self._loss(batch)[0]


def test_stall_monitor_counts_the_fetch_a_step_makes_itself(tmp_path) -> None:
    """Issue 49: with ``training_step(self, dataloader_iter)`` the fetch runs inside the step; a
    40 ms-a-batch loader against 1 ms of compute read 0.4% and no warning (the fetch was the
    step's). The in-step fetch is the wait now, as in the plain loop (400 ms a batch here: on a
    loaded machine the tiny model's steps took 1-1.6 s)."""
    from benchmarks.workloads import TINY_MODEL

    model = StepFetchesItsBatch(**TINY_MODEL)
    msgs, monitor, _ = _stall_warnings(tmp_path, 0.1, model=model, step_s=0.001)
    assert monitor.fetch_seen and len(msgs) == 1 and "DataLoaderTuning" in msgs[0], msgs
    wait, step, rest = monitor.measured()
    assert wait > 5 * 0.4 and monitor.stall_fraction > 0.1, (wait, step, rest)
    # the plain loop on the same data: the same wait
    _, plain, _ = _stall_warnings(tmp_path, 0.1, step_s=0.001)
    assert wait == pytest.approx(plain.measured()[0], rel=0.2)
