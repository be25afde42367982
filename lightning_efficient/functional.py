"""The pure functions behind every technique, usable without Lightning."""

from lightning_efficient._validate import format_bytes, parse_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules
from lightning_efficient.techniques.optimizers import (
    attach_optimizer_in_backward,
    build_optimizer,
    embedding_parameters,
    optimizer_state_bytes,
    repoint_scheduler,
    swap_optimizer,
)

__all__ = ["find_repeated_blocks", "select_modules", "parse_bytes", "format_bytes"]
__all__ += [
    "build_optimizer",
    "swap_optimizer",
    "repoint_scheduler",
    "attach_optimizer_in_backward",
    "embedding_parameters",
    "optimizer_state_bytes",
]
