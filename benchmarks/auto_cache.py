"""AutoEfficient's decision for GPT-2 124M with and without the key/value cache (issue 39).

GPT-2 small from its default config (``GPT2Config()``: ``use_cache=True``, what a user loads) and
with ``use_cache=False``, built on the meta device (no download), sequence 1024, AdamW, a trainer
in bf16-mixed, budget 24 GiB, for the planner's CUDA target, effective batch 512, goal speed: the
decision AutoEfficient makes as a callback (rungs that need another precision or a strategy are
not usable). Every rung is estimated as AutoEfficient trains it: the rungs that add techniques
without the cache, "as configured" with it (and its estimate names the cache). No trial steps (no
GPU here). Estimated on this CPU with fake tensors: nothing of the model is allocated.

Run:  python -m benchmarks.auto_cache      (a few minutes on 2 busy cores)
Writes benchmarks/results/auto_cache.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import environment, provenance, save_results, table
from lightning_efficient.core.validate import format_bytes, parse_bytes
from lightning_efficient.measure.memory.targets import resolve_target
from lightning_efficient.planning import Rung, decide_stack
from lightning_efficient.planning.fit import estimate_measure

ROOT = Path(__file__).resolve().parents[1]

PRECISION = "bf16-mixed"
SEQ = 1024
BUDGET = "24GiB"
EFFECTIVE = 512


def gpt2(use_cache: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config() if use_cache else GPT2Config(use_cache=False)
    assert config.use_cache is use_cache  # the default config keeps the cache on
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def decision_row(use_cache: bool, target: Any) -> dict[str, Any]:
    """AutoEfficient's decision for GPT-2 with ``use_cache``, timed (the estimates included)."""
    model = gpt2(use_cache)
    start = time.perf_counter()
    settings = {"optimizer": "adamw", "loss_fn": lm_loss, "device": target}
    batch_of = lambda n: torch.zeros(n, SEQ, dtype=torch.long)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = decide_stack(  # as the callback: rungs that need another precision unusable
            model, batch_of, BUDGET, EFFECTIVE, precision=PRECISION, trainer_fixed=True, **settings
        )
        seconds = time.perf_counter() - start
        # the "as configured" rung at the chosen micro-batch: the cache is on there, and named
        measure = estimate_measure(
            model, batch_of, parse_bytes("budget", BUDGET), EFFECTIVE,
            {**settings, "precision": PRECISION},
        )  # fmt: skip
        plain = measure(Rung("as configured", PRECISION), d.micro)[2]
    configured = [why for name, why in d.tried if name == "as configured"]
    return {
        "use_cache": use_cache,
        "stack": d.rung.name,
        "micro_batch": d.micro,
        "accumulation": d.accumulation,
        "estimated_bytes": int(d.estimate_bytes) if d.estimate_bytes is not None else None,
        "as_configured": configured[-1] if configured else "",
        "as_configured_bytes_at_micro": int(plain.required_bytes) if plain is not None else None,
        "as_configured_names_cache": any("key/value cache built" in n for n in plain.notes)
        if plain is not None
        else False,
        "estimates": d.estimates,
        "seconds": round(seconds, 1),
        "tried": d.tried,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "auto_cache"))
    args = ap.parse_args(argv)
    target = resolve_target("cuda")
    rows = [decision_row(use_cache, target) for use_cache in (True, False)]
    for r in rows:
        print(r["use_cache"], r["stack"], r["micro_batch"], r["seconds"], flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    env = {
        **environment(("torch", "transformers")),
        "threads": torch.get_num_threads(),
        "load average": f"{load:.1f}",
    }
    title = (
        f"AutoEfficient for GPT-2 124M, sequence {SEQ}, AdamW, trainer {PRECISION}, budget "
        f"{BUDGET}, effective batch {EFFECTIVE}, goal speed, for {target.label}; with and "
        "without the key/value cache"
    )
    lines = [
        f"### {title}",
        "",
        table(
            ["use_cache", "Stack chosen", "Micro-batch x accumulation", "Estimated (reserved)"]
            + ["'as configured' at that micro-batch", "Cache named", "Estimates", "Decision s"],
            [
                (
                    r["use_cache"],
                    r["stack"],
                    f"{r['micro_batch']} x {r['accumulation']}",
                    format_bytes(r["estimated_bytes"]) if r["estimated_bytes"] else "-",
                    format_bytes(r["as_configured_bytes_at_micro"])
                    if r["as_configured_bytes_at_micro"]
                    else "-",
                    "yes" if r["as_configured_names_cache"] else "no",
                    r["estimates"],
                    r["seconds"],
                )
                for r in rows
            ],
            align="lllrrlrr",
        ),
        "",
        "Every rung that adds a technique is estimated (and trained by AutoEfficient) without the "
        "cache; 'as configured' keeps it, and its estimate names it. Estimates on a CPU for a "
        "CUDA target, not measured on a GPU; no trial steps.",
        "",
        provenance(env, "python -m benchmarks.auto_cache"),
    ]
    save_results(args.out, "\n".join(lines), {"title": title, "rows": rows, "env": env})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
