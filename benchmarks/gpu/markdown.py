"""The Markdown of a GPU suite run: one table per part, the summary, the environment.

``markdown(data)`` renders the results ``suite.py`` writes (its ``.json``) as the ``.md``
next to it; ``RENDER`` maps a part's key to the function that renders its rows. Standard
library only (the suite's parent process imports no torch).
"""

from __future__ import annotations

from typing import Any

from benchmarks._results import fmt_bytes, table
from benchmarks.gpu.registry import UNFINISHED

__all__ = ["GOALS", "RENDER", "markdown"]


def _pct(x: Any) -> str:
    return f"{x:.1%}" if isinstance(x, (int, float)) else "-"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _ms(x: Any) -> str:
    return f"{x * 1000:.1f} ms" if isinstance(x, (int, float)) else "-"


def _params(n: Any) -> str:
    if not isinstance(n, (int, float)) or not n:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _render_pytest(p: dict) -> str:
    rows = [(c["test"], c["outcome"], c["message"]) for c in p["rows"]]
    return table(["Test", "Outcome", "Message"], rows) if rows else "(no test)"


def _render_estimate(p: dict) -> str:
    rows = [
        (
            r["model"],
            r["stack"],
            f"{r['batch']} x {r['seq']}",
            fmt_bytes(r.get("estimate_bytes")),
            fmt_bytes(r.get("estimate_rounded_bytes")),
            fmt_bytes(r.get("measured_bytes")),
            _num(r.get("ratio")),
            _num(r.get("ratio_rounded")),
            {True: "yes", False: "no"}.get(r.get("within_10pct"), "-"),
            _pair(r.get("estimate_reserved_bytes"), r.get("reserved_bytes")),
            r["status"],
        )
        for r in p["rows"]
    ]
    cols = [
        "Model",
        "Stack",
        "Batch",
        "Estimate",
        "Estimate (CUDA rounding)",
        "Measured peak",
        "Ratio",
        "Ratio (rounded)",
        "Within 10%",
        "Reserved: estimate / measured",
        "Status",
    ]
    return table(cols, rows, "llrrrrrrlrl")


def _pair(a: Any, b: Any) -> str:
    return "-" if a is None and b is None else f"{fmt_bytes(a)} / {fmt_bytes(b)}"


def _both(allocated: Any, reserved: Any) -> str:
    return fmt_bytes(allocated) + (f" / {fmt_bytes(reserved)}" if reserved is not None else "")


def _render_batch(p: dict) -> str:
    rows = []
    for r in p["rows"]:
        if "estimate_pick" not in r:
            rows.append((r.get("stack", "-"), r.get("precision", "-"), *["-"] * 5, r["status"]))
            continue
        real = r.get("largest_real")
        settled = r.get("resolved") or r.get("at_top")
        rows.append(
            (
                r["stack"],
                r["precision"],
                f"{r['estimate_pick']} ({fmt_bytes(r.get('estimate_bytes'))})",
                f"{r.get('pick_status') or '-'}, "
                f"{_both(r.get('pick_measured_bytes'), r.get('pick_reserved_bytes'))}",
                f"**{real}**" if settled else f"{real} (not settled)",
                _both(r.get("largest_measured_bytes"), r.get("largest_reserved_bytes")),
                r.get("smallest_oom") or "-",
                r["status"],
            )
        )
    out = table(
        [
            "Stack",
            "Precision",
            "Estimate's pick (estimated peak)",
            "Real steps at the pick (peak allocated / reserved)",
            "Largest micro-batch, real steps",
            "Its peak (allocated / reserved)",
            "Smallest out of memory",
            "Status",
        ],
        rows,
        "llrlrrrl",
    )
    probes = [
        f"- {r['stack']}: "
        + "; ".join(
            f"{x['batch']} {x['status']}"
            + (f" {_both(x['peak_bytes'], x.get('reserved_bytes'))}" if x["status"] == "ok" else "")
            + (f" ({x['wall_s']:.0f} s)" if isinstance(x.get("wall_s"), (int, float)) else "")
            for x in r.get("probes", [])
        )
        for r in p["rows"]
        if r.get("probes")
    ]
    if probes:
        out += "\n\nEvery real run (micro-batch, result, peak allocated / reserved, seconds):\n\n"
        out += "\n".join(probes)
    auto = p["figures"].get("auto_efficient")
    if auto:
        out += (
            f"\n\nAutoEfficient (issue 31), budget {fmt_bytes(auto.get('budget_bytes'))} (cap "
            f"{fmt_bytes(auto.get('cap_bytes'))}), effective batch {auto['batch']}, "
            f"{auto['steps']} steps: "
            + (
                f"{auto['stack']}, micro-batch {auto['micro_batch']} x {auto['accumulation']}; "
                f"{auto['status']} after {auto.get('steps_run')} steps (peak "
                f"{_both(auto.get('peak_bytes'), auto.get('reserved_bytes'))}; trial "
                f"{fmt_bytes(auto.get('trial_bytes'))}; decision {auto.get('decision_s') or 0:.1f} s); "
                f"real largest: planner's stack {auto.get('largest_real_planner_stack')}, any "
                f"stack {auto.get('largest_real_any_stack')}; ratio {auto.get('ratio')}; the "
                f"largest divisor of {auto['batch']} within it: {auto.get('largest_divisor_within_real')}"
                if auto.get("micro_batch")
                else auto["status"]
            )
        )
    tried = p["figures"].get("planner_tried")
    if tried:
        batch = p["figures"].get("planner_batch")
        out += f"\n\nPlanner at batch {batch}:\n\n" + table(
            ["Rung", "Estimated peak", "Verdict"],
            [(n, fmt_bytes(b), v) for n, b, v in tried],
            "lrl",
        )
    return out


def _render_ladder(p: dict) -> str:
    rows = []
    for r in p["rows"]:
        tried = "; ".join(
            f"{t['model']} {fmt_bytes(t['device_bytes'])}"
            f"{'' if t['fits_cap'] else ' over cap'}"
            f"{'' if t['fits_host'] else ' (host ' + fmt_bytes(t['host_need_bytes']) + ')'}"
            for t in r.get("estimate_tried", [])
        )
        real = "; ".join(
            f"{x['model']}: {x['status']}, peak {fmt_bytes(x.get('measured_bytes'))}"
            for x in r.get("real", [])
        )
        params = r.get("largest_trained_parameters")
        rows.append(
            (
                r["setting"],
                r.get("estimate_choice") or "-",
                r.get("largest_trained") or "-",
                _params(params),
                tried or "-",
                real or r["status"],
            )
        )
    return table(
        [
            "Setting",
            "Estimate's choice",
            "Largest trained",
            "Parameters",
            "Estimates (device peak)",
            "Real steps",
        ],
        rows,
        "lllrll",
    )


def _render_packing(rows: list[dict]) -> str:
    def fill(r: dict) -> str:
        packer = r.get("packing") or {}
        if not packer.get("fill"):
            return _pct(r.get("fill"))
        made = f"rows {_pct(packer['fill'])}; padded {_pct(packer.get('padded_fill'))}"
        return f"{_pct(r.get('fill'))} ({made})"

    return table(
        ["Loader", "Precision", "Batch", "Tokens/s", "Step", "Fill", "vs padded", "Status"],
        [
            (
                r["variant"],
                r.get("precision", "-"),
                r.get("batch", "-"),
                _num(r.get("tokens_per_s"), "{:,.0f}"),
                _ms(r.get("step_s")),
                fill(r),
                _num(r.get("vs_padded"), "{:.2f}x"),
                r["status"],
            )
            for r in rows
        ],
        "llrrrrrl",
    )


def _render_speed(p: dict) -> str:
    def compiled(r: dict) -> str:
        c = r.get("compile") or {}
        if not c.get("scope"):
            return "-"
        both = ""
        if c.get("regional_step_s") and c.get("whole_step_s"):
            both = (
                f" (regional {_ms(c['regional_step_s'])} / {_num(c.get('regional_compile_s'), '{:.1f} s')}"
                f", whole {_ms(c['whole_step_s'])} / {_num(c.get('whole_compile_s'), '{:.1f} s')})"
            )
        return f"{c['scope']}{both}"

    def verdict(r: dict) -> str:
        v = r.get("verdict")
        if not v:
            return "none" if "levers" in r else "-"
        return f"{v.get('lever')}: {v.get('gain')}"

    rows = [
        (
            r["variant"],
            r.get("precision", "-"),
            f"{r['micro_batch']} x {r['accumulate']}" if r.get("micro_batch") else "-",
            _num(r.get("tokens_per_s"), "{:,.0f}"),
            _ms(r.get("step_s")),
            _pct(r.get("mfu")),
            _num(r.get("vs_plain"), "{:.2f}x"),
            compiled(r),
            _num(r.get("first_step_s"), "{:.1f} s"),
            verdict(r),
            r["status"],
        )
        for r in p["rows"]
        if r.get("table") != "packing"
    ]
    text = table(
        [
            "Row",
            "Precision",
            "Micro-batch x accumulation",
            "Tokens/s",
            "Step",
            "MFU",
            "vs plain",
            "Compile (auto: steady step / compile time)",
            "First step",
            "StepProfiler's next lever: expected gain",
            "Status",
        ],
        rows,
        "lllrrrrlrll",
    )
    over = (p.get("figures") or {}).get("profiler_overhead")
    if over:
        text += (
            f"\n\nStepProfiler's cost: step time with it over without, on "
            f"{p['figures'].get('profiler_overhead_row')}: **{over:.3f}x**."
        )
    packing = [r for r in p["rows"] if r.get("table") == "packing"]
    if packing:
        text += (
            "\n\nPacking (issue 52): padded batches of the long-tail documents against "
            "SequencePacking's rows; tokens/s counts the documents' own tokens, fill is tokens "
            "over slots in the timed steps (the packer's own figures beside it):\n\n"
        ) + _render_packing(packing)
    return text


def _render_compile(p: dict) -> str:
    rows = [
        (
            r["variant"],
            r.get("modules_compiled", "-"),
            _num(r.get("compile_s"), "{:.1f} s"),
            r.get("graphs", "-"),
            _num(r.get("first_step_s"), "{:.1f} s"),
            _ms(r.get("steady_step_s")),
            _num(r.get("speed_vs_eager"), "{:.2f}x"),
            r["status"],
        )
        for r in p["rows"]
    ]
    return table(
        [
            "Variant",
            "Modules compiled",
            "Compile time",
            "Graphs",
            "First step",
            "Steady step",
            "Speed vs eager",
            "Status",
        ],
        rows,
        "lrrrrrrl",
    )


def _render_finetune(p: dict) -> str:
    def reserved(r: dict) -> str:
        if not r.get("reserved_bytes"):
            return "-"
        over = r.get("reserved_over_allocated")
        return fmt_bytes(r["reserved_bytes"]) + (f" ({over:.2f}x)" if over else "")

    rows = [
        (
            r["stack"] + (f", {r['allocator']}" if r.get("allocator") else ""),
            r.get("precision", "-"),
            fmt_bytes(r.get("estimate_bytes")) if r.get("estimate_bytes") else "-",
            fmt_bytes(r.get("measured_bytes")) if r.get("measured_bytes") else "-",
            fmt_bytes(r.get("setup_peak_bytes")) if r.get("setup_peak_bytes") else "-",
            reserved(r),
            _num(r.get("ratio")),
            _num(r.get("peak_vs_lora"), "{:.2f}x"),
            _num(r.get("tokens_per_s"), "{:,.0f}"),
            _num(r.get("vs_lora"), "{:.2f}x"),
            _ms(r.get("step_s")),
            r["status"]
            + (f" (estimate: {r['estimate_error']})" if r.get("estimate_error") else ""),
        )
        for r in p["rows"]
    ]
    return table(
        [
            "Stack",
            "Precision",
            "Estimate",
            "Measured peak (steps)",
            "Peak before the first step",
            "Reserved (x allocated)",
            "Ratio",
            "Peak vs LoRA",
            "Tokens/s",
            "Tokens/s vs LoRA",
            "Step",
            "Status",
        ],
        rows,
        "llrrrrrrrrrl",
    )


#: Figures with a goal that no GPU run has measured yet (issue 52), by part: (figure, the
#: part's figure key, the goal, whether a value meets it, its format). Shown under the part's
#: table, "not measured yet" until a GPU run gives the figure.
GOALS: dict[str, list[tuple[str, str, str, Any, str]]] = {
    "speed": [
        (
            "Packing: SequencePacking's tokens/s over padded batches, long-tail documents",
            "packing_speedup",
            ">= 2x",
            lambda x: x >= 2.0,
            "{:.2f}x",
        )
    ],
    "finetune": [
        (
            "Allocator: reserved bytes with expandable_segments over the default's, QLoRA stack",
            "expandable_reserved_ratio",
            "< 1x (peers: 0.66x for QLoRA, torchtune #1185)",
            lambda x: x < 1.0,
            "{:.2f}x",
        )
    ],
}


def _goals(p: dict[str, Any], dry_run: bool) -> str:
    """The part's figures beside their goals (``GOALS``); a dry run's are not GPU figures."""
    rows = []
    for figure, key, goal, met, fmt in GOALS.get(p["key"], []):
        x = (p.get("figures") or {}).get(key)
        if isinstance(x, (int, float)) and not dry_run:
            rows.append((figure, goal, fmt.format(x), "met" if met(x) else "not met"))
        else:
            dry = f" (dry run: {fmt.format(x)})" if isinstance(x, (int, float)) else ""
            rows.append((figure, goal, "not measured yet" + dry, "-"))
    return table(["Figure", "Goal", "Result", "Met"], rows, "llrl") if rows else ""


RENDER = {
    "pytest": _render_pytest,
    "estimate": _render_estimate,
    "batch": _render_batch,
    "ladder": _render_ladder,
    "speed": _render_speed,
    "compile": _render_compile,
    "finetune": _render_finetune,
}


def _seconds(p: dict[str, Any]) -> str:
    """A part's seconds, with the time it waited for DeepSpeed's build (part 4)."""
    waited = p.get("figures", {}).get("build_wait_s")
    text = f"{p.get('seconds', 0):.0f}"
    return text + (f" ({waited:.0f} of them waiting for the build)" if waited else "")


def markdown(data: dict[str, Any]) -> str:
    dev = data["device"]
    title = "dry run on the CPU" if data["dry_run"] else dev["name"]
    lines = [
        f"# GPU suite: {title}",
        "",
        f"Command: `{data['command']}`; started {data['started']}; "
        f"{data['total_s']:.0f} s of a {data['budget_s']:.0f} s budget; commit {data['commit']}.",
        "",
    ]
    unfinished = [p for p in data["parts"] if p["status"] in UNFINISHED]
    if unfinished:
        lines += [
            f"**Not finished**: written {data['total_s']:.0f} s after the start, when the last "
            "part before it ended (the suite writes its results after every part, and it "
            "did not end); parts that did not finish: "
            + ", ".join(f"{p['number']} ({p['status']})" for p in unfinished)
            + ". Their output so far is in `gpu_suite.log.tmp` beside this file.",
            "",
        ]
    if data["dry_run"]:
        lines += [
            "**Dry run**: tiny shapes on the CPU, memory caps emulated by the estimate only, "
            "peaks from the instrument's storage tracker. No figure here is a GPU figure.",
            "",
        ]
    env = {
        "device": dev["name"],
        "driver": dev.get("driver", "-"),
        **(
            {
                "CUDA": dev["cuda"],
                "capability": dev["capability"],
                "device memory": fmt_bytes(dev["total_memory_bytes"]),
            }
            if dev.get("cuda")
            else {}
        ),
        **data["environment"],
    }
    lines += [table(["Field", "Value"], list(env.items())), "", "## Summary", ""]
    lines.append(
        table(
            ["#", "Part", "Status", "Seconds", "Cap", "Result"],
            [
                (
                    p["number"],
                    p["title"],
                    p["status"] + (f": {p['reason']}" if p.get("reason") else ""),
                    _seconds(p),
                    f"{p['cap_s']:.0f}"
                    + (f" (+{p['spare_s']:.0f} if left)" if p.get("spare_s") else ""),
                    p.get("headline", ""),
                )
                for p in data["parts"]
            ],
            "lllrrl",
        )
    )
    build = data.get("build")
    if build:
        waited = build.get("part_4_waited_s")
        lines += [
            "",
            f"DeepSpeed's CPU extensions: {build.get('status')} in {build.get('seconds', 0):.0f} s "
            "(started first, alongside parts 1-4; part 4's ZeRO rows wait for it within its cap"
            + (f"; part 4 waited {waited:.0f} s for them" if waited is not None else "")
            + ").",
        ]
    timed = [str(p["number"]) for p in data["parts"] if p.get("lane") == "timed"]
    lines += [
        "",
        "Parts 1-4 run side by side (1; 2 then 3; 4), the parts that time something"
        + (f" ({', '.join(timed)})" if timed else "")
        + " alone afterwards, one after the other. A part not `ok` says why, and what its "
        "unfinished rows would have needed. Caps (at the default "
        "budget) are sized from what each part took on an H200: "
        + "; ".join(f"{p['number']}: {p['cap_basis']}" for p in data["parts"] if p.get("cap_basis"))
        + ".",
    ]
    for p in data["parts"]:
        lines += ["", f"## {p['number']}. {p['title']}", ""]
        lines.append(f"Status: **{p['status']}**" + (f": {p['reason']}" if p.get("reason") else ""))
        for note in p.get("notes", []):
            lines += ["", note]
        if p.get("rows"):
            lines += ["", RENDER[p["key"]](p)]
        goals = _goals(p, data["dry_run"])
        if goals:
            lines += ["", goals]
        if p.get("error"):
            lines += ["", "```", p["error"][-1500:].rstrip(), "```"]
        elif p.get("log_tail"):
            lines += ["", "Last output:", "", "```", p["log_tail"][-1500:].rstrip(), "```"]
    return "\n".join(lines)
