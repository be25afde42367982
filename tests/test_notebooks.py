"""Every tutorial notebook runs, in its short mode (the cell tagged ``parameters`` gets
``SHORT = True``); a failing cell fails the test."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_tutorials() -> None:
    assert NOTEBOOKS, "notebooks/ holds no tutorial"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_short(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, "a tutorial needs one cell tagged `parameters` with SHORT = False"
    params[0].source = "SHORT = True"
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "MemoryBreakdown" in outputs  # the report of the fit was printed
