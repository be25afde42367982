"""The variables Lightning's launch writes into ``os.environ``, and putting them back.

A 1-process fit under a launching strategy (DeepSpeed, FSDP) exports the process group's address,
port and ranks; a process started afterwards from the same parent (a DDP run from a notebook, a
test's child) would inherit them, think it was launched already (``LOCAL_RANK``) and wait for its
peers. Strategies snapshot the variables before the launch (at construction: the launch writes
them before any strategy hook runs) and put them back with the ``Change`` of
``launcher_environ_change``, undone in their ``teardown``, which Lightning calls on every path
(the trainer's own teardown, after a fit, on an exception and on ``KeyboardInterrupt``; a callback's
``teardown``, by contrast, is skipped when a fit raises).
"""

from __future__ import annotations

import functools
import os

from lightning_efficient.core.change import Change

__all__ = ["LAUNCHER_VARIABLES", "launcher_environ", "launcher_environ_change", "restore_environ"]

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
