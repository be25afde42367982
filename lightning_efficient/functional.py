"""The pure functions behind every technique, usable without Lightning (no trainer needed)."""

from lightning_efficient.core.validate import (
    format_bytes,
    parse_bytes,
)
from lightning_efficient.techniques._blocks import (
    find_repeated_blocks,
    select_modules,
)
from lightning_efficient.techniques.activation_checkpointing import (
    apply_activation_checkpointing,
    blocks_for_budget,
    checkpointed_blocks,
    remove_activation_checkpointing,
)
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
from lightning_efficient.techniques.compile import (
    compile_modules,
    compiled_modules,
    uncompile_modules,
)
from lightning_efficient.techniques.dataloading import (
    LengthBucketSampler,
    auto_num_workers,
    padding_stats,
    preload_to_device,
    rebuild_dataloader,
    tune_num_workers,
)
from lightning_efficient.techniques.optimizers import (
    attach_optimizer_in_backward,
    build_optimizer,
    embedding_parameters,
    optimizer_state_bytes,
    repoint_scheduler,
    swap_optimizer,
)
from lightning_efficient.techniques.precision import (
    best_precision,
    convert_to_float8,
    restore_matmul_precision,
    set_matmul_precision,
)
from lightning_efficient.techniques.zero_offload import (
    export_fp32,
    full_state_dict,
    host_buffers,
    load_zero_optimizer_state,
    offloaded_categories,
    rebind_schedulers,
    scale_buckets,
    to_deepspeed_optimizer,
    zero_offload_config,
    zero_optimizer_state,
)

__all__ = [
    "format_bytes",
    "parse_bytes",
    "find_repeated_blocks",
    "select_modules",
    "apply_activation_checkpointing",
    "blocks_for_budget",
    "checkpointed_blocks",
    "remove_activation_checkpointing",
    "attach_optimizer_in_backward",
    "build_optimizer",
    "embedding_parameters",
    "optimizer_state_bytes",
    "repoint_scheduler",
    "swap_optimizer",
    "accumulation_for",
    "choose_micro_batch",
    "chunk_weights",
    "count_tokens",
    "largest_fitting_batch",
    "longest_sample",
    "micro_batch_step",
    "round_batch_size",
    "split_batch",
    "worst_case_batch",
    "best_precision",
    "convert_to_float8",
    "restore_matmul_precision",
    "set_matmul_precision",
    "compile_modules",
    "compiled_modules",
    "uncompile_modules",
    "LengthBucketSampler",
    "auto_num_workers",
    "padding_stats",
    "preload_to_device",
    "rebuild_dataloader",
    "tune_num_workers",
    "export_fp32",
    "full_state_dict",
    "host_buffers",
    "load_zero_optimizer_state",
    "offloaded_categories",
    "rebind_schedulers",
    "scale_buckets",
    "to_deepspeed_optimizer",
    "zero_offload_config",
    "zero_optimizer_state",
]
