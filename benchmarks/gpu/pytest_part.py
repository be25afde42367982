"""Part 1 of the GPU suite, ``pytest -m gpu``: run in a process of its own (collected only in a
dry run), and its outcome read back from pytest's JUnit XML or ``--co`` output. Standard library
only (the suite's parent process runs it).
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.gpu.processes import Child, tail

__all__ = [
    "PYTEST",
    "finish_pytest",
    "gpu_test_files",
    "parse_collect_only",
    "parse_junit",
    "start_pytest",
]

ROOT = Path(__file__).resolve().parents[2]


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


def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    """The test files that carry a ``gpu`` mark (``pytest.mark.gpu`` in their text), relative to
    the repository; ``["tests"]`` when none does. ``-m gpu`` deselects every test of the other
    files, so collecting them only costs their imports (a minute for the whole folder)."""
    files = [
        f.relative_to(tests.parent).as_posix()
        for f in sorted(tests.rglob("test_*.py"))  # the test folders mirror the package
        if "mark.gpu" in f.read_text(errors="replace")
    ]
    return files or [tests.name]


def start_pytest(dry_run: bool, work: Path) -> Child:
    cmd = [sys.executable, *PYTEST, f"--junitxml={work / 'pytest.xml'}"]
    if dry_run:
        cmd.append("--co")
    return Child("pytest", [*cmd, *gpu_test_files()], work)


def finish_pytest(child: Child, dry_run: bool, work: Path, log: Path) -> dict[str, Any]:
    code, timed_out = child.finish(log)
    text = tail(child.out_file, 200_000)
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
