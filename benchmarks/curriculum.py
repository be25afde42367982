"""Curriculum benchmark: steps and time to a target validation perplexity, plain vs
sequence-length warm-up vs an easiest-first curriculum; and recompilations during a warm-up
under TorchCompile.

TinyGPT learns the demo corpus (bytes of Python's help topics, windows of ``seq`` bytes). Every
variant trains the same model from the same seed for the same number of steps with the module's
own AdamW + warm-up + cosine schedule, and validates every ``--val-every`` steps on the same
held-out batches. Variants:

- ``plain``: the demo as it is;
- ``warmup-truncate``: ``SequenceLengthWarmup`` (truncate) over the first 30% of the steps,
  from ``seq/8`` tokens in multiples of ``seq/8``: fewer tokens per step early on;
- ``warmup-reshape``: the same in ``reshape`` mode: as many tokens per step as plain;
- ``curriculum``: ``Curriculum("entropy", pacing="root")``, the 10% lowest-entropy windows first,
  all windows from half of the steps on.

The target perplexity is the plain run's at 70% of its steps (``--target`` overrides it); a
variant's "steps to target" is the first validation at or below it. Time to target is given two
ways: *measured* (the sum of the training steps' wall times up to that step; on a machine shared
with other jobs this is noisy) and *modelled* (the sum over those steps of the median step time
of each batch shape, measured afterwards in interleaved rounds: what the schedule costs on an
idle machine).

The compile part runs a short warm-up (4 distinct lengths) under regional ``TorchCompile`` and
counts Dynamo's recompilations during it, against the number of distinct lengths.

    python -m benchmarks.curriculum              # 400 steps, 1 seed (~4 minutes, 2 shared cores)
    python -m benchmarks.curriculum --seeds 3    # the card's run (~12 minutes)
    python -m benchmarks.curriculum --quick      # a smoke run (~1 minute)

Prints a table and saves ``benchmarks/results/curriculum{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from benchmarks._results import QUIET_TRAINER, environment, save_results
from lightning_efficient.core.report import report_for
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.techniques.compile import TorchCompile
from lightning_efficient.techniques.curriculum import Curriculum, SequenceLengthWarmup

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"


def bench_environment() -> dict[str, str]:
    """The shared environment plus this process's torch threads."""
    return {
        **environment(("torch", "lightning")),
        "torch threads": str(torch.get_num_threads()),
    }


def versions(env: dict[str, str]) -> str:
    return ", ".join(f"{k} {env[k]}" for k in ("torch", "lightning", "python"))


class Clock(Callback):
    """Per training step: wall time (batch start to batch end) and batch shape; validation
    perplexity at every check."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.shapes: list[tuple[int, int]] = []
        self.curve: list[dict] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.shapes.append(tuple(batch[0].shape))
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s.append(time.perf_counter() - self._t0)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and pl_module.val_ppl_history:
            self.curve.append(
                {"step": trainer.global_step, "val_ppl": pl_module.val_ppl_history[-1]}
            )


def run(name: str, callbacks: list, cfg: dict, seed: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    model = TinyGPT(**cfg["model"])
    data = TextDataModule(**cfg["data"], seed=seed)
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=cfg["steps"],
        val_check_interval=cfg["val_every"],
        limit_val_batches=cfg["val_batches"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[*callbacks, clock],
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - t0
    final = f"final val ppl {clock.curve[-1]['val_ppl']:.3f}, " if clock.curve else ""
    print(f"  {name} (seed {seed}): {final}{wall:.0f} s", flush=True)
    return {
        "variant": name,
        "seed": seed,
        "curve": clock.curve,
        "step_s": clock.step_s,
        "shapes": clock.shapes,
        "fit_wall_s": wall,
        "report": report_for(trainer).to_dict(),
    }


def step_times(shapes: set[tuple[int, int]], cfg: dict, rounds: int = 3) -> dict:
    """Median seconds of one training step (forward, loss, backward, AdamW) per batch shape,
    measured in interleaved rounds so that background load spreads over every shape."""
    torch.manual_seed(0)
    model = TinyGPT(**cfg["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step_for(shape):
        x = torch.randint(0, 256, shape)

        def step() -> None:
            logits = model(x)
            F.cross_entropy(logits.view(-1, logits.size(-1)), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    samples: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(rounds):
        for s in sorted(shapes):
            samples[s].append(time_fn(step_for(s), warmup=1, repeats=5))
    return {s: statistics.median(v) for s, v in samples.items()}


def compile_part(cfg: dict, backend: str) -> dict:
    seq = cfg["model"]["seq_len"]
    warm = SequenceLengthWarmup(duration=8, start_length=seq // 4, multiple_of=seq // 4)
    comp = TorchCompile(backend=backend, recompile_warning=100)
    torch._dynamo.reset()
    row = run("compile+warmup", [warm, comp], {**cfg, "steps": 12, "val_batches": 0}, 0)
    figures, tc = row["report"]["SequenceLengthWarmup"], row["report"]["TorchCompile"]
    return {
        "backend": backend,
        "distinct_lengths": figures["distinct_lengths"],
        "warmup_recompiles": figures["warmup_recompiles"],
        "recompiles_whole_fit": tc.get("recompiles"),
        "compile_s": tc.get("compile_s"),
        "change": figures and row["report"]["SequenceLengthWarmup"]["change"],
    }


def compile_line(comp: dict) -> str:
    n = comp["warmup_recompiles"]
    return (
        f"Compile (`{comp['backend']}`, regional TorchCompile) with a warm-up of "
        f"{comp['distinct_lengths']} distinct lengths: **{n} recompilation{'' if n == 1 else 's'} "
        f"during the warm-up** (goal: at most one per distinct length); "
        f"{comp['recompiles_whole_fit']} in the whole fit, compile time {comp['compile_s']:.1f} s."
    )


def compile_only(cfg: dict, args) -> dict:
    comp = compile_part(cfg, args.backend)
    env = bench_environment()
    meta = {
        "command": f"python -m benchmarks.curriculum --compile-only --backend {args.backend}",
        "model": "TinyGPT n_layer={n_layer} n_embd={n_embd} seq_len={seq_len}".format(
            **cfg["model"]
        ),
        "versions": versions(env),
    }
    table = f"{compile_line(comp)} {meta['model']}, batch 16; {meta['versions']}. Command: `{meta['command']}`."
    out = args.out or RESULTS / f"curriculum_compile_{args.backend}"
    save_results(out, table, {"meta": meta, "compile": comp, "environment": env})
    return comp


def variants(seq: int) -> dict:
    step = seq // 8
    return {
        "plain": lambda: [],
        "warmup-truncate": lambda: [
            SequenceLengthWarmup(duration=0.3, start_length=step, multiple_of=step)
        ],
        "warmup-reshape": lambda: [
            SequenceLengthWarmup(duration=0.3, start_length=step, multiple_of=step, mode="reshape")
        ],
        "curriculum": lambda: [
            Curriculum("entropy", pacing="root", start_fraction=0.1, duration=0.5)
        ],
    }


def summarize(runs: list[dict], target: float, times: dict) -> None:
    for r in runs:
        hit = next((c for c in r["curve"] if c["val_ppl"] <= target), None)
        n = hit["step"] if hit else None
        r["steps_to_target"] = n
        r["measured_s_to_target"] = sum(r["step_s"][:n]) if n else None
        r["modelled_s_to_target"] = sum(times[tuple(s)] for s in r["shapes"][:n]) if n else None
        r["final_val_ppl"] = r["curve"][-1]["val_ppl"]
        r["tokens"] = sum(a * b for a, b in r["shapes"])


def _mean(values: list) -> float | None:
    return statistics.mean(values) if values and None not in values else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, shorter sequences")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per variant (0, 1, ...)")
    ap.add_argument("--target", type=float, default=None, help="target validation perplexity")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the cores are shared)")
    ap.add_argument("--backend", default="aot_eager", help="TorchCompile backend (compile part)")
    ap.add_argument("--compile-only", action="store_true", help="only the compile part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    seq = 64 if args.quick else 128
    cfg = {
        "model": dict(seq_len=seq, n_layer=2, n_embd=64, n_head=4, dropout=0.0, warmup_steps=20),
        "data": dict(batch_size=16, seq_len=seq),
        "steps": args.steps or (120 if args.quick else 400),
        "val_every": 20,
        "val_batches": 4 if args.quick else 8,
    }
    if args.compile_only:
        return compile_only(cfg, args)
    named = variants(seq)
    print(f"{len(named)} variants x {args.seeds} seed(s), {cfg['steps']} steps each", flush=True)
    run("untimed warm-up of the process", [], {**cfg, "steps": 10, "val_batches": 0}, 0)
    runs = [
        run(name, make(), cfg, seed) for seed in range(args.seeds) for name, make in named.items()
    ]
    at = int(0.7 * cfg["steps"])
    plain_ppl = [
        next(c["val_ppl"] for c in r["curve"] if c["step"] >= at)
        for r in runs
        if r["variant"] == "plain"
    ]
    target = args.target or statistics.mean(plain_ppl)
    print("step times per batch shape", flush=True)
    times = step_times({tuple(s) for r in runs for s in r["shapes"]}, cfg)
    summarize(runs, target, times)
    print("compile part", flush=True)
    comp = compile_part(cfg, args.backend)

    rows = []
    for name in named:
        mine = [r for r in runs if r["variant"] == name]
        rows.append(
            {
                "variant": name,
                "steps_to_target": [r["steps_to_target"] for r in mine],
                "measured_s_to_target": _mean([r["measured_s_to_target"] for r in mine]),
                "modelled_s_to_target": _mean([r["modelled_s_to_target"] for r in mine]),
                "final_val_ppl": [round(r["final_val_ppl"], 3) for r in mine],
                "tokens": mine[0]["tokens"],
            }
        )
    env = bench_environment()
    meta = {
        "command": "python -m benchmarks.curriculum"
        + (" --quick" if args.quick else "")
        + (f" --seeds {args.seeds}" if args.seeds != 1 else ""),
        "model": "TinyGPT n_layer={n_layer} n_embd={n_embd} seq_len={seq_len}".format(
            **cfg["model"]
        ),
        "data": f"TextDataModule batch 16, seq {seq}; validation: {cfg['val_batches']} batches every {cfg['val_every']} steps",
        "steps": cfg["steps"],
        "seeds": args.seeds,
        "target_val_ppl": target,
        "target_rule": "given"
        if args.target
        else "plain run's validation perplexity at 70% of its steps (mean over seeds)",
        "step_s_by_shape": {f"{a}x{b}": t for (a, b), t in sorted(times.items())},
        "hardware": f"{env['host']}, {env['torch threads']} torch thread(s), shared with other jobs",
        "versions": versions(env),
    }
    base = rows[0]

    def rel(value, ref) -> str:
        return f" ({(value - ref) / ref:+.0%})" if value is not None and ref else ""

    def seconds(value) -> str:
        return "-" if value is None else f"{value:.1f} s"

    lines = [
        f"# Curriculum: plain vs sequence-length warm-up vs easiest-first ({meta['model']})",
        "",
        f"{meta['hardware']}; {meta['versions']}. Command: `{meta['command']}`. {meta['data']}; "
        f"{cfg['steps']} steps, seeds 0..{args.seeds - 1}. Target validation perplexity "
        f"**{target:.3f}** ({meta['target_rule']}). Step times per batch shape: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in meta["step_s_by_shape"].items())
        + ".",
        "",
        "| Variant | Steps to target (per seed) | Modelled time to target | Measured time to target | Final val ppl (per seed) | Tokens trained |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = ", ".join(str(s) if s is not None else "not reached" for s in r["steps_to_target"])
        lines.append(
            f"| {r['variant']} | {steps} | {seconds(r['modelled_s_to_target'])}{rel(r['modelled_s_to_target'], base['modelled_s_to_target'])} "
            f"| {seconds(r['measured_s_to_target'])}{rel(r['measured_s_to_target'], base['measured_s_to_target'])} "
            f"| {', '.join(f'{p:.3f}' for p in r['final_val_ppl'])} | {r['tokens']:,}{rel(r['tokens'], base['tokens'])} |"
        )
    lines += [
        "",
        "Times to target are means over the seeds that reached it (`-`: a seed did not reach it).",
        "",
        compile_line(comp),
    ]
    for r in runs:  # per-step lists are long; keep the curves and the summaries
        r.pop("step_s")
        r["shapes"] = sorted({f"{a}x{b}" for a, b in r.pop("shapes")})
    result = {"meta": meta, "rows": rows, "runs": runs, "compile": comp, "environment": env}
    out = args.out or RESULTS / ("curriculum_quick" if args.quick else "curriculum")
    save_results(out, "\n".join(lines), result)
    return result


if __name__ == "__main__":
    main()
