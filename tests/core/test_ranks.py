"""How figures of several ranks read (core/ranks.py): pure functions, no process group."""

from __future__ import annotations

import pytest

from lightning_efficient.core.ranks import (
    agree,
    annotate,
    distributed_world,
    spread_dict,
    spread_kind,
    spread_of,
)
from lightning_efficient.core.report import format_figure

KIB = 1024


def test_spread_skips_non_numbers_and_names_the_worst_rank() -> None:
    s = spread_of([790 * KIB, 803 * KIB, None, "n/a", True])
    assert (s.low, s.high, s.low_rank, s.high_rank, s.ranks) == (790 * KIB, 803 * KIB, 0, 1, 2)
    assert not s.equal
    tie = spread_of([5, 7, 7])
    assert tie.high_rank == 1 and tie.low_rank == 0  # a tie names the lowest rank
    assert spread_of([None, "x"]) is None and spread_of([]) is None
    assert spread_of([3, 3]).equal


def test_kinds_and_agreement() -> None:
    assert spread_kind("peak_bytes") == "worst" and spread_kind("step_s") == "slowest"
    assert spread_kind("samples_per_sec") is None and spread_kind("mfu") is None
    assert spread_kind("stopped_step", ("stopped_step",)) == "agree"
    assert spread_kind("peak_bytes", ("peak_bytes",)) == "agree"  # a declared decision wins
    assert agree([13, 13, 13]) and not agree([13, 14]) and not agree([13, None])
    assert agree([None, None])


def test_annotations_read_as_documented() -> None:
    def read(name, values, decisions=()):
        return annotate(name, values, format_figure, decisions)

    assert read("peak_bytes", [790 * KIB, 803 * KIB]) == (
        "803.00 KiB (worst rank 1; ranks 790.00-803.00 KiB)"
    )
    assert read("peak_bytes", [2 * 2**20, 512 * KIB]) == (
        "2.00 MiB (worst rank 0; ranks 512.00 KiB-2.00 MiB)"
    )
    assert read("step_s", [0.118, 0.123]) == "0.123 s (slowest rank 1; ranks 0.118-0.123 s)"
    assert read("stopped_step", [13, 13], ("stopped_step",)) == "13 (same on 2 ranks)"
    assert read("stopped_step", [13, 14, None], ("stopped_step",)) == (
        "13 (ranks differ: 13, 14, -)"
    )
    assert read("stopped_step", [None, 7], ("stopped_step",)) == "- (ranks differ: -, 7)"
    # nothing to add: equal sizes, figures whose ranks are not compared, one rank
    assert read("peak_bytes", [100, 100]) is None
    assert read("samples_per_sec", [10.0, 12.0]) is None
    assert read("peak_bytes", [100]) is None


def test_spread_as_data() -> None:
    assert spread_dict("peak_bytes", [1, 3]) == {"min": 1.0, "max": 3.0, "worst_rank": 1}
    assert spread_dict("step_s", [0.2, 0.1]) == {"min": 0.1, "max": 0.2, "slowest_rank": 0}
    assert spread_dict("trips", [0, 0], ("trips",)) == {"same": True, "values": [0, 0]}
    assert spread_dict("mfu", [0.1, 0.2]) is None


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_collective_without_a_process_group(world_size: int) -> None:
    # (a 1-process FullyShardedStrategy fit earlier in this process may leave a group of 1)
    class Trainer:
        pass

    trainer = Trainer()
    trainer.world_size = world_size
    assert distributed_world(trainer) == 1
    assert distributed_world(None) == 1  # no trainer (a report shown by hand): never gathers
