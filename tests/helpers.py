"""Tiny models, data and trainers shared by the tests (CPU, seconds per fit)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from lightning_efficient.demos import TextDataModule, TinyGPT

TINY_MODEL = dict(seq_len=32, n_layer=2, n_embd=32, n_head=2, dropout=0.0, warmup_steps=2)
TINY_DATA = dict(batch_size=4, seq_len=32, max_train_samples=64)


def tiny_model(**overrides: Any) -> TinyGPT:
    return TinyGPT(**{**TINY_MODEL, **overrides})


def tiny_data(**overrides: Any) -> TextDataModule:
    return TextDataModule(**{**TINY_DATA, **overrides})


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


class HFGPT2(pl.LightningModule):
    """A tiny Hugging Face GPT-2 built from its default config (``use_cache=True``) unless told,
    trained with SGD (no 8-bit rung, so a planner's stacks are exact)."""

    def __init__(self, use_cache: bool = True, *, n_embd: int = 64, momentum: float = 0.0) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2, use_cache=use_cache
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.momentum = momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)


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


class _Interleaved(torch.utils.data.Sampler):
    """Rank r of w reads samples r, r + w, r + 2w, ... (the world read when iterated)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        return len(range(0, self.n, world))

    def __iter__(self):
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank, self.n, world))


def interleaved_data(batch_size: int, **overrides: Any) -> Any:
    """``tiny_data`` in a fixed order, each rank reading every world-size-th sample: with
    ``use_distributed_sampler=False``, w ranks at ``batch_size`` read together what one process
    reads at ``w * batch_size`` (the same samples, step by step)."""
    from torch.utils.data import DataLoader

    data = tiny_data(batch_size=batch_size, **overrides)

    def train_dataloader() -> DataLoader:
        n = len(data.train_set)
        return DataLoader(
            data.train_set, batch_size=batch_size, sampler=_Interleaved(n), drop_last=True
        )

    data.train_dataloader = train_dataloader
    return data


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
