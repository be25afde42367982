"""A Chrome trace (``torch.profiler``) of a few training steps, for ``StepProfiler(trace=...)``:
one file per rank (``rank_trace_path``), written through a file next to it (``export_trace``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["TraceWindow", "export_trace", "rank_trace_path"]


class TraceWindow:
    """Records the steps between ``start`` and ``stop`` with ``torch.profiler`` (CPU, and CUDA on
    a GPU) and writes them as a Chrome trace (open it in ``chrome://tracing`` or Perfetto). One
    window per fit, from optimizer step ``first`` for ``steps`` steps: ``done`` once it was
    stopped."""

    def __init__(self, path: str, steps: int, first: int = 0) -> None:
        self.path, self.steps, self.first = path, steps, first
        self.done = False
        self._tracer: Any = None

    @property
    def recording(self) -> bool:
        return self._tracer is not None

    def starts_at(self, step: int) -> bool:
        """Whether the window opens at optimizer step ``step`` (not opened yet, and its turn)."""
        return not self.done and not self.recording and step >= self.first

    def ends_at(self, step: int) -> bool:
        """Whether the window, recording, is over at optimizer step ``step``."""
        return self.recording and step >= self.first + self.steps

    def start(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._tracer = profile(activities=activities, record_shapes=False)
        self._tracer.start()

    def stop(self, trainer: Any = None) -> tuple[str, str | None]:
        """Stop recording and write the trace of ``trainer``'s rank (one process without a
        trainer): ``(what was written, None)``, or ``("", why it was not written)``."""
        tracer, self._tracer = self._tracer, None
        if tracer is None:
            return "", None
        world = getattr(trainer, "world_size", 1) if trainer is not None else 1
        rank = getattr(trainer, "global_rank", 0) if trainer is not None else 0
        self.done = True
        tracer.stop()
        path = rank_trace_path(self.path, rank, world)
        error = export_trace(tracer, path)
        if error is not None:
            return "", f"the Chrome trace was not written to {path}: {error}"
        where = path if world == 1 else rank_trace_path(self.path, "<rank>", world)
        per_rank = f" (one file per rank, {world} ranks)" if world > 1 else ""
        return f"Chrome trace of {self.steps} steps written to {where}{per_rank}", None


def rank_trace_path(path: str, rank: Any, world: int) -> Path:
    """The trace file of ``rank``: ``path`` itself on one process, else ``.rank<r>`` before its
    suffix (``trace.json`` -> ``trace.rank1.json``, ``trace.json.gz`` -> ``trace.rank1.json.gz``),
    so that ranks never write one file."""
    path = Path(path)
    if world <= 1:
        return path
    name = path.name
    suffix = ".json.gz" if name.endswith(".json.gz") else path.suffix
    stem = name[: len(name) - len(suffix)] if suffix else name
    return path.with_name(f"{stem}.rank{rank}{suffix}")


def export_trace(tracer: Any, path: Path) -> str | None:
    """Write ``tracer``'s Chrome trace to ``path`` through a file next to it (a reader never sees
    half a trace, and a folder at ``path`` is never replaced); ``None`` when written, else why
    not."""
    suffix = ".json.gz" if path.name.endswith(".gz") else ".json"
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial{suffix}")
    try:
        tracer.export_chrome_trace(str(partial))
        if not partial.is_file() or partial.stat().st_size == 0:
            return "the profiler wrote nothing"
        if path.is_dir():
            return "it is a folder"
        os.replace(partial, path)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        partial.unlink(missing_ok=True)
    return None
