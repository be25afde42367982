"""Curriculum (easiest samples first) and SequenceLengthWarmup (short sequences first): the pure
maths, the sampler without Lightning, and real tiny Lightning fits of the demo."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SaveAt, fit
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Subset

from benchmarks.workloads import tiny_data, tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.functional import (
    CurriculumSampler,
    cut_batch,
    difficulty_scores,
    sequence_length_at,
)
from lightning_efficient.techniques import Curriculum, SequenceLengthWarmup
from lightning_efficient.techniques.curriculum import (
    easiest_first,
    pacing_fraction,
    pool_size,
    pool_walk,
    reshape_length,
    with_sampler,
)


class Batches(Callback):
    """Records (global step, inputs) of every training batch as the module receives it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((trainer.global_step, batch[0].detach().clone()))


def _train_set():
    data = tiny_data()
    data.setup("fit")
    return data.train_set


# -- pacing ------------------------------------------------------------------------------------
def test_pacing_values() -> None:
    assert pacing_fraction("linear", 0, 100, 0.2) == pytest.approx(0.2)
    assert pacing_fraction("linear", 50, 100, 0.2) == pytest.approx(0.6)
    assert pacing_fraction("root", 50, 100, 0.2) == pytest.approx(math.sqrt(0.04 + 0.96 * 0.5))
    assert pacing_fraction("geometric", 50, 100, 0.25) == pytest.approx(0.5)
    assert pacing_fraction("step", 24, 100, 0.2, stages=4) == pytest.approx(0.2)
    assert pacing_fraction("step", 25, 100, 0.2, stages=4) == pytest.approx(0.4)
    for name in ("linear", "root", "geometric", "step"):
        values = [pacing_fraction(name, t, 40, 0.1) for t in range(-2, 50)]
        assert values[2] == pytest.approx(0.1) and values[-1] == 1.0 and values[42] == 1.0
        assert values == sorted(values), f"{name} is not monotone"
    # root is ahead of linear, geometric behind it, in the middle of the schedule
    assert (
        pacing_fraction("root", 20, 40, 0.1)
        > pacing_fraction("linear", 20, 40, 0.1)
        > pacing_fraction("geometric", 20, 40, 0.1)
    )
    assert pacing_fraction("linear", 5, 0, 0.1) == 1.0  # no duration: all data at once
    assert (
        pool_size(0.1, 64) == 7 and pool_size(0.1, 64, minimum=8) == 8 and pool_size(1.0, 64) == 64
    )


def test_unknown_pacing_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="pacing.*'linear', 'root', 'geometric', 'step'.*'cosine'"):
        pacing_fraction("cosine", 1, 10)
    for cls in (Curriculum, SequenceLengthWarmup):
        kwargs = {"difficulty": "entropy"} if cls is Curriculum else {}
        with pytest.raises(ValueError, match="`pacing` must be one of 'linear', 'root'"):
            cls(pacing="cosine", **kwargs)


def test_sequence_lengths_move_in_multiples() -> None:
    lengths = [sequence_length_at(t, 100, 512, 64, 64) for t in range(101)]
    assert lengths[0] == 64 and lengths[-1] == 512 and lengths == sorted(lengths)
    assert all(n % 64 == 0 for n in lengths) and len(set(lengths)) == 8
    assert sequence_length_at(99, 100, 500, 64, 64) == 448  # rounded down, below the full length
    assert sequence_length_at(100, 100, 500, 64, 64) == 500  # then exactly the full length
    assert reshape_length(200, 256, 64) == 128  # divides 256: every token kept
    assert reshape_length(32, 256, 64) == 64 and reshape_length(100, 100, 64) == 100


# -- difficulty --------------------------------------------------------------------------------
class Scored(torch.utils.data.Dataset):
    def __init__(self, n: int = 10) -> None:
        self.n = n
        self.hardness = [float((i * 7) % n) for i in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"input_ids": torch.arange(i + 1), "level": float(i)}


def by_index(sample) -> float:
    return -float(sample["level"])


def test_difficulty_sources(tmp_path) -> None:
    ds = Scored()
    assert difficulty_scores(ds, "attr:hardness") == ds.hardness
    sub = Subset(ds, [3, 1, 4])
    assert difficulty_scores(sub, "attr:hardness") == [ds.hardness[i] for i in (3, 1, 4)]
    assert difficulty_scores(ds, "field:level") == [float(i) for i in range(10)]
    assert difficulty_scores(ds, "length") == [float(i + 1) for i in range(10)]
    assert difficulty_scores(ds, f"fn:{__name__}.by_index") == [-float(i) for i in range(10)]
    assert difficulty_scores(ds, by_index)[3] == -3.0
    scores = [float(i) / 3 for i in range(10)]
    torch.save(torch.tensor(scores), tmp_path / "s.pt")
    (tmp_path / "s.json").write_text(json.dumps(scores))
    (tmp_path / "s.txt").write_text("\n".join(map(str, scores)))
    for name in ("s.pt", "s.json", "s.txt"):
        assert difficulty_scores(ds, f"file:{tmp_path / name}") == pytest.approx(scores)
    # entropy: a constant window is easier than a varied one
    assert difficulty_scores([torch.zeros(8, dtype=torch.long), torch.arange(8)], "entropy") == [
        0,
        3,
    ]
    # ties are broken by the seed, not by the index
    assert easiest_first([1, 0, 0, 0, 0, 0], seed=1)[-1] == 0
    assert easiest_first([0.0] * 6, seed=1) != easiest_first([0.0] * 6, seed=2)


def test_difficulty_bad_sources(tmp_path) -> None:
    ds = Scored()
    with pytest.raises(ValueError, match="no attribute 'missing'.*hardness"):
        difficulty_scores(ds, "attr:missing")
    with pytest.raises(ValueError, match="sample 0 has no field 'nope'.*'input_ids', 'level'"):
        difficulty_scores(ds, "field:nope")
    with pytest.raises(ValueError, match="non-finite value \\(nan\\) for sample 2"):
        difficulty_scores(ds, [0, 1, float("nan")] + [0] * 7)
    with pytest.raises(ValueError, match="gives 3 scores but the dataset has 10"):
        difficulty_scores(ds, [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="does not exist"):
        difficulty_scores(ds, f"file:{tmp_path / 'none.pt'}")
    with pytest.raises(ValueError, match="difficulty.*'entropy', 'length', 'attr:NAME'"):
        Curriculum("hardness")
    with pytest.raises(ValueError, match="difficulty.*no attribute 'nothing_here'"):
        Curriculum("fn:math.nothing_here")


# -- the sampler without Lightning -------------------------------------------------------------
def test_pool_grows_easiest_first() -> None:
    n, batch = 40, 4
    scores = [float(n - i) for i in range(n)]  # the last index is the easiest
    sampler = CurriculumSampler(scores, batch, start_fraction=0.25, duration=8, seed=3)
    ranked = easiest_first(scores)
    assert ranked[:3] == [39, 38, 37]
    pools = []
    for step, chunk in enumerate(sampler.global_batches()):
        pool = sampler.pool_at(step)
        assert set(chunk) <= set(ranked[:pool]), f"step {step} drew outside the easiest {pool}"
        assert len(set(chunk)) == len(chunk)
        pools.append(pool)
    assert pools[0] == 10 and pools[8] == 40 and pools == sorted(pools)
    order = sampler.rank_order()
    assert (
        len(order) == n and len(list(DataLoader(range(n), batch_size=batch, sampler=sampler))) == 10
    )
    # deterministic from the seed; another seed shuffles the pool differently
    assert (
        order
        == CurriculumSampler(scores, batch, start_fraction=0.25, duration=8, seed=3).rank_order()
    )
    assert (
        order
        != CurriculumSampler(scores, batch, start_fraction=0.25, duration=8, seed=4).rank_order()
    )


def test_pool_walk_repeats_only_after_the_whole_pool() -> None:
    order = list(range(20))
    chunks = list(pool_walk(order, [(8, 4)] * 6, seed=0))
    flat = [i for c in chunks for i in c]
    assert sorted(flat[:8]) == list(range(8)) and sorted(flat[8:16]) == list(range(8))
    grown = [
        i
        for c in pool_walk(order, [(4, 4), (20, 4), (20, 4), (20, 4), (20, 4), (20, 4)])
        for i in c
    ]
    assert sorted(grown) == list(range(20)) or len(set(grown)) == 20  # joined samples mixed in


def test_disjoint_shards_for_two_ranks() -> None:
    scores = [float((i * 13) % 50) for i in range(50)]
    ranks = [
        CurriculumSampler(scores, 3, start_fraction=0.2, duration=5, num_replicas=2, rank=r)
        for r in range(2)
    ]
    orders = [s.rank_order() for s in ranks]
    assert len(orders[0]) == len(orders[1]) == 25
    for step in range(9):
        a, b = (o[step * 3 : step * 3 + 3] for o in orders)
        assert set(a).isdisjoint(b), f"step {step}: ranks share samples"
        pool = set(easiest_first(scores)[: ranks[0].pool_at(step)])
        assert set(a) | set(b) <= pool


def test_sampler_resumes_mid_epoch() -> None:
    scores = [float(i % 7) for i in range(30)]
    full = CurriculumSampler(scores, 2, duration=6, seed=1)
    full.set_epoch(1)
    expected = list(full)
    first = CurriculumSampler(scores, 2, duration=6, seed=1)
    first.set_epoch(1)
    it = iter(first)
    head = [next(it) for _ in range(8)]
    state = first.state_dict()
    resumed = CurriculumSampler(scores, 2, duration=6, seed=1)
    resumed.load_state_dict(state)
    assert head + list(resumed) == expected


def test_with_sampler_keeps_the_loader() -> None:
    loader = DataLoader(list(range(12)), batch_size=5, drop_last=True, shuffle=True)
    sampler = CurriculumSampler([0.0] * 12, 5, duration=0)
    new = with_sampler(loader, sampler)
    assert new.sampler is sampler and new.batch_size == 5 and new.drop_last
    with pytest.raises(ValueError, match="batch_sampler"):
        with_sampler(DataLoader(list(range(4)), batch_size=None), sampler)


# -- Curriculum in a fit -------------------------------------------------------------------------
def _index_of(train_set) -> dict[tuple[int, ...], int]:
    return {tuple(train_set[i][0].tolist()): i for i in range(len(train_set))}


def test_fit_draws_from_the_easiest_pool(tmp_path) -> None:
    train_set = _train_set()
    scores = difficulty_scores(train_set, "entropy")
    ranked = easiest_first(scores)
    index = _index_of(train_set)
    rec = Batches()
    cb = Curriculum("entropy", start_fraction=0.25, duration=8)
    trainer, _, _ = fit(tmp_path, [cb, rec], max_steps=12)
    assert isinstance(trainer.train_dataloader.sampler, CurriculumSampler)
    pools = []
    for step, x in rec.seen:
        pool = cb.sampler.pool_at(step)
        ids = [index[tuple(row.tolist())] for row in x]
        assert set(ids) <= set(ranked[:pool]), f"step {step} drew outside the easiest {pool}"
        pools.append(pool)
    assert pools[0] == 16 and pools[-1] == 64 and pools == sorted(pools)
    first = [index[tuple(r.tolist())] for r in rec.seen[0][1]]
    assert max(scores[i] for i in first) < sorted(scores)[len(scores) // 2]
    row = report_for(trainer)["Curriculum"]
    assert "pool 16/64 (25%) -> 64 over 8 steps" in row.change and row.figures["end_pool"] == 64


@pytest.mark.parametrize("limit", [None, 4], ids=["mid-epoch", "epoch-boundary"])
def test_fit_resume_equals_uninterrupted(tmp_path, limit) -> None:
    kw = {"max_steps": 8} | ({"limit_train_batches": limit} if limit else {})
    make = lambda: Curriculum("entropy", start_fraction=0.25, duration=8)  # noqa: E731
    rec_full, rec_resumed = Batches(), Batches()
    full, _, full_losses = fit(
        tmp_path / "a", [make(), rec_full, SaveAt(4, tmp_path / "k.ckpt")], **kw
    )
    resumed, _, losses = fit(
        tmp_path / "b", [make(), rec_resumed], ckpt_path=str(tmp_path / "k.ckpt"), **kw
    )
    assert [s for s, _ in rec_resumed.seen] == [4, 5, 6, 7]
    for (_, a), (_, b) in zip(rec_full.seen[4:], rec_resumed.seen, strict=True):
        assert torch.equal(a, b)
    assert losses.losses == pytest.approx(full_losses.losses[4:], rel=1e-6)
    assert resumed.callbacks[0].state_dict() == full.callbacks[0].state_dict()


def test_fit_resume_with_worker_processes(tmp_path) -> None:
    data = lambda: tiny_data(num_workers=1)  # noqa: E731
    make = lambda: Curriculum("entropy", start_fraction=0.25, duration=8)  # noqa: E731
    rec_full, rec_resumed = Batches(), Batches()
    fit(
        tmp_path / "a", [make(), rec_full, SaveAt(3, tmp_path / "k.ckpt")], data=data(), max_steps=6
    )
    fit(
        tmp_path / "b",
        [make(), rec_resumed],
        data=data(),
        max_steps=6,
        ckpt_path=str(tmp_path / "k.ckpt"),
    )
    for (_, a), (_, b) in zip(rec_full.seen[3:], rec_resumed.seen, strict=True):
        assert torch.equal(a, b)


def test_reloaded_loader_continues_the_curriculum(tmp_path) -> None:
    make = lambda: Curriculum("entropy", start_fraction=0.25, duration=8)  # noqa: E731
    kw = dict(max_steps=8, limit_train_batches=4)
    once, reloaded = Batches(), Batches()
    fit(tmp_path / "a", [make(), once], **kw)
    fit(tmp_path / "b", [make(), reloaded], reload_dataloaders_every_n_epochs=1, **kw)
    for (_, a), (_, b) in zip(once.seen, reloaded.seen, strict=True):
        assert torch.equal(a, b)


def test_fit_start_refuses_bad_difficulty(tmp_path) -> None:
    with pytest.raises(ValueError, match="Curriculum: .*no field 'level'.*tuple"):
        fit(tmp_path, [Curriculum("field:level")], max_steps=1)
    (tmp_path / "bad.json").write_text(json.dumps([0.0] * 63 + [float("inf")]))
    with pytest.raises(ValueError, match="Curriculum: .*non-finite value \\(inf\\) for sample 63"):
        fit(tmp_path, [Curriculum(f"file:{tmp_path / 'bad.json'}")], max_steps=1)


def test_a_sampler_of_the_users_own_is_refused_not_dropped(tmp_path) -> None:
    """Issue 33 item 8: a WeightedRandomSampler (or any sampler that draws a subset or repeats)
    would lose what it decides; refused at fit start, naming it. A shuffle of one's own (the
    demo's EpochShuffle: a permutation per epoch) is replaced as shuffle=True is."""
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    data = tiny_data()
    data.setup("fit")
    n = len(data.train_set)
    weighted = WeightedRandomSampler([1.0] * n, n)

    class Weighted(type(data)):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_set, batch_size=4, sampler=weighted)

    weighted_data = Weighted(**data.hparams)
    with pytest.raises(ValueError, match="Curriculum: .*own WeightedRandomSampler .*weights"):
        fit(tmp_path, [Curriculum("entropy")], data=weighted_data, max_steps=1)
    assert "train_dataloader" not in vars(weighted_data)  # the datamodule as given

    from lightning_efficient.techniques.curriculum.sampler import own_sampler

    assert "weights" in own_sampler(DataLoader(data.train_set, sampler=weighted))
    subset = SubsetRandomSampler(range(10))
    assert "10 indices, 10 distinct, from 64" in own_sampler(
        DataLoader(data.train_set, sampler=subset)
    )
    assert own_sampler(DataLoader(data.train_set, shuffle=True)) is None
    assert own_sampler(data.train_dataloader()) is None  # EpochShuffle: a permutation


def test_curriculum_bad_inputs_named(tmp_path) -> None:
    """Issue 33 item 10: seeds, scores and score files."""
    with pytest.raises(ValueError, match="`seed` must be in \\[0, 4294967295\\]"):
        Curriculum("entropy", seed=2**70)
    with pytest.raises(ValueError, match="`seed`"):
        CurriculumSampler([1.0, 2.0], 1, seed=-1)
    with pytest.raises(ValueError, match="`difficulty` .*found None at index 1"):
        CurriculumSampler([1, None], 1)
    ds = Scored()
    cases = {
        "flat.pt": lambda f: torch.save(torch.zeros(2, 5), f),
        "bad.pt": lambda f: f.write_bytes(b"not a checkpoint"),
        "bad.json": lambda f: f.write_text("[1, 2,"),
        "nested.json": lambda f: f.write_text(json.dumps([[1, 2]] * 5)),
        "words.txt": lambda f: f.write_text("1\ntwo\n3"),
        "bad.npy": lambda f: f.write_bytes(b"\x93NUMPY nonsense"),
    }
    expected = {
        "flat.pt": "shape \\(2, 5\\); expected a 1-D tensor",
        "bad.pt": "could not be read as .pt",
        "bad.json": "could not be read as .json \\(JSONDecodeError",
        "nested.json": "entry 0 is \\[1, 2\\], not a number",
        "words.txt": "entry 1 is 'two', not a number",
        "bad.npy": "could not be read as .npy",
    }
    for name, write in cases.items():
        write(tmp_path / name)
        with pytest.raises(
            ValueError, match=f"`difficulty`: the scores file .*{name}.*{expected[name]}"
        ):
            difficulty_scores(ds, f"file:{tmp_path / name}")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ValueError, match="does not exist \\(it is a folder\\)"):
        difficulty_scores(ds, f"file:{tmp_path / 'dir.json'}")


def test_equal_difficulties_say_so(tmp_path) -> None:
    with pytest.warns(NoEffectWarning, match="same difficulty"):
        fit(tmp_path, [Curriculum("length", duration=4)], max_steps=2)


@pytest.mark.slow
@pytest.mark.ddp_case("curriculum")  # tests/multiprocess/ddp_curriculum.py
def test_ddp_ranks_get_disjoint_shards_of_the_pool(ddp_case) -> None:
    from ddp_curriculum import check_disjoint_shards

    check_disjoint_shards([json.loads((ddp_case / f"rank{r}.json").read_text()) for r in range(2)])


# -- SequenceLengthWarmup ------------------------------------------------------------------------
def test_cut_batch_structures() -> None:
    batch = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(16).reshape(2, 8) + 100,
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "doc_id": torch.tensor([7, 9]),
    }
    short = cut_batch(batch, 4)
    assert short["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert short["labels"].shape == short["attention_mask"].shape == (2, 4)
    assert torch.equal(short["doc_id"], batch["doc_id"])
    pieces = cut_batch(batch, 4, "reshape")
    assert pieces["input_ids"].tolist() == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    assert pieces["doc_id"].tolist() == [7, 7, 9, 9]
    x, y = cut_batch((torch.zeros(3, 10, 5), torch.zeros(3, 10)), 6)
    assert x.shape == (3, 6, 5) and y.shape == (3, 6)
    assert cut_batch(torch.zeros(2, 4), 8).shape == (2, 4)  # already short enough
    with pytest.raises(
        ValueError, match="no sequence dimension.*found tuple\\(tensor\\(4,\\), tensor\\(4,\\)\\)"
    ):
        cut_batch((torch.zeros(4), torch.zeros(4)), 2)


def _lengths_per_step(rec: Batches) -> list[tuple[int, int]]:
    return [(step, x.shape[1]) for step, x in rec.seen]


def test_fit_lengths_follow_the_schedule(tmp_path) -> None:
    rec = Batches()
    cb = SequenceLengthWarmup(duration=6, start_length=8, multiple_of=8)
    trainer, _, losses = fit(tmp_path, [cb, rec], max_steps=8)
    seen = _lengths_per_step(rec)
    assert seen == [(t, sequence_length_at(t, 6, 32, 8, 8)) for t in range(8)]
    assert [n for _, n in seen] == [8, 8, 16, 16, 24, 24, 32, 32]
    assert all(x.shape[0] == 4 for _, x in rec.seen) and all(map(math.isfinite, losses.losses))
    row = report_for(trainer)["SequenceLengthWarmup"]
    assert (
        row.change.startswith("sequence length 8 -> 32 over 6 steps")
        and row.figures["distinct_lengths"] == 4
    )


def test_fit_reshape_keeps_tokens_per_step(tmp_path) -> None:
    rec = Batches()
    fit(
        tmp_path,
        [SequenceLengthWarmup(duration=4, start_length=8, multiple_of=8, mode="reshape"), rec],
        max_steps=6,
    )
    shapes = [tuple(x.shape) for _, x in rec.seen]
    assert shapes == [(16, 8), (16, 8), (8, 16), (8, 16), (4, 32), (4, 32)]
    assert {a * b for a, b in shapes} == {4 * 32}


def test_fit_resume_continues_the_schedule(tmp_path) -> None:
    make = lambda: SequenceLengthWarmup(duration=6, start_length=8, multiple_of=8)  # noqa: E731
    full, resumed = Batches(), Batches()
    epoch = dict(max_steps=8, limit_train_batches=3)  # the demo's own sampler resumes at epochs
    a, _, la = fit(tmp_path / "a", [make(), full, SaveAt(3, tmp_path / "k.ckpt")], **epoch)
    b, _, lb = fit(tmp_path / "b", [make(), resumed], ckpt_path=str(tmp_path / "k.ckpt"), **epoch)
    assert _lengths_per_step(resumed) == _lengths_per_step(full)[3:]
    assert [n for _, n in _lengths_per_step(resumed)] == [16, 24, 24, 32, 32]
    assert lb.losses == pytest.approx(la.losses[3:], rel=1e-5)
    assert a.callbacks[0].state_dict() == b.callbacks[0].state_dict()


def test_a_multiple_above_the_sequence_length_says_it_does_nothing(tmp_path) -> None:
    """Issue 33 item 10: multiple_of >= the sequence length cuts nothing: refused against
    full_length, a NoEffectWarning against the batches' own length (32 here)."""
    with pytest.raises(
        ValueError, match="`multiple_of` \\(64\\) must be below `full_length` \\(32\\)"
    ):
        SequenceLengthWarmup(multiple_of=64, full_length=32)
    rec = Batches()
    with pytest.warns(NoEffectWarning, match="multiple_of=64 is not below the sequence length 32"):
        fit(tmp_path, [SequenceLengthWarmup(duration=4, start_length=8), rec], max_steps=2)
    assert {x.shape[1] for _, x in rec.seen} == {32}


def test_fit_fails_at_the_first_batch_without_a_sequence_dim(tmp_path) -> None:
    class Flat(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i):
            return torch.tensor(float(i)), torch.tensor(float(i))

    class Module(type(tiny_model())):
        def train_dataloader(self):
            return DataLoader(Flat(), batch_size=4)

    model = Module(**{k: v for k, v in tiny_model().hparams.items()})
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[SequenceLengthWarmup(duration=2)])  # fmt: skip
    with pytest.raises(
        ValueError,
        match="SequenceLengthWarmup: the batch has no sequence dimension.*tensor\\(4,\\)",
    ):
        trainer.fit(model)
    assert "on_after_batch_transfer" not in vars(model)  # the hook is restored after the failure


def test_estimate_sizes_the_full_length() -> None:
    from lightning_efficient.measure.memory.estimate import estimate_memory

    model = tiny_model()
    batch = (torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))
    plain = estimate_memory(model, batch)
    warm = estimate_memory(
        model, batch, callbacks=[SequenceLengthWarmup(start_length=8, multiple_of=8)]
    )
    assert warm.peak_bytes == plain.peak_bytes
    assert any("full sequence length" in n for n in warm.notes)


@pytest.mark.slow
def test_compile_recompilations_are_bounded_and_reported(tmp_path) -> None:
    from lightning_efficient.techniques.compile import TorchCompile

    cb = SequenceLengthWarmup(duration=6, start_length=8, multiple_of=8)
    trainer, _, _ = fit(
        tmp_path, [cb, TorchCompile(backend="aot_eager")], max_steps=8, limit_val_batches=0
    )
    figures = report_for(trainer)["SequenceLengthWarmup"].figures
    assert figures["distinct_lengths"] == 4
    assert 0 <= figures["warmup_recompiles"] <= figures["distinct_lengths"] - 1
    assert "recompilation" in report_for(trainer)["SequenceLengthWarmup"].change


def test_an_endless_sampler_is_refused_not_drawn_for_ever(tmp_path) -> None:
    """Issue 37: a sampler of the user's that never ends was drawn into a list (memory without
    bound); no more than one index past the dataset's size is drawn now, and it is refused."""
    from torch.utils.data import Sampler

    from lightning_efficient.techniques.curriculum.sampler import own_sampler

    class Endless(Sampler[int]):
        def __init__(self, n: int) -> None:
            self.n, self.drawn = n, 0

        def __iter__(self):
            while True:
                self.drawn += 1
                if self.drawn > 3 * self.n:  # a list of it would grow without end
                    raise OverflowError("drawn for ever")
                yield self.drawn % self.n

    data = tiny_data()
    data.setup("fit")
    n = len(data.train_set)
    endless = Endless(n)
    why = own_sampler(DataLoader(data.train_set, batch_size=4, sampler=endless))
    assert "Endless" in why and f"more than the dataset's {n} samples, or never ends" in why
    assert endless.drawn == n + 1  # one past a permutation, then it stopped

    class EndlessData(type(data)):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_set, batch_size=4, sampler=Endless(len(self.train_set)))

    with pytest.raises(ValueError, match="Curriculum: .*own Endless .*never ends"):
        fit(tmp_path, [Curriculum("entropy")], data=EndlessData(**data.hparams), max_steps=1)


def test_an_iterable_dataset_is_refused_naming_what_is_allowed(tmp_path) -> None:
    """Issue 37: an iterable-style dataset gave a raw ``TypeError`` (``len()`` of it) at fit
    start; it is refused with what a curriculum needs."""
    from torch.utils.data import IterableDataset

    from lightning_efficient.techniques.curriculum.sampler import own_sampler

    data = tiny_data()
    data.setup("fit")

    class Stream(IterableDataset):
        def __init__(self, samples) -> None:
            self.samples = samples

        def __iter__(self):
            return iter(self.samples)

    with pytest.raises(ValueError, match="iterable-style dataset \\(Stream\\).*map-style"):
        own_sampler(DataLoader(Stream(data.train_set), batch_size=4))

    class StreamData(type(data)):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Stream(self.train_set), batch_size=4)

    streamed = StreamData(**data.hparams)
    with pytest.raises(ValueError, match="Curriculum: .*iterable-style dataset \\(Stream\\)"):
        fit(tmp_path, [Curriculum("entropy")], data=streamed, max_steps=1)
    assert "train_dataloader" not in vars(streamed)  # the datamodule as given
