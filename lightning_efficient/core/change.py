"""Every change a technique makes carries its undo.

- ``Change``: what an ``apply_*`` function did. ``what`` is the one line a person reads (the
  efficiency report's row), ``figures`` the numbers a report compares, ``value`` what the caller
  composes with (the names of the blocks wrapped, the new loader, ...), and ``undo()`` puts back
  what was there before (once: later calls do nothing). ``with apply_x(model) as change:`` undoes
  on leaving the block, whether it raised or not.
- ``patch_attribute(obj, name, value)``: set an attribute on one instance (a wrapped hook, a
  shadowed method) and return the change that puts back what the instance had: its own
  attribute, or none, so that the class's shows again.
- ``ChangeLog``: changes in the order they were made. ``undo_from(change)`` undoes that change
  and every change made after it, last first, so a change made on top of another (two wrappers
  of the same hook) is undone before the one beneath it. Each trainer has one
  (``changes_for(trainer)``); the ``Technique`` base records into it, so that techniques are
  undone in the reverse order of what they did, whatever the order of the callbacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from lightning_efficient.core.per_trainer import PerTrainer

__all__ = ["Change", "ChangeLog", "changes_for", "patch_attribute", "undo_last_first"]


class Change:
    """What an ``apply_*`` did, its figures, and how to undo it.

    Args:
        what: One line saying what changed (``"full checkpointing of 2/2 blocks"``).
        undo: Puts back what was there; ``None``: nothing to undo (a change that changed
            nothing, e.g. a technique with no effect on this device).
        figures: Numbers a report compares (``{"blocks_wrapped": 2}``).
        value: What the caller works with next (the names wrapped, the new object, ...).
    """

    def __init__(
        self,
        what: str,
        undo: Callable[[], Any] | None = None,
        *,
        figures: Mapping[str, Any] | None = None,
        value: Any = None,
    ) -> None:
        self.what = what
        self.figures: dict[str, Any] = dict(figures or {})
        self.value = value
        self._undo = undo

    @property
    def undone(self) -> bool:
        """True once ``undo()`` ran (and for a change with nothing to undo)."""
        return self._undo is None

    def undo(self) -> None:
        """Put back what was there before; runs once, later calls do nothing."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> Change:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "undone" if self.undone else "applied"
        figures = f", figures={self.figures!r}" if self.figures else ""
        return f"Change({self.what!r}{figures}, {state})"

    @classmethod
    def of(
        cls,
        what: str,
        changes: Iterable[Change],
        *,
        figures: Mapping[str, Any] | None = None,
        value: Any = None,
    ) -> Change:
        """One change made of several: its undo undoes them last first."""
        parts = list(changes)
        return cls(
            what, (lambda: undo_last_first(parts)) if parts else None, figures=figures, value=value
        )


def undo_last_first(changes: Iterable[Change]) -> None:
    """Undo ``changes``, the last first. An undo that raises does not stop the others: the first
    error is raised once every change had its turn."""
    errors: list[BaseException] = []
    for change in reversed(list(changes)):
        try:
            change.undo()
        except Exception as err:  # noqa: BLE001 - raised below, after the other undos
            errors.append(err)
    if errors:
        raise errors[0]


_MISSING = object()


def patch_attribute(obj: Any, name: str, value: Any, what: str | None = None) -> Change:
    """Set ``obj.<name> = value`` and return the change whose ``undo`` puts back what ``obj``
    had: its own attribute (an earlier patch, a value it was given), or, when the name came
    from its class (a method), none, so that the class's shows again. A data descriptor of the
    class (a property) is set back to the value it read."""
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    if name in own:
        previous = own[name]
    elif hasattr(inspect.getattr_static(type(obj), name, None), "__set__"):  # a property
        previous = getattr(obj, name)
    else:
        previous = _MISSING
    setattr(obj, name, value)

    def undo() -> None:
        if previous is not _MISSING:
            setattr(obj, name, previous)
        elif name in vars(obj):
            delattr(obj, name)

    return Change(what or f"{type(obj).__name__}.{name} replaced", undo, value=value)


class ChangeLog:
    """Changes in the order they were made; undone last first."""

    def __init__(self) -> None:
        self._changes: list[Change] = []

    def record(self, change: Change) -> Change:
        """Keep ``change`` (changes undone already are let go); returns it."""
        self._changes = [c for c in self._changes if not c.undone]
        if not change.undone:
            self._changes.append(change)
        return change

    def undo_from(self, change: Change) -> None:
        """Undo ``change`` and every change recorded after it, last first."""
        if change not in self._changes:
            change.undo()
            return
        index = self._changes.index(change)
        later, self._changes = self._changes[index:], self._changes[:index]
        undo_last_first(later)

    def undo_all(self) -> None:
        if self._changes:
            self.undo_from(self._changes[0])

    def __iter__(self) -> Iterator[Change]:
        return iter([c for c in self._changes if not c.undone])

    def __len__(self) -> int:
        return sum(1 for c in self._changes if not c.undone)


_LOGS: PerTrainer[ChangeLog] = PerTrainer(ChangeLog)


def changes_for(trainer: Any) -> ChangeLog:
    """The change log of one trainer (created on first use, released with the trainer)."""
    return _LOGS(trainer)
