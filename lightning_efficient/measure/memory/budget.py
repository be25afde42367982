"""A training step against a memory budget: the one sizing engine under the planner,
AutoEfficient and EfficientBatchSize.

- :func:`largest_within`: the largest of a given list of micro-batch sizes whose bytes fit a
  budget (a line through two estimates, then a bracket that closes by interpolation and
  bisection). The only search of a micro-batch against a budget in the package
  (``tests/test_layers.py`` says so).
- :func:`step_within`: the estimate of one step at a micro-batch with an accumulation, judged
  against a budget less a margin (the margin applied here, once): ``(fits, bytes, estimate)``.
- :func:`usable_bytes`: a budget less a margin; :func:`compared_bytes`: a step's bytes as
  :func:`largest_within` compares them (a step that does not fit is over the budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from lightning_efficient.core.validate import check_float, check_int
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.types import MemoryEstimate

__all__ = ["compared_bytes", "largest_within", "step_within", "usable_bytes"]


def usable_bytes(budget_bytes: int, margin: float = 0.0) -> int:
    """``budget_bytes`` less a ``margin`` (a fraction in [0, 0.9)) kept free."""
    margin = check_float("margin", margin, minimum=0.0, maximum=0.9, max_exclusive=True)
    return int(budget_bytes * (1 - margin))


def step_within(
    model: Any,
    batch: Any,
    budget_bytes: int,
    *,
    accumulation: int = 1,
    margin: float = 0.0,
    **settings: Any,
) -> tuple[bool, float, MemoryEstimate]:
    """The estimate of a step of ``model`` on ``batch`` (its micro-batch) with ``accumulation``
    micro-batches per optimizer step (2 stands for any more: the gradients stay live through the
    next forward), judged against ``budget_bytes`` less ``margin``.

    Returns ``(fits, bytes, estimate)``: ``fits`` is the estimate's own verdict (on a CUDA
    target its allocations replayed under the cap); ``bytes`` what must fit (the reserved peak
    on a CUDA target, else the peak). ``settings``: :func:`estimate_memory`'s other keywords."""
    accumulation = check_int("accumulation", accumulation, minimum=1)
    usable = usable_bytes(budget_bytes, margin)
    est = estimate_memory(model, batch, **{**settings, "accumulate_grad_batches": accumulation})
    return est.fits(usable), float(est.required_bytes), est


def compared_bytes(fits: bool, used: float, budget_bytes: float) -> float:
    """What :func:`largest_within` compares with the budget for a step that ``fits`` (or not)
    and needs ``used`` bytes: ``used``, or just over the budget where a step that needs no more
    than the budget still does not fit (the caching allocator's replay ran out of memory)."""
    return used if fits else max(used, budget_bytes + 1.0)


def largest_within(
    sizes: Iterable[int],
    bytes_at: Callable[[int], float],
    budget_bytes: float,
    *,
    probe: int | None = None,
    guess_only: bool = False,
) -> int:
    """The largest of ``sizes`` whose ``bytes_at(n)`` is at most ``budget_bytes``; 0 when the
    smallest does not fit.

    ``bytes_at(n)``: what a step at micro-batch ``n`` needs (an estimate, or a real trial
    returning ``inf`` where it ran out of memory); expected not to shrink as ``n`` grows (memory
    is close to linear in the micro-batch). The smallest size and the ``probe`` (the largest
    size up to ``probe``: an estimate at a much larger size costs more) are estimated first
    (without a probe: the largest size, then the smallest), and a line through the two predicts
    the answer (``guess_only``: that prediction, unconfirmed: a guess to rank by). The size next
    to the prediction confirms it; otherwise the bracket (a size that fits, one that does not)
    closes by interpolation (a point that fits confirmed by the size after it), and by bisection
    after an interpolation that did not halve it. On a curve that shrinks somewhere, the answer
    is a size that fits (never one not estimated) next to one that does not, or the largest.
    ``bytes_at`` is called at most once a size.
    """
    s = sorted({check_int("sizes", n, minimum=1) for n in sizes})
    if not s:
        raise ValueError("`sizes` must hold at least one micro-batch size; got none.")
    known: dict[int, float] = {}

    def at(i: int) -> float:
        if s[i] not in known:
            known[s[i]] = float(bytes_at(s[i]))
        return known[s[i]]

    def line(a: int, b: int) -> int:
        """The largest index that a line through sizes ``a`` and ``b`` keeps in the budget (``a``
        at least; a line that does not rise: the largest size)."""
        slope = (at(b) - at(a)) / (s[b] - s[a]) if math.isfinite(at(b)) else math.inf
        if math.isinf(slope):
            return a
        top = s[a] + (budget_bytes - at(a)) / max(slope, 1e-9)
        return max(a, max((i for i, n in enumerate(s) if n <= top), default=a))

    last = len(s) - 1
    top = max(i for i, n in enumerate(s) if i <= 1 or probe is None or n <= probe)
    for k in (last, 0) if probe is None else (0, top):  # without a probe, all fit: 1 estimate
        if k == 0 and at(0) > budget_bytes:
            return 0
        if k == last and at(k) <= budget_bytes:
            return s[k]
    fits_top = at(top) <= budget_bytes
    # lo: an index that fits; hi: one that does not (len(s): none known yet)
    lo, hi = (top, len(s)) if fits_top else (0, top)
    second = top
    if not math.isfinite(at(top)):  # the estimate could not run there: a line through 2 sizes
        second = 1
        lo, hi = (1, hi) if at(1) <= budget_bytes else (0, 1)
    guess = min(line(0, second), hi - 1)
    if guess_only or hi - lo <= 1:
        return s[guess] if guess_only else s[lo]
    i, interpolated, first, width = guess, True, True, hi - lo
    while hi - lo > 1:
        i = min(max(i, lo + 1), hi - 1)
        if at(i) <= budget_bytes:
            lo = i
        else:
            hi = i
        # a line lands at the edge: the size after one that fits confirms it (and, for the
        # first guess, the size before one that does not)
        near = i + 1 if lo == i else i - 1 if first else -1
        first = False
        if interpolated and lo < near < hi:
            lo, hi = (near, hi) if at(near) <= budget_bytes else (lo, near)
        # the next point: a line through the bracket (or from the smallest size where no size
        # is known not to fit); a bisection after a line that did not halve the bracket
        bisect = interpolated and (hi - lo) * 2 > width
        other = hi if hi < len(s) and math.isfinite(at(hi)) else 0
        interpolated = not bisect and other != lo
        i = line(lo, other) if interpolated else (lo + hi) // 2
        width = hi - lo
    return s[lo]
