"""The benchmark scripts write their results through ``benchmarks/_results.py`` only.

Every script saves its ``.md``/``.json`` pair with ``save_results`` and names the environment
with ``environment()``; this scans the sources (no import, no torch) so a script that writes a
results file itself again is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

#: Files allowed to write JSON themselves, and why.
ALLOWED = {
    "_results.py": "the one place the .md/.json pair is written",
    "gpu/common.py": "device-side part files handed back to gpu/suite.py (the Recorder)",
    "gpu/run.py": "a real run's spec and result files, between a part and its run process",
    "gpu/processes.py": "the context file handed to a device-side child, DeepSpeed's build flag "
    "(the suite's results go through _results)",
    "site/make_index.py": "reads the results files and writes docs/index.md (no results of its own)",
    "site/charts.py": "reads the results files and draws docs/img (no results of its own)",
}

SCRIPTS = sorted(
    p for p in BENCHMARKS.rglob("*.py") if p.relative_to(BENCHMARKS).as_posix() not in ALLOWED
)


def _mentions(node: ast.AST, test) -> bool:
    return any(test(n) for n in ast.walk(node))


def _is_json_dumps(n: ast.AST) -> bool:
    return (
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "dumps"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "json"
    )


def _is_result_suffix(n: ast.AST) -> bool:
    return (
        isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and n.value.endswith((".json", ".md"))
    )


def result_writes(source: str) -> list[int]:
    """Line numbers where ``source`` writes JSON, or a ``.json``/``.md`` file, by itself."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr = node.func.attr
        if (
            attr == "dump"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "json"
        ):
            lines.append(node.lineno)
        elif attr in ("write_text", "write") and (
            any(_mentions(a, _is_json_dumps) for a in node.args)
            or _mentions(node.func.value, _is_result_suffix)
        ):
            lines.append(node.lineno)
    return lines


def test_scanner_finds_the_ways_a_script_wrote_results():
    src = (
        "import json\n"
        "(out / 'x.json').write_text(json.dumps(d))\n"
        "out.with_suffix('.md').write_text(text)\n"
        "json.dump(d, f)\n"
        "print('RESULT ' + json.dumps(d))\n"  # a child's stdout line, not a file
        "save_results(out, text, d)\n"
    )
    assert result_writes(src) == [2, 3, 4]


def test_there_are_scripts_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"batch_size.py", "optimizers.py", "zero_offload.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(BENCHMARKS).as_posix())
def test_benchmark_saves_through_results_module(script: Path):
    source = script.read_text()
    assert result_writes(source) == [], (
        f"{script.name} writes results itself; use _results.save_results(path, text, data)"
    )
    if "benchmarks/results" in source:
        assert "from benchmarks._results import" in source, (
            f"{script.name} saves results without _results"
        )
