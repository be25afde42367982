"""Compile time and steady-state step time: eager, whole-model compile, regional compile.

TinyGPT on the CPU, one training step = forward + cross-entropy + backward + AdamW step. For each
variant, in one run: the compile time (Dynamo compile events, summed by ``CompileWatch``) and the
first step's wall time. Steady-state step times are measured **interleaved**: after all variants
have compiled, each round times one step of every variant (in a rotating order), so a load change
on a shared machine hits all variants alike; the steady step is the median over rounds, and the
speed ratio regional/whole is also given as the median of the per-round ratios (paired). Inductor's
on-disk caches are disabled so every compile is a cold one.

    python -m benchmarks.compile            # TinyGPT 6 x 128, seq 128, batch 8
    python -m benchmarks.compile --quick    # 4 x 64, seq 64
    python -m benchmarks.compile --threads 1 --out benchmarks/results/compile_1thread
    python -m benchmarks.compile --variants whole regional --n-embd 256 \
        --out benchmarks/results/compile_width256    # wider blocks (n_head = n_embd / 32)

Prints a table and saves benchmarks/results/compile.{md,json} (through ``_results.save_results``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

from benchmarks._results import environment, save_results, table
from lightning_efficient.demos import TinyGPT
from lightning_efficient.techniques.compile import CompileWatch, apply_compile

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("eager", "whole", "regional", "regional+outer")


def compile_outer(model: torch.nn.Module, blocks: list[str], backend: str) -> list[str]:
    """The variant ``regional+outer`` adds: every module outside the blocks that owns parameters
    (TinyGPT: the two embeddings, the final norm and the head), each compiled in place as a region
    of its own. torch.nn's own layers need a wrapper frame (Dynamo skips theirs), so each is
    compiled through a function that calls the module's forward, installed as the instance's
    ``forward`` (public torch: the module's ``__call__`` runs it)."""
    names = []
    for name, module in model.named_modules():
        inside = any(name == b or name.startswith(b + ".") for b in blocks)
        if name and not inside and any(True for _ in module.parameters(recurse=False)):
            call = module.forward  # hooks are skipped; TinyGPT has none
            compiled = torch.compile(lambda *a, _c=call, **k: _c(*a, **k), backend=backend)
            module.forward = compiled
            names.append(name)
    return names


def make_step(model: TinyGPT, batch: tuple[torch.Tensor, torch.Tensor]):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch

    def step() -> tuple[float, float, float]:
        """One training step; returns the loss and the forward (with the loss) and backward
        times in seconds."""
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach()), t1 - t0, t2 - t1

    return step


def build_variant(name: str, cfg: dict, batch, backend: str) -> tuple[dict, object]:
    """Compile one variant and run its first steps; returns its row and its step function."""
    torch.manual_seed(0)
    model = TinyGPT(**cfg)
    compiled = []
    if name != "eager":
        compiled = apply_compile(model, regional=name != "whole", backend=backend).value
    if name == "regional+outer":
        compiled += compile_outer(model, compiled, backend)
    step = make_step(model, batch)
    with CompileWatch() as watch:
        t0 = time.perf_counter()
        first_loss = step()[0]
        first_step_s = time.perf_counter() - t0
        for _ in range(2):  # warm-up: anything left to compile (e.g. a deferred backward)
            step()
    row = {
        "variant": name,
        "compiled": len(compiled),
        "compile_s": watch.seconds,
        "compiles": watch.compiles,
        "first_step_s": first_step_s,
        "first_loss": first_loss,
    }
    return row, step


def interleaved(steps: dict[str, object], rounds: int) -> tuple[dict, dict, dict]:
    """Step, forward and backward times of every variant, one step each per round, in a rotating
    order."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    fwd: dict[str, list[float]] = {n: [] for n in names}
    bwd: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            _, f, b = steps[n]()
            times[n].append(time.perf_counter() - t0)
            fwd[n].append(f)
            bwd[n].append(b)
    return times, fwd, bwd


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--n-embd", type=int, default=None, help="model width (default 128)")
    ap.add_argument("--n-layer", type=int, default=None, help="blocks (default 6)")
    ap.add_argument("--out", default=str(RESULTS / "compile"))
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="variants to compile and time (in one interleaved run)",
    )
    args = ap.parse_args(argv)
    args.variants = [v for v in VARIANTS if v in args.variants]  # in VARIANTS' order
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._inductor.config.force_disable_caches = True  # cold compiles every time
    if args.quick:
        cfg = dict(n_layer=4, n_embd=64, n_head=2, seq_len=64, dropout=0.0)
        bsz, rounds = 4, 15
    else:
        cfg = dict(n_layer=6, n_embd=128, n_head=4, seq_len=128, dropout=0.0)
        bsz, rounds = 8, 40
    rounds = args.rounds or rounds
    if args.n_embd:
        cfg.update(n_embd=args.n_embd, n_head=max(1, args.n_embd // 32))
    if args.n_layer:
        cfg["n_layer"] = args.n_layer
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (bsz, cfg["seq_len"] + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    # One Dynamo cache for the whole run (no reset between variants: the compiled variants must
    # keep their graphs for the interleaved timing); the whole model's graph and the blocks' graph
    # have different guards (module types), so each variant compiles its own.
    torch._dynamo.reset()
    rows, steps = [], {}
    for v in args.variants:
        row, steps[v] = build_variant(v, cfg, batch, args.backend)
        if v == "regional+outer" and "regional" in args.variants:
            # its blocks reuse the regional variant's graph from Dynamo's cache: count that time
            row["compile_s"] += rows[args.variants.index("regional")]["compile_s"]
        rows.append(row)
        print(f"{v}: compiled in {row['compile_s']:.1f} s ({row['compiles']} graphs)", flush=True)
    times, fwd, bwd = interleaved(steps, rounds)
    by = {r["variant"]: r for r in rows}
    for r in rows:
        v = r["variant"]
        r["steady_step_s"] = statistics.median(times[v])
        r["steady_forward_s"] = statistics.median(fwd[v])
        r["steady_backward_s"] = statistics.median(bwd[v])
        if "eager" in by:
            r["steady_speed_vs_eager"] = statistics.median(
                e / t for e, t in zip(times["eager"], times[v])
            )
        if "whole" in by and v.startswith("regional"):
            # speed ratios: median of the per-round ratios (paired), and the ratio of medians
            r["compile_over_whole"] = r["compile_s"] / by["whole"]["compile_s"]
            r["speed_over_whole_paired"] = statistics.median(
                w / t for w, t in zip(times["whole"], times[v])
            )
            r["speed_over_whole"] = by["whole"]["steady_step_s"] / r["steady_step_s"]
            r["goal_met"] = (
                r["compile_over_whole"] <= 1 / 3 and r["speed_over_whole_paired"] >= 0.95
            )
    ratios = {}
    if "regional" in by and "whole" in by:
        ratios = {
            "regional_compile_over_whole": by["regional"]["compile_over_whole"],
            "regional_speed_over_whole": by["regional"]["speed_over_whole"],
            "regional_speed_over_whole_paired": by["regional"]["speed_over_whole_paired"],
        }
    goal = bool(ratios) and by["regional"]["goal_met"]
    model = f"TinyGPT n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} seq_len={cfg['seq_len']} batch={bsz}"
    meta = {
        "command": " ".join(
            ["python -m benchmarks.compile", *(argv if argv is not None else sys.argv[1:])]
        ),
        "model": model,
        "backend": args.backend,
        "threads": torch.get_num_threads(),
        "environment": environment(("torch", "lightning")),
        "rounds": rounds,
        "timing": "interleaved: one step of each variant per round, rotating order; medians",
    }
    env = ", ".join(f"{k} {v}" for k, v in meta["environment"].items())
    lines = [
        f"# torch.compile: eager vs whole-model vs regional ({model}, backend {args.backend})",
        "",
        f"{env}; {meta['threads']} threads. Command: `{meta['command']}`. Steady step: median of "
        f"{rounds} interleaved rounds (one step of each variant per round).",
        "",
        table(
            [
                "Variant",
                "Modules compiled",
                "Graphs",
                "Compile time",
                "First step",
                "Steady step",
                "Forward",
                "Backward",
                "Speed vs eager",
            ],
            [
                (
                    r["variant"],
                    r["compiled"] or "-",
                    r["compiles"],
                    f"{r['compile_s']:.2f} s",
                    f"{r['first_step_s']:.2f} s",
                    f"{r['steady_step_s'] * 1000:.1f} ms",
                    f"{r['steady_forward_s'] * 1000:.1f} ms",
                    f"{r['steady_backward_s'] * 1000:.1f} ms",
                    f"{r['steady_speed_vs_eager']:.2f}x" if "steady_speed_vs_eager" in r else "-",
                )
                for r in rows
            ],
            align="llrrrrrrr",
        ),
        "",
        "Forward includes the loss; speed vs eager is the median of per-round ratios.",
        "",
    ]
    regional = [r for r in rows if "compile_over_whole" in r]
    if regional:
        lines += [
            table(
                [
                    "Variant",
                    "Compile time / whole",
                    "Steady speed / whole (paired)",
                    "Steady speed / whole (ratio of medians)",
                    "Goal met",
                ],
                [
                    (
                        r["variant"],
                        f"**{r['compile_over_whole']:.2f}**",
                        f"**{r['speed_over_whole_paired']:.2f}**",
                        f"{r['speed_over_whole']:.2f}",
                        "yes" if r["goal_met"] else "no",
                    )
                    for r in regional
                ],
                align="lrrrl",
            ),
            "",
            "Goal: compile time <= 0.33 of whole-model's, steady speed >= 0.95 of whole-model's "
            "(paired: median of per-round ratios).",
        ]
    result = {
        "meta": meta,
        "rows": rows,
        "ratios": ratios,
        "goal_met": goal,
        "step_times_s": times,
        "forward_times_s": fwd,
        "backward_times_s": bwd,
    }
    save_results(args.out, "\n".join(lines), result)
    return result


if __name__ == "__main__":
    main()
