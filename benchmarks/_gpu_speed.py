"""Parts 5 and 6 of ``benchmarks/gpu_suite.py``: speed, one lever at a time, and compile.

Part 5 (issue 29) is an ablation on TinyGPT at GPT-2 124M shape, micro-batch 8 x 1024: each row
adds one lever of the package to the row before it, as Lightning runs it, and records tokens/s,
step time, MFU, the ratio to the plain run, the verdict ``StepProfiler`` gives on that row (the
next lever, its yaml and expected gain), and for the compile row what ``TorchCompile(scope=
"auto")`` measured and chose. The effective batch is 16 sequences in every row (2 accumulated
micro-batches of 8), so the larger micro-batch row (16, no accumulation) keeps the maths. Last,
the profiler's own cost: the final stack without ``StepProfiler``, against the same stack with it
(start-to-start: the synchronised wall time of the timed steps, every hook included).

Part 6 compiles TinyGPT cold three ways (regional, whole model, eager) in one process, and says
what ``scope="auto"`` would choose from those figures (``choose_scope``).

Imported by the part processes only (``_gpu_parts.PARTS``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch.nn.functional as F
from _gpu_parts import (
    Ctx,
    Recorder,
    RunPool,
    _status,
    build_model,
    describe,
    flops_per_token,
    gpt2_dims,
    peak_bf16,
    pos_params,
    time_skip,
    unique_params,
)

from lightning_efficient.functional import apply_compile
from lightning_efficient.measure.timing import time_fn
from lightning_efficient.techniques.compile import CompileWatch
from lightning_efficient.techniques.compile.scope import choose_scope

__all__ = ["ABLATION", "part_compile", "part_speed"]

#: The ablation: (row, what the row adds). Each row keeps every lever of the rows before it.
ABLATION = [
    ("plain Lightning, fp32", {}),
    ("+ bf16-mixed", {"precision": "bf16-mixed"}),
    ("+ TF32", {"add": {"class_path": "MatmulPrecision", "init_args": {"level": "high"}}}),
    (
        "+ fused AdamW",
        {"add": {"class_path": "OptimizerSwap", "init_args": {"name": "adamw_fused"}}},
    ),
    ("+ compile (scope auto)", {"compile": {"scope": "auto"}}),
    ("+ micro-batch {effective}, no accumulation", {"micro_batch": "effective"}),
    ("+ chunked loss", {"add": {"class_path": "ChunkedCrossEntropy", "init_args": {}}}),
    ("+ CUDA graphs", {"compile_mode": "reduce-overhead"}),
]
PROFILER = {"class_path": "StepProfiler", "init_args": {"print_table": False}}


def _rows_specs(ctx: Ctx, dims: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each row's run spec, the levers accumulated row by row."""
    p = ctx.profile
    micro, accumulate = p["speed_batch"], p["speed_accumulate"]
    precision, callbacks, compile_args = "32-true", [], None
    out = []
    for name, lever in ABLATION:
        precision = lever.get("precision", precision)
        if "add" in lever:
            callbacks = [*callbacks, lever["add"]]
        if "compile" in lever:
            compile_args = {"backend": p["compile_backend"], **lever["compile"]}
        if "micro_batch" in lever:  # the effective batch in one micro-batch: same maths
            micro, accumulate = micro * accumulate, 1
        name = name.format(effective=micro * accumulate)
        if "compile_mode" in lever and compile_args is not None:
            compile_args = {**compile_args, "mode": lever["compile_mode"]}
        stack = list(callbacks)
        if compile_args is not None:
            stack.append({"class_path": "TorchCompile", "init_args": dict(compile_args)})
        spec = {
            "model": "tinygpt",
            "dims": dims,
            "batch": micro,
            "accumulate": accumulate,
            "steps": p["speed_steps"],
            "precision": precision,
            "callbacks": [*stack, PROFILER],
            "device": ctx.device,
            "measure_memory": False,
            "timing": {"warmup": p["speed_warmup"], "window_s": p["speed_window_s"]},
        }
        out.append((name, spec))
    return out


def part_speed(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    dims = gpt2_dims(ctx)
    seq = dims["seq"]
    micro, accumulate = p["speed_batch"], p["speed_accumulate"]
    rec.note(
        f"TinyGPT {describe(dims)}, micro-batch {micro} x {seq}, {accumulate} micro-batches per "
        f"optimizer step (effective batch {micro * accumulate} sequences in every row), random "
        "tokens. Each row adds one lever of the package to the row before it. Tokens/s over the "
        f"optimizer steps after {p['speed_warmup']} warm-up steps (compile happens there), "
        f"synchronised wall time, at most {p['speed_window_s']:.0f} s or {p['speed_steps']} "
        "steps; every row runs with StepProfiler() (its verdict: the next lever); on CUDA each "
        "row in a fresh process. The profiler's cost: the last row again without StepProfiler."
    )
    peak = peak_bf16(ctx.device_name) if ctx.cuda else None
    if ctx.cuda and peak is None:
        rec.note(f"no bf16 peak known for {ctx.device_name!r}: MFU not computed")
    model = build_model("tinygpt", dims, "meta")
    fpt = flops_per_token(
        unique_params(model), pos_params(model), dims["n_layer"], dims["n_embd"], seq
    )
    rec.figure(flops_per_token=fpt, peak_bf16_flops=peak)
    pool = RunPool(ctx, warm=1 if ctx.cuda else 0)
    last_wall: float | None = None
    specs = _rows_specs(ctx, dims)
    final: dict[str, Any] | None = None
    try:
        for name, spec in specs:
            if name == "+ CUDA graphs" and not ctx.cuda:
                rec.row(variant=name, status="skipped: CUDA graphs need a CUDA device")
                continue
            res, last_wall = _timed_row(ctx, rec, pool, name, spec, last_wall, fpt, peak)
            if res is not None and res.get("ok") and res.get("tokens_per_s"):
                final = spec  # the overhead pair runs the last stack that trained
            chosen = ((res or {}).get("figures") or {}).get("TorchCompile", {}).get("scope")
            if chosen in ("regional", "whole"):  # later rows compile what auto chose here
                for _, later in specs:
                    for c in later["callbacks"]:
                        if c.get("class_path") == "TorchCompile":
                            c["init_args"]["scope"] = chosen
        if final is not None:
            bare = {**final, "callbacks": [c for c in final["callbacks"] if c is not PROFILER]}
            _timed_row(
                ctx, rec, pool, "last stack without StepProfiler", bare, last_wall, fpt, peak
            )
    finally:
        pool.close()
    _finish_speed(rec)


def _timed_row(
    ctx: Ctx,
    rec: Recorder,
    pool: RunPool,
    name: str,
    spec: dict[str, Any],
    last_wall: float | None,
    fpt: int,
    peak: float | None,
) -> tuple[dict[str, Any] | None, float | None]:
    need = 1.2 * last_wall if last_wall else 20.0
    if ctx.left() < need:
        basis = f"the last row took {last_wall:.0f} s" if last_wall else "a first guess"
        rec.row(variant=name, **time_skip(ctx.left(), need, basis))
        return None, last_wall
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=ctx.cuda)])[0]
    row: dict[str, Any] = {
        "variant": name,
        "precision": res.get("precision", spec["precision"]),
        "micro_batch": spec["batch"],
        "accumulate": spec["accumulate"],
        "status": _status(res),
        "tokens_per_s": res.get("tokens_per_s"),
        "step_s": res.get("step_s"),
        "timed_steps": res.get("timed_steps"),
        "first_step_s": res.get("first_step_s"),
        "loss": res.get("loss"),
        "report": res.get("report"),
    }
    if peak and res.get("tokens_per_s"):
        row["mfu"] = res["tokens_per_s"] * fpt / peak
    compiled = (res.get("figures") or {}).get("TorchCompile") or {}
    if compiled:
        row["compile"] = {
            k: compiled.get(k)
            for k in (
                "scope",
                "regional_step_s",
                "whole_step_s",
                "regional_compile_s",
                "whole_compile_s",
                "compile_s",
            )
        }
    profile = res.get("profile") or {}
    if profile:
        advice = profile.get("advice") or []
        row["verdict"] = advice[0] if advice else None
        row["levers"] = [a.get("lever") for a in advice]
    rec.row(**row)
    return res, res.get("wall_s") or last_wall


def _finish_speed(rec: Recorder) -> None:
    rows = rec.data["rows"]
    plain = next(
        (r for r in rows if r["variant"].startswith("plain") and r.get("tokens_per_s")), None
    )
    for r in rows:
        if plain and r.get("tokens_per_s"):
            r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    timed = [
        r
        for r in rows
        if r.get("tokens_per_s") and r["status"] == "ok" and not r["variant"].startswith("last")
    ]
    bare = next((r for r in rows if r["variant"].startswith("last") and r.get("step_s")), None)
    if bare and timed and timed[-1].get("step_s"):
        overhead = timed[-1]["step_s"] / bare["step_s"]
        rec.figure(profiler_overhead=overhead, profiler_overhead_row=timed[-1]["variant"])
        bare["profiler_overhead"] = overhead
    rec.save()
    if plain and len(timed) > 1:
        best = max(timed, key=lambda r: r["tokens_per_s"])
        rec.figure(speedup=best["tokens_per_s"] / plain["tokens_per_s"], best=best["variant"])
        mfu = (
            f", MFU {plain['mfu']:.1%} -> {best['mfu']:.1%}"
            if plain.get("mfu") and best.get("mfu")
            else ""
        )
        over = rec.data["figures"].get("profiler_overhead")
        prof = f"; StepProfiler {over:.3f}x" if over else ""
        rec.finish(
            f"tokens/s {plain['tokens_per_s']:,.0f} -> {best['tokens_per_s']:,.0f} "
            f"({best['tokens_per_s'] / plain['tokens_per_s']:.2f}x, {best['variant']}){mfu}{prof}"
        )
    else:
        rec.finish("the ablation did not measure the plain run and a lever")


# -- part 6: compile -----------------------------------------------------------------------------
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
        f"{p['compile_repeats']} (measure.timing.time_fn). One process, variants in this order. "
        "The auto choice: TorchCompile(scope='auto')'s rule (choose_scope) on these figures."
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
