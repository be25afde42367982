"""Trials: real steps of the user's module on its device, measured and then put back (on the
floor's ``scratch``).

- ``trial``: the peak of one real step (:func:`trial_step`, read with ``memory``'s
  ``PeakMemory``), samples/s (:func:`throughput`, timed with ``speed``'s ``time_fn``), a stack
  confirmed within a budget (:func:`trial_within`), and what counts as out of memory.
- ``compile_trial``: each ``TorchCompile`` scope compiled and timed on real steps.

The room imports the floor's root, ``memory`` and ``speed``; nothing of the floor imports it but
``lightning_efficient.measure`` itself (the techniques and the planning floor do).
"""

from lightning_efficient.measure.trials.trial import (
    TrialResult,
    throughput,
    trial_step,
    trial_within,
)

__all__ = ["TrialResult", "throughput", "trial_step", "trial_within"]
