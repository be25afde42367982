"""Part 2 of ``benchmarks/gpu/suite.py``: the estimate against reality.

HF GPT-2 124M and TinyGPT at GPT-2 small shape, for fp32, bf16-mixed, + checkpointing,
+ adamw8bit: ``estimate_memory``'s peak (fake tensors) against the real peak of the same two
Lightning steps (CUDA: ``max_memory_allocated``; CPU: the storage tracker). Run by the suite as
``python -m benchmarks.gpu.estimate --ctx FILE``.
"""

from __future__ import annotations

import sys
import time

from benchmarks.gpu.common import (
    AC,
    SWAP8,
    Ctx,
    Recorder,
    child_main,
    estimate,
    first_line,
    gpt2_dims,
    missing_package,
    time_skip,
)
from benchmarks.gpu.run import run_real, run_status

__all__ = ["MODELS", "STACKS", "part_estimate"]

STACKS = [
    ("fp32", "32-true", []),
    ("bf16-mixed", "bf16-mixed", []),
    ("bf16-mixed + checkpointing", "bf16-mixed", [AC]),
    ("bf16-mixed + checkpointing + adamw8bit", "bf16-mixed", [AC, SWAP8]),
]
MODELS = [("hf_gpt2", "HF GPT-2"), ("tinygpt", "TinyGPT")]


def part_estimate(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    batch = p["estimate_batch"]
    rec.note(
        "Each row: the instrument's estimate of 2 training steps (fake tensors) and the real "
        "peak of the same 2 steps under Lightning's Trainer ("
        + ("torch.cuda.max_memory_allocated" if ctx.cuda else "storage tracker on CPU tensors")
        + "). Ratio = estimate / measured; the goal is within 10%."
    )
    # the dry run: the stacks its profile names (the last holds every technique of the others)
    stacks = [s for s in STACKS if s[0] in p.get("estimate_stacks", [s[0] for s in STACKS])]
    if len(stacks) < len(STACKS):
        rec.note(f"Dry run: the stacks {', '.join(s[0] for s in stacks)} only.")
    per_row = None
    for kind, label in MODELS:
        dims = gpt2_dims(ctx)
        for name, precision, techniques in stacks:
            row = {"model": label, "stack": name, "batch": batch, "seq": dims["seq"]}
            need = per_row * 1.2 if per_row else 5.0
            if ctx.left() < need:
                basis = f"the last row took {per_row:.0f} s" if per_row else "a first guess"
                rec.row(**row, **time_skip(ctx.left(), need, basis))
                continue
            t0 = time.perf_counter()
            try:
                exact = estimate(kind, dims, batch, precision, techniques, rounding=False)
                rounded = estimate(kind, dims, batch, precision, techniques, rounding=True)
            except ImportError as err:
                rec.row(**row, status=f"skipped: {missing_package(err) or first_line(err)}")
                continue
            spec = {
                "model": kind,
                "dims": dims,
                "batch": batch,
                "steps": 2,
                "precision": precision,
                "callbacks": techniques,
                "device": ctx.device,
            }
            res = run_real(spec, ctx, isolate=False, timeout=ctx.left())
            measured = res.get("peak_bytes")
            row.update(
                estimate_bytes=exact.peak_bytes,
                estimate_rounded_bytes=rounded.peak_bytes,
                estimate_reserved_bytes=rounded.reserved_bytes or None,
                estimate_target=getattr(rounded, "target", None),
                estimate_phase=rounded.peak_phase,
                measured_bytes=measured,
                reserved_bytes=res.get("reserved_bytes"),
                status=run_status(res),
            )
            if res.get("ok") and measured:
                row["ratio"] = exact.peak_bytes / measured
                row["ratio_rounded"] = rounded.peak_bytes / measured
                row["within_10pct"] = abs(row["ratio"] - 1) <= 0.10
                row["within_10pct_rounded"] = abs(row["ratio_rounded"] - 1) <= 0.10
            row["seconds"] = time.perf_counter() - t0
            per_row = row["seconds"]
            rec.row(**row)
    measured = [r for r in rec.data["rows"] if "ratio" in r]
    if not measured:
        rec.finish("no stack measured")
        return
    hits = sum(r["within_10pct"] for r in measured)
    hits_r = sum(r["within_10pct_rounded"] for r in measured)
    lo, hi = min(r["ratio"] for r in measured), max(r["ratio"] for r in measured)
    rec.figure(within_10pct=hits, within_10pct_rounded=hits_r, measured=len(measured))
    rec.finish(
        f"estimate within 10% in {hits} of {len(measured)} stacks (estimate/measured "
        f"{lo:.2f}-{hi:.2f}; with CUDA rounding {hits_r} of {len(measured)})"
    )


if __name__ == "__main__":
    sys.exit(child_main(part_estimate))
