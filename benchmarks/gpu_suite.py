"""The one prepared GPU run: the project's headline figures measured on one CUDA device.

    python benchmarks/gpu_suite.py                 # on a CUDA machine, about 8 minutes on an H200
    python benchmarks/gpu_suite.py --dry-run       # the same script on the CPU, tiny shapes

Six parts, each in its own process with its own time cap (a part that would pass the suite's
limit is skipped and says so; a failure in one does not stop the others):

1. ``pytest -m gpu``: the GPU-marked tests (dry run: collected only, ``--co``).
2. Estimate vs reality: HF GPT-2 124M and TinyGPT at GPT-2 small shape, sequence 1024, for
   fp32, bf16-mixed, + checkpointing, + adamw8bit: ``estimate_memory``'s peak against
   ``torch.cuda.max_memory_allocated`` of the same two Lightning steps (goal: within 10%).
3. Largest micro-batch within a 24 GiB cap: plain fp32 vs the planner's stack (``plan_stack``),
   each found by the estimate and then run for real under
   ``torch.cuda.set_per_process_memory_fraction``.
4. Largest GPT-2-shaped model at batch 1 x 1024 within the cap: plain vs ZeRO-2 and ZeRO-3
   with CPU offload (``ZeROOffload``), real steps at the estimate's choice.
5. Speed: tokens/s and MFU of GPT-2 124M, plain fp32 Lightning vs precision auto + TF32 +
   regional ``TorchCompile`` + fused AdamW + ``DataLoaderTuning``.
6. Compile: regional vs whole-model compile time and steady step time.

Writes ``gpu_<device>.md``, ``.json`` and ``.log`` to ``--out`` (default
``benchmarks/results``; a dry run writes to a temporary folder unless ``--out`` is given). The
output format and the caps are described in ``benchmarks/README.md``.

This parent process imports no torch for the parts: it starts them, enforces their caps and
writes the results. The measuring code is ``benchmarks/_gpu_parts.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _results import environment, fmt_bytes, save_results, table  # noqa: E402

RESULTS = HERE / "results"
FORMAT_VERSION = 1
TOTAL_S = 480.0
GIB = 2**30


@dataclass(frozen=True)
class Part:
    number: int
    key: str
    title: str
    cap_s: float  # at the default 480 s budget; scaled with --budget-s
    min_s: float  # a part is skipped when less than this is left


PARTS = [
    Part(1, "pytest", "pytest -m gpu", 45, 15),
    Part(2, "estimate", "Estimate vs reality", 70, 25),
    Part(3, "batch", "Largest micro-batch within the cap", 70, 30),
    Part(4, "ladder", "Largest model at batch 1 within the cap", 150, 40),
    Part(5, "speed", "Speed: tokens/s and MFU", 70, 30),
    Part(6, "compile", "Compile: regional vs whole model", 75, 30),
]
# -- the shapes of a GPU run and of a dry run ------------------------------------------------------
PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        "seq": 1024,
        "vocab": 50257,
        "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
        "estimate_batch": 8,
        "batch_top": 256,
        "planner_batch": 32,
        # GPT-2 / GPT-3 shapes (name, n_layer, n_embd), head size 64: benchmarks/zero_offload.py
        "ladder": [
            ["124M", 12, 768],
            ["350M", 24, 1024],
            ["774M", 36, 1280],
            ["1.5B", 48, 1600],
            ["2.7B", 32, 2560],
            ["6.7B", 32, 4096],
            ["13B", 40, 5120],
        ],
        "ladder_seq": 1024,
        "ladder_vocab": 50257,
        "speed_batch": 8,
        "speed_steps": 300,
        "speed_warmup": 10,
        "speed_window_s": 12.0,
        "compile_batch": 8,
        "compile_repeats": 10,
        "compile_backend": "inductor",
        "compile_precision": "bf16-mixed",
        "real_steps": 2,
    },
    "dry": {
        "seq": 64,
        "vocab": 512,
        "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2},
        "estimate_batch": 4,
        "batch_top": 64,
        "planner_batch": 16,
        "ladder": [["tiny-1", 1, 64], ["tiny-2", 2, 64], ["tiny-3", 2, 128], ["tiny-4", 4, 128]],
        "ladder_seq": 64,
        "ladder_vocab": 512,
        "speed_batch": 4,
        "speed_steps": 12,
        "speed_warmup": 3,
        "speed_window_s": 5.0,
        "compile_batch": 4,
        "compile_repeats": 3,
        "compile_backend": "aot_eager",
        "compile_precision": "32-true",
        "real_steps": 2,
    },
}


#: Parts that measure time: nothing else of the suite runs while they do.
TIMED = ("speed", "compile")
#: Caps of the dry run's emulated memory limits (parts 3 and 4), by the estimate only.
DRY_CAPS = {"batch": 16 * 2**20, "ladder": 4 * 2**20}


# -- helpers ---------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, flags=re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"a size like 24GiB or 80GB; got {text!r}")
    units = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
    units.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
    return int(float(m.group(1)) * units[(m.group(2) or "B").lower()])


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (the results file's name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _host_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * GIB


def probe_device(dry_run: bool) -> dict[str, Any]:
    """Name, memory, capability and driver of CUDA device 0 (or the CPU in a dry run)."""
    if dry_run:
        import platform

        return {"name": f"CPU ({platform.machine()}), dry run", "type": "cpu", "driver": "-"}
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {
        "name": props.name,
        "type": "cuda",
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()),
        "devices": torch.cuda.device_count(),
        "driver": "unknown",
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# -- DeepSpeed's cpu_adam: built in the background while the first parts run ------------------------
PREBUILD = (
    "import torch\n"
    "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
    "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])\n"
)


def start_prebuild(work: Path, log: Path) -> tuple[subprocess.Popen | None, Path]:
    """Build (or load) DeepSpeed's cpu_adam extension in a background process; it writes
    ``prebuild.done`` with ``ok`` or ``failed`` when it ends. Nothing happens without DeepSpeed."""
    flag = work / "prebuild.done"
    from importlib.util import find_spec

    if find_spec("deepspeed") is None:
        flag.write_text("not installed")
        return None, flag
    script = f"{PREBUILD}open({str(flag)!r}, 'w').write('ok')\n"
    wrapper = (
        f"import sys\ntry:\n    exec({script!r})\nexcept BaseException as e:\n"
        f"    open({str(flag)!r}, 'w').write('failed to build: ' + type(e).__name__)\n    raise\n"
    )
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", wrapper],
            cwd=ROOT,
            env=_child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, flag


# -- part 1: pytest -m gpu ---------------------------------------------------------------------------
def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes from a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    cases = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0) or 0)
        for case in suite.iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (el.get("message") or el.text or "").strip().splitlines()[:1]
                    message = message[0][:200] if message else ""
                    break
            name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
            cases.append({"test": name, "outcome": outcome, "message": message})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"counts": counts, "cases": cases}


def parse_collect_only(text: str) -> dict[str, Any]:
    """Node ids and the ``N/M tests collected (K deselected)`` line of ``pytest --co -q``."""
    ids = [ln.strip() for ln in text.splitlines() if "::" in ln and not ln.startswith(" ")]
    m = re.search(r"(\d+)(?:/(\d+))? tests? collected", text)
    errors = re.search(r"(\d+) errors?", text.splitlines()[-1] if text.strip() else "")
    return {
        "collected": int(m.group(1)) if m else len(ids),
        "total": int(m.group(2)) if m and m.group(2) else None,
        "collection_errors": int(errors.group(1)) if errors else 0,
        "cases": [{"test": i, "outcome": "collected", "message": ""} for i in ids],
    }


class Child:
    """One process of the suite (pytest, or a part): started early, timed from ``go()``.

    A part's process is started before its turn so that it imports torch and Lightning while
    the part before it runs; it waits for its context file, which ``go()`` writes with the
    deadline. ``finish()`` waits until the cap and kills the process group if it is still
    running (the part's own run processes and loader workers with it)."""

    def __init__(self, key: str, cmd: list[str], work: Path) -> None:
        self.key = key
        self.out_file = work / f"{key}.out"
        self.ctx_file = work / f"ctx_{key}.json"
        self.result_file = work / f"part_{key}.json"
        self.started = self.timeout = 0.0
        with open(self.out_file, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=_child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def part(cls, key: str, work: Path) -> Child:
        ctx_file = work / f"ctx_{key}.json"
        return cls(key, [sys.executable, __file__, "--child", key, "--ctx", str(ctx_file)], work)

    def go(self, ctx: dict[str, Any] | None, timeout: float) -> None:
        self.started, self.timeout = time.time(), timeout
        if ctx is not None:
            ctx = dict(ctx, deadline=self.started + timeout - 8, result_file=str(self.result_file))
            tmp = self.ctx_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ctx))
            os.replace(tmp, self.ctx_file)  # the waiting child sees a complete file

    def finish(self, log: Path) -> tuple[int | None, bool]:
        """Wait for the end or the cap; ``(exit code, timed out)``. Appends the output to ``log``."""
        left = self.started + self.timeout - time.time() if self.started else 0.0
        try:
            code, timed_out = self.proc.wait(timeout=max(0.1, left)), False
        except subprocess.TimeoutExpired:
            self.kill()
            code, timed_out = None, True
        with open(log, "a") as f:
            f.write(f"\n===== {self.key} =====\n" + _tail(self.out_file, 200_000))
        return code, timed_out

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)


PYTEST = [
    "-m",
    "pytest",
    "-m",
    "gpu",
    "-q",
    "-rA",
    "-p",
    "no:cacheprovider",
    "--continue-on-collection-errors",
]


def start_pytest(dry_run: bool, work: Path) -> Child:
    cmd = [sys.executable, *PYTEST, f"--junitxml={work / 'pytest.xml'}", "tests"]
    if dry_run:
        cmd.insert(-1, "--co")
    return Child("pytest", cmd, work)


def finish_pytest(child: Child, dry_run: bool, work: Path, log: Path) -> dict[str, Any]:
    code, timed_out = child.finish(log)
    text = _tail(child.out_file, 200_000)
    command = "python -m pytest -m gpu" + (" --co" if dry_run else "")
    result: dict[str, Any] = {"rows": [], "figures": {"command": command}, "notes": []}
    if timed_out:
        result.update(status="timeout", reason=f"stopped at its {child.timeout:.0f} s cap")
        result["log_tail"] = text[-3000:]
        return result
    if dry_run:
        got = parse_collect_only(text)
        result["rows"] = got["cases"]
        result["figures"].update(collected=got["collected"], total=got["total"])
        result["notes"].append(
            "Dry run: the GPU tests are collected, not run (they need a CUDA device)."
        )
        result.update(
            status="ok" if code == 0 else "failed",
            reason="collected only (dry run)" if code == 0 else f"pytest --co exited with {code}",
            headline=f"{got['collected']} GPU tests collected (dry run: not run)",
        )
        return result
    junit = work / "pytest.xml"
    if not junit.exists():
        result.update(status="failed", reason=f"pytest exited with {code}, no report")
        result["log_tail"] = text[-3000:]
        return result
    got = parse_junit(junit)
    c = got["counts"]
    result["rows"] = got["cases"]
    result["figures"].update(c, exit_code=code)
    # pytest's exit codes: 0 all passed, 1 some failed, 5 none collected; others are errors
    status = "ok" if code in (0, 1, 5) else "failed"
    headline = (
        f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, "
        f"{c['skipped']} skipped"
    )
    result.update(status=status, headline=headline, reason="" if status == "ok" else headline)
    return result


def finish_part(child: Child, log: Path) -> dict[str, Any]:
    code, timed_out = child.finish(log)
    try:
        result = json.loads(child.result_file.read_text())
    except (OSError, ValueError):
        result = {"rows": [], "figures": {}, "notes": [], "status": "failed"}
        result["reason"] = f"the part's process exited with code {code} and no results"
    if timed_out:
        result.update(status="timeout", reason=f"stopped at its {child.timeout:.0f} s cap")
    elif result.get("status") == "running":
        result.update(status="failed", reason=f"the part's process died (code {code})")
    if result["status"] in ("failed", "timeout"):
        result["log_tail"] = _tail(child.out_file)
    return result


# -- the Markdown -----------------------------------------------------------------------------
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
        "Status",
    ]
    return table(cols, rows, "llrrrrrrll")


def _render_batch(p: dict) -> str:
    rows = [
        (
            r["stack"],
            r["precision"],
            r["largest_micro_batch"],
            fmt_bytes(r.get("estimate_bytes")),
            fmt_bytes(r.get("measured_bytes")),
            fmt_bytes(r.get("reserved_bytes")),
            r["status"],
        )
        for r in p["rows"]
    ]
    out = table(
        [
            "Stack",
            "Precision",
            "Largest micro-batch (estimate)",
            "Estimated peak",
            "Measured peak",
            "Reserved",
            "Real step",
        ],
        rows,
        "llrrrrl",
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


def _render_speed(p: dict) -> str:
    rows = [
        (
            r["variant"],
            r.get("precision", "-"),
            _num(r.get("tokens_per_s"), "{:,.0f}"),
            _ms(r.get("step_s")),
            _pct(r.get("mfu")),
            _num(r.get("first_step_s"), "{:.1f} s"),
            r.get("timed_steps") or "-",
            _num(r.get("loss"), "{:.3f}"),
            r["status"],
        )
        for r in p["rows"]
    ]
    return table(
        [
            "Variant",
            "Precision",
            "Tokens/s",
            "Step",
            "MFU",
            "First step",
            "Timed steps",
            "Last loss",
            "Status",
        ],
        rows,
        "llrrrrrrl",
    )


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


RENDER = {
    "pytest": _render_pytest,
    "estimate": _render_estimate,
    "batch": _render_batch,
    "ladder": _render_ladder,
    "speed": _render_speed,
    "compile": _render_compile,
}


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
                    f"{p.get('seconds', 0):.0f}",
                    f"{p['cap_s']:.0f}",
                    p.get("headline", ""),
                )
                for p in data["parts"]
            ],
            "lllrrl",
        )
    )
    for p in data["parts"]:
        lines += ["", f"## {p['number']}. {p['title']}", ""]
        lines.append(f"Status: **{p['status']}**" + (f": {p['reason']}" if p.get("reason") else ""))
        for note in p.get("notes", []):
            lines += ["", note]
        if p.get("rows"):
            lines += ["", RENDER[p["key"]](p)]
        if p.get("error"):
            lines += ["", "```", p["error"][-1500:].rstrip(), "```"]
        elif p.get("log_tail"):
            lines += ["", "Last output:", "", "```", p["log_tail"][-1500:].rstrip(), "```"]
    return "\n".join(lines)


# -- the suite -------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the same script on the CPU, tiny shapes")
    p.add_argument(
        "--out",
        help="folder for gpu_<device>.{md,json,log} (default: benchmarks/results"
        "; a dry run: a new temporary folder)",
    )
    p.add_argument("--parts", default="1,2,3,4,5,6", help="parts to run, e.g. 2,3 (default: all)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=TOTAL_S,
        help="the suite's time limit in seconds (default 480); the caps scale with it",
    )
    p.add_argument(
        "--cap",
        type=parse_size,
        default=24 * GIB,
        help="device memory cap of parts 3 and 4 (default 24GiB)",
    )
    p.add_argument(
        "--host-ram",
        type=parse_size,
        default=None,
        help="host memory the ZeRO runs may plan with (default: MemTotal)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ctx", help=argparse.SUPPRESS)
    p.add_argument("--run-spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child or args.run_spec:
        import _gpu_parts

        if args.child:
            return _gpu_parts.child_main(args.child, args.ctx)
        return _gpu_parts.run_spec_main(args.run_spec, args.result)
    try:
        selected = {int(x) for x in args.parts.split(",") if x.strip()}
    except ValueError:
        print(f"error: --parts takes numbers 1-6 separated by commas; got {args.parts!r}")
        return 2
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device here. Run with --dry-run to check the script on the CPU.")
            return 2
    started = time.time()
    device = probe_device(args.dry_run)
    name = "dry_run_cpu" if args.dry_run else slug(device["name"])
    if args.out:
        out_dir = Path(args.out)
    elif args.dry_run:
        out_dir = Path(tempfile.mkdtemp(prefix="gpu_suite_dry_"))
    else:
        out_dir = RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_work_"))
    log = out_dir / f"gpu_{name}.log"
    log.write_text(f"gpu_suite {datetime.datetime.now().isoformat(timespec='seconds')}\n")
    scale = args.budget_s / TOTAL_S
    host_ram = args.host_ram or _host_ram()
    base_ctx = {
        "dry_run": args.dry_run,
        "device": "cpu" if args.dry_run else "cuda",
        "device_name": device["name"],
        "profile": PROFILES["dry" if args.dry_run else "gpu"],
        "work_dir": str(work),
        "host_ram_bytes": host_ram,
        "cap_bytes": args.cap,
        "prebuild_done": "",
    }
    prebuild = None
    if 4 in selected:
        prebuild, flag = start_prebuild(work, log)
        base_ctx["prebuild_done"] = str(flag)
    command = "python benchmarks/gpu_suite.py" + " ".join(
        [""] + [a for a in (argv if argv is not None else sys.argv[1:])]
    )
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "dry_run": args.dry_run,
        "command": command,
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "device": device,
        "environment": environment(),
        "budget_s": args.budget_s,
        "cap_bytes": args.cap,
        "host_ram_bytes": host_ram,
        "parts": [],
    }
    children: dict[str, Child] = {}
    pytest_child: Child | None = None
    entries: dict[str, dict[str, Any]] = {}

    def skip(entry: dict[str, Any], reason: str) -> None:
        entry.update(status="skipped", reason=reason, seconds=0.0)

    def prewarm(after: int) -> None:
        """Start the next selected part's process, so it imports while this one runs."""
        for nxt in PARTS[after:]:
            if nxt.number in selected and nxt.key != "pytest":
                if nxt.key not in children:
                    children[nxt.key] = Child.part(nxt.key, work)
                return

    def collect_pytest() -> None:
        nonlocal pytest_child
        if pytest_child is None:
            return
        res = finish_pytest(pytest_child, args.dry_run, work, log)
        entries["pytest"].update(res, seconds=time.time() - pytest_child.started)
        p1, pytest_child = entries["pytest"], None
        print(f"[1/6] {p1['title']}: {p1['status']}: {p1.get('headline') or p1['reason']}")

    try:
        for part in PARTS:
            entry: dict[str, Any] = {
                "number": part.number,
                "key": part.key,
                "title": part.title,
                "cap_s": part.cap_s * scale,
                "rows": [],
                "figures": {},
                "notes": [],
            }
            data["parts"].append(entry)
            entries[part.key] = entry
        for part in PARTS:
            entry = entries[part.key]
            if part.number not in selected:
                skip(entry, "not selected (--parts)")
                continue
            if part.key in TIMED:
                collect_pytest()  # nothing runs alongside a part that measures time
            left = args.budget_s - (time.time() - started)
            if left < part.min_s * scale:
                skip(
                    entry,
                    f"would pass the {args.budget_s:.0f} s limit: {max(0, left):.0f} s left, "
                    f"the part needs at least {part.min_s * scale:.0f} s",
                )
                if part.key in children:
                    children.pop(part.key).kill()
                continue
            timeout = min(entry["cap_s"], left)
            print(f"[{part.number}/6] {part.title} (cap {timeout:.0f} s)", flush=True)
            if part.key == "pytest":
                # alongside part 2 (no part that times anything runs while it does)
                pytest_child = start_pytest(args.dry_run, work)
                pytest_child.go(None, timeout)
                prewarm(part.number)
                continue
            ctx = dict(base_ctx)
            if args.dry_run and part.key in DRY_CAPS:
                ctx["cap_bytes"] = DRY_CAPS[part.key]
            entry["cap_bytes"] = ctx["cap_bytes"] if part.key in DRY_CAPS else None
            child = children.pop(part.key, None) or Child.part(part.key, work)
            child.go(ctx, timeout)
            prewarm(part.number)
            entry.update(finish_part(child, log))
            entry["seconds"] = time.time() - child.started
            print(
                f"      {entry['status']}: {entry.get('headline') or entry.get('reason', '')}",
                flush=True,
            )
            collect_pytest()
        collect_pytest()  # when part 1 ran alone
    finally:
        for child in [*children.values(), *([pytest_child] if pytest_child else [])]:
            child.kill()
        if prebuild is not None and prebuild.poll() is None:
            _kill_group(prebuild)
        data["total_s"] = time.time() - started
        text = markdown(data)
        md, js = save_results(out_dir / f"gpu_{name}", text, data, echo=False)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {md}, {js} and {log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
