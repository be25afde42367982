"""Activation checkpointing: peak memory and step time against the plain run.

Two workloads, every mode measured in the same run:

- TinyGPT (the demo LightningModule) on this machine's CPU: the real peak of one fp32 AdamW
  training step measured by the instrument's storage tracker (``measure_step``), the estimate
  next to it, and the median step time (``time_fn``; modes interleaved over rounds so machine
  load hits them alike).
- GPT-2 small (124M, ``transformers`` config, seq 1024, batch 8, fp32 AdamW): the instrument's
  fake-tensor estimate with CUDA allocator rounding, i.e. the peak a GPU would need. No time:
  nothing runs.

Modes: plain, full (every block), every_n=2, selective (matmul/attention outputs kept) and
budget (the fewest blocks whose estimated peak is under a budget halfway between plain and full).

    python -m benchmarks.activation_checkpointing            # default (about 2 minutes)
    python -m benchmarks.activation_checkpointing --quick    # smaller TinyGPT, GPT-2 at seq 256 batch 2

Prints a table and saves benchmarks/results/activation_checkpointing{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import environment as base_environment
from benchmarks._results import save_results
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.functional import (
    apply_activation_checkpointing,
    blocks_for_budget,
)
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.techniques.activation_checkpointing import (
    remove_activation_checkpointing,
)

RESULTS = Path(__file__).resolve().parent / "results"
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "full": {},
    "every_n=2": {"every_n": 2},
    "selective": {"selective": True},
    "budget": {},  # num_blocks filled in from blocks_for_budget
}


def apply_mode(model: torch.nn.Module, mode: str, num_blocks: int | None = None) -> list[str]:
    remove_activation_checkpointing(model)
    if mode == "plain":
        return []
    return apply_activation_checkpointing(
        model, num_blocks=num_blocks if mode == "budget" else None, **MODES[mode]
    ).value


def midway_budget(plain: int, full: int) -> int:
    return full + (plain - full) // 2


# -- TinyGPT on the CPU: real tracking + time --------------------------------------------------
def tinygpt(cfg: dict[str, Any], batch_size: int, rounds: int) -> list[dict[str, Any]]:
    def fresh() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(**cfg)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (batch_size, cfg["seq_len"] + 1), generator=g)
    batch = (data[:, :-1], data[:, 1:])
    model = fresh()
    plain_est = estimate_memory(model, batch)
    apply_mode(model, "full")
    full_est = estimate_memory(model, batch)
    remove_activation_checkpointing(model)
    budget = midway_budget(plain_est.peak_bytes, full_est.peak_bytes)
    k = blocks_for_budget(model, batch, budget).num_blocks

    rows: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        m = fresh()
        names = apply_mode(m, mode, k)
        est = estimate_memory(m, batch)
        real = measure_step(m, batch, "adamw")  # real tensors, storage tracker, one model each
        rows[mode] = {
            "workload": f"TinyGPT {cfg['n_layer']}x{cfg['n_embd']}, seq {cfg['seq_len']}, batch {batch_size} (CPU, real)",
            "mode": mode + (f" ({format_bytes(budget)})" if mode == "budget" else ""),
            "blocks": len(names),
            "peak_bytes": real.peak_bytes,
            "activation_bytes": real.by_category["activations"],
            "estimate_peak_bytes": est.peak_bytes,
            "step_s": [],
        }

    models, opts = {}, {}
    for mode in MODES:
        models[mode] = fresh()
        apply_mode(models[mode], mode, k)
        opts[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4)

    def step_fn(mode: str):
        model, opt = models[mode], opts[mode]

        def step() -> None:
            logits = model(batch[0])
            F.cross_entropy(logits.reshape(-1, 256), batch[1].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    for mode in MODES:
        step_fn(mode)()  # warm up every mode before any timing
    for _ in range(rounds):
        for mode in MODES:
            rows[mode]["step_s"].append(time_fn(step_fn(mode), warmup=0, repeats=1))
    return _ratios(list(rows.values()))


# -- GPT-2 small, estimated ----------------------------------------------------------------------
def gpt2_small(seq: int, batch_size: int) -> list[dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_positions=max(1024, seq), use_cache=False))
    ids = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    kw = dict(loss_fn=lambda m, b: m(input_ids=b, labels=b).loss, cuda_rounding=True)
    n_params = sum(p.numel() for p in model.parameters())
    peaks: dict[str, Any] = {}
    names: dict[str, list[str]] = {}
    for mode in ("plain", "full", "every_n=2", "selective"):
        names[mode] = apply_mode(model, mode)
        peaks[mode] = estimate_memory(model, ids, **kw)
    remove_activation_checkpointing(model)
    budget = midway_budget(peaks["plain"].peak_bytes, peaks["full"].peak_bytes)
    choice = blocks_for_budget(model, ids, budget, **kw)
    names["budget"] = apply_mode(model, "budget", choice.num_blocks)
    peaks["budget"] = estimate_memory(model, ids, **kw)
    remove_activation_checkpointing(model)
    rows = []
    for mode, est in peaks.items():
        rows.append(
            {
                "workload": f"GPT-2 small ({n_params / 1e6:.0f}M), seq {seq}, batch {batch_size} (estimate, CUDA rounding)",
                "mode": mode + (f" ({format_bytes(budget)})" if mode == "budget" else ""),
                "blocks": len(names[mode]),
                "peak_bytes": est.peak_bytes,
                "activation_bytes": est.by_category["activations"],
                "estimate_peak_bytes": est.peak_bytes,
                "step_s": [],
                "estimates_in_budget_search": len(choice.peaks) if mode == "budget" else None,
            }
        )
    return _ratios(rows)


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    plain = rows[0]
    for r in rows:
        r["peak_ratio"] = r["peak_bytes"] / plain["peak_bytes"]
        r["activation_ratio"] = r["activation_bytes"] / max(1, plain["activation_bytes"])
        if r["step_s"]:
            r["step_s"] = statistics.median(r["step_s"])
            r["time_ratio"] = r["step_s"] / plain["step_s"]
        else:
            r["step_s"] = r["time_ratio"] = None
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, str], command: str) -> str:
    lines = [
        "| workload | mode | blocks | peak | peak vs plain | activations | activations vs plain | estimate | step time | time vs plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = f"{r['step_s'] * 1000:.1f} ms" if r["step_s"] else "n/a"
        tr = f"{r['time_ratio']:.2f}x" if r["time_ratio"] else "n/a"
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['blocks']} | {format_bytes(r['peak_bytes'])} | "
            f"{r['peak_ratio']:.2f}x | {format_bytes(r['activation_bytes'])} | {r['activation_ratio']:.2f}x | "
            f"{format_bytes(r['estimate_peak_bytes'])} | {t} | {tr} |"
        )
    lines += [
        "",
        f"Command: `{command}`",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
    ]
    return "\n".join(lines) + "\n"


def environment() -> dict[str, str]:
    return {
        **base_environment(("torch", "lightning", "transformers")),
        "torch threads": str(torch.get_num_threads()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller TinyGPT, fewer timing rounds, GPT-2 at seq 256 batch 2",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--out",
        default=None,
        help="result stem (default benchmarks/results/activation_checkpointing{,_quick})",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        cfg, batch_size, rounds = (
            dict(seq_len=64, n_layer=4, n_embd=64, n_head=4, dropout=0.1),
            4,
            3,
        )
        gpt2_seq, gpt2_batch = 256, 2
    else:
        cfg, batch_size, rounds = (
            dict(seq_len=128, n_layer=6, n_embd=128, n_head=4, dropout=0.1),
            8,
            5,
        )
        gpt2_seq, gpt2_batch = 1024, 8
    rows = tinygpt(cfg, batch_size, rounds) + gpt2_small(gpt2_seq, gpt2_batch)
    command = "python -m benchmarks.activation_checkpointing" + (" --quick" if args.quick else "")
    if args.threads != 1:
        command += f" --threads {args.threads}"
    env = environment()
    text = markdown(rows, env, command)
    stem = args.out or RESULTS / ("activation_checkpointing" + ("_quick" if args.quick else ""))
    md, js = save_results(stem, text, {"command": command, "environment": env, "rows": rows})
    print(f"saved {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
