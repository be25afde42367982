"""Compile time and steady-state step time: eager, whole-model compile, regional compile.

TinyGPT on the CPU, one training step = forward + cross-entropy + backward + AdamW step. For each
variant, in one run: the compile time (Dynamo compile events, summed by ``CompileWatch``) and the
first step's wall time. Steady-state step times are measured **interleaved**: after all variants
have compiled, each round times one step of every variant (in a rotating order), so a load change
on a shared machine hits all variants alike; the steady step is the median over rounds, and the
speed ratio regional/whole is also given as the median of the per-round ratios (paired). Inductor's
on-disk caches are disabled so every compile is a cold one.

    python benchmarks/compile.py            # TinyGPT 6 x 128, seq 128, batch 8
    python benchmarks/compile.py --quick    # 4 x 64, seq 64
    python benchmarks/compile.py --threads 1 --out benchmarks/results/compile_1thread

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import environment, save_results, table  # noqa: E402

from lightning_efficient.demos import TinyGPT  # noqa: E402
from lightning_efficient.techniques.compile import CompileWatch, compile_modules  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("eager", "whole", "regional")


def make_step(model: TinyGPT, batch: tuple[torch.Tensor, torch.Tensor]):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch

    def step() -> float:
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def build_variant(name: str, cfg: dict, batch, backend: str) -> tuple[dict, object]:
    """Compile one variant and run its first steps; returns its row and its step function."""
    torch.manual_seed(0)
    model = TinyGPT(**cfg)
    compiled = []
    if name != "eager":
        compiled = compile_modules(model, regional=name == "regional", backend=backend)
    step = make_step(model, batch)
    with CompileWatch() as watch:
        t0 = time.perf_counter()
        first_loss = step()
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


def interleaved(steps: dict[str, object], rounds: int) -> dict[str, list[float]]:
    """Step times of every variant, one step each per round, in a rotating order."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            steps[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--out", default=str(RESULTS / "compile"))
    args = ap.parse_args(argv)
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
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (bsz, cfg["seq_len"] + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    # One Dynamo cache for the whole run (no reset between variants: the compiled variants must
    # keep their graphs for the interleaved timing); the whole model's graph and the blocks' graph
    # have different guards (module types), so each variant compiles its own.
    torch._dynamo.reset()
    rows, steps = [], {}
    for v in VARIANTS:
        row, steps[v] = build_variant(v, cfg, batch, args.backend)
        rows.append(row)
        print(f"{v}: compiled in {row['compile_s']:.1f} s ({row['compiles']} graphs)", flush=True)
    times = interleaved(steps, rounds)
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["steady_step_s"] = statistics.median(times[r["variant"]])
        r["steady_speed_vs_eager"] = by["eager"]["steady_step_s"] / r["steady_step_s"]
    paired = [w / g for w, g in zip(times["whole"], times["regional"])]
    ratios = {
        "regional_compile_over_whole": by["regional"]["compile_s"] / by["whole"]["compile_s"],
        "regional_speed_over_whole": by["whole"]["steady_step_s"] / by["regional"]["steady_step_s"],
        "regional_speed_over_whole_paired": statistics.median(paired),
    }
    goal = (
        ratios["regional_compile_over_whole"] <= 1 / 3
        and ratios["regional_speed_over_whole_paired"] >= 0.95
    )
    model = f"TinyGPT n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} seq_len={cfg['seq_len']} batch={bsz}"
    meta = {
        "command": " ".join(
            ["python benchmarks/compile.py", *(argv if argv is not None else sys.argv[1:])]
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
                    f"{r['steady_speed_vs_eager']:.2f}x",
                )
                for r in rows
            ],
            align="llrrrrr",
        ),
        "",
        f"Regional compile time / whole-model compile time: **{ratios['regional_compile_over_whole']:.2f}** (goal <= 0.33)",
        f"Regional steady speed / whole-model steady speed: **{ratios['regional_speed_over_whole_paired']:.2f}** "
        f"(median of per-round ratios; ratio of medians {ratios['regional_speed_over_whole']:.2f}; goal >= 0.95)",
        f"Goal met: **{'yes' if goal else 'no'}**",
    ]
    result = {"meta": meta, "rows": rows, "ratios": ratios, "goal_met": goal, "step_times_s": times}
    save_results(args.out, "\n".join(lines), result)
    return result


if __name__ == "__main__":
    main()
