"""How fast a model can consume batches, estimated without training it.

``estimated_step_rate`` times the module's own ``training_step`` on a real batch in eval mode
and without gradients and scales the forward time by ``STEP_PER_FORWARD`` (a training step runs
the forward, a backward of about twice its cost, and the optimizer). It is a rough figure, meant
as an upper bound on how much loading speed training can use; it is not a step timing. The
calls run inside :func:`~lightning_efficient.measure.scratch.scratch`: whatever they update (a
torchmetrics metric, a counter, a cache, the RNG) is put back after. ``DataLoaderTuning`` times
the fit's own steps instead (``techniques.dataloading.in_fit``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_efficient.core.validate import check_int
from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.measure.step import autocast_for, run_step

__all__ = ["STEP_PER_FORWARD", "estimated_step_rate"]

#: A training step's time in forward times: forward 1, backward about 2.
STEP_PER_FORWARD = 3.0


def estimated_step_rate(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    device: torch.device | str | None = None,
    repeats: int = 5,
) -> float:
    """Training steps per second that ``module`` could run on ``batch`` (already on the module's
    device): ``1 / (STEP_PER_FORWARD x forward seconds)``, the forward timed (fastest of
    ``repeats`` after one warm-up) in eval mode under ``torch.no_grad()`` with logging muted and
    the module put back after (:func:`~lightning_efficient.measure.scratch.scratch`).

    ``module`` is a LightningModule (its ``training_step(batch, 0)`` is timed) or any module
    (``module(batch)``).
    """
    check_int("repeats", repeats, minimum=1)
    device = torch.device(device) if device is not None else _device_of(module)

    def forward() -> None:
        with autocast_for(precision, device.type):
            run_step(module, batch)

    with scratch(module, train=False), torch.no_grad():
        forward()  # warm-up
        # the fastest call: other processes and thread contention only ever add time
        seconds = min(time_fn(forward, warmup=0, repeats=1, device=device) for _ in range(repeats))
    return 1.0 / (STEP_PER_FORWARD * seconds) if seconds > 0 else float("inf")


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
