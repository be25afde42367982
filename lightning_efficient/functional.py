"""The functions a user composes without Lightning (no trainer needed).

One verb style: ``apply_*`` changes a module, an optimizer, a loader or the process's flags and
returns a ``Change`` (``core/change.py``): ``what`` it did, its ``figures``, the ``value`` to
work with next (the names wrapped, the new optimizer or loader) and ``undo()``; ``with
apply_x(...) as change:`` undoes on leaving the block. Next to them: the measurements and
decisions that pick the arguments (``find_repeated_blocks``, ``rank_blocks``, ``blocks_for_budget``,
``largest_fitting_batch``, ``tune_num_workers``, ...), what a training loop of one's own calls
each step (``sequence_length_at``/``cut_batch``, ``micro_batch_step``, ``count`` and
``window_factor`` for exact accumulation, ``PlateauTracker``, ``DivergenceDetector``), the
samplers, and the ZeRO checkpoint tools.

Every other helper stays importable from its module (e.g. ``format_bytes`` from
``lightning_efficient.core.validate``, ``rebuild_dataloader`` from
``lightning_efficient.techniques.dataloading``).
"""

from lightning_efficient.core.change import Change
from lightning_efficient.core.kv_cache import apply_training_without_cache
from lightning_efficient.measure.memory.optimizer_models import optimizer_state_bytes
from lightning_efficient.techniques._blocks import find_repeated_blocks
from lightning_efficient.techniques.accumulation.weighting import count, window_factor
from lightning_efficient.techniques.activation_checkpointing import (
    apply_activation_checkpointing,
    blocks_for_budget,
    checkpointed_blocks,
    rank_blocks,
)
from lightning_efficient.techniques.batch_size.sizing import largest_fitting_batch
from lightning_efficient.techniques.batch_size.split import micro_batch_step
from lightning_efficient.techniques.chunked_loss import apply_chunked_cross_entropy
from lightning_efficient.techniques.compile import apply_compile, compiled_modules
from lightning_efficient.techniques.curriculum.difficulty import difficulty_scores
from lightning_efficient.techniques.curriculum.sampler import CurriculumSampler, apply_sampler
from lightning_efficient.techniques.curriculum.schedule import sequence_length_at
from lightning_efficient.techniques.curriculum.sequence import cut_batch
from lightning_efficient.techniques.dataloading.buckets import LengthBucketSampler, padding_stats
from lightning_efficient.techniques.dataloading.preload import preloaded_loader
from lightning_efficient.techniques.dataloading.rebuild import tuned_loader
from lightning_efficient.techniques.dataloading.workers import tune_num_workers
from lightning_efficient.techniques.early_stopping import DivergenceDetector, PlateauTracker
from lightning_efficient.techniques.optimizers.build import apply_optimizer_swap
from lightning_efficient.techniques.optimizers.in_backward import apply_optimizer_in_backward
from lightning_efficient.techniques.precision import (
    apply_float8,
    apply_matmul_precision,
    best_precision,
)
from lightning_efficient.techniques.quantize import apply_frozen_weights_4bit
from lightning_efficient.techniques.zero_offload import export_fp32, zero_offload_config

__all__ = [
    # what changes a module, an optimizer, a loader or the flags: a Change with its undo
    "Change",
    "apply_activation_checkpointing",
    "apply_chunked_cross_entropy",
    "apply_compile",
    "apply_float8",
    "apply_frozen_weights_4bit",
    "apply_matmul_precision",
    "apply_optimizer_swap",
    "apply_optimizer_in_backward",
    # new loaders with their report line (the given loader is not changed)
    "tuned_loader",
    "preloaded_loader",
    "apply_sampler",
    "apply_training_without_cache",
    # what is applied now
    "checkpointed_blocks",
    "compiled_modules",
    # measurements and decisions that pick the arguments
    "find_repeated_blocks",
    "rank_blocks",
    "blocks_for_budget",
    "largest_fitting_batch",
    "tune_num_workers",
    "optimizer_state_bytes",
    "padding_stats",
    "best_precision",
    "difficulty_scores",
    # a training loop of one's own
    "sequence_length_at",
    "cut_batch",
    "micro_batch_step",
    "count",
    "window_factor",
    "PlateauTracker",
    "DivergenceDetector",
    "CurriculumSampler",
    "LengthBucketSampler",
    # ZeRO checkpoints and configs
    "zero_offload_config",
    "export_fp32",
]
