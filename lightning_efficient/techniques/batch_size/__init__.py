"""Batch size that fits and runs fastest, with the effective batch kept; OOM recovery mid-run.

A small package (every name below is importable from ``lightning_efficient.techniques.batch_size``
as before the split):

- :mod:`.sizing`: pure maths: rounding for the hardware, accumulation for a target, the search
  over batch sizes with a memory estimate, the worst-case input (``largest_fitting_batch`` is in
  ``lightning_efficient.functional``).
- :mod:`.split`: the pure OOM splitter: a batch as micro-batches with gradient accumulation,
  and the retry state machine, on callables (no trainer).
- :mod:`.guard`: that splitter wired to a LightningModule's step methods for a fit.
- :mod:`.choice`: the decision for a running fit (reads the trainer, measures with the
  instrument; real trial steps are :mod:`lightning_efficient.measure.trials.trial`).
- :mod:`.callbacks`: :class:`EfficientBatchSize` (acts in ``setup``, before the optimizer and the
  train DataLoader exist; holds an OOM guard) and :class:`OOMRecovery` (arms the guard for the
  duration of training; the class itself is untouched, so state_dict keys never change).
"""

from lightning_efficient.techniques.batch_size.callback import EfficientBatchSize, OOMRecovery
from lightning_efficient.techniques.batch_size.guard import OOMGuard
from lightning_efficient.techniques.batch_size.sizing import (
    accumulation_for,
    batch_length,
    candidate_sizes,
    choose_micro_batch,
    is_large_tensor_core_device,
    largest_fitting_batch,
    longest_sample,
    resize_batch,
    round_batch_size,
    sample_size,
    worst_case_batch,
)
from lightning_efficient.techniques.batch_size.split import (
    OOMSplitter,
    OutOfMemoryRecoveryError,
    StepCalls,
    chunk_weights,
    micro_batch_step,
    split_batch,
)

__all__ = [
    "round_batch_size",
    "is_large_tensor_core_device",
    "candidate_sizes",
    "accumulation_for",
    "choose_micro_batch",
    "largest_fitting_batch",
    "batch_length",
    "sample_size",
    "longest_sample",
    "resize_batch",
    "worst_case_batch",
    "split_batch",
    "chunk_weights",
    "micro_batch_step",
    "OutOfMemoryRecoveryError",
    "OOMSplitter",
    "StepCalls",
    "OOMGuard",
    "OOMRecovery",
    "EfficientBatchSize",
]
