"""What every benchmark script writes: a Markdown table, the environment, the .md/.json pair.

``save_results(path, text, data)`` prints ``text`` and writes ``path.md`` (the text) and
``path.json`` (``data``); ``table(columns, rows)`` makes the Markdown table; ``environment()``
names the hardware and the versions. Standard library only, so a script's parent process can
use it without importing torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGES",
    "environment",
    "fmt_bytes",
    "host_ram_bytes",
    "provenance",
    "save_json",
    "save_results",
    "table",
    "version_of",
]

#: Distributions whose versions a result names.
PACKAGES = ("torch", "lightning", "deepspeed", "bitsandbytes", "transformers", "triton")


def version_of(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


#: The Trainer keywords every benchmark fit uses: no logger, checkpoints, progress bar or summary
#: (they would write files and print between the measured steps).
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _format_bytes() -> Any:
    """The package's ``format_bytes``: from the imported package, else from its
    ``core/validate.py`` alone (standard library only), so that a process that imports no torch
    (the GPU suite's parent) does not import the package, torch and Lightning (~11 CPU-s) for it."""
    module = sys.modules.get("lightning_efficient.core.validate")
    if module is None:
        module = sys.modules.get("_le_validate")
    if module is None:
        path = Path(__file__).resolve().parents[1] / "lightning_efficient" / "core" / "validate.py"
        spec = importlib.util.spec_from_file_location("_le_validate", path)
        if not path.exists() or spec is None or spec.loader is None:  # the installed package
            from lightning_efficient.core.validate import format_bytes

            return format_bytes
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_le_validate"] = module
    return module.format_bytes


def fmt_bytes(n: float | None) -> str:
    """Binary size as the package writes it (``3.00 GiB``); ``-`` for ``None``."""
    return "-" if n is None else _format_bytes()(n)


def host_ram_bytes() -> int | None:
    """The host's RAM (``MemTotal`` of ``/proc/meminfo``); ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment(packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Python, host CPU cores and RAM, and the versions of ``packages`` (no import needed)."""
    env = {
        "python": platform.python_version(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    ram = host_ram_bytes()
    if ram:
        env["host RAM"] = fmt_bytes(ram)
    for dist in packages:
        env[dist] = version_of(dist)
    return env


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table. ``align`` has one letter per column: ``l`` (default) or ``r``."""
    cols = list(columns)
    marks = [("---:" if (align[i : i + 1] == "r") else "---") for i in range(len(cols))]
    lines = ["| " + " | ".join(map(_cell, cols)) + " |", "|" + "|".join(marks) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def provenance(env: Mapping[str, Any], command: str | None = None) -> str:
    """The line a result ends with: the hardware and versions, then the command that made it."""
    line = "Hardware/versions: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "."
    return f"{line} Command: `{command}`." if command else line


def save_results(
    path: str | os.PathLike, text: str, data: dict[str, Any], *, echo: bool = True
) -> tuple[Path, Path]:
    """Print ``text`` (unless ``echo`` is false) and write ``path.md`` and ``path.json``.

    ``path`` is the stem (``benchmarks/results/compile``); missing folders are created. Each
    file is written whole to a temporary file and renamed over the old one (a reader, or a run
    stopped meanwhile, never sees half a file). Values
    JSON cannot hold are written with ``str``. Returns the two paths written.
    """
    stem = Path(path)
    md, js = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    if echo:
        print(text)
    _write_whole(md, text.rstrip("\n"))
    save_json(js, data)
    return md, js


def save_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` (missing folders created, written whole as
    ``save_results`` does): a script's intermediate results, e.g. one process's share of a
    search that another run of the script gathers."""
    path = Path(path)
    _write_whole(path, json.dumps(data, indent=2, default=str))
    return path


def _write_whole(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # then renamed: never half a file
    tmp.write_text(content + "\n")
    os.replace(tmp, path)
