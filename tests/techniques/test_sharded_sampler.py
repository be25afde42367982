"""techniques/_sharded_sampler.py: the one resumable position of the samplers that shard
themselves (LengthBucketSampler, PackedRowSampler, CurriculumSampler). A checkpoint written
before they shared it (state keys ``seed``, ``epoch``, ``position``; the curriculum's
``start_batch`` too) still resumes each of them mid-epoch."""

from __future__ import annotations

import pytest

from lightning_efficient.techniques.curriculum import CurriculumSampler
from lightning_efficient.techniques.dataloading import LengthBucketSampler
from lightning_efficient.techniques.packing import PackedRowSampler

LENGTHS = [(7 * i) % 23 + 1 for i in range(40)]


def _samplers(seed: int = 5) -> dict[str, object]:
    return {
        "buckets": LengthBucketSampler(LENGTHS, 8, seed=seed),
        "packing": PackedRowSampler(LENGTHS, 32, seed=seed),
        "curriculum": CurriculumSampler([float(n) for n in LENGTHS], 4, duration=6, seed=seed),
    }


@pytest.mark.parametrize("name", ["buckets", "packing", "curriculum"])
def test_a_checkpoint_of_the_old_keys_resumes_mid_epoch(name: str) -> None:
    sampler = _samplers()[name]
    sampler.set_epoch(2)
    whole = list(sampler)
    assert sampler.position == 0  # the epoch is out: the next one starts from its beginning
    # as the samplers wrote it before the shared base (the same keys, plain ints)
    old = {"seed": 5, "epoch": 2, "position": 3}
    if name == "curriculum":
        old["start_batch"] = None
    resumed = _samplers()[name]
    resumed.load_state_dict(old)
    assert list(resumed) == whole[3:]
    # and what it writes now is what it wrote then
    it = iter(resumed)
    next(it), next(it)
    assert resumed.state_dict() == {**old, "position": 2}
    # another epoch starts from its beginning; the same epoch keeps the position
    resumed.set_epoch(2)
    assert resumed.position == 2
    resumed.set_epoch(3)
    assert resumed.position == 0 and resumed.state_dict()["epoch"] == 3


def test_the_seed_of_a_checkpoint_decides_the_order() -> None:
    for name in ("buckets", "packing", "curriculum"):
        loaded = _samplers()[name]
        loaded.load_state_dict({"seed": 9, "epoch": 1, "position": 0})
        built = _samplers(seed=9)[name]
        built.set_epoch(1)
        seed_5 = _samplers()[name]
        seed_5.set_epoch(1)
        assert list(loaded) == list(built) != list(seed_5), name
