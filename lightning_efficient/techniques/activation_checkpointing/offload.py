"""Host offload of saved activations: a saved device tensor is copied to pinned host memory on a
side CUDA stream and brought back in backward (``torch.autograd.graph.saved_tensors_hooks``).
CPU tensors and parameters stay where they are (``pack_to_host``). ``BoundaryChain`` does the
same for the inputs checkpointed blocks keep for their recompute, with a prefetch, and models the
move by a copy off CUDA (so the estimate and the CPU tests count it)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from lightning_efficient.measure.memory.track import keep_on_host

__all__ = ["pack_to_host", "unpack_from_host", "BoundaryChain"]

_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class _OnHost:
    """A saved activation copied to pinned host memory (the copy runs on a side stream)."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor) -> None:
        self.device, self.host = device, host


def pack_to_host(t: torch.Tensor) -> Any:
    # parameters and CPU tensors stay; only device activations move (pinned, async, side stream)
    if (
        t.device.type != "cuda"
        or isinstance(t, nn.Parameter)
        or t.layout != torch.strided
        or t.numel() == 0
    ):
        return t
    stream = _side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)  # the allocator keeps t until the copy is done
    return _OnHost(t.device, host)


def unpack_from_host(packed: Any) -> torch.Tensor:
    if isinstance(packed, _OnHost):
        torch.cuda.current_stream(packed.device).wait_stream(_side_stream(packed.device))
        return packed.host.to(packed.device, non_blocking=True)
    return packed


# -- checkpoint boundaries in host memory ------------------------------------------------------------
class _Boundary:
    """A checkpointed block's saved input, kept in host memory between its forward and its
    recompute. ``prev`` is the boundary saved before it (the next one backward needs)."""

    __slots__ = ("device", "host", "fetched", "event", "prev", "__weakref__")

    def __init__(self, t: torch.Tensor, prev: Any) -> None:
        self.device, self.prev = t.device, prev
        self.fetched: torch.Tensor | None = None
        self.event: Any = None
        if t.device.type == "cuda":
            stream = _side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            self.host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t until the copy is done
        else:  # modelled by a copy (a CPU device, or fake tensors for a CUDA target)
            self.host = t.detach().clone()
            keep_on_host(self.host)

    def prefetch(self) -> None:
        """Start bringing the tensor back (on CUDA: on the side stream, overlapped)."""
        if self.fetched is not None or self.host is None:
            return
        if self.device.type == "cuda":
            stream = _side_stream(self.device)
            with torch.cuda.stream(stream):
                self.fetched = self.host.to(self.device, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            self.fetched = self.host.clone()

    def take(self) -> torch.Tensor:
        self.prefetch()
        out, self.fetched = self.fetched, None
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            out.record_stream(torch.cuda.current_stream(self.device))
            self.event = None
        return out


class BoundaryChain:
    """Pack / unpack hooks for the inputs checkpointed blocks keep for their recompute: moved to
    host memory when saved (pinned, copied on a side stream on CUDA; a copy elsewhere, counted as
    host bytes by the memory trackers), brought back when the block's recompute asks, and the
    boundary of the block before it (the next one backward reaches) prefetched then. One chain is
    shared by the blocks of one ``apply_activation_checkpointing``."""

    def __init__(self) -> None:
        self._last: Any = None  # weak reference to the boundary saved last

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.layout != torch.strided or t.numel() == 0:
            return t
        prev = self._last() if self._last is not None else None
        boundary = _Boundary(t, weakref.ref(prev) if prev is not None else None)
        self._last = weakref.ref(boundary)
        return boundary

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Boundary):
            return packed
        out = packed.take()
        prev = packed.prev() if packed.prev is not None else None
        if prev is not None:
            prev.prefetch()
        return out
