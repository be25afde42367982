import time

import pytest

from lightning_efficient.measure.speed.timing import StepTimer, time_fn


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


class _Event:
    """A stand-in for a CUDA event: completed or not, and its time in ms."""

    def __init__(self, ms: float, done: bool) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Event") -> float:
        return end.ms - self.ms

    def synchronize(self) -> None:
        raise AssertionError("poll() must not wait for the device")


def test_poll_folds_completed_events_without_waiting() -> None:
    """What the profiler calls every 256 batches on CUDA: the regions whose end event has
    completed are added to the totals; the rest stay pending; nothing synchronises."""
    timer = StepTimer("cpu")
    timer._pending = [
        ("forward", _Event(0.0, True), _Event(2.0, True)),
        ("backward", _Event(2.0, True), _Event(6.0, True)),
        ("optimizer", _Event(6.0, True), _Event(7.0, False)),  # still running on the device
        ("rest", _Event(7.0, False), _Event(8.0, True)),  # after one still running: kept
    ]
    timer.poll()
    assert timer._totals == {"forward": 0.002, "backward": 0.004}
    assert [r for r, _, _ in timer._pending] == ["optimizer", "rest"]
    timer._pending = []
    timer.poll()  # nothing pending: nothing to do (and on a CPU there never is)
    assert timer.totals() == {"forward": 0.002, "backward": 0.004}
