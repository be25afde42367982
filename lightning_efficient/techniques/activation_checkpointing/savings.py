"""How much activation memory checkpointing a group of blocks frees, measured by the estimate.

``rank_groups`` runs the instrument's fake-tensor estimate (no allocation) once without
checkpointing and once per candidate group (``techniques._blocks.candidate_groups``), and ranks
the groups by the bytes they take off the forward/backward peak. The estimates run one step with a
stateless optimizer (the ranking compares activations; optimizer state is the same for every
group), eagerly (a compiled block is run uncompiled while measured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import compiled_call, set_compiled_call
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.techniques._blocks import BlockGroup

__all__ = ["GroupSaving", "BlockRanking", "rank_groups", "eager", "little_saving", "LITTLE"]

#: A choice that frees less than this share of the activation memory "saves little".
LITTLE = 0.05


@dataclass
class GroupSaving:
    """One measured group: the forward/backward peak with it checkpointed and what that frees."""

    group: BlockGroup
    peak_bytes: int
    saved_bytes: int


@dataclass
class BlockRanking:
    """Candidate groups ranked by measured saving, best first.

    ``plain_peak_bytes`` is the estimated forward/backward peak without checkpointing and
    ``plain_activation_bytes`` the activations live at it.
    """

    plain_peak_bytes: int
    plain_activation_bytes: int
    savings: list[GroupSaving] = field(default_factory=list)

    @property
    def best(self) -> GroupSaving | None:
        return self.savings[0] if self.savings else None

    def share(self, saving: GroupSaving) -> float:
        """The share of the activation memory ``saving`` frees."""
        return (
            saving.saved_bytes / self.plain_activation_bytes if self.plain_activation_bytes else 0.0
        )

    def describe(self, saving: GroupSaving) -> str:
        return (
            f"frees {format_bytes(max(saving.saved_bytes, 0))} of "
            f"{format_bytes(self.plain_activation_bytes)} activation memory "
            f"(-{max(self.share(saving), 0.0):.0%}, estimated)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain_peak_bytes": self.plain_peak_bytes,
            "plain_activation_bytes": self.plain_activation_bytes,
            "groups": [
                {
                    "block_class": s.group.block_class,
                    "kind": s.group.kind,
                    "blocks": len(s.group.names),
                    "peak_bytes": s.peak_bytes,
                    "saved_bytes": s.saved_bytes,
                }
                for s in self.savings
            ],
        }


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def little_saving(
    ranking: BlockRanking, chosen: GroupSaving, better: GroupSaving | None
) -> str | None:
    """``None`` when ``chosen`` frees at least ``LITTLE`` of the activation memory; else what it
    frees, in numbers, and the ``better`` group (its class name and blocks) if there is one."""
    if ranking.share(chosen) >= LITTLE:
        return None
    text = f"the checkpointed blocks save little: checkpointing them {ranking.describe(chosen)}."
    if better is None:
        return text + " No candidate block group of this model frees more."
    g = better.group
    policy = f", policy={g.block_class!r}" if g.kind == "class" else ""
    return (
        f"{text} Better: checkpointing the {len(g.names)} {g.block_class} blocks "
        f"({_span(g.names)}{policy}) {ranking.describe(better)}."
    )


@contextlib.contextmanager
def eager(model: nn.Module) -> Iterator[None]:
    """Inside, every compiled submodule of ``model`` runs eagerly (restored on exit): the
    estimate's fake forward must not trigger a compile."""
    stash = [(m, compiled_call(m)) for m in model.modules() if compiled_call(m) is not None]
    for m, _ in stash:
        set_compiled_call(m, None)
    try:
        yield
    finally:
        for m, call in stash:
            set_compiled_call(m, call)


def _stateless_sgd(param_groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups, lr=0.0)


def _fb_peak(est: Any) -> int:
    phases = est.phase_peaks
    return max(phases.get("forward", 0), phases.get("backward", 0)) or int(est.peak_bytes)


def rank_groups(
    model: nn.Module,
    batch: Any,
    groups: Sequence[BlockGroup],
    checkpoint: Callable[[list[str]], None],
    restore: Callable[[], None],
    **estimate_kwargs: Any,
) -> BlockRanking:
    """Estimate ``model`` on ``batch`` plain and with each group checkpointed (``checkpoint(names)``
    wraps them; ``restore()`` puts the model back as it was), best saving first (ties keep the
    order of ``groups``). ``estimate_kwargs`` as ``estimate_memory``'s (precision, callbacks,
    accumulation, loss_fn); the optimizer and the number of steps are set here."""
    from lightning_efficient.measure.memory.estimate import estimate_memory

    kwargs = {k: v for k, v in estimate_kwargs.items() if k not in ("optimizer", "steps")}
    kwargs.update(optimizer=_stateless_sgd, steps=1)
    with eager(model):
        try:
            checkpoint([])
            plain = estimate_memory(model, batch, **kwargs)
            measured = []
            for group in groups:
                checkpoint(list(group.names))
                peak = _fb_peak(estimate_memory(model, batch, **kwargs))
                measured.append(GroupSaving(group, peak, _fb_peak(plain) - peak))
        finally:
            restore()
    order = sorted(range(len(measured)), key=lambda i: (-measured[i].saved_bytes, i))
    return BlockRanking(
        plain_peak_bytes=_fb_peak(plain),
        plain_activation_bytes=int(plain.by_category.get("activations", 0)),
        savings=[measured[i] for i in order],
    )
