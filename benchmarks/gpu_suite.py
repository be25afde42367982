"""The one prepared GPU run: the project's headline figures measured on one CUDA device.

    python benchmarks/gpu_suite.py                 # on a CUDA machine, at most 9 minutes
    python benchmarks/gpu_suite.py --dry-run       # the same script on the CPU, tiny shapes

Six parts, each in its own process with its own time cap (a part that would pass the suite's
limit is skipped and says so; a failure in one does not stop the others). DeepSpeed's CPU
extensions are built first, in a process of their own that no part's cap counts; the parts that
measure memory or correctness (1-4) run side by side, each within its own caps, and the parts
that time something (5, 6) run alone afterwards:

1. ``pytest -m gpu``: the GPU-marked tests (dry run: collected only, ``--co``).
2. Estimate vs reality: HF GPT-2 124M and TinyGPT at GPT-2 small shape, sequence 1024, for
   fp32, bf16-mixed, + checkpointing, + adamw8bit: ``estimate_memory``'s peak against
   ``torch.cuda.max_memory_allocated`` of the same two Lightning steps (goal: within 10%).
3. Largest micro-batch within a 24 GiB cap: plain fp32 vs the planner's stack (``plan_stack``):
   the estimate's pick, and the real largest found by real steps (each size in its own process
   under ``torch.cuda.set_per_process_memory_fraction``, several side by side).
4. Largest GPT-2-shaped model at batch 1 x 1024 within the cap: plain vs ZeRO-2 and ZeRO-3
   with CPU offload (``ZeROOffload``), real steps at the estimate's choice.
5. Speed, one lever at a time (issue 29): tokens/s, step time and MFU of TinyGPT at GPT-2
   124M shape from plain fp32 Lightning through bf16-mixed, TF32, fused AdamW, compile
   (``TorchCompile(scope="auto")``: both scopes measured, its choice kept), a larger
   micro-batch (the effective batch kept), the chunked loss and CUDA graphs; each row's
   ``StepProfiler`` verdict, and the profiler's own cost on the last stack.
6. Compile: regional vs whole-model compile time and steady step time, and the auto choice.

Writes ``gpu_<device>.md``, ``.json`` and ``.log`` to ``--out`` (default
``benchmarks/results``; a dry run writes to a temporary folder unless ``--out`` is given). The
output format and the caps are described in ``benchmarks/README.md``.

This parent process imports no torch for the parts: it starts them, enforces their caps and
writes the results. The parts, their caps and the script each part's process runs are one
registry, ``benchmarks/_gpu_registry.py`` (standard library only); the measuring code is in those
scripts (``_gpu_estimate.py``, ``_gpu_batch.py``, ``_gpu_ladder.py``, ``_gpu_speed.py``,
``_gpu_compile.py``) over ``_gpu_common.py`` and ``_gpu_run.py`` (a real run and its processes).
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
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the package and the benchmarks' helpers, whether or not the package is installed (on the GPU
# machine it is not: the repository is the package)
for _path in (ROOT, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _gpu_registry import (  # noqa: E402
    BUILD_WAIT_S,
    PARTS,
    PHASE_A,
    PHASE_B,
    Part,
)
from _results import environment, fmt_bytes, save_results, table  # noqa: E402

RESULTS = HERE / "results"
FORMAT_VERSION = 2
TOTAL_S = 540.0  # 9 minutes, on a cold GPU machine
GIB = 2**30


# -- the shapes of a GPU run and of a dry run ------------------------------------------------------
PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        "seq": 1024,
        "vocab": 50257,
        "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
        "estimate_batch": 8,
        "batch_top": 256,
        "planner_batch": 32,
        # issue 31: AutoEfficient(budget=cap) at this effective batch for this many steps
        "auto_batch": 128,
        "auto_steps": 100,
        "auto_need_s": 90.0,
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
        "speed_accumulate": 2,
        "speed_steps": 300,
        "speed_warmup": 5,
        "speed_window_s": 3.0,
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
        "auto_batch": 60,  # divisors 20, 30, 60: near the real largest (about 31)
        "auto_steps": 3,
        "auto_need_s": 10.0,
        "ladder": [["tiny-1", 1, 64], ["tiny-2", 2, 64], ["tiny-3", 2, 128], ["tiny-4", 4, 128]],
        "ladder_seq": 64,
        "ladder_vocab": 512,
        "speed_batch": 4,
        "speed_accumulate": 2,
        "speed_steps": 6,
        "speed_warmup": 2,
        "speed_window_s": 3.0,
        "compile_batch": 4,
        "compile_repeats": 3,
        "compile_backend": "aot_eager",
        "compile_precision": "32-true",
        "real_steps": 2,
    },
}


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


# -- DeepSpeed's CPU extensions: built first, in a process of their own -------------------------------
PREBUILD = """
import json, os, sys, time
t0, flag, out = time.time(), sys.argv[1], {}
try:
    from lightning_efficient.techniques.zero_offload.extensions import ensure_extensions
    done = ensure_extensions()
    out["status"] = "ok"
    out["extensions"] = [
        {"name": e.name, "status": e.status, "seconds": round(e.seconds, 1)} for e in done
    ]
except BaseException as err:
    out["status"] = "failed to build: " + type(err).__name__ + ": " + str(err)[:300]
    raise
finally:
    out["seconds"] = round(time.time() - t0, 1)
    with open(flag + ".tmp", "w") as f:
        f.write(json.dumps(out))
    os.replace(flag + ".tmp", flag)
"""


class Build:
    """DeepSpeed's CPU extensions (``ensure_extensions``, what ``lightning-efficient prepare``
    runs), built in a process the suite starts before any part: a cold machine compiles
    ``cpu_adam`` for minutes. Only part 4's ZeRO rows wait for it, and that wait is not charged
    to part 4's cap. It writes ``prebuild.json`` (status, seconds, extensions) when it ends."""

    def __init__(self, work: Path, log: Path) -> None:
        from importlib.util import find_spec

        self.flag = work / "prebuild.json"
        self.started = time.time()
        self.proc: subprocess.Popen | None = None
        if find_spec("deepspeed") is None:
            self.flag.write_text(json.dumps({"status": "not installed", "seconds": 0.0}))
            return
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PREBUILD, str(self.flag)],
                cwd=ROOT,
                env=_child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def ended_at(self) -> float | None:
        if self.flag.exists():
            return self.flag.stat().st_mtime
        if self.proc is not None and self.proc.poll() is not None:
            return time.time()
        return None

    def info(self) -> dict[str, Any]:
        try:
            return json.loads(self.flag.read_text())
        except (OSError, ValueError):
            ended = self.proc is not None and self.proc.poll() is not None
            status = "its process died" if ended else "still building (stopped)"
            return {"status": status, "seconds": round(time.time() - self.started, 1)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc)


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


LOG_LOCK = threading.Lock()


class Child:
    """One process of the suite (pytest, or a part): started early, timed from ``go()``.

    A part's process is started when the suite starts, so that it imports torch and Lightning
    while other parts run; it waits for its context file, which ``go()`` writes with the
    deadline. ``finish()`` waits until the cap (plus a grace: part 4's wait for DeepSpeed's
    build) and kills the process group if it is still running (the part's own run processes and
    loader workers with it)."""

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
    def part(cls, part: Part, work: Path) -> Child:
        """The process of ``part``: its script (``_gpu_registry.PARTS``), waiting for its context."""
        ctx_file = work / f"ctx_{part.key}.json"
        return cls(part.key, [sys.executable, str(part.path), "--ctx", str(ctx_file)], work)

    def go(self, ctx: dict[str, Any] | None, timeout: float) -> None:
        self.started, self.timeout = time.time(), timeout
        if ctx is not None:
            ctx = dict(ctx, deadline=self.started + timeout - 8, result_file=str(self.result_file))
            tmp = self.ctx_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ctx))
            os.replace(tmp, self.ctx_file)  # the waiting child sees a complete file

    def finish(self, log: Path, grace: Any = None) -> tuple[int | None, bool]:
        """Wait for the end or the cap (plus ``grace()`` seconds: time not charged to it);
        ``(exit code, timed out)``. Appends the output to ``log``."""
        while True:
            code = self.proc.poll()
            if code is not None:
                timed_out = False
                break
            if time.time() > self.started + self.timeout + (grace() if grace else 0.0):
                self.kill()
                code, timed_out = None, True
                break
            time.sleep(0.2)
        with LOG_LOCK, open(log, "a") as f:
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
        result.update(
            status="timeout", reason=f"stopped at its {child.timeout:.0f} s cap (it needs more)"
        )
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


def finish_part(child: Child, log: Path, grace: Any = None) -> dict[str, Any]:
    code, timed_out = child.finish(log, grace)
    try:
        result = json.loads(child.result_file.read_text())
    except (OSError, ValueError):
        result = {"rows": [], "figures": {}, "notes": [], "status": "failed"}
        result["reason"] = f"the part's process exited with code {code} and no results"
    if timed_out:
        reason = f"stopped at its {child.timeout:.0f} s cap (it needs more)"
        result.update(status="timeout", reason=reason)
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


RENDER = {
    "pytest": _render_pytest,
    "estimate": _render_estimate,
    "batch": _render_batch,
    "ladder": _render_ladder,
    "speed": _render_speed,
    "compile": _render_compile,
}


def _seconds(p: dict[str, Any]) -> str:
    """A part's seconds, with the time it waited for DeepSpeed's build (not charged to its cap)."""
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
                    f"{p['cap_s']:.0f}",
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
            "(started first, alongside parts 1-3; not counted in any part's cap"
            + (f"; part 4 waited {waited:.0f} s for them" if waited is not None else "")
            + ").",
        ]
    lines += [
        "",
        "Parts 1-4 run side by side (1; 2 then 3; 4), parts 5 and 6 alone afterwards. A part not "
        "`ok` says why, and what its unfinished rows would have needed. Caps (at the default "
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
        help="the suite's time limit in seconds (default 540); the caps scale with it",
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
    p.add_argument(
        "--commit",
        default=None,
        help="the commit the results are of (default: git rev-parse; a copy of the checkout "
        "sent to a GPU machine may carry other git metadata)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
    name = "dry_run_cpu" if args.dry_run else None
    if args.out:
        out_dir = Path(args.out)
    elif args.dry_run:
        out_dir = Path(tempfile.mkdtemp(prefix="gpu_suite_dry_"))
    else:
        out_dir = RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_work_"))
    log = out_dir / "gpu_suite.log.tmp"
    log.write_text(f"gpu_suite {datetime.datetime.now().isoformat(timespec='seconds')}\n")
    # first of all, DeepSpeed's build: minutes on a cold machine, alongside parts 1-3
    build = Build(work, log) if 4 in selected else None
    device = probe_device(args.dry_run)
    name = name or slug(device["name"])
    scale = args.budget_s / TOTAL_S
    host_ram = args.host_ram or _host_ram()
    base_ctx = {
        "dry_run": args.dry_run,
        "device": "cpu" if args.dry_run else "cuda",
        "device_name": device["name"],
        "device_total_bytes": int(device.get("total_memory_bytes", 0)),
        "profile": PROFILES["dry" if args.dry_run else "gpu"],
        "work_dir": str(work),
        "host_ram_bytes": host_ram,
        "cap_bytes": args.cap,
        "prebuild_done": str(build.flag) if build else "",
    }
    command = "python benchmarks/gpu_suite.py" + " ".join(
        [""] + [a for a in (argv if argv is not None else sys.argv[1:])]
    )
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "dry_run": args.dry_run,
        "command": command,
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "commit": args.commit or _git_commit(),
        "device": device,
        "environment": environment(),
        "budget_s": args.budget_s,
        "cap_bytes": args.cap,
        "host_ram_bytes": host_ram,
        "parts": [],
    }
    entries: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        entries[part.key] = {
            "number": part.number,
            "key": part.key,
            "title": part.title,
            "lane": part.lane,
            "cap_s": part.cap_s * scale,
            "cap_basis": part.basis,
            "rows": [],
            "figures": {},
            "notes": [],
        }
        data["parts"].append(entries[part.key])
    chosen = [p for p in PARTS if p.number in selected]
    children: dict[str, Child] = {}
    say = threading.Lock()

    def grace_of(part: Part, since: float) -> Any:
        """Part 4's extra time: DeepSpeed's build after the part started (at most its wait)."""
        if part.key != "ladder" or build is None:
            return None

        def grace() -> float:
            end = build.ended_at() or time.time()
            return min(BUILD_WAIT_S * max(1.0, scale), max(0.0, end - since))

        return grace

    def run_one(part: Part) -> None:
        entry = entries[part.key]
        if part.number not in selected:
            entry.update(status="skipped", reason="not selected (--parts)", seconds=0.0)
            return
        # what the parts after this one must keep: the timed parts' caps for phase A, the
        # minimum of the later timed parts for a timed one
        later = [p for p in chosen if p.lane == PHASE_B and p.number > part.number]
        keep = sum((p.cap_s if part.lane != PHASE_B else p.min_s) * scale for p in later)
        left = args.budget_s - (time.time() - started) - keep
        if left < part.min_s * scale:
            entry.update(
                status="skipped",
                seconds=0.0,
                reason=f"would pass the {args.budget_s:.0f} s limit: {max(0, left):.0f} s left "
                f"for it, the part needs at least {part.min_s * scale:.0f} s "
                f"(its cap: {part.cap_s * scale:.0f} s)",
            )
            if part.key in children:
                children.pop(part.key).kill()
            return
        timeout = min(entry["cap_s"], left)
        with say:
            print(f"[{part.number}/6] {part.title} (cap {timeout:.0f} s)", flush=True)
        if part.key == "pytest":
            child = start_pytest(args.dry_run, work)
            child.go(None, timeout)
            entry.update(finish_pytest(child, args.dry_run, work, log))
        else:
            ctx = dict(base_ctx)
            if args.dry_run and part.key in DRY_CAPS:
                ctx["cap_bytes"] = DRY_CAPS[part.key]
            entry["cap_bytes"] = ctx["cap_bytes"] if part.key in DRY_CAPS else None
            child = children.pop(part.key, None) or Child.part(part, work)
            child.go(ctx, timeout)
            entry.update(finish_part(child, log, grace_of(part, child.started)))
        entry["seconds"] = time.time() - child.started
        with say:
            print(
                f"[{part.number}/6] {part.title}: {entry['status']}: "
                f"{entry.get('headline') or entry.get('reason', '')}",
                flush=True,
            )

    def lane(name: str) -> None:
        for part in PARTS:
            if part.lane == name:
                run_one(part)

    try:
        # every part's process starts now and imports while it waits for its turn
        for part in chosen:
            if part.key != "pytest":
                children[part.key] = Child.part(part, work)
        threads = [threading.Thread(target=lane, args=(n,), name=n) for n in PHASE_A]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if build is not None:
            build.stop()  # part 4 has ended: nothing needs it any more
        lane(PHASE_B)  # alone: nothing else of the suite runs while these time anything
    finally:
        for child in children.values():
            child.kill()
        data["total_s"] = time.time() - started
        if build is not None:
            build.stop()
            data["build"] = build.info()
            waited = entries["ladder"].get("figures", {}).get("build_wait_s")
            if waited is not None:
                data["build"]["part_4_waited_s"] = waited
        text = markdown(data)
        md, js = save_results(out_dir / f"gpu_{name}", text, data, echo=False)
        final_log = out_dir / f"gpu_{name}.log"
        os.replace(log, final_log)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {md}, {js} and {final_log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
