"""The instrument: memory estimate, memory tracking, step timing and the efficiency report."""

from lightning_efficient.measure.report import EfficiencyReport, ReportEntry, report_for

__all__ = ["EfficiencyReport", "ReportEntry", "report_for"]
