"""Long context on one GPU: the longest sequence QLoRA on a Llama-3-8B shape fits, searched by the
estimator for a CUDA target, with today's stack and with the long-context options.

1. The Llama-3-8B shape (``benchmarks/finetune.py``: 32 layers, hidden 4096, MLP 14,336, GQA
   32/8, vocabulary 128,256) on ``meta`` with PEFT LoRA r=16 on every linear layer of the
   blocks, micro-batch 1, bf16-mixed, AdamW on the adapters, FrozenWeights4bit +
   ActivationCheckpointing + ChunkedCrossEntropy; the new stack adds
   ``offload_boundaries=True, tile_sequence=16384`` to ActivationCheckpointing. For 16, 24, 48
   and 80 GiB: the longest sequence (in steps of ``--step`` tokens) whose estimated steps fit,
   the allocator's replay under that cap deciding (``MemoryEstimate.fits``). The search: two
   probes give peak(tokens) as a line, then from each budget's prediction one step up and
   down until the boundary is found (each estimate answers every budget). Estimated for a CUDA
   target on a CPU with fake tensors: nothing of the model is allocated, no GPU is used.
2. The anchors' published figures beside them (theirs, not measured here).
3. The step's extra time on this CPU: a tiny Llama (4 layers, hidden 64, sequence 1024) trained
   with checkpointing alone and with each option, side by side in one process, interleaved (CPU
   seconds of the process on one thread: the 2 cores are shared).

Run:  python -m benchmarks.long_context     (about 15-30 minutes on 2 busy cores)
      python -m benchmarks.long_context --quick   (the time part only, a minute)
  or the two searches side by side, then the rest:
      python -m benchmarks.long_context --stack today --partial a.json &
      python -m benchmarks.long_context --stack "long context" --partial b.json
      python -m benchmarks.long_context --from-partials a.json b.json
Writes benchmarks/results/long_context.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import environment, provenance, save_json, save_results, table
from benchmarks.workloads import TARGET, hf_loss, llama3_8b_lora, meta_batch
from lightning_efficient import (
    ActivationCheckpointing,
    ChunkedCrossEntropy,
    FrozenWeights4bit,
)
from lightning_efficient.measure.memory.estimate import estimate_memory

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
BUDGETS_GIB = (16, 24, 48, 80)
GOAL = {"budget_gib": 24, "tokens": 100_000}
#: Tokens per tile in the search: ``True`` would tile at the hidden width (4,096 tokens) and keep
#: a little less, but at 400k tokens that is 100 tiles per layer and call, and each estimate runs
#: every tile on fake tensors: 16,384 keeps the search within minutes on 2 CPU cores.
TILE = 16_384
#: The blocks by class name: "auto" would rank candidate groups with extra estimates each time.
BLOCKS = "LlamaDecoderLayer"
STACKS: dict[str, dict[str, Any]] = {
    "today": {},
    "long context": {"offload_boundaries": True, "tile_sequence": TILE},
}
#: The two lengths whose estimates draw each stack's line (peak against tokens).
PROBES = {"today": (16_384, 32_768), "long context": (65_536, 131_072)}
#: Published figures (theirs, not measured here): tokens of one sequence that fit, Llama 8B.
ANCHORS = [
    {
        "who": "Hugging Face + FlashAttention-2",
        "budget_gib": 24,
        "tokens": 5_800,
        "source": "unsloth.ai, Llama 3.3 post (QLoRA r=32, batch 1)",
    },
    {
        "who": "Hugging Face + FlashAttention-2",
        "budget_gib": 80,
        "tokens": 28_000,
        "source": "unsloth.ai, Llama 3.3 post (QLoRA r=32, batch 1)",
    },
    {
        "who": "Unsloth",
        "budget_gib": 24,
        "tokens": 78_000,
        "source": "unsloth.ai, Llama 3.3 post (QLoRA r=32, batch 1)",
    },
    {
        "who": "Unsloth",
        "budget_gib": 80,
        "tokens": 342_000,
        "source": "unsloth.ai, Llama 3.3 post (QLoRA r=32, batch 1)",
    },
    {
        "who": "ALST",
        "budget_gib": 80,
        "tokens": 500_000,
        "source": "arXiv 2506.13996 (Llama-8B, one H100 80 GB; tiled MLP and loss, offload)",
    },
]


def tile_for(tokens: int) -> int:
    """The search's tile: ``TILE`` tokens, or an eighth of a longer sequence (rounded up to
    4,096): at most 8 tiles per call, so an estimate's cost does not grow with the length."""
    return max(TILE, -(-tokens // 8 // 4096) * 4096)


def stack(options: dict[str, Any], tokens: int) -> list[Any]:
    if options.get("tile_sequence") == TILE:
        options = {**options, "tile_sequence": tile_for(tokens)}
    return [
        FrozenWeights4bit(),
        ActivationCheckpointing(BLOCKS, **options),
        ChunkedCrossEntropy(),
    ]


class Search:
    """Estimates of one stack by sequence length, each kept (one estimate answers every
    budget), and the longest length that fits each budget."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step
        self.model = llama3_8b_lora()
        self.estimates: dict[int, Any] = {}
        self.seconds: list[float] = []

    def at(self, tokens: int) -> Any:
        if tokens not in self.estimates:
            t0 = time.perf_counter()
            self.estimates[tokens] = estimate_memory(
                self.model,
                meta_batch(1, tokens)[:1],
                loss_fn=hf_loss,
                optimizer="adamw",
                precision="bf16-mixed",
                callbacks=stack(STACKS[self.name], tokens),
                device=TARGET,
            )
            self.seconds.append(time.perf_counter() - t0)
            est = self.estimates[tokens]
            print(
                f"  {self.name}: {tokens:,} tokens -> peak {est.peak_bytes / GIB:.2f} GiB, "
                f"reserved {est.reserved_bytes / GIB:.2f}, host {est.host_bytes / GIB:.2f} "
                f"({self.seconds[-1]:.0f} s)",
                flush=True,
            )
        return self.estimates[tokens]

    def fits(self, tokens: int, budget: int) -> bool:
        return tokens <= 0 or self.at(tokens).fits(budget)

    def longest(self, budget: int, guess: int) -> int:
        """The longest multiple of ``step`` that fits ``budget``, walking from ``guess``."""
        n = max(self.step, guess // self.step * self.step)
        if self.fits(n, budget):
            while self.fits(n + self.step, budget):
                n += self.step
            return n
        while n > 0 and not self.fits(n, budget):
            n -= self.step
        return n


def search(
    name: str, step: int, probes: tuple[int, int], budgets: tuple[int, ...] = BUDGETS_GIB
) -> list[dict[str, Any]]:
    s = Search(name, step)
    (a, b) = probes
    ea, eb = s.at(a), s.at(b)
    slope = (eb.required_bytes - ea.required_bytes) / (b - a)
    rows = []
    for gib in budgets:
        budget = gib * GIB
        guess = int(a + (budget - ea.required_bytes) / slope)
        tokens = s.longest(budget, guess)
        est = s.estimates.get(tokens)
        rows.append(
            {
                "stack": name,
                "budget_gib": gib,
                "longest_tokens": tokens,
                "peak_bytes": est.peak_bytes if est else 0,
                "reserved_bytes": est.reserved_bytes if est else 0,
                "host_bytes": est.host_bytes if est else 0,
                "by_category": dict(est.by_category) if est else {},
                "peak_phase": est.peak_phase if est else "",
            }
        )
        print(f"{name} @ {gib} GiB: {tokens:,} tokens", flush=True)
    rows[0]["estimates"] = len(s.estimates)
    rows[0]["seconds_per_estimate"] = round(statistics.median(s.seconds), 1)
    return rows


def _resolution(row: dict[str, Any]) -> str:
    if row.get("lower_bound"):
        return "lower bound"
    return f"{row['resolution_tokens']:,}"


def grid_point(s: Search, tokens: int) -> dict[str, Any]:
    """One estimated length: whether it fits each budget (for a coarse search beside ``search``,
    where one estimate of a long sequence takes many minutes on 2 busy CPU cores)."""
    est = s.at(tokens)
    return {
        "stack": s.name,
        "tokens": tokens,
        "tile_tokens": tile_for(tokens),
        "fits": {str(g): est.fits(g * GIB) for g in BUDGETS_GIB},
        "peak_bytes": est.peak_bytes,
        "reserved_bytes": est.reserved_bytes,
        "host_bytes": est.host_bytes,
        "by_category": dict(est.by_category),
        "seconds": round(s.seconds[-1], 1),
    }


def from_grid(points: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the budgets ``rows`` lacks, from grid points: the longest estimated length that
    fits, and ``resolution_tokens``: how far the shortest longer one that does not fit lies
    (none: ``lower_bound``)."""
    have = {(r["stack"], r["budget_gib"]) for r in rows}
    out = []
    for name in dict.fromkeys(p["stack"] for p in points):
        mine = sorted((p for p in points if p["stack"] == name), key=lambda p: p["tokens"])
        for gib in BUDGETS_GIB:
            if (name, gib) in have:
                continue
            fit = [p for p in mine if p["fits"][str(gib)] is True]
            if not fit:
                continue
            best = fit[-1]  # a verdict None: not known (a point taken from a search's log)
            longer = [p for p in mine if p["tokens"] > best["tokens"]]
            known = bool(longer) and longer[0]["fits"][str(gib)] is False
            over = [longer[0]["tokens"]] if known else []
            out.append(
                {
                    "stack": name,
                    "budget_gib": gib,
                    "longest_tokens": best["tokens"],
                    "resolution_tokens": (over[0] - best["tokens"]) if over else None,
                    "lower_bound": not over,  # no longer length was estimated
                    "tile_tokens": best["tile_tokens"],
                    **{k: best[k] for k in ("peak_bytes", "reserved_bytes", "host_bytes")},
                    "by_category": best["by_category"],
                }
            )
    return out


# -- the step's extra time on this CPU -------------------------------------------------------------
def step_times(repeats: int = 5) -> list[dict[str, Any]]:
    """CPU seconds per training step of a tiny Llama (sequence 1024, one thread) with
    checkpointing alone and with each option, interleaved; median of ``repeats``. CPU time of
    this process, not wall time: the cores are shared with other work."""
    import transformers

    from lightning_efficient.techniques.activation_checkpointing import (
        apply_activation_checkpointing,
    )
    from lightning_efficient.techniques.activation_checkpointing.tiling import apply_tiling

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=224,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (1, 1024))
    variants = {
        "checkpointing": {},
        "+ boundaries in host memory": {"offload_boundaries": True},
        "+ tiles (64 tokens)": {"tile": 64},
        "+ both": {"offload_boundaries": True, "tile": 64},
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats + 1):  # the first round warms up, not counted
        for label, opts in variants.items():
            ckpt = apply_activation_checkpointing(
                model, offload_boundaries=opts.get("offload_boundaries", False)
            )
            tiling = apply_tiling(model, "auto", opts["tile"]) if "tile" in opts else None
            t0 = time.process_time()
            model(input_ids=ids, labels=ids).loss.backward()
            times[label].append(time.process_time() - t0)
            model.zero_grad(set_to_none=True)
            if tiling is not None:
                tiling.undo()
            ckpt.undo()
    torch.set_num_threads(threads)
    base = statistics.median(times["checkpointing"][1:])
    return [
        {
            "variant": label,
            "seconds": round(statistics.median(t[1:]), 4),
            "ratio": round(statistics.median(t[1:]) / base, 3),
        }
        for label, t in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context"))
    ap.add_argument("--step", type=int, default=4096, help="the search's resolution in tokens")
    ap.add_argument("--quick", action="store_true", help="only the CPU step times")
    ap.add_argument(
        "--stack", choices=list(STACKS), help="search this stack only; write its rows to --partial"
    )
    ap.add_argument("--partial", help="the JSON file of --stack's rows")
    ap.add_argument(
        "--budgets", type=int, nargs="*", default=list(BUDGETS_GIB), help="with --stack: GiB"
    )
    ap.add_argument("--probes", type=int, nargs=2, help="with --stack: the two probe lengths")
    ap.add_argument("--timing", help="the step times from `--quick --partial FILE`")
    ap.add_argument("--at", type=int, nargs="*", help="with --stack: estimate these lengths only")
    ap.add_argument(
        "--from-partials", nargs="*", default=[], help="take the rows from these files (parallel)"
    )
    args = ap.parse_args(argv)
    if args.stack and args.at:  # single estimates (a coarse grid), each in a process of its own
        s = Search(args.stack, args.step)
        save_json(args.partial, [grid_point(s, n) for n in args.at])
        return 0
    if args.stack:  # one stack's search, in a process of its own (the two run side by side)
        probes = tuple(args.probes) if args.probes else PROBES[args.stack]
        rows = search(args.stack, args.step, probes, tuple(args.budgets))
        save_json(args.partial, rows)
        return 0
    if args.quick and args.partial:  # the time part alone, for a later --timing
        save_json(args.partial, step_times())
        return 0
    timing = json.loads(Path(args.timing).read_text()) if args.timing else step_times()
    print(table(["Variant", "s / step", "x checkpointing"], [list(r.values()) for r in timing]))
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for path in args.from_partials:
        for item in json.loads(Path(path).read_text()):
            (points if "fits" in item else rows).append(item)
    rows += from_grid(points, rows)
    rows.sort(key=lambda r: (list(STACKS).index(r["stack"]), r["budget_gib"]))
    for r in rows:
        r.setdefault("resolution_tokens", args.step)
        r.setdefault("lower_bound", False)
        if STACKS[r["stack"]].get("tile_sequence"):
            r.setdefault("tile_tokens", tile_for(r["longest_tokens"]))
    if not args.quick and not rows:
        for name in STACKS:
            rows += search(name, args.step, PROBES[name])
    lines = [
        f"| {r['stack']} | {r['budget_gib']} | **{r['longest_tokens']:,}** | "
        f"{_resolution(r)} | {r.get('tile_tokens') or '-'} | "
        f"{r['peak_bytes'] / GIB:.2f} | {r['reserved_bytes'] / GIB:.2f} | "
        f"{r['host_bytes'] / GIB:.2f} |"
        for r in rows
    ]
    text = "\n".join(
        [
            "# Long context: the longest sequence that fits (estimated for a CUDA target)",
            "",
            "Llama-3-8B shape, PEFT LoRA r=16 on every linear layer, micro-batch 1, bf16-mixed, "
            "AdamW on the adapters, FrozenWeights4bit + ActivationCheckpointing + "
            "ChunkedCrossEntropy; `long context` adds `offload_boundaries=True, "
            f"tile_sequence={TILE}` (or an eighth of longer sequences). Searched by the estimator "
            f"for {TARGET.label} in steps of {args.step:,} tokens, or on a grid of lengths (one "
            "estimate each, in processes side by side: the resolution column says how far the "
            "next length that did not fit lies): estimates, not measured on a GPU.",
            "",
            "Resolution: how far the next length estimated lies (it did not fit); a lower bound "
            "where no longer length was found not to fit. Tile: tokens per tile.",
            "",
            "| Stack | Budget GiB | Longest tokens | Resolution | Tile | Peak GiB | Reserved GiB "
            "| Host GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *lines,
            "",
            "Published figures of others (theirs, not measured here):",
            "",
            table(
                ["Who", "GiB", "Tokens", "Source"],
                [[a["who"], a["budget_gib"], f"{a['tokens']:,}", a["source"]] for a in ANCHORS],
            ),
            "",
            "The step's CPU time on this CPU (tiny Llama, 4 layers, hidden 64, sequence 1024; "
            "forward + backward on one thread, median of 5, interleaved):",
            "",
            table(["Variant", "s / step", "x checkpointing"], [list(r.values()) for r in timing]),
            "",
            provenance(environment(), "python -m benchmarks.long_context"),
        ]
    )
    save_results(
        args.out,
        text,
        {
            "longest": rows,
            "goal": GOAL,
            "anchors": ANCHORS,
            "step_tokens": args.step,
            "tile_tokens": TILE,
            "cpu_step_time": timing,
            "target": TARGET.label,
            "environment": environment(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
