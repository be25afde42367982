"""core/change.py: a change carries its undo; patches of one attribute are undone last first."""

from __future__ import annotations

import pytest
from helpers import fit

from benchmarks.workloads import tiny_data, tiny_model
from lightning_efficient.core.change import Change, ChangeLog, changes_for, patch_attribute
from lightning_efficient.core.technique import Technique


class _Hooks:
    def hook(self) -> str:
        return "class"

    @property
    def level(self) -> int:
        return self._level

    @level.setter
    def level(self, value: int) -> None:
        self._level = value


def test_undo_runs_once_and_the_with_block_undoes() -> None:
    calls = []
    change = Change("did it", lambda: calls.append("undo"), figures={"n": 2}, value=[1])
    assert not change.undone and change.figures == {"n": 2} and change.value == [1]
    change.undo()
    change.undo()
    assert calls == ["undo"] and change.undone
    with Change("in a block", lambda: calls.append("left")) as inner:
        assert not inner.undone
    assert calls == ["undo", "left"] and inner.undone
    assert Change("nothing to undo").undone  # a change that changed nothing


def test_patch_attribute_puts_back_what_the_instance_had() -> None:
    obj = _Hooks()
    obj.level = 1
    first = patch_attribute(obj, "hook", lambda: "first")
    second = patch_attribute(obj, "hook", lambda: "second")
    level = patch_attribute(obj, "level", 5)
    assert obj.hook() == "second" and obj.level == 5
    level.undo()
    second.undo()
    assert obj.hook() == "first" and obj.level == 1
    first.undo()
    assert "hook" not in vars(obj) and obj.hook() == "class"  # the class's method shows again


def test_combined_change_undoes_last_first() -> None:
    order: list[str] = []
    parts = [Change(name, lambda name=name: order.append(name)) for name in "abc"]
    Change.of("three", parts).undo()
    assert order == ["c", "b", "a"]


def test_a_change_made_on_top_is_undone_first() -> None:
    """Two techniques wrap one hook; the one that wrapped first is restored first (callback
    order): the log undoes the later wrapping before it, so the hook is as given. Undoing each
    change alone in that order would put the first wrapper back."""
    obj, log = _Hooks(), ChangeLog()
    below = log.record(patch_attribute(obj, "hook", lambda: "below"))
    log.record(patch_attribute(obj, "hook", lambda: "on top"))
    log.undo_from(below)
    assert "hook" not in vars(obj) and len(log) == 0

    obj = _Hooks()
    below = patch_attribute(obj, "hook", lambda: "below")
    above = patch_attribute(obj, "hook", lambda: "on top")
    below.undo()
    above.undo()
    assert obj.hook() == "below"  # what the log prevents


class _Wraps(Technique):
    """Wraps the datamodule's train_dataloader in a hook of its own choosing."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook

    def _wrap(self, trainer, pl_module) -> None:
        data = trainer.datamodule
        inner = data.train_dataloader
        self.record(trainer, patch_attribute(data, "train_dataloader", lambda: inner()))

    def setup(self, trainer, pl_module, stage) -> None:
        super().setup(trainer, pl_module, stage)
        if self.hook == "setup":
            self._wrap(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.hook == "on_fit_start":
            self._wrap(trainer, pl_module)


@pytest.mark.parametrize("error", [None, RuntimeError])
def test_techniques_are_undone_in_reverse_of_what_they_did(tmp_path, error) -> None:
    # the first callback wraps first, the second on top of it; Lightning restores (teardown,
    # on_exception) in the callbacks' order: the one beneath first
    data = tiny_data()
    callbacks = [_Wraps("setup"), _Wraps("on_fit_start")]
    if error is None:
        trainer, _, _ = fit(tmp_path, callbacks, data=data, max_steps=1)
        assert len(changes_for(trainer)) == 0
    else:

        class Fail(_Wraps):
            def on_train_start(self, trainer, pl_module) -> None:
                raise RuntimeError("stop")

        with pytest.raises(RuntimeError, match="stop"):
            fit(tmp_path, [*callbacks, Fail("none")], model=tiny_model(), data=data, max_steps=1)
    assert "train_dataloader" not in vars(data)


def test_an_undo_that_raises_does_not_stop_the_others() -> None:
    order: list[str] = []

    def fails() -> None:
        order.append("fails")
        raise RuntimeError("cannot put it back")

    log = ChangeLog()
    first = log.record(Change("first", lambda: order.append("first")))
    log.record(Change("fails", fails))
    log.record(Change("last", lambda: order.append("last")))
    with pytest.raises(RuntimeError, match="cannot put it back"):
        log.undo_from(first)
    assert order == ["last", "fails", "first"] and len(log) == 0
