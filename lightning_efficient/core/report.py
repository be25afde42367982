"""The efficiency report: one table of what every technique changed, shown at the end of fit.

Techniques add an entry (``report_for(trainer).add(...)``); the last technique callback to reach
``on_fit_end`` shows the table once, on rank zero, and logs its numbers as logger metrics.
The same report renders as a rich table, Markdown, a dict, or a PNG bar chart.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_efficient.core.validate import format_bytes

__all__ = ["ReportEntry", "EfficiencyReport", "report_for", "format_figure"]


@dataclass
class ReportEntry:
    """What one technique did: a one-line change and named figures.

    Figure names follow a unit convention that the renderers use: ``*_bytes`` are bytes,
    ``*_s`` seconds, ``*_ratio`` a ratio against the plain run, anything else a plain number.
    """

    technique: str
    change: str
    figures: dict[str, Any] = field(default_factory=dict)


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


class EfficiencyReport:
    """Entries keyed by technique name; adding the same technique again replaces its entry."""

    def __init__(self) -> None:
        self._entries: dict[str, ReportEntry] = {}
        self._shown = False

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
        return {e.technique: {"change": e.change, **e.figures} for e in self._entries.values()}

    def metrics(self) -> dict[str, float]:
        """Numeric figures as flat logger metrics: ``efficiency/<technique>/<figure>``."""
        out = {}
        for e in self._entries.values():
            for k, v in e.figures.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"efficiency/{e.technique}/{k}"] = float(v)
        return out

    def _rows(self) -> list[tuple[str, str, str]]:
        return [
            (
                e.technique,
                e.change,
                ", ".join(f"{k}={format_figure(k, v)}" for k, v in e.figures.items()),
            )
            for e in self._entries.values()
        ]

    def to_markdown(self) -> str:
        lines = ["| Technique | What changed | Figures |", "|---|---|---|"]
        lines += [f"| {t} | {c} | {f} |" for t, c, f in self._rows()]
        return "\n".join(lines)

    def to_rich(self):  # -> rich.table.Table
        from rich.table import Table

        table = Table(title="lightning-efficient report", show_lines=False)
        for col in ("Technique", "What changed", "Figures"):
            table.add_column(col, overflow="fold")
        for row in self._rows():
            table.add_row(*row)
        return table

    def print(self) -> None:
        from rich.console import Console

        Console().print(self.to_rich())

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
        labels, values, units = [], [], []
        for e in self._entries.values():
            for k, v in e.figures.items():
                if figure is not None and figure not in k:
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    scale, unit = (2**30, "GiB") if k.endswith("_bytes") else (1, "")
                    labels.append(f"{e.technique}\n{k}")
                    values.append(v / scale)
                    units.append(unit)
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(values)), 3.5))
        ax.bar(range(len(values)), values, color="#4c72b0")
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

        Returns True when it printed.
        """
        if self._shown or not self._entries:
            return False
        if trainer is not None and not getattr(trainer, "is_global_zero", True):
            return False
        self._shown = True
        self.print()
        logger = getattr(trainer, "logger", None)
        metrics = self.metrics()
        if logger is not None and metrics:
            logger.log_metrics(metrics, step=getattr(trainer, "global_step", 0))
        return True


_REPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def report_for(trainer: Any) -> EfficiencyReport:
    """The report of one trainer (created on first use, released with the trainer)."""
    report = _REPORTS.get(trainer)
    if report is None:
        report = _REPORTS[trainer] = EfficiencyReport()
    return report
