"""What Dynamo did during a fit: compilations, recompilations (and why), graph breaks (and where).

- ``CompileWatch`` counts Dynamo compilations and recompilations and sums their wall time through
  Dynamo's compile callbacks (``on_compile_start``/``on_compile_end``), and counts the graph
  breaks that happened while it was installed: ``breaks()`` (reason -> count, each reason its
  first line) and ``break_sites()`` (``"forward at line 7"`` -> count).
- ``recompile_reasons``: the latest guard failures; ``cause_and_fix``: what they usually mean.
- ``describe_breaks``: one note on the graph breaks, in words (no raw Dynamo text).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from lightning_efficient.core._internals import (
    compile_callbacks,
    graph_break_counts,
    graph_break_sites,
    guard_failure_reasons,
)
from lightning_efficient.core.change import Change

__all__ = ["CompileWatch", "cause_and_fix", "describe_breaks", "recompile_reasons"]


class CompileWatch:
    """Counts Dynamo compilations and recompilations and sums their wall time while installed.

    Uses Dynamo's start/end compile callbacks. A compile id ``"f/n"`` with
    ``n > 0`` is the n-th recompilation of frame ``f``. ``on_recompile(watch)`` runs after each
    recompilation.
    """

    def __init__(self, on_recompile: Callable[[CompileWatch], None] | None = None) -> None:
        self.compiles = 0  # Dynamo frame compilations (graphs captured)
        self.recompiles = 0
        self.events = 0  # every compile event, deferred backward compiles included
        self.seconds = 0.0
        self.on_recompile = on_recompile
        self._started: float | None = None
        self._installed = False
        self._breaks_before: dict[str, int] = {}
        self._sites_before: dict[str, int] = {}
        self._filter: Any = None

    def _start(self, args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, args: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        self.events += 1
        if "DYNAMO" not in str(getattr(args, "callback_trigger", "DYNAMO")):
            return  # a deferred backward (or autotuning) compile of a graph already counted
        self.compiles += 1
        parts = str(getattr(args, "compile_id", "")).strip("[]").split("/")
        if len(parts) >= 2 and parts[-1].isdigit() and int(parts[-1]) > 0:
            self.recompiles += 1
            if self.on_recompile is not None:
                self.on_recompile(self)

    def install(self) -> CompileWatch:
        """Count from now; Dynamo's own warnings (raw tracer text, e.g. at a graph break) are
        held back meanwhile: the breaks are reported by count, place and reason instead."""
        callback_handler = compile_callbacks()
        if not self._installed:
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._dynamo")
            self._filter = warnings.filters[0]
            self._breaks_before, self._sites_before = graph_break_counts(), graph_break_sites()
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            self._installed = True
        return self

    def remove(self) -> None:
        callback_handler = compile_callbacks()
        if self._installed:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
            if self._filter in warnings.filters:
                warnings.filters.remove(self._filter)
            self._installed = False

    def breaks(self) -> dict[str, int]:
        """Graph breaks since ``install``: reason (its first line) -> count."""
        return _first_lines(_since(graph_break_counts(), self._breaks_before))

    def break_sites(self) -> dict[str, int]:
        """Where Dynamo resumed after a break since ``install``: ``"forward at line 7"`` -> count."""
        return _since(graph_break_sites(), self._sites_before)

    def apply(self) -> Change:
        """Install; the change's ``undo()`` removes the callbacks again."""
        self.install()
        return Change("compile callbacks installed", self.remove, value=self)

    def __enter__(self) -> CompileWatch:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def recompile_reasons(limit: int = 3) -> list[str]:
    """The latest guard failures Dynamo recorded (why it recompiled), newest last."""
    return guard_failure_reasons(limit)


def cause_and_fix(reasons: list[str]) -> str:
    text = " ".join(reasons).lower()
    if "size" in text or "stride" in text or "shape" in text or not reasons:
        cause = "input shapes change between steps (dynamic shapes, e.g. variable sequence lengths or a smaller last batch)"
        fix = (
            "pad or bucket sequence lengths to a few fixed sizes (and drop_last=True), or pass "
            "dynamic=True so one graph covers every size"
        )
    else:
        cause = "a guard on a Python value or module attribute keeps failing"
        fix = "make that value constant during training, or move it out of the compiled module"
    last = f" Last reason: {reasons[-1]}." if reasons else ""
    return f"Cause: {cause}.{last} Fix: {fix}."


def _since(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


def _first_lines(reasons: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason, n in reasons.items():
        line = (reason.strip().splitlines() or ["unknown reason"])[0].strip()
        out[line] = out.get(line, 0) + n
    return out


def describe_breaks(breaks: dict[str, int], sites: dict[str, int]) -> str:
    """One note on Dynamo's graph breaks: how many, where and why, in words (``""``: none)."""
    total = sum(breaks.values())
    if not total:
        return ""
    why = "; ".join(f"{reason} (x{n})" for reason, n in list(breaks.items())[:3])
    where = ", ".join(list(sites)[:3])
    return (
        f"{total} graph break{'' if total == 1 else 's'}"
        + (f" (resumed in {where})" if where else "")
        + f": {why}. The model runs as several graphs with eager code between them; "
        "fullgraph=True raises at the first break to find it."
    )
