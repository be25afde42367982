"""How long the memory estimate takes, and what it says, for GPT-2 small; plus its accuracy.

Estimates GPT-2 small (124M parameters, transformers GPT2Config built on the meta device, no
download) at sequence 1024, batch 8, AdamW: fp32, bf16-mixed, and with every transformer block
under the package's ActivationCheckpointing (non-reentrant torch.utils.checkpoint). Each row: the peak (GiB), the phase of the peak, the
bytes per category at the peak and the seconds the estimate took (fake tensors, this CPU).
A last row checks accuracy on a GPT-2-shaped model small enough to train for real on the CPU:
the estimate against the same steps tracked on real tensors (their ratio).

Run:  python -m benchmarks.estimate_speed          (default, ~1 minute on 2 cores)
      python -m benchmarks.estimate_speed --quick  (sequence 256, batch 2)
Writes benchmarks/results/estimate_speed{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch

from benchmarks._results import environment, save_results
from lightning_efficient.measure import estimate_memory, measure_step
from lightning_efficient.measure.memory.estimate import CATEGORIES
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence 256, batch 2")
    parser.add_argument(
        "--out",
        default=None,
        help="result stem (default benchmarks/results/estimate_speed{,_quick})",
    )
    args = parser.parse_args()
    seq, batch = (256, 2) if args.quick else (1024, 8)
    torch.set_num_threads(2)

    with torch.device("meta"):
        model = gpt2(n_positions=1024)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    rows = []
    for name, kwargs in [
        ("fp32 AdamW", {}),
        ("bf16-mixed AdamW", {"precision": "bf16-mixed"}),
        ("fp32 AdamW + block checkpointing", {"callbacks": [ActivationCheckpointing()]}),
    ]:
        start, cpu_start = time.perf_counter(), time.process_time()
        est = estimate_memory(model, ids, loss_fn=lm_loss, **kwargs)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        rows.append(
            {
                "run": name,
                "peak_gib": est.peak_bytes / GIB,
                "phase": est.peak_phase,
                **{f"{c}_gib": est.by_category[c] / GIB for c in CATEGORIES},
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "notes": est.notes,
            }
        )
        print(f"{name}: {est}  ({seconds:.1f} s wall, {cpu_seconds:.1f} s CPU)", flush=True)

    # accuracy on a model small enough to run for real on this CPU
    torch.manual_seed(0)
    small = gpt2(
        n_positions=128,
        n_embd=128,
        n_layer=2,
        n_head=2,
        vocab_size=2048,
        bos_token_id=0,
        eos_token_id=0,
    )
    small_ids = torch.randint(0, 2048, (4, 128))
    accuracy = []
    for name, cbs in [
        ("small GPT-2, fp32 AdamW", []),
        ("small GPT-2, + block checkpointing", [ActivationCheckpointing()]),
    ]:
        est = estimate_memory(small, small_ids, loss_fn=lm_loss, callbacks=cbs)
        real = measure_step(copy.deepcopy(small), small_ids, loss_fn=lm_loss, callbacks=cbs)
        accuracy.append(
            {
                "run": name,
                "estimate_bytes": est.peak_bytes,
                "real_bytes": real.peak_bytes,
                "ratio": est.peak_bytes / real.peak_bytes,
            }
        )

    env = {
        **environment(("torch", "transformers")),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_avg": os.getloadavg()[0],
    }
    title = (
        f"GPT-2 small ({n_params / 1e6:.0f}M parameters), sequence {seq}, batch {batch}, 2 steps"
    )
    md = [
        f"### Memory estimate: {title}",
        "",
        "| Run | Peak (GiB) | Phase | Params | Grads | Optimizer | Activations | Temporaries | Wall s | CPU s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cats = " | ".join(f"{r[f'{c}_gib']:.2f}" for c in CATEGORIES)
        md.append(
            f"| {r['run']} | {r['peak_gib']:.2f} | {r['phase']} | {cats} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} |"
        )
    md += [
        "",
        "### Accuracy: estimate vs the same steps on real CPU tensors",
        "",
        "| Model | Estimate (bytes) | Real (bytes) | Ratio |",
        "|---|---:|---:|---:|",
    ]
    for a in accuracy:
        md.append(
            f"| {a['run']} | {a['estimate_bytes']:,} | {a['real_bytes']:,} | {a['ratio']:.4f} |"
        )
    md += [
        "",
        f"Machine load average when run: {env['load_avg']:.1f} (wall seconds grow with it; CPU "
        "seconds are the process's own time over all its threads).",
        "",
    ]
    md += [
        f"Hardware/versions: {env['host']}, {env['threads']} torch threads, Python {env['python']}, "
        f"torch {env['torch']}, transformers {env['transformers']}. Command: "
        f"`python -m benchmarks.estimate_speed{' --quick' if args.quick else ''}`."
    ]
    print()
    stem = args.out or ROOT / "benchmarks" / "results" / (
        "estimate_speed_quick" if args.quick else "estimate_speed"
    )
    save_results(
        stem, "\n".join(md), {"title": title, "rows": rows, "accuracy": accuracy, "env": env}
    )


if __name__ == "__main__":
    main()
