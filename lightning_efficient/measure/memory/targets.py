"""The device an estimate models: its kernels, its allocator and its fixed workspaces.

Fake tensors on a CPU dispatch to the CPU's kernels, which are not CUDA's: on an NVIDIA H200 the
CPU-side figure was 1.98-2.78x the real peak of GPT-2-sized models without checkpointing (the
CPU runs attention's math path with dropout, saving the B x H x S x S probabilities, where CUDA
runs a fused kernel) and 0.54x on a family where CUDA falls back to the math path and the CPU
does not. So every estimate names its target, and a CUDA target is modelled explicitly
(:mod:`lightning_efficient.measure.memory.cuda_kernels`).

``resolve_target`` turns what a user writes (``"cpu"``, ``"cuda"``, ``"cuda:sm80"``,
``"cuda:a100"``, a ``torch.device``) into a :class:`DeviceTarget`; ``None`` is this machine's
own accelerator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeviceTarget",
    "GPU_CAPABILITIES",
    "is_local_gpu",
    "resolve_target",
    "workspace_allocations",
    "workspace_bytes",
]

#: GPU names a target may be given by, and their compute capability.
GPU_CAPABILITIES: dict[str, tuple[int, int]] = {
    "v100": (7, 0),
    "t4": (7, 5),
    "a100": (8, 0),
    "a10": (8, 6),
    "a40": (8, 6),
    "rtx3090": (8, 6),
    "l4": (8, 9),
    "l40s": (8, 9),
    "rtx4090": (8, 9),
    "h100": (9, 0),
    "h200": (9, 0),
    "gh200": (9, 0),
    "b200": (10, 0),
}
#: A CUDA target whose GPU is not named and not present: the H100/H200 class.
DEFAULT_CAPABILITY = (9, 0)
#: cuDNN of a CUDA target whose GPU is not present: 9.19, what torch 2.11's CUDA 13 image held
#: on the H200 measured (torch prefers cuDNN's attention on sm90/sm100 from cuDNN 9.15.1).
DEFAULT_CUDNN = 91900


def _installed_torch() -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return major, minor


@dataclass(frozen=True)
class DeviceTarget:
    """The device an estimate models.

    Attributes:
        kind: ``"cpu"`` (the CPU's own kernels, measured by running them on fake tensors) or
            ``"cuda"`` (CUDA's kernels, modelled: attention backend, dropout, autocast policy,
            cuBLAS workspaces, the caching allocator's block sizes).
        capability: The GPU's compute capability (CUDA only), which decides the attention
            backends available and the cuBLAS workspace size.
        torch_version: ``(major, minor)`` of the torch whose selection rules apply (default:
            the installed one).
        name: How the target was named (for the label).
        cudnn_version: cuDNN's version as torch reports it (``91900`` for 9.19), which decides
            whether torch prefers cuDNN's attention (default: this GPU's, else 9.19).
    """

    kind: str = "cpu"
    capability: tuple[int, int] = DEFAULT_CAPABILITY
    torch_version: tuple[int, int] = (0, 0)
    name: str = ""
    cudnn_version: int = DEFAULT_CUDNN

    def __post_init__(self) -> None:
        if self.torch_version == (0, 0):
            object.__setattr__(self, "torch_version", _installed_torch())

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def label(self) -> str:
        """What the estimate modelled, e.g. ``"CUDA sm90 (h200), torch 2.11 kernels"``."""
        if not self.cuda:
            return "CPU (its own kernels)"
        major, minor = self.capability
        named = f" ({self.name})" if self.name else ""
        t = ".".join(map(str, self.torch_version))
        cudnn = f"{self.cudnn_version // 10000}.{self.cudnn_version // 100 % 100}"
        return f"CUDA sm{major}{minor}{named}, torch {t} kernels, cuDNN {cudnn}"


def workspace_allocations(target: DeviceTarget) -> tuple[int, ...]:
    """The allocations (bytes) the CUDA caching allocator holds for the cuBLAS and cuBLASLt
    workspaces of one thread that runs matrix products (the forward's thread and autograd's
    backward thread each have theirs); empty for a CPU target.

    torch's default ``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8`` (32 MiB) from compute capability 9
    (Hopper and newer), ``:4096:2:16:8`` (8 MiB + 128 KiB) below; cuBLASLt's 1 MiB
    (``CUBLASLT_WORKSPACE_SIZE``) on top. Measured on an H200 (torch 2.11): a tiny model's
    training step read 69.8 MB allocated where its own tensors were 1.7 MB, i.e. 68.1 MB of
    workspaces; this model says 2 x 33 MiB = 69.2 MB.
    """
    if not target.cuda:
        return ()
    cublas = 4096 * 8 * 1024 if target.capability[0] >= 9 else (4096 * 2 + 16 * 8) * 1024
    return cublas, 1024 * 1024


def workspace_bytes(target: DeviceTarget) -> int:
    """The sum of :func:`workspace_allocations` (one thread's workspaces)."""
    return sum(workspace_allocations(target))


def resolve_target(device: Any = None) -> DeviceTarget:
    """The :class:`DeviceTarget` for ``device``.

    - ``None``: this machine's accelerator (its CUDA GPU when there is one, else the CPU);
    - ``"cpu"``; ``"cuda"`` (this machine's GPU, or the H100/H200 class when there is none);
    - ``"cuda:sm80"``, ``"cuda:8.0"`` (a compute capability) or ``"cuda:a100"`` (a name of
      :data:`GPU_CAPABILITIES`); a bare GPU name (``"h100"``) works too;
    - a ``torch.device`` or a ``DeviceTarget`` (returned as is).
    """
    if isinstance(device, DeviceTarget):
        return device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        device = device.type
    if not isinstance(device, str):
        raise TypeError(
            "`device` must be 'cpu', 'cuda', 'cuda:<capability or GPU name>' (e.g. 'cuda:sm80', "
            f"'cuda:a100'), a torch.device or a DeviceTarget; got {device!r} "
            f"({type(device).__name__})."
        )
    text = device.strip().lower()
    if text in GPU_CAPABILITIES:
        text = f"cuda:{text}"
    kind, _, detail = text.partition(":")
    if kind in ("cpu", "mps") and not detail:
        return DeviceTarget("cpu")
    if kind not in ("cuda", "gpu"):
        raise ValueError(_bad_device(device))
    if not detail or detail.isdigit():  # "cuda" or "cuda:0": this machine's GPU, if any
        if torch.cuda.is_available():
            index = int(detail) if detail else torch.cuda.current_device()
            return DeviceTarget(
                "cuda",
                tuple(torch.cuda.get_device_capability(index)),
                name=torch.cuda.get_device_name(index),
                cudnn_version=int(torch.backends.cudnn.version() or 0),
            )
        return DeviceTarget("cuda", DEFAULT_CAPABILITY, name="H100/H200 class")
    if detail in GPU_CAPABILITIES:
        return DeviceTarget("cuda", GPU_CAPABILITIES[detail], name=detail)
    m = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", detail)
    if m is None:
        raise ValueError(_bad_device(device))
    if m.group(2) is not None:
        capability = (int(m.group(1)), int(m.group(2)))
    else:
        digits = m.group(1)
        capability = (int(digits[:-1]), int(digits[-1])) if len(digits) >= 2 else (int(digits), 0)
    if not 5 <= capability[0] <= 12:
        raise ValueError(_bad_device(device))
    return DeviceTarget("cuda", capability)


def is_local_gpu(device: Any) -> bool:
    """``device`` names this machine's own GPU (``"cuda"``, ``"cuda:<index>"``, a CUDA
    ``torch.device``) and there is one."""
    if isinstance(device, torch.device):
        device = device.type
    return (
        isinstance(device, str)
        and torch.cuda.is_available()
        and re.fullmatch(r"cuda(:\d+)?", device.strip().lower()) is not None
    )


def _bad_device(device: Any) -> str:
    names = ", ".join(sorted(GPU_CAPABILITIES))
    return (
        f"`device` must be 'cpu', 'cuda', 'cuda:sm<NN>' (e.g. 'cuda:sm80', 'cuda:9.0') or "
        f"'cuda:<GPU>' with a GPU among {names}; got {device!r}."
    )
