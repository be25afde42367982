"""EarlyStopper, DivergenceGuard and Curriculum together with Lightning's ModelCheckpoint,
OnExceptionCheckpoint and a StepLR scheduler, on 2 CPU processes (gloo), under each strategy
named (issue 33): all in the same 2 processes, two fits per strategy.

- Fit A: 12 steps planned; validation every 2 steps (a ``val_loss`` synced over the ranks, so
  ModelCheckpoint and the stopper judge the same value); a NaN in the batch of step 3 (the
  guard rolls back and lowers the learning rate of steps 4 and 5); a fault at the start of
  step 7 (OnExceptionCheckpoint writes ``on_exception.ckpt``).
- Fit B: resumed from ``on_exception.ckpt``, to step 12; at the end the stopper puts the best
  weights back (from ModelCheckpoint's best file, or its host copy).

DataLoaderTuning measures the worker count in both fits, from their own first steps (the module
counts its training_step calls: none may run out of band).

Each rank writes ``OUT/<strategy>-rank<r>.json`` with what tests/techniques/test_combinations.py
checks; weights are compared here, gathered whole (``full_tensor``) under FSDP.

Run by ``tests/multiprocess/ddp_cases.py`` (case ``combinations``: ddp, then fsdp).
"""

import json
from pathlib import Path

import torch
from helpers import fit
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from benchmarks.workloads import TINY_MODEL, tiny_data
from lightning_efficient.core.report import report_for
from lightning_efficient.demos import TinyGPT
from lightning_efficient.techniques import (
    Curriculum,
    DataLoaderTuning,
    DivergenceGuard,
    EarlyStopper,
)

STEPS, FAULT, NAN, EVERY, GAMMA = 12, 7, 3, 4, 0.5
LR = 3e-3


class Module(TinyGPT):
    """TinyGPT with a StepLR schedule, a validation loss synced over the ranks, and a count of
    its training_step calls."""

    calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        loss, logits = self._loss(batch)
        self.val_ppl.update(logits.float(), batch[1])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=EVERY, gamma=GAMMA)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole weights (sharded ones gathered: every rank must call it)."""
    out = {}
    for name, value in module.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().cpu().clone()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Watch(Callback):
    """Weights at every validation end and at the start of each step (by global step), the
    learning rate after each step; raises at the start of step ``fault``."""

    def __init__(self, snapshots: dict, fault: int | None) -> None:
        self.snapshots, self.fault, self.lrs = snapshots, fault, {}

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.snapshots[trainer.global_step] = full_state(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.fault:
            self.snapshots["fault"] = full_state(pl_module)
            raise RuntimeError(f"a fault at step {self.fault}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


class NaNAtStep(Callback):
    """The embedding output (so the loss) is NaN in the batches of the given global steps."""

    def __init__(self, steps) -> None:
        self.steps, self.step, self.handle = set(steps), -1, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.step = trainer.global_step
        if self.handle is None:
            self.handle = pl_module.tok_emb.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        return output * float("nan") if module.training and self.step in self.steps else output

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def callbacks(out: Path, snapshots: dict, fault: int | None) -> list:
    return [
        Watch(snapshots, fault),
        EarlyStopper("val_loss", patience=20),
        DivergenceGuard(
            "rollback", spike_factor=None, snapshot_every=1, lr_factor=0.5, cooldown_steps=2
        ),
        Curriculum("entropy", start_fraction=0.5, duration=6),
        DataLoaderTuning(tune=True, tune_time_s=1.0, pin_memory=False),
        NaNAtStep([NAN]),
        ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=1),
        OnExceptionCheckpoint(out / "ex"),
    ]


def expected_lr(step: int) -> float:
    """What StepLR alone gives after ``step`` steps: the cooldown must not show."""
    return LR * GAMMA ** (step // EVERY)


def strategy(name: str):
    if name == "fsdp":
        from lightning_efficient.techniques.fsdp import FullyShardedStrategy

        return FullyShardedStrategy()
    return "ddp"


def run(strategy_name: str, out: Path) -> dict:
    out = out / strategy_name
    kwargs = dict(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        enable_checkpointing=True,
        data=tiny_data(max_train_samples=64),
    )
    snapshots: dict = {}
    # fit A: the fault at step 7
    a = callbacks(out, snapshots, FAULT)
    model = Module(**TINY_MODEL)
    try:
        fit(None, a, model=model, strategy=strategy(strategy_name), **kwargs)
        fault = "no exception"
    except RuntimeError as err:
        fault = str(err)
    stopper, guard = a[1], a[2]
    ckpt = torch.load(out / "ex" / "on_exception.ckpt", weights_only=False, map_location="cpu")
    adam = next(iter(ckpt["optimizer_states"][0]["state"].values()))
    fit_a = {
        "fault": fault,
        "ckpt_step": ckpt["global_step"],
        "ckpt_adam_step": float(adam["step"]),
        "ckpt_holds_trained": same(ckpt["state_dict"], snapshots["fault"]),
        "best_step": stopper.tracker.best_step,
        "restored_from": stopper._restored_from,
        "module_is_best": same(full_state(model), snapshots[stopper.tracker.best_step]),
        "trips": [t["step"] for t in guard.trips],
        "lrs_as_scheduled": all(lr == expected_lr(s) for s, lr in a[0].lrs.items()),
        "lrs": a[0].lrs,
        "calls": model.calls,
    }
    # fit B: resumed from the exception's checkpoint
    b = callbacks(out, snapshots, None)
    model = Module(**TINY_MODEL)
    trainer, model, _ = fit(
        None,
        b,
        model=model,
        strategy=strategy(strategy_name),
        ckpt_path=str(out / "ex" / "on_exception.ckpt"),
        **kwargs,
    )
    stopper, guard, curriculum = b[1], b[2], b[3]
    fit_b = {
        "global_step": trainer.global_step,
        "best_step": stopper.tracker.best_step,
        "restored_from": stopper._restored_from,
        "module_is_best": same(full_state(model), snapshots[stopper.tracker.best_step]),
        "trips": [t["step"] for t in guard.trips],
        "lrs_as_scheduled": all(lr == expected_lr(s) for s, lr in b[0].lrs.items()),
        "lrs": b[0].lrs,
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "curriculum_batches": curriculum.state_dict().get("batches"),
        "calls": model.calls,
        "loader": type(trainer.train_dataloader).__name__,
        "workers": trainer.train_dataloader.num_workers,
        "tuning": report_for(trainer)["DataLoaderTuning"].figures,
    }
    return {"a": fit_a, "b": fit_b}


def main(names: str, out: Path) -> None:
    result = {name: run(name, out) for name in names.split(",")}
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    torch.distributed.barrier()


def case(out: Path) -> None:
    main("ddp,fsdp", out)
