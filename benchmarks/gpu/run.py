"""A real training run of the GPU suite, and the pool of fresh processes that run them.

A *real run* (``real_fit``) trains a model with Lightning's ``Trainer`` from a JSON-able spec
(model, batch, precision, the package's techniques as ``{"class_path", "init_args"}``, a
strategy, a memory cap, timing) and returns the peak memory (the package's ``PeakMemory``:
CUDA's ``max_memory_allocated``; on a CPU the instrument's storage tracker on the real tensors),
step timing and whether it trained. On CUDA, runs that need a fresh allocator (a memory cap, an
out-of-memory, DeepSpeed, cold compiles) run in their own process (``RUN_CHILD``: ``run_spec_main`` in a fresh interpreter),
through a ``RunPool`` that starts those processes ahead of their turn. On the CPU a memory cap
is emulated: a run whose tracked peak passes it counts as out of memory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks._results import QUIET_TRAINER
from benchmarks.gpu.common import (
    ROOT,
    Ctx,
    build_technique,
    first_line,
    missing_package,
    unique_params,
)
from benchmarks.gpu.processes import kill_group
from benchmarks.workloads import Items, build_model, pad_batch, paragraphs
from lightning_efficient.core.report import report_for
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.measure.memory.peak import PeakMemory
from lightning_efficient.measure.speed.tokens import BatchCounter
from lightning_efficient.measure.trials.trial import is_out_of_memory
from lightning_efficient.techniques.precision import resolve_precision

__all__ = [
    "Clock",
    "Run",
    "RunPool",
    "SetupPeak",
    "real_fit",
    "run_real",
    "run_spec_main",
    "run_status",
    "timed_fields",
]

#: A run's process: ``run_spec_main`` in a fresh interpreter (``-c``: this module is no script).
RUN_CHILD = "import sys; from benchmarks.gpu.run import run_spec_main; sys.exit(run_spec_main(*sys.argv[1:3]))"


class Clock(pl.Callback):
    """Wall time of the steps after ``warmup`` (synchronised at both ends of the window), the
    first step's time from the start of training (compile included), and the last loss. Stops
    the fit once the window has lasted ``window_s`` seconds. ``count``: the window's batches
    are counted too, their tokens (the package's ``BatchCounter``: padding left out) and
    ``slots`` (the elements of their ``input_ids``), for batches whose shape varies."""

    def __init__(self, cuda: bool, warmup: int, window_s: float, count: bool = False) -> None:
        self.cuda, self.warmup, self.window_s = cuda, warmup, window_s
        self.counter = BatchCounter() if count else None
        self.slots = 0
        self.started: float | None = None
        self.first_step_s: float | None = None
        self.t0: float | None = None
        self.step0 = 0
        self.steps = 0
        self.seconds: float | None = None
        self.loss: float | None = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.started = self._now()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if self.t0 is None and trainer.global_step >= self.warmup:
            self.t0, self.step0 = self._now(), trainer.global_step
        if self.counter is not None and self.t0 is not None and self.seconds is None:
            self.counter.add(batch)
            self.slots += batch["input_ids"].numel()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = trainer.global_step
        if self.first_step_s is None and self.started is not None:
            self.first_step_s = self._now() - self.started
        if self.t0 is not None and self.seconds is None:
            last = trainer.max_steps > 0 and step >= trainer.max_steps
            if last or time.perf_counter() - self.t0 >= self.window_s:
                self._close(step, outputs)
                trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.t0 is not None and self.seconds is None:
            self._close(trainer.global_step, None)

    def _close(self, step: int, outputs: Any) -> None:
        self.seconds = self._now() - self.t0
        self.steps = step - self.step0
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.loss = float(loss.detach().float())


class SetupPeak(pl.Callback):
    """CUDA: the peak allocated from the start of the fit to the first training step (the model
    moved to the device, the techniques applied: 4-bit weights are quantized there), read at
    ``on_train_start``; then the peak counter starts again, so that the fit's ``PeakMemory``
    reads the training steps' own peak."""

    def __init__(self) -> None:
        self.peak: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        torch.cuda.synchronize()
        self.peak = int(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()


def make_loader(spec: dict[str, Any]) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(spec.get("seed", 0))
    n = spec["batch"] * spec.get("accumulate", 1) * (spec["steps"] + 1)
    ids = torch.randint(0, spec["dims"]["vocab"], (n, spec["dims"]["seq"] + 1), generator=g)
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return DataLoader(data, batch_size=spec["batch"], shuffle=False, drop_last=True)


class _Documents(pl.LightningDataModule):
    """The packing benchmarks' documents (``workloads.paragraphs``: ``spec["documents"]`` of
    them), ``spec["batch"]`` a batch padded to the longest (shuffled, seeded), from
    ``train_dataloader()``, where ``SequencePacking`` finds the loader it packs."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        docs, _ = paragraphs(self.spec["documents"])
        g = torch.Generator().manual_seed(self.spec.get("seed", 0))
        return DataLoader(
            Items(docs), batch_size=self.spec["batch"], shuffle=True, generator=g,
            collate_fn=pad_batch,
        )  # fmt: skip


class _LoaderData(pl.LightningDataModule):
    """``make_loader``'s data behind a ``batch_size`` that a callback may set (AutoEfficient):
    the samples of ``spec["batch"] * (steps + 1)``, served ``batch_size`` at a time."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec, self.batch_size = spec, spec["batch"]

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        data = make_loader(self.spec).dataset
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


def real_fit(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec`` for real with Lightning's Trainer; what happened, as a JSON-able dict.

    spec keys: ``model`` (kind), ``dims``, ``batch``, ``steps``, ``precision`` (``"auto"``:
    the package's ``best_precision``), ``callbacks`` and ``strategy`` (technique specs),
    ``device``, ``cap_bytes`` (CUDA: ``set_per_process_memory_fraction``), ``measure_memory``,
    ``timing`` (``{"warmup", "window_s"}``), ``seed``, ``accumulate`` (micro-batches per
    optimizer step, default 1), ``setup_peak`` (CUDA: ``peak_bytes`` is the training steps'
    peak, ``setup_peak_bytes`` the peak before the first step, ``fit_peak_bytes`` the larger),
    ``data`` (``"documents"``: ``_Documents`` of ``spec["documents"]`` documents; tokens/s
    counts their tokens, ``fill`` is tokens over slots). The result also says the allocator
    settings the run's process started with (``PYTORCH_CUDA_ALLOC_CONF``) and, on CUDA with a
    setting, whether its segments were expandable.
    """
    cuda = spec["device"] == "cuda"
    out: dict[str, Any] = {"ok": False, "oom": False, "error": None}
    t_start = time.perf_counter()
    try:
        callbacks = [build_technique(c) for c in spec.get("callbacks", [])]
        strategy = build_technique(spec["strategy"]) if spec.get("strategy") else "auto"
    except ImportError as err:
        out.update(error=f"{type(err).__name__}: {first_line(err)}", missing=missing_package(err))
        return out
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    # parameters are initialised on the device (fast), then handed to the Trainer from the host;
    # not when they alone would pass the run's cap (other runs may share the device meanwhile)
    cap = spec.get("cap_bytes")
    n = unique_params(build_model(spec["model"], spec["dims"], "meta"))
    on_device = cuda and (not cap or 4 * n <= cap)
    model = build_model(spec["model"], spec["dims"], "cuda" if on_device else "cpu")
    if on_device:
        model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    out["parameters"] = unique_params(model)
    out["init_s"] = time.perf_counter() - t_start
    precision = resolve_precision(spec.get("precision", "32-true"), spec["device"])
    out["precision"] = precision
    if cuda and cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    timing = spec.get("timing") or {}
    documents = spec.get("data") == "documents"
    clock = Clock(cuda, timing.get("warmup", 0), timing.get("window_s", 1e9), count=documents)
    setup = SetupPeak() if cuda and spec.get("setup_peak") else None
    meter = PeakMemory(
        spec["device"],
        [*model.parameters(), *model.buffers()],
        enabled=spec.get("measure_memory", True),
    )
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=spec["steps"],
        accumulate_grad_batches=spec.get("accumulate", 1),
        callbacks=[*callbacks, clock, *([setup] if setup else [])],
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        with meter:
            if documents:
                trainer.fit(model, datamodule=_Documents(spec))
            elif spec.get("datamodule"):  # AutoEfficient sets the loader's batch size
                trainer.fit(model, datamodule=_LoaderData(spec))
            else:
                trainer.fit(model, train_dataloaders=make_loader(spec))
        out["ok"] = trainer.global_step >= min(spec["steps"], clock.step0 + 1)
        if not out["ok"]:
            out["error"] = f"stopped after {trainer.global_step} of {spec['steps']} steps"
    except Exception as err:  # an OOM is a result here; anything else is reported, not raised
        out.update(error=f"{type(err).__name__}: {first_line(err)}", oom=is_out_of_memory(err))
        if not out["oom"]:
            traceback.print_exc()  # into the part's log
            out["traceback"] = traceback.format_exc()[-3000:]
    out["steps_run"] = trainer.global_step
    out["peak_bytes"] = meter.peak
    out["reserved_bytes"] = meter.reserved
    if setup is not None and setup.peak is not None and meter.peak is not None:
        base = meter.peak_allocated - meter.peak  # allocated before the fit
        out["setup_peak_bytes"] = setup.peak - base
        out["fit_peak_bytes"] = max(out["setup_peak_bytes"], meter.peak)
    if not cuda and cap and out["ok"] and meter.peak is not None and meter.peak > cap:
        # the CPU has no cap: a run whose tracked peak passed it counts as out of memory
        out.update(ok=False, oom=True, emulated_oom=True)
        out["error"] = f"emulated out of memory: peak {format_bytes(meter.peak)} over the cap"
    out["first_step_s"] = clock.first_step_s
    out["allocator_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if cuda and out["allocator_conf"]:  # before empty_cache: the segments the run reserved
        flags = {s["is_expandable"] for s in torch.cuda.memory_snapshot() if "is_expandable" in s}
        out["expandable_segments"] = (True in flags) if flags else None  # None: not said
    if clock.seconds and clock.steps:
        if clock.counter is not None:  # batches of varying shape: their own tokens
            tokens = clock.counter.tokens or 0
            out["fill"] = tokens / clock.slots if clock.slots else None
        else:
            tokens = clock.steps * spec["batch"] * spec.get("accumulate", 1) * spec["dims"]["seq"]
        out.update(
            timed_steps=clock.steps,
            step_s=clock.seconds / clock.steps,
            tokens_per_s=tokens / clock.seconds,
            loss=clock.loss,
        )
    out["report"] = _report_rows(trainer)
    out["figures"] = _report_figures(trainer)
    profiler = next((c for c in callbacks if isinstance(getattr(c, "summary", None), dict)), None)
    if profiler is not None:  # StepProfiler: its verdict (the levers, first things first)
        s = profiler.summary
        out["profile"] = {
            "step_s": s.get("step_s"),
            "mfu": s.get("mfu"),
            "advice": [
                {k: a.get(k) for k in ("lever", "gain", "yaml")} for a in s.get("advice", [])
            ],
        }
    auto = next((c for c in callbacks if getattr(c, "decision", None) is not None), None)
    if auto is not None:  # AutoEfficient's decision (issue 31)
        out["auto"] = {**auto.decision.state(), "notes": auto.decision.notes}
    out["wall_s"] = time.perf_counter() - t_start
    del trainer, model, callbacks, strategy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _report_rows(trainer: Any) -> list[str]:
    """The efficiency report's rows (technique: what changed), for the results file."""
    return [f"{e.technique}: {e.change}" for e in report_for(trainer).entries][:8]


def _report_figures(trainer: Any) -> dict[str, dict[str, Any]]:
    """The efficiency report's figures by technique (numbers and short strings only)."""
    simple = (int, float, str, bool, type(None))
    return {
        e.technique: {k: v for k, v in e.figures.items() if isinstance(v, simple)}
        for e in report_for(trainer).entries
    }


def _run_here(spec: dict[str, Any]) -> dict[str, Any]:
    """``real_fit`` in this process; an exception is a result (as in a run's own process)."""
    try:
        return real_fit(spec)
    except Exception as err:
        traceback.print_exc()
        return {
            "ok": False,
            "error": f"{type(err).__name__}: {first_line(err)}",
            "oom": is_out_of_memory(err),
        }


@dataclass
class Run:
    """A real run handed to a ``RunPool``: its spec, its process (None: ran here) and result."""

    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    spec_file: Path | None = None
    result_file: Path | None = None
    deadline: float = 0.0
    started: float = 0.0
    result: dict[str, Any] | None = None


class RunPool:
    """Real runs in fresh processes (``python -m benchmarks.gpu.run SPEC RESULT``), several at once.

    ``warm`` processes are started ahead: each imports torch, Lightning, transformers and the
    package, then waits (no CUDA call yet) until its spec file is written, so a run starts in
    about a second instead of after the imports. ``submit`` hands a spec to a waiting process
    (or starts one) and returns at once; ``poll`` says whether it ended; a run past its time
    limit is killed with its process group. ``isolate=False`` runs the spec here instead, before
    ``submit`` returns (the dry run, after its first round). ``env`` adds to the processes'
    environment."""

    def __init__(self, ctx: Ctx, warm: int = 0, env: dict[str, str] | None = None) -> None:
        self.ctx, self.env = ctx, env or {}
        self.waiting: list[Run] = []
        self.running: list[Run] = []
        self.warm = warm
        self.top_up()

    def _start(self) -> Run:
        tag = f"{os.getpid()}_{time.monotonic_ns()}"
        run = Run({}, spec_file=Path(self.ctx.work_dir) / f"spec_{tag}.json")
        run.result_file = Path(self.ctx.work_dir) / f"result_{tag}.json"
        cmd = [sys.executable, "-c", RUN_CHILD, str(run.spec_file), str(run.result_file)]
        env = {**os.environ, **self.env}
        run.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, start_new_session=True)
        return run

    def top_up(self) -> None:
        while len(self.waiting) < self.warm:
            self.waiting.append(self._start())

    def submit(self, spec: dict[str, Any], timeout: float, isolate: bool = True) -> Run:
        if timeout <= 5:
            return Run(spec, result={"ok": False, "skipped": True, "error": "no time left"})
        if not isolate:
            t0 = time.perf_counter()
            res = _run_here(spec)
            res.setdefault("wall_s", time.perf_counter() - t0)
            return Run(spec, result=res)
        run = self.waiting.pop(0) if self.waiting else self._start()
        run.spec, run.started, run.deadline = spec, time.time(), time.time() + timeout
        tmp = run.spec_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, run.spec_file)  # the waiting process sees a complete file
        self.running.append(run)
        self.top_up()
        return run

    def poll(self, run: Run) -> dict[str, Any] | None:
        """The run's result once it ended (killed at its deadline), else None."""
        if run.result is not None:
            return run.result
        code = run.proc.poll()
        if code is None and time.time() < run.deadline:
            return None
        if code is None:
            kill_group(run.proc)
            limit = run.deadline - run.started
            run.result = {
                "ok": False,
                "timeout": True,
                "error": f"stopped at its {limit:.0f} s limit",
            }
            run.result["wall_s"] = limit
        elif run.result_file.exists():
            run.result = json.loads(run.result_file.read_text())
        else:
            run.result = {"ok": False, "error": f"the run's process exited with code {code}"}
        self.running.remove(run)
        return run.result

    def wait(self, runs: list[Run]) -> list[dict[str, Any]]:
        while any(self.poll(r) is None for r in runs):
            time.sleep(0.2)
        return [r.result for r in runs]

    def close(self) -> None:
        for run in [*self.waiting, *self.running]:
            if run.proc is not None and run.proc.poll() is None:
                kill_group(run.proc)
        self.waiting, self.running = [], []


def run_real(spec: dict[str, Any], ctx: Ctx, isolate: bool, timeout: float) -> dict[str, Any]:
    """``real_fit(spec)`` in this process, or in a fresh one killed after ``timeout`` s."""
    pool = RunPool(ctx)
    try:
        return pool.wait([pool.submit(spec, timeout, isolate)])[0]
    finally:
        pool.close()


#: A run's figures of its timed steps, as the rows of the timed parts record them.
TIMED = ("tokens_per_s", "step_s", "timed_steps", "first_step_s", "loss", "report", "wall_s")


def timed_fields(res: dict[str, Any]) -> dict[str, Any]:
    """``TIMED`` of a run's result (None where it has none)."""
    return {k: res.get(k) for k in TIMED}


def run_status(res: dict[str, Any]) -> str:
    """A row's status from a run's result: ``ok``, a skip, out of memory, a timeout, an error."""
    if res.get("ok"):
        return "ok"
    if res.get("missing"):
        return f"skipped: {res['missing']} not installed"
    if res.get("skipped"):
        return f"skipped: {res['error']}"
    if res.get("oom"):
        return "out of memory"
    if res.get("timeout"):
        return f"timeout: {res['error']} (it needs more)"
    return f"error: {res.get('error')}"


def _end_with(parent: int) -> None:
    """End this run (its process group: loader workers, DeepSpeed's helpers) when the part that
    started it is gone: the suite kills a part at its cap, and a run in a session of its own
    would otherwise go on using the device under the next parts (the timed ones included)."""
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-part", daemon=True).start()


def run_spec_main(spec_file: str, result_file: str) -> int:
    """One real run in this fresh process. Started ahead of its
    turn (``RunPool``), it waits for its spec file with the imports done."""
    parent, path = os.getppid(), Path(spec_file)
    _end_with(parent)
    if not path.exists():
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401  (the HF model's import, while waiting)
    while not path.exists():
        time.sleep(0.05)
    spec = json.loads(path.read_text())
    t0 = time.perf_counter()
    res = _run_here(spec)
    res.setdefault("wall_s", time.perf_counter() - t0)
    Path(result_file).write_text(json.dumps(res, default=str))
    return 0
