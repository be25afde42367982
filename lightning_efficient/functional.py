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
from lightning_efficient.techniques.compile import compile_modules, compiled_modules, uncompile_modules  # noqa: E402
from lightning_efficient.techniques.precision import (  # noqa: E402
    best_precision,
    convert_to_float8,
    restore_matmul_precision,
    set_matmul_precision,
)

__all__ += [
    "best_precision",
    "set_matmul_precision",
    "restore_matmul_precision",
    "convert_to_float8",
    "compile_modules",
    "uncompile_modules",
    "compiled_modules",
]
