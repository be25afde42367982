"""EarlyStopper on a validation plateau, DivergenceGuard against a NaN batch and an LR blow-up.

Plateau: TinyGPT on a small training subset (it overfits, so the validation perplexity bottoms
out and rises) trains for ``max_steps`` with validation every ``val_every`` steps, once plain
(the full run) and once with ``EarlyStopper("val_loss", patience=3)`` (restore_best on). Figures:
steps and wall time of each run, and the stopped run's validation perplexity after fit (the
best weights back) against the full run's best validation perplexity.

Divergence: the same model trains ``div_steps`` steps clean; then with a NaN injected into one
batch (a forward hook turns the embedding output into NaN; the module is not modified), and
with the learning rate multiplied by 300 for 3 steps; each without a guard, and with
``DivergenceGuard`` (skip / rollback). Figure: the validation loss after fit, against the clean
run's.

    python -m benchmarks.early_stopping            # 64 training samples, 300 + 120 steps
    python -m benchmarks.early_stopping --quick    # 32 training samples, 240 + 60 steps

Prints tables and saves benchmarks/results/early_stopping{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks._results import QUIET_TRAINER, environment, save_results
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.functional import PlateauTracker
from lightning_efficient.techniques import DivergenceGuard, EarlyStopper
from lightning_efficient.techniques.early_stopping import (
    scale_lr,
    set_lr,
)

RESULTS = Path(__file__).parent / "results"
MODEL = dict(seq_len=32, n_layer=2, n_embd=32, n_head=2, dropout=0.0, lr=3e-3, warmup_steps=10)


class NaNAt(pl.Callback):
    """NaN in the embedding output of the training batches with these running indices."""

    def __init__(self, at) -> None:
        self.at, self.n, self.handle = set(at), -1, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.n += 1
        if self.handle is None:
            self.handle = pl_module.tok_emb.register_forward_hook(
                lambda m, a, out: out * float("nan") if m.training and self.n in self.at else out
            )

    def on_train_end(self, trainer, pl_module) -> None:
        self.handle.remove()


class LRBlowUp(pl.Callback):
    """The learning rate times ``factor`` for the optimizer steps in ``steps``."""

    def __init__(self, steps, factor: float) -> None:
        self.steps, self.factor, self.saved = set(steps), factor, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.saved = scale_lr(trainer.optimizers, self.factor)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.saved is not None:
            set_lr(trainer.optimizers, self.saved)
            self.saved = None


class ValHistory(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float]] = []  # step, val_loss, val_ppl

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            m = trainer.callback_metrics
            self.rows.append((trainer.global_step, float(m["val_loss"]), float(m["val_ppl"])))


def replay(history: list[tuple[int, float, float]], **settings) -> tuple[int, int]:
    """Where EarlyStopper(**settings) would stop on the full run's validation history, and its
    best step: ``PlateauTracker`` is the stopper's own decision (a run with the stopper follows
    the full run exactly until it stops)."""
    tracker = PlateauTracker(**settings)
    for step, loss, _ in history:
        if tracker.observe(loss, step)[1] is not None:
            return step, tracker.best_step
    return history[-1][0], tracker.best_step


def _fit(callbacks, data_cfg, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    model, data = TinyGPT(**MODEL), TextDataModule(**data_cfg)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
        limit_val_batches=4,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(model, datamodule=data)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    val = trainer.validate(model, datamodule=data, verbose=False)[0]
    return trainer, (wall, cpu), float(val["val_loss"]), float(val["val_ppl"])


SETTINGS = {  # replayed on the full run's validation history
    "patience=2": dict(patience=2),
    "patience=3": dict(patience=3),
    "patience=5": dict(patience=5),
    "patience=3, half_life=2": dict(patience=3, half_life=2.0),
    "patience=5, min_delta=1% (relative)": dict(patience=5, min_delta=0.01, relative=True),
}
CHOSEN = "patience=5"  # the one also run for real, with restore_best


def plateau(samples: int, max_steps: int, val_every: int) -> dict:
    data_cfg = dict(batch_size=4, seq_len=32, max_train_samples=samples)
    kw = dict(max_steps=max_steps, val_check_interval=val_every, check_val_every_n_epoch=None)
    history = ValHistory()
    full, (full_wall, full_cpu), _, full_final_ppl = _fit([history], data_cfg, **kw)
    ppl_at = {step: ppl for step, _, ppl in history.rows}
    best_step = min(ppl_at, key=ppl_at.get)
    replays = []
    for name, settings in SETTINGS.items():
        stop, best = replay(history.rows, **settings)
        replays.append(
            {
                "setting": name,
                "stop_step": stop,
                "best_step": best,
                "steps_saved_fraction": 1 - stop / max_steps,
                "ppl_vs_full_best": ppl_at[best] / ppl_at[best_step] - 1,
            }
        )
    settings = SETTINGS[CHOSEN]
    stopper = EarlyStopper("val_loss", patience=settings["patience"], restore_best=True)
    stopped, (stopped_wall, stopped_cpu), _, stopped_ppl = _fit([stopper], data_cfg, **kw)
    return {
        "config": f"{samples} training samples, max_steps={max_steps}, validation every "
        f"{val_every} steps (4 batches)",
        "chosen": CHOSEN,
        "replays": replays,
        "full_steps": full.global_step,
        "full_wall_s": full_wall,
        "full_cpu_s": full_cpu,
        "full_best_ppl": ppl_at[best_step],
        "full_best_step": best_step,
        "full_final_ppl": full_final_ppl,
        "stopped_steps": stopped.global_step,
        "stopped_wall_s": stopped_wall,
        "stopped_cpu_s": stopped_cpu,
        "stopped_best_step": stopper.tracker.best_step,
        "stopped_final_ppl": stopped_ppl,
        "steps_saved": full.global_step - stopped.global_step,
        "steps_saved_fraction": 1 - stopped.global_step / full.global_step,
        "wall_saved_fraction": 1 - stopped_wall / full_wall,
        "cpu_saved_fraction": 1 - stopped_cpu / full_cpu,
        "ppl_vs_full_best": stopped_ppl / ppl_at[best_step] - 1,
        "replay_matches_run": replays[list(SETTINGS).index(CHOSEN)]["stop_step"]
        == stopped.global_step,
    }


def divergence(steps: int) -> dict:
    data_cfg = dict(batch_size=4, seq_len=32, max_train_samples=64)
    nan_at, blow = steps // 3, range(steps // 2, steps // 2 + 3)
    guard_args = dict(snapshot_every=10, cooldown_steps=20)
    runs = [
        ("clean", "none", lambda: []),
        ("clean", "rollback", lambda: [DivergenceGuard("rollback", **guard_args)]),
        (f"NaN at step {nan_at}", "none", lambda: [NaNAt([nan_at])]),
        (f"NaN at step {nan_at}", "skip", lambda: [DivergenceGuard("skip"), NaNAt([nan_at])]),
        (
            f"NaN at step {nan_at}",
            "rollback",
            lambda: [DivergenceGuard("rollback", **guard_args), NaNAt([nan_at])],
        ),
        (f"LR x300 at steps {blow[0]}-{blow[-1]}", "none", lambda: [LRBlowUp(blow, 300.0)]),
        (
            f"LR x300 at steps {blow[0]}-{blow[-1]}",
            "rollback",
            lambda: [DivergenceGuard("rollback", **guard_args), LRBlowUp(blow, 300.0)],
        ),
    ]
    rows = []
    for fault, guard, make in runs:
        callbacks = make()
        _, (wall, _), val_loss, _ = _fit(
            callbacks, data_cfg, max_steps=steps, check_val_every_n_epoch=10**6
        )  # no validation during fit: one after it
        guards = [c for c in callbacks if isinstance(c, DivergenceGuard)]
        trips = guards[0].trips if guards else []
        rows.append(
            {
                "fault": fault,
                "guard": "rollback (snapshot_every=10, cooldown_steps=20)"
                if guard == "rollback"
                else guard,
                "val_loss": val_loss,
                "wall_s": wall,
                "trips": [{"step": t["step"], "action": t["action"]} for t in trips],
            }
        )
    clean = rows[0]["val_loss"]
    for r in rows:
        r["vs_clean"] = r["val_loss"] / clean - 1 if math.isfinite(r["val_loss"]) else None
    return {"steps": steps, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.quick:
        plat, div = plateau(32, 240, 10), divergence(60)
    else:
        plat, div = plateau(64, 300, 10), divergence(120)
    env = {**environment(("torch", "lightning")), "torch threads": str(torch.get_num_threads())}
    meta = {
        "command": "python -m benchmarks.early_stopping" + (" --quick" if args.quick else ""),
        "model": "TinyGPT n_layer=2 n_embd=32 seq_len=32 batch=4, AdamW lr 3e-3 (cosine)",
        "hardware": f"{env['host']}, {env['torch threads']} torch threads (shared)",
        "versions": ", ".join(f"{k} {env[k]}" for k in ("torch", "lightning", "python")),
    }
    p = plat
    lines = [
        f"# Early stopping and divergence guarding ({meta['model']})",
        "",
        f"{meta['hardware']}; {meta['versions']}. Command: `{meta['command']}`.",
        "",
        f"## Validation plateau: {p['config']}",
        "",
        f"EarlyStopper('val_loss', {p['chosen']}) run for real (best weights restored):",
        "",
        "| Run | Steps | Wall time | CPU time | Val perplexity after fit | Best val perplexity seen |",
        "|---|---|---|---|---|---|",
        f"| full run | {p['full_steps']} | {p['full_wall_s']:.1f} s | {p['full_cpu_s']:.1f} s | "
        f"{p['full_final_ppl']:.2f} | {p['full_best_ppl']:.2f} (step {p['full_best_step']}) |",
        f"| EarlyStopper | {p['stopped_steps']} ({-p['steps_saved_fraction']:+.0%}) | "
        f"{p['stopped_wall_s']:.1f} s ({-p['wall_saved_fraction']:+.0%}) | "
        f"{p['stopped_cpu_s']:.1f} s ({-p['cpu_saved_fraction']:+.0%}) | "
        f"{p['stopped_final_ppl']:.2f} ({p['ppl_vs_full_best']:+.2%} vs the full run's best) | "
        f"best weights of step {p['stopped_best_step']} restored |",
        "",
        "Other settings, replayed on the full run's validation history with PlateauTracker "
        f"(the replay of {p['chosen']} matches the real run: {p['replay_matches_run']}):",
        "",
        "| Setting | Stops at | Steps saved | Best step | Val perplexity vs full run's best |",
        "|---|---|---|---|---|",
        *(
            f"| {r['setting']} | {r['stop_step']} | {r['steps_saved_fraction']:.0%} | "
            f"{r['best_step']} | {r['ppl_vs_full_best']:+.2%} |"
            for r in p["replays"]
        ),
        "",
        f"## Divergence: {div['steps']} steps, 64 training samples, same seed and batches",
        "",
        "| Fault | Guard | Val loss after fit | vs clean | Trips (step: action) |",
        "|---|---|---|---|---|",
    ]
    for r in div["rows"]:
        trips = ", ".join(f"{t['step']}: {t['action']}" for t in r["trips"]) or "-"
        vs = f"{r['vs_clean']:+.2%}" if r["vs_clean"] is not None else "NaN"
        lines.append(f"| {r['fault']} | {r['guard']} | {r['val_loss']:.4f} | {vs} | {trips} |")
    result = {"meta": meta, "plateau": plat, "divergence": div, "environment": env}
    out = args.out or RESULTS / ("early_stopping_quick" if args.quick else "early_stopping")
    save_results(out, "\n".join(lines), result)
    return result


if __name__ == "__main__":
    main()
