"""One module per technique: pure functions plus a thin Callback or Strategy.

``TECHNIQUES`` lists every technique class of this floor; ``lightning_efficient.TECHNIQUES`` adds
``AutoEfficient`` (on the planning floor above, :mod:`lightning_efficient.planning`), and is what
the contract tests and the CLI use.
"""

from lightning_efficient.core.technique import NoEffectWarning, Technique
from lightning_efficient.measure.memory.breakdown import MemoryBreakdown
from lightning_efficient.measure.profiling.profiler import StepProfiler
from lightning_efficient.measure.speed.input_stall import InputStallMonitor
from lightning_efficient.techniques.accumulation import ExactAccumulation
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
from lightning_efficient.techniques.batch_size import EfficientBatchSize, OOMRecovery
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy
from lightning_efficient.techniques.compile import TorchCompile
from lightning_efficient.techniques.curriculum import (
    Curriculum,
    CurriculumSampler,
    SequenceLengthWarmup,
)
from lightning_efficient.techniques.dataloading import (
    DataLoaderTuning,
    DevicePreload,
    LengthBucketSampler,
)
from lightning_efficient.techniques.early_stopping import DivergenceGuard, EarlyStopper
from lightning_efficient.techniques.fsdp import FullyShardedStrategy
from lightning_efficient.techniques.optimizers import OptimizerSwap
from lightning_efficient.techniques.packing import SequencePacking
from lightning_efficient.techniques.precision import Float8Training, MatmulPrecision
from lightning_efficient.techniques.quantize import FrozenWeights4bit
from lightning_efficient.techniques.zero_offload import ZeROOffload

#: Every technique class of the package (callbacks and strategies), in documentation order.
TECHNIQUES: list[type] = [
    MemoryBreakdown,
    StepProfiler,
    ActivationCheckpointing,
    ChunkedCrossEntropy,
    OptimizerSwap,
    FrozenWeights4bit,
    MatmulPrecision,
    Float8Training,
    TorchCompile,
    EfficientBatchSize,
    OOMRecovery,
    ExactAccumulation,
    DataLoaderTuning,
    DevicePreload,
    InputStallMonitor,
    Curriculum,
    SequenceLengthWarmup,
    SequencePacking,
    ZeROOffload,
    FullyShardedStrategy,
    EarlyStopper,
    DivergenceGuard,
]

__all__ = [
    "Technique",
    "NoEffectWarning",
    "TECHNIQUES",
    "LengthBucketSampler",
    "CurriculumSampler",
] + [c.__name__ for c in TECHNIQUES]
