"""Part 5 of ``benchmarks/gpu/suite.py``: speed, one lever at a time.

An ablation (issue 29) on TinyGPT at GPT-2 124M shape, micro-batch 8 x 1024: each row adds one
lever of the package to the row before it, as Lightning runs it, and records tokens/s, step
time, MFU (the device's dense bf16 peak from the package's ``measure.speed.flops`` table), the ratio
to the plain run, the verdict ``StepProfiler`` gives on that row (the next lever, its yaml and
expected gain), and for the compile row what ``TorchCompile(scope="auto")`` measured and chose.
The effective batch is 16 sequences in every row (2 accumulated micro-batches of 8), so the
larger micro-batch row (16, no accumulation) keeps the maths. Then the profiler's own cost: the
ablation's last stack without ``StepProfiler``, against the same stack with it (start-to-start:
the synchronised wall time of the timed steps, every hook included).

Last, packing (issue 52; its goal is in ``markdown.GOALS``): the workload of
``benchmarks/packing.py`` (``workloads.py``: long-tail paragraphs as byte tokens, a Hugging Face
Llama, here at the profile's size), padded batches against ``SequencePacking``'s rows, each a
Lightning run in a fresh process on CUDA; tokens/s counts the documents' own tokens (padding left
out). The ablation keeps the pair's time (the profile's ``packing.need_s``) out of its own.

Last, where the part's time is left, the optional rows (``OPTIONAL``: CUDA graphs, on the
ablation's last stack): every figure issue 52 names comes first, so the part's cap cuts these.

Run by the suite as ``python -m benchmarks.gpu.speed --ctx FILE``.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.gpu.common import (
    Ctx,
    Recorder,
    bf16_peak,
    child_main,
    describe,
    flops_per_token,
    gpt2_dims,
    pos_params,
    time_skip,
    unique_params,
)
from benchmarks.gpu.run import RunPool, run_status, timed_fields
from benchmarks.workloads import ROW, SEED, build_model

__all__ = ["ABLATION", "OPTIONAL", "part_speed"]

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
]
#: Rows that go on from the ablation's last stack where the part's time is left, after every
#: figure issue 52 names (the ablation, the profiler's cost, the packing pair).
OPTIONAL = [("+ CUDA graphs", {"compile_mode": "reduce-overhead"})]
PROFILER = {"class_path": "StepProfiler", "init_args": {"print_table": False}}


def _rows_specs(ctx: Ctx, dims: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each row's run spec, the levers accumulated row by row."""
    p = ctx.profile
    micro, accumulate = p["speed_batch"], p["speed_accumulate"]
    precision, callbacks, compile_args = "32-true", [], None
    out = []
    for name, lever in ABLATION + OPTIONAL:
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
        "row in a fresh process. The profiler's cost: the ablation's last row again without "
        "StepProfiler. In this order: the ablation, the profiler's cost, the packing pair, then "
        "the optional rows (" + ", ".join(n for n, _ in OPTIONAL) + "), each only where the "
        "part's time is left: a row skipped says so, with what it would have needed."
    )
    peak, source = bf16_peak(ctx.device_name) if ctx.cuda else (None, "")
    if ctx.cuda and peak is None:
        rec.note(f"{source}: MFU not computed")
    model = build_model("tinygpt", dims, "meta")
    fpt = flops_per_token(
        unique_params(model), pos_params(model), dims["n_layer"], dims["n_embd"], seq
    )
    rec.figure(flops_per_token=fpt, peak_bf16_flops=peak, peak_source=source)
    pool = RunPool(ctx, warm=1 if ctx.cuda else 0)
    last_wall: float | None = None
    specs = _rows_specs(ctx, dims)
    final: tuple[str, dict[str, Any]] | None = None
    keep = p["packing"]["need_s"]  # the packing rows' time, after the ablation's
    try:
        for name, spec in specs[: len(ABLATION)]:
            res, last_wall = _timed_row(ctx, rec, pool, name, spec, last_wall, fpt, peak, keep)
            if res is not None and res.get("ok") and res.get("tokens_per_s"):
                final = name, spec  # the overhead pair runs the last stack that trained
            chosen = ((res or {}).get("figures") or {}).get("TorchCompile", {}).get("scope")
            if chosen in ("regional", "whole"):  # later rows compile what auto chose here
                for _, later in specs:
                    for c in later["callbacks"]:
                        if c.get("class_path") == "TorchCompile":
                            c["init_args"]["scope"] = chosen
        if final is not None:
            of, spec = final
            bare = {**spec, "callbacks": [c for c in spec["callbacks"] if c is not PROFILER]}
            name = f"{of} without StepProfiler"
            _timed_row(ctx, rec, pool, name, bare, last_wall, fpt, peak, keep, of=of)
        for name, spec in _packing_specs(ctx):
            _packing_row(ctx, rec, pool, name, spec)
        for name, spec in specs[len(ABLATION) :]:  # where time is left
            if not ctx.cuda:
                rec.row(variant=name, status="skipped: CUDA graphs need a CUDA device")
                continue
            _timed_row(ctx, rec, pool, name, spec, last_wall, fpt, peak, optional=True)
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
    keep: float = 0.0,
    of: str | None = None,
    optional: bool = False,
) -> tuple[dict[str, Any] | None, float | None]:
    """One row of the ablation, unless less than it needs is left (``keep`` s kept for later);
    ``of``: the row whose stack this one runs without ``StepProfiler`` (the profiler's cost);
    ``optional``: a row run after every figure issue 52 names, where time is left. A row needs
    1.2x the last row's time (a new lever), the profiler's cost 1x (the same stack again)."""
    need = (1.0 if of else 1.2) * last_wall if last_wall else 20.0
    if ctx.left() - keep < need:
        basis = f"the last row took {last_wall:.0f} s" if last_wall else "a first guess"
        basis += f"; {keep:.0f} s kept for the packing rows" if keep else ""
        basis += "; optional, run last: only where time is left" if optional else ""
        rec.row(variant=name, **time_skip(ctx.left() - keep, need, basis))
        return None, last_wall
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=ctx.cuda)])[0]
    row: dict[str, Any] = {
        "variant": name,
        "precision": res.get("precision", spec["precision"]),
        "micro_batch": spec["batch"],
        "accumulate": spec["accumulate"],
        "status": run_status(res),
        **timed_fields(res),
        **({"without_profiler_of": of} if of else {}),
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


def _packing_specs(ctx: Ctx) -> list[tuple[str, dict[str, Any]]]:
    """The packing pair: padded batches of ``rows`` documents, then ``SequencePacking``'s
    rows of ``ROW`` tokens, ``rows`` a batch (at most as many slots a step as padded)."""
    k = ctx.profile["packing"]
    base = {
        "model": "llama_docs",
        "dims": {key: k[key] for key in ("n_layer", "n_embd", "n_head", "n_kv_head")},
        "data": "documents",
        "documents": k["documents"],
        "batch": k["rows"],
        "steps": k["steps"],
        "precision": k["precision"],
        "device": ctx.device,
        "measure_memory": False,
        "seed": SEED,
        "timing": {"warmup": k["warmup"], "window_s": k["window_s"]},
    }
    packer = {"class_path": "SequencePacking", "init_args": {"row_length": ROW, "seed": SEED}}
    return [
        (f"padded batches of {k['rows']} documents", {**base, "callbacks": []}),
        (f"SequencePacking: {k['rows']} rows of {ROW} tokens", {**base, "callbacks": [packer]}),
    ]


def _packing_row(ctx: Ctx, rec: Recorder, pool: RunPool, name: str, spec: dict[str, Any]) -> None:
    """One run of the packing pair (``table: "packing"``: not a row of the ablation)."""
    need = ctx.profile["packing"]["need_s"] / 2
    if ctx.left() < need:
        basis = f"half the {2 * need:.0f} s kept for the pair"
        rec.row(table="packing", variant=name, **time_skip(ctx.left(), need, basis))
        return
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=ctx.cuda)])[0]
    packed = (res.get("figures") or {}).get("SequencePacking") or {}
    rec.row(
        table="packing",
        variant=name,
        loader="packed" if spec["callbacks"] else "padded",
        precision=res.get("precision", spec["precision"]),
        batch=spec["batch"],
        status=run_status(res),
        fill=res.get("fill"),
        packing={k: packed.get(k) for k in ("fill", "padded_fill", "path", "rows", "check_error")}
        if packed
        else None,
        **timed_fields(res),
    )


def _finish_packing(rec: Recorder) -> str:
    """The pair's ratio (figure ``packing_speedup``) and its clause of the headline."""
    pair = {r.get("loader"): r for r in rec.data["rows"] if r.get("table") == "packing"}
    padded, packed = pair.get("padded") or {}, pair.get("packed") or {}
    if not (padded.get("tokens_per_s") and packed.get("tokens_per_s")):
        return ""
    ratio = packed["tokens_per_s"] / padded["tokens_per_s"]
    packed["vs_padded"] = ratio
    rec.figure(packing_speedup=ratio)
    return f"; packing {ratio:.2f}x the tokens/s of padded batches"


def _finish_speed(rec: Recorder) -> None:
    packing = _finish_packing(rec)
    rows = [r for r in rec.data["rows"] if r.get("table") != "packing"]  # the ablation's
    plain = next(
        (r for r in rows if r["variant"].startswith("plain") and r.get("tokens_per_s")), None
    )
    for r in rows:
        if plain and r.get("tokens_per_s"):
            r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    timed = [
        r
        for r in rows
        if r.get("tokens_per_s") and r["status"] == "ok" and "without_profiler_of" not in r
    ]
    bare = next((r for r in rows if r.get("without_profiler_of") and r.get("step_s")), None)
    of = next((r for r in timed if bare and r["variant"] == bare["without_profiler_of"]), None)
    if bare and of and of.get("step_s"):
        overhead = of["step_s"] / bare["step_s"]
        rec.figure(profiler_overhead=overhead, profiler_overhead_row=of["variant"])
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
            + packing
        )
    else:
        rec.finish("the ablation did not measure the plain run and a lever" + packing)


if __name__ == "__main__":
    sys.exit(child_main(part_speed))
