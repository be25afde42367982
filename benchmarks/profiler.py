"""StepProfiler benchmark: its overhead, the accuracy of its FLOP count, and its verdicts.

In one run:

1. **Overhead.** TinyGPT (the demo's size: 4 layers, width 128, sequence 128, batch 16) fits on
   the CPU with and without ``StepProfiler()`` (default settings), in interleaved rounds. An
   independent clock (``perf_counter`` at each ``on_train_batch_start``) gives the steady step
   time of each run; the ratio with/without is taken per round (the load of other processes moves
   both runs of a round alike), and the median over rounds is reported. Because that ratio is
   noisy at the 1% level on a shared machine, the profiler's own per-step work is also timed
   directly: its phase switches and batch counting, plus the profiler-hook forwarding for as many
   calls as Lightning makes per step, as a share of the step time.
2. **FLOPs.** ``count_flops`` (fake tensors, 3 x forward) against the analytic count: an MLP
   against 6 x parameters x samples; TinyGPT and a GPT-2-shaped ``transformers`` model against
   6 x (matrix-product parameters) x tokens + attention (2 x 2 x seq^2 x width per layer and
   sequence, forward, x 3).
3. **Verdicts.** Short fits: an input-bound run (``__getitem__`` sleeps), a run whose model state
   dominates memory (with a memory budget just above its peak), and a balanced run; the advice
   each one gets.

    python benchmarks/profiler.py            # default (about 3 minutes on 2 idle CPU cores)
    python benchmarks/profiler.py --quick    # a smoke run

Prints the tables and saves ``benchmarks/results/profiler.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.profilers import PassThroughProfiler
from torch import nn
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import QUIET_TRAINER, environment, save_results  # noqa: E402

from lightning_efficient.demos import TextDataModule, TinyGPT  # noqa: E402
from lightning_efficient.measure import MemoryBreakdown, StepProfiler, estimate_memory  # noqa: E402
from lightning_efficient.measure.flops import count_flops  # noqa: E402
from lightning_efficient.measure.step_phases import FetchWatch  # noqa: E402
from lightning_efficient.measure.timing import StepTimer  # noqa: E402
from lightning_efficient.measure.tokens import batch_counts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEMO = dict(seq_len=128, n_layer=4, n_embd=128, n_head=4, dropout=0.1)


class Clock(Callback):
    """perf_counter at every train batch start: the step periods, independent of StepProfiler."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def periods(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])][warmup:]


class CountingProfiler(PassThroughProfiler):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def start(self, action_name: str) -> None:
        self.calls += 1


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


def fit_demo(steps: int, profiled: bool) -> dict:
    pl.seed_everything(0, verbose=False)
    clock = Clock()
    callbacks: list = [clock]
    if profiled:
        callbacks.append(StepProfiler(print_table=False))
    trainer = _trainer(steps, callbacks)
    t0 = time.perf_counter()
    with _quiet():
        trainer.fit(TinyGPT(**DEMO), datamodule=TextDataModule(batch_size=16, seq_len=128))
    periods = clock.periods(warmup=3)
    out = {
        "steady_step_s": statistics.median(periods),
        # the fastest step is the one least disturbed by other processes on a shared machine
        "fastest_step_s": min(periods),
        "fit_s": time.perf_counter() - t0,
    }
    if profiled:
        out["summary"] = callbacks[1].summary
    return out


def hook_cost(step_s: float) -> dict:
    """Seconds of StepProfiler's own work per step, timed directly."""
    # profiler calls Lightning makes per training step (callback hooks, loops, fetch)
    counter = CountingProfiler()
    trainer = _trainer(6, [], profiler=counter)
    with _quiet():
        trainer.fit(TinyGPT(**DEMO), datamodule=TextDataModule(batch_size=16, seq_len=128))
    calls_per_step = counter.calls / 6
    n = 2000
    profiler = StepProfiler()
    profiler._timer, profiler._measuring = StepTimer("cpu"), True
    x = torch.zeros(16, 128, dtype=torch.long)
    t0 = time.perf_counter()
    for _ in range(n):
        for phase in ("data", "forward", "optimizer", "backward", "optimizer", "rest"):
            profiler._switch(phase)
        batch_counts((x, x))
    switches = (time.perf_counter() - t0) / n
    plain, watch = PassThroughProfiler(), FetchWatch(PassThroughProfiler(), lambda: None)
    timings = {}
    for name, prof in (("plain", plain), ("watch", watch)):
        t0 = time.perf_counter()
        for _ in range(n * 10):
            prof.start("[Callback]x.on_train_batch_start")
            prof.stop("[Callback]x.on_train_batch_start")
        timings[name] = (time.perf_counter() - t0) / (n * 10)
    forwarding = max(0.0, timings["watch"] - timings["plain"]) * calls_per_step
    per_step = switches + forwarding
    return {
        "profiler_calls_per_step": calls_per_step,
        "switches_s": switches,
        "forwarding_s": forwarding,
        "per_step_s": per_step,
        "share_of_step": per_step / step_s,
    }


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
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--render", action="store_true", help="only redo the Markdown from the saved JSON"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (8 if args.quick else 30)
    rounds = args.rounds or (1 if args.quick else 5)
    out = Path(args.out or RESULTS / ("profiler_quick" if args.quick else "profiler"))
    if args.render:
        saved = json.loads(out.with_name(out.name + ".json").read_text())
        text = render(saved["env"], saved["overhead"], saved["flops"], saved["verdicts"])
        save_results(out, text, saved)
        return 0
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    ratios, fastest, fit_ratios, plain_steps, summary = [], [], [], [], None
    for _ in range(rounds):
        plain = fit_demo(steps, profiled=False)
        prof = fit_demo(steps, profiled=True)
        ratios.append(prof["steady_step_s"] / plain["steady_step_s"])
        fastest.append(prof["fastest_step_s"] / plain["fastest_step_s"])
        fit_ratios.append(prof["fit_s"] / plain["fit_s"])
        plain_steps.append(plain["steady_step_s"])
        summary = prof["summary"]
    step_s = statistics.median(plain_steps)
    hooks = hook_cost(step_s)
    overhead = {
        "steps": steps,
        "rounds": rounds,
        "plain_step_s": step_s,
        "step_ratio": statistics.median(ratios),
        "step_ratios": ratios,
        "fastest_step_ratio": statistics.median(fastest),
        "fastest_step_ratios": fastest,
        "fit_ratio": statistics.median(fit_ratios),
        "hooks": hooks,
        "demo_profile": {
            k: summary[k]
            for k in ("phases", "step_s", "samples_per_s", "tokens_per_s", "flops_per_step", "mfu")
        }
        | {"peak_flops": summary["peak_flops"], "peak_source": summary["peak_source"]},
    }
    flops = flops_rows(args.quick)
    verdict = verdicts()

    env = {
        **environment(("torch", "lightning")),
        "device": "cpu (no GPU)",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load,
        "command": "python benchmarks/profiler.py" + (" --quick" if args.quick else ""),
    }
    text = render(env, overhead, flops, verdict)
    save_results(out, text, {"env": env, "overhead": overhead, "flops": flops, "verdicts": verdict})
    return 0


def render(env: dict, overhead: dict, flops: list[dict], verdict: list[dict]) -> str:
    """The Markdown tables of one run (``--render`` redoes them from the saved JSON)."""
    load, rounds, steps = env["load_average_at_start"], overhead["rounds"], overhead["steps"]
    ratios, fastest = overhead["step_ratios"], overhead["fastest_step_ratios"]
    step_s, hooks = overhead["plain_step_s"], overhead["hooks"]
    d = overhead["demo_profile"]
    lines = [
        "# StepProfiler benchmark",
        "",
        f"`{env['command']}` on cpu (no GPU), {env['cores']} CPU cores, {env['torch_threads']} "
        f"torch threads, torch {env['torch']}, lightning {env['lightning']}, Python "
        f"{env['python']}; load average {load:.1f} at the start.",
        "",
        "## Overhead (TinyGPT 4x128, seq 128, batch 16, fp32, CPU)",
        "",
        f"Steady step time with `StepProfiler()` over without, median of {rounds} interleaved "
        f"rounds of {steps} steps: **{overhead['step_ratio']:.3f}x** (per round: "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + "); fastest step with over without (the step least disturbed by other processes): "
        f"**{overhead['fastest_step_ratio']:.3f}x** (per round: "
        + ", ".join(f"{r:.3f}" for r in fastest)
        + f"); whole fit, including the one-off FLOP count and CPU peak measurement: "
        f"{overhead['fit_ratio']:.3f}x. Plain step (median): {step_s * 1e3:.1f} ms.",
        "",
        f"The profiler's own work per step, timed directly: {hooks['switches_s'] * 1e6:.1f} us of "
        f"phase switches and batch counting + {hooks['forwarding_s'] * 1e6:.1f} us of hook "
        f"forwarding ({hooks['profiler_calls_per_step']:.0f} profiler calls per step) = "
        f"{hooks['per_step_s'] * 1e6:.1f} us, **{hooks['share_of_step']:.3%} of the step**.",
        "",
        "The demo model's profile (one profiled run):",
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
        f"MFU peak: {d['peak_flops'] / 1e9:.1f} GFLOP/s ({d['peak_source']}).",
        "",
        "## FLOPs: counted (fake tensors, 3 x forward) vs analytic",
        "",
        "| Model | counted | analytic | formula | ratio |",
        "|---|---:|---:|---|---:|",
        *[
            f"| {r['model']} | {r['counted']:.4e} | {r['analytic']:.4e} | {r['formula']} | {r['ratio']:.4f} |"
            for r in flops
        ],
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
        "",
        "MFU on a GPU: not measured on a GPU.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
