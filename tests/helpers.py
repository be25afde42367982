"""Trainers and fits shared by the tests (CPU, seconds per fit); the tiny models and data they
train are ``benchmarks.workloads``'."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from benchmarks.workloads import tiny_data, tiny_model


class LossRecorder(Callback):
    """Records the training loss of every optimizer step (on rank zero's process)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


class SaveAt(Callback):
    """Saves a checkpoint right after optimizer step ``step``, as a run stopped there would, and
    calls ``snapshot(trainer)`` at that moment (its result is kept in ``self.snapshot``)."""

    def __init__(self, step: int, path: Any, snapshot: Any = None) -> None:
        self.step, self.path, self._snap, self.snapshot = step, str(path), snapshot, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.snapshot is None:
            trainer.save_checkpoint(self.path)
            self.snapshot = self._snap(trainer) if self._snap else True


def tiny_trainer(tmp_path: Any = None, callbacks: Any = (), **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        val_check_interval=None,
        default_root_dir=str(tmp_path) if tmp_path is not None else None,
    )
    kwargs.update(overrides)
    return pl.Trainer(callbacks=list(callbacks), **kwargs)


def fit(
    tmp_path: Any = None,
    callbacks: Any = (),
    *,
    seed: int = 0,
    model: Any = None,
    data: Any = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, Any, LossRecorder]:
    """Seeded tiny fit; returns the trainer, the module and the per-step losses."""
    pl.seed_everything(seed, verbose=False)
    model = model if model is not None else tiny_model()
    data = data if data is not None else tiny_data()
    recorder = LossRecorder()
    trainer = tiny_trainer(tmp_path, [*callbacks, recorder], **trainer_kwargs)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer, model, recorder


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    """Keep Python's cyclic collector out of a timed fit: late in a full run a worker's heap is
    large, and one collection (tens of ms) landing in the window a test times is no property of
    the code under test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def subprocess_timeout(seconds: float) -> float:
    """A generous timeout for a subprocess that takes about ``seconds / 4`` on 2 idle cores,
    scaled up on a busy machine (load per core above 1) and by ``LE_TEST_TIMEOUT_SCALE``."""
    import os

    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # pragma: no cover - platforms without a load average
        load = 1.0
    return seconds * max(1.0, load) * float(os.environ.get("LE_TEST_TIMEOUT_SCALE", "1"))


def launch(
    cmd: list[str], cwd: Any, timeout: float, env: dict[str, str] | None = None, stdout: bool = True
) -> tuple[str, str, int | None]:
    """A two-process launch: ``cmd`` (a script that starts its own rank 1) from a clean launcher
    environment (a 1-process fit in this process under a launching strategy leaves Lightning's
    LOCAL_RANK and MASTER_PORT; the child would think it was launched) plus ``env``, in a session
    of its own. Returns its stdout (``""`` unless ``stdout``), stderr and exit code (None: it ran
    past ``subprocess_timeout(timeout)``); both ranks' processes are killed at the end (rank 1 is
    rank 0's child: one signal ends both)."""
    import os
    import signal
    import subprocess

    from lightning_efficient.core.environ import LAUNCHER_VARIABLES

    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**clean, **(env or {})},
        stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=subprocess_timeout(timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        out, err, code = "", f"timed out running {cmd[1:]}", None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return out or "", err or "", code


def once_per_session(tmp_path_factory: Any, name: str, produce: Any) -> dict:
    """``produce(folder)`` (a JSON-able dict; files in ``folder``) once per test session: under
    pytest-xdist, the first worker to ask runs it and the others wait for it and reuse its result
    (a module fixture alone runs once per worker that got one of the module's tests: a 2-process
    launch twice). Without xdist, simply ``produce`` in a fresh folder."""
    import json
    import os
    from pathlib import Path

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return produce(tmp_path_factory.mktemp(name))
    from filelock import FileLock  # a dependency of torch

    shared = Path(tmp_path_factory.getbasetemp()).parent  # this session's, common to workers
    folder, result = shared / name, shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.exists():
            folder.mkdir()
            result.write_text(json.dumps(produce(folder)))
    return json.loads(result.read_text())
