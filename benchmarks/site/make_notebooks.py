"""Run the tutorials in their short mode and commit them with their outputs (charts included).

Each ``notebooks/*.ipynb`` runs from a clean kernel with ``SHORT = True`` (as
``tests/project/test_notebooks.py`` runs it), from a temporary working folder, and is written back
with its outputs: text, and each chart as a PNG at 100 dpi (the notebooks' ``show``). The
``parameters`` cell keeps its source (``SHORT = False``: a reader who runs it gets the full mode)
and shows one
line saying where the outputs come from. Stripped: stderr (warnings, progress), timing metadata,
widget state; the temporary folder's path is written ``$TMPDIR`` and the repository's path is
dropped (``configs/tiny.yaml``, not ``/home/me/lightning-efficient/configs/tiny.yaml``).

    python -m benchmarks.site.make_notebooks                  # every notebook (minutes on 2 cores)
    python -m benchmarks.site.make_notebooks 03_speed 04_fewer_steps

Re-run it after a change to a notebook or to what it prints; the test checks that every chart
cell holds an image and that the outputs have the structure a run gives now.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"

__all__ = ["NOTE", "RESET", "clean", "execute_short", "output_kinds", "main"]

#: The line the parameters cell shows in a committed notebook.
NOTE = (
    "The outputs below come from the short mode (SHORT = True, small models on a CPU: "
    "python -m benchmarks.site.make_notebooks); run with SHORT = False for the full figures.\n"
)


def _parameters(nb: Any) -> Any:
    return next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))


#: Run first in a kernel that ran a notebook before: an empty namespace (``%reset -f``), then
#: the working folder and ``TMPDIR`` (``tempfile.gettempdir()``) of this run; the names it uses
#: are deleted again, so a notebook that forgets an import still fails.
RESET = """%reset -f
import os as _os, tempfile as _tempfile
_os.chdir({cwd!r})
_os.environ["TMPDIR"] = {tmp!r}
_tempfile.tempdir = None
del _os, _tempfile"""


def execute_short(path: Path, workdir: Path, timeout: int = 900, kernel: Any = None) -> Any:
    """``path`` run in its short mode from ``workdir`` (its kernel's working folder and
    ``TMPDIR``): the executed notebook, cleaned (``clean``), its parameters cell as committed.

    ``kernel``: a started ``jupyter_client`` kernel manager to run it in (its namespace emptied
    first, see :data:`RESET`; the tests share one, as a kernel's imports cost ~11 CPU-s); by
    default a fresh kernel, started for this notebook and shut down after (what ``main`` writes
    the committed notebooks with)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    params = _parameters(nb)
    source = params.source
    params.source = "SHORT = True"
    cwd = workdir / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    if kernel is not None:
        nb.cells.insert(0, nbformat.v4.new_code_cell(RESET.format(cwd=str(cwd), tmp=str(workdir))))
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(workdir)  # the kernel's tempfile.gettempdir()
    client = NotebookClient(
        nb,
        km=kernel,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    try:
        client.execute()
    finally:
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        if kernel is not None and client.kc is not None:
            client.kc.stop_channels()  # the kernel stays up for the next notebook
    if kernel is not None:
        reset = nb.cells.pop(0)
        assert not reset.outputs, reset.outputs  # the reset printed nothing
    params.source = source
    params.outputs = [nbformat.v4.new_output("stream", name="stdout", text=NOTE)]
    return clean(nb, str(workdir))


def clean(nb: Any, tmp: str | None = None) -> Any:
    """Drop stderr, timing and widget metadata; write the temporary folder as ``$TMPDIR`` and the
    repository's files relative to it."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stderr":
                continue
            if out.output_type == "stream":
                out.text = out.text.replace(f"{ROOT}/", "")
                out.text = out.text.replace(tmp, "$TMPDIR") if tmp else out.text
            kept.append(out)
        cell.outputs = kept
    return nb


def output_kinds(nb: Any) -> list[list[str]]:
    """Per code cell, the kinds of its outputs (``stdout``, ``image/png``, ``text/plain``...)."""
    kinds = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        got = []
        for out in cell.outputs:
            if out.output_type == "stream":
                got.append(out.name)
            elif out.output_type in ("display_data", "execute_result"):
                got.append("image/png" if "image/png" in out.data else "text/plain")
            else:
                got.append(out.output_type)
        kinds.append(sorted(set(got)))
    return kinds


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook stems (default: all)")
    args = parser.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            nb = execute_short(path, Path(tmp))
        nbformat.write(nb, path)
        images = sum(k.count("image/png") for k in output_kinds(nb))
        print(f"wrote {path.relative_to(ROOT)}: {images} charts, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
