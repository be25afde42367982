import time

import pytest

from lightning_efficient.measure.timing import StepTimer, time_fn


def test_regions_accumulate_wall_clock() -> None:
    timer = StepTimer("cpu")
    for _ in range(2):
        with timer.region("sleep"):
            time.sleep(0.02)
    timer.start("short")
    timer.stop("short")
    totals = timer.totals()
    assert 0.035 < totals["sleep"] < 1.0
    assert totals["short"] < totals["sleep"]
    assert timer.counts() == {"sleep": 2, "short": 1}
    timer.reset()
    assert timer.totals() == {}


def test_misuse_is_reported() -> None:
    timer = StepTimer("cpu")
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop("x")
    timer.start("x")
    with pytest.raises(RuntimeError, match="twice"):
        timer.start("x")
    with pytest.raises(ValueError, match="device"):
        StepTimer("not-a-device")


def test_time_fn_is_median_of_repeats() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.01)

    seconds = time_fn(fn, warmup=2, repeats=3, device="cpu")
    assert len(calls) == 5
    assert 0.009 < seconds < 0.5
    with pytest.raises(ValueError, match="repeats"):
        time_fn(fn, repeats=0)
