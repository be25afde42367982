"""The rank and resume bookkeeping shared by the package's samplers that shard themselves.

``ShardedSampler`` is a ``DistributedSampler`` (so Lightning leaves it in place under DDP/FSDP
instead of wrapping it), whose ``num_replicas``/``rank`` default to the process group's at
iteration time (1 and 0 without one), and whose per-rank length follows ``drop_last`` as
torch's ``DistributedSampler`` does. Subclasses set ``self.sample_count`` (samples in the
dataset) and ``self.seed``, and decide the order.

Its resumable position: ``position`` counts what this rank has handed out this epoch
(``walk``), goes back to 0 at the end of the epoch and when ``set_epoch`` moves to another one;
``state_dict()`` holds ``seed``, ``epoch`` and ``position``, and after ``load_state_dict`` the
next iteration continues from there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from torch.utils.data.distributed import DistributedSampler

from lightning_efficient.core.validate import check_bool, check_int

__all__ = ["ShardedSampler", "process_group_ranks"]

T = TypeVar("T")


def process_group_ranks() -> tuple[int, int]:
    """``(world size, rank)`` of the default process group; ``(1, 0)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class ShardedSampler(DistributedSampler):
    """Base of the samplers that shard themselves (see the module docstring)."""

    sample_count: int = 0
    seed: int = 0
    epoch: int = 0
    position: int = 0

    def _init_ranks(self, num_replicas: int | None, rank: int | None, drop_last: bool) -> None:
        """Check and keep the rank arguments (``None``: from the process group when iterated)."""
        self._num_replicas = check_int("num_replicas", num_replicas, minimum=1, allow_none=True)
        self._rank = check_int("rank", rank, minimum=0, allow_none=True)
        if num_replicas is not None and rank is not None and rank >= num_replicas:
            raise ValueError(f"`rank` must be < num_replicas={num_replicas}; got {rank}.")
        self.drop_last = check_bool("drop_last", drop_last)
        self.epoch = 0
        self.position = 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self._num_replicas if self._num_replicas is not None else process_group_ranks()[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = value

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._rank if self._rank is not None else process_group_ranks()[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        n, r = self.sample_count, self.num_replicas
        return n // r if self.drop_last else math.ceil(n / r)

    @property
    def total_size(self) -> int:  # type: ignore[override]
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    # -- the resumable position ------------------------------------------------------------------
    def walk(self, order: Sequence[T], start: int) -> Iterator[T]:
        """``order`` from ``start`` on, counting ``position`` (0 again once the epoch is out)."""
        self.position = start
        for item in order[start:]:
            self.position += 1
            yield item
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state.get("epoch", self.epoch))
        self.position = int(state.get("position", 0))
