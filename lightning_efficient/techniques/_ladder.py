"""The planner's ladder as data: the stacks of techniques to try, cheapest first.

``Part`` (a technique's class name and constructor arguments, stated once), ``Rung`` (a precision,
parts and an optional strategy) and :func:`default_ladder`. Shared by the planner
(``lightning_efficient.planner``, which re-exports every name) and ``AutoEfficient``, which walks
the same ladder at fit start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.validate import check_int

__all__ = [
    "ADAMW8BIT",
    "ADAMW8BIT_IN_BACKWARD",
    "CHECKPOINT_ALL",
    "CHUNKED_LOSS",
    "FSDP_FULL",
    "FSDP_GRAD_OP",
    "ZERO2_OFFLOAD",
    "ZERO3_OFFLOAD",
    "Part",
    "Rung",
    "checkpoint_fewest",
    "default_ladder",
]


def technique_class(name: str) -> type:
    """The class of a ladder technique by its short name (imported on use: the techniques'
    modules, not the package, which imports this one)."""
    if name == "ActivationCheckpointing":
        from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

        return ActivationCheckpointing
    if name == "ChunkedCrossEntropy":
        from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy

        return ChunkedCrossEntropy
    if name == "OptimizerSwap":
        from lightning_efficient.techniques.optimizers import OptimizerSwap

        return OptimizerSwap
    if name == "ZeROOffload":
        from lightning_efficient.techniques.zero_offload import ZeROOffload

        return ZeROOffload
    if name == "FullyShardedStrategy":
        from lightning_efficient.techniques.fsdp import FullyShardedStrategy

        return FullyShardedStrategy
    raise ValueError(
        f"`class_path` {name!r} is not a technique of the ladder; expected one of "
        "ActivationCheckpointing, ChunkedCrossEntropy, OptimizerSwap, ZeROOffload, "
        "FullyShardedStrategy."
    )


@dataclass(frozen=True)
class Part:
    """One technique of a rung, as data: the name of a class of the package and its constructor
    arguments, stated once. ``build()`` makes a fresh instance; ``spec()`` is the same arguments
    as a LightningCLI ``class_path``/``init_args`` entry."""

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        return technique_class(self.class_path)(**self.init_args)

    def spec(self) -> dict[str, Any]:
        args = {"init_args": dict(self.init_args)} if self.init_args else {}
        return {"class_path": self.class_path, **args}


@dataclass
class Rung:
    """One stack to try: a precision, callbacks and an optional strategy (``Part``s, built fresh
    on demand); ``configured``: techniques already built (the config's own, "as configured").

    ``sharding``: how the rung divides the state across ranks when it has no strategy of its
    own (``None``: as configured); a rung's strategy declares its own (``strategy_sharding``).
    """

    name: str
    precision: str
    callbacks: tuple[Part, ...] = ()
    strategy: Part | None = None
    cost: str = ""
    sharding: str | None = None
    configured: tuple[Any, ...] = ()

    def build(self) -> tuple[list[Any], Any]:
        callbacks = [*self.configured, *(part.build() for part in self.callbacks)]
        return callbacks, (self.strategy.build() if self.strategy is not None else None)

    def specs(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The callbacks' and the strategy's ``class_path``/``init_args`` (a configured technique:
        its class; its arguments are the config's own)."""
        callbacks = [{"class_path": type(obj).__name__} for obj in self.configured]
        callbacks += [part.spec() for part in self.callbacks]
        return callbacks, (self.strategy.spec() if self.strategy is not None else None)


#: The parts of the ladder (``checkpoint_fewest`` takes the budget).
ADAMW8BIT = Part("OptimizerSwap", {"name": "adamw8bit"})
ADAMW8BIT_IN_BACKWARD = Part("OptimizerSwap", {"name": "adamw8bit", "optimizer_in_backward": True})
CHECKPOINT_ALL = Part("ActivationCheckpointing")
ZERO2_OFFLOAD = Part("ZeROOffload", {"stage": 2, "offload_optimizer": "cpu"})
ZERO3_OFFLOAD = Part(
    "ZeROOffload", {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": True}
)
FSDP_GRAD_OP = Part("FullyShardedStrategy", {"sharding": "grad_op"})
FSDP_FULL = Part("FullyShardedStrategy")
CHUNKED_LOSS = Part("ChunkedCrossEntropy")


def checkpoint_fewest(budget_bytes: int) -> Part:
    """Checkpoint the fewest blocks that bring the estimated peak under ``budget_bytes``."""
    return Part("ActivationCheckpointing", {"budget": budget_bytes})


def default_ladder(
    budget_bytes: int,
    *,
    precision: str = "32-true",
    bf16: bool = True,
    accumulate_grad_batches: int = 1,
    configured: Sequence[Any] = (),
    world_size: int = 1,
    configured_sharding: str | None = None,
    chunked_loss: bool = False,
) -> list[Rung]:
    """The stacks the planner tries, cheapest first. ``configured``: the techniques (callbacks
    and strategy) the config already has; the first rung, "as configured", estimates them.

    One device (``world_size=1``): as configured, bf16, 8-bit optimizer states, checkpointing
    (fewest blocks, then all), optimizer in backward, then ZeRO offload to the host.

    Several ranks: as configured, bf16, then sharding across the ranks before anything lossy
    or slow: ``FullyShardedStrategy(sharding="grad_op")`` (the same communication volume as
    DDP), ``FullyShardedStrategy()`` (full sharding, +50% communication), full sharding with
    the fewest checkpointed blocks, then all blocks, then ZeRO offload to the host. The 8-bit
    rungs are left out: bitsandbytes cannot step sharded parameters, and full sharding divides
    the optimizer state by the rank count where 8-bit states divide it by 4.
    ``configured_sharding``: how the configured strategy divides the state (a sharding rung
    that divides no more than it is left out).

    ``chunked_loss``: the model's logits are wide (``chunked_loss.worth_chunking``):
    ``ChunkedCrossEntropy`` gets a rung right after the precision (the same maths, about as
    fast: cheaper than any rung after it) and stays in every later rung but ZeRO-3's (which
    cannot serve it).
    """
    check_int("world_size", world_size, minimum=1)
    low = "bf16-mixed" if bf16 and precision == "32-true" else precision
    fewest = checkpoint_fewest(budget_bytes)
    loss = (CHUNKED_LOSS,) if chunked_loss else ()
    name = f"{low} + chunked loss" if chunked_loss else low  # what every later rung starts with
    rungs = [Rung("as configured", precision, cost="none", configured=tuple(configured))]
    if low != precision:
        rungs.append(Rung(low, low, cost="none on bf16 hardware; loss within ~2% of fp32"))
    if chunked_loss:
        rungs.append(Rung(name, low, loss, cost="none: the same maths without the full logits"))
    if world_size > 1:
        rungs += _sharding_rungs(name, low, fewest, configured_sharding, loss)
    else:
        rungs += [
            Rung(
                f"{name} + adamw8bit",
                low,
                (*loss, ADAMW8BIT),
                cost="8-bit optimizer states (lossy, small)",
            ),
            Rung(
                f"{name} + adamw8bit + checkpoint fewest blocks",
                low,
                (*loss, ADAMW8BIT, fewest),
                cost="recompute some blocks' forward",
            ),
            Rung(
                f"{name} + adamw8bit + checkpoint all blocks",
                low,
                (*loss, ADAMW8BIT, CHECKPOINT_ALL),
                cost="recompute every block's forward (~+30% step time)",
            ),
        ]
    if accumulate_grad_batches == 1 and world_size == 1:
        rungs.append(
            Rung(
                f"{name} + adamw8bit in backward + checkpoint all blocks",
                low,
                (*loss, ADAMW8BIT_IN_BACKWARD, CHECKPOINT_ALL),
                cost="no gradient clipping or accumulation",
            )
        )
    rungs += [
        Rung(
            f"{name} + checkpoint all blocks + ZeRO-2 optimizer offload",
            low,
            (*loss, CHECKPOINT_ALL),
            ZERO2_OFFLOAD,
            cost="optimizer step on the host (PCIe traffic every step)",
        ),
        Rung(
            f"{low} + checkpoint all blocks + ZeRO-3 parameter offload",
            low,
            (CHECKPOINT_ALL,),
            ZERO3_OFFLOAD,
            cost="weights streamed from the host for every layer (slowest)",
        ),
    ]
    return rungs


#: Shardings that divide at least the optimizer state, gradients and parameters in flight as
#: much as SHARD_GRAD_OP does (a grad_op rung adds nothing to them), and as much as FULL_SHARD.
_AT_LEAST_GRAD_OP = ("zero2", "zero3", "grad_op", "full")
_AT_LEAST_FULL = ("zero3", "full")


def _sharding_rungs(
    name: str, low: str, fewest: Part, configured_sharding: str | None, loss: tuple[Part, ...]
) -> list[Rung]:
    """The multi-rank rungs between bf16 and host offload (see :func:`default_ladder`)."""
    rungs = []
    if configured_sharding not in _AT_LEAST_GRAD_OP:
        rungs.append(
            Rung(
                f"{name} + FSDP grad_op",
                low,
                loss,
                strategy=FSDP_GRAD_OP,
                cost="state sharded; communication as DDP (all-gather + reduce-scatter)",
            )
        )
    if configured_sharding not in _AT_LEAST_FULL:
        rungs.append(
            Rung(
                f"{name} + FSDP full",
                low,
                loss,
                strategy=FSDP_FULL,
                cost="parameters gathered again in backward (+50% communication over DDP)",
            )
        )
    rungs += [
        Rung(
            f"{name} + FSDP full + checkpoint fewest blocks",
            low,
            (*loss, fewest),
            FSDP_FULL,
            cost="+ recompute some blocks' forward",
        ),
        Rung(
            f"{name} + FSDP full + checkpoint all blocks",
            low,
            (*loss, CHECKPOINT_ALL),
            FSDP_FULL,
            cost="+ recompute every block's forward (~+30% step time)",
        ),
    ]
    return rungs
