"""Write docs/index.md and the charts: every technique with what it saves and what it costs.

The figures are read from ``benchmarks/results/*.json`` (never typed by hand); each row names its
results file, and the page links the method cards and the tutorials. The README's and the cards'
charts (``docs/img/*.svg``) are drawn from the same files by ``benchmarks/site/charts.py``.
``tests/project/test_docs.py`` and ``tests/project/test_charts.py`` check that the committed page
and charts are what this script writes now, so re-run it after a benchmark:

    python -m benchmarks.site.make_index            # writes docs/index.md and docs/img/*.svg
    python -m benchmarks.site.make_index --check    # exit 1 when either is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "docs" / "index.md"

__all__ = ["ENTRIES", "Entry", "render", "main"]

TUTORIALS = {
    "01_quickstart": "estimate, plan, fit, the efficiency report and the profiler's verdict",
    "02_fit_a_bigger_model": "every stack estimated at growing sizes against a budget; the plan, fitted",
    "03_speed": "precision, compile (regional vs whole), data loading: step time by phase",
    "04_fewer_steps": "early stopping, divergence guard, sequence-length warmup, curriculum",
    "05_cli_and_scale_out": "one yaml from the command line, on one device and under DDP",
    "06_packing": "padded against packed fill on Python's own text; a packed Llama fit",
    "07_finetuning": "LoRA vs QLoRA (4-bit frozen weights) on a tiny Llama; the estimate with and without the key/value cache",
}


def load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(ratio: float) -> str:
    """A ratio to 1 as a signed percentage: 0.32 -> '-68%'."""
    return f"{ratio - 1:+.0%}"


def row(rows: list[dict], **match: Any) -> dict:
    return next(r for r in rows if all(r.get(k) == v for k, v in match.items()))


def _checkpointing() -> tuple[str, str]:
    rows = load("activation_checkpointing")["rows"]
    real = [r for r in rows if "(CPU, real)" in r["workload"]]
    gpt2 = [r for r in rows if "GPT-2" in r["workload"]]
    full, gfull = row(real, mode="full"), row(gpt2, mode="full")
    return (
        f"peak {pct(full['peak_ratio'])} ({full['workload']}); "
        f"{pct(gfull['peak_ratio'])} on GPT-2 small, seq 1024, batch 8 (estimate)",
        f"step time {pct(full['time_ratio'])} (full), "
        f"{pct(row(real, mode=next(r['mode'] for r in real if r['mode'].startswith('budget')))['time_ratio'])}"
        " with a budget (fewest blocks)",
    )


def _chunked_loss() -> tuple[str, str]:
    data = load("chunked_loss")
    phase = {r["vocab"]: r for r in data["loss_phase"]}
    before, after = (r["largest_micro_batch"] for r in data["largest_batch"]["rows"])
    step = data["step_time"][0]
    lower = ", ".join(
        f"{r['ratio_tracked']:.1f}x lower at vocabulary {v:,}" for v, r in sorted(phase.items())
    )
    return (
        f"loss-phase peak {lower} ({phase[min(phase)]['rows']} rows, fp32, CPU); GPT-2 small in "
        f"24 GiB, bf16-mixed + 8-bit AdamW + checkpointing: micro-batch {before} -> {after} "
        "(CUDA estimate)",
        f"none in maths; step time {pct(step['wall_ratio'])} wall, {pct(step['cpu_ratio'])} CPU "
        "time (GPT-2 shape, CPU)",
    )


def _quantize() -> tuple[str, str]:
    rows = load("finetune")["llama3_8b_lora"]
    plain, qlora = rows[0]["peak_bytes"], rows[-1]["peak_bytes"]
    return (
        f"Llama-3-8B shape, LoRA r=16, seq 2048, micro-batch 1: peak {plain / 2**30:.1f} -> "
        f"{qlora / 2**30:.1f} GiB with checkpointing and the chunked loss (CUDA estimate)",
        "lossy: NF4 weights (tiny configs: losses within 2% of the bf16/fp32 LoRA run); "
        "dequantized per layer in forward and backward",
    )


def _optimizers() -> tuple[str, str]:
    data = load("optimizers")
    r = row(data["memory_and_time"], optimizer="adamw8bit")
    conv = row(data["convergence"], run="adamw8bit")
    saves, costs = _bf16_weights()
    return (
        f"adamw8bit: optimizer state {pct(r['optimizer_state_ratio'])}, peak "
        f"{pct(r['peak_ratio'])} (TinyGPT 4x128, CPU); {saves}",
        f"step time {pct(r['step_time_ratio'])} on a CPU; validation loss "
        f"{pct(conv['val_loss_ratio'])} vs AdamW after {conv['steps']} steps; {costs}",
    )


def _bf16_weights() -> tuple[str, str]:
    """OptimizerSwap's bf16-weights names (benchmarks/results/bf16_weights.json)."""
    data = load("bf16_weights")
    mem = {r["form"]: r for r in data["memory"]}
    keys = ("adamw_kahan", "adamw_sr", "adamw8bit_sr", "nearest rounding")
    worst = {
        k: max(r["loss_vs_reference"] for r in data["quality"] if k in r["form"]) for k in keys
    }
    ref = next(iter(mem.values()))["bytes_per_parameter"]
    sr8 = next(r for f, r in mem.items() if "adamw8bit_sr" in f)["bytes_per_parameter"]
    return (
        f"bf16 weights + adamw8bit_sr: {sr8:.1f} B/parameter (weights, gradients, states) vs "
        f"{ref:.1f} with fp32 masters (TinyGPT, CPU)",
        f"bf16 weights, held-out loss vs fp32 masters at most {worst['adamw_kahan']:+.2%} (Kahan), "
        f"{worst['adamw_sr']:+.2%} (SR), {worst['adamw8bit_sr']:+.2%} (SR 8-bit); plain bf16 "
        f"AdamW {worst['nearest rounding']:+.2%} (bf16_weights.json)",
    )


def _precision() -> tuple[str, str]:
    rows = load("precision")["rows"]
    r = row(rows, precision="bf16-mixed")
    return (
        f"`precision: auto` (bf16-mixed here): peak {pct(r['memory_vs_fp32'])}, "
        f"{r['speed_vs_fp32']:.2f}x fp32 speed (TinyGPT 2x64, CPU with AVX512); TF32 itself "
        "needs an Ampere+ GPU (no figure yet)",
        f"validation loss {r['val_loss_vs_fp32']:+.1e} vs fp32 (relative)",
    )


def _compile() -> tuple[str, str]:
    rows = load("compile")["rows"]
    reg, whole = row(rows, variant="regional"), row(rows, variant="whole")
    return (
        f"steady step {reg['steady_speed_vs_eager']:.2f}x eager (regional), "
        f"{whole['steady_speed_vs_eager']:.2f}x (whole model); TinyGPT 6x128, CPU, inductor",
        f"compile {reg['compile_s']:.1f} s (regional) vs {whole['compile_s']:.1f} s (whole) "
        "before the first step",
    )


def _batch_size() -> tuple[str, str]:
    rows = load("batch_size")["gpt2"]["rows"]
    fp32 = row(rows, run="fp32")
    best = max(rows, key=lambda r: r["largest_micro_batch"])
    return (
        f"largest micro-batch in 24 GiB, GPT-2 small: {fp32['largest_micro_batch']} (fp32) -> "
        f"{best['largest_micro_batch']} ({best['run']}) (estimate)",
        "a few estimates before the fit (about "
        f"{fp32['search_s']:.0f} s for GPT-2 small on a CPU); accumulation keeps the effective batch",
    )


def _auto() -> tuple[str, str]:
    rows = load("auto")["rows"]
    speed = row(rows, effective_batch=64, goal="speed")
    return (
        f"GPT-2 small, 24 GiB, effective batch 64: {speed['stack']} at micro-batch "
        f"{speed['micro_batch']} x {speed['accumulation']} (estimate, CUDA target)",
        f"the decision: {speed['seconds']:.0f} s on a CPU ({speed['estimates']} estimates), plus two "
        "real steps per tried size on the GPU",
    )


def _oom() -> tuple[str, str]:
    return ("a run that hits out-of-memory halves the micro-batch and goes on", "no figure yet")


def _zero() -> tuple[str, str]:
    data = load("zero_offload")
    plain = row(data["ladder"], setting="plain Lightning")
    best = max(data["ladder"], key=lambda r: r["largest_parameters"])
    stage2 = row(data["tinygpt"], setting="ZeROOffload stage 2 (optimizer on CPU)")
    return (
        f"largest GPT-2 in {data['cap']}: {plain['largest']} (plain) -> {best['largest']} "
        f"({best['setting']}) (estimate); TinyGPT device peak {pct(stage2['device_peak_ratio'])} "
        "(stage 2)",
        "optimizer step on the host, PCIe traffic every step; needs DeepSpeed "
        f"(host memory {stage2['host_bytes'] / 2**20:.1f} MiB for TinyGPT, stage 2)",
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _fsdp() -> tuple[str, str]:
    data = load("scale_out")
    rows = data["gpt2_small"]
    one = row(rows, strategy="one device")
    most = max(r["ranks"] for r in rows)
    fsdp = row(rows, strategy="FSDP (full shard)", ranks=most)
    measured = data["measured"]
    return (
        f"model state per rank {_mib(fsdp['parameters_bytes'] + fsdp['gradients_bytes'] + fsdp['optimizer_state_bytes'])} "
        f"vs {_mib(one['parameters_bytes'] + one['optimizer_state_bytes'])} on one device at {most} "
        f"ranks (GPT-2 small, estimate); peak {pct(fsdp['vs_one_device'])} (activations dominate)",
        f"an all-gather per block each forward and backward; per-rank estimate within "
        f"{max(abs(r['gap']) for r in measured['runs']):.2%} of real 2-process CPU runs "
        f"({len(measured['runs'])} runs: 2 sizes, full and grad-op)",
    )


def _data() -> tuple[str, str]:
    data = load("data_pipeline")
    plain = data["throughput"][0]
    tuned = max(
        (r for r in data["throughput"] if r["loading"].startswith("DataLoaderTuning")),
        key=lambda r: r["vs_plain"],
    )
    return (
        f"{tuned['vs_plain']:.2f}x samples/s ({tuned['loading']}), input stall "
        f"{plain['stall_fraction']:.0%} -> {tuned['stall_fraction']:.0%} (2 ms decode per sample, CPU)",
        "worker processes (memory, start-up); `auto` measures a few worker counts first",
    )


def _preload() -> tuple[str, str]:
    rows = load("data_pipeline")["input_bound"]
    pre = next((r for r in rows if "DevicePreload" in r["loading"]), None)
    if pre is None:
        return ("no input stall at all once the dataset is in device memory", "no figure yet")
    return (
        f"{pre['vs_plain']:.2f}x samples/s on an input-bound loader ({pre['loading']})",
        "the whole dataset in device memory",
    )


def _buckets() -> str:
    p = load("data_pipeline")["padding"]
    return (
        f"LengthBucketSampler: padding {p['plain_padding_fraction']:.0%} -> "
        f"{p['bucketed_padding_fraction']:.0%}, {p['tokens_saved_fraction']:.0%} fewer tokens"
    )


def _long_context() -> str:
    data = load("long_context")
    rows = {(r["stack"], r["budget_gib"]): r["longest_tokens"] for r in data["longest"]}
    gib = data["goal"]["budget_gib"]
    today, new = rows[("today", gib)], rows[("long context", gib)]
    return (
        f"`ActivationCheckpointing(offload_boundaries=True, tile_sequence=True)`: QLoRA on a "
        f"Llama-3-8B shape fits {new:,} tokens in {gib} GiB (today's stack {today:,}), "
        "estimated for a CUDA target ([long_context.md](long_context.md), "
        "`benchmarks/results/long_context.json`)"
    )


def _stall() -> tuple[str, str]:
    plain = load("data_pipeline")["throughput"][0]
    return (
        f"names the stall and the fix (measured {plain['stall_fraction']:.0%} of a step waiting "
        "for data on the benchmark's plain loader)",
        "a timer per step; nothing per step in the logs",
    )


def _memory() -> tuple[str, str]:
    acc = load("estimate_speed")["accuracy"]
    worst = max(abs(r["ratio"] - 1) for r in acc)
    return (
        "memory of a real step by category; the estimate it checks is within "
        f"{worst:.1%} of it ({len(acc)} runs of the benchmark)",
        "a storage tracker on sampled steps (CPU) or allocator statistics (CUDA)",
    )


def _profiler() -> tuple[str, str]:
    data = load("profiler")
    return (
        f"where a step's time goes and the verdict; {len(data['verdicts'])} verdict cases "
        "in the benchmark",
        f"step {data['overhead']['ratio']['StepProfiler()']:.3f}x with it start-to-start, an "
        f"empty Callback {data['overhead']['ratio']['empty Callback']:.3f}x (median of "
        f"{data['overhead']['rounds']} interleaved rounds, shared CPU); its own work "
        f"{data['overhead']['own_work']['per_step_s'] * 1e6:.0f} us per step",
    )


def _curriculum(variant: str, label: str = "") -> tuple[str, str]:
    data = load("curriculum")
    plain, r = row(data["rows"], variant="plain"), row(data["rows"], variant=variant)

    def mean(xs: list) -> str:
        got = [x for x in xs if x is not None]
        return f"{sum(got) / len(got):.0f}" if got else "-"

    reached = sum(x is not None for x in r["steps_to_target"])
    return (
        f"{label}steps to the target perplexity {mean(r['steps_to_target'])} vs "
        f"{mean(plain['steps_to_target'])} plain (mean over the seeds that reached it); tokens "
        f"{pct(r['tokens'] / plain['tokens'])}",
        f"reached the target in {reached} of {len(r['steps_to_target'])} seeds "
        f"({data['meta']['model']})",
    )


def _packing() -> tuple[str, str]:
    data = load("packing")
    padded, packed = data["runs"]["padded"], data["runs"]["packed"]
    return (
        f"{data['ratio_tokens_per_s']:.2f}x tokens/s at the same slots per step; fill "
        f"{padded['fill']:.1%} -> {packed['fill']:.1%} (Llama, long-tail paragraphs, CPU)",
        "documents must be kept apart: HF models or F.scaled_dot_product_attention; "
        "checked before training",
    )


def _accumulation() -> tuple[str, str]:
    data = load("accumulation")
    errors = {k: sum(v) / len(v) for k, v in data["errors"].items()}
    plain = errors["length-bucketed/Lightning (plain)"]
    exact = errors["length-bucketed/ExactAccumulation"]
    return (
        f"update error of 4 x 4 accumulation {plain:.2f} -> {exact:.1e} (length-bucketed pydoc "
        "paragraphs, token-mean loss)",
        f"step time {pct(data['cost'])} (CPU); a few no-gradient forwards on the first batch",
    )


def _early() -> tuple[str, str]:
    plateau = load("early_stopping")["plateau"]
    r = row(plateau["replays"], setting=plateau["chosen"])
    return (
        f"{r['steps_saved_fraction']:.0%} of the steps saved ({plateau['chosen']}); best "
        f"perplexity {pct(1 + r['ppl_vs_full_best'])} vs the full run's best",
        "a validation check every few steps; a host copy of the best weights",
    )


def _guard() -> tuple[str, str]:
    rows = load("early_stopping")["divergence"]["rows"]
    skip = next(r for r in rows if r["guard"] == "skip" and "NaN" in r["fault"])
    clean = row(rows, fault="clean", guard="none")
    guarded = next(r for r in rows if r["fault"] == "clean" and r["guard"] != "none")
    return (
        f"a NaN at step 40: final loss NaN without it, {skip['val_loss']:.3f} with `skip` "
        f"(clean run {clean['val_loss']:.3f})",
        f"fit wall time {pct(guarded['wall_s'] / clean['wall_s'])} with rollback snapshots "
        "(shared CPU)",
    )


@dataclass
class Entry:
    """One technique: its card, the tutorials that show it, and where its figures come from."""

    name: str
    card: str
    tutorials: tuple[str, ...]
    results: str
    figures: Callable[[], tuple[str, str]]


ENTRIES = [
    Entry(
        "MemoryBreakdown",
        "memory",
        ("01_quickstart", "02_fit_a_bigger_model"),
        "estimate_speed",
        _memory,
    ),
    Entry("StepProfiler", "profiling", ("01_quickstart", "03_speed"), "profiler", _profiler),
    Entry(
        "ActivationCheckpointing",
        "activation_checkpointing",
        ("01_quickstart", "02_fit_a_bigger_model"),
        "activation_checkpointing",
        _checkpointing,
    ),
    Entry(
        "ChunkedCrossEntropy",
        "chunked_loss",
        ("02_fit_a_bigger_model",),
        "chunked_loss",
        _chunked_loss,
    ),
    Entry("OptimizerSwap", "optimizers", ("02_fit_a_bigger_model",), "optimizers", _optimizers),
    Entry("FrozenWeights4bit", "quantize", ("07_finetuning",), "finetune", _quantize),
    Entry("MatmulPrecision", "precision", ("03_speed",), "precision", _precision),
    Entry(
        "Float8Training",
        "precision",
        (),
        "precision",
        lambda: ("FP8 matmuls (torchao) on H100-class GPUs", "no figure yet: needs a GPU with FP8"),
    ),
    Entry("TorchCompile", "compile", ("03_speed",), "compile", _compile),
    Entry("EfficientBatchSize", "batch_size", (), "batch_size", _batch_size),
    Entry("OOMRecovery", "batch_size", (), "batch_size", _oom),
    Entry("ExactAccumulation", "accumulation", (), "accumulation", _accumulation),
    Entry("DataLoaderTuning", "dataloading", ("03_speed",), "data_pipeline", _data),
    Entry("DevicePreload", "dataloading", (), "data_pipeline", _preload),
    Entry("InputStallMonitor", "dataloading", ("01_quickstart",), "data_pipeline", _stall),
    Entry(
        "Curriculum",
        "curriculum",
        ("04_fewer_steps",),
        "curriculum",
        lambda: _curriculum("curriculum"),
    ),
    Entry(
        "SequenceLengthWarmup",
        "curriculum",
        ("04_fewer_steps",),
        "curriculum",
        lambda: _curriculum("warmup-reshape", "reshape mode: "),
    ),
    Entry("SequencePacking", "packing", ("06_packing",), "packing", _packing),
    Entry("ZeROOffload", "zero_offload", ("02_fit_a_bigger_model",), "zero_offload", _zero),
    Entry("FullyShardedStrategy", "fsdp", ("05_cli_and_scale_out",), "scale_out", _fsdp),
    Entry("EarlyStopper", "early_stopping", ("04_fewer_steps",), "early_stopping", _early),
    Entry("DivergenceGuard", "early_stopping", ("04_fewer_steps",), "early_stopping", _guard),
    Entry("AutoEfficient", "auto", ("01_quickstart",), "auto", _auto),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The page, from the registry and the results files."""
    from lightning_efficient import TECHNIQUES

    names = [e.name for e in ENTRIES]
    if names != [t.__name__ for t in TECHNIQUES]:
        raise ValueError(
            f"ENTRIES {names} do not follow TECHNIQUES {[t.__name__ for t in TECHNIQUES]}"
        )
    lines = [
        "# Techniques and tutorials",
        "",
        "<!-- generated by `python -m benchmarks.site.make_index` from benchmarks/results/*.json; "
        "do not edit by hand -->",
        "",
        "Every technique of `lightning_efficient.TECHNIQUES`, with what it saves and "
        "what it costs as measured by the benchmark named in the last column (the hardware and "
        "versions are in that results file; on a CPU unless it says GPU). The method card says "
        "when to use it, what it conflicts with and how to configure it.",
        "",
        "| Technique | Saves | Costs | Card | Tutorials | Figures from |",
        "|---|---|---|---|---|---|",
    ]
    for e in ENTRIES:
        saves, costs = e.figures()
        tutorials = ", ".join(f"[{t[:2]}](../notebooks/{t}.ipynb)" for t in e.tutorials) or "-"
        lines.append(
            f"| `{e.name}` | {_cell(saves)} | {_cell(costs)} | [{e.card}.md]({e.card}.md) | "
            f"{tutorials} | [`{e.results}.json`](../benchmarks/results/{e.results}.json) |"
        )
    lines += [
        "",
        f"Also in `docs/dataloading.md`: {_buckets()} (`benchmarks/results/data_pipeline.json`).",
        "",
        f"Long context: {_long_context()}.",
        "",
        "## Tutorials",
        "",
        "Each runs on a CPU; the tests run them in a short mode, and the full mode saves the "
        "charts as PNG files.",
        "",
    ]
    lines += [f"- [`{t}`](../notebooks/{t}.ipynb): {what}" for t, what in TUTORIALS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when docs/index.md or a chart is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    from benchmarks.site import charts  # matplotlib: only here, not for render()

    if args.check:
        stale = not INDEX.exists() or INDEX.read_text() != text
        stale_charts = charts.stale_charts()
        if stale:
            print("docs/index.md is stale: run python -m benchmarks.site.make_index")
        if stale_charts:
            print(
                f"charts stale or missing: {stale_charts}: run python -m benchmarks.site.make_index"
            )
        print("ok" if not (stale or stale_charts) else "")
        return int(stale or bool(stale_charts))
    INDEX.write_text(text)
    print(f"wrote {INDEX.relative_to(ROOT)}")
    for path in charts.write_charts():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
