"""The tutorials: every notebook runs in its short mode (the cell tagged ``parameters`` gets
``SHORT = True``; a failing cell, including the notebook's own asserts of the effect it shows,
fails the test) from an empty kernel namespace (one kernel serves the module's short runs, emptied
with ``%reset -f`` before each, as a kernel's imports cost ~11 CPU-s; ``make_notebooks.py`` writes
the committed outputs from a fresh kernel per notebook), from a working folder that is not the
repository's (a notebook finds the repository's files from the package's location, not from where
it is started), leaves no file in the repository or in the temporary folder, and draws at least
one chart, which its full mode saves as a PNG. The committed notebooks hold the outputs of that
short run (``python -m benchmarks.site.make_notebooks`` writes them): every chart cell an image, small
PNGs, no stderr or widget state, and the same outputs, cell by cell, as a run of the current code
gives. Without the `notebooks` extra the file is skipped, with the reason."""

import ast
import base64
import os
from pathlib import Path

import pytest

_EXTRA = (
    "the tutorials' tests need the notebooks extra: pip install 'lightning-efficient[notebooks]'"
)
nbformat = pytest.importorskip("nbformat", reason=_EXTRA)
matplotlib = pytest.importorskip("matplotlib", reason=_EXTRA)
pytest.importorskip("nbclient", reason=_EXTRA)

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TUTORIALS = [
    "01_quickstart",
    "02_fit_a_bigger_model",
    "03_speed",
    "04_fewer_steps",
    "05_cli_and_scale_out",
    "06_packing",
    "07_finetuning",
]
#: Over ~20 s on 2 idle cores in the short mode (many fake-tensor estimates; CLI subprocesses,
#: two of them DDP ranks; transformers imported in the kernel); the others stay in the quick loop.
SLOW = {
    "01_quickstart",
    "02_fit_a_bigger_model",
    "05_cli_and_scale_out",
    "06_packing",
    "07_finetuning",
}
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
#: Limits on what a committed notebook holds: each chart, and the whole file.
MAX_PNG_BYTES, MAX_NOTEBOOK_BYTES = 150_000, 1_000_000


def _make_notebooks():
    from benchmarks.site import make_notebooks

    return make_notebooks


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_the_short_runs_outputs(path: Path) -> None:
    """Committed as `benchmarks/site/make_notebooks.py` writes it: every cell that calls `show(fig`
    holds a PNG (at least one per notebook), each under the size limit, every other code cell run
    (an execution count), the parameters cell's note, no stderr, no widget state."""
    nb, params = _cells(path)
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size:,} bytes"
    assert params[0].outputs[0].text == _make_notebooks().NOTE, "not written by make_notebooks.py"
    assert "widgets" not in nb.metadata
    charts = 0
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        assert cell.execution_count or cell is params[0], f"a cell never ran:\n{cell.source[:200]}"
        assert not [o for o in cell.outputs if o.get("name") == "stderr"], "stderr committed"
        pngs = [o.data["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
        if "show(fig" in cell.source and "def show(" not in cell.source:
            assert pngs, f"{path.name}: a chart cell without its image:\n{cell.source[:200]}"
        for png in pngs:
            raw = base64.b64decode(png)
            assert raw[:4] == b"\x89PNG" and len(raw) < MAX_PNG_BYTES, len(raw)
        charts += len(pngs)
    assert charts >= 1, f"{path.name} shows no chart"


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
            "Image": lambda p=None, data=None: data if p is None else Path(p).read_bytes(),
            "display": shown.append,
        }
        exec(compile(ast.Module([fn], type_ignores=[]), path.name, "exec"), scope)
        fig, ax = plt.subplots()
        ax.bar(["a", "b"], [1, 2])
        scope["show"](fig, "chart")
        assert (tmp_path / "charts" / "chart.png").exists() is not short
    assert (tmp_path / "charts" / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert len(shown) == 2 and all(png[:4] == b"\x89PNG" for png in shown)  # inline both times


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    """One Jupyter kernel for the short runs of this module (of each pytest worker): a kernel's
    imports (torch, Lightning) cost ~11 CPU-s; each notebook runs after ``%reset -f``, from its own
    working folder and ``TMPDIR`` (``make_notebooks.RESET``). A kernel a notebook killed is
    started again."""
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path_factory.mktemp("kernel")))

    class Shared:
        def get(self) -> KernelManager:
            if not manager.is_alive():
                manager.restart_kernel(now=True)
            return manager

    yield Shared()
    manager.shutdown_kernel(now=True)


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.slow] if p.stem in SLOW else []) for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_runs_short(path: Path, tmp_path: Path, kernel) -> None:
    """The short run passes, writes nothing, and gives the committed notebook's outputs: the same
    kinds (text, image) in every cell (timings and tiny models' figures vary between machines)."""
    make_notebooks = _make_notebooks()
    before = _files(ROOT)
    ran = make_notebooks.execute_short(path, tmp_path, timeout=600, kernel=kernel.get())
    new = sorted(map(str, _files(ROOT) - before))
    assert not new, f"the notebook wrote files into the repository: {new}"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "files left in the temporary folder"
    committed = nbformat.read(path, as_version=4)
    assert [c.source for c in ran.cells] == [c.source for c in committed.cells]
    assert make_notebooks.output_kinds(ran) == make_notebooks.output_kinds(committed), (
        f"{path.name}'s outputs are stale: run python -m benchmarks.site.make_notebooks {path.stem}"
    )
