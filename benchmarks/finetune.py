"""Fine-tuning estimates for a CUDA target: QLoRA on a Llama-3-8B shape, and the key/value cache.

1. A Llama-3-8B shape (32 layers, hidden 4096, intermediate 14336, GQA 32/8 heads, vocabulary
   128,256; bf16 weights) with PEFT LoRA r=16 on every linear layer of the blocks, sequence
   2048, micro-batch 1, bf16-mixed, AdamW on the adapters: the estimated peak for a CUDA target
   without any technique, and with FrozenWeights4bit + ActivationCheckpointing +
   ChunkedCrossEntropy (each estimate takes minutes here). The model is built on the ``meta`` device and estimated on
   fake tensors: nothing of its 16 GB is allocated.
2. GPT-2 124M from its default config (``use_cache=True``) and with ``use_cache=False``, seq
   1024, micro-batch 30, bf16-mixed + adamw8bit + checkpointing + chunked loss (the stack of
   issue 39): the techniques switch the cache off for training, so both estimate the same peak.

Run:  python -m benchmarks.finetune     (about 15 minutes on 2 busy cores)
Writes benchmarks/results/finetune.{md,json}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import TARGET, build_model, hf_loss, llama3_8b_lora, meta_batch
from lightning_efficient import (
    ActivationCheckpointing,
    ChunkedCrossEntropy,
    FrozenWeights4bit,
    OptimizerSwap,
)
from lightning_efficient.measure.memory.estimate import estimate_memory

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
SEQ = 2048
STACKS: list[tuple[str, list[str]]] = [
    ("LoRA (no technique)", []),
    ("LoRA + 4-bit frozen weights + checkpointing + chunked loss", ["4bit", "ac", "cce"]),
]
BUILD = {"4bit": FrozenWeights4bit, "ac": ActivationCheckpointing, "cce": ChunkedCrossEntropy}


def llama_rows() -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, data = [], []
    for label, names in STACKS:
        model = llama3_8b_lora()
        t0 = time.perf_counter()
        est = estimate_memory(
            model,
            meta_batch(1, SEQ)[:1],
            loss_fn=hf_loss,
            optimizer="adamw",
            precision="bf16-mixed",
            callbacks=[BUILD[n]() for n in names],
            device=TARGET,
        )
        seconds = time.perf_counter() - t0
        cat = est.by_category
        data.append(
            {
                "stack": label,
                "peak_bytes": est.peak_bytes,
                "reserved_bytes": est.reserved_bytes,
                "by_category": dict(cat),
                "notes": est.notes,
                "seconds": round(seconds, 1),
            }
        )
        rows.append(
            [
                label,
                f"{est.peak_bytes / GIB:.2f}",
                f"{cat.get('parameters', 0) / GIB:.2f}",
                f"{(cat.get('gradients', 0) + cat.get('optimizer_state', 0)) / GIB:.2f}",
                f"{(cat.get('activations', 0) + cat.get('temporaries', 0)) / GIB:.2f}",
                est.peak_phase,
            ]
        )
        print(rows[-1], flush=True)
    return rows, data


def gpt2_rows() -> tuple[list[list[str]], list[dict[str, Any]]]:
    dims = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024}
    rows, data = [], []
    for use_cache in (True, False):
        model = build_model("hf_gpt2", dims, "meta")
        model.model.config.use_cache = use_cache
        for stack in ("stack",):
            callbacks = (
                [ActivationCheckpointing(), ChunkedCrossEntropy(), OptimizerSwap("adamw8bit")]
                if stack == "stack"
                else []
            )
            est = estimate_memory(
                model,
                meta_batch(30, 1024),
                precision="bf16-mixed",
                callbacks=callbacks,
                device=TARGET,
            )
            cache = any("key/value cache built" in n for n in est.notes)
            label = (
                "bf16-mixed + adamw8bit + checkpointing + chunked loss"
                if callbacks
                else ("bf16-mixed")
            )
            data.append(
                {
                    "use_cache": use_cache,
                    "stack": label,
                    "peak_bytes": est.peak_bytes,
                    "cache_named": cache,
                }
            )
            rows.append(
                [
                    str(use_cache),
                    label,
                    f"{est.peak_bytes / GIB:.2f}",
                    "yes" if cache else "no",
                ]
            )
            print(rows[-1], flush=True)
    return rows, data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "finetune"))
    args = ap.parse_args(argv)
    llama, llama_data = llama_rows()
    gpt2, gpt2_data = gpt2_rows()
    text = "\n".join(
        [
            "# Fine-tuning estimates (CUDA target, computed on a CPU with fake tensors)",
            "",
            "Llama-3-8B shape (32 layers, hidden 4096, intermediate 14336, GQA 32/8, vocabulary "
            "128,256, bf16 weights, default config), PEFT LoRA r=16 on every linear layer of the "
            f"blocks, seq {SEQ}, micro-batch 1, bf16-mixed, AdamW on the adapters; target "
            f"{TARGET.label}. Estimates, not measured on a GPU.",
            "",
            table(
                [
                    "Stack",
                    "Peak GiB",
                    "Weights GiB",
                    "Grads + Adam GiB",
                    "Activations GiB",
                    "Peak in",
                ],
                llama,
            ),
            "",
            "GPT-2 124M, seq 1024, micro-batch 30: from its default config (`use_cache=True`) "
            "and with the cache off. The estimate names a cache built while training; the "
            "techniques switch it off, so the stack's peak is the same either way.",
            "",
            table(["use_cache", "Stack", "Peak GiB", "Cache named"], gpt2),
            "",
            provenance(environment(), "python -m benchmarks.finetune"),
        ]
    )
    save_results(
        args.out,
        text,
        {
            "llama3_8b_lora": llama_data,
            "gpt2_use_cache": gpt2_data,
            "target": TARGET.label,
            "environment": environment(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
