"""Memory: what a training step's memory is spent on, estimated without a GPU and measured.

- The estimate on fake tensors (``estimate``: :func:`estimate_memory`) runs on the storage
  tracker (``track``) and returns its data types (``types``); it reads the fit's settings
  (``settings``), models the target device (``targets``, ``cuda_kernels``,
  ``caching_allocator``), answers transformers' mask checks (``hf_masks``), notes training KV
  caches (``kv_cache``), divides the state per rank (``per_rank``) and models optimizer states
  (``optimizer_models``); ``heads`` finds the output head (the logits' layer).
- On real tensors: the peak of a block (``peak``: :class:`PeakMemory`, the one peak meter), the
  CPU allocator's own peak (``allocator``) and the measuring callback :class:`MemoryBreakdown`
  (``breakdown``).

The room imports the floor's root (``step``, ``scratch``, ``plots``) and none of its other rooms.
"""

from lightning_efficient.measure.memory.breakdown import MemoryBreakdown
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.peak import PeakMemory
from lightning_efficient.measure.memory.targets import DeviceTarget, resolve_target
from lightning_efficient.measure.memory.track import StorageTracker, measure_step
from lightning_efficient.measure.memory.types import CATEGORIES, EstimatePlan, MemoryEstimate

__all__ = [
    "CATEGORIES",
    "DeviceTarget",
    "EstimatePlan",
    "MemoryBreakdown",
    "MemoryEstimate",
    "PeakMemory",
    "StorageTracker",
    "estimate_memory",
    "measure_step",
    "resolve_target",
]
