"""Host offload of saved activations: a saved device tensor is copied to pinned host memory on a
side CUDA stream and brought back in backward (``torch.autograd.graph.saved_tensors_hooks``).
CPU tensors and parameters stay where they are."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["pack_to_host", "unpack_from_host"]

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
