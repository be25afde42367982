"""The host figures the instrument reads: cores, child processes, private and available memory."""

from __future__ import annotations

import subprocess
import sys

from lightning_efficient.measure.speed.host import (
    available_bytes,
    child_pids,
    private_bytes,
    usable_cores,
)


def test_cores_and_memory_are_read() -> None:
    assert 1 <= usable_cores()
    free = available_bytes()
    assert free is not None and free > 0
    import os

    own = private_bytes(os.getpid())
    assert own is not None and own > 10 * 2**20  # this process holds torch: well over 10 MiB


def test_a_started_child_is_seen_and_its_memory_read() -> None:
    before = child_pids()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids() - before
        size = private_bytes(child.pid)
        assert size is not None and 0 < size < (private_bytes(__import__("os").getpid()) or 0)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in child_pids()
    assert private_bytes(child.pid) is None  # gone: no figure rather than a wrong one
