"""One rank's memory when the state is divided over ranks: the per-rank estimate for GPT-2 small
(124M, seq 1024, batch 8 per rank, fp32 AdamW, CUDA allocator rounding) under DDP, FSDP
(FULL_SHARD) and ZeRO-3 at 2, 4 and 8 ranks, from one fake-tensor estimate of the step
(``estimate_memory(..., world_size=, sharding=)``). With ``--measure`` also a real 2-process
FullyShardedStrategy run of the tiny model on this CPU (tests/_fsdp_fit.py): its tracked peak per
rank against the per-rank estimate of the same step.

    PYTHONPATH=. python benchmarks/scale_out.py [--measure]

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import environment, fmt_bytes, save_results, table  # noqa: E402

from lightning_efficient.measure.estimate import estimate_memory  # noqa: E402
from lightning_efficient.measure.per_rank import (  # noqa: E402
    parameter_bytes,
    per_rank_estimate,
)

SHARDINGS = {"DDP": "ddp", "FSDP (full shard)": "full", "ZeRO-3": "zero3"}
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
    rows = [{"ranks": 1, "strategy": "one device", **_figures(one, one)}]
    for world in WORLDS:
        for label, sharding in SHARDINGS.items():
            est = per_rank_estimate(
                one, world_size=world, sharding=sharding, param_bytes=params, block_bytes=block
            )
            rows.append({"ranks": world, "strategy": label, **_figures(est, one)})
    info = {"parameters": sum(p.numel() for p in model.parameters()), "block_bytes": block}
    return rows, info


def _figures(est, one) -> dict:
    c = est.by_category
    return {
        "peak_bytes": est.peak_bytes,
        "parameters_bytes": c["parameters"],
        "gradients_bytes": c["gradients"],
        "optimizer_state_bytes": c["optimizer_state"],
        "activations_bytes": c["activations"] + c["temporaries"],
        "vs_one_device": est.peak_bytes / one.peak_bytes,
    }


def measured() -> dict:
    """A real 2-process FullyShardedStrategy fit (tiny model, checkpointing, CPU, gloo): the
    tracked peak of step 1 on each rank, and the per-rank estimate of the same step."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import tiny_model

    from lightning_efficient.techniques.activation_checkpointing import (
        apply_activation_checkpointing,
    )

    options = {
        "callbacks": {
            "ActivationCheckpointing": {},
            "MemoryBreakdown": {"sample_steps": [1], "print_table": False},
        },
        "steps": 2,
    }
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "_fsdp_fit.py"), json.dumps(options), out],
            cwd=out,
            check=True,
            capture_output=True,
            env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"},
        )
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]
    model = tiny_model()
    apply_activation_checkpointing(model, "auto")
    batch = (torch.zeros(4, 32, dtype=torch.long),) * 2
    est = estimate_memory(model, batch, optimizer="adamw", world_size=2, sharding="full")
    tracked = [r["report"]["MemoryBreakdown"]["peak_bytes"] for r in ranks]
    return {
        "workload": "tiny GPT (2 blocks, n_embd 32, seq 32), batch 4 per rank, 2 CPU processes",
        "tracked_peak_bytes_per_rank": tracked,
        "estimated_peak_bytes": est.peak_bytes,
        "gap": est.peak_bytes / max(tracked) - 1,
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
        "divided per rank by `measure/per_rank.py`.",
        "",
        table(
            [
                "ranks",
                "strategy",
                "peak per rank",
                "vs 1 device",
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
                    fmt_bytes(r["parameters_bytes"]),
                    fmt_bytes(r["gradients_bytes"]),
                    fmt_bytes(r["optimizer_state_bytes"]),
                    fmt_bytes(r["activations_bytes"]),
                ]
                for r in rows
            ],
            "rlrrrrrr",
        ),
    ]
    data = {"gpt2_small": rows, "model": info, "environment": environment()}
    if args.measure:
        m = measured()
        data["measured"] = m
        text += [
            "",
            f"## Estimate vs a real run: {m['workload']}",
            "",
            table(
                ["tracked peak rank 0", "tracked peak rank 1", "estimated per rank", "gap"],
                [
                    [
                        *map(fmt_bytes, m["tracked_peak_bytes_per_rank"]),
                        fmt_bytes(m["estimated_peak_bytes"]),
                        f"{m['gap']:+.1%}",
                    ]
                ],
                "rrrr",
            ),
        ]
    env = data["environment"]
    text += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    text += ["", "Command: `PYTHONPATH=. python benchmarks/scale_out.py --measure`"]
    save_results(ROOT / "benchmarks" / "results" / "scale_out", "\n".join(text), data)


if __name__ == "__main__":
    main()
