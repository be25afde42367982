"""The pure functions behind every technique, usable without Lightning."""

from lightning_efficient._validate import format_bytes, parse_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules

from lightning_efficient.techniques.zero_offload import (
    export_fp32,
    full_state_dict,
    load_zero_optimizer_state,
    offloaded_categories,
    rebind_schedulers,
    scale_buckets,
    to_deepspeed_optimizer,
    zero_offload_config,
    zero_optimizer_state,
)

__all__ = ["find_repeated_blocks", "select_modules", "parse_bytes", "format_bytes"]
__all__ += [
    "zero_offload_config",
    "scale_buckets",
    "to_deepspeed_optimizer",
    "rebind_schedulers",
    "zero_optimizer_state",
    "load_zero_optimizer_state",
    "export_fp32",
    "full_state_dict",
    "offloaded_categories",
]
