"""The estimate for a CUDA target, computed on this CPU, against what a real GPU measured.

The GPU's figures are read from ``benchmarks/recorded/h200_2026-12-04.json`` (written down from
``gpu/suite.py`` parts 2 and 3 run on an NVIDIA H200); the estimates are computed here, each
for the CPU's own kernels (the old estimate) and for the CUDA target of that run (sm90, torch
2.11 rules). Then the caching allocator's replay of two part-3 runs: plain fp32 GPT-2 at
micro-batch 6 (allocated and reserved) and the planner's pick at micro-batch 37 under a 24 GiB
cap (which ran out of memory).

Run:  python -m benchmarks.estimate_cuda     (~1 minute on 2 cores)
Writes benchmarks/results/estimate_cuda.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.gpu.common import AC, SWAP8, build_technique
from benchmarks.workloads import build_model, meta_batch
from lightning_efficient.measure.memory.caching_allocator import replay
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.targets import DeviceTarget

ROOT = Path(__file__).resolve().parents[1]

RECORDED = ROOT / "benchmarks" / "recorded" / "h200_2026-12-04.json"
GPT2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024}
TARGET = DeviceTarget("cuda", (9, 0), (2, 11), name="H200")
STACKS = {
    "fp32": ("32-true", []),
    "bf16-mixed": ("bf16-mixed", []),
    "bf16-mixed + checkpointing": ("bf16-mixed", [AC]),
    "bf16-mixed + checkpointing + adamw8bit": ("bf16-mixed", [AC, SWAP8]),
}
LABELS = {"hf_gpt2": "HF GPT-2 124M", "tinygpt": "TinyGPT 12 x 768"}
GIB = 2**30


def _estimate(kind: str, batch: int, stack: str, device: object) -> object:
    precision, techniques = STACKS[stack]
    return estimate_memory(
        build_model(kind, GPT2, "meta"),
        meta_batch(batch, GPT2["seq"]),
        precision=precision,
        callbacks=[build_technique(t) for t in techniques],
        device=device,
        cuda_rounding=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "estimate_cuda"))
    args = ap.parse_args(argv)
    recorded = json.loads(RECORDED.read_text())
    rows, data_rows = [], []
    for row in recorded["peaks"]["rows"]:
        kind, stack, measured = row["model"], row["stack"], row["measured_bytes"]
        t0 = time.perf_counter()
        cpu = _estimate(kind, 8, stack, "cpu")
        cuda = _estimate(kind, 8, stack, TARGET)
        seconds = time.perf_counter() - t0
        data_rows.append(
            {
                "model": kind,
                "stack": stack,
                "measured_bytes": measured,
                "cpu_estimate_bytes": cpu.peak_bytes,
                "cuda_estimate_bytes": cuda.peak_bytes,
                "cuda_reserved_bytes": cuda.reserved_bytes,
                "cuda_notes": cuda.notes,
                "seconds": seconds,
            }
        )
        rows.append(
            [
                LABELS[kind],
                stack,
                f"{measured / GIB:.2f}",
                f"{cpu.peak_bytes / GIB:.2f}",
                f"{cpu.peak_bytes / measured:.2f}",
                f"{cuda.peak_bytes / GIB:.2f}",
                f"{cuda.peak_bytes / measured:.3f}",
            ]
        )
        print(rows[-1], flush=True)
    alloc = recorded["allocator"]
    plain = _estimate("hf_gpt2", 6, "fp32", TARGET)
    pick = _estimate("hf_gpt2", 37, "bf16-mixed + checkpointing + adamw8bit", TARGET)
    capped = replay(pick.allocations, cap=24 * GIB)
    plain_m, pick_m = (
        alloc["plain_fp32_micro_batch_6"],
        alloc["planner_stack_micro_batch_37_cap_24gib"],
    )
    replay_rows = [
        [
            "plain fp32, micro-batch 6, no cap",
            f"{plain_m['allocated_gib']:.2f} / {plain_m['reserved_gib']:.2f}",
            f"{plain.peak_bytes / GIB:.2f} / {plain.reserved_bytes / GIB:.2f}",
            "ran",
            "runs",
        ],
        [
            "planner's pick (bf16-mixed + adamw8bit + checkpointing), micro-batch 37, cap 24 GiB",
            f"{pick_m['allocated_gib_at_oom']:.2f} / {pick_m['reserved_gib_at_oom']:.2f} "
            "(at the out-of-memory)",
            f"{pick.peak_bytes / GIB:.2f} / {capped.reserved_peak / GIB:.2f} (replayed under the cap)",
            "out of memory",
            "out of memory" if capped.out_of_memory else "runs",
        ],
    ]
    env = environment()
    text = "\n".join(
        [
            f"# The estimate for a CUDA target vs a real {recorded['hardware']}",
            "",
            f"GPU figures: {recorded['about']} Versions there: "
            + ", ".join(f"{k} {v}" for k, v in recorded["versions"].items())
            + ".",
            "",
            f"## Peak allocated: {recorded['peaks']['workload']}",
            "",
            "Estimates computed on this CPU: for the CPU's own kernels (the estimate before it "
            f"had a target) and for the CUDA target `{TARGET.label}`; both with the allocator's "
            "rounding. Ratio = estimate / measured.",
            "",
            table(
                [
                    "Model",
                    "Stack",
                    "Measured (GiB)",
                    "CPU kernels (GiB)",
                    "Ratio",
                    "CUDA target (GiB)",
                    "Ratio",
                ],
                rows,
                "llrrrrr",
            ),
            "",
            f"## The caching allocator replayed: {alloc['workload']}",
            "",
            table(
                [
                    "Run",
                    "Measured allocated / reserved (GiB)",
                    "Estimated allocated / reserved (GiB)",
                    "Real run",
                    "Replay",
                ],
                replay_rows,
            ),
            "",
            provenance(env, "python -m benchmarks.estimate_cuda"),
        ]
    )
    data = {
        "recorded": str(RECORDED.relative_to(ROOT)),
        "target": TARGET.label,
        "rows": data_rows,
        "allocator": {
            "plain_fp32_micro_batch_6": {
                "allocated_bytes": plain.peak_bytes,
                "reserved_bytes": plain.reserved_bytes,
            },
            "planner_pick_micro_batch_37": {
                "allocated_bytes": pick.peak_bytes,
                "reserved_bytes_uncapped": pick.reserved_bytes,
                "reserved_bytes_capped": capped.reserved_peak,
                "out_of_memory_under_24gib": capped.out_of_memory,
            },
        },
        "environment": env,
    }
    save_results(args.out, text, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
