"""The efficiency report gathered over 2 CPU processes (gloo): MemoryBreakdown, StepProfiler,
EarlyStopper and DivergenceGuard in one fit, where rank 1 holds an extra 2 MiB tensor through
the backward of the measured step (its tracked peak is higher); the profiler writes a Chrome
trace of one step (one file per rank: ``OUT/<strategy>-trace.rank<r>.json``). For each strategy named, one
fit in the same 2 processes (a second fit reuses the process group); each rank writes
``OUT/<strategy>-rank<r>.json`` (its report after the gather, its own measured peak).

Run by ``tests/multiprocess/ddp_cases.py`` (case ``reports``: ddp, then fsdp).
"""

import json
from pathlib import Path

import torch
from helpers import fit
from lightning.pytorch import Callback

from benchmarks.workloads import tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.measure import MemoryBreakdown, StepProfiler
from lightning_efficient.techniques import DivergenceGuard, EarlyStopper

EXTRA_BYTES = 2 * 2**20


class HoldOnRankOne(Callback):
    """Rank 1 only: a tensor allocated when the backward of step 1 starts, freed after it."""

    def __init__(self) -> None:
        self.held: torch.Tensor | None = None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 1:
            self.held = torch.ones(EXTRA_BYTES // 4)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.held = None


def main(strategy_name: str, out: Path) -> None:
    model = tiny_model()
    training_step = model.training_step

    def logged_step(batch, batch_idx):  # the module's own step, plus a metric lowest at step 3
        loss = training_step(batch, batch_idx)
        model.log("probe", float((model.global_step - 3) ** 2))
        return loss

    model.training_step = logged_step
    memory = MemoryBreakdown(sample_steps=[1])
    callbacks = [
        memory,
        HoldOnRankOne(),
        StepProfiler(skip_steps=1, trace=str(out / f"{strategy_name}-trace.json"), trace_steps=1),
        EarlyStopper("probe", check_every_n_steps=1, patience=1, restore_best=False),
        DivergenceGuard("skip"),
    ]
    if strategy_name == "fsdp":
        from lightning_efficient.techniques.fsdp import FullyShardedStrategy

        strategy = FullyShardedStrategy()
    else:
        strategy = "ddp"
    trainer, _, _ = fit(
        None,
        callbacks,
        model=model,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=20,
        limit_val_batches=0,
    )
    report = report_for(trainer)
    # shown once on every rank: a later call on rank zero alone runs no collective (no hang)
    again = report.show(trainer) if trainer.is_global_zero else False
    result = {
        "shown_again": again,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "own_peak_bytes": memory.measurement.peak_bytes,
        "report": report.to_dict(),
        "markdown": report.to_markdown(),
        "metrics": report.metrics(),
    }
    (out / f"{strategy_name}-rank{trainer.global_rank}.json").write_text(
        json.dumps(result, default=str)
    )


def case(out: Path) -> None:
    for name in ("ddp", "fsdp"):
        main(name, out)
