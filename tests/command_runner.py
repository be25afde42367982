"""``lightning-efficient ARGS`` run inside the test's process: the command's ``main`` on those
arguments, its exit code (``SystemExit``'s or the returned one) and what it printed (pytest's
``capsys``). A fresh interpreter costs ~11 CPU-s of imports; a test whose subject is not the
process boundary (the console script, a fresh import, a fresh working folder) runs it here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from lightning_efficient.commands import main

__all__ = ["Ran", "run_command"]


class Ran(NamedTuple):
    """What a command gave: its exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def run_command(capsys: pytest.CaptureFixture, *args: str, cwd: Path | None = None) -> Ran:
    """``main()`` with ``sys.argv`` as the console script gives it (``lightning-efficient ARGS``),
    from ``cwd`` (default: where the test runs), its output captured; the working folder and
    ``sys.argv`` are put back after. An exception other than ``SystemExit`` is raised as is (a
    traceback, where the command should have ended with a short error, fails the test)."""
    capsys.readouterr()  # what the test printed before is not the command's
    here, argv = os.getcwd(), sys.argv
    sys.argv = ["lightning-efficient", *args]  # as the console script sees them
    try:
        if cwd is not None:
            os.chdir(cwd)
        try:
            code = main()  # reads sys.argv, as the console script does
        except SystemExit as exit_:
            # sys.exit() and sys.exit(None) end with 0; a message (a string) with 1
            code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
        sys.argv = argv
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)
