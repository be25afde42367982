"""ChunkedCrossEntropy: the loss phase's memory and time on this CPU, and GPT-2 small's largest
micro-batch in 24 GiB for a CUDA target.

Part 1, the loss phase alone (what the output projection and the cross-entropy hold: hidden
states of GPT-2's width 768 through a gain, as a final norm, and the projection to the
vocabulary, then ``F.cross_entropy``), 4096 rows (sequence 1024 x micro-batch 4), fp32, SGD
without state, one real step on this CPU, plain and with ``ChunkedCrossEntropy`` (default chunk
size), at vocabularies 50,257 (GPT-2) and 128,256 (Llama 3). The peak above the parameters,
from the instrument's storage tracker (``measure_step``) and, in the same run, from the CPU
allocator's own events (``allocator_step_peak``). Beside them, the instrument's estimate of the
same step under bf16-mixed for a CUDA target (fake tensors).

Part 2, step time at GPT-2 shape on this CPU: TinyGPT at GPT-2 small's shape (12 blocks, width
768, 12 heads, vocabulary 50,257, sequence 1024; 124M parameters), micro-batch 1, fp32 AdamW,
forward + backward + optimizer step, plain and chunked in interleaved rounds (``time_fn``, one
timed step per model per round; median over the rounds), wall and process CPU seconds; and the
loss phase of part 1 (vocabulary 50,257) timed the same way.

Part 3, the largest micro-batch (Hugging Face GPT-2 small, 124M, sequence 1024) whose estimate
for a CUDA target fits 24 GiB (``MemoryEstimate.fits``: the allocations replayed through the
CUDA caching allocator under that cap), with the planner's stack (bf16-mixed, 8-bit AdamW,
every block checkpointed), without and with ``ChunkedCrossEntropy``; and the estimate of the
planner's pick before (micro-batch 30) with and without it, by category and phase.

Part 4, moderate logits (2 x 256 rows, fp32), the whole step's peak: a plain GPT-like module
with a 64 -> 64,000 head (131 MB of logits; the tracker, two real steps) and a tiny Llama with
vocabulary 128,256 (the estimate, fake tensors), with SGD and AdamW.

Run:  python -m benchmarks.chunked_loss          (~25 minutes on 2 busy cores)
      python -m benchmarks.chunked_loss --quick  (smaller shapes, a few minutes)
      python -m benchmarks.chunked_loss --moderate  (part 4 only, a few minutes)
Writes benchmarks/results/chunked_loss{,_quick,_moderate}.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import GPTLike, LossHead, llama_128k, logits_loss
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure.memory.allocator import allocator_step_peak
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.measure.step import loss_of
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
from lightning_efficient.techniques.batch_size.sizing import largest_fitting_batch
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy
from lightning_efficient.techniques.optimizers import OptimizerSwap

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
SGD = "torch.optim.SGD"  # no optimizer state: the step's memory is the loss phase's


def head_batch(rows: int, width: int, vocab: int, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    if device == "meta":
        return (
            torch.empty(rows, width, device="meta"),
            torch.empty(rows, dtype=torch.long, device="meta"),
        )
    return torch.randn(rows, width, generator=g), torch.randint(0, vocab, (rows,), generator=g)


def _chunked(on: bool) -> list[Any]:
    return [ChunkedCrossEntropy()] if on else []


# -- part 1 -----------------------------------------------------------------------------------------
def part1(args: argparse.Namespace) -> list[dict[str, Any]]:
    width, rows = 768, args.rows
    out = []
    for vocab in args.vocabs:
        row: dict[str, Any] = {"vocab": vocab, "rows": rows, "width": width}
        for on in (False, True):
            key = "chunked" if on else "plain"
            torch.manual_seed(0)
            model = LossHead(width, vocab)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            tracked, allocator = allocator_step_peak(
                model,
                head_batch(rows, width, vocab),
                optimizer_factory=SGD,
                loss_fn=logits_loss,
                callbacks=_chunked(on),
                steps=1,
            )
            with torch.device("meta"):
                fake = LossHead(width, vocab)
            est = estimate_memory(
                fake,
                head_batch(rows, width, vocab, "meta"),
                optimizer=SGD,
                loss_fn=logits_loss,
                precision="bf16-mixed",
                callbacks=_chunked(on),
                device="cuda",
            )
            row[f"{key}_tracked"] = tracked.peak_bytes - params
            row[f"{key}_allocator"] = allocator - params
            row[f"{key}_estimate_cuda_bf16"] = (
                est.peak_bytes - params - est.by_category.get("workspaces", 0)
            )
            print(
                f"  vocab {vocab} {key}: tracked {format_bytes(row[f'{key}_tracked'])}", flush=True
            )
        for m in ("tracked", "allocator", "estimate_cuda_bf16"):
            row[f"ratio_{m}"] = row[f"plain_{m}"] / row[f"chunked_{m}"]
        out.append(row)
    return out


# -- part 4: moderate logits (issue 37, row 12) -------------------------------------------------------
def part4(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Whole-step peaks at moderate logits (2 x 256 rows, fp32): a plain GPT-like module with a
    64 -> 64,000 head (131 MB of logits), measured by the tracker (``measure_step``, two real
    steps), and a tiny Llama with Llama 3's 128,256 vocabulary (263 MB), estimated (fake
    tensors, same tracker); SGD and AdamW."""
    out = []
    batch64 = (torch.randint(0, 64000, (2, 256)), torch.randint(0, 64000, (2, 256)))
    ids = torch.randint(0, 128256, (2, 256))
    for opt in (SGD, "adamw"):
        for name, how in (("GPT-like, 64 -> 64,000", "tracker"), ("Llama, 128,256", "estimate")):
            row: dict[str, Any] = {"model": name, "optimizer": opt, "how": how}
            for on in (False, True):
                torch.manual_seed(0)
                if how == "tracker":
                    r = measure_step(
                        GPTLike(), batch64, opt, loss_fn=logits_loss, callbacks=_chunked(on)
                    )
                else:
                    r = estimate_memory(
                        llama_128k(),
                        (ids, ids),
                        optimizer=opt,
                        loss_fn=logits_loss,
                        callbacks=_chunked(on),
                        device="cpu",
                    )
                key = "chunked" if on else "plain"
                row[f"{key}_peak"], row[f"{key}_phase"] = r.peak_bytes, r.peak_phase
            row["ratio"] = row["plain_peak"] / row["chunked_peak"]
            print(f"  {name} {opt}: {row['ratio']:.2f}x", flush=True)
            out.append(row)
    return out


# -- part 2 -----------------------------------------------------------------------------------------
class Silent:
    """A LightningModule's ``training_step`` outside a Trainer, with ``self.log`` silenced."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> nn.Module:
        self.module.log = lambda *a, **k: None
        return self.module

    def __exit__(self, *exc: Any) -> None:
        del self.module.log


def _gpt_step(on: bool, dims: dict[str, int], batch: tuple) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = TinyGPT(**dims, dropout=0.0).train()
    change = None
    if on:
        from lightning_efficient.techniques.chunked_loss import apply_chunked_cross_entropy

        change = apply_chunked_cross_entropy(model)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        with Silent(model):
            loss = loss_of(model.training_step(batch, 0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, change


def _head_step(on: bool, vocab: int, rows: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = LossHead(768, vocab)
    change = None
    if on:
        from lightning_efficient.techniques.chunked_loss import apply_chunked_cross_entropy

        change = apply_chunked_cross_entropy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = head_batch(rows, 768, vocab)

    def step() -> None:
        logits_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, change


def interleaved(steps: dict[str, Any], rounds: int) -> dict[str, dict[str, float]]:
    """Median wall and process-CPU seconds of one call of each step, over interleaved rounds."""
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    for fn in steps.values():
        fn()  # warm-up, untimed
    for _ in range(rounds):
        for k, fn in steps.items():
            c0 = time.process_time()
            wall[k].append(time_fn(fn, warmup=0, repeats=1))
            cpu[k].append(time.process_time() - c0)
    return {
        k: {"wall_s": statistics.median(wall[k]), "cpu_s": statistics.median(cpu[k])} for k in steps
    }


def part2(args: argparse.Namespace) -> list[dict[str, Any]]:
    dims = dict(vocab_size=50257, seq_len=args.seq, n_layer=args.layers, n_embd=768, n_head=12)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50257, (1, args.seq), generator=g)
    batch = (x, torch.roll(x, -1, 1))
    out = []
    for name, build in (
        (
            f"TinyGPT {args.layers} x 768, vocabulary 50,257, sequence {args.seq}, micro-batch 1, "
            "fp32 AdamW step",
            lambda on: _gpt_step(on, dims, batch),
        ),
        (
            f"loss phase alone ({args.rows} rows, width 768, vocabulary 50,257), fp32 SGD step",
            lambda on: _head_step(on, 50257, args.rows),
        ),
    ):
        plain, _ = build(False)
        chunked, change = build(True)
        times = interleaved({"plain": plain, "chunked": chunked}, args.rounds)
        assert change.value.chunked_calls > 0 and not change.value.fallbacks
        out.append(
            {
                "workload": name,
                "rounds": args.rounds,
                "plain_wall_s": times["plain"]["wall_s"],
                "chunked_wall_s": times["chunked"]["wall_s"],
                "plain_cpu_s": times["plain"]["cpu_s"],
                "chunked_cpu_s": times["chunked"]["cpu_s"],
                "wall_ratio": times["chunked"]["wall_s"] / times["plain"]["wall_s"],
                "cpu_ratio": times["chunked"]["cpu_s"] / times["plain"]["cpu_s"],
                "rows_per_chunk": change.value.rows,
            }
        )
        print(f"  {name}: {out[-1]['wall_ratio']:.3f} (wall), {out[-1]['cpu_ratio']:.3f} (CPU)")
    return out


# -- part 3 -----------------------------------------------------------------------------------------
def _gpt2(seq: int) -> nn.Module:
    import lightning.pytorch as pl
    from transformers import GPT2Config, GPT2LMHeadModel

    class HFGPT2(pl.LightningModule):  # as benchmarks/gpu/common.py's
        def __init__(self) -> None:
            super().__init__()
            cfg = GPT2Config(n_positions=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
            self.model = GPT2LMHeadModel(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            return self.model(input_ids=x, labels=x).loss

    with torch.device("meta"):
        return HFGPT2()


def _stack(on: bool) -> list[Any]:
    return [OptimizerSwap("adamw8bit"), ActivationCheckpointing(), *_chunked(on)]


def part3(args: argparse.Namespace) -> dict[str, Any]:
    seq, budget = args.gpt2_seq, args.budget
    model = _gpt2(seq)

    def estimate(n: int, on: bool) -> Any:
        ids = torch.empty(n, seq, dtype=torch.long, device="meta")
        return estimate_memory(
            model, (ids, ids), precision="bf16-mixed", callbacks=_stack(on), device="cuda"
        )

    rows = []
    for on in (False, True):
        t0 = time.perf_counter()

        def fn(n: int, on: bool = on) -> float:
            est = estimate(n, on)
            return est.peak_bytes if est.fits(budget) else math.inf

        largest, seen = largest_fitting_batch(fn, budget, args.top)
        rows.append(
            {
                "stack": "bf16-mixed + adamw8bit + checkpoint all blocks"
                + (" + ChunkedCrossEntropy" if on else ""),
                "largest_micro_batch": largest,
                "peak_bytes": int(seen.get(largest, 0)),
                "estimates": len(seen),
                "search_s": time.perf_counter() - t0,
            }
        )
        print(f"  {rows[-1]['stack']}: {largest}", flush=True)
    at = {}
    for on in (False, True):
        est = estimate(args.at, on)
        at["chunked" if on else "plain"] = {
            "peak_bytes": est.peak_bytes,
            "reserved_bytes": est.reserved_bytes,
            "peak_phase": est.peak_phase,
            "by_category": est.by_category,
            "phase_peaks": est.phase_peaks,
        }
    return {"rows": rows, "at": at, "at_batch": args.at, "budget_bytes": budget, "seq": seq}


# -- report -----------------------------------------------------------------------------------------
def render(p1: list, p2: list, p3: dict, args: argparse.Namespace, wall: float) -> str:
    f = format_bytes
    lines = [
        f"### Loss phase, {args.rows} rows, width 768, one fp32 SGD step on this CPU (peak above "
        "the parameters)",
        "",
        table(
            (
                "Vocabulary",
                "Plain (tracker)",
                "Chunked (tracker)",
                "Lower by",
                "Plain (allocator)",
                "Chunked (allocator)",
                "Lower by",
                "bf16-mixed, CUDA estimate",
            ),
            [
                (
                    f"{r['vocab']:,}",
                    f(r["plain_tracked"]),
                    f(r["chunked_tracked"]),
                    f"{r['ratio_tracked']:.1f}x",
                    f(r["plain_allocator"]),
                    f(r["chunked_allocator"]),
                    f"{r['ratio_allocator']:.1f}x",
                    f"{f(r['plain_estimate_cuda_bf16'])} -> {f(r['chunked_estimate_cuda_bf16'])} "
                    f"({r['ratio_estimate_cuda_bf16']:.1f}x)",
                )
                for r in p1
            ],
            "r" * 8,
        ),
        "",
        "The chunked step keeps the weight's gradient (as any step does, created in the forward "
        "instead of the head's backward), the hidden states' gradient and one chunk's logits; the "
        "plain step holds the (rows x vocabulary) logits, their log-softmax and their gradient.",
        "",
        f"### Step time on this CPU ({args.rounds} interleaved rounds, median; default chunk size)",
        "",
        table(
            ("Workload", "Plain s", "Chunked s", "Chunked / plain (wall)", "(process CPU)"),
            [
                (
                    r["workload"],
                    f"{r['plain_wall_s']:.2f}",
                    f"{r['chunked_wall_s']:.2f}",
                    f"{r['wall_ratio']:.3f}",
                    f"{r['cpu_ratio']:.3f}",
                )
                for r in p2
            ],
            "lrrrr",
        ),
        "",
        f"### HF GPT-2 small, sequence {p3['seq']}, {f(p3['budget_bytes'])}, CUDA target (H100/"
        "H200 class): largest micro-batch whose allocations fit the cap (estimate)",
        "",
        table(
            ("Stack", "Largest micro-batch", "Peak at it", "Estimates", "Search s"),
            [
                (
                    r["stack"],
                    r["largest_micro_batch"],
                    f(r["peak_bytes"]),
                    r["estimates"],
                    f"{r['search_s']:.0f}",
                )
                for r in p3["rows"]
            ],
            "lrrrr",
        ),
        "",
        f"At micro-batch {p3['at_batch']} (the planner's stack), by category at the peak:",
        "",
        table(
            ("Category", "Without", "With ChunkedCrossEntropy"),
            [
                (
                    c.replace("_", " "),
                    f(p3["at"]["plain"]["by_category"][c]),
                    f(p3["at"]["chunked"]["by_category"][c]),
                )
                for c in p3["at"]["plain"]["by_category"]
            ]
            + [
                (
                    "**peak**",
                    f"{f(p3['at']['plain']['peak_bytes'])} ({p3['at']['plain']['peak_phase']})",
                    f"{f(p3['at']['chunked']['peak_bytes'])} ({p3['at']['chunked']['peak_phase']})",
                ),
                (
                    "reserved by the allocator",
                    f(p3["at"]["plain"]["reserved_bytes"]),
                    f(p3["at"]["chunked"]["reserved_bytes"]),
                ),
            ],
            "lrr",
        ),
        "",
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    env = {
        **environment(("torch", "lightning", "transformers")),
        "torch threads": str(torch.get_num_threads()),
        "load average": f"{load:.1f}",
    }
    cmd = "python -m benchmarks.chunked_loss" + (" --quick" if args.quick else "")
    lines += [
        f"Machine load average at the end: {load:.1f} on {os.cpu_count()} cores (wall times "
        f"shift with it; process CPU seconds are this process's own). Total {wall:.0f} s.",
        "",
        provenance(env, cmd),
    ]
    return "\n".join(lines)


def render_part4(p4: list) -> str:
    f = format_bytes
    return "\n".join(
        [
            "",
            "### Moderate logits, 2 x 256 rows, fp32, the whole step's peak (default chunk size)",
            "",
            table(
                ("Model", "Optimizer", "Measured by", "Plain", "Chunked", "Lower by"),
                [
                    (
                        r["model"],
                        r["optimizer"].rsplit(".", 1)[-1],
                        r["how"],
                        f"{f(r['plain_peak'])} ({r['plain_phase']})",
                        f"{f(r['chunked_peak'])} ({r['chunked_phase']})",
                        f"{r['ratio']:.3f}x",
                    )
                    for r in p4
                ],
                "lllrrr",
            ),
            "",
            "A chunk holds at most 1/16 of the logits' rows (here 32 of 512), so moderate logits "
            "are chunked too (the 128 MiB cap alone would hold all 512 rows in one chunk). With "
            "AdamW on these narrow models the chunked step's peak is the optimizer step's "
            "(parameters, gradients, both moments and AdamW's temporaries), the plain step's too "
            "at that phase: no loss can go lower.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, for a fast check")
    parser.add_argument("--out", default=None, help="result stem")
    parser.add_argument(
        "--moderate", action="store_true", help="part 4 only (moderate logits, a few minutes)"
    )
    args = parser.parse_args()
    if args.moderate:
        warnings.filterwarnings("ignore")
        p4 = part4(args)
        text = (
            render_part4(p4)
            + "\n"
            + provenance(
                environment(("torch", "lightning", "transformers")),
                "python -m benchmarks.chunked_loss --moderate",
            )
        )
        stem = args.out or ROOT / "benchmarks" / "results" / "chunked_loss_moderate"
        save_results(stem, text, {"moderate_logits": p4})
        return
    q = args.quick
    args.rows = 512 if q else 4096
    args.vocabs = (50257, 128256)
    args.seq = 128 if q else 1024
    args.layers = 2 if q else 12
    args.rounds = 2 if q else 5
    args.gpt2_seq = 256 if q else 1024
    args.budget = 6 * GIB if q else 24 * GIB
    args.top = 512 if q else 256
    args.at = 30
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print("part 1: loss-phase memory", flush=True)
    p1 = part1(args)
    print("part 2: step time", flush=True)
    p2 = part2(args)
    print("part 3: largest micro-batch, CUDA target", flush=True)
    p3 = part3(args)
    print("part 4: moderate logits, whole step", flush=True)
    p4 = part4(args)
    wall = time.perf_counter() - t0
    text = render(p1, p2, p3, args, wall) + render_part4(p4)
    stem = args.out or ROOT / "benchmarks" / "results" / (
        "chunked_loss_quick" if q else "chunked_loss"
    )
    save_results(
        stem,
        text,
        {
            "loss_phase": p1,
            "step_time": p2,
            "largest_batch": p3,
            "moderate_logits": p4,
            "env": environment(("torch", "lightning", "transformers")),
            "wall_s": wall,
        },
    )


if __name__ == "__main__":
    main()
