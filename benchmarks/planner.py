"""What the planner picks for GPT-2 small under shrinking memory budgets.

GPT-2 small (124M parameters, transformers GPT2Config built on the meta device, no download),
sequence 1024, batch 8, AdamW, fp32 as configured. For each budget the planner walks its ladder
(cheapest stack first) on fake tensors and stops at the first stack whose estimated peak, with
for the planner's default target (CUDA: this machine's GPU, else the H100/H200 class) fits: its
allocations, replayed through the CUDA caching allocator under the budget, do not run out of
memory. Each row: the budget, the stack chosen, its device peak, what the allocator reserves and
the host memory, how many stacks were estimated and the seconds the plan took on this CPU.

With ``--ranks 2,8`` the plans are for several ranks: the batch is one rank's, every peak is
one rank's, and the ladder shards the state across the ranks (FSDP) before it offloads; the
results add the whole ladder at 8 ranks (every rung estimated) for the last budget.

Run:  python -m benchmarks.planner          (GPT-2 small, seq 1024, batch 8)
      python -m benchmarks.planner --quick  (sequence 256, batch 2)
      python -m benchmarks.planner --ranks 2,8
Writes benchmarks/results/planner{,_quick,_ranks}.{md,json}.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import gpt2, hf_loss
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.planning import plan_stack

ROOT = Path(__file__).resolve().parents[1]


def _bytes_cells(row: dict) -> tuple[str, str, str]:
    """A row's device peak, reserved and host bytes as table cells ("-" where none)."""
    keys = ("peak_bytes", "reserved_bytes", "host_bytes")
    return tuple(format_bytes(row[k]) if row.get(k) else "-" for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out", default=None, help="result stem (default benchmarks/results/planner{,_quick})"
    )
    parser.add_argument(
        "--ranks", default=None, help="comma-separated world sizes to plan for (e.g. 2,8)"
    )
    args = parser.parse_args()
    if args.ranks:
        ranks_main(args)
        return
    seq, batch = (256, 2) if args.quick else (1024, 8)
    budgets = ["80GiB", "24GiB", "16GiB", "8GiB"] if not args.quick else ["8GiB", "3GiB", "2GiB"]
    model = gpt2()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    rows = []
    for budget in budgets:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = plan_stack(model, ids, budget, optimizer="adamw", loss_fn=hf_loss)
        seconds = time.perf_counter() - start
        chosen = result.chosen
        est = next((e for r, e, _ in result.tried if r is chosen), None)
        rows.append(
            {
                "budget": budget,
                "stack": chosen.name if chosen else "nothing fits",
                "peak_bytes": est.peak_bytes if est else None,
                "reserved_bytes": est.reserved_bytes if est else None,
                "host_bytes": est.host_bytes if est else None,
                "estimated": len(result.tried),
                "seconds": round(seconds, 1),
                "tried": [(r.name, e.peak_bytes if e else None, p) for r, e, p in result.tried],
                "target": result.target,
            }
        )
    title = (
        f"Planner on GPT-2 small (124M), sequence {seq}, batch {batch}, AdamW, fp32 as configured, "
        f"for {rows[0]['target']}"
    )
    env = {**environment(("torch", "transformers")), "threads": torch.get_num_threads()}
    lines = [
        f"### {title}",
        "",
        table(
            ["Budget", "Stack chosen", "Device peak", "Reserved", "Host", "Stacks estimated"]
            + ["Seconds"],
            [
                (r["budget"], r["stack"], *_bytes_cells(r), r["estimated"], r["seconds"])
                for r in rows
            ],
            align="llrrrrr",
        ),
        "",
        provenance(env, f"python -m benchmarks.planner{' --quick' if args.quick else ''}"),
    ]
    stem = args.out or ROOT / "benchmarks" / "results" / (
        "planner_quick" if args.quick else "planner"
    )
    save_results(stem, "\n".join(lines), {"title": title, "rows": rows, "env": env})


def ranks_main(args: argparse.Namespace) -> None:
    """Plans for several ranks (GPT-2 small, seq 1024, batch 8 per rank)."""
    worlds = [int(w) for w in args.ranks.split(",")]
    seq, batch = (256, 2) if args.quick else (1024, 8)
    budgets = ["3GiB", "2GiB"] if args.quick else ["24GiB", "16GiB", "8GiB"]
    model = gpt2()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    rows, full_table = [], ""
    for world in worlds:
        for budget in budgets:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = plan_stack(
                    model, ids, budget, optimizer="adamw", loss_fn=hf_loss, world_size=world
                )
            seconds = time.perf_counter() - start
            chosen = result.chosen
            est = result.estimate_of(chosen) if chosen else None
            rows.append(
                {
                    "ranks": world,
                    "budget": budget,
                    "stack": chosen.name if chosen else "nothing fits",
                    "sharding": result.shardings.get(id(chosen)) if chosen else None,
                    "peak_bytes": est.peak_bytes if est else None,
                    "reserved_bytes": est.reserved_bytes if est else None,
                    "host_bytes": est.host_bytes if est else None,
                    "estimated": len(result.tried),
                    "seconds": round(seconds, 1),
                    "tried": [
                        (r.name, result.shardings.get(id(r)), e.peak_bytes if e else None, p)
                        for r, e, p in result.tried
                    ],
                }
            )
    world = max(worlds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = plan_stack(
            model,
            ids,
            budgets[-1],
            optimizer="adamw",
            loss_fn=hf_loss,
            world_size=world,
            try_all=True,
        )
    full_table = every.to_markdown()
    title = (
        f"Planner on GPT-2 small (124M) on several ranks, sequence {seq}, batch {batch} per rank, "
        f"AdamW, fp32 as configured, for {every.target}"
    )
    columns = ["Ranks", "Budget per rank", "Stack chosen", "Sharding", "Device peak per rank"]
    columns += ["Reserved per rank", "Host per rank", "Stacks estimated", "Seconds"]
    lines = [
        f"### {title}",
        "",
        table(
            columns,
            [
                (r["ranks"], r["budget"], r["stack"], r["sharding"] or "-", *_bytes_cells(r))
                + (r["estimated"], r["seconds"])
                for r in rows
            ],
            align="rlllrrrrr",
        ),
    ]
    env = {**environment(("torch", "transformers")), "threads": torch.get_num_threads()}
    command = f"python -m benchmarks.planner --ranks {args.ranks}{' --quick' if args.quick else ''}"
    lines += [
        "",
        f"#### Every rung at {world} ranks, budget {budgets[-1]} per rank",
        "",
        full_table,
        "",
        provenance(env, command),
    ]
    stem = args.out or ROOT / "benchmarks" / "results" / (
        "planner_ranks_quick" if args.quick else "planner_ranks"
    )
    save_results(
        stem,
        "\n".join(lines),
        {"title": title, "rows": rows, "every_rung": full_table, "env": env},
    )


if __name__ == "__main__":
    main()
