"""measure/memory/caching_allocator.py: the CUDA caching allocator's algorithm replayed on a log of
allocations (pools, segment sizes, best fit, splitting, merging, releasing the cache at a cap)."""

from __future__ import annotations

from lightning_efficient.measure.memory.caching_allocator import replay, round_request

MiB = 2**20


def _log(*steps: tuple[str, int, int]) -> list[tuple[str, int, int]]:
    """``("a", +1, size)`` allocates under the key "a", ``("a", -1, 0)`` frees it."""
    return list(steps)


def test_requests_round_to_512_bytes() -> None:
    assert [round_request(n) for n in (1, 512, 513, 10**6)] == [512, 512, 1024, 1000448]


def test_pools_and_segment_sizes() -> None:
    # small requests share one 2 MiB segment
    r = replay(_log(("a", 1, 1000), ("b", 1, 4000), ("c", 1, MiB)))
    assert (r.segments, r.reserved_peak, r.allocated_peak) == (1, 2 * MiB, 1024 + 4096 + MiB)
    # above 1 MiB: a 20 MiB large-pool segment; from 10 MiB: a segment of its own (2 MiB steps)
    assert replay(_log(("a", 1, MiB + 1))).reserved_peak == 20 * MiB
    assert replay(_log(("b", 1, 12 * MiB + 5))).reserved_peak == 14 * MiB
    # what is left of a segment serves the next request that fits in it
    r = replay(_log(("a", 1, MiB + 1), ("b", 1, 12 * MiB + 5)))
    assert r.segments == 1 and r.reserved_peak == 20 * MiB
    # a block is split only when more than 1 MiB would be left: 13 MiB takes its 14 MiB segment
    r = replay(_log(("a", 1, 13 * MiB)))
    assert r.allocated_peak == 14 * MiB


def test_freed_blocks_are_cached_and_reused_best_fit() -> None:
    r = replay(
        _log(
            ("a", 1, 12 * MiB),
            ("b", 1, 16 * MiB),
            ("a", -1, 0),
            ("b", -1, 0),
            ("c", 1, 12 * MiB),  # the 12 MiB block fits exactly: no new segment
        )
    )
    assert r.segments == 2 and r.reserved_peak == 28 * MiB and r.allocated_peak == 28 * MiB


def test_fragmentation_reserves_more_than_is_allocated() -> None:
    # a freed 12 MiB block cannot serve 14 MiB: a new segment while 12 MiB sit idle
    r = replay(_log(("a", 1, 12 * MiB), ("b", 1, 12 * MiB), ("a", -1, 0), ("c", 1, 14 * MiB)))
    assert r.allocated_peak == 26 * MiB
    assert r.reserved_peak == 38 * MiB


def test_free_neighbours_merge() -> None:
    # three blocks cut from one 20 MiB segment, freed: one block again, serving 6 MiB
    r = replay(
        _log(
            ("a", 1, 2 * MiB),
            ("b", 1, 2 * MiB),
            ("c", 1, 2 * MiB),
            ("b", -1, 0),
            ("a", -1, 0),
            ("c", -1, 0),
            ("d", 1, 6 * MiB),
        )
    )
    assert r.segments == 1 and r.reserved_peak == 20 * MiB


def test_a_cap_releases_the_cache_before_running_out_of_memory() -> None:
    log = _log(("a", 1, 12 * MiB), ("a", -1, 0), ("b", 1, 14 * MiB))
    assert replay(log).reserved_peak == 26 * MiB  # without a cap the cached 12 MiB stay
    capped = replay(log, cap=20 * MiB)
    assert not capped.out_of_memory and capped.reserved_peak == 14 * MiB
    # 12 MiB still allocated: nothing to release, so 14 more pass the cap
    held = replay(_log(("a", 1, 12 * MiB), ("b", 1, 14 * MiB)), cap=20 * MiB)
    assert held.out_of_memory and held.reserved_peak == 12 * MiB


def test_a_segment_made_after_a_release_is_a_segment_of_its_own() -> None:
    """Segments released at the cap must not hand their number to a new one: a segment opened
    after a release once took the number of one still in use, and releasing both later raised
    KeyError (found by the planner's ladder with ChunkedCrossEntropy on GPT-2 at 8 GiB)."""
    log = _log(
        ("a", 1, 100 * MiB),
        ("b", 1, 100 * MiB),
        ("c", 1, 100 * MiB),
        ("b", -1, 0),  # cached: its segment is released when d would pass the cap
        ("d", 1, 150 * MiB),
        ("c", -1, 0),
        ("d", -1, 0),
        ("e", 1, 300 * MiB),  # releases c's and d's segments, then fits under the cap
    )
    capped = replay(log, cap=400 * MiB)
    assert not capped.out_of_memory and capped.reserved_peak == 400 * MiB
    assert capped.segments == 5
