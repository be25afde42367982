"""OptimizerSwap: peak memory, optimizer-state bytes and step time per optimizer, as ratios
against fp32 AdamW, and convergence on the demo.

Everything is measured in the same run on this machine:

- Memory: one real TinyGPT (demo config: 4 layers, width 128, seq 128) training step of two
  steps on the CPU under the instrument's storage tracker (``measure_step``), with the optimizer
  swapped by ``OptimizerSwap.configure_estimate``. Real tensors are used for all (the fake-tensor
  estimate models bitsandbytes and Adafactor: ``EightBitStateModel``, ``AdafactorStateModel``).
- Step time: median of a full real step (forward, backward, optimizer step) per optimizer, the
  optimizers interleaved over rounds so that machine load hits them alike (``time_fn``).
- Convergence: a Lightning fit of the demo (a 2-layer TinyGPT + TextDataModule, the module's own AdamW with
  warmup + cosine, swapped by ``OptimizerSwap``) for a fixed number of steps, then the validation
  loss over the whole validation split. Adafactor is run with the carried lr (a relative step
  size for Adafactor) and with its own default ``lr=1e-2``. A control run swaps to
  bitsandbytes' ``AdamW32bit``: the same update as AdamW with 32-bit states, so it differs from
  AdamW by rounding only; ``--seeds N`` repeats every run for seeds 0..N-1 (model init).

    python -m benchmarks.optimizers            # default (about 3 minutes on 2 idle cores)
    python -m benchmarks.optimizers --quick    # fewer timing rounds and training steps
    python -m benchmarks.optimizers --seeds 5 --convergence-only  # the adamw8bit question
    python -m benchmarks.optimizers --seeds 3 --convergence-only --gradient-clip 1.0

Prints a table and saves benchmarks/results/optimizers{,_quick}{,_convergence}{,_clipped}.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import QUIET_TRAINER, save_results
from benchmarks._results import environment as base_environment
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.techniques.optimizers import (
    EIGHT_BIT_NAMES,
    OptimizerSwap,
    attach_optimizer_in_backward,
    build_optimizer,
    embedding_parameters,
)

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = "torch.optim.AdamW"
#: row label -> (OptimizerSwap name, optimizer_in_backward)
ROWS: dict[str, tuple[str, bool]] = {
    "AdamW (baseline)": (BASELINE, False),
    "adamw_fused": ("adamw_fused", False),
    "adamw8bit": ("adamw8bit", False),
    "adam8bit": ("adam8bit", False),
    "paged_adamw8bit": ("paged_adamw8bit", False),
    "paged_adamw32bit": ("paged_adamw32bit", False),
    "lion8bit": ("lion8bit", False),
    "adafactor": ("adafactor", False),
    "AdamW + in-backward": (BASELINE, True),
    "adamw8bit + in-backward": ("adamw8bit", True),
}


def _batch(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(
        0, 256, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    return data[:, :-1], data[:, 1:]


def _fresh(cfg: dict[str, Any]) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**cfg)


def memory_and_time(cfg: dict[str, Any], batch_size: int, rounds: int) -> list[dict[str, Any]]:
    batch = _batch(batch_size, cfg["seq_len"])
    rows = []
    for label, (name, in_backward) in ROWS.items():
        m = measure_step(
            _fresh(cfg),
            batch,
            BASELINE,
            callbacks=[OptimizerSwap(name, optimizer_in_backward=in_backward)],
        )
        rows.append(
            {
                "optimizer": label,
                "name": name,
                "optimizer_in_backward": in_backward,
                "peak_bytes": m.peak_bytes,
                "optimizer_state_bytes": m.by_category["optimizer_state"],
                "gradients_at_peak_bytes": m.by_category["gradients"],
            }
        )

    steps = {}
    for label, (name, in_backward) in ROWS.items():
        model = _fresh(cfg)
        keep = embedding_parameters(model) if name in EIGHT_BIT_NAMES else []
        if in_backward:
            opt = attach_optimizer_in_backward(
                model, lambda g, n=name, k=keep: build_optimizer(n, g, keep_32bit=k)
            )
        else:
            opt = build_optimizer(name, model.parameters(), keep_32bit=keep)
        x, y = batch

        def step(model=model, opt=opt, x=x, y=y) -> None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # states built
        steps[label] = step
    times: dict[str, list[float]] = {label: [] for label in ROWS}
    for _ in range(rounds):
        for label, fn in steps.items():
            times[label].append(time_fn(fn, warmup=0, repeats=1))
    base = rows[0]
    base_time = statistics.median(times[rows[0]["optimizer"]])
    for row in rows:
        row["step_s"] = statistics.median(times[row["optimizer"]])
        row["peak_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        row["optimizer_state_ratio"] = row["optimizer_state_bytes"] / base["optimizer_state_bytes"]
        row["step_time_ratio"] = row["step_s"] / base_time
    return rows


#: convergence runs: label -> OptimizerSwap arguments (None: the module's own AdamW)
CONVERGENCE_RUNS: dict[str, dict[str, Any] | None] = {
    "AdamW (module's own)": None,
    # the same update as AdamW in bitsandbytes' kernel, 32-bit states: only the rounding differs
    "AdamW32bit (bitsandbytes, same maths)": {"name": "bitsandbytes.optim.AdamW32bit"},
    "adamw8bit": {"name": "adamw8bit"},
    "adafactor (carried lr)": {"name": "adafactor"},
    "adafactor lr=1e-2": {"name": "adafactor", "lr": 1e-2},
}


def convergence(
    cfg: dict[str, Any],
    steps: int,
    batch_size: int,
    seeds: list[int],
    labels: list[str],
    gradient_clip: float | None = None,
) -> list[dict[str, Any]]:
    import lightning.pytorch as pl

    out = []
    for seed in seeds:
        for label in labels:
            swap = CONVERGENCE_RUNS[label]
            pl.seed_everything(seed, verbose=False)
            model = TinyGPT(**cfg)
            data = TextDataModule(batch_size=batch_size, seq_len=cfg["seq_len"])
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=steps,
                **QUIET_TRAINER,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                gradient_clip_val=gradient_clip,
                callbacks=[OptimizerSwap(**swap)] if swap else [],
            )
            trainer.fit(model, datamodule=data)
            val = pl.Trainer(
                accelerator="cpu",
                devices=1,
                **QUIET_TRAINER,
            )
            loss = float(val.validate(model, datamodule=data, verbose=False)[0]["val_loss"])
            out.append(
                {
                    "run": label,
                    "seed": seed,
                    "steps": steps,
                    "gradient_clip_val": gradient_clip,
                    "val_loss": loss,
                }
            )
            print(f"  seed {seed} {label}: val_loss {loss:.4f}", file=sys.stderr)
        base = next(r["val_loss"] for r in out if r["seed"] == seed)
        for row in out:
            if row["seed"] == seed:
                row["val_loss_ratio"] = row["val_loss"] / base
    return out


def environment() -> dict[str, Any]:
    return {
        **base_environment(("torch", "lightning", "bitsandbytes")),
        "torch_threads": torch.get_num_threads(),
        "device": "cpu (no GPU): paged optimizers fall back to plain buffers; adamw_fused runs foreach AdamW",
    }


def to_markdown(
    env: dict[str, Any],
    cfg: dict[str, Any],
    batch_size: int,
    mem: list[dict],
    conv: list[dict],
    conv_cfg: dict[str, Any],
    conv_batch: int,
    command: str,
) -> str:
    lines = [
        "# OptimizerSwap benchmark",
        "",
        f"Command: `{command}`  ",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
    ]
    if mem:
        lines += [
            "",
            f"## Memory and step time (TinyGPT {cfg}, batch {batch_size}, fp32, real CPU step under the instrument's tracker)",
            "",
            "| Optimizer | Peak | Peak ratio | Optimizer state | State ratio | Gradients at peak | Step time | Time ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for r in mem:
        lines.append(
            f"| {r['optimizer']} | {format_bytes(r['peak_bytes'])} | {r['peak_ratio']:.3f} | "
            f"{format_bytes(r['optimizer_state_bytes'])} | {r['optimizer_state_ratio']:.3f} | "
            f"{format_bytes(r['gradients_at_peak_bytes'])} | {r['step_s'] * 1e3:.1f} ms | {r['step_time_ratio']:.2f} |"
        )
    if conv:
        lines += ["", *convergence_markdown(conv, conv_cfg, conv_batch)]
    return "\n".join(lines)


def convergence_markdown(conv: list[dict], conv_cfg: dict[str, Any], batch: int) -> list[str]:
    steps, seeds = conv[0]["steps"], sorted({r["seed"] for r in conv})
    clip = conv[0].get("gradient_clip_val")
    lines = [
        f"## Convergence (demo: TinyGPT {conv_cfg} + TextDataModule, {steps} steps, batch "
        f"{batch}, seeds {', '.join(map(str, seeds))}"
        + (f", gradient_clip_val={clip}" if clip else ", no gradient clipping")
        + ")",
        "",
        "| Run | " + " | ".join(f"Val loss (seed {s}) | Ratio vs AdamW" for s in seeds) + " |",
        "|---|" + "---|---|" * len(seeds),
    ]
    for label in dict.fromkeys(r["run"] for r in conv):
        cells = []
        for seed in seeds:
            r = next(r for r in conv if r["run"] == label and r["seed"] == seed)
            cells.append(f"{r['val_loss']:.4f} | {r['val_loss_ratio']:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def gaps(label: str) -> list[float]:
        return [(r["val_loss_ratio"] - 1) * 100 for r in conv if r["run"] == label]

    eight, same = gaps("adamw8bit"), gaps("AdamW32bit (bitsandbytes, same maths)")
    within = all(abs(g) <= 2 for g in eight)
    lines += [
        "",
        f"adamw8bit validation loss within 2% of AdamW: {'yes' if within else 'NO'} "
        f"({', '.join(f'{g:+.2f}%' for g in eight)}); the same update with 32-bit states in "
        f"bitsandbytes' kernel (only the rounding differs): {', '.join(f'{g:+.2f}%' for g in same)}.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer timing rounds and training steps"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="convergence runs for seeds 0..N-1 (default 1)"
    )
    parser.add_argument(
        "--convergence-only",
        action="store_true",
        help="only the adamw8bit convergence question: AdamW, the same-maths control, adamw8bit",
    )
    parser.add_argument(
        "--gradient-clip", type=float, default=None, help="gradient_clip_val of the fits"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="result stem (default benchmarks/results/optimizers{,_quick}{,_convergence}{,_clipped})",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings(
        "ignore", message=".*(Paged optimizers|does not have many workers|litlogger).*"
    )
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = dict(n_layer=4, n_embd=128, n_head=4, seq_len=128, dropout=0.0)  # the demo model
    conv_cfg = dict(n_layer=2, n_embd=64, n_head=4, seq_len=64, dropout=0.0, warmup_steps=10)
    batch_size, conv_batch = 2, 16
    rounds, steps = (3, 60) if args.quick else (7, 150)
    if not args.convergence_only:
        print("memory and step time ...", file=sys.stderr)
    mem = [] if args.convergence_only else memory_and_time(cfg, batch_size, rounds)
    for row in mem:
        print(
            f"  {row['optimizer']}: peak {row['peak_ratio']:.3f}, state {row['optimizer_state_ratio']:.3f}, "
            f"time {row['step_time_ratio']:.2f}",
            file=sys.stderr,
        )
    print("convergence ...", file=sys.stderr)
    labels = list(CONVERGENCE_RUNS)[:3] if args.convergence_only else list(CONVERGENCE_RUNS)
    conv = convergence(
        conv_cfg, steps, conv_batch, list(range(args.seeds)), labels, args.gradient_clip
    )
    env = environment()
    command = "python -m benchmarks.optimizers" + (" --quick" if args.quick else "")
    command += f" --seeds {args.seeds}" if args.seeds != 1 else ""
    command += " --convergence-only" if args.convergence_only else ""
    command += f" --gradient-clip {args.gradient_clip}" if args.gradient_clip else ""
    md = to_markdown(env, cfg, batch_size, mem, conv, conv_cfg, conv_batch, command)
    stem = "optimizers_quick" if args.quick else "optimizers"
    stem += "_convergence" if args.convergence_only else ""
    stem += "_clipped" if args.gradient_clip else ""
    md_path, json_path = save_results(
        args.out or RESULTS / stem,
        md,
        {
            "environment": env,
            "config": cfg,
            "batch_size": batch_size,
            "convergence_config": conv_cfg,
            "convergence_batch_size": conv_batch,
            "memory_and_time": mem,
            "convergence": conv,
            "command": command,
        },
    )
    print(f"\nsaved {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
