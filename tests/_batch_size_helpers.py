"""Test models for the batch-size tests: TinyGPT that runs out of memory on purpose."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from lightning_efficient.demos import TinyGPT


class OOMGPT(TinyGPT):
    """TinyGPT whose training forward fails with a *real* CPU allocation failure (it asks the
    allocator for 2**60 bytes) when a micro-batch has more than ``oom_above`` samples, from
    optimizer step ``from_step`` on, on process ``on_rank`` (None: every process).

    ``where="backward"`` instead raises ``torch.OutOfMemoryError`` once, at ``from_step``, after
    the backward has already written (partial) gradients, like a CUDA OOM in the backward.
    ``samples_seen`` counts the samples of every training forward that completed.
    """

    def __init__(
        self,
        oom_above: int | None = None,
        from_step: int = 0,
        where: str = "forward",
        on_rank: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.oom_above, self.from_step, self.where, self.on_rank = (
            oom_above,
            from_step,
            where,
            on_rank,
        )
        self.samples_seen = 0
        self.injected = 0

    def _hit(self, n: int) -> bool:
        trainer = self.trainer
        return (
            self.oom_above is not None
            and n > self.oom_above
            and trainer.global_step >= self.from_step
            and (self.on_rank is None or trainer.global_rank == self.on_rank)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training and self.where == "forward" and self._hit(idx.shape[0]):
            self.injected += 1
            torch.empty(2**60, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        out = super().forward(idx)
        if self.training and not isinstance(idx, FakeTensor):  # not the estimate's fake steps
            self.samples_seen += idx.shape[0]
        return out

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        loss.backward(*args, **kwargs)
        if self.where == "backward" and self.injected == 0 and self._hit(self.oom_above + 1):
            self.injected += 1
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)"
            )
