"""What a checkpointed block's recompute must not change: running statistics of BatchNorm layers
(updated once per forward, not again in backward) and container arguments (copied, so the
recompute sees what the forward saw)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["OnceStats", "shallow_copy"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def shallow_copy(value: Any) -> Any:
    # plain containers only: a subclass (a model output class) may not rebuild from its items
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    return value


class OnceStats:
    """The function checkpoint runs: the first call is the forward; every later call is a
    recompute in backward, in which BatchNorm layers normalise with the same batch statistics
    but leave their running statistics (and ``num_batches_tracked``) as the forward left them."""

    def __init__(self, forward: Callable[..., Any], module: nn.Module) -> None:
        self.forward, self.module, self.calls = forward, module, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.forward(*args, **kwargs)
        norms = [
            m
            for m in self.module.modules()
            if isinstance(m, _BATCH_NORMS) and m.training and m.track_running_stats
        ]
        if not norms:
            return self.forward(*args, **kwargs)
        saved = [(m, m.momentum, m.num_batches_tracked) for m in norms]
        for m, _, tracked in saved:
            m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch: unchanged, exactly
            if tracked is not None:
                m.num_batches_tracked = tracked.clone()  # the increment lands on a copy
        try:
            return self.forward(*args, **kwargs)
        finally:
            for m, momentum, tracked in saved:
                m.momentum = momentum
                if tracked is not None:
                    m.num_batches_tracked = tracked
