"""``PeakMemory``: the peak memory of whatever runs inside a ``with`` block, measured by the
instrument.

On CUDA it reads the caching allocator's statistics (``max_memory_allocated`` above what was
allocated when the block began, and ``max_memory_reserved``); anywhere else the instrument's storage
tracker (``measure.memory.track.StorageTracker``) on the real tensors, with the given tensors (a
module's parameters and buffers) counted from the start. It changes nothing it measures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_efficient.measure.memory.track import StorageTracker

__all__ = ["PeakMemory"]


class PeakMemory:
    """Peak bytes of what runs inside the block.

    Args:
        device: Where the block runs (``"cuda"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device``).
        tensors: Tensors alive before the block that its peak must count on a CPU (a model's
            parameters and buffers); on CUDA the allocator already sees them.
        enabled: ``False`` measures nothing (``peak`` and ``reserved`` stay ``None``).

    After the block, ``peak`` holds the peak bytes (``peak_allocated`` the same with what was
    allocated before the block) and ``reserved`` the allocator's peak
    reserved bytes (CUDA only: ``None`` on a CPU, which has no caching allocator). The block's exception, if any, is
    not swallowed; the figures are still read.
    """

    def __init__(
        self, device: torch.device | str, tensors: Iterable[torch.Tensor] = (), enabled: bool = True
    ) -> None:
        self.device = torch.device(device)
        self.tensors = list(tensors)
        self.enabled = bool(enabled)
        self.peak: int | None = None
        self.reserved: int | None = None
        self._tracker: StorageTracker | None = None
        self._base = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def peak_allocated(self) -> int | None:
        """The peak with what was allocated before the block counted too: on CUDA
        ``max_memory_allocated`` itself; elsewhere ``peak`` (which counts the given tensors)."""
        return None if self.peak is None else self.peak + self._base

    def __enter__(self) -> PeakMemory:
        if not self.enabled:
            return self
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = StorageTracker(fake=False)
            self._tracker.__enter__()
            self._tracker.label(self.tensors, "parameters")
        return self

    def __exit__(self, *exc: Any) -> bool:
        if not self.enabled:
            return False
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device)) - self._base
            self.reserved = int(torch.cuda.max_memory_reserved(self.device))
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peak = self._tracker.summary().peak_bytes
        return False
