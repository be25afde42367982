"""DeepSpeed's CPU extensions: built once, announced, and never waited on without a word.

DeepSpeed compiles its CPU extensions (``cpu_adam`` for ``DeepSpeedCPUAdam``, ``shm_comm`` for
its CPU communication) on first use into torch's extensions cache (``$TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions/py311_cpu``): about 2 minutes on 2 idle cores, during which a
fit printed nothing. An interrupted build leaves a ``lock`` file in the extension's folder, and
every later load waited on it forever, again printing nothing.

:func:`ensure_extensions` (run by ``ZeROOffload`` before DeepSpeed needs them, and by
``lightning-efficient prepare`` ahead of time) says once per process that it builds, how long it
took and where it is cached, and checks the lock first (:func:`check_lock`): a lock held by a
build process is waited on with a message; a lock no process holds is removed with a warning
once it is older than ``stale_after`` seconds (at once when its holder died while we waited).
Where the lock's holders cannot be seen (no ``/proc``), a stale lock is an error naming the file
and the command that removes it.
"""

from __future__ import annotations

import os
import stat
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lightning_efficient.core._internals import torch_extension_dir
from lightning_efficient.core.validate import check_float

__all__ = [
    "EXTENSIONS",
    "DEFAULT_EXTENSIONS",
    "STALE_AFTER_S",
    "ExtensionBuildError",
    "StaleLockWarning",
    "Extension",
    "ensure_extensions",
    "check_lock",
    "check_stale_after",
    "lock_holders",
]

#: The extensions ZeROOffload may need: short name -> (DeepSpeed op builder, what it is).
EXTENSIONS: dict[str, tuple[str, str]] = {
    "cpu_adam": ("CPUAdamBuilder", "DeepSpeed's CPU Adam optimizer"),
    "cpu_adagrad": ("CPUAdagradBuilder", "DeepSpeed's CPU Adagrad optimizer"),
    "shm_comm": ("ShareMemCommBuilder", "DeepSpeed's shared-memory communication for CPUs"),
}
#: What a default ZeROOffload fit (AdamW, CPU offload) loads.
DEFAULT_EXTENSIONS = ("cpu_adam", "shm_comm")
#: A lock no process holds is stale after this many seconds (builds hold theirs throughout).
STALE_AFTER_S = 300.0
#: While waiting on a lock, say so again this often (seconds).
_REMIND_S = 60.0

# extension folders whose build this process announced (the announcement is once per process)
_announced: set[str] = set()


class ExtensionBuildError(RuntimeError):
    """An extension could not be built, or its lock cannot be judged stale safely."""


class StaleLockWarning(UserWarning):
    """A stale build lock was removed."""


@dataclass
class Extension:
    """What :func:`ensure_extensions` did for one extension."""

    name: str
    folder: Path | None
    status: str  # "built", "cached", "installed" (prebuilt with DeepSpeed) or "not used"
    seconds: float = 0.0


def _say(message: str, out: TextIO | None) -> None:
    print(f"lightning-efficient: {message}", file=out or sys.stderr, flush=True)


def _builder(name: str) -> Any:
    """DeepSpeed's op builder for ``name`` on this machine's accelerator (None: not used)."""
    if name not in EXTENSIONS:
        raise ValueError(
            f"`extensions` must name DeepSpeed extensions among {', '.join(EXTENSIONS)}; "
            f"got {name!r}."
        )
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(EXTENSIONS[name][0])
    if builder is None or not builder.is_compatible(verbose=False):
        return None
    return builder


def _prebuilt(builder: Any) -> bool:
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(builder.name, False))


def lock_holders(lock: Path) -> list[int] | None:
    """Process ids that hold ``lock`` open (a build holds its lock from start to end); None when
    that cannot be known (no ``/proc``, or processes whose open files this user cannot read)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    holders, blind = [], False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except PermissionError:
            blind = True
            continue
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue  # the process ended
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders if holders or not blind else None


def _remove(lock: Path, seen: os.stat_result, why: str) -> None:
    try:
        now = lock.stat()
        if (now.st_ino, now.st_mtime) != (seen.st_ino, seen.st_mtime):
            return  # another process replaced it meanwhile: a new build, not ours to remove
        lock.unlink()
    except FileNotFoundError:
        return
    warnings.warn(
        f"removed the stale build lock {lock} ({why}): an earlier DeepSpeed extension build was "
        "interrupted; the extension is built again if needed.",
        StaleLockWarning,
        stacklevel=3,
    )


def check_stale_after(value: Any) -> float:
    """``stale_after``: a finite number of seconds >= 0 (NaN would never be reached: a wait
    without end)."""
    value = check_float("stale_after", value, minimum=0.0)
    if value == float("inf"):
        raise ValueError("`stale_after` must be a finite number of seconds >= 0; got inf.")
    return value


def check_lock(
    folder: str | os.PathLike,
    *,
    stale_after: float = STALE_AFTER_S,
    out: TextIO | None = None,
    poll_s: float = 0.5,
) -> None:
    """Return when ``folder/lock`` is gone or removed as stale; never wait without a word.

    A lock held by a process is waited on (said once, then every minute); a lock no process
    holds is removed with a ``StaleLockWarning`` when older than ``stale_after`` seconds, or at
    once when the process that held it ended while we waited. Where holders cannot be seen,
    a lock older than ``stale_after`` raises ``ExtensionBuildError`` naming the file and the
    command that removes it.
    """
    stale_after = check_stale_after(stale_after)
    lock = Path(folder) / "lock"
    said = reminded = 0.0
    saw_holder = False
    while True:
        try:
            seen = lock.stat()
        except FileNotFoundError:
            return
        if stat.S_ISDIR(seen.st_mode):
            raise ExtensionBuildError(
                f"the build lock {lock} is a folder, not a lock file a build would take; remove "
                f"it if no DeepSpeed extension build is running: rm -r {lock}"
            )
        age = time.time() - seen.st_mtime
        holders = lock_holders(lock)
        if holders is None and age >= stale_after:
            raise ExtensionBuildError(
                f"the build lock {lock} is {age / 60:.0f} minutes old and this machine does not "
                "show which process holds it. If no DeepSpeed extension build is running, remove "
                f"it: rm {lock}"
            )
        if holders == [] and (saw_holder or age >= stale_after):
            why = (
                "its build process ended" if saw_holder else f"{age:.0f} s old, no process holds it"
            )
            _remove(lock, seen, why)
            return
        now = time.monotonic()
        if not said:
            who = f"process {', '.join(map(str, holders))}" if holders else "no process we can see"
            _say(
                f"waiting on the build lock {lock} (held by {who}); "
                + (
                    f"it is removed as stale if no process holds it at {stale_after:.0f} s of age"
                    if not holders
                    else "another process is building this DeepSpeed extension"
                ),
                out,
            )
            said = reminded = now
        elif now - reminded >= _REMIND_S:
            _say(f"still waiting on {lock} ({(now - said) / 60:.0f} min)", out)
            reminded = now
        saw_holder = saw_holder or bool(holders)
        time.sleep(poll_s)


def ensure_extensions(
    names: Iterable[str] = DEFAULT_EXTENSIONS,
    *,
    stale_after: float = STALE_AFTER_S,
    out: TextIO | None = None,
    verbose: bool = False,
) -> list[Extension]:
    """Build (once) and load DeepSpeed's CPU extensions ``names``; what ``prepare`` runs.

    A build is announced once per process with the cache folder, and its time reported; a
    cached extension loads silently. The lock is checked first (:func:`check_lock`).
    Raises ``ExtensionBuildError`` when a build fails (it needs a C++ compiler and ninja);
    ``verbose`` shows the compiler's output.
    """
    stale_after = check_stale_after(stale_after)
    done = []
    for name in names:
        builder = _builder(name)
        if builder is None:
            done.append(Extension(name, None, "not used"))
            continue
        if _prebuilt(builder):
            done.append(Extension(name, None, "installed"))
            continue
        folder = Path(torch_extension_dir(builder.name))
        check_lock(folder, stale_after=stale_after, out=out)
        cached = (folder / f"{builder.name}.so").exists()
        if not cached and str(folder) not in _announced:
            _announced.add(str(folder))
            _say(
                f"building {EXTENSIONS[name][1]} ({name}), one time, about 2 minutes on 2 cores; "
                f"cached in {folder}",
                out,
            )
        start = time.perf_counter()
        try:
            builder.load(verbose=verbose)
        except Exception as err:  # noqa: BLE001 - the compiler's error, reworded with the folder
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            raise ExtensionBuildError(
                f"building DeepSpeed's {name} extension in {folder} failed "
                f"({lines[-1] if lines else type(err).__name__}); it needs a C++ compiler and "
                "ninja (pip install ninja). `lightning-efficient prepare --verbose` shows the build."
            ) from err
        seconds = time.perf_counter() - start
        if not cached:
            _say(f"built {name} in {seconds:.0f} s (cached in {folder})", out)
        done.append(Extension(name, folder, "cached" if cached else "built", seconds))
    return done
