"""Profiling: :class:`StepProfiler` (``profiler``), where each training step's time goes, how
close it is to the hardware and what to turn on next, with its parts: the phase bookkeeping
(``step_phases``), the Chrome trace of a few steps (``trace_window``), what it works out from the
measured steps (``profile_summary``), the figures as a person reads them (``profile_report``)
and the rules that turn them into advice naming a technique (``advice``).

The room imports the floor's root, ``memory`` and ``speed``, never ``trials``.
"""

from lightning_efficient.measure.profiling.advice import Advice, Findings, advise
from lightning_efficient.measure.profiling.profiler import StepProfiler

__all__ = ["Advice", "Findings", "StepProfiler", "advise"]
