"""The planner's ladder as data: the stacks of techniques to try, cheapest first.

``Part`` (a technique's class name and constructor arguments, stated once, and what it is
estimated as), ``Rung`` (a precision, parts and an optional strategy) and :func:`default_ladder`.
Walked by the one search (:mod:`lightning_efficient.planning.search`): ``plan_stack``,
``fit --auto`` and ``AutoEfficient``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_efficient.core.stack import Stack, spec
from lightning_efficient.core.validate import check_int
from lightning_efficient.measure.memory.optimizer_models import optimizer_class
from lightning_efficient.techniques._blocks import find_repeated_blocks
from lightning_efficient.techniques.accumulation import ExactAccumulation
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy, worth_chunking
from lightning_efficient.techniques.fsdp import FullyShardedStrategy
from lightning_efficient.techniques.optimizers import OptimizerSwap, eight_bit_saves_nothing
from lightning_efficient.techniques.optimizers.bf16 import gate_summary
from lightning_efficient.techniques.quantize import FrozenWeights4bit, worth_quantizing
from lightning_efficient.techniques.zero_offload import ZeROOffload

__all__ = [
    "ADAMW8BIT",
    "ADAM8BIT",
    "BF16_WEIGHT_RUNGS",
    "ADAMW8BIT_IN_BACKWARD",
    "CHECKPOINT_ALL",
    "CHECKPOINT_FEWEST",
    "CHUNKED_LOSS",
    "FROZEN_4BIT",
    "FSDP_FULL",
    "FSDP_GRAD_OP",
    "LONG_CONTEXT",
    "ZERO2_OFFLOAD",
    "ZERO3_OFFLOAD",
    "LADDER_CLASSES",
    "Part",
    "Rung",
    "checkpoint_fewest",
    "default_ladder",
    "eight_bit_form",
    "extended_by",
    "ladder_options",
    "offloadable",
    "optimizer_swap",
    "technique_class",
    "trains_full_weights",
    "trains_without_cache",
]


#: The classes a ladder part may name (a checkpoint's decision names them too), by short name.
LADDER_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ActivationCheckpointing,
        ChunkedCrossEntropy,
        OptimizerSwap,
        FrozenWeights4bit,
        ZeROOffload,
        FullyShardedStrategy,
        ExactAccumulation,  # what a decision's micro-batch x accumulation adds
    )
}


def technique_class(name: str) -> type:
    """The class of a ladder technique by its short name (:data:`LADDER_CLASSES`)."""
    if name not in LADDER_CLASSES:
        raise ValueError(
            f"`class_path` {name!r} is not a technique of the ladder; expected one of "
            f"{', '.join(LADDER_CLASSES)}."
        )
    return LADDER_CLASSES[name]


@dataclass(frozen=True)
class Part:
    """One technique of a rung, as data: the name of a class of the package and its constructor
    arguments, stated once. ``build()`` makes a fresh instance; ``spec()`` is the same arguments
    as a LightningCLI ``class_path``/``init_args`` entry.

    ``takes_budget``: the constructor argument that receives the memory budget (checkpointing
    "the fewest blocks within the budget": ``"budget"``), handed to the part when the search
    builds its rung (:meth:`within`); ``None``: the part needs no budget. ``estimated_as``: the
    part whose estimate gives this one's largest micro-batch, where the part decides from the
    size it is given (the fewest blocks fit exactly where every block fits); ``None``: the part
    itself. ``extends``: the part this one is, with more (checkpointing every block with its
    boundaries in host memory and tiled layers extends checkpointing every block:
    :func:`extended_by`). Neither of the last two is part of the part's identity (equality,
    ``repr``)."""

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)
    takes_budget: str | None = None
    estimated_as: Part | None = field(default=None, compare=False, repr=False)
    extends: Part | None = field(default=None, compare=False, repr=False)

    def within(self, budget_bytes: int) -> Part:
        """This part with the budget handed to it (itself when it takes none)."""
        if self.takes_budget is None:
            return self
        args = {**self.init_args, self.takes_budget: budget_bytes}
        return Part(self.class_path, args, None, self.estimated_as, self.extends)

    def build(self) -> Any:
        return technique_class(self.class_path)(**self._args())

    def spec(self) -> dict[str, Any]:
        return spec(self.class_path, self._args())

    def _args(self) -> dict[str, Any]:
        if self.takes_budget is not None:
            raise ValueError(
                f"{self.class_path} takes the budget (`{self.takes_budget}`): build its rung "
                "with `Rung.within(budget_bytes)`, as the search does."
            )
        return self.init_args


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

    def within(self, budget_bytes: int) -> Rung:
        """This rung with the budget handed to its parts that take one (``Part.within``);
        itself when none does."""
        parts = tuple(p.within(budget_bytes) for p in self.callbacks)
        strategy = self.strategy.within(budget_bytes) if self.strategy is not None else None
        if parts == self.callbacks and strategy == self.strategy:
            return self
        return replace(self, callbacks=parts, strategy=strategy)

    def build(self) -> tuple[list[Any], Any]:
        callbacks = [*self.configured, *(part.build() for part in self.callbacks)]
        return callbacks, (self.strategy.build() if self.strategy is not None else None)

    def specs(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The callbacks' and the strategy's ``class_path``/``init_args`` (a configured technique:
        its class; its arguments are the config's own)."""
        callbacks = [{"class_path": type(obj).__name__} for obj in self.configured]
        callbacks += [part.spec() for part in self.callbacks]
        return callbacks, (self.strategy.spec() if self.strategy is not None else None)

    def stack(self, *, configured: bool = True) -> Stack:
        """The rung as a config (:meth:`Stack.to_yaml`): its precision, callbacks and strategy
        (``configured=False``: without the config's own techniques)."""
        callbacks, strategy = self.specs()
        if not configured:
            callbacks = callbacks[len(self.configured) :]
        return Stack(self.precision, callbacks, strategy)


#: The parts of the ladder (``CHECKPOINT_FEWEST`` takes the budget, ``optimizer_swap`` the name).
ADAMW8BIT = Part("OptimizerSwap", {"name": "adamw8bit"})
ADAM8BIT = Part("OptimizerSwap", {"name": "adam8bit"})
ADAMW8BIT_IN_BACKWARD = Part("OptimizerSwap", {"name": "adamw8bit", "optimizer_in_backward": True})
CHECKPOINT_ALL = Part("ActivationCheckpointing")
ZERO2_OFFLOAD = Part("ZeROOffload", {"stage": 2, "offload_optimizer": "cpu"})
ZERO3_OFFLOAD = Part(
    "ZeROOffload", {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": True}
)
FSDP_GRAD_OP = Part("FullyShardedStrategy", {"sharding": "grad_op"})
FSDP_FULL = Part("FullyShardedStrategy")
CHUNKED_LOSS = Part("ChunkedCrossEntropy")
#: Checkpoint the fewest blocks within the budget the search hands it (estimated, for its largest
#: micro-batch, as :data:`CHECKPOINT_ALL`: it fits wherever every block does).
CHECKPOINT_FEWEST = Part(
    "ActivationCheckpointing", takes_budget="budget", estimated_as=CHECKPOINT_ALL
)
#: Long context: every block checkpointed, the inputs it keeps for the recompute in (pinned)
#: host memory, its position-wise layers run in tiles along the sequence (same maths).
LONG_CONTEXT = Part(
    "ActivationCheckpointing",
    {"offload_boundaries": True, "tile_sequence": True},
    extends=CHECKPOINT_ALL,
)
#: The bf16-weights rungs' optimizers, most bytes first (8, then about 6 bytes a parameter).
BF16_WEIGHT_RUNGS = ("adamw_sr", "adamw8bit_sr")
FROZEN_4BIT = Part("FrozenWeights4bit")


def _optimizer_type(optimizer: Any) -> type | None:
    """The class of ``optimizer``: a name as ``OptimizerSwap`` takes it (or a class path), a
    class, or an instance; ``None`` when it cannot be told (a factory)."""
    if isinstance(optimizer, str):
        return optimizer_class(optimizer)
    if isinstance(optimizer, type):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer)
    return None


def eight_bit_form(optimizer: Any) -> str | None:
    """The ``OptimizerSwap`` name of the 8-bit form of ``optimizer``'s family (a name, a class
    path, a class or an instance), so a swap keeps the user's maths: AdamW -> ``"adamw8bit"``,
    Adam -> ``"adam8bit"``. ``None``: no 8-bit form keeps it (SGD, with or without momentum,
    and any other family), or it is 8-bit already: the ladder offers no swap."""
    cls = _optimizer_type(optimizer)
    if cls is None:
        return None
    if issubclass(cls, torch.optim.AdamW):
        return "adamw8bit"
    if issubclass(cls, torch.optim.Adam):
        return "adam8bit"
    return None


def offloadable(optimizer: Any) -> bool:
    """Whether ZeRO offload keeps ``optimizer``'s family (DeepSpeed's CPU Adam/AdamW/Adagrad run
    the host step; any other optimizer would be replaced)."""
    cls = _optimizer_type(optimizer)
    return cls is not None and issubclass(cls, (torch.optim.Adam, torch.optim.Adagrad))


def optimizer_swap(name: str, *, in_backward: bool = False) -> Part:
    """``OptimizerSwap(name)`` (stepped in backward when ``in_backward``)."""
    return Part(
        "OptimizerSwap", {"name": name, **({"optimizer_in_backward": True} if in_backward else {})}
    )


def checkpoint_fewest(budget_bytes: int) -> Part:
    """Checkpoint the fewest blocks that bring the estimated peak under ``budget_bytes``
    (estimated, for its largest micro-batch, as :data:`CHECKPOINT_ALL`): :data:`CHECKPOINT_FEWEST`
    with the budget handed to it."""
    return CHECKPOINT_FEWEST.within(budget_bytes)


def ladder_options(model: Any) -> dict[str, bool]:
    """What ``model`` decides of :func:`default_ladder` (its keyword arguments): ``chunked_loss``
    (wide logits: ``worth_chunking``), ``frozen_4bit`` (frozen linear weights dominate:
    ``worth_quantizing``) and ``eight_bit`` (not every trainable tensor is under bitsandbytes'
    ``min_8bit_size``: ``eight_bit_saves_nothing``), ``bf16_weights`` (:func:`trains_full_weights`)
    and ``long_context`` (the model's repeated blocks are found: ``find_repeated_blocks``)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "chunked_loss": worth_chunking(model),
        "frozen_4bit": worth_quantizing(model),
        "eight_bit": not eight_bit_saves_nothing(trainable),
        "bf16_weights": trains_full_weights(model),
        "long_context": bool(find_repeated_blocks(model)),
    }


def trains_full_weights(model: Any) -> bool:
    """Whether ``model`` trains (nearly) all its weights: at least 90% of its parameters are
    trainable, so weights, gradients and optimizer states are what the bf16-weights rungs
    shrink. Adapters-only training (LoRA) is not: its frozen weights are never updated."""
    sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
    total = sum(n for n, _ in sizes)
    return total > 0 and sum(n for n, t in sizes if t) >= 0.9 * total


def default_ladder(
    *,
    precision: str = "32-true",
    bf16: bool = True,
    accumulate_grad_batches: int = 1,
    configured: Sequence[Any] = (),
    world_size: int = 1,
    configured_sharding: str | None = None,
    chunked_loss: bool = False,
    optimizer: Any = "adamw",
    frozen_4bit: bool = False,
    eight_bit: bool = True,
    bf16_weights: bool = False,
    long_context: bool = False,
) -> list[Rung]:
    """The stacks the planner tries, cheapest first. ``configured``: the techniques (callbacks
    and strategy) the config already has; the first rung, "as configured", estimates them. No
    budget: the search hands it to the rungs that take one (``Rung.within``: checkpointing the
    fewest blocks).

    ``optimizer``: the user's optimizer (a name, class path, class or instance; a factory
    counts as AdamW, the estimate's default). The 8-bit rungs swap it for the 8-bit form of its
    own family (:func:`eight_bit_form`: AdamW -> adamw8bit, Adam -> adam8bit); a family with
    none (SGD) gets no 8-bit rung, and no ZeRO offload rung unless DeepSpeed's CPU optimizer
    keeps its family (:func:`offloadable`). Checkpointing rungs come without the swap too.

    One device (``world_size=1``): as configured, bf16, 8-bit optimizer states, checkpointing
    the fewest blocks, then with 8-bit states, every block, then with 8-bit states, optimizer in
    backward, then ZeRO offload to the host.

    Several ranks: as configured, bf16, then sharding across the ranks before anything lossy
    or slow: ``FullyShardedStrategy(sharding="grad_op")`` (the same communication volume as
    DDP), ``FullyShardedStrategy()`` (full sharding, +50% communication), full sharding with
    every block checkpointed; then, under the configured strategy (what a callback can apply to
    a built Trainer), checkpointing the fewest (not under ``FullyShardedStrategy``: the budget
    search would estimate a sharded module, which it refuses) and every block, and
    (under DDP, where the parameters are not sharded) 8-bit states with every block; then ZeRO
    offload to the host. ``configured_sharding``: how the configured strategy divides the state
    (a sharding rung that divides no more than it is left out).

    ``chunked_loss``: the model's logits are wide (``chunked_loss.worth_chunking``):
    ``ChunkedCrossEntropy`` gets a rung right after the precision (the same maths, about as
    fast: cheaper than any rung after it) and stays in every later rung but ZeRO-3's (which
    cannot serve it).

    ``eight_bit``: False where 8-bit states would save nothing (every trainable tensor under
    bitsandbytes' ``min_8bit_size``, e.g. LoRA adapters on a small model:
    ``techniques.optimizers.eight_bit_saves_nothing``): no 8-bit rung (nor its in-backward one).

    ``frozen_4bit``: the model's frozen linear weights dominate its parameter bytes
    (``techniques.quantize.worth_quantizing``: adapters or a frozen backbone). Then
    ``FrozenWeights4bit`` (NF4, double quantization) gets three rungs after the exact ones
    (checkpointing every block, with 8-bit states where offered): alone, with the fewest
    checkpointed blocks, then with every block (and the 8-bit states). They come after
    checkpointing because they are lossy in the forward itself (the frozen weights are rounded
    to 4 bits; loss within ~2% of the 16-bit run in the card) and dequantize every weight in
    forward and again in backward, where checkpointing is exact; and before the optimizer in
    backward and ZeRO offload, which forbid clipping and accumulation or move the step to the
    host. On several ranks, one rung (with every block checkpointed) under the configured DDP
    only: 4-bit weights cannot be sharded. Trainable weights are never quantized (the technique
    picks frozen layers only). Never offered on full-weight training (no frozen weights).

    ``bf16_weights``: full-weight training (:func:`trains_full_weights`), where weights,
    gradients and AdamW states (16 bytes a parameter; 10 with 8-bit states) dominate. Then, on one
    device, for the AdamW family and where bf16 is allowed (``bf16``, or the trainer's precision
    is ``bf16-true`` already), two ``bf16-true`` rungs come after the 8-bit rungs and before the
    optimizer in backward and ZeRO offload: :data:`BF16_WEIGHT_RUNGS` (bf16 weights and
    gradients with stochastic rounding, 8 and about 6 bytes a parameter, with every block
    checkpointed); their cost names the quality gate's figure. A callback cannot change a
    built Trainer's precision: AutoEfficient reports them as needing ``trainer.precision:
    bf16-true`` (``fit --auto`` builds it). Never offered on adapters-only training.

    ``long_context``: the model's repeated blocks are found (``find_repeated_blocks``). Then, on
    one device, :data:`LONG_CONTEXT` (every block checkpointed, the inputs each keeps for its
    recompute in pinned host memory, its position-wise layers tiled along the sequence: the same
    maths) comes right after the exact checkpointing rungs, and with the 4-bit frozen weights
    (and 8-bit states) after the 4-bit rungs: where the checkpointed blocks' inputs and one
    block's wide intermediates set the peak (long sequences). It extends checkpointing every
    block (:func:`extended_by`): where it saves nothing it is passed over. Its host bytes are in
    its estimate; a host budget refuses it where they exceed it.
    """
    check_int("world_size", world_size, minimum=1)
    family = optimizer if _optimizer_type(optimizer) is not None else "adamw"
    eight = eight_bit_form(family) if eight_bit else None
    swap = (optimizer_swap(eight),) if eight else ()
    low = "bf16-mixed" if bf16 and precision == "32-true" else precision
    fewest = CHECKPOINT_FEWEST
    loss = (CHUNKED_LOSS,) if chunked_loss else ()
    name = f"{low} + chunked loss" if chunked_loss else low  # what every later rung starts with
    rungs = [Rung("as configured", precision, cost="none", configured=tuple(configured))]
    if low != precision:
        rungs.append(Rung(low, low, cost="none on bf16 hardware; loss within ~2% of fp32"))
    if chunked_loss:
        rungs.append(Rung(name, low, loss, cost="none: the same maths without the full logits"))
    lossy = "8-bit optimizer states (lossy, small)"
    if world_size > 1:
        rungs += _sharding_rungs(name, low, configured_sharding, loss)
        plain = _checkpoint_rungs(name, low, fewest, loss, ())
        rungs += plain[1:] if configured_sharding in _FSDP else plain  # as _sharding_rungs
        if swap and configured_sharding in (None, "ddp"):  # bitsandbytes steps whole tensors
            rungs.append(
                Rung(f"{name} + {eight} + checkpoint all blocks", low,
                     (*loss, *swap, CHECKPOINT_ALL), cost=f"{lossy}; recompute every block")
            )  # fmt: skip
        if frozen_4bit and configured_sharding in (None, "ddp"):  # 4-bit weights are not sharded
            rungs.append(_4bit_rungs(name, low, fewest, loss, swap, eight)[-1])
    else:
        if swap:
            rungs.append(Rung(f"{name} + {eight}", low, (*loss, *swap), cost=lossy))
        plain_fewest, plain_all = _checkpoint_rungs(name, low, fewest, loss, ())
        rungs.append(plain_fewest)
        if swap:
            rungs.append(_checkpoint_rungs(name, low, fewest, loss, swap, eight)[0])
        rungs.append(plain_all)
        if swap:
            rungs.append(_checkpoint_rungs(name, low, fewest, loss, swap, eight)[1])
        if long_context:
            rungs.append(_long_context_rung(plain_all))
        if frozen_4bit:
            rungs += _4bit_rungs(name, low, fewest, loss, swap, eight)
            if long_context:
                rungs.append(_long_context_rung(rungs[-1]))
    if bf16_weights and world_size == 1 and eight == "adamw8bit":
        if bf16 or precision == "bf16-true":
            rungs += _bf16_weight_rungs(loss)
    if accumulate_grad_batches == 1 and world_size == 1 and eight:
        rungs.append(
            Rung(
                f"{name} + {eight} in backward + checkpoint all blocks",
                low,
                (*loss, optimizer_swap(eight, in_backward=True), CHECKPOINT_ALL),
                cost="no gradient clipping or accumulation",
            )
        )
    if offloadable(family):
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


def _checkpoint_rungs(
    name: str,
    low: str,
    fewest: Part,
    loss: tuple[Part, ...],
    swap: tuple[Part, ...],
    eight: str | None = None,
) -> list[Rung]:
    """Checkpointing the fewest blocks, then every block (with ``swap``'s 8-bit states, if any)."""
    with_swap = f" + {eight}" if swap else ""
    return [
        Rung(
            f"{name}{with_swap} + checkpoint fewest blocks",
            low,
            (*loss, *swap, fewest),
            cost="recompute some blocks' forward",
        ),
        Rung(
            f"{name}{with_swap} + checkpoint all blocks",
            low,
            (*loss, *swap, CHECKPOINT_ALL),
            cost="recompute every block's forward (~+30% step time)",
        ),
    ]


def _long_context_rung(rung: Rung) -> Rung:
    """``rung`` (which checkpoints every block) with :data:`LONG_CONTEXT` in its place."""
    parts = tuple(LONG_CONTEXT if p == CHECKPOINT_ALL else p for p in rung.callbacks)
    return Rung(
        f"{rung.name}, boundaries on host + tiled",
        rung.precision,
        parts,
        cost=f"{rung.cost}; same maths: the blocks' inputs to pinned host memory and back "
        "(overlapped on CUDA: expected, not measured), position-wise layers in tiles (CPU step "
        "x1.01 and x1.55 with 64-token tiles: benchmarks/long_context.py)",
    )


def _bf16_weight_rungs(loss: tuple[Part, ...]) -> list[Rung]:
    """bf16 weights with stochastic rounding (``adamw_sr``, then ``adamw8bit_sr``), every block
    checkpointed; the cost names the quality gate's held-out loss against fp32 masters."""
    name = "bf16-true + chunked loss" if loss else "bf16-true"
    return [
        Rung(
            f"{name} + {swap} + checkpoint all blocks",
            "bf16-true",
            (*loss, optimizer_swap(swap), CHECKPOINT_ALL),
            cost=f"bf16 weights: {gate_summary(swap)}; recompute every block's forward",
        )
        for swap in BF16_WEIGHT_RUNGS
    ]


def _4bit_rungs(
    name: str,
    low: str,
    fewest: Part,
    loss: tuple[Part, ...],
    swap: tuple[Part, ...],
    eight: str | None,
) -> list[Rung]:
    """4-bit frozen weights alone, with the fewest checkpointed blocks, then with every block
    (and ``swap``'s 8-bit states, if any): see :func:`default_ladder`."""
    four = f"{name} + 4-bit frozen weights"
    lossy = "frozen weights in NF4 (lossy), dequantized in every forward and backward"
    with_swap = f" + {eight}" if swap else ""
    return [
        Rung(four, low, (*loss, FROZEN_4BIT), cost=lossy),
        Rung(
            f"{four} + checkpoint fewest blocks",
            low,
            (*loss, FROZEN_4BIT, fewest),
            cost=f"{lossy}; recompute some blocks' forward",
        ),
        Rung(
            f"{four}{with_swap} + checkpoint all blocks",
            low,
            (*loss, *swap, FROZEN_4BIT, CHECKPOINT_ALL),
            cost=f"{lossy}; recompute every block's forward",
        ),
    ]


def extended_by(rung: Rung, earlier: Sequence[Rung]) -> list[Rung]:
    """The rungs of ``earlier`` that ``rung`` extends: the same precision and configured
    techniques, each of their parts in ``rung`` too and their strategy (if any) ``rung``'s, and
    ``rung`` adds a part or a strategy. A rung that needs no less memory than a rung it extends
    saves nothing by what it adds (8-bit states on tensors that stay 32-bit, ZeRO offload of a
    tiny optimizer state): the search passes it over and says so."""
    out = []
    for base in earlier:
        if base is rung or base.precision != rung.precision or base.configured != rung.configured:
            continue
        if base.strategy is not None and base.strategy != rung.strategy:
            continue
        more = [p.extends for p in rung.callbacks if p.extends in base.callbacks]
        if not all(part in rung.callbacks or part in more for part in base.callbacks):
            continue
        adds = (
            len(rung.callbacks) > len(base.callbacks)
            or bool(more)
            or (rung.strategy is not None and base.strategy is None)
        )
        if adds:
            out.append(base)
    return out


def trains_without_cache(rung: Rung) -> bool:
    """Whether AutoEfficient trains ``rung`` without a Hugging Face model's key/value cache
    (``measure.memory.kv_cache.apply_training_without_cache``): a rung that adds techniques does
    (a training forward never reads the cache); "as configured" and a precision alone keep the
    model as configured. The search estimates and tries each rung the same way."""
    return bool(rung.callbacks)


#: Shardings that divide at least the optimizer state, gradients and parameters in flight as
#: much as SHARD_GRAD_OP does (a grad_op rung adds nothing to them), and as much as FULL_SHARD.
_AT_LEAST_GRAD_OP = ("zero2", "zero3", "grad_op", "full")
_AT_LEAST_FULL = ("zero3", "full")
#: The configured shardings of ``FullyShardedStrategy`` (FSDP2: the module is sharded in place).
_FSDP = ("grad_op", "full")


def _sharding_rungs(
    name: str, low: str, configured_sharding: str | None, loss: tuple[Part, ...]
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
    # no "fewest blocks" rung sharded: its budget search estimates the module at the first
    # batch, which fully_shard has sharded by then (ActivationCheckpointing refuses it)
    rungs.append(
        Rung(
            f"{name} + FSDP full + checkpoint all blocks",
            low,
            (*loss, CHECKPOINT_ALL),
            FSDP_FULL,
            cost="+ recompute every block's forward (~+30% step time)",
        )
    )
    return rungs
