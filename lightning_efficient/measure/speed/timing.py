"""Step timing: CUDA events on a GPU, ``time.perf_counter`` on a CPU; synchronises only when read
(``totals``; ``poll`` folds the completed events without waiting).

``StepTimer`` times named regions (``"data"``, ``"forward"``, ...) and accumulates their totals.
On CUDA it records events and reads them only in ``totals()`` (one synchronisation), so timing a
sampled step costs nothing on the others. ``time_once`` is the seconds of one call, ``time_fn``
the median of several; ``StepTimes`` times a fit's first steps one by one and keeps apart those
something disturbed (a compile): the first step and the steady step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_efficient.core.validate import check_int

__all__ = ["StepTimer", "StepTimes", "time_fn", "time_once"]


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as err:
            raise ValueError(
                f"`device` must be a torch device such as 'cpu' or 'cuda:0'; got {device!r}."
            ) from err
    if isinstance(device, torch.device):
        return device
    raise TypeError(
        f"`device` must be a torch.device, a string or None; got {device!r} ({type(device).__name__})."
    )


class StepTimer:
    """Region timing: CUDA events on GPU, ``time.perf_counter`` on CPU; syncs only when read.

    Args:
        device: The device whose work is timed. ``None``: the current CUDA device if there is
            one, else the CPU. On CUDA, ``start``/``stop`` record events on the current stream.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = _as_device(device)
        self._cuda = self.device.type == "cuda"
        self._open: dict[str, Any] = {}
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA (region, start, end) not yet read
        self._totals: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def start(self, region: str) -> None:
        if region in self._open:
            raise RuntimeError(f"StepTimer: region {region!r} was started twice without stop().")
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[region] = event
        else:
            self._open[region] = time.perf_counter()

    def stop(self, region: str) -> None:
        if region not in self._open:
            raise RuntimeError(f"StepTimer: stop({region!r}) without start({region!r}).")
        begin = self._open.pop(region)
        self._counts[region] = self._counts.get(region, 0) + 1
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((region, begin, end))
        else:
            self._totals[region] = self._totals.get(region, 0.0) + time.perf_counter() - begin

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """``with timer.region("data"): ...`` times the block."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def poll(self) -> None:
        """Fold the CUDA regions whose events have completed into the totals, without waiting
        (``Event.query``); a long run keeps few events pending, and nothing synchronises."""
        done = 0
        for _, _, end in self._pending:
            if not end.query():
                break
            done += 1
        for region, begin, end in self._pending[:done]:
            self._totals[region] = self._totals.get(region, 0.0) + begin.elapsed_time(end) / 1000.0
        del self._pending[:done]

    def totals(self) -> dict[str, float]:
        """Seconds per region since the last reset (synchronises CUDA once, if events are pending)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for region, begin, end in self._pending:
                self._totals[region] = (
                    self._totals.get(region, 0.0) + begin.elapsed_time(end) / 1000.0
                )
            self._pending.clear()
        return dict(self._totals)

    def counts(self) -> dict[str, int]:
        """How many times each region was stopped since the last reset."""
        return dict(self._counts)

    def reset(self) -> None:
        self._open.clear()
        self._pending.clear()
        self._totals.clear()
        self._counts.clear()


def time_once(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Seconds of one call of ``fn()`` (CUDA-synchronised before and after)."""
    dev = _as_device(device)
    timer = StepTimer(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    with timer.region("call"):
        fn()
    return timer.totals()["call"]


class StepTimes:
    """The first ``limit`` steps of a fit timed one by one (``start()`` / ``stop()`` around
    each); a step during which ``disturbed()`` changed (e.g. Dynamo's compile count) is not
    steady. ``figures()``: ``first_step_s`` and ``steady_step_s`` (the median of the steady
    steps), once a step was timed.

    Args:
        device: The device whose work is timed (as :class:`StepTimer`).
        disturbed: ``disturbed() -> int``, a count that grows when something other than the step
            ran during it (default: nothing ever does).
        limit: Steps timed; later ones cost nothing.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        disturbed: Callable[[], int] | None = None,
        limit: int = 64,
    ) -> None:
        self._timer = StepTimer(device)
        self._disturbed = disturbed or (lambda: 0)
        self.limit = check_int("limit", limit, minimum=1)
        self.steps = 0
        self._calm: list[bool] = []
        self._before = 0

    def start(self) -> None:
        if self.steps < self.limit:
            self._before = self._disturbed()
            self._timer.start(f"step{self.steps}")

    def stop(self) -> None:
        if self.steps < self.limit:
            self._timer.stop(f"step{self.steps}")
            self._calm.append(self._disturbed() == self._before)
            self.steps += 1

    def figures(self) -> dict[str, float]:
        if not self.steps:
            return {}
        totals = self._timer.totals()
        times = [totals.get(f"step{i}", 0.0) for i in range(self.steps)]
        out = {"first_step_s": times[0]}
        steady = [t for t, calm in zip(times, self._calm) if calm]
        if steady:
            out["steady_step_s"] = statistics.median(steady)
        return out


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 1,
    repeats: int = 3,
    device: torch.device | str | None = None,
) -> float:
    """Median seconds per call of ``fn()`` after ``warmup`` untimed calls (CUDA-synchronised)."""
    if not callable(fn):
        raise TypeError(f"`fn` must be callable; got {fn!r} ({type(fn).__name__}).")
    check_int("warmup", warmup, minimum=0)
    check_int("repeats", repeats, minimum=1)
    dev = _as_device(device)
    for _ in range(warmup):
        fn()
    return statistics.median([time_once(fn, dev) for _ in range(repeats)])
