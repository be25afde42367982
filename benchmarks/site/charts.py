"""The charts of the README and the method cards, drawn from ``benchmarks/results/*.json``.

``benchmarks/site/make_index.py`` calls ``write_charts()`` (and ``--check`` calls ``stale_charts()``),
so one command writes ``docs/index.md`` and every ``docs/img/*.svg``;
``tests/project/test_charts.py`` regenerates each chart from its JSON and compares it byte for byte
with the committed file. The SVGs are deterministic: a fixed ``svg.hashsalt``, no date, text kept as
text.

Every chart says in its footer the hardware its figures come from, whether they were measured or
estimated, and the results file it reads. Nothing is typed by hand.
"""

from __future__ import annotations

import io
import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RECORDED = ROOT / "benchmarks" / "recorded"
IMG = ROOT / "docs" / "img"

__all__ = ["CHARTS", "Chart", "render_chart", "stale_charts", "write_charts"]

GIB = 2**30
MIB = 2**20
#: One colour per memory category, the same in every chart.
COLOURS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
    "temporaries": "#8172b3",
    "workspaces": "#937860",
    "other": "#8c8c8c",
    "host": "#b0b0b0",
}
CPU = "x86_64 CPU, 2 cores (shared)"
CUDA = "CUDA sm90 target (H100/H200 class)"


def _load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(width: float = 7.0, height: float = 3.6, ncols: int = 1) -> tuple[Any, Any]:
    """A figure and its panels as ``axes[0][i]``; two panels are stacked one above the other
    (``height`` each, 7 inches wide), so long labels keep their room."""
    plt = _plt()
    with plt.rc_context(_RC):
        if ncols == 1:
            return plt.subplots(1, 1, figsize=(width, height), squeeze=False)
        fig, axes = plt.subplots(ncols, 1, figsize=(7.0, 0.55 * height * ncols + 0.4))
        return fig, [list(axes)]


_RC = {
    "svg.hashsalt": "lightning-efficient",
    "svg.fonttype": "none",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _footer(fig: Any, how: str, source: str) -> None:
    text = textwrap.fill(f"{how} · {source}", 150)
    fig.text(0.01, 0.005, text, fontsize=6.5, color="#555555", ha="left", va="bottom")


def _stacked(
    ax: Any,
    labels: Sequence[str],
    parts: dict[str, Sequence[float]],
    scale: float,
    unit: str,
    *,
    horizontal: bool = True,
) -> None:
    """Stacked bars: one per label, one segment per category (in ``COLOURS`` order)."""
    base = [0.0] * len(labels)
    for cat, values in parts.items():
        vals = [v / scale for v in values]
        if horizontal:
            ax.barh(labels, vals, left=base, color=COLOURS.get(cat), label=cat.replace("_", " "))
        else:
            ax.bar(labels, vals, bottom=base, color=COLOURS.get(cat), label=cat.replace("_", " "))
        base = [b + v for b, v in zip(base, vals)]
    if horizontal:
        ax.invert_yaxis()
        ax.set_xlabel(unit)
    else:
        ax.set_ylabel(unit)
    ax.legend(fontsize=6, framealpha=0.85, loc="best")


def _bars(
    ax: Any,
    labels: Sequence[str],
    values: Sequence[float],
    unit: str,
    fmt: str = "{:.2f}",
    colour: str = "#4c72b0",
    colours: Sequence[str] | None = None,
) -> None:
    """Horizontal bars, each with its value written at its end (``colours``: one per bar)."""
    ax.barh(labels, values, color=colour)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    _totals(ax, values, fmt)
    ax.set_xlim(0, max(values) * 1.2 if values else 1)
    for patch, each in zip(ax.patches, colours or ()):
        patch.set_color(each)


def _totals(ax: Any, values: Sequence[float], fmt: str) -> None:
    """Each horizontal bar's value written at its end (``values`` in the axis' unit)."""
    for i, v in enumerate(values):
        ax.text(v, i, " " + fmt.format(v), va="center", fontsize=7)


def _budget(ax: Any, budget_bytes: float, y: float) -> None:
    """The budget as a dashed vertical line (GiB axis), named at ``y``."""
    ax.axvline(budget_bytes / GIB, color="black", linestyle="--", linewidth=1)
    ax.text(budget_bytes / GIB, y, f" {budget_bytes / GIB:.0f} GiB", fontsize=7)


def _cats(rows: Iterable[dict], keys: Sequence[str], suffix: str = "_bytes") -> dict[str, list]:
    rows = list(rows)
    return {k: [r.get(k + suffix, 0) or 0 for r in rows] for k in keys}


# -- the README ------------------------------------------------------------------------------------
def readme() -> Any:
    data = _load("readme_figure")
    fig, axes = _figure(7.5, 3.8)
    ax = axes[0][0]
    labels, parts = [], {}
    for r in data["rows"]:
        for n in (data["at_batch"], r["largest_micro_batch"]):
            got = r["at"][str(n)]
            labels.append(f"{r['stack']}\nmicro-batch {n}")
            for cat in COLOURS:
                if cat in got["by_category"]:
                    parts.setdefault(cat, [])
            for cat in parts:
                parts[cat].append(got["by_category"].get(cat, 0))
    parts = {k: v + [0] * (len(labels) - len(v)) for k, v in parts.items()}
    _stacked(ax, labels, parts, GIB, "peak GiB (estimated)")
    _budget(ax, data["budget_bytes"], -0.6)
    _totals(ax, [sum(v[i] for v in parts.values()) / GIB for i in range(len(labels))], "{:.1f} GiB")
    largest = " · ".join(f"{r['stack']} {r['largest_micro_batch']}" for r in data["rows"])
    ax.set_title(
        f"GPT-2 124M, sequence {data['seq']}, in 24 GiB: estimated for a CUDA target, not "
        f"measured on a GPU\nlargest micro-batch that fits: {largest}",
        fontsize=8,
    )
    _footer(fig, f"estimated for the {CUDA} on a CPU", "benchmarks/results/readme_figure.json")
    return fig


def readme_reused() -> Any:
    """The README's picture from the benchmarks' existing JSON (scale_out, batch_size,
    chunked_loss), where ``readme_figure.json`` is not there."""
    one = next(r for r in _load("scale_out")["gpt2_small"] if r["strategy"] == "one device")
    plain_largest = next(r for r in _load("batch_size")["gpt2"]["rows"] if r["run"] == "fp32")
    big = _load("chunked_loss")["largest_batch"]
    stack = big["rows"][1]
    cats = ["parameters", "gradients", "optimizer_state", "activations", "temporaries"]
    plain = {c: one.get(f"{c}_bytes", 0) for c in cats}
    plain["temporaries"] = one["peak_bytes"] - sum(plain.values())
    ours = big["at"]["chunked"]["by_category"]
    labels = [
        "plain (fp32, AdamW)\nmicro-batch 8",
        f"planner's stack\nmicro-batch {big['at_batch']}",
    ]
    parts = {c: [plain.get(c, 0), ours.get(c, 0)] for c in cats}
    fig, axes = _figure(7.5, 3.0)
    ax = axes[0][0]
    _stacked(ax, labels, parts, GIB, "peak GiB (estimated)")
    totals = (one["peak_bytes"], big["at"]["chunked"]["peak_bytes"])
    _totals(ax, [total / GIB for total in totals], "{:.1f} GiB")
    _budget(ax, big["budget_bytes"], -0.55)
    ax.set_title(
        "GPT-2 124M, sequence 1024, in 24 GiB: estimated for a CUDA target, not measured on a "
        "GPU\n"
        + textwrap.fill(
            f"largest micro-batch that fits: plain {plain_largest['largest_micro_batch']} · "
            f"planner's stack ({stack['stack']}) {stack['largest_micro_batch']}",
            110,
        ),
        fontsize=8,
    )
    _footer(
        fig,
        f"estimated for the {CUDA} on a CPU",
        "benchmarks/results/scale_out.json, batch_size.json, chunked_loss.json",
    )
    return fig


# -- memory by category per stack --------------------------------------------------------------------
def checkpointing() -> Any:
    rows = _load("activation_checkpointing")["rows"]
    fig, axes = _figure(8.0, 3.4, ncols=2)
    for ax, key, how in (
        (axes[0][0], "(CPU, real)", "measured"),
        (axes[0][1], "GPT-2", "estimated (CUDA rounding)"),
    ):
        got = [r for r in rows if key in r["workload"]]
        labels = [r["mode"] for r in got]
        parts = {
            "activations": [r["activation_bytes"] for r in got],
            "other": [r["peak_bytes"] - r["activation_bytes"] for r in got],
        }
        scale, unit = (MIB, "peak MiB") if key.startswith("(") else (GIB, "peak GiB")
        _stacked(ax, labels, parts, scale, f"{unit} ({how})")
        ax.set_title(got[0]["workload"], fontsize=8)
    _footer(fig, f"top measured on a {CPU}; bottom estimated", "activation_checkpointing.json")
    return fig


def optimizers() -> Any:
    data = _load("optimizers")
    rows = data["memory_and_time"]
    fig, axes = _figure(8.0, 3.6, ncols=2)
    parts = {
        "optimizer_state": [r["optimizer_state_bytes"] for r in rows],
        "gradients": [r["gradients_at_peak_bytes"] for r in rows],
        "other": [
            r["peak_bytes"] - r["optimizer_state_bytes"] - r["gradients_at_peak_bytes"]
            for r in rows
        ],
    }
    _stacked(axes[0][0], [r["optimizer"] for r in rows], parts, MIB, "peak MiB (measured)")
    axes[0][0].set_title("Peak by category, TinyGPT 4x128", fontsize=8)
    conv = _load("optimizers_convergence")["convergence"]
    runs = sorted({r["run"] for r in conv}, key=[r["run"] for r in conv].index)
    ax = axes[0][1]
    for i, run in enumerate(runs):
        losses = [r["val_loss"] for r in conv if r["run"] == run]
        ax.scatter(losses, [i] * len(losses), color="#4c72b0", s=14)
    ax.set_yticks(range(len(runs)), runs)
    ax.invert_yaxis()
    ax.set_xlabel("validation loss, one dot per seed (measured)")
    steps = conv[0]["steps"]
    ax.set_title(f"Quality after {steps} steps (optimizers_convergence.json)", fontsize=8)
    _footer(fig, f"measured on a {CPU}", "optimizers.json, optimizers_convergence.json")
    return fig


def bf16_weights() -> Any:
    data = _load("bf16_weights")
    fig, axes = _figure(8.0, 3.6, ncols=2)
    ax = axes[0][0]
    forms = list(dict.fromkeys(r["form"] for r in data["quality"]))
    lrs = sorted({r["lr"] for r in data["quality"]}, reverse=True)
    height = 0.8 / len(lrs)
    for j, lr in enumerate(lrs):
        values = [100 * row["loss_vs_reference"] for row in data["quality"] if row["lr"] == lr]
        ys = [i + j * height for i in range(len(forms))]
        ax.barh(ys, values, height=height, color=("#4c72b0", "#dd8452")[j % 2], label=f"lr {lr:g}")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(forms))], forms)
    ax.invert_yaxis()
    ax.axvline(1.0, color="#c44e52", linestyle="--", linewidth=0.8)
    ax.set_xlabel("held-out loss vs fp32 masters, % (measured; dashed: the 1% goal)")
    ax.legend(fontsize=6)
    ax.set_title("The quality gate: fine-tuning a pretrained TinyGPT", fontsize=8)
    mem = data["memory"]
    _bars(
        axes[0][1],
        [r["form"] for r in mem],
        [r["bytes_per_parameter"] for r in mem],
        "weights + gradients + states, bytes per parameter (measured)",
    )
    _footer(fig, f"measured on a {CPU}", "bf16_weights.json")
    return fig


def chunked_loss() -> Any:
    data = _load("chunked_loss")
    fig, axes = _figure(8.0, 3.2, ncols=2)
    big = data["largest_batch"]
    at = big["at"]
    labels = ["without chunked loss", "+ ChunkedCrossEntropy"]
    parts = {c: [at[k]["by_category"].get(c, 0) for k in ("plain", "chunked")] for c in COLOURS}
    parts = {c: v for c, v in parts.items() if any(v)}
    _stacked(axes[0][0], labels, parts, GIB, f"peak GiB at micro-batch {big['at_batch']}")
    axes[0][0].set_title(
        textwrap.fill(
            f"GPT-2 small, seq 1024, {big['rows'][0]['stack']}: largest micro-batch in 24 GiB "
            + " -> ".join(str(r["largest_micro_batch"]) for r in big["rows"])
            + " (estimated, CUDA)",
            100,
        ),
        fontsize=8,
    )
    phase = data["loss_phase"]
    ax = axes[0][1]
    labels = [f"vocab {r['vocab']:,}" for r in phase]
    width = 0.38
    xs = range(len(phase))
    for side, name, colour in ((-1, "plain", "#c44e52"), (1, "chunked", "#4c72b0")):
        ax.bar(
            [x + side * width / 2 for x in xs],
            [r[f"{name}_tracked"] / MIB for r in phase],
            width,
            label=name,
            color=colour,
        )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("loss-phase peak MiB (measured)")
    ax.legend(fontsize=7, frameon=False)
    ax.set_title(f"Loss phase, {phase[0]['rows']} rows, fp32 (CPU)", fontsize=8)
    _footer(fig, f"top estimated for the {CUDA}; bottom measured on a {CPU}", "chunked_loss.json")
    return fig


def planner() -> Any:
    rows = _load("planner")["rows"]
    tight = rows[-1]
    fig, axes = _figure(7.0, 2.8)
    ax = axes[0][0]
    tried = tight["tried"]
    _bars(
        ax, [t[0] for t in tried], [t[1] / GIB for t in tried], "peak GiB (estimated)", "{:.2f} GiB"
    )
    budget = float(tight["budget"].removesuffix("GiB"))
    ax.axvline(budget, color="black", linestyle="--", linewidth=1)
    ax.set_title(
        f"The planner's rungs for GPT-2 small, seq 1024, batch 8, budget {tight['budget']}: "
        f"picks {tight['stack']}",
        fontsize=8,
    )
    _footer(fig, f"estimated for the {CUDA} on a CPU", "planner.json")
    return fig


def precision() -> Any:
    rows = _load("precision")["rows"]
    fig, axes = _figure(8.0, 2.8, ncols=2)
    cats = [c for c in COLOURS if any(r["by_category"].get(c) for r in rows)]
    parts = {c: [r["by_category"].get(c, 0) for r in rows] for c in cats}
    _stacked(axes[0][0], [r["precision"] for r in rows], parts, MIB, "peak MiB (measured)")
    _bars(
        axes[0][1],
        [r["precision"] for r in rows],
        [r["speed_vs_fp32"] for r in rows],
        "speed vs fp32 (measured)",
        "{:.2f}x",
    )
    _footer(fig, f"measured on a {CPU} (AVX512), TinyGPT 2x64", "precision.json")
    return fig


def memory() -> Any:
    rows = _load("estimate_speed")["rows"]
    fig, axes = _figure(7.0, 2.6)
    cats = ["parameters", "gradients", "optimizer_state", "activations", "temporaries"]
    parts = {c: [r[f"{c}_gib"] * GIB for r in rows] for c in cats}
    _stacked(axes[0][0], [r["run"] for r in rows], parts, GIB, "peak GiB (estimated)")
    axes[0][0].set_title("GPT-2 small, seq 1024, batch 8: the estimate by category", fontsize=8)
    _footer(fig, "estimated on a CPU (CPU kernels)", "estimate_speed.json")
    return fig


def scale_out() -> Any:
    rows = _load("scale_out")["gpt2_small"]
    rows = [r for r in rows if r["ranks"] in (1, max(x["ranks"] for x in rows))]
    fig, axes = _figure(7.0, 3.0)
    cats = ["parameters", "gradients", "optimizer_state"]
    labels = [f"{r['strategy']}, {r['ranks']} rank{'s' * (r['ranks'] > 1)}" for r in rows]
    _stacked(axes[0][0], labels, _cats(rows, cats), GIB, "model state per rank, GiB (estimated)")
    axes[0][0].set_title("GPT-2 small: model state per rank (activations alike)", fontsize=8)
    _footer(fig, f"estimated on a CPU for {CUDA.split(' target')[0]}-like ranks", "scale_out.json")
    return fig


def zero_offload() -> Any:
    data = _load("zero_offload")
    fig, axes = _figure(8.0, 3.0, ncols=2)
    ladder = data["ladder"]
    _bars(
        axes[0][0],
        [r["setting"].replace(" (", "\n(") for r in ladder],
        [r["largest_parameters"] / 1e9 for r in ladder],
        f"largest GPT-2 in {data['cap']}, billions of parameters (estimated)",
        "{:.2f}B",
    )
    rows = data["tinygpt"]
    parts = _cats(rows, ["parameters", "gradients", "optimizer_state", "activations"])
    parts["host"] = [r["host_bytes"] for r in rows]
    _stacked(
        axes[0][1],
        [r["setting"].replace(" (", "\n(") for r in rows],
        parts,
        MIB,
        "TinyGPT: device by category + host MiB",
    )
    _footer(fig, "estimated on a CPU", "zero_offload.json")
    return fig


def batch_size() -> Any:
    data = _load("batch_size")["gpt2"]
    rows = data["rows"]
    fig, axes = _figure(7.0, 2.4)
    _bars(
        axes[0][0],
        [r["run"] for r in rows],
        [r["largest_micro_batch"] for r in rows],
        f"largest micro-batch in {data['budget_bytes'] / GIB:.0f} GiB (estimated)",
        "{:.0f}",
    )
    axes[0][0].set_title(f"GPT-2 small, sequence {data['seq']}, AdamW", fontsize=8)
    _footer(fig, f"estimated for a {CUDA.split(' (')[0]} on a CPU", "batch_size.json")
    return fig


def auto() -> Any:
    rows = _load("auto")["rows"]
    fig, axes = _figure(7.5, 2.8)
    labels = [f"effective {r['effective_batch']}, goal {r['goal']}" for r in rows]
    _bars(
        axes[0][0],
        labels,
        [r["micro_batch"] for r in rows],
        "micro-batch picked (estimated)",
        "{:.0f}",
    )
    for i, r in enumerate(rows):
        axes[0][0].text(
            0.5,
            i + 0.3,
            r["stack"],
            fontsize=6,
            color="white" if r["micro_batch"] > 20 else "black",
        )
    axes[0][0].set_title("AutoEfficient on GPT-2 small, seq 1024, 24 GiB", fontsize=8)
    _footer(fig, f"estimated for the {CUDA} on a CPU", "auto.json")
    return fig


# -- speed -------------------------------------------------------------------------------------------
def speed_levers() -> Any:
    """Each lever's step speed vs its own plain run, measured on this CPU (workloads differ)."""
    levers = []
    prec = {r["precision"]: r for r in _load("precision")["rows"]}
    levers.append(("bf16-mixed (precision)", prec["bf16-mixed"]["speed_vs_fp32"]))
    comp = {r["variant"]: r for r in _load("compile")["rows"]}
    levers.append(("compile, whole model", comp["whole"]["steady_speed_vs_eager"]))
    levers.append(("compile, regional", comp["regional"]["steady_speed_vs_eager"]))
    data = max(_load("data_pipeline")["throughput"], key=lambda r: r["vs_plain"])
    levers.append((f"data: {data['loading'].split(' (')[0]}", data["vs_plain"]))
    ckpt = next(
        r
        for r in _load("activation_checkpointing")["rows"]
        if "(CPU, real)" in r["workload"] and r["mode"] == "full"
    )
    levers.append(("checkpointing, full", 1 / ckpt["time_ratio"]))
    opt = {r["optimizer"]: r for r in _load("optimizers")["memory_and_time"]}
    levers.append(("adamw8bit", 1 / opt["adamw8bit"]["step_time_ratio"]))
    levers.append(("chunked loss", 1 / _load("chunked_loss")["step_time"][0]["wall_ratio"]))
    fig, axes = _figure(7.5, 3.0, ncols=2)
    ax = axes[0][0]
    _bars(
        ax, [n for n, _ in levers], [v for _, v in levers], "speed vs plain (measured)", "{:.2f}x"
    )
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_title("Each lever on a CPU (its benchmark's workload)", fontsize=8)
    gpu = json.loads((RECORDED / "h200_speed_2026-12-04.json").read_text())
    prof = gpu["profiles"]
    _bars(
        axes[0][1],
        [k.replace("_", " ") for k in prof],
        [p["measured"]["tokens_per_s"] / 1e3 for p in prof.values()],
        "thousand tokens/s (measured, H200)",
        "{:.0f}k",
        colour="#55a868",
    )
    stack = textwrap.fill(prof["speed_stack"]["run"], 110)
    axes[0][1].set_title(f"GPT-2 124M shape, batch 8, seq 1024, on an H200; {stack}", fontsize=7)
    _footer(
        fig,
        f"top measured on a {CPU}; bottom measured on an NVIDIA H200 (issue 29)",
        "results/*.json, recorded/h200_speed_2026-12-04.json",
    )
    return fig


def compile_steps() -> Any:
    data = _load("compile")
    fig, axes = _figure(7.0, 2.6)
    names = list(data["step_times_s"])
    ax = axes[0][0]
    ax.boxplot(
        [[t * 1e3 for t in data["step_times_s"][n]] for n in names], vert=False, showfliers=False
    )
    ax.set_yticks(range(1, len(names) + 1), names)
    ax.set_xlabel("step ms, interleaved rounds (measured)")
    ax.set_title(data["meta"]["model"] + ", inductor", fontsize=8)
    _footer(fig, f"measured on a {CPU}", "compile.json")
    return fig


def profiler_overhead() -> Any:
    over = _load("profiler")["overhead"]
    fig, axes = _figure(7.0, 2.4)
    names = list(over["step_s"])
    axes[0][0].boxplot([[t * 1e3 for t in over["step_s"][n]] for n in names], vert=False)
    axes[0][0].set_yticks(range(1, len(names) + 1), names)
    axes[0][0].set_xlabel(f"step ms, {over['rounds']} interleaved rounds (measured)")
    axes[0][0].set_title("What StepProfiler costs a step", fontsize=8)
    _footer(fig, f"measured on a {CPU}", "profiler.json")
    return fig


def loader() -> Any:
    data = _load("data_pipeline")
    fig, axes = _figure(8.0, 2.8, ncols=2)
    ax = axes[0][0]
    for i, rep in enumerate(data["input_bound_tuning_reports"]):
        workers = sorted(int(k.rsplit("w", 1)[1]) for k in rep if k.startswith("batches_per_s_w"))
        ax.plot(
            workers,
            [rep[f"batches_per_s_w{w}"] for w in workers],
            marker="o",
            label=f"round {i + 1}",
        )
    ax.set_xlabel("worker processes")
    ax.set_ylabel("batches/s (measured)")
    ax.legend(fontsize=7, frameon=False)
    ax.set_title("Input-bound loader: batches/s by workers", fontsize=8)
    rows = data["input_bound"]
    _bars(
        axes[0][1],
        [r["loading"].replace(" (", "\n(") for r in rows],
        [r["samples_per_s"] for r in rows],
        "samples/s in the fit (measured)",
        "{:.0f}",
    )
    _footer(fig, f"measured on a {CPU}", "data_pipeline.json")
    return fig


# -- loss curves -------------------------------------------------------------------------------------
def curriculum() -> Any:
    data = _load("curriculum")
    fig, axes = _figure(7.0, 3.0)
    ax = axes[0][0]
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in data["runs"])):
        run = next(r for r in data["runs"] if r["variant"] == variant and r["seed"] == 0)
        ax.plot(
            [p["step"] for p in run["curve"]],
            [p["val_ppl"] for p in run["curve"]],
            label=variant,
            color=f"C{i}",
        )
    ax.axhline(data["meta"]["target_val_ppl"], color="black", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("validation perplexity (measured)")
    ax.legend(fontsize=7, frameon=False)
    ax.set_title(f"{data['meta']['model']}, seed 0; dashed: the target", fontsize=8)
    _footer(fig, f"measured on a {CPU}", "curriculum.json")
    return fig


def early_stopping() -> Any:
    data = _load("early_stopping")
    plateau = data["plateau"]
    fig, axes = _figure(8.0, 2.8, ncols=2)
    reps = plateau["replays"]
    _bars(
        axes[0][0],
        [r["setting"] for r in reps],
        [r["stop_step"] for r in reps],
        f"stop step of {plateau['full_steps']} (measured)",
        "{:.0f}",
    )
    axes[0][0].set_title("Where each setting stops the plateau run", fontsize=8)
    rows = data["divergence"]["rows"]
    vals = [r["val_loss"] if r["val_loss"] == r["val_loss"] else 0 for r in rows]
    _bars(
        axes[0][1],
        [f"{r['fault']}, {r['guard'].split(' (')[0]}" for r in rows],
        vals,
        "final validation loss (0: NaN) (measured)",
        "{:.2f}",
        colour="#c44e52",
    )
    _footer(fig, f"measured on a {CPU}", "early_stopping.json")
    return fig


def packing() -> Any:
    """Packed rows against padded batches: tokens/s, fill, and the loss over the same tokens."""
    data = _load("packing")
    runs = data["runs"]
    names = list(runs)
    labels = [
        {
            "padded": f"padded batches of {data['rows_per_batch']}",
            "packed": f"packed rows, {data['rows_per_batch']} a batch",
            "padded, same steps": f"padded batches of {data['same_steps_batch']} (as many steps)",
        }.get(n, n)
        for n in names
    ]
    colours = {"packed": "#55a868"}
    fig, axes = _figure(7.0, 3.4, ncols=3)
    ax = axes[0][0]
    bar_colours = [colours.get(n, "#8c8c8c") for n in names]
    tokens_per_s = [runs[n]["tokens_per_s"] for n in names]
    _bars(ax, labels, tokens_per_s, "tokens/s, wall (measured)", "{:.0f}", colours=bar_colours)
    ax.set_title(
        textwrap.fill(
            f"{data['documents']} documents (median {data['median_length']} tokens, longest "
            f"{data['longest']}), at most {data['rows_per_batch']} x {data['row_length']} slots "
            f"a step: packed / padded {data['ratio_tokens_per_s']:.2f}x tokens/s",
            55,
        ),
        fontsize=8,
    )
    ax = axes[0][1]
    fill = [runs[n]["fill"] * 100 for n in names]
    _bars(ax, labels, fill, "% of slots that are tokens", "{:.1f}%", colours=bar_colours)
    ax.set_xlim(0, 115)
    ax.set_title("Fill", fontsize=8)
    ax = axes[0][2]
    for label, n in zip(labels, names):
        run = runs[n]
        if run.get("losses") and run.get("tokens_seen"):
            ax.plot(
                [t / 1e3 for t in run["tokens_seen"]],
                run["losses"],
                label=f"{label}, held-out {run['held_out_loss']:.3f}",
                color=colours.get(n),
                linewidth=1.6 if n in colours else 0.9,
            )
    ax.set_xlabel("thousand real tokens seen (one epoch)")
    ax.set_ylabel("training loss (measured)")
    ax.legend(fontsize=6.5, frameon=False)
    ax.set_title("Loss over the same tokens", fontsize=8)
    _footer(fig, f"measured on a {CPU}, a Llama of 557,696 parameters, fp32", "packing.json")
    return fig


def finetune() -> Any:
    """Llama-3-8B shape with LoRA: memory by category, plain LoRA against the QLoRA stack."""
    rows = _load("finetune")["llama3_8b_lora"]
    target = _load("finetune")["target"]
    fig, axes = _figure(7.5, 3.0)
    ax = axes[0][0]
    cats = [c for c in COLOURS if any(r["by_category"].get(c) for r in rows)]
    parts = {c: [r["by_category"].get(c, 0) for r in rows] for c in cats}
    labels = [textwrap.fill(r["stack"], 34) for r in rows]
    _stacked(ax, labels, parts, GIB, "peak GiB (estimated)")
    _totals(ax, [r["peak_bytes"] / GIB for r in rows], "{:.2f} GiB")
    ax.set_xlim(0, max(r["peak_bytes"] for r in rows) / GIB * 1.2)
    ax.set_title(
        "Llama-3-8B shape, LoRA r=16, seq 2048, micro-batch 1, bf16-mixed:\n"
        "estimated for a CUDA target, not measured on a GPU",
        fontsize=8,
    )
    _footer(fig, f"estimated on a CPU with fake tensors for {target}", "finetune.json")
    return fig


def long_context() -> Any:
    """The longest sequence per budget: today's stack, the long-context stack (both estimated for
    a CUDA target) and the anchors' published figures (theirs, hatched)."""
    data = _load("long_context")
    rows, anchors = data["longest"], data["anchors"]
    labels, values, colours, hatches = [], [], [], []
    for gib in sorted({r["budget_gib"] for r in rows}):
        for r in (r for r in rows if r["budget_gib"] == gib):
            bound = ", at least" if r.get("lower_bound") else ""
            labels.append(f"{gib} GiB · {r['stack']} (estimated{bound})")
            values.append(r["longest_tokens"] / 1000)
            colours.append("#4c72b0" if r["stack"] != "today" else "#8c8c8c")
            hatches.append("")
        for a in (a for a in anchors if a["budget_gib"] == gib):
            labels.append(f"{gib} GB · {a['who']} (published, theirs)")
            values.append(a["tokens"] / 1000)
            colours.append("#dd8452")
            hatches.append("//")
    fig, axes = _figure(7.5, 0.28 * len(labels) + 1.2)
    ax = axes[0][0]
    _bars(ax, labels, values, "longest sequence, thousands of tokens", "{:,.0f}k", colours=colours)
    for patch, hatch in zip(ax.patches, hatches):
        if hatch:
            patch.set_hatch(hatch)
            patch.set_edgecolor("white")
    goal = data["goal"]
    ax.axvline(goal["tokens"] / 1000, color="#c44e52", linestyle="--", linewidth=0.8)
    ax.set_title(
        f"QLoRA, Llama-3-8B shape, batch 1: goal {goal['tokens']:,} tokens in "
        f"{goal['budget_gib']} GiB (dashed)",
        fontsize=8,
    )
    ax.tick_params(axis="y", labelsize=6.5)
    _footer(
        fig,
        f"ours estimated on a CPU with fake tensors for {data['target']}, not measured on a GPU; "
        "orange: published by others, not measured here",
        "long_context.json",
    )
    return fig


def accumulation() -> Any:
    """Exact accumulation: the update error of 4 x 4 against one step on the 16 documents, and the
    step time side by side."""
    data = _load("accumulation")
    fig, axes = _figure(7.0, 2.6, ncols=2)
    ax = axes[0][0]
    labels = [k.replace("/", ", ") for k in data["errors"]]
    errors = [sum(v) / len(v) for v in data["errors"].values()]
    colours = ["#55a868" if "Exact" in k else "#8c8c8c" for k in data["errors"]]
    ax.barh(labels, errors, color=colours)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("relative error of the update, mean over windows (log; measured)")
    _totals(ax, errors, "{:.1e}")
    ax.set_xlim(min(errors) / 3, max(errors) * 30)
    ax.set_title("Micro-batch 4 x accumulation 4 against one step on the 16 documents", fontsize=8)
    ax = axes[0][1]
    least = {k: sum(min(s) for s in zip(*runs)) for k, runs in data["step_seconds"].items()}
    steps = data["steps"]
    names = ["Lightning (plain)", "ExactAccumulation"]
    values = [least["plain"] / steps * 1e3, least["exact"] / steps * 1e3]
    _bars(ax, names, values, "ms per optimizer step (measured)", "{:.1f}",
          colours=["#8c8c8c", "#55a868"])  # fmt: skip
    ax.set_title(
        f"Step time: {data['cost']:.3f}x side by side; the exact run's own hooks "
        f"{data['hook_cost']:.3f}x (goal 1.02x)",
        fontsize=8,
    )
    _footer(fig, f"measured on a {CPU}, a tiny Llama, fp32, pydoc paragraphs", "accumulation.json")
    return fig


@dataclass(frozen=True)
class Chart:
    """One picture: its file under ``docs/img``, the page(s) that link it, how it is drawn."""

    name: str
    pages: tuple[str, ...]
    draw: Callable[[], Any]

    @property
    def path(self) -> Path:
        return IMG / f"{self.name}.svg"


CHARTS = [
    # readme_figure.json (python -m benchmarks.site.readme_figure) where it is committed, else the
    # figures the planner, batch-size and chunked-loss benchmarks already hold
    Chart(
        "readme_gpt2_24gib",
        ("README.md",),
        readme if (RESULTS / "readme_figure.json").exists() else readme_reused,
    ),
    Chart("activation_checkpointing_memory", ("docs/activation_checkpointing.md",), checkpointing),
    Chart("optimizers_memory", ("docs/optimizers.md",), optimizers),
    Chart("bf16_weights_gate", ("docs/optimizers.md",), bf16_weights),
    Chart("chunked_loss_memory", ("docs/chunked_loss.md",), chunked_loss),
    Chart("planner_rungs", ("docs/planner.md",), planner),
    Chart("precision_memory", ("docs/precision.md",), precision),
    Chart("memory_estimate", ("docs/memory.md",), memory),
    Chart("scale_out_state", ("docs/scale_out.md", "docs/fsdp.md"), scale_out),
    Chart("zero_offload_ladder", ("docs/zero_offload.md",), zero_offload),
    Chart("batch_size_largest", ("docs/batch_size.md",), batch_size),
    Chart("auto_decisions", ("docs/auto.md",), auto),
    Chart("speed_levers", ("docs/profiling.md", "docs/compile.md"), speed_levers),
    Chart("compile_steps", ("docs/compile.md",), compile_steps),
    Chart("profiler_overhead", ("docs/profiling.md",), profiler_overhead),
    Chart("dataloading_workers", ("docs/dataloading.md",), loader),
    Chart("curriculum_curves", ("docs/curriculum.md",), curriculum),
    Chart("early_stopping_runs", ("docs/early_stopping.md",), early_stopping),
    Chart("packing_fill_speed", ("docs/packing.md",), packing),
    Chart("accumulation_error_time", ("docs/accumulation.md",), accumulation),
    Chart("finetune_memory", ("docs/finetuning.md", "docs/quantize.md"), finetune),
    Chart("long_context_tokens", ("docs/long_context.md",), long_context),
]


def render_chart(chart: Chart) -> bytes:
    """The chart's SVG, the same bytes for the same JSON (fixed hash salt, no date)."""
    plt = _plt()
    with plt.rc_context(_RC):
        fig = chart.draw()
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return buf.getvalue()


def write_charts() -> list[Path]:
    """Write every chart to ``docs/img``; returns the paths written."""
    IMG.mkdir(parents=True, exist_ok=True)
    out = []
    for chart in CHARTS:
        chart.path.write_bytes(render_chart(chart))
        out.append(chart.path)
    return out


def stale_charts() -> list[str]:
    """The charts whose committed file is missing or differs from what the JSON draws now."""
    return [c.name for c in CHARTS if not c.path.exists() or c.path.read_bytes() != render_chart(c)]
