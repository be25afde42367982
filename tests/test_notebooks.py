"""The tutorials: every notebook runs from a clean kernel in its short mode (the cell tagged
``parameters`` gets ``SHORT = True``; a failing cell, including the notebook's own asserts of the
effect it shows, fails the test), from a working folder that is not the repository's (a notebook
finds the repository's files from the package's location, not from where it is started), leaves
no file in the repository or in the temporary folder, and draws at least one chart, which its
full mode saves as a PNG. Without the `notebooks` extra the file is skipped, with the reason."""

import ast
import os
from pathlib import Path

import pytest

_EXTRA = (
    "the tutorials' tests need the notebooks extra: pip install 'lightning-efficient[notebooks]'"
)
nbformat = pytest.importorskip("nbformat", reason=_EXTRA)
matplotlib = pytest.importorskip("matplotlib", reason=_EXTRA)
NotebookClient = pytest.importorskip("nbclient", reason=_EXTRA).NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TUTORIALS = [
    "01_quickstart",
    "02_fit_a_bigger_model",
    "03_speed",
    "04_fewer_steps",
    "05_cli_and_scale_out",
    "07_finetuning",
]
#: Over ~20 s on 2 idle cores in the short mode (many fake-tensor estimates; CLI subprocesses,
#: two of them DDP ranks); the others stay in the quick loop.
SLOW = {"01_quickstart", "02_fit_a_bigger_model", "05_cli_and_scale_out", "07_finetuning"}
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}


def _files(root: Path) -> set[Path]:
    out = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        out.update(Path(folder, f).relative_to(root) for f in files)
    return out


def _cells(path: Path) -> tuple[nbformat.NotebookNode, list[nbformat.NotebookNode]]:
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    return nb, params


def test_the_tutorials_are_there() -> None:
    assert [p.stem for p in NOTEBOOKS] == TUTORIALS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_shape(path: Path) -> None:
    """One `parameters` cell with SHORT = False, a chart through `show`, asserts of the effect."""
    nb, params = _cells(path)
    assert len(params) == 1 and params[0].source.startswith("SHORT = False"), path.name
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert 'matplotlib.use("Agg")' in code and "show(fig" in code, "draws no chart"
    assert code.count("assert ") >= 2, "asserts no effect"
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "saved with outputs"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_full_mode_saves_png(path: Path, tmp_path: Path) -> None:
    """The notebook's `show` (from its setup cell) writes the chart as a PNG when SHORT is False,
    and nothing when it is True."""
    nb, _ = _cells(path)
    setup = next(c.source for c in nb.cells if "def show(" in c.source)
    fn = next(
        n for n in ast.parse(setup).body if isinstance(n, ast.FunctionDef) and n.name == "show"
    )
    import io

    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    shown = []
    for short in (True, False):
        scope = {
            "SHORT": short,
            "OUT": tmp_path / "charts",
            "io": io,
            "plt": plt,
            "Image": lambda p: p,
            "display": shown.append,
        }
        exec(compile(ast.Module([fn], type_ignores=[]), path.name, "exec"), scope)
        fig, ax = plt.subplots()
        ax.bar(["a", "b"], [1, 2])
        scope["show"](fig, "chart")
        assert (tmp_path / "charts" / "chart.png").exists() is not short
    assert (tmp_path / "charts" / "chart.png").read_bytes()[:4] == b"\x89PNG" and shown


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.slow] if p.stem in SLOW else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_runs_short(path: Path, tmp_path: Path, monkeypatch) -> None:
    nb, params = _cells(path)
    params[0].source = "SHORT = True"
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile.gettempdir()
    # the kernel starts in a folder of its own, neither the repository's root nor notebooks/
    # (files written there are files left in the temporary folder, checked below)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = _files(ROOT)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()
    new = sorted(map(str, _files(ROOT) - before))
    assert not new, f"the notebook wrote files into the repository: {new}"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "files left in the temporary folder"
