"""The pure functions behind every technique, usable without Lightning."""

from lightning_efficient._validate import format_bytes, parse_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules

from lightning_efficient.techniques.batch_size import (
    accumulation_for,
    choose_micro_batch,
    chunk_weights,
    count_tokens,
    largest_fitting_batch,
    longest_sample,
    micro_batch_step,
    round_batch_size,
    split_batch,
    worst_case_batch,
)

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
__all__ += [
    "round_batch_size",
    "accumulation_for",
    "choose_micro_batch",
    "largest_fitting_batch",
    "longest_sample",
    "worst_case_batch",
    "split_batch",
    "count_tokens",
    "chunk_weights",
    "micro_batch_step",
]
