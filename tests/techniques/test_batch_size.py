"""EfficientBatchSize and OOMRecovery: rounding, target arithmetic, search, worst case, OOM."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _batch_size_helpers import OOMGPT
from helpers import fit, params_of
from lightning.pytorch import Callback, LightningDataModule

from benchmarks.workloads import TINY_MODEL, tiny_data, tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.functional import (
    largest_fitting_batch,
    micro_batch_step,
)
from lightning_efficient.measure.memory.budget import largest_within
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.trials.trial import is_out_of_memory
from lightning_efficient.techniques.batch_size import (
    EfficientBatchSize,
    OOMRecovery,
    OutOfMemoryRecoveryError,
)
from lightning_efficient.techniques.batch_size.sizing import (
    accumulation_for,
    choose_micro_batch,
    longest_sample,
    round_batch_size,
    worst_case_batch,
)
from lightning_efficient.techniques.batch_size.split import (
    chunk_weights,
    split_batch,
)


# -- rounding --------------------------------------------------------------------------------------
def test_rounding_rules() -> None:
    # a power of two on a CPU, whatever the precision
    assert [round_batch_size(n) for n in (1, 3, 8, 100, 1000)] == [1, 2, 8, 64, 512]
    assert round_batch_size(100, precision="bf16-mixed") == 64
    # 8 for fp16/bf16 on CUDA tensor cores (an RTX card: no 64 rule)
    rtx = dict(device_type="cuda", capability=(8, 6), device_name="NVIDIA GeForce RTX 3090")
    assert round_batch_size(100, precision="bf16-mixed", **rtx) == 96
    assert round_batch_size(300, precision="16-mixed", **rtx) == 296
    assert round_batch_size(100, precision="32-true", **rtx) == 64  # fp32: power of two
    assert round_batch_size(6, precision="bf16-mixed", **rtx) == 4  # below 8: power of two
    # 64 on A100/H100-class devices once the batch is large enough (>= 256), else 8
    h100 = dict(device_type="cuda", capability=(9, 0), device_name="NVIDIA H100 80GB HBM3")
    assert round_batch_size(300, precision="bf16-mixed", **h100) == 256
    assert round_batch_size(700, precision="32-true", **h100) == 640
    assert round_batch_size(200, precision="bf16-mixed", **h100) == 200
    assert (
        round_batch_size(
            700, precision="32-true", device_type="cuda", device_name="NVIDIA A100-SXM4-40GB"
        )
        == 640
    )
    # an explicit multiple
    assert (
        round_batch_size(100, 24) == 96
        and round_batch_size(20, 24) == 16
        and round_batch_size(7, 1) == 7
    )
    with pytest.raises(ValueError, match="`n`"):
        round_batch_size(0)
    with pytest.raises(ValueError, match="multiple_of"):
        round_batch_size(10, 0)


# -- target arithmetic -------------------------------------------------------------------------------
def test_accumulation_for_target() -> None:
    assert accumulation_for(64, 8) == (8, 64, True)
    assert accumulation_for(64, 8, world_size=2) == (4, 64, True)
    assert accumulation_for(64, 64, world_size=2) == (1, 128, False)  # nearest possible
    assert accumulation_for(100, 32) == (3, 96, False)  # 96 is nearer to 100 than 128
    assert accumulation_for(112, 32) == (3, 96, False)  # a tie (96 / 128): not above the target
    assert accumulation_for(120, 32) == (4, 128, False)
    for bad in (0, -4, 2.5, "64", True):
        with pytest.raises((ValueError, TypeError), match="target_batch_size"):
            accumulation_for(bad, 8)


def test_choose_micro_batch_prefers_exact() -> None:
    assert choose_micro_batch(50) == (32, 1, 32, True)  # no target: the rounded largest
    assert choose_micro_batch(50, target=96) == (32, 3, 96, True)  # rounded and exact
    assert choose_micro_batch(64, target=100) == (50, 2, 100, True)  # exact beats rounded
    assert choose_micro_batch(40, target=64, world_size=2) == (32, 1, 64, True)
    assert choose_micro_batch(64, target=8, world_size=2) == (
        4,
        1,
        8,
        True,
    )  # capped at target/world
    m, acc, eff, exact = choose_micro_batch(16, target=97)  # 97 is prime: nearest, not exact
    assert not exact and m * acc == eff and abs(eff - 97) <= m


# -- search ----------------------------------------------------------------------------------------
def test_largest_fitting_batch_with_the_estimate() -> None:
    model = tiny_model()
    batch = lambda n: (torch.zeros(n, 32, dtype=torch.long),) * 2  # noqa: E731
    peak = functools.lru_cache(lambda n: estimate_memory(model, batch(n)).peak_bytes)
    budget = peak(24)
    n, seen = largest_fitting_batch(peak, budget, max_batch_size=64)
    assert n >= 24 and peak(n) <= budget < peak(n + 1)
    assert len(seen) <= 6, f"too many estimates: {sorted(seen)}"
    assert largest_fitting_batch(peak, peak(1) - 1, 64)[0] == 0
    assert largest_fitting_batch(peak, 2**40, 64)[0] == 64


def test_largest_fitting_batch_exact_on_any_monotone_curve() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        a, b, c = rng.randint(1, 50), rng.random() * 3, rng.choice([1.0, 1.3, 2.0])
        budget, top = rng.randint(1, 10**5), rng.randint(1, 3000)
        curve = lambda n: a + 7 * n + b * n**c  # noqa: E731
        want = max((n for n in range(1, top + 1) if curve(n) <= budget), default=0)
        assert largest_fitting_batch(curve, budget, top)[0] == want


def _counted(curve):
    """``curve`` as ``bytes_at``, with the sizes it was called at (in order)."""
    calls: list[int] = []

    def bytes_at(n: int) -> float:
        calls.append(n)
        return curve(n)

    return bytes_at, calls


def test_largest_within_edges() -> None:
    """The one search of a micro-batch in a budget: nothing fits, all fit, a single size."""
    line = lambda n: 100.0 + 10 * n  # noqa: E731
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 50) == 0 and calls == [128, 1]  # nothing fits
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 50, probe=64) == 0 and calls == [1]  # smallest first
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 10**6) == 128 and calls == [128]  # all fit: 1
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 10**6, probe=64) == 128 and calls == [1, 64, 128]
    assert largest_within([8], line, 180) == 8 and largest_within([8], line, 179) == 0
    # the probe bounds the line's second point; the guess is the line's, unconfirmed
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 500, probe=64, guess_only=True) == 32
    assert calls == [1, 64]
    bytes_at, calls = _counted(line)
    assert largest_within(sizes, bytes_at, 500, probe=64) == 32 and calls == [1, 64, 32]
    with pytest.raises(ValueError, match="sizes"):
        largest_within([], line, 500)
    with pytest.raises(ValueError, match="sizes"):
        largest_within([0, 4], line, 500)


def test_largest_within_exact_on_monotone_curves_and_local_on_others() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        a, b, c = rng.randint(1, 50), rng.random() * 3, rng.choice([1.0, 1.3, 2.0])
        budget, top = rng.randint(1, 10**5), rng.randint(1, 3000)
        sizes = [d for d in range(1, top + 1) if top % d == 0] if rng.random() < 0.5 else None
        sizes = sizes or list(range(1, top + 1))
        curve = lambda n: a + 7 * n + b * n**c  # noqa: E731
        bytes_at, calls = _counted(curve)
        want = max((n for n in sizes if curve(n) <= budget), default=0)
        assert largest_within(sizes, bytes_at, budget, probe=rng.choice([None, 64])) == want
        assert len(calls) == len(set(calls)) and len(calls) <= 30
    # a curve that shrinks (an estimate that is not monotone): a size that fits next to one
    # that does not (or the largest), estimated, never a guess
    for _ in range(300):
        sizes = sorted(rng.sample(range(1, 500), rng.randint(1, 40)))
        noisy = {n: rng.random() * 1000 for n in sizes}
        bytes_at, calls = _counted(noisy.__getitem__)
        got = largest_within(sizes, bytes_at, 500, probe=rng.choice([None, 64]))
        if got == 0:
            assert noisy[sizes[0]] > 500
            continue
        assert got in calls and noisy[got] <= 500
        after = sizes.index(got) + 1
        assert after == len(sizes) or (sizes[after] in calls and noisy[sizes[after]] > 500)


# -- worst case --------------------------------------------------------------------------------------
class Varlen(torch.utils.data.Dataset):
    """Token sequences of different lengths (one much longer than the rest)."""

    def __init__(self, lengths) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        x = torch.arange(self.lengths[i]) % 256
        return x, x


def pad_collate(samples):
    xs, ys = zip(*samples)
    pad = lambda seqs, v: torch.nn.utils.rnn.pad_sequence(
        list(seqs), batch_first=True, padding_value=v
    )  # noqa: E731
    return pad(xs, 0), pad(ys, -100)


def test_worst_case_probing_finds_the_longest_sample() -> None:
    data = Varlen([5, 9, 31, 7, 12])
    assert longest_sample(data) == (2, 62)  # input + target elements
    batch = worst_case_batch(data, pad_collate, 4)
    assert batch[0].shape == (4, 31) and torch.equal(batch[0][3], data[2][0])
    # evenly spaced scan of a larger set still sees both ends
    assert longest_sample(Varlen([3] * 99 + [40]), max_samples=10)[0] == 99
    # the longest sample decides: the memory of n worst-case samples exceeds a typical batch
    model = tiny_model()
    typical = estimate_memory(model, pad_collate([data[0]] * 8)).peak_bytes
    worst = estimate_memory(model, worst_case_batch(data, pad_collate, 8)).peak_bytes
    assert worst > typical


class VarlenData(LightningDataModule):
    def __init__(self, lengths, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.data = Varlen(lengths)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            self.data, batch_size=self.batch_size, collate_fn=pad_collate
        )


class MaskedGPT(OOMGPT):
    """Token-mean loss that ignores padding (-100): a plain mean over micro-batches is wrong."""

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100
        ), logits


def test_callback_sizes_for_the_longest_sample(tmp_path) -> None:
    short, long_ = [8] * 31, [8] * 30 + [32]
    budget = estimate_memory(tiny_model(), pad_collate([Varlen([8])[0]] * 16)).peak_bytes
    picks = {}
    for name, lengths in (("short", short), ("long", long_)):
        cb = EfficientBatchSize(budget=int(budget / 0.9) + 16, multiple_of=1, max_batch_size=24)
        fit(tmp_path / name, [cb], model=gpt(cls=MaskedGPT), data=VarlenData(lengths), max_steps=1)
        picks[name] = cb.micro_batch_size
    assert picks["short"] >= 16 and picks["long"] < picks["short"] / 2, picks


# -- loss normalisation --------------------------------------------------------------------------------
def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_split_batch_keeps_every_sample() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "n": 3, "y": [torch.arange(5), "tag"]}
    parts = split_batch(batch, 3)
    assert [p["x"].shape[0] for p in parts] == [2, 1, 2]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert torch.equal(torch.cat([p["y"][0] for p in parts]), batch["y"][0])
    assert all(p["n"] == 3 and p["y"][1] == "tag" for p in parts)
    with pytest.raises(ValueError, match="cannot split"):
        split_batch(batch, 6)


def test_accumulated_gradient_equals_full_batch_gradient_mean_loss() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    x = torch.randint(0, 256, (6, 32))
    loss_fn = lambda b: F.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten())  # noqa: E731
    full = loss_fn((x, x))
    full.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    got_loss = micro_batch_step(loss_fn, (x, x), 4)  # 6 samples in chunks of 2, 1, 2, 1
    got = _grads(model)
    torch.testing.assert_close(got_loss, full.detach(), rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_token_weighting_for_variable_length_losses() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    data = Varlen([4, 6, 30, 28])  # the second micro-batch holds many more real tokens
    x, y = pad_collate([data[i] for i in range(4)])
    loss_fn = lambda b: F.cross_entropy(
        model(b[0]).flatten(0, 1), b[1].flatten(), ignore_index=-100
    )  # noqa: E731
    loss_fn((x, y)).backward()
    want = _grads(model)
    results = {}
    for weighting in ("samples", "tokens"):
        model.zero_grad(set_to_none=True)
        results[weighting] = (
            micro_batch_step(loss_fn, (x, y), 2, weighting=weighting),
            _grads(model),
        )
    full = loss_fn((x, y)).detach()
    torch.testing.assert_close(results["tokens"][0], full, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(results["tokens"][1][name], want[name], rtol=1e-4, atol=1e-7)
    # a plain mean over micro-batches is wrong here
    assert abs(float(results["samples"][0] - full)) > 1e-3
    assert chunk_weights(split_batch((x, y), 2), "tokens") == pytest.approx([10 / 68, 58 / 68])
    assert chunk_weights(split_batch((x, y), 2), "samples") == [0.5, 0.5]


# -- OOM recovery ----------------------------------------------------------------------------------------
def test_is_out_of_memory() -> None:
    try:
        torch.empty(2**60, dtype=torch.uint8)
    except RuntimeError as err:
        assert is_out_of_memory(err)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def assert_same_updates(plain, model, tol: float = 1e-3) -> None:
    """The parameters moved the same way as in the plain run: the difference is tiny next to
    the update itself. (Element-wise checks fail on noise: AdamW turns a gradient that is zero
    in exact arithmetic, such as an attention key bias's, into a +-lr step of its sign.)"""
    init = params_of(gpt())
    a, b, start = (
        torch.cat([p.flatten().double() for p in d.values()])
        for d in (params_of(plain), params_of(model), init)
    )
    assert (a - start).norm() > 0
    assert (b - a).norm() / (a - start).norm() < tol, float((b - a).norm() / (a - start).norm())


def gpt(cls=OOMGPT, **kwargs):
    """The test model, built from the same seed as `fit` builds the plain one."""
    pl.seed_everything(0, verbose=False)
    return cls(**kwargs, **TINY_MODEL)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_forward_oom_mid_training_keeps_samples_and_losses(tmp_path, accumulate) -> None:
    _, plain, plain_rec = _plain(tmp_path, accumulate)
    cb = OOMRecovery()
    with pytest.warns(UserWarning, match="out of memory in the forward at step 2"):
        trainer, model, rec = fit(
            tmp_path / "oom",
            [cb],
            model=gpt(oom_above=2, from_step=2),
            max_steps=6,
            limit_val_batches=0,
            accumulate_grad_batches=accumulate,
        )
    assert model.injected == 1 and cb.splits == 2 and cb.recoveries == 1  # it did fail, once
    assert trainer.global_step == 6
    assert model.samples_seen == plain.samples_seen == 6 * accumulate * 4  # no sample skipped
    torch.testing.assert_close(
        torch.tensor(rec.losses), torch.tensor(plain_rec.losses), rtol=1e-5, atol=1e-6
    )
    assert_same_updates(plain, model)
    entry = report_for(trainer)["OOMRecovery"]
    assert entry.figures["splits"] == 2 and entry.figures["recoveries"] == 1


def _plain(tmp_path, accumulate=1):
    _, model, rec = fit(
        tmp_path / f"plain{accumulate}",
        [],
        model=gpt(),
        max_steps=6,
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
    )
    return None, model, rec


def test_repeated_oom_halves_until_it_fits(tmp_path) -> None:
    _, plain, plain_rec = _plain(tmp_path)
    cb = EfficientBatchSize(budget="1GiB", max_batch_size=4)
    trainer, model, rec = fit(
        tmp_path / "oom",
        [cb],
        model=gpt(oom_above=1, from_step=1),
        max_steps=6,
        limit_val_batches=0,
    )
    assert cb.micro_batch_size == 4 and cb.splits == 4 and cb.recoveries == 2
    assert model.samples_seen == plain.samples_seen
    torch.testing.assert_close(
        torch.tensor(rec.losses), torch.tensor(plain_rec.losses), rtol=1e-5, atol=1e-6
    )
    assert "after OOM: micro-batch 1 x 4 splits" in report_for(trainer)["EfficientBatchSize"].change


def test_backward_oom_is_rerun_split(tmp_path) -> None:
    _, plain, plain_rec = _plain(tmp_path)
    cb = OOMRecovery()
    trainer, model, rec = fit(
        tmp_path / "oom",
        [cb],
        model=gpt(oom_above=2, from_step=3, where="backward"),
        max_steps=6,
        limit_val_batches=0,
    )
    assert model.injected == 1 and cb.splits == 2
    torch.testing.assert_close(
        torch.tensor(rec.losses), torch.tensor(plain_rec.losses), rtol=1e-5, atol=1e-6
    )
    assert_same_updates(plain, model)


def test_gives_up_at_micro_batch_one(tmp_path) -> None:
    with pytest.raises(OutOfMemoryRecoveryError, match="even with micro-batch 1"):
        fit(tmp_path, [OOMRecovery()], model=gpt(oom_above=0, from_step=1), max_steps=3)


@pytest.mark.slow
@pytest.mark.ddp_case("batch_size")
def test_ddp_two_processes_target_and_oom(ddp_case) -> None:
    results = {}
    # both runs in the session's 2-process launch, one after the other
    # (tests/multiprocess/ddp_batch_size.py)
    for mode in ("plain", "oom"):
        results[mode] = [
            json.loads(Path(f"{ddp_case / mode}.rank{r}.json").read_text()) for r in (0, 1)
        ]
        results[mode + "_params"] = torch.load(f"{ddp_case / mode}.rank0.pt")
    for r in results["plain"] + results["oom"]:
        # micro-batch x accumulation x world size == target, on both processes
        assert r["world_size"] == 2 and r["micro"] * r["accumulate_grad_batches"] * 2 == 16
        assert r["accumulate_grad_batches"] == 2 and r["global_step"] == 3
    rank1 = results["oom"][1]
    assert rank1["injected"] == 1 and rank1["splits"] == 2 and results["oom"][0]["splits"] == 1
    for plain, oom in zip(results["plain"], results["oom"]):
        assert plain["samples_seen"] == oom["samples_seen"] == 3 * 2 * 4
        torch.testing.assert_close(
            torch.tensor(oom["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6
        )
    # the gradient all-reduce saw the split rank's whole gradient: the same updates
    init = params_of(gpt())
    a, b, start = (
        torch.cat([p.flatten().double() for p in d.values()])
        for d in (results["plain_params"], results["oom_params"], init)
    )
    assert (b - a).norm() / (a - start).norm() < 1e-3


# -- the callback ------------------------------------------------------------------------------------
class SamplesPerStep(Callback):
    def __init__(self) -> None:
        self.samples = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += batch[0].shape[0]


def test_target_batch_with_accumulation_matches_full_batch(tmp_path) -> None:
    """micro 4 x accumulation 2 == target 8: the same updates as batch 8 without accumulation."""
    _, plain, _ = fit(
        tmp_path / "plain", [], data=tiny_data(batch_size=8), max_steps=3, limit_val_batches=0
    )
    count = SamplesPerStep()
    cb = EfficientBatchSize(target_batch_size=8, budget="1GiB", max_batch_size=4)
    trainer, model, _ = fit(
        tmp_path / "tech",
        [cb, count],
        data=tiny_data(batch_size=2),
        max_steps=3,
        limit_val_batches=0,
    )
    assert (cb.micro_batch_size, trainer.accumulate_grad_batches) == (4, 2)
    assert trainer.train_dataloader.batch_size == 4
    assert trainer.datamodule.batch_size == 2  # the given batch size back after fit (its undo)
    assert count.samples == 3 * 8
    assert_same_updates(plain, model)


def test_budget_decides_the_micro_batch(tmp_path) -> None:
    model = tiny_model()
    peak = lambda n: (
        estimate_memory(
            model, (torch.zeros(n, 32, dtype=torch.long),) * 2, accumulate_grad_batches=2
        ).peak_bytes
    )  # noqa: E731
    budget = int(peak(12) / 0.9) + 16
    cb = EfficientBatchSize(target_batch_size=32, budget=budget, max_batch_size=32)
    with pytest.warns(UserWarning, match="replaced by 4"):
        trainer, _, _ = fit(tmp_path, [cb], max_steps=1, accumulate_grad_batches=3)
    assert cb._figures["largest_fitting"] == 12 and cb.micro_batch_size == 8  # power of two <= 12
    assert trainer.accumulate_grad_batches == 4
    assert cb._figures["estimated_peak_bytes"] <= budget * 0.9


def test_inexact_target_warns(tmp_path) -> None:
    cb = EfficientBatchSize(target_batch_size=7, budget="1GiB", max_batch_size=4)  # 7 is prime
    with pytest.warns(UserWarning, match="cannot be reached exactly"):
        trainer, _, _ = fit(tmp_path, [cb], max_steps=1)
    assert (cb.micro_batch_size, trainer.accumulate_grad_batches) == (4, 2)  # 8: the nearest


def test_throughput_mode_times_the_candidates(tmp_path) -> None:
    cb = EfficientBatchSize(mode="throughput", budget="1GiB", max_batch_size=4)
    trainer, _, _ = fit(tmp_path, [cb], max_steps=1)
    rates = cb._figures["candidates"]
    assert all(f"{m}:" in rates for m in (1, 2, 4))
    assert cb.micro_batch_size in (1, 2, 4) and cb._figures["samples_per_s"] > 0


def test_resume_keeps_the_chosen_sizes(tmp_path) -> None:
    cb = EfficientBatchSize(target_batch_size=8, budget="1GiB", max_batch_size=2)
    trainer, _, _ = fit(tmp_path / "a", [cb], max_steps=2)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    # a larger budget would choose micro-batch 8; the resumed run keeps 2 x 4
    cb2 = EfficientBatchSize(target_batch_size=8, budget="2GiB", max_batch_size=8)
    trainer2, _, _ = fit(tmp_path / "b", [cb2], max_steps=4, ckpt_path=str(ckpt))
    assert (cb2.micro_batch_size, trainer2.accumulate_grad_batches) == (2, 4)
    assert trainer2.train_dataloader.batch_size == 2 and trainer2.global_step == 4


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -8, 2.5, "32", True])
def test_bad_target(value) -> None:
    with pytest.raises((ValueError, TypeError), match="target_batch_size"):
        EfficientBatchSize(target_batch_size=value)


@pytest.mark.parametrize("value", [-0.1, 0.9, 1.5, float("nan"), "0.1"])
def test_bad_margin(value) -> None:
    with pytest.raises((ValueError, TypeError), match="margin"):
        EfficientBatchSize(margin=value)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"mode": "fastest"}, "mode"),
        ({"multiple_of": 0}, "multiple_of"),
        ({"multiple_of": "eight"}, "multiple_of"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"budget": "lots"}, "budget"),
        ({"loss_weighting": "mean"}, "loss_weighting"),
        ({"token_counter": 3}, "token_counter"),
    ],
)
def test_bad_arguments(kwargs, name) -> None:
    with pytest.raises((ValueError, TypeError), match=name):
        EfficientBatchSize(**kwargs)


class NoBatchSizeData(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_data()

    def setup(self, stage=None) -> None:
        self.inner.setup(stage)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.inner.train_set, batch_size=4)


def test_datamodule_without_batch_size(tmp_path) -> None:
    with pytest.raises(ValueError, match="no `batch_size` found.*NoBatchSizeData"):
        fit(tmp_path, [EfficientBatchSize(budget="1GiB")], data=NoBatchSizeData(), max_steps=1)


def test_model_too_large_for_the_budget(tmp_path) -> None:
    with pytest.raises(OutOfMemoryRecoveryError, match="even a micro-batch of 1 needs"):
        fit(tmp_path, [EfficientBatchSize(budget="100KiB")], max_steps=1)


def test_conflicts_are_refused(tmp_path) -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    with pytest.raises(ValueError, match="GradientAccumulationScheduler changes it"):
        fit(
            tmp_path,
            [EfficientBatchSize(target_batch_size=8), GradientAccumulationScheduler({0: 2})],
            max_steps=1,
        )
    with pytest.raises(ValueError, match="OOM recovery is on twice"):
        fit(tmp_path, [EfficientBatchSize(budget="1GiB"), OOMRecovery()], max_steps=1)


class BatchCounter(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches += 1


@pytest.mark.parametrize("sizer_first", [False, True])
def test_optimizer_in_backward_refuses_a_target_batch_size(tmp_path, sizer_first) -> None:
    """Issue 21 item 2: the rule is checked against the accumulation EfficientBatchSize will set,
    in either callback order, and the fit stops before its first step."""
    from lightning_efficient.techniques.optimizers import OptimizerSwap

    swap = OptimizerSwap("torch.optim.AdamW", optimizer_in_backward=True)
    sizer = EfficientBatchSize(target_batch_size=8, budget="1GiB", max_batch_size=2)
    counter = BatchCounter()
    callbacks = [sizer, swap] if sizer_first else [swap, sizer]
    with pytest.raises(
        ValueError,
        match=r"OptimizerSwap\(optimizer_in_backward=True\) cannot be combined with "
        r"EfficientBatchSize, which sets accumulate_grad_batches during the fit",
    ):
        fit(tmp_path, [*callbacks, counter], max_steps=2, limit_val_batches=0)
    assert counter.batches == 0 and sizer.micro_batch_size is None  # refused before choosing
    # without a target the accumulation stays 1: the same pair trains
    sizer = EfficientBatchSize(budget="1GiB", max_batch_size=2)
    trainer, _, _ = fit(tmp_path, [swap, sizer], max_steps=2, limit_val_batches=0)
    assert trainer.global_step == 2 and trainer.accumulate_grad_batches == 1


# -- composition: EfficientBatchSize holds OOM recovery, and says so publicly ---------------------
def test_efficient_batch_size_composes_oom_recovery() -> None:
    from lightning_efficient.core import compat
    from lightning_efficient.techniques.batch_size import OOMGuard

    cb = EfficientBatchSize(target_batch_size=8)
    assert not isinstance(cb, OOMRecovery) and isinstance(cb.recovery, OOMGuard)
    assert cb.sets_accumulation and cb.recovers_from_oom and OOMRecovery().recovers_from_oom
    off = EfficientBatchSize(oom_recovery=False)
    assert not off.sets_accumulation and not off.recovers_from_oom
    # the rule reads the declared attributes: two recoveries are refused, one is not
    trainer = pl.Trainer(accelerator="cpu", logger=False)
    assert "OOM recovery is on twice" in compat._batch_size_accumulation(
        trainer, [EfficientBatchSize(), OOMRecovery()]
    )
    assert compat._batch_size_accumulation(trainer, [off, OOMRecovery()]) is None
    # state: the splitter's, with the choice
    cb.recovery.load_state_dict({"splits": 4, "recoveries": 2})
    assert (cb.splits, cb.recoveries) == (4, 2) and cb.state_dict()["splits"] == 4


# -- the pure splitter: a step given as callables, no trainer ---------------------------------------
def _oom_above(limit: int, model, log: list):
    def step(chunk):
        x, y = chunk
        log.append(x.shape[0])
        if x.shape[0] > limit:
            torch.empty(2**60, dtype=torch.uint8)  # a real CPU allocation failure
        return F.mse_loss(model(x), y)

    return step


def test_splitter_reruns_split_with_the_full_batch_gradient() -> None:
    from lightning_efficient.techniques.batch_size import OOMSplitter, StepCalls

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    F.mse_loss(model(x), y).backward()
    expected = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)

    splitter, sizes, said = OOMSplitter(), [], []
    calls = StepCalls(
        step=_oom_above(2, model, sizes),
        backward=lambda t: t.backward(),
        zero_grad=lambda: model.zero_grad(set_to_none=True),
        step_index=5,
        on_split=said.append,
    )
    loss = splitter.run((x, y), calls)
    loss.backward()  # the caller's backward completes the accumulation
    assert (splitter.splits, splitter.recoveries) == (4, 2)
    assert sizes == [8, 4, 2, 2, 2, 2]  # whole, half (OOM), then four parts of 2
    assert said[0].startswith("out of memory in the forward at step 5") and "split in 4" in said[1]
    torch.testing.assert_close(model.weight.grad, expected)
    torch.testing.assert_close(loss.detach(), F.mse_loss(model(x), y).detach())
    assert not splitter.take_zero_grad() and splitter.take_zero_grad()  # skipped once


def test_splitter_refuses_what_it_cannot_rerun_exactly() -> None:
    from lightning_efficient.techniques.batch_size import OOMSplitter, StepCalls

    model = torch.nn.Linear(3, 1)
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    calls = StepCalls(
        step=_oom_above(0, model, []),
        backward=lambda t: t.backward(),
        zero_grad=lambda: None,
        step_index=3,
    )
    with pytest.raises(OutOfMemoryRecoveryError, match="at step 3 even with micro-batch 1"):
        OOMSplitter().run(batch, calls)
    # a backward OOM later in an accumulation window: earlier gradients are held
    later = StepCalls(calls.step, calls.backward, calls.zero_grad, first_of_window=False)
    with pytest.raises(OutOfMemoryRecoveryError, match="in the backward of a micro-batch"):
        OOMSplitter().recover_backward(batch, later, "CUDA out of memory")
