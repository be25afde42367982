"""Deprecated alias of :mod:`lightning_efficient.commands` (moved there by issue 38): the
names this module held stay importable from here; import them from
``lightning_efficient.commands`` (``main``, ``EXTRA_COMMANDS``) and
``lightning_efficient.commands.cli`` (``EfficientCLI`` and the rest) instead."""

from __future__ import annotations

from lightning_efficient.commands import EXTRA_COMMANDS, main
from lightning_efficient.commands.cli import (
    CONFIG_ERRORS,
    NOISE,
    EfficientCLI,
    RunConfigSaver,
    quiet_known_noise,
    reason_first,
)

__all__ = [
    "CONFIG_ERRORS",
    "EXTRA_COMMANDS",
    "NOISE",
    "EfficientCLI",
    "RunConfigSaver",
    "main",
    "quiet_known_noise",
    "reason_first",
]
