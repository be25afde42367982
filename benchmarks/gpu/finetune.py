"""Part 7 of ``benchmarks/gpu/suite.py``: fine-tuning, LoRA against the QLoRA stack (issue 39).

A Llama shape smaller than ``benchmarks/finetune.py``'s Llama-3-8B estimate (on CUDA: the
Llama-3.2-1B block shape, hidden 2048, intermediate 8192, GQA 32/8 heads, vocabulary 128,256,
at 8 of its 16 layers; bf16 weights, default config) with PEFT LoRA r=16 on every linear layer
of the blocks, sequence 2048, micro-batch 1, bf16-mixed, AdamW on the adapters. Three rows, each
a real Lightning run in a fresh process: LoRA alone, LoRA + ``FrozenWeights4bit`` +
``ActivationCheckpointing`` + ``ChunkedCrossEntropy``, and that stack with the checkpointed
blocks' inputs in host memory and tiled MLPs and norms at a long sequence (``long_seq``, 16,384
tokens; issue 53: its estimate against the real peak, and its host copies on the side stream). Each row records the real peak (the
package's ``PeakMemory``: ``torch.cuda.max_memory_allocated``), the package's estimate of the
same stack for this device (``estimate_memory``, fake tensors; on CUDA computed in a thread of
the part's process while the runs train in their own, on the CPU after them) and their ratio, and tokens/s over the steps after the
warm-up (synchronised wall time). On CUDA the peak is the training steps' own (the estimate
models 2 steps); the peak before the first step is recorded beside it: the model moved to the
device in bf16 and, for the stack, its frozen weights quantized there, layer by layer.

Where time is left (issue 52, item 3; the part's ``spare_s`` in ``registry``): the QLoRA
stack again with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which the allocator reads
when CUDA starts, so in processes of its own (a ``RunPool`` with that environment; also on the
CPU, where it changes nothing, so the dry run checks that the setting reaches the run): its
reserved bytes against the default allocator's on the same stack (peers report -34% reserved for
QLoRA, torchtune #1185).

Without peft (or its accelerate) the rows say ``skipped: peft not installed``; without
bitsandbytes the QLoRA row says so. Run by the suite as ``python -m benchmarks.gpu.finetune
--ctx FILE``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from benchmarks._results import fmt_bytes
from benchmarks.gpu.common import (
    AC,
    CHUNKED,
    Ctx,
    Recorder,
    child_main,
    estimate,
    first_line,
    missing_package,
    params_text,
    time_skip,
    unique_params,
)
from benchmarks.gpu.run import RunPool, run_status, timed_fields
from benchmarks.workloads import build_model

__all__ = ["ALLOCATOR", "STACKS", "part_finetune"]

FOUR_BIT = {"class_path": "FrozenWeights4bit", "init_args": {}}
#: Checkpointing with the long-context options (issue 53, docs/long_context.md).
AC_LONG = {
    "class_path": "ActivationCheckpointing",
    "init_args": {"offload_boundaries": True, "tile_sequence": True},
}
#: The long-sequence row: the stack with boundaries in host memory and tiled layers, at the
#: profile's ``long_seq`` tokens (the other rows: ``seq``).
LONG = "QLoRA stack + boundaries in host memory + tiled layers, long sequence"
#: The rows: (stack, the package's techniques).
STACKS: list[tuple[str, list[dict[str, Any]]]] = [
    ("LoRA", []),
    ("LoRA + 4-bit frozen weights + checkpointing + chunked loss", [FOUR_BIT, AC, CHUNKED]),
    (LONG, [FOUR_BIT, AC_LONG, CHUNKED]),
]
#: The index in ``STACKS`` of the QLoRA stack, which the allocator row runs again.
QLORA = 1
#: The allocator row's setting (the QLoRA stack again, where time is left): the environment of
#: its processes.
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def row_dims(name: str, dims: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """The model and sequence of row ``name``: the long row runs ``long_seq`` tokens."""
    return {**dims, "seq": f["long_seq"]} if name == LONG else dims


def _missing_peft() -> str | None:
    """The package missing for the PEFT model (peft, or what it imports), else None."""
    try:
        import peft  # noqa: F401
    except ImportError as err:
        return missing_package(err) or "peft"
    return None


def part_finetune(ctx: Ctx, rec: Recorder) -> None:
    f = ctx.profile["finetune"]
    dims = {k: f[k] for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate")}
    dims.update(vocab=f["vocab"], seq=f["seq"], dtype=f["dtype"], lora_r=f["lora_r"])
    batch, precision = f["batch"], f["precision"]
    shape = (
        f"Llama shape {f['n_layer']} layers x hidden {f['n_embd']} (intermediate "
        f"{f['intermediate']}, GQA {f['n_head']}/{f['n_kv_head']} heads, vocabulary "
        f"{f['vocab']:,}, {f['dtype']} weights), PEFT LoRA r={f['lora_r']} on every linear "
        f"layer of the blocks, micro-batch {batch} x {f['seq']}, {precision}, AdamW on the "
        "adapters, random tokens"
    )
    missing = _missing_peft()
    if missing:
        rec.note(shape + ".")
        for name, _ in STACKS:
            rec.row(stack=name, status=f"skipped: {missing} not installed")
        rec.finish(f"skipped: {missing} not installed")
        return
    model = build_model("llama_lora", dims, "meta")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rec.figure(parameters=unique_params(model), trainable=trainable)
    del model
    rec.note(
        f"{shape}; {params_text(rec.data['figures']['parameters'])} parameters, "
        f"{params_text(trainable)} of them trainable. Each row: a real Lightning run in a fresh "
        "process (on CUDA), its peak by the package's PeakMemory (max_memory_allocated; on "
        "CUDA the training steps' own, the peak before the first step beside it), "
        f"tokens/s over the optimizer steps after {f['warmup']} warm-up steps (synchronised "
        f"wall time, at most {f['window_s']:.0f} s or {f['steps']} steps); the estimate: "
        "estimate_memory of 2 steps of the same stack for this device (fake tensors; on CUDA "
        "computed on the host while the runs train in their own processes). Ratio = estimate "
        "/ measured."
    )
    estimates: dict[str, dict[str, Any]] = {}
    # on CUDA the runs train in their own processes: the estimates are computed meanwhile, in a
    # thread of this one (fake tensors: host work only); on the CPU the runs train here, so the
    # estimates wait for them (the storage tracker must see the run's tensors alone)
    thread = threading.Thread(
        target=_estimate_all, args=(dims, f, ctx.cuda, estimates), name="estimates", daemon=True
    )
    if ctx.cuda:
        thread.start()
    pool = RunPool(ctx, warm=1 if ctx.cuda else 0)
    # the allocator row's processes: the setting in their environment before CUDA starts
    spare = RunPool(ctx, warm=1 if ctx.cuda else 0, env=ALLOCATOR)
    last_wall: float | None = None
    try:
        for name, techniques in STACKS:
            last_wall = _run_row(ctx, rec, pool, name, techniques, dims, last_wall)
        name, techniques = STACKS[QLORA]
        _run_row(ctx, rec, spare, name, techniques, dims, last_wall, allocator=True)
    finally:
        pool.close()
        spare.close()
    if not ctx.cuda:
        thread.start()
    thread.join(max(0.0, ctx.left() - 1))
    for row in rec.data["rows"]:
        row.update(estimates.get(row["stack"]) or {"estimate_error": "not finished in the cap"})
        if row.get("status") == "ok" and row.get("estimate_bytes") and row.get("measured_bytes"):
            row["ratio"] = row["estimate_bytes"] / row["measured_bytes"]
    _finish(rec)


def _estimate_all(
    dims: dict[str, Any], f: dict[str, Any], rounding: bool, out: dict[str, dict[str, Any]]
) -> None:
    """Each stack's estimate for this device (2 steps, fake tensors; ``rounding``: CUDA's
    allocator rounding), into ``out`` by stack as each ends."""
    for name, techniques in STACKS:
        t0 = time.time()
        try:
            shape = row_dims(name, dims, f)
            est = estimate("llama_lora", shape, f["batch"], f["precision"], techniques, rounding)
            out[name] = {
                "estimate_bytes": est.peak_bytes,
                "estimate_reserved_bytes": est.reserved_bytes or None,
                "estimate_target": getattr(est, "target", None),
                "estimate_phase": est.peak_phase,
                "estimate_s": round(time.time() - t0, 1),
            }
        except ImportError as err:
            missing = missing_package(err) or type(err).__name__
            out[name] = {"estimate_error": f"{missing} not installed"}
        except Exception as err:  # the run's figures stand without the estimate
            out[name] = {"estimate_error": f"{type(err).__name__}: {first_line(err)}"}


def _run_row(
    ctx: Ctx,
    rec: Recorder,
    pool: RunPool,
    name: str,
    techniques: list[dict[str, Any]],
    dims: dict[str, Any],
    last_wall: float | None,
    allocator: bool = False,
) -> float | None:
    """One stack's real run; its row is written as soon as the run ends. ``allocator``: the
    row of ``pool``'s allocator setting (``ALLOCATOR``), in a process of its own also on the
    CPU."""
    f = ctx.profile["finetune"]
    need = 1.2 * last_wall if last_wall else 15.0
    setting = {"allocator": ALLOCATOR["PYTORCH_CUDA_ALLOC_CONF"]} if allocator else {}
    if ctx.left() < need:
        basis = f"the last run took {last_wall:.0f} s" if last_wall else "a first guess"
        rec.row(stack=name, **setting, **time_skip(ctx.left(), need, basis))
        return last_wall
    spec = {
        "model": "llama_lora",
        "dims": row_dims(name, dims, f),
        "batch": f["batch"],
        "steps": f["steps"],
        "precision": f["precision"],
        "callbacks": techniques,
        "device": ctx.device,
        "measure_memory": True,
        "setup_peak": True,  # CUDA: the steps' peak apart from the one before them
        "timing": {"warmup": f["warmup"], "window_s": f["window_s"]},
    }
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=ctx.cuda or allocator)])[0]
    rec.row(
        stack=name,
        **setting,
        allocator_conf=res.get("allocator_conf"),  # as the run's process saw it
        expandable_segments=res.get("expandable_segments"),  # CUDA: its segments
        precision=res.get("precision", f["precision"]),
        batch=f["batch"],
        seq=row_dims(name, dims, f)["seq"],
        status=run_status(res),
        measured_bytes=res.get("peak_bytes"),
        reserved_bytes=res.get("reserved_bytes"),
        setup_peak_bytes=res.get("setup_peak_bytes"),
        fit_peak_bytes=res.get("fit_peak_bytes"),
        **timed_fields(res),
    )
    return res.get("wall_s") or last_wall


def _finish_allocator(rec: Recorder) -> str:
    """The allocator row against the same stack's default one: reserved over allocated of
    each, and expandable segments' reserved over the default's (figure
    ``expandable_reserved_ratio``); the headline's clause."""
    rows = rec.data["rows"]
    default = next((r for r in rows if r["stack"] == STACKS[QLORA][0] and "allocator" not in r), {})
    spare = next((r for r in rows if "allocator" in r), {})
    for r in (default, spare):
        if r.get("reserved_bytes") and r.get("measured_bytes"):
            r["reserved_over_allocated"] = r["reserved_bytes"] / r["measured_bytes"]
    if not (default.get("reserved_bytes") and spare.get("reserved_bytes")):
        return ""
    ratio = spare["reserved_vs_default"] = spare["reserved_bytes"] / default["reserved_bytes"]
    rec.figure(expandable_reserved_ratio=ratio)
    return f"; expandable segments: reserved {ratio:.2f}x the default's"


def _finish(rec: Recorder) -> None:
    rows = rec.data["rows"]
    plain, stack = (rows + [{}, {}])[:2]
    for r in rows:
        if plain.get("tokens_per_s") and r.get("tokens_per_s"):
            r["vs_lora"] = r["tokens_per_s"] / plain["tokens_per_s"]
        if plain.get("measured_bytes") and r.get("measured_bytes"):
            r["peak_vs_lora"] = r["measured_bytes"] / plain["measured_bytes"]
    allocator = _finish_allocator(rec)
    rec.save()
    if plain.get("status") == "ok" and stack.get("status") == "ok":
        ratios = ", ".join(f"{r['ratio']:.2f}" for r in rows if r.get("ratio")) or "-"
        setup = stack.get("setup_peak_bytes")
        before = f"; {fmt_bytes(setup)} before its first step" if setup else ""
        rec.finish(
            f"peak {fmt_bytes(plain['measured_bytes'])} -> {fmt_bytes(stack['measured_bytes'])} "
            f"({stack['peak_vs_lora']:.2f}x{before}), tokens/s "
            f"{plain['tokens_per_s']:,.0f} -> {stack['tokens_per_s']:,.0f} "
            f"({stack['vs_lora']:.2f}x); estimate / measured {ratios}{allocator}"
        )
    else:
        rec.finish("the LoRA run and the stack's run did not both train")


if __name__ == "__main__":
    sys.exit(child_main(part_finetune))
