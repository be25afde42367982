"""The test files' two-process cases, one after another in one launch of 2 CPU processes (gloo):
the interpreters, the imports and the process group are paid once for the whole session.

Each case is a module of tests/ with a ``case(out: Path)`` function that fits under a 2-rank
strategy and writes what its test checks into ``out`` (``OUT/<name>``, also the working folder
while it runs). Both ranks run the same cases in the same order (Lightning re-launches this
script for rank 1; the first fit leaves the launcher variables set, so every later Trainer joins
the same two ranks). Each rank's output of a case (file descriptors 1 and 2, so C-level output
and the log handlers too) goes to ``out/rank<r>.out`` and ``out/rank<r>.err``; rank zero writes
``out/done`` once the case has ended on it (a case that raises ends the launch).

Usage: python tests/multiprocess/ddp_cases.py OUT NAME[,NAME...]   (NAME: a key of ``CASES``)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: case name -> the module of tests/ whose ``case(out)`` runs it
CASES = {
    "bucket": "ddp_bucket",
    "curriculum": "ddp_curriculum",
    "packing": "ddp_packing",
    "early_stopping": "ddp_early_stopping",
    "batch_size": "ddp_batch_size",
    "accumulation": "ddp_accumulation",
    "reports": "ddp_reports",
    "combinations": "ddp_combinations",
}


@contextmanager
def _output_to(out: Path, rank: int) -> Iterator[None]:
    """This process's file descriptors 1 and 2 into ``out/rank<r>.out|err``, put back after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    files = [open(out / f"rank{rank}.{ext}", "a") for ext in ("out", "err")]  # noqa: SIM115
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        for f in files:
            f.close()


def main(root: Path, names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)  # two ranks on two cores
    for name in names:
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        rank = int(os.environ.get("LOCAL_RANK", "0"))  # rank 1 is launched with it set
        here = os.getcwd()
        os.chdir(out)
        try:
            with _output_to(out, rank):
                importlib.import_module(CASES[name]).case(out)
        finally:
            os.chdir(here)
        if rank == 0:
            (out / "done").write_text("")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2].split(","))
