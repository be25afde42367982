"""StepProfiler benchmark: its overhead start-to-start, the accuracy of its FLOP count, and its
verdicts.

In one run:

1. **Overhead, start-to-start.** TinyGPT (the demo's size: 4 layers, width 128, sequence 128,
   batch 16) fits on the CPU three ways, in interleaved rounds (the order rotates each round):
   plain; with an empty ``Callback`` (the floor of any callback: Lightning's hook dispatch); with
   ``StepProfiler()`` (default settings). A tiny clock callback, first in the list, reads
   ``time.perf_counter()`` at every ``on_train_batch_start``: the time between consecutive
   starts is one whole step with every hook of it (the profiler's work at the step's edges
   included). Per fit the median period after the warm-up steps; per round the ratio to the
   plain fit of that round (load from other processes moves a round's fits alike); reported:
   the median over rounds, and every round. The profiler's own work is also timed directly
   inside a profiled fit: each of its hooks and its profiler-hook forwarding, median per call,
   summed per step.
2. **FLOPs.** ``count_flops`` (fake tensors, 3 x forward) against the analytic count: an MLP
   against 6 x parameters x samples; TinyGPT and a GPT-2-shaped ``transformers`` model against
   6 x (matrix-product parameters) x tokens + attention (2 x 2 x seq^2 x width per layer and
   sequence, forward, x 3).
3. **Verdicts.** Short fits: an input-bound run (``__getitem__`` sleeps), a run whose model state
   dominates memory (with a memory budget just above its peak), and a balanced run; the advice
   each one gets.

    python -m benchmarks.profiler                    # default (about 5 minutes on 2 CPU cores)
    python -m benchmarks.profiler --only overhead    # the start-to-start overhead alone
    python -m benchmarks.profiler --quick            # a smoke run

Prints the tables and saves ``benchmarks/results/profiler.{md,json}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks._results import QUIET_TRAINER, environment, save_results
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure import MemoryBreakdown, StepProfiler, estimate_memory
from lightning_efficient.measure.speed.fetch_watch import FetchWatch
from lightning_efficient.measure.speed.flops import count_flops

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"
DEMO = dict(seq_len=128, n_layer=4, n_embd=128, n_head=4, dropout=0.1)
DEMO_BATCH = 16
WARMUP = 5  # periods left out at the start of each fit (first steps, the FLOP count)
VARIANTS = ("plain", "empty Callback", "StepProfiler()")


class Clock(Callback):
    """perf_counter at every train batch start: start-to-start step periods, every hook of the
    step included, independent of StepProfiler."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def periods(self, warmup: int, cpu: bool = False) -> list[float]:
        t = self.cpu if cpu else self.starts
        return [b - a for a, b in zip(t, t[1:])][warmup:]


def _trainer(steps: int, callbacks: list, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        **QUIET_TRAINER,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kw,
    )


def _quiet():
    return contextlib.redirect_stdout(io.StringIO())


def fit_start_to_start(variant: str, steps: int, batch: int = DEMO_BATCH) -> dict:
    """One demo fit with ``variant``'s callbacks after the clock; its start-to-start periods."""
    pl.seed_everything(0, verbose=False)
    clock = Clock()
    extra = {"plain": [], "empty Callback": [Callback()]}.get(variant)
    if extra is None:
        extra = [StepProfiler(print_table=False)]
    trainer = _trainer(steps, [clock, *extra])
    with _quiet():
        trainer.fit(TinyGPT(**DEMO), datamodule=TextDataModule(batch_size=batch, seq_len=128))
    periods = clock.periods(warmup=WARMUP)
    out = {
        "median_s": statistics.median(periods),
        "fastest_s": min(periods),
        "cpu_median_s": statistics.median(clock.periods(warmup=WARMUP, cpu=True)),
    }
    if isinstance(extra[0] if extra else None, StepProfiler):
        out["summary"] = extra[0].summary
    return out


def start_to_start(rounds: int, steps: int) -> dict:
    """Interleaved rounds of the three variants (order rotated per round); ratios to plain."""
    fits: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    summary = None
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for variant in order:
            res = fit_start_to_start(variant, steps)
            fits[variant].append(res["median_s"])
            cpu[variant].append(res["cpu_median_s"])
            summary = res.get("summary", summary)
        print(
            f"round {r + 1}/{rounds}: "
            + ", ".join(
                f"{v} {fits[v][-1] * 1e3:.1f} ms (CPU {cpu[v][-1] * 1e3:.1f} ms)" for v in VARIANTS
            ),
            flush=True,
        )
    ratios = {v: [a / b for a, b in zip(fits[v], fits["plain"])] for v in VARIANTS if v != "plain"}
    cpu_ratios = {
        v: [a / b for a, b in zip(cpu[v], cpu["plain"])] for v in VARIANTS if v != "plain"
    }
    return {
        "rounds": rounds,
        "steps": steps,
        "warmup": WARMUP,
        "batch": DEMO_BATCH,
        "step_s": {v: fits[v] for v in VARIANTS},
        "plain_step_s": statistics.median(fits["plain"]),
        "ratios": ratios,
        "ratio": {v: statistics.median(x) for v, x in ratios.items()},
        "cpu_step_s": cpu,
        "cpu_ratios": cpu_ratios,
        "cpu_ratio": {v: statistics.median(x) for v, x in cpu_ratios.items()},
        "summary": summary,
    }


HOOKS = (
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "_after_optimizer_step",
    "on_train_batch_end",
    "_on_fetch",
)


def own_work(steps: int) -> dict:
    """The profiler's own work per step, timed inside a profiled fit: each hook's median call
    (after the first steps: the one-off FLOP count is no per-step cost) times its calls per
    step, and the profiler-hook forwarding (``FetchWatch.start``/``stop``) likewise."""
    calls: dict[str, list[float]] = collections.defaultdict(list)

    def timed(obj, name):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls[name].append(time.perf_counter() - t0)

        setattr(obj, name, wrapper)
        return fn

    profiler = StepProfiler(print_table=False)
    for hook in HOOKS:
        timed(profiler, hook)
    saved = {name: getattr(FetchWatch, name) for name in ("start", "stop")}
    try:
        for name in saved:
            timed(FetchWatch, name)
        pl.seed_everything(0, verbose=False)
        with _quiet():
            _trainer(steps, [profiler]).fit(
                TinyGPT(**DEMO), datamodule=TextDataModule(batch_size=DEMO_BATCH, seq_len=128)
            )
    finally:
        for name, fn in saved.items():
            setattr(FetchWatch, name, fn)
    per_hook = {}
    for name, times in calls.items():
        steady = times[len(times) * WARMUP // steps :] or times
        per_hook[name] = statistics.median(steady) * len(times) / steps
    return {"per_hook_s": per_hook, "per_step_s": sum(per_hook.values())}


# -- FLOPs -----------------------------------------------------------------------------------------
def flops_rows(quick: bool) -> list[dict]:
    rows = []
    mlp = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    count = count_flops(
        mlp, (x, y), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    params = sum(p.numel() for p in mlp.parameters())
    rows.append(
        _row("MLP 256-1024-1024-10, batch 64", count, 6 * params * 64, "6 x params x samples")
    )
    sizes = [(2, 64, 64, 8)] if quick else [(2, 64, 64, 8), (4, 128, 128, 16), (8, 256, 256, 8)]
    for layers, d, seq, batch in sizes:
        model = TinyGPT(seq_len=seq, n_layer=layers, n_embd=d, n_head=4, dropout=0.0)
        ids = torch.zeros(batch, seq, dtype=torch.long)
        count = count_flops(model, (ids, ids))
        analytic = _transformer(layers, d, seq, batch, 256 * d)
        rows.append(
            _row(
                f"TinyGPT L{layers} d{d} seq {seq} batch {batch}",
                count,
                analytic,
                "6NT + attention",
            )
        )
    with contextlib.suppress(ImportError):
        rows.append(_gpt2(quick))
    return rows


def _transformer(layers: int, d: int, seq: int, batch: int, head_params: int) -> int:
    matmul_params = layers * 12 * d * d + head_params
    return 6 * matmul_params * batch * seq + 3 * layers * 4 * seq * seq * d * batch


def _gpt2(quick: bool) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, d, seq, batch = (2, 256, 128, 2) if quick else (12, 768, 1024, 8)
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=max(1, d // 64), n_positions=seq)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    count = count_flops(model, ids, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss)
    name = "GPT-2 124M" if not quick else "GPT-2-shaped (small)"
    analytic = _transformer(layers, d, seq, batch, cfg.vocab_size * d)
    return _row(
        f"{name} (transformers), seq {seq} batch {batch}", count, analytic, "6NT + attention"
    )


def _row(name: str, count, analytic: int, formula: str) -> dict:
    return {
        "model": name,
        "counted": count.step,
        "analytic": analytic,
        "formula": formula,
        "ratio": count.step / analytic,
    }


# -- verdicts --------------------------------------------------------------------------------------
class Blobs(Dataset):
    def __init__(self, delay_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 4))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def verdicts() -> list[dict]:
    rows = []
    prof = StepProfiler(skip_steps=1, print_table=False)
    with _quiet():
        _trainer(5, [prof]).fit(MLP(), DataLoader(Blobs(0.02), batch_size=8))
    rows.append(_verdict("input-bound (20 ms sleep per sample, batch 8)", prof.summary))

    kw = dict(seq_len=8, n_layer=2, n_embd=128, n_head=4, dropout=0.0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    est = estimate_memory(TinyGPT(**kw), (ids, ids), optimizer=torch.optim.AdamW)
    prof = StepProfiler(skip_steps=1, memory_budget=int(est.peak_bytes * 1.05), print_table=False)
    pl.seed_everything(0, verbose=False)
    with _quiet():
        _trainer(3, [MemoryBreakdown(print_table=False), prof]).fit(
            TinyGPT(**kw), datamodule=TextDataModule(batch_size=2, seq_len=8, max_train_samples=64)
        )
    rows.append(_verdict("model state dominates, budget = 1.05 x estimated peak", prof.summary))

    prof = StepProfiler(skip_steps=2, print_table=False)
    pl.seed_everything(0, verbose=False)
    with _quiet():
        _trainer(6, [prof]).fit(
            TinyGPT(seq_len=128, n_layer=2, n_embd=128, n_head=4, dropout=0.0),
            datamodule=TextDataModule(batch_size=8, seq_len=128, max_train_samples=256),
        )
    rows.append(_verdict("balanced (TinyGPT, in-memory data)", prof.summary))
    return rows


def _verdict(name: str, s: dict) -> dict:
    mem = s["memory"]
    used = mem["peak_bytes"] / mem["capacity_bytes"] if mem["capacity_bytes"] else None
    return {
        "run": name,
        "data_wait_fraction": s["data_wait_fraction"],
        "memory_used": used,
        "advice": [a["technique"] for a in s["advice"]],
        "first_reason": s["advice"][0]["reason"] if s["advice"] else "",
    }


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--steps", type=int, default=None, help="steps per overhead fit")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument(
        "--only", choices=("overhead",), default=None, help="run only the overhead rounds"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (1: a step does not wait on a descheduled thread of a shared core)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--render", action="store_true", help="only redo the Markdown from the saved JSON"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.quick else 30)
    rounds = args.rounds or (1 if args.quick else 7)
    stem = "profiler_quick" if args.quick else "profiler"
    if args.only:
        stem += f"_{args.only}"
    out = Path(args.out or RESULTS / stem)
    if args.render:
        saved = json.loads(out.with_name(out.name + ".json").read_text())
        text = render(saved["env"], saved["overhead"], saved.get("flops"), saved.get("verdicts"))
        save_results(out, text, saved)
        return 0
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(args.threads, torch.get_num_threads())))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    overhead = start_to_start(rounds, steps)
    overhead["own_work"] = own_work(steps)
    summary = overhead.pop("summary")
    overhead["demo_profile"] = {
        k: summary[k]
        for k in ("phases", "step_s", "samples_per_s", "tokens_per_s", "flops_per_step", "mfu")
    } | {
        "peak_flops": summary["peak_flops"],
        "peak_source": summary["peak_source"],
        "advice": summary["advice"],
    }
    flops = verdict = None
    if args.only is None:
        flops = flops_rows(args.quick)
        verdict = verdicts()

    command = "python -m benchmarks.profiler" + " ".join(
        [""]
        + (["--quick"] if args.quick else [])
        + ([f"--only {args.only}"] if args.only else [])
        + ([f"--rounds {args.rounds}"] if args.rounds else [])
        + ([f"--threads {args.threads}"] if args.threads != 2 else [])
    )
    env = {
        **environment(("torch", "lightning")),
        "device": "cpu (no GPU)",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
        "command": command,
    }
    text = render(env, overhead, flops, verdict)
    save_results(out, text, {"env": env, "overhead": overhead, "flops": flops, "verdicts": verdict})
    return 0


def render(env: dict, overhead: dict, flops: list[dict] | None, verdict: list[dict] | None) -> str:
    """The Markdown tables of one run (``--render`` redoes them from the saved JSON)."""
    rounds, steps = overhead["rounds"], overhead["steps"]
    ratio, ratios, step_s = overhead["ratio"], overhead["ratios"], overhead["step_s"]
    own = overhead["own_work"]
    plain_s = overhead["plain_step_s"]
    d = overhead["demo_profile"]
    cpu_ratio, cpu_ratios = overhead.get("cpu_ratio", {}), overhead.get("cpu_ratios", {})
    cpu_s = overhead.get("cpu_step_s", {})

    def cpu_cells(v: str) -> str:
        if not cpu_s:
            return "- | - |"
        head = f"{statistics.median(cpu_s[v]) * 1e3:.1f} ms | "
        if v == "plain":
            return head + "1.000x (-) |"
        rs = cpu_ratios[v]
        return head + f"**{cpu_ratio[v]:.3f}x** ({min(rs):.3f}-{max(rs):.3f}) |"

    rows = [
        f"| {v} | {statistics.median(step_s[v]) * 1e3:.1f} ms | "
        + ("1.000x | - |" if v == "plain" else f"**{ratio[v]:.3f}x** | ")
        + ("" if v == "plain" else f"{min(ratios[v]):.3f}-{max(ratios[v]):.3f} |")
        + f" {cpu_cells(v)} "
        + ", ".join(f"{x * 1e3:.1f}" for x in step_s[v])
        + " |"
        for v in VARIANTS
    ]
    lines = [
        "# StepProfiler benchmark",
        "",
        f"`{env['command']}` on cpu (no GPU), {env['cores']} CPU cores, {env['torch_threads']} "
        f"torch threads, torch {env['torch']}, lightning {env['lightning']}, Python "
        f"{env['python']}; load average {env['load_average_at_start']:.1f} at the start, "
        f"{env.get('load_average_at_end', float('nan')):.1f} at the end (the 2 cores are shared "
        "with other jobs: the rounds are interleaved and the figures are medians).",
        "",
        f"## Overhead, start-to-start (TinyGPT 4x128, seq 128, batch {overhead['batch']}, fp32, "
        "CPU)",
        "",
        f"{rounds} interleaved rounds (order rotated each round) of three fits of {steps} steps; "
        "per fit the median start-to-start period (`perf_counter` at consecutive "
        f"`on_train_batch_start`, every hook of the step included) after {overhead['warmup']} "
        "warm-up periods; ratio to the plain fit of the same round, median over rounds.",
        "",
        "| Run | Step, wall (median of fits) | vs plain, wall (median of rounds) | range over "
        "rounds | Step, process CPU time | vs plain, CPU time (range) | per fit, wall (ms) |",
        "|---|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "The profiler's own work, timed inside a profiled fit (each hook's median call x its "
        "calls per step): "
        + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in own["per_hook_s"].items())
        + f"; in all **{own['per_step_s'] * 1e6:.0f} us per step = "
        f"{own['per_step_s'] / plain_s:.2%} of the plain step** ({plain_s * 1e3:.1f} ms).",
        "",
        "The demo model's profile (the last profiled fit):",
        "",
        "| data | forward | backward | optimizer | rest | step | samples/s | FLOPs/step | MFU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| "
        + " | ".join(
            f"{d['phases'][p] * 1e3:.1f} ms"
            for p in ("data", "forward", "backward", "optimizer", "rest")
        )
        + f" | {d['step_s'] * 1e3:.1f} ms | {d['samples_per_s']:.1f} | {d['flops_per_step'] / 1e9:.2f} G"
        f" | {d['mfu']:.1%} |",
        "",
        f"MFU peak: {d['peak_flops'] / 1e9:.1f} GFLOP/s ({d['peak_source']}; warm, the fastest "
        "of 7 products). Verdict: "
        + ("; ".join(f"{a['technique']} ({a['reason']})" for a in d["advice"]) or "none")
        + ".",
    ]
    if flops:
        lines += [
            "",
            "## FLOPs: counted (fake tensors, 3 x forward) vs analytic",
            "",
            "| Model | counted | analytic | formula | ratio |",
            "|---|---:|---:|---|---:|",
            *[
                f"| {r['model']} | {r['counted']:.4e} | {r['analytic']:.4e} | {r['formula']} | {r['ratio']:.4f} |"
                for r in flops
            ],
        ]
    if verdict:
        lines += [
            "",
            "## Verdicts",
            "",
            "| Run | data wait | memory used | advice (in order) |",
            "|---|---:|---:|---|",
            *[
                f"| {v['run']} | {v['data_wait_fraction']:.1%} | "
                + (f"{v['memory_used']:.0%}" if v["memory_used"] is not None else "n/a")
                + f" | {', '.join(v['advice']) or 'none'} |"
                for v in verdict
            ],
            "",
            *[f"- {v['run']}: {v['first_reason']}" for v in verdict if v["first_reason"]],
        ]
    lines += ["", "MFU on a GPU: not measured here (`benchmarks/gpu/suite.py` part 5 does)."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
