"""What every technique callback shares: the report, rank-zero notes, the compatibility check."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_efficient import compat
from lightning_efficient.measure.report import report_for

__all__ = ["Technique", "NoEffectWarning"]


class NoEffectWarning(UserWarning):
    """A technique was asked for but could not change anything (said once, instead of silence)."""


class Technique(Callback):
    """Base class of this package's callbacks. Subclasses hold no maths; they decide *when*.

    - ``self.report(trainer, change, **figures)`` adds the technique's row to the efficiency
      report, which is shown once at the end of fit on rank zero.
    - ``self.note(message)`` / ``self.no_effect(message)`` log once, on rank zero.
    - ``setup`` runs the package's compatibility rules once per fit (``compat.check``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    # -- reporting -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return type(self).__name__

    def report(self, trainer: Any, change: str, **figures: Any) -> None:
        report_for(trainer).add(self.name, change, **figures)

    def note(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            rank_zero_info(f"{self.name}: {message}")

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        if message not in self._said:
            self._said.add(message)
            rank_zero_warn(f"{self.name}: {message}", category=category)

    def no_effect(self, message: str) -> None:
        self.warn(message, NoEffectWarning)

    # -- hooks -----------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        compat.check(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        report_for(trainer).show(trainer)
