"""No alias before the first release (issue 50): every module, name and parameter has one path.

Read from the code itself, as ``tests/test_layers.py`` reads the floors: no module that only
re-exports one other package (an alias module), no entry written into ``sys.modules`` (an old
path kept alive as the same module object), no ``DeprecationWarning`` (an old name or parameter
kept working), and after importing every module each ``lightning_efficient.*`` entry of
``sys.modules`` is the module of that name."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

PACKAGE = "lightning_efficient"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
#: Alias modules kept for a while (none: every alias went with issue 50). A module listed here
#: must exist; delete it and its entry together.
PENDING: set[str] = set()


def _body(tree: ast.Module) -> list[ast.stmt]:
    """Statements other than the docstring and ``from __future__`` imports."""
    return [
        node
        for node in tree.body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
    ]


def _is_alias(source: str) -> bool:
    """Defines nothing (imports and ``__all__`` only) and imports from one package only."""
    body = _body(ast.parse(source))
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    rest = [n for n in body if not isinstance(n, ast.ImportFrom)]
    if not imports or any(
        not (isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__all__"])
        for n in rest
    ):
        return False
    return len({".".join((n.module or "").split(".")[:2]) for n in imports}) == 1


def _sys_modules_writes(source: str) -> list[int]:
    """Lines that write ``sys.modules`` (item assignment, ``update``, ``setdefault``)."""

    def is_sys_modules(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "modules"
            and (getattr(node.value, "id", "") == "sys")
        )

    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Subscript) and is_sys_modules(t.value) for t in targets):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("update", "setdefault") and is_sys_modules(node.func.value):
                found.append(node.lineno)
    return found


def test_the_rules_see_what_they_look_for() -> None:
    alias = '"""Old path."""\nfrom pkg.rooms import a\nfrom pkg.rooms.b import c\n__all__ = ["a", "c"]\n'
    facade = "from pkg.one import a\nfrom pkg.two import b\n__all__ = ['a', 'b']\n"
    assert _is_alias(alias) and not _is_alias(facade) and not _is_alias("def f():\n    pass\n")
    registry = "import sys\nfor n, m in T.items():\n    sys.modules[f'pkg.{n}'] = m\n"
    assert _sys_modules_writes(registry) == [3]
    assert _sys_modules_writes("import sys\nsys.modules.update(T)\nm = sys.modules.get('x')\n") == [
        2
    ]


def test_no_alias_module() -> None:
    found = {  # a package's __init__ is its face: it re-exports its own modules by design
        m for m, path in FILES.items() if path.name != "__init__.py" and _is_alias(path.read_text())
    }
    assert found - PENDING == set(), f"alias modules (import from the real path): {found - PENDING}"
    assert PENDING <= found, f"gone, so drop them from PENDING: {PENDING - found}"


def test_no_sys_modules_alias() -> None:
    found = {m: lines for m, p in FILES.items() if (lines := _sys_modules_writes(p.read_text()))}
    assert not found, f"sys.modules written (an old path kept alive): {found}"
    for module in FILES:
        if not module.endswith("__main__"):  # runs the command line when imported
            importlib.import_module(module)
    wrong = {
        name: module.__name__
        for name, module in list(sys.modules.items())
        if name.startswith(f"{PACKAGE}.") and module is not None and module.__name__ != name
    }
    assert not wrong, f"sys.modules entries that are another module: {wrong}"


def test_no_deprecation_warning() -> None:
    """An old name or parameter kept working warns with ``DeprecationWarning``: none is left."""
    found = [
        f"{m}: line {node.lineno}"
        for m, path in FILES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and node.id in ("DeprecationWarning", "FutureWarning")
    ]
    assert not found, "deprecated names or parameters (delete them: nothing is released):\n" + (
        "\n".join(found)
    )
