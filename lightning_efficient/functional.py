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

from lightning_efficient.techniques.dataloading import (  # noqa: E402
    LengthBucketSampler,
    auto_num_workers,
    padding_stats,
    preload_to_device,
    rebuild_dataloader,
    tune_num_workers,
)

__all__ += [
    "rebuild_dataloader",
    "auto_num_workers",
    "tune_num_workers",
    "preload_to_device",
    "LengthBucketSampler",
    "padding_stats",
]

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
