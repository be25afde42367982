"""The method cards' examples are code, not prose: every Python block of every card parses and
its imports from this package resolve; the cards whose examples are complete programs run."""

import ast
import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).parents[2] / "docs"
CARDS = sorted(DOCS.glob("*.md"))
#: Cards whose Python blocks are complete, quick programs (run here, on CPU).
RUNNABLE = [
    "memory",
    "chunked_loss",
    "activation_checkpointing",
    "compile",
    "precision",
    "curriculum",
    "early_stopping",
    "profiling",
    "auto",
]


def python_blocks(card: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card.read_text(), flags=re.S)


def test_every_technique_module_has_a_card() -> None:
    import lightning_efficient.techniques as techniques

    folder = Path(techniques.__file__).parent
    modules = [p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")]
    modules += [p.parent.name for p in folder.glob("*/__init__.py")]  # packages count too
    assert {"batch_size", "dataloading", "activation_checkpointing"} <= set(modules), modules
    missing = [m for m in modules if not (DOCS / f"{m}.md").exists()]
    assert not missing, f"techniques without a method card in docs/: {missing}"


@pytest.mark.parametrize("card", CARDS, ids=[c.stem for c in CARDS])
def test_card_examples_parse_and_import(card: Path) -> None:
    for code in python_blocks(card):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "lightning_efficient"
            ):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{card.name}: {node.module} has no {missing}"


@pytest.mark.parametrize("name", RUNNABLE)
def test_card_examples_run(name: str, capsys) -> None:
    blocks = python_blocks(DOCS / f"{name}.md")
    assert blocks, f"docs/{name}.md has no Python example"
    for code in blocks:
        exec(compile(code, f"docs/{name}.md", "exec"), {})
    if name == "memory":  # the example prints the estimate's summary line
        out = capsys.readouterr().out
        assert out.startswith("peak ") and "activations" in out


def _card_of(cls: type) -> Path:
    parts = cls.__module__.split(".")
    name = parts[2] if parts[1] == "techniques" else parts[-1]
    return DOCS / f"{CARD_OF_MODULE.get(name, name)}.md"


#: measuring callbacks documented in a card named after what they measure
CARD_OF_MODULE = {"profiler": "profiling", "input_stall": "memory", "breakdown": "memory"}


def test_every_card_lists_the_bad_inputs_each_argument_refuses() -> None:
    import inspect

    from lightning_efficient import TECHNIQUES

    for cls in TECHNIQUES:
        card = _card_of(cls)
        assert card.exists(), f"{cls.__name__}: no card {card.name}"
        section = re.search(r"^## Bad input.*?(?=^## |\Z)", card.read_text(), flags=re.S | re.M)
        assert section, f"{card.name} has no '## Bad inputs refused' section"
        params = [
            name
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        missing = [p for p in params if f"`{p}" not in section.group(0)]
        assert not missing, (
            f"{card.name}: arguments of {cls.__name__} not in its bad-input list: {missing}"
        )


def test_index_is_generated() -> None:
    """docs/index.md is what `python -m benchmarks.site.make_index` writes from the registry and the
    benchmark results now (re-run the script after a benchmark or a new technique)."""
    from benchmarks.site import make_index

    assert (DOCS / "index.md").read_text() == make_index.render(), (
        "docs/index.md is stale: run python -m benchmarks.site.make_index"
    )
    from lightning_efficient import TECHNIQUES

    text = (DOCS / "index.md").read_text()
    assert all(f"`{t.__name__}`" in text for t in TECHNIQUES)
    for link in re.findall(r"\]\(([^)#]+)\)", text):  # every card, notebook and results file
        assert (DOCS / link).resolve().exists(), link


#: A benchmark's command as the docs write it, and the old way (a script path) that no longer runs.
BENCHMARK_COMMAND = re.compile(r"python3? -m (benchmarks(?:\.\w+)+)(\.<\w+>)?")
SCRIPT_COMMAND = re.compile(r"python3? benchmarks/[\w/]+\.py")


def benchmark_command_faults(text: str, root: Path) -> list[str]:
    """The benchmark commands in ``text`` that would not run from ``root``: a module that is not
    there, or a script path (benchmarks run as modules, ``python -m benchmarks.<name>``)."""
    faults = [f"{m}: run it as python -m benchmarks.<name>" for m in SCRIPT_COMMAND.findall(text)]
    for module, placeholder in BENCHMARK_COMMAND.findall(text):
        if placeholder:  # `python -m benchmarks.gpu.<part>`: a pattern, not a command
            continue
        path = root.joinpath(*module.split("."))
        if not path.with_suffix(".py").exists():
            faults.append(f"python -m {module}: no {path.relative_to(root)}.py")
    return faults


def test_benchmark_commands_name_modules_that_exist(tmp_path) -> None:
    """Every benchmark command in the cards, the READMEs, the notebooks and the benchmarks'
    own docstrings names a module of ``benchmarks/`` (checked to fail on a moved script)."""
    root = DOCS.parent
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "here.py").write_text("")
    assert benchmark_command_faults(
        "python -m benchmarks.here\npython -m benchmarks.gone --quick\npython benchmarks/x.py\n"
        "python -m benchmarks.here.<name>",
        tmp_path,
    ) == [
        "python benchmarks/x.py: run it as python -m benchmarks.<name>",
        "python -m benchmarks.gone: no benchmarks/gone.py",
    ]
    files = [
        *DOCS.glob("*.md"),
        root / "README.md",
        root / "benchmarks" / "README.md",
        *(root / "notebooks").glob("*.ipynb"),
        *(root / "benchmarks").rglob("*.py"),
    ]
    found = {
        f.relative_to(root).as_posix(): benchmark_command_faults(f.read_text(), root) for f in files
    }
    assert sum(len(BENCHMARK_COMMAND.findall(f.read_text())) for f in files) > 30, "commands read"
    faults = [f"{name}: {fault}" for name, faults in found.items() for fault in faults]
    assert not faults, "\n".join(faults)
