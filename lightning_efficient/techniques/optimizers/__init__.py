"""Memory-lean optimizers for an unmodified LightningModule: 8-bit, paged, Adafactor, fused,
optimizer-in-backward, and compensated updates for bf16 weights (:mod:`.bf16`).

Pure functions (no Lightning needed; ``apply_optimizer_swap`` and ``apply_optimizer_in_backward``
are in :mod:`lightning_efficient.functional`):

- :func:`optimizer_class` / :func:`build_optimizer`: an optimizer by short name or class path
  (:mod:`.build`, which also says how param groups carry over).
- :func:`swap_optimizer`: a new optimizer of another kind over the same param groups.
- :func:`repoint_scheduler` / :func:`rebind_schedulers`: LR schedulers now drive the new
  optimizer (:mod:`.schedulers`).
- :func:`attach_optimizer_in_backward`: step each parameter from its post-accumulate-grad hook
  and free its gradient at once (:mod:`.in_backward`).
- :mod:`.checkpoint`: what a checkpoint holds and what a resumed run restores.

:class:`OptimizerSwap` (:mod:`.callback`) is the thin callback that decides *when*. The
estimate-only state models (:class:`EightBitStateModel`, :class:`AdafactorStateModel`) and
:func:`optimizer_state_bytes` live in :mod:`lightning_efficient.measure.memory.optimizer_models`.
"""

from lightning_efficient.techniques.optimizers.bf16 import BF16_NAMES
from lightning_efficient.techniques.optimizers.build import (
    EIGHT_BIT_NAMES,
    NAMES,
    accepted_options,
    build_optimizer,
    eight_bit_saves_nothing,
    embedding_parameters,
    optimizer_class,
    swap_optimizer,
)
from lightning_efficient.techniques.optimizers.callback import OptimizerSwap
from lightning_efficient.techniques.optimizers.in_backward import (
    InBackwardOptimizer,
    attach_optimizer_in_backward,
)
from lightning_efficient.techniques.optimizers.schedulers import (
    rebind_schedulers,
    repoint_scheduler,
)

__all__ = [
    "NAMES",
    "EIGHT_BIT_NAMES",
    "BF16_NAMES",
    "optimizer_class",
    "accepted_options",
    "build_optimizer",
    "swap_optimizer",
    "repoint_scheduler",
    "rebind_schedulers",
    "embedding_parameters",
    "eight_bit_saves_nothing",
    "attach_optimizer_in_backward",
    "InBackwardOptimizer",
    "OptimizerSwap",
]
