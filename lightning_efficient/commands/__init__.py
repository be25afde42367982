"""The ``lightning-efficient`` command: one module per command, and :func:`main`, which imports
each of them.

- ``cli``: ``fit|validate|test|predict --config X.yaml`` (LightningCLI with this package's classes;
  a bad config ends with ``error: ...`` and exit code 2).
- ``auto_fit``: ``fit --auto`` (the Trainer built from AutoEfficient's plan).
- ``estimate``, ``profile``, ``plan``, ``export-zero`` (``export_zero``), ``prepare``: the commands
  that are not trainer methods, listed in :data:`EXTRA_COMMANDS`.
- ``options``: the options several commands take, the short error, a config's CLI built without
  running and its workload.

The commands sit above every other floor of the package (they import the planner, the techniques,
the instrument); nothing below imports them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from lightning_efficient.commands import estimate, export_zero, plan, prepare, profile
from lightning_efficient.commands.auto_fit import auto_fit_command, wants_auto
from lightning_efficient.commands.cli import EfficientCLI, exit_with_error, quiet_known_noise
from lightning_efficient.commands.options import (
    OPTIONS,
    command_parser,
    config_workload,
    error_status,
)
from lightning_efficient.core.validate import SettingsError

__all__ = [
    "EXTRA_COMMANDS",
    "OPTIONS",
    "command_parser",
    "config_workload",
    "estimate_command",
    "error_status",
    "main",
    "profile_command",
]

# the public names of the former module ``lightning_efficient.commands``
estimate_command = estimate.estimate_command
profile_command = profile.profile_command

#: Commands that are not trainer methods: name -> (one-line help, the function). The function
#: takes the remaining arguments and returns an exit code.
EXTRA_COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "estimate": (estimate.HELP, estimate.estimate_command),
    "profile": (profile.HELP, profile.profile_command),
    "plan": (plan.HELP, plan.plan_command),
    "export-zero": (export_zero.HELP, export_zero.export_zero_command),
    "prepare": (prepare.HELP, prepare.prepare_command),
}


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-efficient ARGS`` (``argv``: the arguments; default ``sys.argv[1:]``); returns
    the exit code (a bad configuration exits with 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()
    if args and args[0] in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[args[0]][1](args[1:])
    if wants_auto(args):  # the Trainer is built from AutoEfficient's plan
        try:
            return auto_fit_command(args[1:])
        except SettingsError as err:
            exit_with_error(str(err))
    if args and args[0] in ("-h", "--help"):
        extra = "\n".join(f"  {name:<14}{help_}" for name, (help_, _) in EXTRA_COMMANDS.items())
        print(f"lightning-efficient extra commands:\n{extra}\n")
    try:
        EfficientCLI(args=None if argv is None else args)
    except SettingsError as err:  # found at fit start: a short error, not a traceback
        exit_with_error(str(err))
    return 0
