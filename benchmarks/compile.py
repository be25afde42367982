"""Compile time and steady-state step time: eager, whole-model compile, regional compile.

TinyGPT on the CPU, one training step = forward + cross-entropy + backward + AdamW step. For each
variant, in one run: the compile time (Dynamo compile events, summed by ``CompileWatch``), the
first step's wall time, and the steady-state step time (median, ``measure.timing.time_fn``).
Ratios compare the variants of this same run. Inductor's on-disk caches are disabled so every
compile is a cold one.

    python benchmarks/compile.py            # TinyGPT 6 x 128, seq 128, batch 8 (~3 min on 2 cores)
    python benchmarks/compile.py --quick    # 4 x 64, seq 64 (about a minute)

Prints a table and saves benchmarks/results/compile.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning  # noqa: E402

from lightning_efficient.demos import TinyGPT  # noqa: E402
from lightning_efficient.measure.timing import time_fn  # noqa: E402
from lightning_efficient.techniques.compile import CompileWatch, compile_modules  # noqa: E402

RESULTS = Path(__file__).parent / "results"


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


def run_variant(name: str, cfg: dict, batch, repeats: int, backend: str) -> dict:
    torch._dynamo.reset()
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
        steady_s = time_fn(step, warmup=2, repeats=repeats)
    return {
        "variant": name,
        "compiled": len(compiled),
        "compile_s": watch.seconds,
        "compiles": watch.compiles,
        "first_step_s": first_step_s,
        "steady_step_s": steady_s,
        "first_loss": first_loss,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer repeats")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", default=str(RESULTS / "compile"))
    args = ap.parse_args(argv)
    torch._inductor.config.force_disable_caches = True  # cold compiles every time
    if args.quick:
        cfg = dict(n_layer=4, n_embd=64, n_head=2, seq_len=64, dropout=0.0)
        bsz, repeats = 4, 5
    else:
        cfg = dict(n_layer=6, n_embd=128, n_head=4, seq_len=128, dropout=0.0)
        bsz, repeats = 8, 10
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (bsz, cfg["seq_len"] + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    rows = [
        run_variant(v, cfg, batch, repeats, args.backend) for v in ("eager", "whole", "regional")
    ]
    by = {r["variant"]: r for r in rows}
    for r in rows:
        r["steady_speed_vs_eager"] = by["eager"]["steady_step_s"] / r["steady_step_s"]
    ratios = {
        "regional_compile_over_whole": by["regional"]["compile_s"] / by["whole"]["compile_s"],
        "regional_speed_over_whole": by["whole"]["steady_step_s"] / by["regional"]["steady_step_s"],
    }
    goal = (
        ratios["regional_compile_over_whole"] <= 1 / 3
        and ratios["regional_speed_over_whole"] >= 0.95
    )
    meta = {
        "command": "python benchmarks/compile.py" + (" --quick" if args.quick else ""),
        "model": f"TinyGPT n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} seq_len={cfg['seq_len']} batch={bsz}",
        "backend": args.backend,
        "hardware": f"{platform.machine()} CPU, {torch.get_num_threads()} threads ({platform.processor() or 'cpu'})",
        "versions": f"torch {torch.__version__}, lightning {lightning.__version__}, python {platform.python_version()}",
        "repeats": repeats,
    }
    lines = [
        f"# torch.compile: eager vs whole-model vs regional ({meta['model']}, backend {args.backend})",
        "",
        f"{meta['hardware']}; {meta['versions']}. Command: `{meta['command']}`. Steady step: median of {repeats}.",
        "",
        "| Variant | Modules compiled | Compile time | First step | Steady step | Steady speed vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['compiled'] or '-'} | {r['compile_s']:.2f} s | {r['first_step_s']:.2f} s | "
            f"{r['steady_step_s'] * 1000:.1f} ms | {r['steady_speed_vs_eager']:.2f}x |"
        )
    lines += [
        "",
        f"Regional compile time / whole-model compile time: **{ratios['regional_compile_over_whole']:.2f}** (goal <= 0.33)",
        f"Regional steady speed / whole-model steady speed: **{ratios['regional_speed_over_whole']:.2f}** (goal >= 0.95)",
        f"Goal met: **{'yes' if goal else 'no'}**",
    ]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    result = {"meta": meta, "rows": rows, "ratios": ratios, "goal_met": goal}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
