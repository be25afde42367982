"""The largest micro-batch that really trains under a memory cap, found by real steps.

Standard library only (``benchmarks/gpu/suite.py`` part 3 drives it; the tests run it against a
made-up device). A ``LargestSearch`` proposes sizes, a round at a time (the sizes of one round
run side by side, each in its own process with its own cap), and is told how each run ended:
``ok`` (the steps ran; with the peak bytes) or ``oom`` (out of memory). Memory grows with the
micro-batch, so the answer is the ``n`` with ``n`` ok and ``n + 1`` out of memory.

Rounds, from the estimate's pick (the largest size whose *estimate* fits the cap):

1. The pick and sizes around it, above and below (x2, /2, x4, ...): the estimate may be wrong in
   either direction (on CUDA today it is about 2x too high without checkpointing).
2. Once the runs that fit give a line (two peaks, or one peak and the estimate's slope), the size
   where that line meets the cap, and its neighbours: usually the answer in one round.
3. Otherwise, or if the line was wrong: keep doubling (no OOM yet) or halving (nothing ran yet),
   then bisect the interval between the largest ok and the smallest OOM, ``k`` points a round.

Sizes never leave ``[1, top]``; a size is never run twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LargestSearch", "Probe"]


@dataclass
class Probe:
    """One real run: its micro-batch and how it ended (``ok``, ``oom`` or ``error: ...``),
    with the peaks it measured (allocated; reserved on CUDA) and its wall time."""

    batch: int
    status: str
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    wall_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LargestSearch:
    """The largest micro-batch in ``[1, top]`` that trains under ``cap_bytes``.

    ``pick`` is the estimate's answer; ``estimate`` (optional) maps sizes to estimated peak bytes
    (the estimate's own search gives a few), used for a slope while only one run has fitted.
    """

    name: str
    pick: int
    top: int
    cap_bytes: int
    estimate: dict[int, float] = field(default_factory=dict)
    probes: list[Probe] = field(default_factory=list)
    error: str | None = None

    # -- what is known -------------------------------------------------------------------------
    @property
    def lo(self) -> int:
        """The largest size that ran (0: none)."""
        return max((p.batch for p in self.probes if p.status == "ok"), default=0)

    @property
    def hi(self) -> int:
        """The smallest size above ``lo`` that ran out of memory (``top + 1``: none)."""
        lo = self.lo
        return min(
            (p.batch for p in self.probes if p.status == "oom" and p.batch > lo),
            default=self.top + 1,
        )

    @property
    def done(self) -> bool:
        return self.error is not None or self.hi - self.lo <= 1

    @property
    def consistent(self) -> bool:
        """False when a size ran out of memory below one that ran (a flaky device)."""
        return not any(p.status == "oom" and p.batch < self.lo for p in self.probes)

    def tried(self, n: int) -> bool:
        return any(p.batch == n for p in self.probes)

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.status not in ("ok", "oom") and self.error is None:
            self.error = f"batch {probe.batch}: {probe.status}"

    # -- what to run next ----------------------------------------------------------------------
    def predicted(self) -> int | None:
        """Where the line through the runs that fitted meets the cap (None: no line yet)."""
        fitted = sorted(
            {
                p.batch: (p.reserved_bytes or p.peak_bytes) for p in self.probes if p.status == "ok"
            }.items()
        )
        fitted = [(n, b) for n, b in fitted if b]
        if len(fitted) >= 2:
            (n0, b0), (n1, b1) = fitted[0], fitted[-1]
            slope = (b1 - b0) / (n1 - n0)
        elif len(fitted) == 1 and len(self.estimate) >= 2:
            # one run: the estimate's slope, scaled by how far the estimate was off at that run
            (n0, b0) = fitted[0]
            sizes = sorted(self.estimate)
            e_lo, e_hi = sizes[0], sizes[-1]
            e_slope = (self.estimate[e_hi] - self.estimate[e_lo]) / max(1, e_hi - e_lo)
            at_n0 = self.estimate[e_lo] + e_slope * (n0 - e_lo)
            slope = e_slope * (b0 / at_n0) if at_n0 > 0 else 0.0
        else:
            return None
        if not slope > 0 or not math.isfinite(slope):
            return None
        return n0 + int((self.cap_bytes - b0) // slope)

    def next_sizes(self, k: int) -> list[int]:
        """Up to ``k`` sizes for the next round (empty once done)."""
        if self.done or k < 1:
            return []
        lo, hi = self.lo, self.hi
        inside = [n for n in range(lo + 1, hi) if not self.tried(n)]
        if not inside:
            return []
        if not self.probes:
            factors = [1, 2, 0.5, 4, 0.25, 8]
            want = [max(1, min(self.top, round(self.pick * f))) for f in factors]
        else:
            want = []
            guess = self.predicted()
            if guess is not None and lo <= guess < hi:
                # the prediction and its neighbours, nearest first: n ok and n + 1 OOM settles it
                want = [guess + d for d in (0, 1, -1, 2, -2, 3)]
            if hi > self.top:  # nothing ran out of memory yet: grow
                want += [lo * 2**i for i in range(1, 8)]
            elif lo == 0:  # nothing ran yet: shrink
                want += [max(1, hi // 2**i) for i in range(1, 8)]
            else:  # bisect (lo, hi) into k + 1 parts
                want += [lo + round((hi - lo) * i / (k + 1)) for i in range(1, k + 1)]
            want = [min(self.top, max(1, n)) for n in want]
        out: list[int] = []
        for n in want:
            if lo < n < hi and not self.tried(n) and n not in out:
                out.append(n)
            if len(out) == k:
                break
        if not out:  # every proposal was tried or outside: the middle of the interval
            out = [inside[len(inside) // 2]]
        return sorted(out)

    # -- the answer ----------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """The row's fields: the largest size that ran, whether it is settled, every probe."""
        at_pick = next((p for p in self.probes if p.batch == self.pick), None)
        best = next((p for p in self.probes if p.batch == self.lo and p.status == "ok"), None)
        return {
            "largest_real": self.lo,
            "smallest_oom": self.hi if self.hi <= self.top else None,
            "resolved": self.error is None and self.hi - self.lo <= 1,
            "at_top": self.lo == self.top,
            "consistent": self.consistent,
            "pick_status": at_pick.status if at_pick else None,
            "pick_measured_bytes": at_pick.peak_bytes if at_pick else None,
            "pick_reserved_bytes": at_pick.reserved_bytes if at_pick else None,
            "largest_measured_bytes": best.peak_bytes if best else None,
            "largest_reserved_bytes": best.reserved_bytes if best else None,
            "probes": [p.as_dict() for p in sorted(self.probes, key=lambda p: p.batch)],
            "error": self.error,
        }
