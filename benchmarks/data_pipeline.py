"""Data pipeline benchmark: plain loading vs DataLoaderTuning vs DevicePreload, and bucketing.

A TinyGPT trains on the demo corpus through a dataset that sleeps per sample (a stand-in for
reading and decoding: it costs wall time, not CPU, like storage or network latency). In one run
it measures training throughput (samples/s over the steps after warm-up) on two workloads:

- ``decode``: ``--decode-ms`` per sample, TinyGPT 2 x 64 (the card's main table);
- ``input-bound``: ``--io-decode-ms`` (3 ms) per sample, batch 16, a TinyGPT of 1 layer x 32
  (issue 20, item 3: the default ``DataLoaderTuning()`` must fix it, goal >= 1.5x),

each with plain loading (``num_workers=0``), ``DataLoaderTuning(tune=False)`` (the rule:
cores - 1 workers), ``DataLoaderTuning()`` (the default: worker counts measured) and
``DevicePreload`` (the dataset decoded once and served from device memory: the compute-bound
limit), with ``InputStallMonitor`` attached (its stall fraction is printed). The speed-up is the
ratio to plain loading in the same round, and every run is checked to train on the same batches
in the same order as the plain run. It then measures the padding that ``LengthBucketSampler``
saves when the corpus's paragraphs (variable-length text, up to 512 bytes) are batched and
padded to the longest sample of each batch.

    python -m benchmarks.data_pipeline            # default (about 8 minutes on 2 busy CPU cores)
    python -m benchmarks.data_pipeline --quick    # a smoke run

Prints a table and saves ``benchmarks/results/data_pipeline.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset

from benchmarks._results import QUIET_TRAINER, environment, save_results
from lightning_efficient.core.report import report_for
from lightning_efficient.demos import TinyGPT
from lightning_efficient.demos.text import ByteChunks, EpochShuffle, load_corpus
from lightning_efficient.functional import (
    LengthBucketSampler,
    padding_stats,
)
from lightning_efficient.measure.speed.input_stall import InputStallMonitor
from lightning_efficient.measure.speed.timing import StepTimer
from lightning_efficient.techniques.dataloading import (
    DataLoaderTuning,
    DevicePreload,
    auto_num_workers,
)

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"


class Decoded(Dataset):
    """ByteChunks behind a simulated per-sample decode latency (``time.sleep``)."""

    def __init__(self, inner: Dataset, decode_s: float) -> None:
        self.inner, self.decode_s = inner, decode_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        time.sleep(self.decode_s)
        return self.inner[i]


class DecodedText(pl.LightningDataModule):
    def __init__(self, samples: int, seq_len: int, batch_size: int, decode_s: float) -> None:
        super().__init__()
        self.samples, self.seq_len, self.batch_size, self.decode_s = (
            samples,
            seq_len,
            batch_size,
            decode_s,
        )

    def setup(self, stage: str) -> None:
        chunks = ByteChunks(load_corpus(), self.seq_len)
        self.train_set = Decoded(
            torch.utils.data.Subset(chunks, range(self.samples)), self.decode_s
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(self.train_set)),
            drop_last=True,
        )


class Throughput(Callback):
    """Times the steps after ``warmup`` with the instrument's StepTimer (one region) and keeps a
    fingerprint of every training batch (to check that the runs see the same batches)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.timer, self.steps, self.samples = warmup, None, 0, 0
        self.batches: list[int] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.timer = StepTimer(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(hash(batch[0].cpu().numpy().tobytes()))
        if trainer.global_step == self.warmup:
            self.timer.start("steps")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup:
            self.steps += 1
            self.samples += int(batch[0].shape[0])
        if trainer.global_step == trainer.max_steps:
            self.timer.stop("steps")

    def samples_per_s(self) -> float:
        return self.samples / self.timer.totals()["steps"]


def run(name: str, technique: Callback | None, w: dict, args: argparse.Namespace) -> dict:
    """One fit of workload ``w`` (decode_ms, n_layer, n_embd, seq_len) with ``technique``."""
    pl.seed_everything(0, verbose=False)
    model = TinyGPT(
        seq_len=w["seq_len"], n_layer=w["n_layer"], n_embd=w["n_embd"], n_head=4, dropout=0.0
    )
    samples = args.batch_size * (args.steps + args.warmup + 1)
    data = DecodedText(samples, w["seq_len"], args.batch_size, w["decode_ms"] / 1000)
    meter, monitor = Throughput(args.warmup), InputStallMonitor(check_after=max(1, args.steps // 2))
    callbacks = [c for c in (technique, monitor, meter) if c is not None]
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.warmup + args.steps,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    stall_warning = next(
        (str(m.message) for m in caught if "InputStallMonitor" in str(m.message)), None
    )
    wall = time.perf_counter() - start
    report = report_for(trainer).to_dict()
    loader = trainer.train_dataloader
    tune_s = (report.get("DataLoaderTuning") or {}).get("tune_s")
    return {
        "loading": name,
        "samples_per_s": meter.samples_per_s(),
        "stall_fraction": monitor.stall_fraction,
        "num_workers": getattr(loader, "num_workers", None),
        "fit_wall_s": wall,
        "tune_s": tune_s,
        "batches": meter.batches,
        "stall_warning": stall_warning,
        "report": report,
        "device": str(trainer.strategy.root_device),
    }


CONFIGS: list[tuple[str, Callable[[argparse.Namespace], Callback | None]]] = [
    ("plain (num_workers=0)", lambda args: None),
    ("DataLoaderTuning(tune=False) (rule: cores - 1)", lambda args: DataLoaderTuning(tune=False)),
    (
        "DataLoaderTuning() (default: measured)",
        lambda args: DataLoaderTuning(tune_time_s=args.tune_time_s),
    ),
    ("DevicePreload() (compute-bound limit)", lambda args: DevicePreload()),
]
PLAIN, LIMIT = 0, len(CONFIGS) - 1


def compare(w: dict, args: argparse.Namespace) -> tuple[list[dict], list[list[dict]]]:
    """Every loading of ``CONFIGS`` on workload ``w``, in rounds that interleave them (rotated
    order), so that load from other processes on a shared machine hits them alike; each figure
    is the median over the rounds, each ratio the median of the per-round ratios."""
    n = len(CONFIGS)
    runs: list[list[dict]] = [[] for _ in CONFIGS]
    for r in range(args.rounds):
        for k in range(n):
            i = (k + r) % n
            runs[i].append(run(CONFIGS[i][0], CONFIGS[i][1](args), w, args))
    rows = []
    for i in range(n):
        row = {k: v for k, v in runs[i][0].items() if k != "batches"}
        row["samples_per_s"] = statistics.median(x["samples_per_s"] for x in runs[i])
        row["samples_per_s_rounds"] = [round(x["samples_per_s"], 2) for x in runs[i]]
        row["num_workers_rounds"] = [x["num_workers"] for x in runs[i]]
        stalls = [x["stall_fraction"] for x in runs[i] if x["stall_fraction"] is not None]
        row["stall_fraction"] = statistics.median(stalls) if stalls else None
        tunes = [x["tune_s"] for x in runs[i] if x["tune_s"] is not None]
        row["tune_s"] = statistics.median(tunes) if tunes else None
        for key, ref in (("of_limit", LIMIT), ("vs_plain", PLAIN)):
            row[key] = statistics.median(
                runs[i][r]["samples_per_s"] / runs[ref][r]["samples_per_s"]
                for r in range(args.rounds)
            )
        row["same_batches_as_plain"] = all(
            runs[i][r]["batches"] == runs[PLAIN][r]["batches"] for r in range(args.rounds)
        )
        rows.append(row)
    # within-run figure, insensitive to the machine's load level: the share of step time not
    # spent waiting, against the same share of the preloaded run
    for row in rows:
        stall, stall_limit = row["stall_fraction"], rows[LIMIT]["stall_fraction"]
        ok = stall is not None and stall_limit is not None
        row["of_limit_by_stall"] = (1 - stall) / (1 - stall_limit) if ok else None
    return rows, runs


def table(rows: list[dict]) -> list[str]:
    md = [
        "| Loading | workers | samples/s | vs plain (same round) | of compute-bound limit | "
        "stall fraction (InputStallMonitor) | of the limit by stall fraction | tuning s | "
        "same batches as plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        stall = "n/a" if r["stall_fraction"] is None else f"{r['stall_fraction']:.1%}"
        workers = "/".join(str(w) for w in dict.fromkeys(r["num_workers_rounds"]))
        by_stall = "n/a" if r["of_limit_by_stall"] is None else f"{r['of_limit_by_stall']:.2f}"
        tune = "" if r["tune_s"] is None else f"{r['tune_s']:.1f}"
        same = "yes" if r["same_batches_as_plain"] else "NO"
        md.append(
            f"| {r['loading']} | {workers} | {r['samples_per_s']:.1f} | {r['vs_plain']:.2f}x | "
            f"{r['of_limit']:.2f} | {stall} | {by_stall} | {tune} | {same} |"
        )
    return md


def padding(args: argparse.Namespace) -> dict:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lengths = [min(512, len(p.encode())) for p in text.split("\n\n") if p.strip()]
    b = args.batch_size
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    plain = padding_stats(lengths, [order[i : i + b] for i in range(0, len(order), b)])
    sampler = LengthBucketSampler(lengths, bucket_size=b * 50, seed=0)
    bucketed_order = list(sampler)
    bucketed = padding_stats(
        lengths, [bucketed_order[i : i + b] for i in range(0, len(bucketed_order), b)]
    )
    return {
        "samples": len(lengths),
        "batch_size": b,
        "bucket_size": b * 50,
        "plain_padding_fraction": plain["padding_fraction"],
        "bucketed_padding_fraction": bucketed["padding_fraction"],
        "plain_padded_tokens": plain["padded_tokens"],
        "bucketed_padded_tokens": bucketed["padded_tokens"],
        "real_tokens": plain["real_tokens"],
        "tokens_saved_fraction": 1 - bucketed["padded_tokens"] / plain["padded_tokens"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--decode-ms", type=float, default=2.0, help="simulated decode latency per sample"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument(
        "--io-decode-ms", type=float, default=3.0, help="input-bound workload: decode per sample"
    )
    parser.add_argument("--io-seq-len", type=int, default=32)
    parser.add_argument("--io-n-layer", type=int, default=1)
    parser.add_argument("--io-n-embd", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads of the training process"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved repetitions (median reported)"
    )
    parser.add_argument(
        "--tune-time-s", type=float, default=10.0, help="DataLoaderTuning(tune_time_s=...)"
    )
    parser.add_argument("--out", default=str(RESULTS / "data_pipeline"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 8, 2, 1
    # one intra-op thread: on a shared 2-core machine two OpenMP threads spin against other
    # processes and make a step ~10x slower (measured here: 0.058 s vs 0.57 s per step)
    torch.set_num_threads(args.threads)

    workloads = {
        "decode": dict(
            decode_ms=args.decode_ms, n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len
        ),
        "input-bound": dict(
            decode_ms=args.io_decode_ms,
            n_layer=args.io_n_layer,
            n_embd=args.io_n_embd,
            seq_len=args.io_seq_len,
        ),
    }
    results = {name: compare(w, args) for name, w in workloads.items()}
    rows, runs = results["decode"]
    io_rows, _ = results["input-bound"]
    pad = padding(args)
    env = {
        "command": "python -m benchmarks.data_pipeline "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        **environment(("torch", "lightning")),
        "device": rows[0]["device"],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "auto_num_workers": auto_num_workers(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    d, io = workloads["decode"], workloads["input-bound"]
    md = [
        "# Data pipeline benchmark",
        "",
        f"`{env['command'].strip()}` on {env['device']} ({env['gpu'] or 'no GPU'}), "
        f"{env['cpu_cores']} CPU cores, torch {env['torch']}, lightning {env['lightning']}, "
        f"Python {env['python']}. Batch {args.batch_size}, {args.steps} timed steps after "
        f"{args.warmup} warm-up, {args.threads} torch thread(s) in the training process. "
        f"Median of {args.rounds} interleaved rounds (ratios: median of the per-round ratios). "
        "The column 'of the limit by stall fraction' is (1 - stall) / (1 - stall of "
        "DevicePreload): the same ratio from the time split inside each run, which the load of "
        "other processes moves less than it moves samples/s. 'same batches as plain': every "
        "training batch equal to the plain run's, in the same order, in every round.",
        "",
        f"## Input-bound: {io['decode_ms']:g} ms wait per sample, TinyGPT n_layer={io['n_layer']} "
        f"n_embd={io['n_embd']} seq_len={io['seq_len']}",
        "",
        *table(io_rows),
        "",
        f"## Decode: {d['decode_ms']:g} ms wait per sample, TinyGPT n_layer={d['n_layer']} "
        f"n_embd={d['n_embd']} seq_len={d['seq_len']}",
        "",
        *table(rows),
    ]
    plain_warning = next((x["stall_warning"] for x in runs[PLAIN] if x["stall_warning"]), None)
    md += [
        "",
        "InputStallMonitor's warning on the plain run of the decode workload (first round):",
        "",
        f"    {plain_warning}",
    ]
    md += [
        "",
        f"Padding to the longest sample per batch, {pad['samples']} paragraphs of the corpus "
        f"(<= 512 bytes), batch {pad['batch_size']}:",
        "",
        "| Batching | padding share of the padded tokens | padded tokens |",
        "|---|---:|---:|",
        f"| random | {pad['plain_padding_fraction']:.1%} | {pad['plain_padded_tokens']} |",
        f"| LengthBucketSampler(bucket_size={pad['bucket_size']}) | "
        f"{pad['bucketed_padding_fraction']:.1%} | {pad['bucketed_padded_tokens']} |",
        "",
        f"LengthBucketSampler cuts the padded tokens by {pad['tokens_saved_fraction']:.1%} "
        f"(real tokens: {pad['real_tokens']}).",
    ]

    def slim(rs: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "report"} for r in rs]

    tuned = [x["report"].get("DataLoaderTuning") for x in results["input-bound"][1][2]]
    md_path, json_path = save_results(
        args.out,
        "\n".join(md),
        {
            "env": env,
            "workloads": workloads,
            "throughput": slim(rows),
            "input_bound": slim(io_rows),
            "input_bound_tuning_reports": tuned,
            "padding": pad,
        },
    )
    print(f"\nsaved {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
