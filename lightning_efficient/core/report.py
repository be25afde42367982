"""The efficiency report: one table of what every technique changed, shown at the end of fit.

Techniques add an entry (``report_for(trainer).add(...)``); the last technique callback to reach
``on_fit_end`` shows the table once, on rank zero, and logs its numbers as logger metrics.
The same report renders as a rich table, Markdown, a dict, or a PNG bar chart.

Under several ranks ``show`` first gathers every rank's figures (one collective, so every rank
calls it; nothing is gathered on one process) and rank zero prints once, with the spread where
it matters (``core/ranks.py``): the worst rank of ``*_bytes`` figures, the slowest of ``*_s``
figures, and whether all ranks took the same decisions.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_efficient.core.per_trainer import PerTrainer
from lightning_efficient.core.ranks import (
    annotate,
    distributed_world,
    gather_objects,
    is_number,
    spread_dict,
    spread_kind,
    spread_of,
)
from lightning_efficient.core.validate import format_bytes

__all__ = ["ReportEntry", "EfficiencyReport", "report_for", "format_figure", "print_table"]


@dataclass
class ReportEntry:
    """What one technique did: a one-line change and named figures.

    Figure names follow a unit convention that the renderers use: ``*_bytes`` are bytes,
    ``*_s`` seconds, ``*_ratio`` a ratio against the plain run, anything else a plain number.

    ``decisions`` names the figures every rank must agree on (e.g. an early stopper's
    ``stopped_step``). ``per_rank`` is ``None`` on one process; after a gather under several
    ranks, every rank's figures in rank order (``{}`` for a rank without this row).
    """

    technique: str
    change: str
    figures: dict[str, Any] = field(default_factory=dict)
    decisions: tuple[str, ...] = ()
    per_rank: list[dict[str, Any]] | None = None

    def names(self) -> list[str]:
        """The figures shown: this rank's, then decisions only other ranks reported."""
        names = list(self.figures)
        for figures in self.per_rank or ():
            names += [k for k in figures if k in self.decisions and k not in names]
        return names

    def ranks_of(self, name: str) -> list[Any] | None:
        """The figure on every rank (``None`` where a rank lacks it), or ``None`` ungathered."""
        if self.per_rank is None:
            return None
        return [figures.get(name) for figures in self.per_rank]

    def text(self, name: str) -> str:
        """``name=value`` as the report shows it, with the ranks' spread where it matters."""
        values = self.ranks_of(name)
        shown = annotate(name, values, format_figure, self.decisions) if values else None
        return f"{name}={shown or format_figure(name, self.figures.get(name))}"


def format_figure(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if name.endswith("_bytes"):
        return format_bytes(value)
    if name.endswith("_s"):
        return f"{value:.3g} s"
    if name.endswith("_ratio"):
        return f"{value:.3f}x"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _or_dash(name: str, value: Any) -> str:
    return "-" if value is None else format_figure(name, value)


def _bars(entries: Iterable[ReportEntry], figure: str | None) -> tuple[list, list, list, list]:
    """What :meth:`EfficiencyReport.to_png` draws: a label, a value (GiB for ``*_bytes``) and a
    unit per numeric figure whose name contains ``figure`` (all where ``None``), and the spans
    ``(bar, low, high)`` of the figures that differ between ranks."""
    labels, values, units, spans = [], [], [], []
    for e in entries:
        for k, v in e.figures.items():
            if figure is not None and figure not in k:
                continue
            if is_number(v):
                scale, unit = (2**30, "GiB") if k.endswith("_bytes") else (1, "")
                labels.append(f"{e.technique}\n{k}")
                values.append(v / scale)
                units.append(unit)
                spread = spread_of(e.ranks_of(k) or []) if spread_kind(k) else None
                if spread is not None and not spread.equal:  # the ranks' min to max
                    spans.append((len(values) - 1, spread.low / scale, spread.high / scale))
    return labels, values, units, spans


class EfficiencyReport:
    """Entries keyed by technique name; adding the same technique again replaces its entry."""

    def __init__(self) -> None:
        self._entries: dict[str, ReportEntry] = {}
        self._shown = False
        #: Ranks gathered by the last ``gather`` (1: one process, nothing gathered).
        self.ranks = 1

    def add(self, technique: str, change: str, **figures: Any) -> ReportEntry:
        entry = ReportEntry(technique, change, dict(figures))
        self._entries[technique] = entry
        self._shown = False
        return entry

    def update(self, technique: str, **figures: Any) -> None:
        """Add figures to an existing entry (or start one with an empty change)."""
        entry = self._entries.get(technique) or self.add(technique, "")
        entry.figures.update(figures)
        self._shown = False

    @property
    def entries(self) -> list[ReportEntry]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, technique: str) -> bool:
        return technique in self._entries

    def __getitem__(self, technique: str) -> ReportEntry:
        return self._entries[technique]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{technique: {"change", **figures}}``; gathered rows add ``per_rank`` (every rank's
        figures) and ``spread`` (``{figure: {"min", "max", "worst_rank"}}`` for sizes,
        ``slowest_rank`` for times, ``{"same", "values"}`` for decisions)."""
        out: dict[str, dict[str, Any]] = {}
        for e in self._entries.values():
            row = {"change": e.change, **e.figures}
            if e.per_rank is not None:
                row["per_rank"] = [dict(f) for f in e.per_rank]
                spreads = {k: spread_dict(k, e.ranks_of(k) or [], e.decisions) for k in e.names()}
                row["spread"] = {k: v for k, v in spreads.items() if v is not None}
            out[e.technique] = row
        return out

    def metrics(self) -> dict[str, float]:
        """Numeric figures as flat logger metrics: ``efficiency/<technique>/<figure>`` (this
        rank's value); gathered sizes and times add ``.../<figure>/max`` and ``.../min``."""
        out = {}
        for e in self._entries.values():
            for k, v in e.figures.items():
                if is_number(v):
                    out[f"efficiency/{e.technique}/{k}"] = float(v)
                    spread = spread_of(e.ranks_of(k) or [])
                    if spread is not None and spread_kind(k) is not None:
                        out[f"efficiency/{e.technique}/{k}/max"] = spread.high
                        out[f"efficiency/{e.technique}/{k}/min"] = spread.low
        return out

    def _rows(self) -> list[tuple[str, str, str]]:
        return [
            (e.technique, e.change, ", ".join(e.text(k) for k in e.names()))
            for e in self._entries.values()
        ]

    # -- several ranks ---------------------------------------------------------------------
    def gather(self, trainer: Any) -> bool:
        """Gather every rank's figures into ``per_rank`` of each row (one collective: every rank
        of the trainer's process group must call it at the same point). On one process it
        does nothing and returns False. Rank zero warns when ranks took different decisions."""
        world = distributed_world(trainer)
        if world < 2:
            return False
        local = {
            e.technique: {
                "change": e.change,
                "decisions": list(e.decisions),
                "figures": {
                    k: v
                    for k, v in e.figures.items()
                    if v is None or isinstance(v, (int, float, str))
                },
            }
            for e in self._entries.values()
        }
        ranks = gather_objects(local, world)
        self.ranks = world
        for technique in dict.fromkeys(t for rows in ranks for t in rows):
            held = [r for r, rows in enumerate(ranks) if technique in rows]
            entry = self._entries.get(technique)
            if entry is None:  # reported by other ranks only
                first = ranks[held[0]][technique]
                change = f"{first['change']} (reported on ranks {', '.join(map(str, held))})"
                entry = self._entries[technique] = ReportEntry(technique, change)
            for r in held:
                extra = ranks[r][technique]["decisions"]
                entry.decisions += tuple(d for d in extra if d not in entry.decisions)
            entry.per_rank = [dict(rows.get(technique, {}).get("figures", {})) for rows in ranks]
        if getattr(trainer, "is_global_zero", True):
            for message in self.disagreements():
                warnings.warn(message, stacklevel=2)
        return True

    def disagreements(self) -> list[str]:
        """One message per decision figure whose gathered values differ between ranks."""
        out = []
        for e in self._entries.values():
            for k in e.decisions:
                values = e.ranks_of(k)
                if values and any(v != values[0] for v in values):
                    shown = ", ".join(f"rank {r} {_or_dash(k, v)}" for r, v in enumerate(values))
                    out.append(f"{e.technique}: the ranks took different decisions, {k}: {shown}.")
        return out

    def to_markdown(self) -> str:
        lines = ["| Technique | What changed | Figures |", "|---|---|---|"]
        lines += [f"| {t} | {c} | {f} |" for t, c, f in self._rows()]
        return "\n".join(lines)

    def to_rich(self):  # -> rich.table.Table
        from rich.table import Table

        title = "lightning-efficient report"
        if any(e.per_rank is not None for e in self._entries.values()):
            title += f" ({self.ranks} ranks)"
        table = Table(title=title, show_lines=False)
        for col in ("Technique", "What changed", "Figures"):
            table.add_column(col, overflow="fold")
        for e in self._entries.values():  # one figure a line: a line break never splits one
            table.add_row(e.technique, e.change, "\n".join(e.text(k) for k in e.names()))
        return table

    def print(self) -> None:
        print_table(self.to_rich())

    def to_png(self, path: str | Path, figure: str | None = None) -> Path:
        """Bar chart of the numeric figures (one bar per technique and figure) saved to ``path``.

        ``figure`` restricts the chart to figures whose name contains it (e.g. ``"bytes"``).
        Needs matplotlib: ``pip install 'lightning-efficient[plot]'``.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - depends on the environment
            from lightning_efficient.core.validate import missing_extra

            raise missing_extra("matplotlib", "plot", "EfficiencyReport.to_png") from err
        labels, values, units, spans = _bars(self._entries.values(), figure)
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(values)), 3.5))
        ax.bar(range(len(values)), values, color="#4c72b0")
        if spans:
            x, low, high = zip(*spans)
            ax.vlines(x, low, high, color="#c44e52", linewidth=3, label="ranks' min-max")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title("lightning-efficient report")
        if units and all(u == "GiB" for u in units):
            ax.set_ylabel("GiB")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def show(self, trainer: Any = None) -> bool:
        """Print the table and log the metrics once per change; only on global rank zero.

        Under several ranks it first gathers every rank's figures (``gather``, a collective:
        every rank calls it, as the techniques do at the end of fit; each rank keeps the same
        "shown" state, so a later call skips the collective on every rank alike). Returns True
        when it printed.
        """
        if self._shown:
            return False
        self.gather(trainer)  # every rank reaches the collective; rows of all ranks after it
        if not self._entries:
            return False
        self._shown = True
        if trainer is not None and not getattr(trainer, "is_global_zero", True):
            return False
        self.print()
        logger = getattr(trainer, "logger", None)
        metrics = self.metrics()
        if logger is not None and metrics:
            logger.log_metrics(metrics, step=getattr(trainer, "global_step", 0))
        return True


def print_table(table: Any, file: IO[str] | None = None) -> None:
    """Print a rich ``table`` to ``file`` (default: standard output). On a terminal it wraps to the
    terminal's width between words; to a file or a pipe, which has no width to honour (rich would
    assume 80 columns and fold a number such as "1.95 MiB" into "1" and ".95 MiB"), every row
    stays on one line."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(file=file)
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(10**6), table).maximum
        if natural > console.width:
            console = Console(file=file, width=natural)
    console.print(table)


_REPORTS: PerTrainer[EfficiencyReport] = PerTrainer(EfficiencyReport)


def report_for(trainer: Any) -> EfficiencyReport:
    """The report of one trainer (created on first use, released with the trainer)."""
    return _REPORTS(trainer)
