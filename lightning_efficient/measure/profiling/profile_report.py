"""The profiler's figures as a person reads them: the report row (``report_line``,
``report_figures``), logger metrics, the rich table and the PNG; pure functions of the summary
(``measure.profiling.profile_summary.summarize``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_efficient.core.validate import format_bytes

__all__ = [
    "PHASES",
    "phase_summary",
    "report_line",
    "report_figures",
    "logger_metrics",
    "nothing_measured",
    "profile_table",
    "profile_png",
]

#: The phases of a training step, in the order they run.
PHASES = ("data", "forward", "backward", "optimizer", "rest")


def phase_summary(totals: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per step of each phase from ``StepTimer`` totals over ``steps`` optimizer steps."""
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1; got {steps}.")
    return {p: float(totals.get(p, 0.0)) / steps for p in PHASES}


# -- rendering ---------------------------------------------------------------------------------
def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def report_line(s: dict[str, Any]) -> str:
    """The efficiency report's line of a profile: step time by phase, throughput, MFU, advice."""
    shares = ", ".join(f"{p} {s['phases'][p] / s['step_s']:.0%}" for p in PHASES if s["step_s"] > 0)
    text = f"step {s['step_s'] * 1e3:.1f} ms ({shares}); {s['samples_per_s']:.1f} samples/s"
    if s["mfu"] is not None:
        text += f"; MFU {s['mfu']:.1%}"
    advice = s["advice"]
    text += (
        f"; advice: {', '.join(a.get('lever') or a['technique'] for a in advice)}"
        if advice
        else "; no advice"
    )
    return text


def report_figures(s: dict[str, Any]) -> dict[str, Any]:
    """The few numbers of a profile the efficiency report compares."""
    # (``*_s`` figures are seconds in the report: throughputs are named ``*_per_sec``)
    figures: dict[str, Any] = {
        "step_s": s["step_s"],
        "samples_per_sec": round(s["samples_per_s"], 2),
    }
    if s["tokens_per_s"] is not None:
        figures["tokens_per_sec"] = round(s["tokens_per_s"], 1)
    if s["mfu"] is not None:
        figures["mfu"] = round(s["mfu"], 4)
    figures["data_wait"] = round(s["data_wait_fraction"] or 0.0, 4)
    return figures


def logger_metrics(s: dict[str, Any]) -> dict[str, float]:
    """``profiler/*`` metrics of a profile for the trainer's logger."""
    out = {f"profiler/{p}_s": v for p, v in s["phases"].items()}
    out["profiler/step_s"] = s["step_s"]
    out["profiler/samples_per_s"] = s["samples_per_s"]
    for key in ("tokens_per_s", "flops_per_step", "mfu", "data_wait_fraction"):
        if s[key] is not None:
            out[f"profiler/{key}"] = float(s[key])
    return out


def profile_table(s: dict[str, Any]):  # -> rich.table.Table
    """The profile as one rich table: speed, time per phase, memory, and the verdict."""
    from rich.table import Table

    table = Table(
        title=f"StepProfiler: {s['model']} on {s['device']}, {s['precision']}, "
        f"{s['steps']} steps measured",
        show_lines=False,
    )
    table.add_column("", style="bold")
    table.add_column("per step", justify="right")
    table.add_column("", overflow="fold")
    speed = f"{s['samples_per_s']:.1f} samples/s"
    if s["tokens_per_s"] is not None:
        speed += f", {_si(s['tokens_per_s'], 'tokens/s')}"
    table.add_row("step", f"{s['step_s'] * 1e3:.1f} ms", speed)
    for p in PHASES:
        share = s["phases"][p] / s["step_s"] if s["step_s"] > 0 else 0.0
        bar = "#" * round(share * 30)
        table.add_row(f"  {p}", f"{s['phases'][p] * 1e3:.1f} ms", f"{share:5.1%} {bar}")
    if s["flops_per_step"]:
        detail = f"{_si(s['flops_per_s'] or 0, 'FLOP/s')}"
        if s["mfu"] is not None:
            detail += (
                f" = MFU {s['mfu']:.1%} of {_si(s['peak_flops'], 'FLOP/s')} ({s['peak_source']})"
            )
        else:
            detail += f"; MFU unknown: {s['peak_source']}"
        table.add_row("FLOPs", _si(s["flops_per_step"], "FLOP"), detail)
    mem = s["memory"]
    if mem["peak_bytes"] is not None:
        cats = mem["by_category"] or {}
        top = sorted(cats.items(), key=lambda kv: -kv[1])[:3]
        detail = f"this run ({mem['source']})"
        if top and mem["peak_bytes"]:
            detail += ": " + ", ".join(
                f"{k.replace('_', ' ')} {v / mem['peak_bytes']:.0%}" for k, v in top
            )
        table.add_row("memory peak", format_bytes(mem["peak_bytes"]), detail)
    if s["plain_peak_bytes"]:
        detail = "plain run, fp32 AdamW, no techniques (estimated)"
        if mem["peak_bytes"]:
            detail += f"; this run {mem['peak_bytes'] / s['plain_peak_bytes'] - 1:+.0%}"
        table.add_row("  vs plain", format_bytes(s["plain_peak_bytes"]), detail)
    if mem["capacity_bytes"]:
        table.add_row("  capacity", format_bytes(mem["capacity_bytes"]), "")
    if s["advice"]:
        for i, a in enumerate(s["advice"], 1):
            gain = f"\nexpected: {a['gain']}" if a.get("gain") else ""
            table.add_row(
                f"{i}. {a.get('lever') or a['technique']}",
                "",
                f"{a['reason']}{gain}\n[dim]{_escape(a['yaml'])}[/dim]",
            )
    else:
        table.add_row(
            "verdict",
            "",
            "no lever applies: no input stall, memory pressure, slow precision, compile, "
            "optimizer, batch-size or wide-vocabulary lever found by the rules",
        )
    return table


def _escape(text: str) -> str:
    return text.replace("[", "\\[")


def profile_png(s: dict[str, Any], path: str | Path) -> Path:
    """The profile as a picture (PNG or SVG by the suffix): the phases of a step stacked (ms),
    and memory by category. Needs matplotlib: ``pip install 'lightning-efficient[plot]'``."""
    from lightning_efficient.measure.plots import phases_figure, save_figure

    phases = {p: s["phases"][p] for p in PHASES}
    return save_figure(phases_figure(phases, s["memory"]["by_category"]), path)


def nothing_measured(skip_steps: int, trace_steps: int | None, steps: int) -> str:
    """Why a fit of ``steps`` optimizer steps measured none: the warm-up (and the trace's
    ``trace_steps``; ``None``: no trace) took them all."""
    traced = f", trace_steps={trace_steps}" if trace_steps is not None else ""
    return f"no step was measured (skip_steps={skip_steps}{traced}; the fit ran {steps} steps)."
