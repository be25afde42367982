"""The host machine as the instrument sees it: usable CPU cores, child processes, and memory.

Read from ``/proc`` on Linux, from ``psutil`` elsewhere when it is installed; a figure that
cannot be read is ``None`` (callers then go without that bound, and say so).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning_efficient.core.validate import check_int

__all__ = [
    "available_bytes",
    "child_pids",
    "default_max_workers",
    "private_bytes",
    "usable_cores",
]

_PROC = Path("/proc")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_max_workers(devices: int = 1) -> int:
    """The most loader workers per loader worth running: 4 per usable core of a device (waiting
    loads gain beyond the core count), at least 2, at most 64. ``DataLoaderTuning``'s search stops
    there and ``InputStallMonitor`` never suggests more: one cap."""
    check_int("devices", devices, minimum=1)
    return max(2, min(64, 4 * usable_cores() // devices))


def child_pids() -> set[int]:
    """Process ids of this process's living children (e.g. DataLoader workers)."""
    tasks = _PROC / "self" / "task"
    if tasks.is_dir():
        pids: set[int] = set()
        for task in tasks.iterdir():
            try:
                pids.update(int(p) for p in (task / "children").read_text().split())
            except OSError:  # the thread ended, or a kernel without the children file
                continue
        return pids
    try:
        import psutil
    except ImportError:  # pragma: no cover - no /proc and no psutil
        return set()
    return {p.pid for p in psutil.Process().children()}  # pragma: no cover - not Linux


def private_bytes(pid: int) -> int | None:
    """Memory that only process ``pid`` holds (its unique set size: private pages, clean and
    dirty); what a forked worker costs beyond the pages it shares with its parent."""
    rollup = _PROC / str(pid) / "smaps_rollup"
    try:
        text = rollup.read_text()
    except OSError:
        text = None
    if text is not None:
        kib = 0
        for line in text.splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                kib += int(line.split()[1])
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process(pid).memory_full_info().uss)  # pragma: no cover - not Linux
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone
        return None


def available_bytes() -> int | None:
    """Host memory available to new allocations without swapping (``MemAvailable``)."""
    try:
        for line in (_PROC / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)  # pragma: no cover - not Linux
    except ImportError:  # pragma: no cover
        return None
