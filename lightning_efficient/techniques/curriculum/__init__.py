"""Curriculum learning: easiest samples first (``Curriculum``) and short sequences first
(``SequenceLengthWarmup``), on an unmodified module and datamodule.

Pure functions (no Lightning needed; the ones a user composes are in
``lightning_efficient.functional``):

- ``schedule``: ``pacing_fraction``, ``pool_size``, ``sequence_length_at``, ``reshape_length``.
- ``difficulty``: ``difficulty_scores`` (entropy, length, a dataset attribute or field, a callable
  by import path, a scores file), ``easiest_first``.
- ``sampler``: ``CurriculumSampler`` (a DistributedSampler: disjoint shards per rank, exact
  mid-epoch resume), ``pool_walk``, ``with_sampler``.
- ``sequence``: ``cut_batch`` (truncate or reshape a tensor / tuple / dict batch),
  ``sequence_shape``.

Callbacks (they only decide *when*): ``Curriculum`` and ``SequenceLengthWarmup``.
Not built: the self-paced mode (difficulty from the module's per-sample training loss).
"""

from lightning_efficient.techniques.curriculum.callback import Curriculum, SequenceLengthWarmup
from lightning_efficient.techniques.curriculum.difficulty import (
    DIFFICULTY_BUILTINS,
    difficulty_scores,
    easiest_first,
    load_scores,
    token_count,
    token_entropy,
)
from lightning_efficient.techniques.curriculum.sampler import (
    CurriculumSampler,
    pool_walk,
    with_sampler,
)
from lightning_efficient.techniques.curriculum.schedule import (
    PACINGS,
    pacing_fraction,
    pool_size,
    reshape_length,
    sequence_length_at,
    total_steps,
)
from lightning_efficient.techniques.curriculum.sequence import (
    CUT_MODES,
    cut_batch,
    describe_batch,
    sequence_shape,
)

__all__ = [
    "Curriculum",
    "SequenceLengthWarmup",
    "CurriculumSampler",
    "DIFFICULTY_BUILTINS",
    "PACINGS",
    "CUT_MODES",
    "pacing_fraction",
    "pool_size",
    "sequence_length_at",
    "reshape_length",
    "total_steps",
    "difficulty_scores",
    "easiest_first",
    "load_scores",
    "token_entropy",
    "token_count",
    "pool_walk",
    "with_sampler",
    "cut_batch",
    "sequence_shape",
    "describe_batch",
]
