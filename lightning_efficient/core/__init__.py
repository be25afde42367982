"""The lowest layer: the ``Technique`` base, the efficiency report, the compatibility rules,
argument validation, and ``_internals`` (the one module that touches private names of torch,
Lightning, DeepSpeed and jsonargparse). ``core`` imports nothing else of the package."""

from lightning_efficient.core.report import EfficiencyReport, ReportEntry, report_for
from lightning_efficient.core.technique import NoEffectWarning, Technique, techniques_of

__all__ = [
    "EfficiencyReport",
    "NoEffectWarning",
    "ReportEntry",
    "Technique",
    "report_for",
    "techniques_of",
]
