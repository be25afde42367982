"""Speed: where a training step's time goes and what bounds it.

- ``timing``: the one timer (:class:`StepTimer`, :func:`time_fn`: CUDA events on a GPU,
  ``perf_counter`` on a CPU).
- ``flops``: the FLOPs of a step (counted on the estimate's fake tensors), the device's peak
  FLOP/s and MFU; ``tokens``: what a sample and a token of a batch are (one definition).
- ``step_rate``: how fast a model can consume batches, estimated without training it; ``host``:
  the host's usable cores and memory (the loader workers' bounds); ``fetch_watch``: when the
  training loop starts waiting for its next batch (the trainer's profiler, wrapped); the
  measuring callback :class:`InputStallMonitor` (``input_stall``): the share of the loop's time
  spent waiting for data.

The room imports the floor's root and ``memory`` (FLOPs are counted on the estimate's fake
tensors), never ``trials`` or ``profiling``.
"""

from lightning_efficient.measure.speed.flops import count_flops, peak_flops
from lightning_efficient.measure.speed.input_stall import InputStallMonitor
from lightning_efficient.measure.speed.timing import StepTimer, time_fn

__all__ = ["InputStallMonitor", "StepTimer", "count_flops", "peak_flops", "time_fn"]
