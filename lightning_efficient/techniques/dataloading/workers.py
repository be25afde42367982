"""How many worker processes a DataLoader needs: measured, not guessed.

``tune_num_workers`` times steady-state batches/s of the loader for worker counts 0, 1, 2, 4, ...
(doubling) while the rate keeps improving, bounded by host memory (the measured private memory
of a worker times the count), by ``max_workers`` and by the rate at which training can consume
batches (``target_batches_per_s``: loading faster than the step gains nothing). Waiting loads
(storage, network, decoding that releases the GIL) gain from more workers than cores; CPU-bound
ones stop gaining at the core count, and the search stops there.

What training sees is kept: ``kept_training_state(loader)`` restores the global RNG states, the
loader's and its samplers' generators and a stateful sampler's position afterwards.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_efficient.core.validate import (
    check_float,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.speed.host import (
    available_bytes,
    child_pids,
    default_max_workers,
    private_bytes,
)
from lightning_efficient.measure.speed.timing import StepTimer
from lightning_efficient.techniques.dataloading.rebuild import (
    _check_num_workers,
    rebuild_dataloader,
)

__all__ = ["TuneResult", "default_max_workers", "kept_training_state", "tune_num_workers"]

_MIN_TIMED = 3  # batches timed per worker count, even past its share of the time


@dataclass
class TuneResult:
    """What ``tune_num_workers`` measured: steady-state batches/s per worker count.

    ``target_batches_per_s`` is the rate training can consume (None: unknown); ``in_training``
    the rate each count is expected to give there: with 0 workers loading and the step take
    turns (``1 / (1/rate + 1/target)``), with workers they overlap (``min(rate, target)``).
    ``stopped`` says why the search ended; ``worker_bytes`` is the largest private memory of one
    worker measured.
    """

    best: int
    batches_per_s: dict[int, float]
    batches: dict[int, int]
    measured_s: float
    notes: list[str] = field(default_factory=list)
    target_batches_per_s: float | None = None
    stopped: str = ""
    worker_bytes: int | None = None

    def in_training(self, workers: int) -> float:
        """Expected batches/s of training with ``workers`` workers (see the class docstring)."""
        rate, target = self.batches_per_s[workers], self.target_batches_per_s
        if target is None or rate <= 0:
            return rate
        return 1.0 / (1.0 / rate + 1.0 / target) if workers == 0 else min(rate, target)

    def table(self) -> str:
        lines = [
            "| num_workers | batches/s | batches timed | in training (expected) |",
            "|---:|---:|---:|---:|",
        ]
        for w, rate in self.batches_per_s.items():
            mark = " (kept)" if w == self.best else ""
            lines.append(
                f"| {w}{mark} | {rate:.1f} | {self.batches[w]} | {self.in_training(w):.1f} |"
            )
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
    max_workers: int | None = None,
    target_batches_per_s: float | None = None,
    max_worker_bytes: int | str | None = None,
) -> TuneResult:
    """Measure batches/s of ``loader`` per worker count and return the count to train with.

    ``candidates=None`` searches 0, 1, 2, 4, ... up to ``max_workers`` (``None``:
    ``default_max_workers()``) and stops early when two counts in a row are not ``tolerance``
    faster than the best smaller one, when loading reaches ``target_batches_per_s``, or when twice the workers
    would need more than ``max_worker_bytes`` of host memory (``None``: half of the memory
    available now; the private memory of the measured workers is the per-worker cost). A list
    of ``candidates`` measures exactly those counts.

    Each count gets an equal share of the time left of ``time_cap_s`` (start-up included; at
    least 3 batches are timed while the cap allows; the search stops when the cap is spent).
    Its worker start-up and first round of batches (one per worker, which arrive together) are
    not timed; then up to ``max_batches`` batches, across epochs, with persistent workers as
    training uses them. The kept count is
    the smallest whose expected training rate (``TuneResult.in_training``) is within
    ``tolerance`` of the best: fewer processes for the same speed. The global RNG states, the
    loader's generators and a stateful sampler's position are restored afterwards, so tuning
    does not change what training sees. Timing uses the instrument's ``StepTimer``.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"`loader` must be a torch DataLoader; got {type(loader).__name__}.")
    check_int("max_workers", max_workers, minimum=1, allow_none=True)
    limit = default_max_workers() if max_workers is None else max_workers
    search = candidates is None
    if search:
        candidates = [0] + [2**k for k in range(limit.bit_length()) if 2**k <= limit]
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
    check_float("target_batches_per_s", target_batches_per_s, minimum=0.0, allow_none=True)
    budget = parse_bytes("max_worker_bytes", max_worker_bytes, allow_none=True)
    if budget is None:
        free = available_bytes()
        budget = free // 2 if free is not None else None

    result = TuneResult(0, {}, {}, 0.0, target_batches_per_s=target_batches_per_s)
    start_all = time.perf_counter()
    cap = start_all + time_cap_s
    with kept_training_state(loader), warnings.catch_warnings():
        # torch warns of more workers than cores: finding out whether they help is the point
        warnings.filterwarnings("ignore", ".*worker processes in total", UserWarning)
        todo = list(dict.fromkeys(candidates))
        misses, previous = 0, 0
        for k, c in enumerate(todo):
            if time.perf_counter() >= cap:
                result.stopped = f"tune_time_s={time_cap_s:g} spent before {c} workers"
                break
            share = (cap - time.perf_counter()) / (len(todo) - k)
            need = c * (result.worker_bytes or 0)
            if search and budget is not None and need > budget:
                result.stopped = (
                    f"memory: {c} workers would hold about {format_bytes(need)} "
                    f"(max_worker_bytes {format_bytes(budget)})"
                )
                break
            earlier = [r for w, r in result.batches_per_s.items() if w > 0]
            rate, n, worker_bytes = _measure(loader, c, share, cap, max_batches, pin_memory, rank)
            result.batches_per_s[c], result.batches[c] = rate, n
            if worker_bytes is not None:
                result.worker_bytes = max(worker_bytes, result.worker_bytes or 0)
            if n < _MIN_TIMED:
                result.notes.append(
                    f"num_workers={c}: only {n} batches fit in {share:.2g} s; its rate is rough"
                )
            if not search or c == 0:
                continue
            if n == 0:  # not measured: leave it out
                del result.batches_per_s[c], result.batches[c]
                result.stopped = f"tune_time_s={time_cap_s:g} spent starting {c} workers"
                break
            if target_batches_per_s is not None and rate >= target_batches_per_s:
                result.stopped = (
                    f"{c} workers load {rate:.1f} batches/s, as fast as training consumes them "
                    f"({target_batches_per_s:.1f}/s)"
                )
                break
            if earlier and rate < (1 + tolerance) * max(earlier):
                misses += 1  # one more count is tried: a single slow reading may be noise
                if misses == 2:
                    result.stopped = f"{previous} and {c} workers were not faster than fewer"
                    break
            else:
                misses = 0
            previous = c
        else:
            if search:
                result.stopped = f"reached max_workers={limit}"
    result.measured_s = time.perf_counter() - start_all
    expected = {w: result.in_training(w) for w in result.batches_per_s}
    top = max(expected.values())
    result.best = min(w for w, r in expected.items() if r >= (1 - tolerance) * top)
    return result


def _measure(
    loader: DataLoader,
    workers: int,
    share_s: float,
    cap: float,
    max_batches: int,
    pin_memory: bool | None,
    rank: int,
) -> tuple[float, int, int | None]:
    """(batches/s, batches timed, largest private bytes of one worker) with ``workers``.

    Runs ``share_s`` seconds, start-up included, and longer if needed to time ``_MIN_TIMED``
    batches, but never past ``cap`` (a ``perf_counter`` time)."""
    before = child_pids()
    trial = rebuild_dataloader(
        loader,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=pin_memory,
        rank=rank,
    )
    deadline = time.perf_counter() + share_s
    timer = StepTimer("cpu")
    n, untimed, timing, fetched = 0, max(1, workers), False, 0
    it = iter(trial)
    try:
        while n < max_batches and (now := time.perf_counter()) < cap:
            if now >= deadline and n >= _MIN_TIMED:
                break
            try:
                next(it)
            except StopIteration:
                if not fetched:  # an empty epoch
                    break
                fetched, it = 0, iter(trial)  # the epoch boundary is timed, as in training
                continue
            fetched += 1
            if untimed:
                untimed -= 1
                if not untimed:
                    timer.start("fetch")  # steady state: every worker has delivered once
                    timing = True
                continue
            n += 1
        worker_bytes = None
        if workers:
            sizes = [private_bytes(p) for p in child_pids() - before]
            worker_bytes = max((s for s in sizes if s is not None), default=None)
    finally:
        if timing:
            timer.stop("fetch")
        del it, trial  # persistent workers exit with their loader
    spent = timer.totals().get("fetch", 0.0)
    return (n / spent if n and spent > 0 else 0.0), n, worker_bytes


@contextlib.contextmanager
def kept_training_state(loader: DataLoader) -> Iterator[None]:
    """Whatever runs inside may draw from ``loader`` and from the random generators: on exit the
    global RNG states (torch, CUDA when initialised, ``random``, numpy), the generators of the
    loader and its samplers, and a stateful sampler's position are as they were."""
    samplers = [
        s
        for s in (
            loader.sampler,
            loader.batch_sampler,
            getattr(loader.batch_sampler, "sampler", None),
        )
        if s is not None
    ]
    generators = {
        id(g): g
        for g in [loader.generator, *(getattr(s, "generator", None) for s in samplers)]
        if isinstance(g, torch.Generator)
    }
    saved_generators = [(g, g.get_state()) for g in generators.values()]
    saved_samplers = [
        (s, s.state_dict())
        for s in samplers
        if callable(getattr(s, "state_dict", None))
        and callable(getattr(s, "load_state_dict", None))
    ]
    py_state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch here
        np, np_state = None, None
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
        for g, state in saved_generators:
            g.set_state(state)
        for s, state in saved_samplers:
            s.load_state_dict(state)
