"""Activation checkpointing for any model, with no opt-in from the model.

The parts, lowest first:

- ``offload.py``: host offload of saved activations (``saved_tensors_hooks``, CUDA tensors only).
- ``recompute.py``: the in-place wrapper of one block: its instance ``forward`` runs the original
  under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG state preserved;
  ``selective`` keeps matmul and attention outputs and recomputes only the cheap ops.
- ``apply.py``: ``apply_activation_checkpointing`` (a ``Change`` whose ``undo()`` puts the
  wrapping back) and ``remove_activation_checkpointing``. No module is replaced or renamed, so
  ``state_dict`` keys never change. Blocks are selected by ``techniques._blocks.select_modules``
  (``"auto"``: the repeated blocks, or a class, class name, name glob or ``"re:<regex>"``).
- ``savings.py``: what checkpointing a group of blocks frees, measured by the memory estimate.
- ``choose.py``: the one decision, ``choose_blocks``: ``"auto"`` resolved to the group that frees
  the most (``rank_blocks``), then with a budget the fewest blocks that bring the estimated peak
  under it (``blocks_for_budget``). The estimate and the first training batch both call it.
- ``callback.py``: ``ActivationCheckpointing``, the Lightning callback; it decides when.
"""

from lightning_efficient.techniques.activation_checkpointing.apply import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    remove_activation_checkpointing,
)
from lightning_efficient.techniques.activation_checkpointing.callback import (
    ActivationCheckpointing,
)
from lightning_efficient.techniques.activation_checkpointing.choose import (
    BlockChoice,
    BudgetChoice,
    blocks_for_budget,
    choose_blocks,
    rank_blocks,
)
from lightning_efficient.techniques.activation_checkpointing.recompute import SELECTIVE_SAVE_OPS
from lightning_efficient.techniques.activation_checkpointing.savings import BlockRanking

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "blocks_for_budget",
    "BudgetChoice",
    "BlockChoice",
    "choose_blocks",
    "rank_blocks",
    "BlockRanking",
    "SELECTIVE_SAVE_OPS",
]
