"""fp32 vs bf16-mixed vs bf16-true on the CPU: step time, memory, final loss.

Each precision trains the same TinyGPT (same seed, same batches) with the Lightning Trainer for
``--steps`` steps, then validates. Step time is the median of the steps after the first two
(``measure.speed.timing.StepTimer``); memory is the instrument's estimate (``estimate_memory``,
exact peak bytes of a training step on fake tensors, per category); the losses are the last training
loss and the validation loss after training. Ratios are against fp32 in the same run.

    python -m benchmarks.precision            # TinyGPT 4 x 128, seq 128, batch 16, 60 steps
    python -m benchmarks.precision --quick    # 2 x 64, seq 64, 20 steps

Prints a table and saves benchmarks/results/precision.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks._results import QUIET_TRAINER, environment, save_results
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.speed.timing import StepTimer
from lightning_efficient.techniques.precision import best_precision

RESULTS = Path(__file__).parent / "results"
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


class _Steps(pl.Callback):
    def __init__(self) -> None:
        self.timer = StepTimer("cpu")
        self.n = 0
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.timer.start(f"step{self.n}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.timer.stop(f"step{self.n}")
        self.n += 1
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def steady_s(self) -> float:
        totals = self.timer.totals()
        return statistics.median(totals[f"step{i}"] for i in range(2, self.n))


def run(precision: str, model_cfg: dict, data_cfg: dict, steps: int) -> dict:
    pl.seed_everything(0, verbose=False)
    model, data = TinyGPT(**model_cfg), TextDataModule(**data_cfg)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    memory = estimate_memory(TinyGPT(**model_cfg), (x, y), precision=precision)
    probe = _Steps()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=steps,
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
        limit_val_batches=8,
        callbacks=[probe],
    )
    trainer.fit(model, datamodule=data)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    return {
        "precision": precision,
        "steady_step_s": probe.steady_s(),
        "peak_bytes": memory.peak_bytes,
        "by_category": memory.by_category,
        "final_train_loss": probe.losses[-1],
        "val_loss": float(val),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    ap.add_argument("--out", default=str(RESULTS / "precision"))
    args = ap.parse_args(argv)
    if args.quick:
        model_cfg = dict(n_layer=2, n_embd=64, n_head=2, seq_len=64, dropout=0.0, warmup_steps=4)
        data_cfg = dict(batch_size=8, seq_len=64, max_train_samples=512)
        steps = 20
    else:
        model_cfg = dict(n_layer=4, n_embd=128, n_head=4, seq_len=128, dropout=0.0, warmup_steps=10)
        data_cfg = dict(batch_size=16, seq_len=128, max_train_samples=2048)
        steps = 60
    rows = [run(p, model_cfg, data_cfg, steps) for p in PRECISIONS]
    ref = rows[0]
    for r in rows:
        r["speed_vs_fp32"] = ref["steady_step_s"] / r["steady_step_s"]
        r["memory_vs_fp32"] = r["peak_bytes"] / ref["peak_bytes"]
        r["val_loss_vs_fp32"] = r["val_loss"] / ref["val_loss"] - 1
    env = {**environment(("torch", "lightning")), "torch threads": str(torch.get_num_threads())}
    meta = {
        "command": "python -m benchmarks.precision" + (" --quick" if args.quick else ""),
        "model": f"TinyGPT n_layer={model_cfg['n_layer']} n_embd={model_cfg['n_embd']} seq_len={model_cfg['seq_len']} "
        f"batch={data_cfg['batch_size']}, {steps} steps, AdamW",
        "hardware": f"{env['host']}, {env['torch threads']} torch threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; best_precision('cpu') = {best_precision('cpu')!r}",
        "versions": ", ".join(f"{k} {env[k]}" for k in ("torch", "lightning", "python")),
    }
    lines = [
        f"# Precision on the CPU ({meta['model']})",
        "",
        f"{meta['hardware']}; {meta['versions']}. Command: `{meta['command']}`. Memory: estimated training-step peak.",
        "",
        "| Precision | Step time | Speed vs fp32 | Peak memory | Memory vs fp32 | Final train loss | Val loss | Val loss vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['steady_step_s'] * 1000:.1f} ms | {r['speed_vs_fp32']:.2f}x | "
            f"{format_bytes(r['peak_bytes'])} | {r['memory_vs_fp32']:.2f}x | {r['final_train_loss']:.4f} | "
            f"{r['val_loss']:.4f} | {r['val_loss_vs_fp32']:+.2%} |"
        )
    result = {"meta": meta, "rows": rows, "environment": env}
    save_results(args.out, "\n".join(lines), result)
    return result


if __name__ == "__main__":
    main()
