"""The benchmarks' house rules, read from their code (every import, inside functions too): no
private module or private name of the package imported (benchmarks use the package as a user
does), and the GPU suite's modules under 600 lines each. Their import rules (no ``sys.path``
edit, no cycle, nothing of tests/, no script importing another) are gates in test_layers.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PACKAGE = "lightning_efficient"
SCRIPTS = {
    ".".join(p.relative_to(BENCHMARKS.parent).with_suffix("").parts): p
    for p in sorted(BENCHMARKS.rglob("*.py"))
}


def _imported(source: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``source`` (names: what ``from`` takes)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or "", [a.name for a in node.names]))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str) -> list[str]:
    """Imports of a private module of the package (a dotted part starting with ``_``) or of a
    private name from it."""
    bad = []
    for line, module, names in _imported(source):
        if module.split(".")[0] != PACKAGE:
            continue
        if any(_private(part) for part in module.split(".")[1:]):
            bad.append(f"line {line}: {module}")
        bad += [f"line {line}: {module}.{n}" for n in names if _private(n)]
    return bad


def test_the_rule_sees_what_it_looks_for() -> None:
    source = (
        "from lightning_efficient.techniques._blocks import find_repeated_blocks\n"
        "def f():\n"
        "    from lightning_efficient.core import _internals\n"
        "    from lightning_efficient.measure.speed.flops import _NAME_PATTERNS, gpu_peak\n"
        "    import lightning_efficient.techniques._compile_scope\n"
        "from lightning_efficient.measure.memory.peak import PeakMemory\n"
        "from lightning_efficient import __version__\n"
    )
    assert sorted(private_imports(source)) == [
        "line 1: lightning_efficient.techniques._blocks",
        "line 3: lightning_efficient.core._internals",
        "line 4: lightning_efficient.measure.speed.flops._NAME_PATTERNS",
        "line 5: lightning_efficient.techniques._compile_scope",
    ]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_benchmark_imports_no_private_module(name: str) -> None:
    found = private_imports(SCRIPTS[name].read_text())
    assert not found, f"{name} imports private parts of the package:\n" + "\n".join(found)


@pytest.mark.parametrize("name", sorted(n for n in SCRIPTS if n.startswith("benchmarks.gpu.")))
def test_gpu_suite_modules_are_small(name: str) -> None:
    lines = len(SCRIPTS[name].read_text().splitlines())
    assert lines <= 600, f"{name} has {lines} lines (at most 600)"
