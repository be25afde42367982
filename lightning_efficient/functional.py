"""The pure functions behind every technique, usable without Lightning."""

from lightning_efficient._validate import format_bytes, parse_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules

__all__ = ["find_repeated_blocks", "select_modules", "parse_bytes", "format_bytes"]
from lightning_efficient.techniques.activation_checkpointing import (  # noqa: E402
    apply_activation_checkpointing,
    blocks_for_budget,
    checkpointed_blocks,
    remove_activation_checkpointing,
)

__all__ += [
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "blocks_for_budget",
]
