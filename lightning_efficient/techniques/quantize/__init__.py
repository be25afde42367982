"""Frozen weights stored in 4 bits for fine-tuning (QLoRA's NF4; see docs/quantize.md).

- :mod:`.weights`: ``select_frozen_linears`` (which layers, and why the others stay) and
  ``apply_frozen_weights_4bit`` (the change, with its exact undo).
- :mod:`.callback`: ``FrozenWeights4bit``, the callback.
"""

from lightning_efficient.techniques.quantize.callback import FrozenWeights4bit
from lightning_efficient.techniques.quantize.weights import (
    FROZEN_SHARE,
    QUANT_TYPES,
    Selection,
    apply_frozen_weights_4bit,
    compute_dtype_for,
    frozen_linear_share,
    linear_weight_bytes,
    select_frozen_linears,
    worth_quantizing,
)

__all__ = [
    "FROZEN_SHARE",
    "QUANT_TYPES",
    "FrozenWeights4bit",
    "Selection",
    "apply_frozen_weights_4bit",
    "compute_dtype_for",
    "linear_weight_bytes",
    "select_frozen_linears",
    "frozen_linear_share",
    "worth_quantizing",
]
