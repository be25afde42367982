"""One rank's memory when the state is divided over ranks: the per-rank estimate for GPT-2 small
(124M, seq 1024, batch 8 per rank, fp32 AdamW, CUDA allocator rounding) under DDP, FSDP
(FULL_SHARD) and ZeRO-3 at 2, 4 and 8 ranks, from one fake-tensor estimate of the step
(``estimate_memory(..., world_size=, sharding=)``). With ``--measure`` also real 2-process
FullyShardedStrategy runs of two tiny GPT sizes, FULL_SHARD and SHARD_GRAD_OP, on this CPU
(tests/multiprocess/fsdp_fit.py): the tracked peak per rank against the per-rank estimate of the
same step.

    PYTHONPATH=. python -m benchmarks.scale_out [--measure]

Prints a table and saves benchmarks/results/scale_out.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks._results import environment, fmt_bytes, save_results, table
from benchmarks.workloads import tiny_model
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.per_rank import (
    parameter_bytes,
    per_rank_estimate,
    root_parameter_bytes,
)

ROOT = Path(__file__).resolve().parents[1]

SHARDINGS = {
    "DDP": "ddp",
    "FSDP (full shard)": "full",
    "FSDP (grad-op shard)": "grad_op",
    "ZeRO-3": "zero3",
}
WORLDS = (2, 4, 8)


def gpt2_rows(seq: int = 1024, batch: int = 8) -> tuple[list[dict], dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_positions=seq, use_cache=False))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    one = estimate_memory(
        model,
        ids,
        optimizer="adamw",
        loss_fn=lambda m, b: m(input_ids=b, labels=b).loss,
        cuda_rounding=True,
    )
    params = parameter_bytes(model)
    block = parameter_bytes(model.transformer.h[0])
    root = root_parameter_bytes(model)  # wte (tied with the head), wpe, ln_f
    rows = [{"ranks": 1, "strategy": "one device", **_figures(one, one)}]
    for world in WORLDS:
        for label, sharding in SHARDINGS.items():
            est = per_rank_estimate(
                one,
                world_size=world,
                sharding=sharding,
                param_bytes=params,
                block_bytes=block,
                root_bytes=root,
            )
            rows.append({"ranks": world, "strategy": label, **_figures(est, one)})
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "block_bytes": block,
        "root_bytes": root,
    }
    return rows, info


def _figures(est, one) -> dict:
    c = est.by_category
    return {
        "peak_bytes": est.peak_bytes,
        "peak_phase": est.peak_phase,
        "parameters_bytes": c["parameters"],
        "gradients_bytes": c["gradients"],
        "optimizer_state_bytes": c["optimizer_state"],
        "activations_bytes": c["activations"] + c["temporaries"],
        "vs_one_device": est.peak_bytes / one.peak_bytes,
    }


#: The real runs the estimate is checked against: tiny GPT sizes (``tiny_model`` overrides)
SIZES = {
    "tiny GPT (2 blocks, n_embd 32)": {},
    "tiny GPT x3.7 (4 blocks, n_embd 48)": {"n_layer": 4, "n_embd": 48},
    "tiny GPT (2 blocks, n_embd 32), no checkpointing": {"checkpointing": False},
}


def measured() -> dict:
    """Real 2-process FullyShardedStrategy fits (CPU, gloo) of two sizes with activation
    checkpointing and the small one without, under FULL_SHARD and SHARD_GRAD_OP: the tracked peak of step 1 on each rank, and the
    per-rank estimate of the same step."""
    from lightning_efficient.techniques.activation_checkpointing import (
        apply_activation_checkpointing,
    )

    rows = []
    for label, setup in SIZES.items():
        size = {k: v for k, v in setup.items() if k != "checkpointing"}
        checkpointing = setup.get("checkpointing", True)
        for sharding in ("full", "grad_op"):
            callbacks = {"MemoryBreakdown": {"sample_steps": [1], "print_table": False}}
            if checkpointing:
                callbacks = {"ActivationCheckpointing": {}, **callbacks}
            options = {
                "callbacks": callbacks,
                "steps": 2,
                "allocator_step": 1,
                "model": size,
                "strategy": {"sharding": sharding},
            }
            with tempfile.TemporaryDirectory() as out:
                subprocess.run(
                    [
                        sys.executable,
                        str(ROOT / "tests" / "multiprocess" / "fsdp_fit.py"),
                        json.dumps(options),
                        out,
                    ],
                    cwd=out,
                    check=True,
                    capture_output=True,
                    env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"},
                )
                ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
            model = tiny_model(**size)
            if checkpointing:
                apply_activation_checkpointing(model, "auto")
            batch = (torch.zeros(4, 32, dtype=torch.long),) * 2
            est = estimate_memory(model, batch, optimizer="adamw", world_size=2, sharding=sharding)
            plain = estimate_memory(model, batch, optimizer="adamw")
            tracked = [r["report"]["MemoryBreakdown"]["peak_bytes"] for r in ranks]
            allocator = max(r["allocator"]["peak_bytes"] for r in ranks)
            rows.append(
                {
                    "model": label,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "sharding": sharding,
                    "tracked_peak_bytes_per_rank": tracked,
                    "estimated_peak_bytes": est.peak_bytes,
                    "estimated_peak_phase": est.peak_phase,
                    "one_device_estimate_bytes": plain.peak_bytes,
                    "gap": est.peak_bytes / max(tracked) - 1,
                    "allocator_peak_bytes": allocator,
                    "allocator_vs_tracked": allocator / max(tracked) - 1,
                }
            )
    return {
        "workload": "activation checkpointing unless said, batch 4 x seq 32 per rank, fp32, "
        "2 CPU processes",
        "runs": rows,
        "allocator_note": "the CPU allocator's peak over the same step (torch.profiler memory "
        "events, measure/memory/allocator.py), an instrument independent of the tracker; it also "
        "sees what kernels and gloo's collectives allocate inside an operation (gloo copies the block "
        "inside all-gather and reduce-scatter). The profiler sees no free of a block allocated "
        "before it started, so the last step's gradients (freed by zero_grad before backward, "
        "where every peak here is) are left out of its starting bytes",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also run the 2-process check")
    args = parser.parse_args()
    rows, info = gpt2_rows()
    text = [
        "# One rank's peak: GPT-2 small (124M), seq 1024, batch 8 per rank, fp32 AdamW",
        "",
        "Estimated on fake tensors (CUDA allocator rounding), no GPU; one estimate of the step, "
        "divided per rank by `measure/memory/per_rank.py`.",
        "",
        table(
            [
                "ranks",
                "strategy",
                "peak per rank",
                "vs 1 device",
                "peak in",
                "parameters",
                "gradients",
                "optimizer state",
                "activations + temporaries",
            ],
            [
                [
                    r["ranks"],
                    r["strategy"],
                    fmt_bytes(r["peak_bytes"]),
                    f"{r['vs_one_device']:.2f}x",
                    r["peak_phase"],
                    fmt_bytes(r["parameters_bytes"]),
                    fmt_bytes(r["gradients_bytes"]),
                    fmt_bytes(r["optimizer_state_bytes"]),
                    fmt_bytes(r["activations_bytes"]),
                ]
                for r in rows
            ],
            "rlrrlrrrr",
        ),
    ]
    data = {"gpt2_small": rows, "model": info, "environment": environment()}
    if args.measure:
        m = measured()
        data["measured"] = m
        text += [
            "",
            f"## Estimate vs a real run: FullyShardedStrategy, {m['workload']}",
            "",
            table(
                [
                    "model",
                    "parameters",
                    "sharding",
                    "tracked peak rank 0",
                    "tracked peak rank 1",
                    "estimated per rank",
                    "gap",
                    "one device (estimate)",
                    "CPU allocator peak (profiler)",
                ],
                [
                    [
                        r["model"],
                        f"{r['parameters']:,}",
                        r["sharding"],
                        *map(fmt_bytes, r["tracked_peak_bytes_per_rank"]),
                        fmt_bytes(r["estimated_peak_bytes"]),
                        f"{r['gap']:+.2%}",
                        fmt_bytes(r["one_device_estimate_bytes"]),
                        f"{fmt_bytes(r['allocator_peak_bytes'])} "
                        f"({r['allocator_vs_tracked']:+.1%} vs tracked)",
                    ]
                    for r in m["runs"]
                ],
                "lrlrrrrrr",
            ),
            "",
            f"Last column: {m['allocator_note']}.",
        ]
    env = data["environment"]
    text += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    text += ["", "Command: `PYTHONPATH=. python -m benchmarks.scale_out --measure`"]
    save_results(ROOT / "benchmarks" / "results" / "scale_out", "\n".join(text), data)


if __name__ == "__main__":
    main()
