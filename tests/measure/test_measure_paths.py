"""The measure floor's rooms: every module that lay flat in ``measure/`` before the floor was
grouped by subject (``memory/``, ``speed/``, ``trials/``, ``profiling/``) lives in one room and
imports from there only: its old flat path is gone (no alias before the first release, issue 50)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MEASURE = "lightning_efficient.measure"
ROOT = Path(__file__).resolve().parents[2]

#: Old flat module -> its place now (stated here, not read from the package's table, so a
#: module the table misses fails).
MOVED = {
    "allocator": "memory.allocator",
    "caching_allocator": "memory.caching_allocator",
    "cuda_kernels": "memory.cuda_kernels",
    "estimate": "memory.estimate",
    "heads": "memory.heads",
    "hf_masks": "memory.hf_masks",
    "kv_cache": "memory.kv_cache",
    "optimizer_models": "memory.optimizer_models",
    "peak": "memory.peak",
    "per_rank": "memory.per_rank",
    "settings": "memory.settings",
    "targets": "memory.targets",
    "track": "memory.track",
    "types": "memory.types",
    "flops": "speed.flops",
    "host": "speed.host",
    "input_stall": "speed.input_stall",
    "step_rate": "speed.step_rate",
    "timing": "speed.timing",
    "tokens": "speed.tokens",
    "compile_trial": "trials.compile_trial",
    "trial": "trials.trial",
    "advice": "profiling.advice",
    "profile_report": "profiling.profile_report",
    "profile_summary": "profiling.profile_summary",
    "profiler": "profiling.profiler",
    "step_phases": "profiling.step_phases",
    "trace_window": "profiling.trace_window",
}
#: Stayed at the floor's root: what every room runs on.
ROOT_MODULES = {"step", "scratch", "plots"}
#: Made in a room after the floor was grouped (no old flat path).
BORN_IN_A_ROOM = {"speed.fetch_watch", "memory.budget"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_flat_path_is_gone(old: str) -> None:
    """No alias before the first release (issue 50): the old flat path neither imports nor is an
    attribute of ``measure``; the module imports from its room only."""
    new = importlib.import_module(f"{MEASURE}.{MOVED[old]}")
    assert new.__name__ == f"{MEASURE}.{MOVED[old]}"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{MEASURE}.{old}")
    assert not hasattr(importlib.import_module(MEASURE), old)


def test_memory_room_exports_its_callback() -> None:
    """``measure.memory`` is the memory room (a package); it exports ``MemoryBreakdown`` as the
    speed room exports ``InputStallMonitor``, and nothing of the old module besides."""
    from lightning_efficient.measure.memory import breakdown

    room = importlib.import_module(f"{MEASURE}.memory")
    assert room.__path__ and room is not breakdown  # a package
    assert room.MemoryBreakdown is breakdown.MemoryBreakdown
    assert not {"check_steps", "plot_measurement"} & set(room.__all__)


def test_every_flat_module_is_in_a_room_or_at_the_root() -> None:
    folder = ROOT / "lightning_efficient" / "measure"
    flat = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    rooms = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert flat == ROOT_MODULES and rooms == {"memory", "speed", "trials", "profiling"}
    placed = {f"{room.name}.{p.stem}" for room in folder.iterdir() for p in room.glob("*.py")}
    placed = {m for m in placed if not m.endswith(".__init__")}
    # every module accounted for
    assert set(MOVED.values()) | {"memory.breakdown"} | BORN_IN_A_ROOM == placed
