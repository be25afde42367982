"""The technique contract (DESIGN.md), one test per item, parametrized over one registry.

Every technique registers a ``Case`` in ``CASES`` below. ``REFERENCE`` is a real Lightning
callback (``EarlyStopping``) that runs through the same tests, so the tests are shown to work
even for properties no technique of ours has yet. Adding a technique: the checklist in
``tests/techniques/README.md`` (folder, registry, this case, tests, benchmark, card, CHANGELOG).
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from given import Snapshot
from helpers import SaveAt, fit, launch, params_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import EarlyStopping

from benchmarks.workloads import tiny_data, tiny_model
from lightning_efficient.commands.cli import EfficientCLI
from lightning_efficient.core.change import changes_for
from lightning_efficient.core.report import report_for

MULTIPROCESS = Path(__file__).parents[1] / "multiprocess"


@dataclass
class Case:
    """How the contract tests exercise one technique.

    cls / init_args: the class and the arguments of a test-friendly instance (also the yaml).
    bad_args: ``(kwargs, argument name)`` pairs that must fail at construction.
    fuzz: argument name -> hypothesis strategy of *wrong* values for it.
    kind: "callback" or "strategy".
    stateful: the technique has ``state_dict``; resume must equal an uninterrupted run.
    state_changes: its state differs between step k and 2k (resume test checks it).
    same_maths: losses equal the plain run within ``rtol``/``atol`` (contract item 6).
    ddp: True, or the message a DDP run must fail with when the technique refuses DDP.
    reports: the technique adds a row to the efficiency report (contract item 8).
    trainer_kwargs: extra Trainer arguments the technique needs in tests.
    keeps: for a strategy whose result is the module changed (sharded parameters), the function
        that makes only that change on a fresh module: a fit that raises leaves the module as
        this alone leaves it (nothing else of the fit's).
    """

    cls: type
    init_args: dict[str, Any] = field(default_factory=dict)
    bad_args: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    fuzz: dict[str, Any] = field(default_factory=dict)
    kind: str = "callback"
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
    stateful: bool = False
    state_changes: bool = True
    same_maths: bool = True
    rtol: float = 1e-5
    atol: float = 1e-6
    ddp: bool | str = True
    reports: bool = True
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    keeps: Any = None
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or self.cls.__name__

    def make(self) -> Any:
        return self.cls(**self.init_args)

    def given(self, model: Any) -> Any:
        """The module as its user gives it to the fit (as built, unless a case says otherwise)."""
        return model

    def fit(self, tmp_path: Any, *, with_technique: bool = True, callbacks: Any = (), **kw: Any):
        trainer_kwargs = {**self.trainer_kwargs, **kw}
        extra = list(callbacks)
        if with_technique:
            if self.kind == "strategy":
                trainer_kwargs["strategy"] = self.make()
            else:
                extra.insert(0, self.make())
        return fit(tmp_path, extra, **trainer_kwargs)


REFERENCE = Case(
    EarlyStopping,
    init_args={"monitor": "val_loss", "patience": 100, "min_delta": 0.0},
    bad_args=[({"monitor": "val_loss", "mode": "sideways"}, "mode")],
    fuzz={"mode": st.text(max_size=8).filter(lambda s: s not in ("min", "max"))},
    errors=(MisconfigurationException,),
    stateful=True,
    reports=False,
    trainer_kwargs={"val_check_interval": 2},
    id="reference-EarlyStopping",
)

#: One entry per technique of the package. Techniques register themselves here.
CASES: list[Case] = []

# the instrument's tracking callback (issue 3)
from lightning_efficient.measure.memory.breakdown import MemoryBreakdown  # noqa: E402

CASES.append(
    Case(
        MemoryBreakdown,
        init_args={"sample_steps": [1]},
        bad_args=[
            ({"sample_steps": [-1]}, "sample_steps"),
            ({"sample_steps": "1"}, "sample_steps"),
            ({"sample_steps": []}, "sample_steps"),
            ({"print_table": "yes"}, "print_table"),
        ],
        fuzz={
            "sample_steps": st.one_of(
                st.integers(max_value=-1).map(lambda i: [i]),
                st.text(),
                st.lists(st.floats(), min_size=1),
                st.just([]),
                st.integers(),
            ),
            "log_metrics": st.one_of(st.integers(), st.text(), st.none()),
        },
    )
)

# the instrument's profiler (issue 13): measures, changes nothing
from lightning_efficient.measure.profiling.profiler import StepProfiler  # noqa: E402

CASES.append(
    Case(
        StepProfiler,
        init_args={"skip_steps": 1, "print_table": False},
        bad_args=[
            ({"skip_steps": -1}, "skip_steps"),
            ({"flops_per_step": 0}, "flops_per_step"),
            ({"memory_budget": "lots"}, "memory_budget"),
            ({"trace": 3}, "trace"),
            ({"compare_plain": "yes"}, "compare_plain"),
        ],
        fuzz={
            "skip_steps": st.integers(max_value=-1) | st.floats() | st.text(max_size=4),
            "peak_flops": st.floats(max_value=0.0) | st.text(max_size=4) | st.booleans(),
            "memory_budget": st.integers(max_value=0) | st.sampled_from(["lots", "-1GiB"]),
            "print_table": st.integers() | st.text(max_size=4) | st.none(),
        },
    )
)

from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing  # noqa: E402

CASES.append(
    Case(
        ActivationCheckpointing,
        init_args={"policy": "auto", "every_n": 1},
        bad_args=[
            ({"every_n": 0}, "every_n"),
            ({"policy": 3}, "policy"),
            ({"policy": "re:(unclosed"}, "policy"),
            ({"budget": "twelve gigs"}, "budget"),
            ({"selective": "yes"}, "selective"),
        ],
        fuzz={
            "every_n": st.integers(max_value=0) | st.floats() | st.text(max_size=4),
            "policy": st.integers() | st.floats() | st.just("") | st.just("re:[") | st.just([]),
            "budget": st.integers(max_value=0)
            | st.booleans()
            | st.sampled_from(["lots", "-1GiB", "12 parsecs"]),
            "offload_activations": st.integers() | st.text(max_size=4),
        },
        same_maths=True,
        id="ActivationCheckpointing",
    )
)
# long context (issue 53): boundaries in host memory, MLPs in tiles of 8 of the 32 tokens
CASES.append(
    Case(
        ActivationCheckpointing,
        init_args={"policy": r"re:blocks\.\d+$", "offload_boundaries": True, "tile_sequence": 8},
        bad_args=[
            ({"tile_sequence": 0}, "tile_sequence"),
            ({"tile_sequence": "wide"}, "tile_sequence"),
            ({"offload_boundaries": "yes"}, "offload_boundaries"),
        ],
        fuzz={
            "tile_sequence": st.integers(max_value=0)
            | st.floats()
            | st.text(max_size=4).filter(lambda s: s != "auto"),
            "offload_boundaries": st.integers() | st.text(max_size=4),
        },
        same_maths=True,
        id="ActivationCheckpointing-long-context",
    )
)

# -- data pipeline (techniques/dataloading/) -----------------------------------------------------
from lightning_efficient.measure import InputStallMonitor  # noqa: E402
from lightning_efficient.techniques.dataloading import DataLoaderTuning, DevicePreload  # noqa: E402

CASES += [
    Case(
        DataLoaderTuning,
        init_args={"num_workers": 1, "pin_memory": False},
        bad_args=[
            ({"num_workers": -1}, "num_workers"),
            ({"num_workers": 0, "prefetch_factor": 2}, "prefetch_factor"),
            ({"pin_memory": "yes"}, "pin_memory"),
            ({"tune": "yes"}, "tune"),
        ],
        fuzz={
            "num_workers": st.integers(max_value=-1)
            | st.text(max_size=6).filter(lambda s: s != "auto"),
            "prefetch_factor": st.integers(max_value=0),
        },
    ),
    Case(
        DevicePreload,
        init_args={"max_bytes": "64MiB"},
        bad_args=[({"max_bytes": "lots"}, "max_bytes"), ({"max_bytes": -5}, "max_bytes")],
        fuzz={"max_bytes": st.integers(max_value=0)},
    ),
    Case(
        InputStallMonitor,
        init_args={"threshold": 0.1, "check_after": 2},
        bad_args=[({"threshold": 1.5}, "threshold"), ({"check_after": 0}, "check_after")],
        fuzz={
            "threshold": st.floats(min_value=1.0) | st.floats(max_value=-0.001),
            "check_after": st.integers(max_value=0),
        },
    ),
]

# -- chunked cross-entropy (issue 28): the same maths, so losses equal the plain run's
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy  # noqa: E402

CASES.append(
    Case(
        ChunkedCrossEntropy,
        init_args={"chunk_bytes": "64KiB"},
        bad_args=[
            ({"backend": "triton"}, "backend"),
            ({"chunk_bytes": "lots"}, "chunk_bytes"),
            ({"chunk_bytes": 1024}, "chunk_bytes"),
            ({"head": ""}, "head"),
            ({"head": 3}, "head"),
        ],
        fuzz={
            "backend": st.text(max_size=8).filter(
                lambda s: s not in ("auto", "chunked", "liger", "cce")
            ),
            "chunk_bytes": st.integers(max_value=2**16 - 1) | st.sampled_from(["lots", "-1MiB"]),
            "head": st.integers() | st.just(""),
        },
    )
)

# -- curriculum (issue 15): another order / shorter sequences, so not the plain run's maths; at
# initialisation every batch's loss is close to ln(256), so the first losses stay within 10%
from lightning_efficient.techniques.curriculum import (  # noqa: E402
    PACINGS,
    Curriculum,
    SequenceLengthWarmup,
)

CASES += [
    Case(
        Curriculum,
        init_args={"difficulty": "entropy", "start_fraction": 0.25, "duration": 4},
        bad_args=[
            ({"difficulty": "hardness"}, "difficulty"),
            ({"difficulty": "entropy", "pacing": "cosine"}, "pacing"),
            ({"difficulty": "entropy", "start_fraction": 0.0}, "start_fraction"),
            ({"difficulty": "entropy", "duration": 1.5}, "duration"),
            ({"difficulty": "entropy", "duration": -1}, "duration"),
            ({"difficulty": "fn:os.path.no_such_function"}, "difficulty"),
        ],
        fuzz={
            "pacing": st.text(max_size=10).filter(lambda s: s not in PACINGS) | st.integers(),
            "start_fraction": st.floats().filter(lambda f: not 0 < f <= 1) | st.text(max_size=3),
            "duration": st.integers(max_value=-1)
            | st.floats().filter(lambda f: not 0 < f <= 1)
            | st.text(max_size=3),
            "difficulty": st.text(max_size=8).filter(
                lambda s: (
                    s not in ("entropy", "length")
                    and not s.startswith(("attr:", "field:", "file:"))
                )
            )
            | st.integers(),
        },
        stateful=True,
        same_maths=False,
        rtol=0.1,
    ),
    Case(
        SequenceLengthWarmup,
        init_args={"duration": 4, "start_length": 8, "multiple_of": 8},
        bad_args=[
            ({"mode": "crop"}, "mode"),
            ({"pacing": "cosine"}, "pacing"),
            ({"multiple_of": 0}, "multiple_of"),
            ({"start_length": "short"}, "start_length"),
            ({"duration": 2.0}, "duration"),
            ({"full_length": 0}, "full_length"),
        ],
        fuzz={
            "mode": st.text(max_size=10).filter(lambda s: s not in ("truncate", "reshape")),
            "pacing": st.text(max_size=10).filter(lambda s: s not in PACINGS) | st.integers(),
            "start_length": st.integers(max_value=0) | st.floats() | st.text(max_size=3),
            "multiple_of": st.integers(max_value=0) | st.floats() | st.text(max_size=3),
            "duration": st.integers(max_value=-1) | st.floats().filter(lambda f: not 0 < f <= 1),
        },
        stateful=True,
        same_maths=False,
        rtol=0.1,
    ),
]

# -- sequence packing (issue 40): the demo's items are (input, target) pairs of one length, not
# documents with `input_ids`: the loader is left as it is (said once), so the maths is the plain
# run's; packing itself is tested in tests/techniques/test_packing.py
from lightning_efficient.techniques.packing import SequencePacking  # noqa: E402

CASES.append(
    Case(
        SequencePacking,
        init_args={"row_length": 64, "seed": 1},
        bad_args=[
            ({"row_length": 1}, "row_length"),
            ({"rows_per_batch": 0}, "rows_per_batch"),
            ({"oversize": "truncate"}, "oversize"),
            ({"seed": -1}, "seed"),
            ({"shifted_labels": "yes"}, "shifted_labels"),
        ],
        fuzz={
            "row_length": st.integers(max_value=1) | st.floats() | st.text(max_size=4),
            "oversize": st.text(max_size=8).filter(lambda s: s not in ("split", "refuse")),
            "pad_id": st.integers(max_value=-1) | st.text(max_size=3),
        },
        stateful=True,
        state_changes=False,
    )
)

from lightning_efficient.techniques.zero_offload import ZeROOffload  # noqa: E402

CASES.append(
    Case(
        ZeROOffload,
        init_args={"stage": 2, "offload_optimizer": "cpu"},
        bad_args=[
            ({"stage": 1}, "stage"),
            ({"offload_optimizer": "gpu"}, "offload_optimizer"),
            ({"offload_optimizer": "nvme"}, "nvme_path"),
            ({"stage": 2, "offload_parameters": True}, "offload_parameters"),
            ({"config": {"zero_optimization": {"stage": 3}}}, "stage"),
        ],
        fuzz={
            "stage": st.integers().filter(lambda s: s not in (2, 3)),
            "offload_optimizer": st.text(max_size=6).filter(lambda s: s not in ("cpu", "nvme")),
            "pin_memory": st.one_of(st.integers(), st.text(max_size=3)),
        },
        kind="strategy",
        # no state of its own: the optimizer state is in the checkpoint
        # (tests/techniques/test_zero_offload.py checks resume equality through ZeRO, plain -> ZeRO
        # and ZeRO -> plain)
        stateful=False,
        rtol=1e-4,
        atol=1e-5,
        # on one process keep the loader's own sampler (a distributed strategy would wrap it)
        trainer_kwargs={"use_distributed_sampler": False},
    )
)

# -- scale out (issue 17): FSDP2 on an unmodified module; on one process the maths is the plain
# run's; tests/techniques/test_fsdp.py checks 2 processes against the plain run and the techniques
# under it
from lightning_efficient.techniques.fsdp import (  # noqa: E402
    DTYPES,
    FullyShardedStrategy,
    apply_fully_shard,
)


def _sharded_alone(model: torch.nn.Module) -> None:
    """What FullyShardedStrategy's sharding alone does to a module (over this process's group,
    which a 1-process fit leaves): after a fit the module stays sharded, as Lightning's own FSDP
    strategies leave it (undoing it would need every rank to gather every parameter, which an
    exception on one rank cannot join)."""
    from torch.distributed.device_mesh import init_device_mesh

    apply_fully_shard(model, init_device_mesh("cpu", (1,)))
    model(torch.zeros(1, 8, dtype=torch.long))  # FSDP adds its state-dict hooks at the first run
    model.reshard()  # the root keeps its parameters gathered after a forward


CASES.append(
    Case(
        FullyShardedStrategy,
        init_args={"policy": "auto", "sharding": "full"},
        bad_args=[
            ({"sharding": "hybrid"}, "sharding"),
            ({"param_dtype": "int8"}, "param_dtype"),
            ({"reduce_dtype": 16}, "reduce_dtype"),
            ({"cpu_offload": "yes"}, "cpu_offload"),
            ({"policy": "re:(unclosed"}, "policy"),
            ({"process_group_backend": "mpi"}, "process_group_backend"),
        ],
        fuzz={
            "sharding": st.text(max_size=8).filter(lambda s: s not in ("full", "grad_op")),
            "param_dtype": st.text(max_size=6).filter(lambda s: s not in DTYPES) | st.integers(),
            "cpu_offload": st.integers() | st.text(max_size=4) | st.none(),
        },
        kind="strategy",
        stateful=False,
        # on one process keep the loader's own sampler (a distributed strategy would wrap it)
        trainer_kwargs={"use_distributed_sampler": False},
        keeps=_sharded_alone,
    )
)

# -- batch size (issue 6): the plain run's batch (4) fits, so the maths is the plain run's
from lightning_efficient.techniques.batch_size import EfficientBatchSize, OOMRecovery  # noqa: E402

CASES.append(
    Case(
        EfficientBatchSize,
        init_args={"budget": "1GiB", "max_batch_size": 4},
        bad_args=[
            ({"target_batch_size": 0}, "target_batch_size"),
            ({"margin": 0.9}, "margin"),
            ({"mode": "fastest"}, "mode"),
            ({"multiple_of": "eight"}, "multiple_of"),
        ],
        fuzz={
            "target_batch_size": st.one_of(
                st.integers(max_value=0), st.floats(), st.text(), st.booleans()
            ),
            "margin": st.one_of(st.floats().filter(lambda m: not 0 <= m < 0.9), st.text()),
        },
        stateful=True,
        state_changes=False,
    )
)
CASES.append(
    Case(
        OOMRecovery,
        bad_args=[({"loss_weighting": "mean"}, "loss_weighting")],
        fuzz={
            "loss_weighting": st.text(max_size=8).filter(
                lambda s: s not in ("auto", "samples", "tokens")
            )
        },
        stateful=True,
        state_changes=False,
    )
)

# -- exact accumulation (issue 48): the demo's samples have equal lengths, so the maths is the
# plain run's; its state is the weighting measured on the first batch
from lightning_efficient.techniques.accumulation import ExactAccumulation  # noqa: E402

CASES.append(
    Case(
        ExactAccumulation,
        bad_args=[
            ({"loss_weighting": "mean"}, "loss_weighting"),
            ({"ignore_index": "pad"}, "ignore_index"),
            ({"token_counter": 3}, "token_counter"),
        ],
        fuzz={
            "loss_weighting": st.text(max_size=8).filter(
                lambda s: s not in ("auto", "samples", "tokens")
            )
        },
        stateful=True,
        state_changes=False,
    )
)

from lightning_efficient.techniques.compile import TorchCompile, valid_backends, valid_modes  # noqa: E402
from lightning_efficient.techniques.precision import (
    FP8_RECIPES,
    MATMUL_LEVELS,
    Float8Training,
    MatmulPrecision,
)  # noqa: E402

CASES.append(
    Case(
        MatmulPrecision,
        init_args={"level": "high"},
        bad_args=[({"level": "tf32"}, "level"), ({"level": 32}, "level")],
        fuzz={
            "level": st.text(max_size=8).filter(lambda s: s not in MATMUL_LEVELS)
            | st.integers()
            | st.booleans()
        },
        id="MatmulPrecision",
    )
)
CASES.append(
    Case(
        Float8Training,
        init_args={"recipe": "tensorwise"},
        bad_args=[({"recipe": "delayed"}, "recipe"), ({"exclude": "head"}, "exclude")],
        fuzz={
            "recipe": st.text(max_size=8).filter(lambda s: s not in FP8_RECIPES) | st.integers(),
            "exclude": st.text(max_size=4)
            | st.integers()
            | st.lists(st.integers(), min_size=1, max_size=2),
        },
        id="Float8Training",
    )
)
CASES.append(
    Case(
        TorchCompile,
        init_args={
            "backend": "aot_eager"
        },  # real Dynamo + AOTAutograd; inductor in test_compile.py
        bad_args=[
            ({"mode": "fastest"}, "mode"),
            ({"backend": "tensorrtx"}, "backend"),
            ({"mode": "max-autotune", "backend": "aot_eager"}, "mode"),
            ({"fullgraph": "yes"}, "fullgraph"),
            ({"dynamic": 1}, "dynamic"),
            ({"recompile_warning": 0}, "recompile_warning"),
            ({"blocks": 3}, "blocks"),
            ({"scope": "fastest"}, "scope"),
        ],
        fuzz={
            "mode": st.text(max_size=8).filter(lambda s: s not in valid_modes()) | st.integers(),
            "backend": st.text(max_size=8).filter(lambda s: s not in valid_backends())
            | st.integers(),
            "recompile_warning": st.integers(max_value=0) | st.floats() | st.text(max_size=3),
            "regional": st.integers() | st.text(max_size=3),
            "scope": st.text(max_size=8).filter(lambda s: s not in ("auto", "regional", "whole"))
            | st.integers(),
        },
        id="TorchCompile",
    )
)

from lightning_efficient.techniques.optimizers import NAMES as _OPTIMIZER_NAMES  # noqa: E402
from lightning_efficient.techniques.optimizers import OptimizerSwap  # noqa: E402

_OPTIMIZER_SWAP_BAD = [
    ({"name": "adamw9bit"}, "name"),
    ({"name": "adamw8bit", "overrides": {"momentum": 0.9}}, "overrides"),
    ({"name": "adamw8bit", "on_mismatch": "ignore"}, "on_mismatch"),
    ({"name": "adamw8bit", "optimizer_in_backward": "yes"}, "optimizer_in_backward"),
]
_OPTIMIZER_SWAP_FUZZ = {
    "name": st.text(max_size=12).filter(lambda s: s not in _OPTIMIZER_NAMES and "." not in s),
    "on_mismatch": st.text(max_size=8).filter(lambda s: s not in ("error", "reset")),
    "embeddings_32bit": st.one_of(st.integers(), st.text(max_size=4), st.none()),
}
# 8-bit states are lossy: the first loss (same model, same batch) matches; later ones stay close
# (tests/techniques/optimizers/test_optimizers.py checks 8 steps within 1% of AdamW). Resume is
# exact (rtol/atol). A plain (AdamW) checkpoint has no 8-bit state to resume: on_mismatch="reset"
# starts it afresh (the default, "error", stops with the choices; tested in
# tests/techniques/optimizers/test_optimizers.py).
CASES.append(
    Case(
        OptimizerSwap,
        init_args={"name": "adamw8bit", "on_mismatch": "reset"},
        bad_args=_OPTIMIZER_SWAP_BAD,
        fuzz=_OPTIMIZER_SWAP_FUZZ,
        stateful=True,
        same_maths=False,
        id="OptimizerSwap-adamw8bit",
    )
)
# fused AdamW on CUDA, foreach AdamW on CPU: the same maths as the module's own AdamW
CASES.append(
    Case(
        OptimizerSwap,
        init_args={"name": "adamw_fused"},
        bad_args=_OPTIMIZER_SWAP_BAD,
        stateful=True,
        same_maths=True,
        id="OptimizerSwap-adamw_fused",
    )
)


# -- spend fewer steps (issue 14): checks every step on the training loss, so the state moves
# 4-bit frozen weights (issue 39): a technique for frozen weights, so every fit of its case (with
# and without it) first freezes the blocks' linear weights, as an adapter or frozen-backbone
# fine-tune has them, and gives them back after the fit
from lightning_efficient.techniques.quantize import QUANT_TYPES, FrozenWeights4bit  # noqa: E402


class _FreezeBlocks(pl.Callback):
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._frozen = [p for n, p in pl_module.named_parameters() if n.startswith("blocks.")]
        for p in self._frozen:
            p.requires_grad_(False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for p in getattr(self, "_frozen", []):
            p.requires_grad_(True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")


class _FrozenBlocksCase(Case):
    def given(self, model: Any) -> Any:
        """The module as its user gives it: the blocks frozen (the fine-tuning setting)."""
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith("blocks."))
        return model

    def fit(self, tmp_path: Any, *, with_technique: bool = True, callbacks: Any = (), **kw: Any):
        extra = [*callbacks, _FreezeBlocks()]
        return super().fit(tmp_path, with_technique=with_technique, callbacks=extra, **kw)


CASES.append(
    _FrozenBlocksCase(
        FrozenWeights4bit,
        bad_args=[
            ({"quant_type": "int4"}, "quant_type"),
            ({"blocksize": 100}, "blocksize"),
            ({"modules": 3}, "modules"),
        ],
        fuzz={
            "quant_type": st.text(max_size=6).filter(lambda s: s not in QUANT_TYPES),
            "blocksize": st.integers().filter(lambda b: b < 64 or b > 4096 or b & (b - 1)),
        },
        same_maths=False,  # lossy: 4-bit weights; the first loss within 2% of the plain run's
        rtol=0.02,
        atol=0.0,
    )
)

from lightning_efficient.techniques.early_stopping import DivergenceGuard, EarlyStopper  # noqa: E402

CASES += [
    Case(
        EarlyStopper,
        init_args={"monitor": "train_loss", "check_every_n_steps": 1, "patience": 100},
        bad_args=[
            ({"patience": -1}, "patience"),
            ({"half_life": 0}, "half_life"),
            ({"max_time": "soon"}, "max_time"),
            ({"max_tokens": "lots"}, "max_tokens"),
            ({"mode": "lowest"}, "mode"),
            ({"min_delta": -1.0}, "min_delta"),
        ],
        fuzz={
            "patience": st.integers(max_value=-1) | st.floats() | st.text(max_size=3),
            "half_life": st.floats(max_value=0.0) | st.just(float("inf")) | st.text(max_size=3),
            "max_time": st.sampled_from(["soon", "1 fortnight", "-5m", "0s", "h", "1:2:3:4:5"])
            | st.integers(max_value=0)
            | st.booleans(),
            "mode": st.text(max_size=6).filter(lambda s: s not in ("min", "max")),
        },
        stateful=True,
    ),
    Case(
        DivergenceGuard,
        init_args={"action": "rollback", "snapshot_every": 2, "warmup_steps": 2},
        bad_args=[
            ({"action": "ignore"}, "action"),
            ({"half_life": 0}, "half_life"),
            ({"spike_factor": 0.5}, "spike_factor"),
            ({"lr_factor": 0}, "lr_factor"),
            ({"max_trips": 0}, "max_trips"),
        ],
        fuzz={
            "action": st.text(max_size=8).filter(lambda s: s not in ("stop", "skip", "rollback")),
            "half_life": st.floats(max_value=0.0) | st.none() | st.text(max_size=3),
            "spike_factor": st.floats(max_value=1.0) | st.text(max_size=3),
            "snapshot_every": st.integers(max_value=0) | st.floats(),
        },
        stateful=True,
    ),
]

# -- one switch (issue 31): a budget that holds the tiny fit's batch, so the configured stack and
# batch are kept (the maths is the plain run's); tests/planning/test_auto.py checks the other
# choices
from lightning_efficient.planning import GOALS, AutoEfficient  # noqa: E402

CASES.append(
    Case(
        AutoEfficient,
        init_args={"budget": "1GiB"},
        bad_args=[
            ({"budget": "lots"}, "budget"),
            ({"goal": "fastest"}, "goal"),
            ({"target_batch": 0}, "target_batch"),
            ({"trial": "yes"}, "trial"),
            ({"batch_arg_name": "1x"}, "batch_arg_name"),
        ],
        fuzz={
            "goal": st.text(max_size=8).filter(lambda s: s not in GOALS) | st.integers(),
            "target_batch": st.integers(max_value=0) | st.floats() | st.text(max_size=3),
            "budget": st.integers(max_value=0) | st.sampled_from(["lots", "-1GiB"]),
        },
        stateful=True,
        state_changes=False,
    )
)


def _from_registry(cases: list[Case]) -> list[Case]:
    """The cases in the registry's order; a technique of ``TECHNIQUES`` without a case (or a
    case of a class that is not registered) fails collection of this file."""
    from lightning_efficient import TECHNIQUES

    tested = {c.cls for c in cases}
    missing = [t.__name__ for t in TECHNIQUES if t not in tested]
    unregistered = sorted({c.cls.__name__ for c in cases if c.cls not in TECHNIQUES})
    if missing or unregistered:
        raise RuntimeError(
            f"the contract registry is out of step: techniques without a Case: {missing}; "
            f"cases of classes not in TECHNIQUES: {unregistered}"
        )
    order = {t: i for i, t in enumerate(TECHNIQUES)}
    return sorted(cases, key=lambda c: order[c.cls])


ALL = [REFERENCE, *_from_registry(CASES)]
ids = [c.id for c in ALL]


def _fuzz_cases() -> list[tuple[Case, str]]:
    return [(c, arg) for c in ALL for arg in c.fuzz]


def _kwargs_for(case: Case, arg: str, value: Any) -> dict[str, Any]:
    return {**case.init_args, arg: value}


# -- 1. works on an unmodified LightningModule ---------------------------------------------
def test_demo_imports_nothing_of_the_package() -> None:
    import ast

    import lightning_efficient.demos as demos

    for path in Path(demos.__file__).parent.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("lightning_efficient") for n in names), (
                f"{path.name} imports {names}"
            )


#: Fits whose outcome several contract items read, run once per process (the cases of one
#: technique share its 4-step fit; the plain runs are shared by every case alike): the key
#: names the fit, the value is what the tests read of it (never a module they could change).
_SHARED: dict[tuple, Any] = {}


def _once(key: tuple, produce: Any) -> Any:
    if key not in _SHARED:
        _SHARED[key] = produce()
    return _SHARED[key]


def _plain_key(case: Case) -> tuple:
    """Cases whose plain (technique-less) fits are the same fit: same Case class (its ``fit``)
    and the same trainer arguments."""
    return (type(case).__name__, repr(sorted(case.trainer_kwargs.items())))


def _four_steps(case: Case, tmp_path: Path, *, with_technique: bool = True) -> tuple[int, list]:
    """The 4-step fit (global step and losses) with the technique or, shared by the cases alike,
    without it."""

    def produce() -> tuple[int, list]:
        trainer, _, rec = case.fit(tmp_path, with_technique=with_technique, max_steps=4)
        return trainer.global_step, list(rec.losses)

    key = ("fit4", case.id) if with_technique else ("plain4", *_plain_key(case))
    return _once(key, produce)


@pytest.mark.parametrize("case", ALL, ids=ids)
def test_fits_unmodified_module(case: Case, tmp_path) -> None:
    global_step, losses = _four_steps(case, tmp_path)
    assert global_step == 4
    assert len(losses) >= 4 and all(torch.isfinite(torch.tensor(losses)))


# -- 6. the maths is unchanged (or within a stated tolerance); next to item 1, whose fit it reads
# (pytest-xdist hands out neighbouring tests together: one worker, one fit) ----------------
@pytest.mark.parametrize("case", ALL, ids=ids)
def test_losses_match_plain_run(case: Case, tmp_path) -> None:
    # the technique's fit is test_fits_unmodified_module's; the plain run is shared by the cases
    _, plain = _four_steps(case, tmp_path / "plain", with_technique=False)
    _, tech = _four_steps(case, tmp_path / "tech")
    assert len(tech) == len(plain) == 4
    if case.same_maths:
        torch.testing.assert_close(
            torch.tensor(tech), torch.tensor(plain), rtol=case.rtol, atol=case.atol
        )
    else:  # lossy: the first loss is the same model on the same batch, later ones stay close
        assert abs(tech[0] - plain[0]) <= case.atol + case.rtol * abs(plain[0])


# -- 2. constructs from yaml through the CLI parser ----------------------------------------
def _simple_state(obj: Any) -> dict[str, Any]:
    simple = (int, float, str, bool, type(None), tuple, list, dict)
    return {k: v for k, v in vars(obj).items() if isinstance(v, simple) and not k.startswith("__")}


@pytest.mark.parametrize("case", ALL, ids=ids)
def test_constructs_from_yaml(case: Case, tmp_path) -> None:
    import yaml

    spec = {
        "class_path": case.cls.__name__
        if case.cls.__module__.startswith("lightning_efficient")
        else f"{case.cls.__module__}.{case.cls.__name__}",
        "init_args": case.init_args,
    }
    key = "strategy" if case.kind == "strategy" else "callbacks"
    trainer_cfg: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        key: spec if key == "strategy" else [spec],
    }
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": trainer_cfg}))
    cli = EfficientCLI(args=["--config", str(cfg)], run=False)
    if case.kind == "strategy":
        built = cli.trainer.strategy
        # a Trainer fills in a strategy's devices: compare with one attached the same way
        expected = pl.Trainer(accelerator="cpu", logger=False, strategy=case.make()).strategy
    else:
        built = next(cb for cb in cli.trainer.callbacks if isinstance(cb, case.cls))
        expected = case.make()
    assert isinstance(built, case.cls)
    assert _simple_state(built) == _simple_state(expected)


# -- 3. bad arguments fail at construction, naming the argument ------------------------------
@pytest.mark.parametrize("case", ALL, ids=ids)
def test_bad_arguments_named(case: Case) -> None:
    assert case.bad_args, f"{case.id} must list at least one bad argument"
    for kwargs, arg in case.bad_args:
        with pytest.raises(case.errors) as info:
            case.cls(**kwargs)
        assert arg in str(info.value), f"message does not name `{arg}`: {info.value}"


@pytest.mark.parametrize("case,arg", _fuzz_cases(), ids=[f"{c.id}-{a}" for c, a in _fuzz_cases()])
def test_fuzzed_wrong_values_named(case: Case, arg: str) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(value=case.fuzz[arg])
    def check(value: Any) -> None:
        with pytest.raises(case.errors) as info:
            case.cls(**_kwargs_for(case, arg, value))
        assert arg in str(info.value), f"{arg}={value!r}: message does not name it: {info.value}"

    check()


# -- 4. checkpoints load with and without the technique; keys unchanged ----------------------
@pytest.mark.parametrize("case", ALL, ids=ids)
def test_checkpoint_portable(case: Case, tmp_path, tmp_path_factory) -> None:
    plain_keys = set(tiny_model().state_dict())
    trainer, model, _ = case.fit(tmp_path / "with", max_steps=2)
    ckpt_with = tmp_path / "with.ckpt"
    trainer.save_checkpoint(ckpt_with)
    assert set(model.state_dict()) == plain_keys
    state = torch.load(ckpt_with, weights_only=False)["state_dict"]
    assert set(state) == plain_keys
    # without the technique: loads strictly into a plain module and resumes training
    fresh = tiny_model()
    fresh.load_state_dict(state, strict=True)
    trainer2, _, _ = case.fit(
        tmp_path / "without", with_technique=False, max_steps=4, ckpt_path=str(ckpt_with)
    )
    assert trainer2.global_step == 4
    # and the other way round: a plain checkpoint (one per process for the cases alike: it is
    # only read) resumes with the technique
    ckpt_plain = _once(
        ("plain-ckpt", *_plain_key(case)), lambda: _plain_checkpoint(case, tmp_path_factory)
    )
    trainer3, _, _ = case.fit(tmp_path / "resumed", max_steps=4, ckpt_path=str(ckpt_plain))
    assert trainer3.global_step == 4


def _plain_checkpoint(case: Case, tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp("plain-ckpt")
    plain_trainer, _, _ = case.fit(folder, with_technique=False, max_steps=2)
    plain_trainer.save_checkpoint(folder / "plain.ckpt")
    return folder / "plain.ckpt"


# -- 5. stop at step k and resume equals an uninterrupted run --------------------------------
@pytest.mark.parametrize(
    "case", [c for c in ALL if c.stateful], ids=[c.id for c in ALL if c.stateful]
)
def test_resume_matches_uninterrupted(case: Case, tmp_path) -> None:
    k = 4
    ckpt = tmp_path / "k.ckpt"
    save = SaveAt(
        k, ckpt, snapshot=lambda t: (_technique_state(case, t), params_of(t.lightning_module))
    )
    epoch = dict(limit_train_batches=k)  # k is an epoch boundary: plain DataLoaders resume there
    full_trainer, full_model, _ = case.fit(
        tmp_path / "full", max_steps=2 * k, callbacks=[save], **epoch
    )
    at_k, params_k = save.snapshot
    resumed_trainer, resumed_model, _ = case.fit(
        tmp_path / "resumed", max_steps=2 * k, ckpt_path=str(ckpt), **epoch
    )
    assert resumed_trainer.global_step == full_trainer.global_step == 2 * k
    # the test must be able to fail: the model (and the state, if it evolves) moved after k
    assert any(
        not torch.equal(a, b) for a, b in zip(params_k.values(), params_of(full_model).values())
    )
    at_2k = _technique_state(case, full_trainer)
    if case.state_changes:
        assert at_k != at_2k, (
            f"{case.id}: state at step k equals state at 2k; the test would pass trivially"
        )
    assert _technique_state(case, resumed_trainer) == at_2k
    for (name, a), b in zip(params_of(full_model).items(), params_of(resumed_model).values()):
        torch.testing.assert_close(a, b, rtol=case.rtol, atol=case.atol, msg=f"{name} differs")


def _technique_state(case: Case, trainer: Any) -> Any:
    obj = (
        trainer.strategy
        if case.kind == "strategy"
        else next(c for c in trainer.callbacks if isinstance(c, case.cls))
    )
    return _comparable(obj.state_dict())


def _comparable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.flatten().tolist())
    if isinstance(x, dict):
        return {k: _comparable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_comparable(v) for v in x]
    return x


# -- 7. DDP with 2 CPU processes (gloo) -------------------------------------------------------
def _launch_ddp(case_ids: list[str], tmp_path: Path) -> tuple[list[dict], str, int | None]:
    """One 2-process launch of ``tests/multiprocess/ddp_contract.py`` running ``case_ids`` in
    order: the JSON lines rank zero wrote, the launch's stderr and exit code (None: timed out; both
    ranks' processes are killed at the end)."""
    out = tmp_path / f"ddp-{len(list(tmp_path.glob('ddp-*')))}.jsonl"
    cmd = [sys.executable, str(MULTIPROCESS / "ddp_contract.py"), ",".join(case_ids), str(out)]
    _, stderr, code = launch(cmd, tmp_path, 300 + 60 * len(case_ids), stdout=False)
    lines = out.read_text().splitlines() if out.exists() else []
    return [json.loads(line) for line in lines], stderr, code


def _ddp_outcomes(cases: list[Case], tmp_path: Path) -> dict[str, dict | str]:
    """Each case's rank-zero result, or why it has none. The cases share one launch; when one
    fails, its error is kept (the stderr tail) and the cases after it get a fresh launch."""
    outcomes: dict[str, dict | str] = {}
    remaining = [c.id for c in cases]
    while remaining:
        records, stderr, returncode = _launch_ddp(remaining, tmp_path)
        started = [r["case"] for r in records if len(r) == 1]
        outcomes.update({r["case"]: r for r in records if len(r) > 1})
        failed = [c for c in started if c not in outcomes]
        if returncode != 0 and not failed:  # the launch failed before a case or after the last
            failed = started[-1:] or remaining[:1]
        if not failed and all(c not in outcomes for c in remaining):  # ended, having done nothing
            failed = remaining[:1]
        for case_id in failed:
            outcomes[case_id] = f"exit code {returncode}:\n{stderr[-4000:]}"
        remaining = [c for c in remaining if c not in outcomes]
    return outcomes


@pytest.mark.slow
def test_ddp_two_processes(tmp_path, request) -> None:
    """Every case trains under DDP on 2 CPU processes (a case refusing DDP fails with its message,
    in a launch of its own); the cases that train share one launch. Each failing case is named."""
    if any(c.id == "ZeROOffload" for c in ALL):
        request.getfixturevalue("deepspeed_extensions")
    trains = [c for c in ALL if c.ddp is True]
    outcomes = _ddp_outcomes(trains, tmp_path)
    failures: dict[str, str] = {}
    for case in trains:
        result = outcomes[case.id]
        if isinstance(result, str):
            failures[case.id] = f"the fit failed:\n{result}"
        elif not (result["world_size"] == 2 and result["global_step"] == 3):
            failures[case.id] = f"world size {result['world_size']}, step {result['global_step']}"
        elif case.reports and case.cls.__name__ not in result["report"]:
            failures[case.id] = f"no {case.cls.__name__} row in the report {result['report']}"
    for case in (c for c in ALL if c.ddp is not True):
        records, stderr, returncode = _launch_ddp([case.id], tmp_path)
        if returncode == 0 or any(len(r) > 1 for r in records) or str(case.ddp) not in stderr:
            failures[case.id] = f"should refuse DDP with {case.ddp!r}:\n{stderr[-4000:]}"
    assert not failures, "\n\n".join(f"[{k}] {v}" for k, v in failures.items())


# -- 8. reports what it did; logs once on rank zero, nothing per step ------------------------
@pytest.mark.parametrize("case", ALL, ids=ids)
def test_reports_once_not_per_step(case: Case, tmp_path, caplog, capsys) -> None:
    def messages(steps: int) -> tuple[list[str], Any]:
        caplog.clear()
        capsys.readouterr()
        with caplog.at_level("INFO"):
            trainer, _, _ = case.fit(tmp_path / f"s{steps}", max_steps=steps, limit_val_batches=0)
        printed = capsys.readouterr().out
        logged = [r.getMessage() for r in caplog.records if case.cls.__name__ in r.getMessage()]
        return logged + [ln for ln in printed.splitlines() if case.cls.__name__ in ln], trainer

    short, trainer = messages(2)
    long, _ = messages(6)
    assert len(long) == len(short), f"messages grow with steps: {len(short)} -> {len(long)}"
    report = report_for(trainer)
    if case.reports:
        assert case.cls.__name__ in report and report[case.cls.__name__].change
    else:
        assert case.cls.__name__ not in report


# -- a fit that raises leaves the module, its data hooks and the global flags as given --------
class _RaiseAt(pl.Callback):
    """Raises ``error`` in optimizer step ``step``, after its forward (before its backward).

    With ``through_the_log`` it first undoes the trainer's change log (``core.change``: what the
    ``Technique`` base records) and keeps the snapshot of the module then in ``self.undone``: a
    change made outside the log shows there, before any technique's own exception handling."""

    def __init__(self, step: int, error: type[BaseException], through_the_log: Any = None) -> None:
        self.step, self.error, self.raised = step, error, False
        self.through_the_log, self.undone = through_the_log, None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if trainer.global_step == self.step:
            self.raised = True
            if self.through_the_log is not None:
                changes_for(trainer).undo_all()
                self.undone = Snapshot.take(pl_module, self.through_the_log)
            raise self.error(f"raised by the test at step {self.step}")


#: The data of the raise tests: batches of 2, which the batch-size techniques change (their
#: cases allow up to 4), so the given ``batch_size`` must come back.
RAISE_DATA = {"batch_size": 2}


def test_the_snapshot_sees_what_a_fit_could_leave() -> None:
    """The contract case can fail: each kind of leftover shows in the snapshot's diff."""
    from lightning_efficient.core.change import patch_attribute
    from lightning_efficient.functional import apply_activation_checkpointing, apply_compile

    model, data = tiny_model(), tiny_data()
    given = Snapshot.take(model, data)
    assert given.diff(Snapshot.take(model, data)) == []
    leftovers = [
        (apply_activation_checkpointing(model), "instance[blocks.0]: forward added"),
        (apply_compile(model, backend="eager"), "instance[blocks.1]: _compiled_call_impl added"),
        (patch_attribute(data, "train_dataloader", lambda: None), "datamodule: train_dataloader"),
        (patch_attribute(torch.backends.cudnn, "benchmark", True), "cudnn.benchmark False -> True"),
        (patch_attribute(data, "batch_size", 8), "attributes[datamodule]: batch_size 4 -> 8"),
    ]
    handle = model.head.register_forward_hook(lambda *args: None)
    hook = model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    left = "\n".join(given.diff(Snapshot.take(model, data)))
    for _, line in leftovers:
        assert line in left
    assert "hooks[head]: _forward_hooks added" in left and "parameters: head.weight" in left
    handle.remove(), hook.remove()
    for change, _ in reversed(leftovers):
        change.undo()
    assert given.diff(Snapshot.take(model, data)) == []


@pytest.mark.parametrize("case", ALL, ids=ids)
def test_fit_that_raises_leaves_what_was_given(case: Case, tmp_path) -> None:
    # an exception propagates; a KeyboardInterrupt is caught by Lightning, which ends the process
    # with SystemExit after the callbacks' on_exception (and ignores Ctrl+C from then on)
    for error, seen in ((RuntimeError, RuntimeError), (KeyboardInterrupt, SystemExit)):
        model, data = tiny_model(), tiny_data(**RAISE_DATA)
        given = Snapshot.take(model, data)
        raiser = _RaiseAt(2, error)
        sigint = signal.getsignal(signal.SIGINT)
        try:
            with pytest.raises(seen):
                case.fit(
                    tmp_path / error.__name__, model=model, data=data, callbacks=[raiser],
                    max_steps=4, limit_val_batches=0,
                )  # fmt: skip
        finally:
            signal.signal(signal.SIGINT, sigint)
        assert raiser.raised
        after = Snapshot.take(model, data)
        if case.keeps is not None:  # the strategy's own result, and nothing else
            given, after = _kept(case, data).layout(), after.layout()
        left = given.diff(after)
        assert not left, f"{case.id} after {error.__name__} at step 2:\n" + "\n".join(left)


def _kept(case: Case, data: Any) -> Snapshot:
    alike = tiny_model()
    case.keeps(alike)
    return Snapshot.take(alike, data)


@pytest.mark.parametrize(
    "case",
    [c for c in ALL if c.kind == "callback"],
    ids=[c.id for c in ALL if c.kind == "callback"],
)
def test_every_change_goes_through_the_one_log(case: Case, tmp_path) -> None:
    """Mid-fit, undoing the trainer's change log alone puts the module, its datamodule and the
    global flags back: no technique changes anything outside the log (and so outside the one
    undo path). Strategies undo their changes in their ``teardown``, which Lightning calls on
    every path (``core/environ.py``); the raise test above checks them."""
    model, data = tiny_model(), tiny_data(**RAISE_DATA)
    model = case.given(model)
    given = Snapshot.take(model, data)
    raiser = _RaiseAt(2, RuntimeError, through_the_log=data)
    with pytest.raises(RuntimeError):
        case.fit(
            tmp_path, model=model, data=data, callbacks=[raiser], max_steps=4, limit_val_batches=0
        )
    assert raiser.undone is not None
    left = given.diff(raiser.undone)
    assert not left, f"{case.id}: changed outside the change log:\n" + "\n".join(left)
