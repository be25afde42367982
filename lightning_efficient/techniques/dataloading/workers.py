"""How many worker processes a DataLoader needs: measured, not guessed.

``tune_num_workers`` times steady-state batches/s of the loader for each worker count and keeps
the fastest; global RNG states and a stateful sampler's position are restored afterwards, so
measuring does not change what training sees.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_efficient.core.validate import check_float, check_int
from lightning_efficient.measure.timing import StepTimer
from lightning_efficient.techniques.dataloading.rebuild import (
    _check_num_workers,
    auto_num_workers,
    rebuild_dataloader,
)

__all__ = ["TuneResult", "tune_num_workers"]


@dataclass
class TuneResult:
    """What ``tune_num_workers`` measured: steady-state batches/s per worker count."""

    best: int
    batches_per_s: dict[int, float]
    batches: dict[int, int]
    measured_s: float
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = ["| num_workers | batches/s | batches timed |", "|---:|---:|---:|"]
        for w, rate in self.batches_per_s.items():
            mark = " (kept)" if w == self.best else ""
            lines.append(f"| {w}{mark} | {rate:.1f} | {self.batches[w]} |")
        return "\n".join(lines)


def tune_num_workers(
    loader: DataLoader,
    candidates: Sequence[int] | None = None,
    time_cap_s: float = 10.0,
    *,
    max_batches: int = 50,
    tolerance: float = 0.05,
    pin_memory: bool | None = None,
    rank: int = 0,
) -> TuneResult:
    """Measure batches/s of ``loader`` for each worker count and return the fastest.

    Each candidate gets an equal share of ``time_cap_s`` (the first batch, which includes worker
    start-up, is not timed; then up to ``max_batches`` batches). The smallest count within
    ``tolerance`` of the best rate wins (fewer processes for the same speed). The global RNG
    states and a stateful sampler's position are restored afterwards, so tuning does not change
    what training sees. Timing uses the instrument's ``StepTimer``.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    if candidates is None:
        auto = auto_num_workers()
        candidates = sorted({0, 1, auto, 2 * auto})
    if (
        isinstance(candidates, (str, bytes))
        or not isinstance(candidates, Sequence)
        or not candidates
    ):
        raise TypeError(
            f"`candidates` must be a non-empty list of worker counts; got {candidates!r}."
        )
    for c in candidates:
        _check_num_workers("candidates", c, allow_auto=False)
    check_float("time_cap_s", time_cap_s, minimum=0.0)
    if time_cap_s <= 0:
        raise ValueError(f"`time_cap_s` must be > 0 seconds; got {time_cap_s!r}.")
    check_int("max_batches", max_batches, minimum=1)
    check_float("tolerance", tolerance, minimum=0.0, maximum=1.0)

    states = _rng_states()
    sampler_states = _sampler_states(loader)
    share = time_cap_s / len(candidates)
    rates: dict[int, float] = {}
    counts: dict[int, int] = {}
    notes: list[str] = []
    start_all = time.perf_counter()
    try:
        for c in dict.fromkeys(candidates):
            trial = rebuild_dataloader(
                loader, num_workers=c, persistent_workers=False, pin_memory=pin_memory, rank=rank
            )
            timer = StepTimer("cpu")
            deadline = time.perf_counter() + share
            it = iter(trial)
            n = 0
            try:
                next(it)  # worker start-up and the first batch: not steady state
                while n < max_batches and time.perf_counter() < deadline:
                    timer.start("fetch")
                    try:
                        next(it)
                    except StopIteration:
                        timer.stop("fetch")
                        it = iter(trial)
                        continue
                    timer.stop("fetch")
                    n += 1
            except StopIteration:
                pass
            finally:
                del it
            spent = timer.totals().get("fetch", 0.0)
            counts[c] = n
            rates[c] = n / spent if n and spent > 0 else 0.0
            if n < 3:
                notes.append(
                    f"num_workers={c}: only {n} batches fit in {share:.2g} s; its rate is rough"
                )
    finally:
        _restore_rng_states(states)
        _restore_sampler_states(loader, sampler_states)
    top = max(rates.values())
    best = min(c for c, r in rates.items() if r >= (1 - tolerance) * top)
    return TuneResult(best, rates, counts, time.perf_counter() - start_all, notes)


def _rng_states() -> tuple[Any, ...]:
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_state = None
    return torch.get_rng_state(), random.getstate(), np_state


def _restore_rng_states(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if states[2] is not None:
        import numpy as np

        np.random.set_state(states[2])


def _sampler_states(loader: DataLoader) -> list[tuple[Any, Any]]:
    out = []
    for s in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        if (
            s is not None
            and callable(getattr(s, "state_dict", None))
            and callable(getattr(s, "load_state_dict", None))
        ):
            out.append((s, s.state_dict()))
    return out


def _restore_sampler_states(loader: DataLoader, states: list[tuple[Any, Any]]) -> None:
    for sampler, state in states:
        sampler.load_state_dict(state)
