"""How long AutoEfficient's decision takes, and what it picks, for GPT-2 small under 24 GiB.

GPT-2 small (124M parameters, transformers ``GPT2Config()`` built on the meta device, no
download), sequence 1024, AdamW, fp32 as configured, for the planner's CUDA target (H100/H200
class: CUDA's kernels, workspaces and the caching allocator's reserve modelled), measured on this
CPU. The decision is the one ``lightning-efficient fit --auto`` makes (every rung of the ladder
usable, the bf16-mixed ones included): for each rung the largest exact divisor of the effective
batch whose estimate fits, ranked by the goal. No trial steps (no GPU here): on a GPU the pick is
then confirmed by two real steps under the budget, which this table does not time.

Run:  python -m benchmarks.auto           (effective batches 64 and 512, both goals)
      python -m benchmarks.auto --quick   (sequence 256, budget 3 GiB, effective batch 16)
Writes benchmarks/results/auto{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import gpt2, hf_loss
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.measure.memory.targets import resolve_target
from lightning_efficient.planning import decide_stack

ROOT = Path(__file__).resolve().parents[1]


def decision_row(model, seq: int, budget: str, effective: int, goal: str, target) -> dict:
    """One decision, timed from the ladder to the pick (the estimates included)."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = decide_stack(  # as fit --auto: every rung usable, the bf16-mixed ones included
            model,
            lambda n: torch.zeros(n, seq, dtype=torch.long),
            budget,
            effective,
            goal=goal,
            precision="32-true",
            bf16=True,
            optimizer="adamw",
            loss_fn=hf_loss,
            device=target,
        )
    seconds = time.perf_counter() - start
    return {
        "budget": budget,
        "effective_batch": effective,
        "goal": goal,
        "stack": d.rung.name,
        "micro_batch": d.micro,
        "accumulation": d.accumulation,
        "estimated_bytes": int(d.estimate_bytes) if d.estimate_bytes is not None else None,
        "estimates": d.estimates,
        "seconds": round(seconds, 1),
        "tried": d.tried,
        "yaml": d.to_yaml("data"),
        "target": target.label,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="result stem (default benchmarks/results/auto)")
    args = parser.parse_args()
    seq, budget = (256, "3GiB") if args.quick else (1024, "24GiB")
    batches = (16,) if args.quick else (64, 512)
    target = resolve_target("cuda")
    model = gpt2()
    rows = [
        decision_row(model, seq, budget, effective, goal, target)
        for effective in batches
        for goal in ("speed", "memory")
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    env = {
        **environment(("torch", "transformers")),
        "threads": torch.get_num_threads(),
        "load average": f"{load:.1f}",
    }
    title = (
        f"AutoEfficient's decision for GPT-2 small (124M), sequence {seq}, AdamW, fp32 as "
        f"configured, budget {budget}, for {target.label}; timed on this CPU"
    )
    lines = [
        f"### {title}",
        "",
        table(
            ["Effective batch", "Goal", "Stack chosen", "Micro-batch x accumulation"]
            + ["Estimated peak (reserved)", "Estimates", "Decision s"],
            [
                (
                    r["effective_batch"],
                    r["goal"],
                    r["stack"],
                    f"{r['micro_batch']} x {r['accumulation']}",
                    format_bytes(r["estimated_bytes"]) if r["estimated_bytes"] else "-",
                    r["estimates"],
                    r["seconds"],
                )
                for r in rows
            ],
            align="rlllrrr",
        ),
        "",
        "No trial steps here (no GPU): on a GPU two real steps under the budget confirm the pick.",
        "",
        provenance(env, f"python -m benchmarks.auto{' --quick' if args.quick else ''}"),
    ]
    stem = args.out or ROOT / "benchmarks" / "results" / ("auto_quick" if args.quick else "auto")
    save_results(stem, "\n".join(lines), {"title": title, "rows": rows, "env": env})


if __name__ == "__main__":
    main()
