"""EarlyStopper and DivergenceGuard under DDP with 2 CPU processes (gloo); each rank writes
rank<r>.json into OUT. Run by ``tests/multiprocess/ddp_cases.py`` (case ``early_stopping``).

The monitored metric is logged without sync and differs per rank: rank 0's is lowest at step 6,
rank 1's at step 14, their mean at step 10. A NaN is injected into rank 1's batch 3 only.
"""

import json
from pathlib import Path

from helpers import fit
from test_early_stopping import NaNAt

from benchmarks.workloads import tiny_model
from lightning_efficient.techniques import DivergenceGuard, EarlyStopper


class RankNaN(NaNAt):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != 1:
            self.at = set()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def run(strategy, params_sum, **trainer_kwargs) -> tuple[int, dict]:
    """Fit on 2 ranks under ``strategy`` with the rank-dependent metric and rank 1's NaN; returns
    the global rank and what the test compares across ranks. ``params_sum(model)``: the sum of
    the full parameters (a sharded strategy gathers them)."""
    model = tiny_model()
    probe: list[float] = []
    training_step = model.training_step

    def logged_step(batch, batch_idx):  # the module's own step, plus a rank-dependent metric
        loss = training_step(batch, batch_idx)
        centre = 6 if model.global_rank == 0 else 14
        probe.append(float((model.global_step - centre) ** 2))
        model.log("probe", probe[-1])
        return loss

    model.training_step = logged_step
    stopper = EarlyStopper("probe", check_every_n_steps=1, patience=2, restore_best=False)
    guard = DivergenceGuard("skip")
    trainer, model, _ = fit(
        None,
        [stopper, guard, RankNaN([3])],
        model=model,
        strategy=strategy,
        max_steps=30,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    return trainer.global_rank, {
        "global_step": trainer.global_step,
        "stopper": {
            "stopped_step": stopper.stopped_step,
            "best_step": stopper.tracker.best_step,
            "best": stopper.tracker.best,
            "checks": stopper.tracker.checks,
        },
        "probe_at_5": probe[5],  # this rank's own value at step 5
        "guard_trips": [t["step"] for t in guard.trips],
        "params_sum": params_sum(model),
    }


def case(out: Path) -> None:
    rank, result = run(
        "ddp",
        lambda model: float(sum(p.double().sum() for p in model.parameters())),
        accelerator="cpu",
        devices=2,
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
