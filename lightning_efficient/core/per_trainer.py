"""One object per trainer (a report, a change log), made on first use and released with it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerTrainer"]

T = TypeVar("T")


class PerTrainer(Generic[T]):
    """``make()`` once per trainer; the object lives as long as the trainer (a weak key)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._objects: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()

    def __call__(self, trainer: Any) -> T:
        found = self._objects.get(trainer)
        if found is None:
            found = self._objects[trainer] = self._make()
        return found
