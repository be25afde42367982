"""EfficientBatchSize: candidate micro-batches of TinyGPT on this CPU, and GPT-2 small in 24 GiB.

Part 1, TinyGPT (the demo model: 4 blocks, width 128, sequence 128) on this CPU, AdamW fp32:
for each candidate micro-batch (powers of two), the peak memory of two real steps tracked by
the instrument (``measure_step``), the instrument's estimate of it, and samples/s (forward +
backward + optimizer step, median of 5 timed with the instrument's ``time_fn``). Marked: the micro-batch
``mode="max_fit"`` chooses under ``--budget`` (estimate, margin 0.1) and the one
``mode="throughput"`` keeps (the fastest that fits).

Part 2, GPT-2 small (124M, transformers config on the meta device, no download), sequence
1024, AdamW: from the estimate alone (fake tensors, for a CUDA target: the H100/H200 class), the
largest micro-batch that fits 24 GiB (its allocations replayed through the CUDA caching allocator
under that cap: ``MemoryEstimate.fits``) for fp32, bf16-mixed and bf16-mixed with every block
checkpointed (ActivationCheckpointing), found by ``largest_fitting_batch``; with the number of
estimates the search needed and its seconds.

Run:  python -m benchmarks.batch_size          (~3 minutes on 2 cores)
      python -m benchmarks.batch_size --quick  (TinyGPT up to 16; GPT-2 at sequence 256 in 6 GiB)
Writes benchmarks/results/batch_size{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks._results import environment, provenance, save_results
from lightning_efficient.core.validate import format_bytes, parse_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.measure.step import loss_of
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
from lightning_efficient.techniques.batch_size.sizing import (
    candidate_sizes,
    choose_micro_batch,
    largest_fitting_batch,
)

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30


def tiny_batch(n: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (n, seq), generator=g)
    return x, x


class Silent:
    """Runs a LightningModule's training_step outside a Trainer with self.log silenced."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __enter__(self):
        self.module.log = lambda *a, **k: None
        return self.module

    def __exit__(self, *exc) -> None:
        del self.module.log


def samples_per_s(n: int, seq: int, model_kwargs: dict) -> tuple[float, float]:
    torch.manual_seed(0)
    model = TinyGPT(**model_kwargs).train()
    opt = torch.optim.AdamW(model.parameters())
    batch = tiny_batch(n, seq)
    with Silent(model):

        def step() -> None:
            loss = loss_of(model.training_step(batch, 0))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        cpu0 = time.process_time()
        seconds = time_fn(step, warmup=1, repeats=5)
        cpu = (time.process_time() - cpu0) / 6  # per call: 1 warmup + 5 timed
    return n / seconds, n / cpu


def part1(args) -> tuple[list[dict], dict]:
    seq = 128
    model_kwargs = dict(seq_len=seq, n_layer=4, n_embd=128, n_head=4, dropout=0.0)
    budget = parse_bytes("budget", args.budget)
    usable = int(budget * 0.9)
    top = 16 if args.quick else 64
    model = TinyGPT(**model_kwargs)
    estimate = lambda n: estimate_memory(model, tiny_batch(n, seq)).peak_bytes  # noqa: E731
    largest, seen = largest_fitting_batch(estimate, usable, top)
    max_fit = choose_micro_batch(largest)[0]
    rows = []
    for n in candidate_sizes(top):
        torch.manual_seed(0)
        real = measure_step(TinyGPT(**model_kwargs), tiny_batch(n, seq)).peak_bytes
        est = seen.get(n) or estimate(n)
        rate, per_cpu_s = samples_per_s(n, seq, model_kwargs)
        rows.append(
            {
                "micro_batch": n,
                "peak_bytes": real,
                "estimate_bytes": int(est),
                "fits": est <= usable,
                "samples_per_s": rate,
                "samples_per_cpu_s": per_cpu_s,
            }
        )
    fitting = [r for r in rows if r["fits"]]
    fastest = max(fitting, key=lambda r: r["samples_per_s"])["micro_batch"]
    for r in rows:
        r["chosen"] = " ".join(
            tag
            for tag, m in (("max_fit", max_fit), ("throughput", fastest))
            if r["micro_batch"] == m
        )
    info = {
        "budget_bytes": budget,
        "usable_bytes": usable,
        "largest_fitting": largest,
        "max_fit": max_fit,
        "throughput": fastest,
        "estimates": len(seen),
        "model": model_kwargs,
    }
    return rows, info


def part2(args) -> tuple[list[dict], dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    seq = 256 if args.quick else 1024
    budget = parse_bytes("budget", "6GiB" if args.quick else "24GiB")
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_positions=1024))
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    rows = []
    for name, precision, callbacks in [
        ("fp32", "32-true", []),
        ("bf16-mixed", "bf16-mixed", []),
        ("bf16-mixed + checkpointing", "bf16-mixed", [ActivationCheckpointing()]),
    ]:

        def estimate(n: int) -> float:
            ids = torch.empty(n, seq, dtype=torch.long, device="meta")
            est = estimate_memory(
                model,
                ids,
                loss_fn=loss_fn,
                precision=precision,
                callbacks=callbacks,
                device="cuda",
            )
            return est.peak_bytes if est.fits(budget) else float("inf")

        t0 = time.perf_counter()
        largest, seen = largest_fitting_batch(estimate, budget, 512)
        seconds = time.perf_counter() - t0
        bf16 = precision != "32-true"
        rounded_rtx = choose_micro_batch(
            largest, precision=precision, device_type="cuda", capability=(8, 6)
        )[0]
        rows.append(
            {
                "run": name,
                "largest_micro_batch": largest,
                "peak_bytes": int(seen[largest]),
                "next_bytes": int(seen[largest + 1])
                if largest + 1 in seen and seen[largest + 1] != float("inf")
                else None,
                "rounded_cuda": rounded_rtx,
                "estimates": len(seen),
                "search_s": seconds,
                "bf16": bf16,
            }
        )
    info = {
        "budget_bytes": budget,
        "seq": seq,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return rows, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller, for a fast check")
    parser.add_argument("--budget", default="40MiB", help="TinyGPT budget for the choice (part 1)")
    parser.add_argument(
        "--out", default=None, help="result stem (default benchmarks/results/batch_size{,_quick})"
    )
    args = parser.parse_args()
    torch.set_num_threads(2)

    t0 = time.perf_counter()
    rows1, info1 = part1(args)
    rows2, info2 = part2(args)
    wall = time.perf_counter() - t0

    lines = [
        f"### TinyGPT on this CPU (fp32 AdamW, sequence 128): candidate micro-batches, budget "
        f"{format_bytes(info1['budget_bytes'])} (margin 0.1: {format_bytes(info1['usable_bytes'])})",
        "",
        "| Micro-batch | Peak, measured | Peak, estimate | Fits | Samples/s | Samples per CPU-s | Chosen |",
        "|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows1:
        lines.append(
            f"| {r['micro_batch']} | {format_bytes(r['peak_bytes'])} | {format_bytes(r['estimate_bytes'])} | "
            f"{'yes' if r['fits'] else 'no'} | {r['samples_per_s']:.1f} | {r['samples_per_cpu_s']:.1f} | {r['chosen']} |"
        )
    lines += [
        "",
        f"Largest fitting micro-batch (estimate): {info1['largest_fitting']} after {info1['estimates']} "
        f"estimates; max_fit rounds it to {info1['max_fit']}; throughput keeps {info1['throughput']}.",
        "",
        f"### GPT-2 small ({info2['params'] / 1e6:.0f}M), sequence {info2['seq']}, AdamW: largest micro-batch "
        f"within {format_bytes(info2['budget_bytes'])}, from the estimate alone, for a CUDA target "
        "(H100/H200 class; what the caching allocator reserves must fit)",
        "",
        "| Run | Largest micro-batch | Peak at it | Peak at +1 (if it fits) | Rounded (bf16 tensor cores: 8; else power of 2) | Estimates | Search s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows2:
        nxt = format_bytes(r["next_bytes"]) if r["next_bytes"] else "-"
        lines.append(
            f"| {r['run']} | {r['largest_micro_batch']} | {format_bytes(r['peak_bytes'])} | {nxt} | "
            f"{r['rounded_cuda']} | {r['estimates']} | {r['search_s']:.0f} |"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cmd = "python -m benchmarks.batch_size" + (" --quick" if args.quick else "")
    env = {
        **environment(("torch", "lightning", "transformers")),
        "torch threads": str(torch.get_num_threads()),
        "load average": f"{load:.1f}",
    }
    lines += [
        "",
        f"Machine load average when run: {load:.1f} on {os.cpu_count()} cores (wall samples/s shrink with it; "
        "samples per CPU-second are this process's own time). "
        f"Total {wall:.0f} s.",
        "",
        provenance(env, cmd),
    ]
    stem = args.out or ROOT / "benchmarks" / "results" / (
        "batch_size_quick" if args.quick else "batch_size"
    )
    save_results(
        stem,
        "\n".join(lines),
        {
            "tinygpt": {"rows": rows1, **info1},
            "gpt2": {"rows": rows2, **info2},
            "command": cmd,
            "torch": torch.__version__,
            "wall_s": wall,
            "environment": env,
        },
    )


if __name__ == "__main__":
    main()
