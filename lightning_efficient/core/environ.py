"""The variables Lightning's launch writes into ``os.environ``, and putting them back.

A 1-process fit under a launching strategy (DeepSpeed, FSDP) exports the process group's address,
port and ranks; a process started afterwards from the same parent (a DDP run from a notebook, a
test's child) would inherit them, think it was launched already (``LOCAL_RANK``) and wait for its
peers. A strategy holds a ``LauncherEnviron``: the variables before the launch (taken at
construction: the launch writes them before any strategy hook runs), the ``Change`` a one-process
fit makes (``launcher_environ_change``), recorded in the trainer's change log, and its undo in the
strategy's ``teardown``, which Lightning calls on every path (the trainer's own teardown, after a
fit, on an exception and on ``KeyboardInterrupt``; a callback's ``teardown``, by contrast, is
skipped when a fit raises).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from lightning_efficient.core.change import Change, changes_for

__all__ = [
    "LAUNCHER_VARIABLES",
    "LauncherEnviron",
    "launcher_environ",
    "launcher_environ_change",
    "restore_environ",
]

LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")


def launcher_environ() -> dict[str, str | None]:
    """The launcher variables as they are now (``None``: not set)."""
    return {key: os.environ.get(key) for key in LAUNCHER_VARIABLES}


def restore_environ(before: dict[str, str | None]) -> None:
    """Put the variables back as ``before`` recorded them (unset those that were not set)."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def launcher_environ_change(before: dict[str, str | None]) -> Change:
    """The launcher variables a fit writes, as a change: ``undo()`` puts them back as ``before``
    (``launcher_environ()`` taken before the launch) recorded them."""
    written = sorted(k for k, v in before.items() if os.environ.get(k) != v)
    return Change(
        f"launcher variables set: {', '.join(written) or 'none yet'}",
        functools.partial(restore_environ, dict(before)),
    )


class LauncherEnviron:
    """One strategy's launcher variables: ``before`` (taken when the strategy is built, before
    fit's launch writes them), ``record(trainer)`` when one process set up its group, ``undo()``
    in the strategy's ``teardown``."""

    def __init__(self) -> None:
        self.before = launcher_environ()
        self.change = Change("launcher variables untouched")

    def record(self, trainer: Any) -> Change:
        """The variables the launch wrote, as a change in ``trainer``'s change log (the list of
        what the fit changed). The strategy undoes it itself, in its ``teardown``: the log is
        undone by the techniques (callbacks), a fit may have none, and a callback's ``teardown``
        does not run when a fit raises."""
        self.change = launcher_environ_change(self.before)
        if trainer is not None:
            changes_for(trainer).record(self.change)
        return self.change

    def undo(self) -> None:
        self.change.undo()
