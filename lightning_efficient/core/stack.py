"""A stack of techniques as the LightningCLI config that turns it on: one writer of that yaml.

The planner's pick, AutoEfficient's decision and the profiler's advice each say "add this to your
config"; :class:`Stack` is what they say and :meth:`Stack.to_yaml` how it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Stack", "spec"]


def spec(class_path: str, init_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``class_path``/``init_args`` entry (``init_args`` left out when empty)."""
    return {"class_path": class_path, **({"init_args": dict(init_args)} if init_args else {})}


@dataclass
class Stack:
    """A trainer's settings as a LightningCLI config.

    Args:
        precision: ``trainer.precision`` (``None``: not written).
        callbacks: ``trainer.callbacks`` entries (``class_path``/``init_args`` dicts, see
            :func:`spec`).
        strategy: ``trainer.strategy`` (an entry, or a registered name; ``None``: not written).
        trainer: Other ``trainer:`` keys (``devices``, ``accumulate_grad_batches``...), written
            after the precision.
        sections: Other top-level sections (``{"data": {"init_args": {"batch_size": 8}}}``).
    """

    precision: str | None = None
    callbacks: Sequence[dict[str, Any]] = ()
    strategy: dict[str, Any] | str | None = None
    trainer: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)

    def trainer_config(self) -> dict[str, Any]:
        """The ``trainer:`` section: precision, the other keys, callbacks, strategy."""
        out: dict[str, Any] = {}
        if self.precision is not None:
            out["precision"] = self.precision
        out.update(self.trainer)
        if self.callbacks:
            out["callbacks"] = [dict(c) for c in self.callbacks]
        if self.strategy is not None:
            out["strategy"] = self.strategy
        return out

    def to_yaml(self) -> str:
        """The config as yaml (keys in the order given)."""
        import yaml

        return yaml.safe_dump({"trainer": self.trainer_config(), **self.sections}, sort_keys=False)
