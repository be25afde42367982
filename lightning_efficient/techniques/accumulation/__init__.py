"""Exact gradient accumulation: the accumulated update is one step on the window's samples.

- :mod:`.weighting`: the pure maths: what a micro-batch's loss averages over, the weighting read
  from the losses of a batch and its parts, the factor at the window's end.
- :mod:`.probe`: the measurement on the module (forward passes that change nothing).
- :mod:`.window`: :class:`AccumulationWeights`, the hooks' work, held by every technique that
  accumulates (``ExactAccumulation``, ``EfficientBatchSize``, ``AutoEfficient``, the OOM split).
- :mod:`.callback`: :class:`ExactAccumulation`.
"""

from lightning_efficient.techniques.accumulation.callback import ExactAccumulation
from lightning_efficient.techniques.accumulation.probe import Probe, probe_weighting
from lightning_efficient.techniques.accumulation.weighting import (
    WEIGHTINGS,
    batch_slice,
    count,
    measured_share,
    window_factor,
)
from lightning_efficient.techniques.accumulation.window import (
    WINDOW_LOSS,
    AccumulationWeights,
    windows_for,
)

__all__ = [
    "WEIGHTINGS",
    "WINDOW_LOSS",
    "AccumulationWeights",
    "ExactAccumulation",
    "Probe",
    "batch_slice",
    "count",
    "measured_share",
    "probe_weighting",
    "window_factor",
    "windows_for",
]
