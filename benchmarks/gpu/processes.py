"""The GPU suite's processes: each part (and pytest) in a process group of its own, started
early and stopped at its cap, and DeepSpeed's CPU extensions built first in another.

``Child`` is one part's process (``go()`` hands it its context and deadline, ``finish()`` waits
for the end or the cap); ``finish_part`` reads what the part wrote; ``Build`` is the build of
DeepSpeed's extensions; ``kill_group`` stops a process with its children. Standard library only
(the suite's parent process imports no torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.registry import Part

__all__ = ["Build", "Child", "child_env", "finish_part", "kill_group", "tail"]

ROOT = Path(__file__).resolve().parents[2]


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and every process of its group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` characters of the file at ``path`` (empty when it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def child_env() -> dict[str, str]:
    """The environment of a child process: the repository on its path, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# -- DeepSpeed's CPU extensions: built first, in a process of their own -------------------------------
PREBUILD = """
import json, os, sys, time
t0, flag, out = time.time(), sys.argv[1], {}
try:
    from lightning_efficient.techniques.zero_offload.extensions import ensure_extensions
    done = ensure_extensions()
    out["status"] = "ok"
    out["extensions"] = [
        {"name": e.name, "status": e.status, "seconds": round(e.seconds, 1)} for e in done
    ]
except BaseException as err:
    out["status"] = "failed to build: " + type(err).__name__ + ": " + str(err)[:300]
    raise
finally:
    out["seconds"] = round(time.time() - t0, 1)
    with open(flag + ".tmp", "w") as f:
        f.write(json.dumps(out))
    os.replace(flag + ".tmp", flag)
"""


class Build:
    """DeepSpeed's CPU extensions (``ensure_extensions``, what ``lightning-efficient prepare``
    runs), built in a process the suite starts before any part: a cold machine compiles
    ``cpu_adam`` for minutes. Only part 4's ZeRO rows wait for it, within part 4's cap. It writes ``prebuild.json`` (status, seconds, extensions) when it ends."""

    def __init__(self, work: Path, log: Path) -> None:
        from importlib.util import find_spec

        self.flag = work / "prebuild.json"
        self.started = time.time()
        self.proc: subprocess.Popen | None = None
        if find_spec("deepspeed") is None:
            self.flag.write_text(json.dumps({"status": "not installed", "seconds": 0.0}))
            return
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PREBUILD, str(self.flag)],
                cwd=ROOT,
                env=child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def info(self) -> dict[str, Any]:
        try:
            return json.loads(self.flag.read_text())
        except (OSError, ValueError):
            ended = self.proc is not None and self.proc.poll() is not None
            status = "its process died" if ended else "still building (stopped)"
            return {"status": status, "seconds": round(time.time() - self.started, 1)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)


LOG_LOCK = threading.Lock()

#: The dry run's process shared by the parts of one lane (they run one after the other): it
#: imports torch, Lightning and the package once, then runs each part's own module, as its own
#: process would (``python -m MODULE --ctx FILE``), in the order their context files come.
SHARED = """
import os, runpy, sys, time
import benchmarks.gpu.run  # torch, Lightning, the package: imported while the parts wait for their turn
parent, todo = os.getppid(), list(zip(sys.argv[1::2], sys.argv[2::2]))
while todo and os.getppid() == parent:
    ready = [t for t in todo if os.path.exists(t[1])]
    if not ready:
        time.sleep(0.05)
        continue
    todo.remove(ready[0])
    sys.argv = [ready[0][0], "--ctx", ready[0][1]]
    try:
        runpy.run_module(ready[0][0], run_name="__main__", alter_sys=True)
    except SystemExit:
        pass  # the part's end: child_main wrote its result and its exit code
"""


class Child:
    """One process of the suite (pytest, or a part): started early, timed from ``go()``.

    A part's process is started when the suite starts, so that it imports torch and Lightning
    while other parts run; it waits for its context file, which ``go()`` writes with the
    deadline. ``finish()`` waits until the cap and kills the process group if it is still running (the part's own run processes and
    loader workers with it)."""

    def __init__(
        self, key: str, cmd: list[str], work: Path, shared_with: Child | None = None
    ) -> None:
        self.key = key
        self.ctx_file = work / f"ctx_{key}.json"
        self.result_file = work / f"part_{key}.json"
        self.done_file = self.ctx_file.with_suffix(".done")  # child_main: the part's exit code
        self.started = self.timeout = 0.0
        self.offset = 0  # where this part's output starts in ``out_file``
        self.shared = shared_with is not None
        if shared_with is not None:  # a later part of a shared process (the dry run)
            self.out_file, self.proc = shared_with.out_file, shared_with.proc
            shared_with.shared = True
            return
        self.out_file = work / f"{key}.out"
        with open(self.out_file, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def part(cls, part: Part, work: Path) -> Child:
        """The process of ``part``: its script (``registry.PARTS``), waiting for its context."""
        ctx_file = work / f"ctx_{part.key}.json"
        return cls(part.key, [sys.executable, "-m", part.module, "--ctx", str(ctx_file)], work)

    @classmethod
    def shared_by(cls, parts: list[Part], work: Path) -> list[Child]:
        """One process for ``parts`` (the dry run: the parts of a lane, one after the other):
        each part's script runs in it as in a process of its own, once its context is written.
        Saves a process's imports (~11 CPU-s) per part after the first."""
        args = [str(a) for p in parts for a in (p.module, work / f"ctx_{p.key}.json")]
        first = cls(parts[0].key, [sys.executable, "-c", SHARED, *args], work)
        return [first, *(cls(p.key, [], work, shared_with=first) for p in parts[1:])]

    def go(self, ctx: dict[str, Any] | None, timeout: float) -> None:
        self.started, self.timeout = time.time(), timeout
        if self.shared:
            with contextlib.suppress(OSError):
                self.offset = self.out_file.stat().st_size
        if ctx is not None:
            ctx = dict(ctx, deadline=self.started + timeout - 8, result_file=str(self.result_file))
            tmp = self.ctx_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ctx))
            os.replace(tmp, self.ctx_file)  # the waiting child sees a complete file

    def finish(self, log: Path) -> tuple[int | None, bool]:
        """Wait for the end or the cap; ``(exit code, timed out)``. Appends the output to ``log``."""
        while True:
            code = self.proc.poll()
            if code is None and self.shared and self.done_file.exists():  # the process goes on
                code = int(self.done_file.read_text() or 0)
            if code is not None:
                timed_out = False
                break
            if time.time() > self.started + self.timeout:
                self.kill()
                code, timed_out = None, True
                break
            time.sleep(0.2)
        with LOG_LOCK, open(log, "a") as f:
            f.write(f"\n===== {self.key} =====\n" + self.output(200_000))
        return code, timed_out

    def output(self, n: int = 3000) -> str:
        """The last ``n`` characters of this part's output (of a shared process: since ``go``)."""
        if not self.offset:
            return tail(self.out_file, n)
        try:
            with open(self.out_file, "rb") as f:
                f.seek(self.offset)
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)


def finish_part(child: Child, log: Path) -> dict[str, Any]:
    code, timed_out = child.finish(log)
    try:
        result = json.loads(child.result_file.read_text())
    except (OSError, ValueError):
        result = {"rows": [], "figures": {}, "notes": [], "status": "failed"}
        result["reason"] = f"the part's process exited with code {code} and no results"
    if timed_out:
        reason = f"stopped at its {child.timeout:.0f} s cap (it needs more)"
        result.update(status="timeout", reason=reason)
    elif result.get("status") == "running":
        result.update(status="failed", reason=f"the part's process died (code {code})")
    if result["status"] in ("failed", "timeout"):
        result["log_tail"] = child.output()
    return result
