"""The phase bookkeeping of ``StepProfiler``: which phase of a training step runs now, its time
(``StepTimer``: CUDA events on a GPU, ``perf_counter`` on a CPU), and what the measured steps
held (batches, samples, tokens).

- ``StepPhases``: the phase machine. ``switch(phase)`` stops the running phase and starts the next;
  ``begin``/``end`` open and close the measured window; ``count(batch)`` adds a batch's samples and
  tokens (``measure.speed.tokens.BatchCounter``); ``phases()`` are the seconds per step of each
  phase.
- ``StepPostHooks``: a hook after each optimizer's step (the end of the ``optimizer`` phase),
  registered once per optimizer, each registration a ``Change``.

Its cost per step is what ``StepProfiler`` costs (it is meant to stay on): a clock read (a CUDA
event recorded on a GPU) per phase switch and an O(1) batch count; no device synchronisation
(CUDA events are read when they have completed, ``StepTimer.poll``, and once at the end).

The ``data`` phase begins when the train loader's ``next`` starts, seen through
``measure.speed.fetch_watch.FetchWatch`` (the trainer's profiler, wrapped); a fetch inside a step
(a ``training_step(self, dataloader_iter)``) is ``data`` until it returns, then the step's phase
goes on (``fetch``/``fetched``: ``StepFetch``, as ``InputStallMonitor`` times its wait).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_efficient.core.change import Change
from lightning_efficient.measure.profiling.profile_report import phase_summary
from lightning_efficient.measure.speed.fetch_watch import StepFetch
from lightning_efficient.measure.speed.timing import StepTimer
from lightning_efficient.measure.speed.tokens import BatchCounter

__all__ = ["StepPhases", "StepPostHooks", "STEP_PHASES"]

#: The phases of a training step itself (a fetch made in one of them is the step's own).
STEP_PHASES = ("forward", "backward", "optimizer")


class StepPhases:
    """The phases of the measured training steps, timed, and the batches they ran.

    Args:
        device: the device whose work is timed (CUDA events there, ``perf_counter`` on a CPU).
    """

    def __init__(self, device: torch.device | str | None) -> None:
        self.timer = StepTimer(device)
        self.phase: str | None = None
        self.measuring = False
        self.start_step = self.end_step = 0
        self.counter = BatchCounter()
        self.step_fetch = StepFetch(self.switch_from)

    def switch(self, phase: str | None) -> None:
        """Stop the running phase (if any) and start ``phase`` (``None``: none)."""
        if phase == self.phase:
            return
        if self.phase is not None:
            self.timer.stop(self.phase)
        if phase is not None:
            self.timer.start(phase)
        self.phase = phase

    def switch_from(self, current: str | tuple[str, ...] | None, phase: str) -> None:
        """Switch to ``phase`` while measuring, when the running phase is ``current`` (one of
        them; ``None``: any)."""
        if self.measuring and (
            current is None or self.phase in ((current,) if isinstance(current, str) else current)
        ):
            self.switch(phase)

    def begin(self, step: int, phase: str) -> None:
        """Open the measured window at optimizer step ``step``, in ``phase``."""
        self.measuring, self.start_step = True, step
        self.switch(phase)

    def enter(self, phase: str, step: int, measured: bool) -> None:
        """Switch to ``phase`` while measuring; else open the window there at optimizer step
        ``step`` when that step is ``measured``."""
        if self.measuring:
            self.switch(phase)
        elif measured:
            self.begin(step, phase)

    def fetch(self, step: int, measured: bool) -> None:
        """The train loader's ``next`` starts, before optimizer step ``step`` (``measured``: as
        ``enter``): the ``data`` phase; inside a step (a ``training_step(self, dataloader_iter)``
        fetches its batch itself) until ``fetched``, then the step's phase goes on."""
        if self.phase in STEP_PHASES:
            self.step_fetch.begin(self.phase, "data")
        else:
            self.enter("data", step, measured)

    def fetched(self) -> None:
        """The train loader's ``next`` has returned: back to the step that fetched, if one did."""
        self.step_fetch.end()

    def end(self, step: int) -> None:
        """Close the measured window after optimizer step ``step``."""
        if self.measuring:
            self.switch(None)
            self.measuring, self.end_step = False, step

    def paused(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` outside every phase (it is no part of a step), then go on."""
        phase = self.phase
        self.switch(None)
        try:
            return work()
        finally:
            self.switch(phase)

    def count(self, batch: Any) -> None:
        """Add a measured batch's samples and tokens."""
        counter = self.counter
        counter.add(batch)
        if counter.batches % 256 == 0:
            self.timer.poll()  # fold the CUDA events that have completed (no synchronisation)

    @property
    def batches(self) -> int:
        """Batches in the measured window."""
        return self.counter.batches

    @property
    def samples(self) -> int:
        """Samples in the measured window."""
        return self.counter.samples

    @property
    def tokens(self) -> int | None:
        """Tokens in the measured window; ``None`` once a batch had none."""
        return self.counter.tokens

    @property
    def steps(self) -> int:
        """Optimizer steps in the measured window."""
        return self.end_step - self.start_step

    def phases(self) -> dict[str, float]:
        """Seconds per step of each phase of a training step."""
        return phase_summary(self.timer.totals(), self.steps)

    def seconds(self, phase: str) -> float:
        """Seconds spent in ``phase`` over the window (e.g. ``"validation"``)."""
        return float(self.timer.totals().get(phase, 0.0))


class StepPostHooks:
    """``hook`` as a step post-hook on each optimizer, once per optimizer."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook
        self._hooked: set[int] = set()
        self._last: tuple[int, ...] | None = None  # ids of the optimizers last seen

    def new(self, optimizers: Any) -> list[Change]:
        """Hook the optimizers not hooked yet; their changes (the undo removes the hook)."""
        key = tuple(map(id, optimizers))
        if key == self._last:  # the same optimizers as last step: nothing new to hook
            return []
        self._last, changes = key, []
        for opt in optimizers:
            opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer's own
            if id(opt) not in self._hooked and hasattr(opt, "register_step_post_hook"):
                self._hooked.add(id(opt))
                handle = opt.register_step_post_hook(self.hook)
                changes.append(Change("optimizer step post-hook", handle.remove))
        return changes
