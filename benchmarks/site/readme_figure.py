"""The README's picture: GPT-2 small in 24 GiB, plain vs the planner's stack, by category.

GPT-2 small (124M parameters, ``transformers`` ``GPT2Config()`` on the meta device, no download),
sequence 1024, AdamW, estimated by ``estimate_memory`` for the planner's CUDA target (H100/H200
class: CUDA's kernels, workspaces and the caching allocator modelled), on this CPU. Nothing here
ran on a GPU. Two stacks:

- plain: fp32, AdamW, no technique (what a LightningModule does as written);
- the planner's stack: the techniques ``fit --auto`` picks for this model in 24 GiB at effective
  batch 64 (``benchmarks/results/auto.json``, goal speed): bf16-mixed + ChunkedCrossEntropy +
  8-bit AdamW + ActivationCheckpointing, here of every block (at its largest micro-batch the
  budget mode checkpoints them all; at micro-batch 8 it would checkpoint fewer).

For each: the largest micro-batch whose estimate fits 24 GiB (``largest_fitting_batch``), and the
peak by category at micro-batch 8 and at that largest micro-batch.

Run:  python -m benchmarks.site.readme_figure     (a few minutes on 2 cores)
Writes benchmarks/results/readme_figure.{md,json}; ``python -m benchmarks.site.make_index`` draws
docs/img/readme_gpt2_24gib.svg from the JSON.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import gpt2, hf_loss
from lightning_efficient.core.validate import (
    SettingsError,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.techniques.activation_checkpointing import (
    ActivationCheckpointing,
)
from lightning_efficient.techniques.batch_size.sizing import largest_fitting_batch
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy
from lightning_efficient.techniques.optimizers import OptimizerSwap

ROOT = Path(__file__).resolve().parents[2]

SEQ, BUDGET, AT, TOP = 1024, "24GiB", 8, 256


def stacks(budget: int) -> dict[str, tuple[str, Any]]:
    """Name -> (precision, a factory of the callbacks)."""
    return {
        "plain (fp32, AdamW)": ("32-true", lambda: []),
        "planner's stack": (  # bf16-mixed + chunked loss + 8-bit AdamW + checkpointing
            "bf16-mixed",
            lambda: [
                ChunkedCrossEntropy(),
                OptimizerSwap("adamw8bit"),
                ActivationCheckpointing(),
            ],
        ),
    }


def main() -> None:
    budget = parse_bytes("budget", BUDGET)
    model = gpt2()
    rows = []
    for name, (precision, callbacks) in stacks(budget).items():

        def estimate(n: int, precision: str = precision, callbacks: Any = callbacks) -> Any:
            ids = torch.zeros(n, SEQ, dtype=torch.long)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return estimate_memory(
                    model,
                    ids,
                    loss_fn=hf_loss,
                    precision=precision,
                    callbacks=callbacks(),
                    optimizer="adamw",
                    device="cuda",
                )

        t0 = time.perf_counter()

        def peak(n: int, estimate: Any = estimate) -> float:
            try:
                est = estimate(n)
            except SettingsError:  # a technique that cannot reach the budget at this size
                return math.inf
            return est.peak_bytes if est.fits(budget) else math.inf

        largest, _ = largest_fitting_batch(peak, budget, TOP)
        at = {}
        for n in (AT, largest):
            est = estimate(n)
            at[str(n)] = {
                "peak_bytes": int(est.peak_bytes),
                "reserved_bytes": int(est.reserved_bytes),
                "by_category": {k: int(v) for k, v in est.by_category.items()},
            }
        rows.append(
            {
                "stack": name,
                "precision": precision,
                "largest_micro_batch": largest,
                "at": at,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(f"{name}: largest micro-batch {largest}", flush=True)
    env = {**environment(("torch", "lightning", "transformers", "bitsandbytes"))}
    target = "CUDA sm90 (H100/H200 class), estimated on a CPU, not measured on a GPU"
    title = f"GPT-2 small (124M), sequence {SEQ}, AdamW, budget {BUDGET}, {target}"
    lines = [
        f"### {title}",
        "",
        table(
            ["Stack", "Largest micro-batch", f"Peak at micro-batch {AT}", "Peak at the largest"],
            [
                (
                    r["stack"],
                    r["largest_micro_batch"],
                    format_bytes(r["at"][str(AT)]["peak_bytes"]),
                    format_bytes(r["at"][str(r["largest_micro_batch"])]["peak_bytes"]),
                )
                for r in rows
            ],
            align="lrrr",
        ),
        "",
        provenance(env, "python -m benchmarks.site.readme_figure"),
    ]
    data = {
        "title": title,
        "model": "GPT-2 small (124M)",
        "seq": SEQ,
        "budget_bytes": budget,
        "at_batch": AT,
        "target": target,
        "measured": False,
        "rows": rows,
        "environment": env,
    }
    save_results(ROOT / "benchmarks" / "results" / "readme_figure", "\n".join(lines), data)


if __name__ == "__main__":
    main()
