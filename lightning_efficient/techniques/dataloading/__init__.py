"""The data pipeline: DataLoader tuning, device preloading, length bucketing.

Pure functions (no Lightning needed; the ones a user composes are in
``lightning_efficient.functional``):

- ``rebuild_dataloader(loader, num_workers=..., ...)`` (``rebuild.py``): the same loader (dataset,
  sampler or batch sampler, collate_fn, batch_size, drop_last, generator) with other
  worker/pinning settings and deterministic worker seeding (``WorkerSeeder``); it yields the same
  samples in the same order. ``auto_num_workers(devices)``: the usable CPU cores per device, minus
  one for the main process.
- ``tune_num_workers(loader, ...)`` (``workers.py``): batches/s per worker count, measured (0, 1,
  2, 4, ... while loading gets faster, bounded by memory and the model's step rate).
- ``preload_to_device(loader, device, max_bytes)`` (``preload.py``): the whole dataset collated
  once onto the device; batches are served by indexing device tensors (no per-step
  host-to-device copy).
- ``LengthBucketSampler`` and ``padding_stats`` (``buckets.py``): batches of similar length, less
  padding.

Callbacks (``callback.py``; they only decide *when*): ``DataLoaderTuning`` and
``DevicePreload``. ``InputStallMonitor`` measures and so lives in
``lightning_efficient.measure.speed.input_stall``.
"""

from lightning_efficient.techniques.dataloading.buckets import LengthBucketSampler, padding_stats
from lightning_efficient.techniques.dataloading.callback import DataLoaderTuning, DevicePreload
from lightning_efficient.techniques.dataloading.preload import (
    PreloadedBatches,
    PreloadRefused,
    preload_to_device,
)
from lightning_efficient.techniques.dataloading.rebuild import (
    WorkerSeeder,
    auto_num_workers,
    rebuild_dataloader,
)
from lightning_efficient.techniques.dataloading.workers import (
    TuneResult,
    default_max_workers,
    kept_training_state,
    tune_num_workers,
)

__all__ = [
    "rebuild_dataloader",
    "auto_num_workers",
    "tune_num_workers",
    "TuneResult",
    "default_max_workers",
    "kept_training_state",
    "preload_to_device",
    "PreloadedBatches",
    "PreloadRefused",
    "WorkerSeeder",
    "LengthBucketSampler",
    "padding_stats",
    "DataLoaderTuning",
    "DevicePreload",
]
