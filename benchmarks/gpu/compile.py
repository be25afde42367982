"""Part 6 of ``benchmarks/gpu/suite.py``: compile, regional against whole model.

Compiles TinyGPT cold three ways (regional, whole model, eager) in one process: compile time,
first and steady step time, and what ``scope="auto"`` would choose from those figures
(``choose_scope``). Run by the suite as ``python -m benchmarks.gpu.compile --ctx FILE``.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch.nn.functional as F

from benchmarks.gpu.common import Ctx, Recorder, child_main, describe, gpt2_dims, time_skip
from benchmarks.workloads import build_model
from lightning_efficient.functional import apply_compile
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.techniques.compile import CompileWatch
from lightning_efficient.techniques.compile.scope import choose_scope

__all__ = ["part_compile"]


def _compile_variant(
    variant: str, ctx: Ctx, dims: dict[str, Any], batch: Any, backend: str, bf16: bool
) -> dict[str, Any]:
    """One cold compile (or eager) of TinyGPT's training step: compile time, first and steady
    step time."""
    import torch._dynamo

    device = torch.device(ctx.device)
    x, y = batch
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("tinygpt", dims, ctx.device)
    names = []
    if variant != "eager":
        names = apply_compile(model, regional=variant == "regional", backend=backend).value
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with CompileWatch() as watch:
        t0 = time.perf_counter()
        step()
        if ctx.cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        steady = time_fn(step, warmup=2, repeats=ctx.profile["compile_repeats"], device=device)
    return {
        "variant": variant,
        "status": "ok",
        "modules_compiled": len(names),
        "compile_s": watch.seconds,
        "graphs": watch.compiles,
        "recompiles": watch.recompiles,
        "first_step_s": first,
        "steady_step_s": steady,
    }


def part_compile(ctx: Ctx, rec: Recorder) -> None:
    import torch._inductor.config

    p = ctx.profile
    dims = gpt2_dims(ctx)
    batch, seq, backend = p["compile_batch"], dims["seq"], p["compile_backend"]
    torch._inductor.config.force_disable_caches = True  # every compile is a cold one
    bf16 = p["compile_precision"] == "bf16-mixed"
    rec.note(
        f"TinyGPT {describe(dims)}, batch {batch} x {seq}, "
        f"{'bf16 autocast' if bf16 else 'fp32'}, AdamW; one training step = forward + "
        f"cross-entropy + backward + step. Backend {backend}, caches disabled (cold compiles); "
        f"compile time = Dynamo compile events (CompileWatch); steady step = median of "
        f"{p['compile_repeats']} (measure.speed.timing.time_fn). One process, variants in this "
        "order. The auto choice: TorchCompile(scope='auto')'s rule (choose_scope) on these figures."
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, dims["vocab"], (batch, seq + 1), generator=g).to(ctx.device)
    data = (tokens[:, :-1], tokens[:, 1:])
    per_variant = None
    for variant in ("regional", "whole", "eager"):
        need = per_variant * 1.5 if per_variant and variant != "eager" else 10.0
        if ctx.left() < need:
            basis = f"the last variant took {per_variant:.0f} s" if per_variant else "a guess"
            rec.row(variant=variant, **time_skip(ctx.left(), need, basis))
            continue
        t0 = time.perf_counter()
        rec.row(**_compile_variant(variant, ctx, dims, data, backend, bf16))
        per_variant = time.perf_counter() - t0
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    by = {r["variant"]: r for r in rec.data["rows"] if r.get("status") == "ok"}
    if "eager" in by:
        for r in by.values():
            r["speed_vs_eager"] = by["eager"]["steady_step_s"] / r["steady_step_s"]
    if "regional" in by and "whole" in by and by["whole"]["compile_s"] > 0:
        t = by["regional"]["compile_s"] / by["whole"]["compile_s"]
        s = by["whole"]["steady_step_s"] / by["regional"]["steady_step_s"]
        choice = choose_scope(
            by["regional"]["steady_step_s"],
            by["whole"]["steady_step_s"],
            regional_compile_s=by["regional"]["compile_s"],
            whole_compile_s=by["whole"]["compile_s"],
        )
        rec.figure(
            regional_compile_over_whole=t,
            regional_speed_over_whole=s,
            auto_choice=choice.scope,
            auto_reason=choice.reason,
        )
        rec.finish(
            f"regional compile takes {t:.2f}x the whole model's compile time and runs at "
            f"{s:.2f}x its steady speed; scope auto would choose {choice.scope}"
        )
    else:
        rec.finish("regional and whole-model compile not both measured")


if __name__ == "__main__":
    sys.exit(child_main(part_compile))
