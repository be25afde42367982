"""The measuring callbacks' pictures: a step's phases stacked, memory by category.

``phases_figure`` and ``memory_figure`` return a matplotlib ``Figure`` (the test reads its bars);
``save_figure`` writes it as PNG or SVG by the path's suffix (SVG text kept as text, no date, a
fixed hash salt: the same figures give the same bytes). matplotlib is the optional ``plot``
extra: ``require_plot`` fails with the exact ``pip install`` line, before a fit starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_efficient.core.validate import format_bytes, missing_extra

__all__ = ["memory_figure", "phases_figure", "require_plot", "save_figure"]

MIB = 2**20
_RC = {"svg.hashsalt": "lightning-efficient", "svg.fonttype": "none"}
_SUFFIXES = (".png", ".svg")


def require_plot(purpose: str) -> None:
    """Raise the ``ImportError`` with the install line when matplotlib is not installed."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a stubbed-out module (sys.modules entry None)
        found = False
    if not found:
        raise missing_extra("matplotlib", "plot", purpose)


def check_plot_path(name: str, path: str | None) -> None:
    """A ``plot=`` path must end in .png or .svg (the format); matplotlib must be there."""
    if path is None:
        return
    if Path(path).suffix.lower() not in _SUFFIXES:
        raise ValueError(
            f"`{name}` must end in .png or .svg (the picture's format); got {str(path)!r}."
        )
    require_plot(f"`{name}`")


def _pyplot(purpose: str) -> Any:
    require_plot(purpose)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def phases_figure(
    phases: Mapping[str, float], by_category: Mapping[str, int] | None = None, title: str = ""
) -> Any:
    """One stacked bar of a step's phases (ms per step), and a bar per memory category (MiB) when
    ``by_category`` is given."""
    plt = _pyplot("phases_figure")
    cats = dict(by_category or {})
    fig, axes = plt.subplots(1, 2 if cats else 1, figsize=(9 if cats else 5, 2.8), squeeze=False)
    ax = axes[0][0]
    left = 0.0
    for phase, seconds in phases.items():
        ms = seconds * 1e3
        ax.barh([0], [ms], left=left, label=phase)
        left += ms
    ax.set_yticks([])
    ax.set_xlabel("ms per step (measured)")
    ax.set_title(title or "where a step's time goes", fontsize=9)
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    if cats:
        _category_bars(axes[0][1], cats, "memory by category")
    fig.tight_layout()
    return fig


def memory_figure(by_category: Mapping[str, int], title: str = "") -> Any:
    """A bar per memory category, in MiB, each with its size written above it."""
    plt = _pyplot("memory_figure")
    fig, axes = plt.subplots(figsize=(6, 3))
    _category_bars(axes, dict(by_category), title or "memory by category")
    fig.tight_layout()
    return fig


def _category_bars(ax: Any, cats: dict[str, int], title: str) -> None:
    xs = range(len(cats))
    ax.bar(xs, [v / MIB for v in cats.values()], color="#4c72b0")
    for x, v in zip(xs, cats.values()):
        ax.text(x, v / MIB, format_bytes(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [c.replace("_", "\n") for c in cats], fontsize=7)
    ax.set_ylabel("MiB at the peak")
    ax.set_title(title, fontsize=9)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (PNG at 100 dpi or SVG, by the suffix) and close it."""
    plt = _pyplot("save_figure")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with plt.rc_context(_RC):
        fig.savefig(path, dpi=100, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path
