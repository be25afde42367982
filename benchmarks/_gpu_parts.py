"""The measuring half of ``benchmarks/gpu_suite.py``: parts 2-4 and the real training runs
(parts 5 and 6, the timed ones: ``_gpu_speed.py``).

Imported only by the suite's child processes (it imports torch, Lightning and the package).
Each part takes a ``Ctx`` (device, profile of shapes, deadline) and a ``Recorder`` that saves
its rows to a JSON file after every row, so a part stopped at its cap keeps what it measured.

A *real run* (``real_fit``) trains a model with Lightning's ``Trainer`` from a JSON-able spec
(model, batch, precision, the package's techniques as ``{"class_path", "init_args"}``, a
strategy, a memory cap, timing) and returns the peak memory (CUDA: the allocator's
``max_memory_allocated``; CPU: the instrument's storage tracker on the real tensors), step
timing and whether it trained. On CUDA, runs that need a fresh allocator (a memory cap, an
out-of-memory, DeepSpeed, cold compiles) run in their own process (``gpu_suite.py --run-spec``),
through a ``RunPool`` that starts those processes ahead of their turn. On the CPU a memory cap
is emulated: a run whose tracked peak passes it counts as out of memory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _gpu_search import LargestSearch, Probe  # noqa: E402
from _results import QUIET_TRAINER  # noqa: E402

import lightning_efficient as le  # noqa: E402
from lightning_efficient.core.validate import format_bytes  # noqa: E402
from lightning_efficient.demos import TinyGPT  # noqa: E402
from lightning_efficient.functional import largest_fitting_batch  # noqa: E402
from lightning_efficient.measure.estimate import estimate_memory  # noqa: E402
from lightning_efficient.measure.track import StorageTracker  # noqa: E402
from lightning_efficient.techniques.precision import resolve_precision  # noqa: E402

SUITE = Path(__file__).resolve().parent / "gpu_suite.py"

#: Dense bf16 tensor-core peaks (FLOP/s, vendor datasheets, no sparsity); first match wins.
PEAK_BF16 = [
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("GH200", 989.4e12),
    ("A100", 312.0e12),
]


def peak_bf16(device_name: str) -> float | None:
    for key, flops in PEAK_BF16:
        if key.lower() in device_name.lower():
            return flops
    return None


def flops_per_token(n_params: int, n_pos_params: int, n_layer: int, n_embd: int, seq: int) -> int:
    """Training FLOPs per token of a GPT (forward + backward): ``6 N + 12 L d T``, where N
    counts the parameters without the position embedding (the tied head is counted once, as
    the output matmul) and the second term is attention (PaLM appendix B; nanoGPT's MFU)."""
    return 6 * (n_params - n_pos_params) + 12 * n_layer * n_embd * seq


# -- context and recorder ------------------------------------------------------------------------
@dataclass
class Ctx:
    """What a part child is told: where it runs, with which shapes, until when."""

    dry_run: bool
    device: str  # "cuda" or "cpu"
    device_name: str
    profile: dict[str, Any]
    deadline: float  # time.time() at which the part must have written its rows
    result_file: str
    work_dir: str
    cap_bytes: int
    host_ram_bytes: int
    prebuild_done: str = ""  # a file the DeepSpeed prebuild writes when it ends (JSON)
    device_total_bytes: int = 0  # CUDA: the device's memory (0 on the CPU)
    extra_s: float = 0.0  # time not charged to the part's cap (waiting for DeepSpeed's build)

    @classmethod
    def load(cls, path: str) -> Ctx:
        return cls(**json.loads(Path(path).read_text()))

    def left(self) -> float:
        return self.deadline + self.extra_s - time.time()

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


class Recorder:
    """A part's rows, figures and notes, written atomically to ``path`` after every change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "status": "running",
            "reason": "",
            "headline": "",
            "rows": [],
            "figures": {},
            "notes": [],
        }
        self.save()

    def row(self, **row: Any) -> dict[str, Any]:
        self.data["rows"].append(row)
        self.save()
        return row

    def figure(self, **figures: Any) -> None:
        self.data["figures"].update(figures)
        self.save()

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
            self.save()

    def finish(self, headline: str) -> None:
        """Close the part: ``partial`` when a row did not complete (skipped, stopped at its time
        limit, or a search not settled), with what those rows would have needed."""
        rows = self.data["rows"]
        short = [r for r in rows if str(r.get("status", "")).startswith(INCOMPLETE)]
        self.data["status"] = "partial" if short else "ok"
        needs = [r["needs_s"] for r in short if isinstance(r.get("needs_s"), (int, float))]
        if needs:
            self.data["figures"]["needs_s"] = sum(needs)
        if short and not self.data["reason"]:
            self.data["reason"] = f"{len(short)} of {len(rows)} rows not complete: " + (
                short[0]["status"].removeprefix("skipped: ")
            )
            if needs:
                self.data["reason"] += f"; they would have needed about {sum(needs):.0f} s more"
        self.data["headline"] = headline
        self.save()

    def fail(self, err: BaseException) -> None:
        self.data["status"] = "failed"
        self.data["reason"] = f"{type(err).__name__}: {_first_line(err)}"
        self.data["error"] = "".join(traceback.format_exception(err))[-4000:]
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        Path(tmp).write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


#: Row statuses of rows that did not complete.
INCOMPLETE = ("skipped", "timeout", "partial")


def time_skip(left: float, need: float, basis: str) -> dict[str, Any]:
    """The fields of a row skipped for want of time: what was left, what it would have needed."""
    return {
        "status": f"skipped: {max(0.0, left):.0f} s left in the part's cap, the row needs about "
        f"{need:.0f} s ({basis})",
        "needs_s": round(need, 1),
    }


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def missing_package(err: BaseException) -> str | None:
    """The package an ImportError (or the package's missing-extra error) names, if any."""
    if isinstance(err, ModuleNotFoundError) and err.name:
        return err.name.split(".")[0]
    text = str(err)
    for name in ("bitsandbytes", "deepspeed", "transformers", "torchao"):
        if name in text and ("install" in text or "No module" in text):
            return name
    return None


# -- models ----------------------------------------------------------------------------------------
class HFGPT2(pl.LightningModule):
    """A transformers GPT-2 built from its config (no download), trained on next-token loss."""

    def __init__(
        self,
        n_layer: int = 12,
        n_embd: int = 768,
        n_head: int = 12,
        vocab: int = 50257,
        seq: int = 1024,
        dropout: float = 0.1,
        lr: float = 1e-4,
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def build_model(kind: str, dims: dict[str, Any], device: str = "cpu") -> pl.LightningModule:
    """``kind`` ``"tinygpt"`` (the demo module) or ``"hf_gpt2"``; ``dims``: n_layer, n_embd,
    n_head, vocab, seq and optionally dropout. Parameters are created on ``device``."""
    with torch.device(device):
        if kind == "tinygpt":
            return TinyGPT(
                vocab_size=dims["vocab"],
                seq_len=dims["seq"],
                n_layer=dims["n_layer"],
                n_embd=dims["n_embd"],
                n_head=dims["n_head"],
                dropout=dims.get("dropout", 0.1),
            )
        if kind == "hf_gpt2":
            return HFGPT2(**dims)
    raise ValueError(f"unknown model kind {kind!r}")


def unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def pos_params(model: torch.nn.Module) -> int:
    for name, p in model.named_parameters():
        if name.endswith(("pos_emb.weight", "wpe.weight")):
            return p.numel()
    return 0


def params_text(n: int | None) -> str:
    if not n:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def describe(dims: dict[str, Any], kind: str = "tinygpt") -> str:
    """``12 x 768 (124M parameters)``, counted on the meta device."""
    n = unique_params(build_model(kind, dims, "meta"))
    return f"{dims['n_layer']} x {dims['n_embd']} ({params_text(n)} parameters)"


def build_technique(spec: dict[str, Any]) -> Any:
    """A technique (callback or strategy) of the package from ``{"class_path", "init_args"}``."""
    cls = getattr(le, spec["class_path"])
    return cls(**spec.get("init_args", {}))


def meta_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return ids, ids


def estimate(
    kind: str,
    dims: dict[str, Any],
    batch: int,
    precision: str = "32-true",
    techniques: list[dict[str, Any]] | None = None,
    rounding: bool = True,
) -> Any:
    """The instrument's estimate of 2 training steps (fake tensors; the model on ``meta``)."""
    model = build_model(kind, dims, "meta")
    return estimate_memory(
        model,
        meta_batch(batch, dims["seq"]),
        precision=precision,
        callbacks=[build_technique(t) for t in techniques or []],
        cuda_rounding=rounding,
    )


# -- a real training run -----------------------------------------------------------------------
class PeakMeter:
    """Peak memory of what runs inside: CUDA allocator statistics, or on a CPU the instrument's
    storage tracker on the real tensors (the model's parameters counted from the start)."""

    def __init__(self, cuda: bool, model: torch.nn.Module, enabled: bool = True) -> None:
        self.cuda, self.model, self.enabled = cuda, model, enabled
        self.peak: int | None = None
        self.reserved: int | None = None
        self._tracker: StorageTracker | None = None
        self._base = 0

    def __enter__(self) -> PeakMeter:
        if not self.enabled:
            return self
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._tracker = StorageTracker(fake=False)
            self._tracker.__enter__()
            self._tracker.label(list(self.model.parameters()), "parameters")
            self._tracker.label(list(self.model.buffers()), "parameters")
        return self

    def __exit__(self, *exc: Any) -> bool:
        if not self.enabled:
            return False
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            self.reserved = torch.cuda.max_memory_reserved()
        elif self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peak = self._tracker.summary().peak_bytes
        return False


class Clock(pl.Callback):
    """Wall time of the steps after ``warmup`` (synchronised at both ends of the window), the
    first step's time from the start of training (compile included), and the last loss. Stops
    the fit once the window has lasted ``window_s`` seconds."""

    def __init__(self, cuda: bool, warmup: int, window_s: float) -> None:
        self.cuda, self.warmup, self.window_s = cuda, warmup, window_s
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


def make_loader(spec: dict[str, Any]) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(spec.get("seed", 0))
    n = spec["batch"] * spec.get("accumulate", 1) * (spec["steps"] + 1)
    ids = torch.randint(0, spec["dims"]["vocab"], (n, spec["dims"]["seq"] + 1), generator=g)
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return DataLoader(data, batch_size=spec["batch"], shuffle=False, drop_last=True)


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
    optimizer step, default 1).
    """
    cuda = spec["device"] == "cuda"
    out: dict[str, Any] = {"ok": False, "oom": False, "error": None}
    t_start = time.perf_counter()
    try:
        callbacks = [build_technique(c) for c in spec.get("callbacks", [])]
        strategy = build_technique(spec["strategy"]) if spec.get("strategy") else "auto"
    except ImportError as err:
        out.update(error=f"{type(err).__name__}: {_first_line(err)}", missing=missing_package(err))
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
    clock = Clock(cuda, timing.get("warmup", 0), timing.get("window_s", 1e9))
    meter = PeakMeter(cuda, model, enabled=spec.get("measure_memory", True))
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=spec["steps"],
        accumulate_grad_batches=spec.get("accumulate", 1),
        callbacks=[*callbacks, clock],
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        with meter:
            if spec.get("datamodule"):  # AutoEfficient sets the loader's batch size
                trainer.fit(model, datamodule=_LoaderData(spec))
            else:
                trainer.fit(model, train_dataloaders=make_loader(spec))
        out["ok"] = trainer.global_step >= min(spec["steps"], clock.step0 + 1)
        if not out["ok"]:
            out["error"] = f"stopped after {trainer.global_step} of {spec['steps']} steps"
    except Exception as err:  # an OOM is a result here; anything else is reported, not raised
        out.update(error=f"{type(err).__name__}: {_first_line(err)}", oom=is_oom(err))
        if not out["oom"]:
            traceback.print_exc()  # into the part's log
            out["traceback"] = traceback.format_exc()[-3000:]
    out["steps_run"] = trainer.global_step
    out["peak_bytes"] = meter.peak
    out["reserved_bytes"] = meter.reserved
    if not cuda and cap and out["ok"] and meter.peak is not None and meter.peak > cap:
        # the CPU has no cap: a run whose tracked peak passed it counts as out of memory
        out.update(ok=False, oom=True, emulated_oom=True)
        out["error"] = f"emulated out of memory: peak {format_bytes(meter.peak)} over the cap"
    out["first_step_s"] = clock.first_step_s
    if clock.seconds and clock.steps:
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
    from lightning_efficient.core.report import report_for

    return [f"{e.technique}: {e.change}" for e in report_for(trainer).entries][:8]


def _report_figures(trainer: Any) -> dict[str, dict[str, Any]]:
    """The efficiency report's figures by technique (numbers and short strings only)."""
    from lightning_efficient.core.report import report_for

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
            "error": f"{type(err).__name__}: {_first_line(err)}",
            "oom": is_oom(err),
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
    """Real runs in fresh processes (``gpu_suite.py --run-spec``), several at once.

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
        cmd = [sys.executable, str(SUITE), "--run-spec", str(run.spec_file)]
        cmd += ["--result", str(run.result_file)]
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
            _kill_group(run.proc)
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
                _kill_group(run.proc)
        self.waiting, self.running = [], []


def run_real(spec: dict[str, Any], ctx: Ctx, isolate: bool, timeout: float) -> dict[str, Any]:
    """``real_fit(spec)`` in this process, or in a fresh one killed after ``timeout`` s."""
    pool = RunPool(ctx)
    try:
        return pool.wait([pool.submit(spec, timeout, isolate)])[0]
    finally:
        pool.close()


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _status(res: dict[str, Any]) -> str:
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


# -- part 2: estimate vs reality ---------------------------------------------------------------------
AC = {"class_path": "ActivationCheckpointing", "init_args": {}}
SWAP8 = {"class_path": "OptimizerSwap", "init_args": {"name": "adamw8bit"}}
STACKS = [
    ("fp32", "32-true", []),
    ("bf16-mixed", "bf16-mixed", []),
    ("bf16-mixed + checkpointing", "bf16-mixed", [AC]),
    ("bf16-mixed + checkpointing + adamw8bit", "bf16-mixed", [AC, SWAP8]),
]
MODELS = [("hf_gpt2", "HF GPT-2"), ("tinygpt", "TinyGPT")]


def gpt2_dims(ctx: Ctx, **extra: Any) -> dict[str, Any]:
    p = ctx.profile
    return {**p["gpt2"], "vocab": p["vocab"], "seq": p["seq"], **extra}


def part_estimate(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    batch = p["estimate_batch"]
    rec.note(
        "Each row: the instrument's estimate of 2 training steps (fake tensors) and the real "
        "peak of the same 2 steps under Lightning's Trainer ("
        + ("torch.cuda.max_memory_allocated" if ctx.cuda else "storage tracker on CPU tensors")
        + "). Ratio = estimate / measured; the goal is within 10%."
    )
    per_row = None
    for kind, label in MODELS:
        dims = gpt2_dims(ctx)
        for name, precision, techniques in STACKS:
            row = {"model": label, "stack": name, "batch": batch, "seq": dims["seq"]}
            need = per_row * 1.2 if per_row else 5.0
            if ctx.left() < need:
                basis = f"the last row took {per_row:.0f} s" if per_row else "a first guess"
                rec.row(**row, **time_skip(ctx.left(), need, basis))
                continue
            t0 = time.perf_counter()
            try:
                exact = estimate(kind, dims, batch, precision, techniques, rounding=False)
                rounded = estimate(kind, dims, batch, precision, techniques, rounding=True)
            except ImportError as err:
                rec.row(**row, status=f"skipped: {missing_package(err) or _first_line(err)}")
                continue
            spec = {
                "model": kind,
                "dims": dims,
                "batch": batch,
                "steps": 2,
                "precision": precision,
                "callbacks": techniques,
                "device": ctx.device,
            }
            res = run_real(spec, ctx, isolate=False, timeout=ctx.left())
            measured = res.get("peak_bytes")
            row.update(
                estimate_bytes=exact.peak_bytes,
                estimate_rounded_bytes=rounded.peak_bytes,
                estimate_reserved_bytes=rounded.reserved_bytes or None,
                estimate_target=getattr(rounded, "target", None),
                estimate_phase=rounded.peak_phase,
                measured_bytes=measured,
                reserved_bytes=res.get("reserved_bytes"),
                status=_status(res),
            )
            if res.get("ok") and measured:
                row["ratio"] = exact.peak_bytes / measured
                row["ratio_rounded"] = rounded.peak_bytes / measured
                row["within_10pct"] = abs(row["ratio"] - 1) <= 0.10
                row["within_10pct_rounded"] = abs(row["ratio_rounded"] - 1) <= 0.10
            row["seconds"] = time.perf_counter() - t0
            per_row = row["seconds"]
            rec.row(**row)
    measured = [r for r in rec.data["rows"] if "ratio" in r]
    if not measured:
        rec.finish("no stack measured")
        return
    hits = sum(r["within_10pct"] for r in measured)
    hits_r = sum(r["within_10pct_rounded"] for r in measured)
    lo, hi = min(r["ratio"] for r in measured), max(r["ratio"] for r in measured)
    rec.figure(within_10pct=hits, within_10pct_rounded=hits_r, measured=len(measured))
    rec.finish(
        f"estimate within 10% in {hits} of {len(measured)} stacks (estimate/measured "
        f"{lo:.2f}-{hi:.2f}; with CUDA rounding {hits_r} of {len(measured)})"
    )


# -- part 3: largest micro-batch within the cap ----------------------------------------------------
def _usable_ladder(ctx: Ctx, rec: Recorder, model: Any) -> list[Any]:
    """The planner's default ladder for ``model``, without the rungs whose techniques cannot be
    built here."""
    from lightning_efficient.planning import default_ladder
    from lightning_efficient.techniques.chunked_loss import worth_chunking

    rungs = []
    for rung in default_ladder(ctx.cap_bytes, chunked_loss=worth_chunking(model)):
        try:
            rung.build()
        except ImportError as err:
            rec.note(f"planner rung {rung.name!r} left out: {missing_package(err) or err} missing")
            continue
        rungs.append(rung)
    return rungs


GIB = 2**30


def probe_slots(ctx: Ctx) -> int:
    """How many real runs of part 3 go side by side: on CUDA as many capped processes as the
    device holds next to part 4's run (one more cap) and 8 GiB for the rest (the GPU tests, the
    parts' own processes, CUDA contexts), at most 4; in the dry run 2 (the same code path)."""
    if not ctx.cuda:
        return 2
    room = ctx.device_total_bytes - (ctx.cap_bytes + GIB) - 8 * GIB
    return max(1, min(4, int(room // (ctx.cap_bytes + GIB))))


def _probe_status(res: dict[str, Any]) -> str:
    if res.get("ok"):
        return "ok"
    if res.get("oom"):
        return "oom"
    return _status(res)


class BatchProbes:
    """Part 3's real runs: one ``LargestSearch`` per stack, rounds of probes sharing ``slots``
    processes of a ``RunPool``. ``step()`` collects the runs that ended and starts the next
    rounds; it returns at once, so the part estimates the next stack while probes run."""

    def __init__(self, ctx: Ctx, pool: RunPool, slots: int, spec: Any) -> None:
        self.ctx, self.pool, self.slots, self.spec = ctx, pool, slots, spec
        self.stacks: list[dict[str, Any]] = []
        self.walls: list[float] = []
        self.rounds = 0

    def add(self, stack: dict[str, Any]) -> None:
        stack.update(pending=[], stopped=None)
        self.stacks.append(stack)
        self.step()

    def probe_s(self) -> float:
        """What one probe takes: the slowest so far (a first guess before any)."""
        return max(self.walls) if self.walls else (30.0 if self.ctx.cuda else 20.0)

    def active(self) -> list[dict[str, Any]]:
        return [s for s in self.stacks if not s["search"].done and not s["stopped"]]

    def step(self) -> None:
        for st in self.stacks:
            for run in list(st["pending"]):
                res = self.pool.poll(run)
                if res is None:
                    continue
                st["pending"].remove(run)
                if isinstance(res.get("wall_s"), (int, float)):
                    self.walls.append(res["wall_s"])
                st["search"].record(
                    Probe(
                        batch=run.spec["batch"],
                        status=_probe_status(res),
                        peak_bytes=res.get("peak_bytes"),
                        reserved_bytes=res.get("reserved_bytes"),
                        wall_s=res.get("wall_s"),
                    )
                )
        idle = [s for s in self.active() if not s["pending"]]
        free = self.slots - sum(len(s["pending"]) for s in self.stacks)
        for i, st in enumerate(idle):
            share = max(1, free // (len(idle) - i))
            sizes = st["search"].next_sizes(min(share, max(free, 0)))
            if not sizes:
                continue
            need = 1.3 * self.probe_s()
            if self.ctx.left() < need:
                st["stopped"] = (self.ctx.left(), need)
                continue
            # the dry run sends its first round through the processes, the rest runs here
            isolate = self.ctx.cuda or self.rounds == 0
            if not self.ctx.cuda:
                self.pool.warm = 0  # no process waits for a round that will not come
            for n in sizes:
                run = self.pool.submit(self.spec(st, n), self.ctx.left() - 2, isolate)
                st["pending"].append(run)
            free -= len(sizes)
            self.rounds += 1

    def run(self) -> None:
        while any(s["pending"] for s in self.stacks) or any(
            not s["pending"] for s in self.active()
        ):
            self.step()
            if not any(s["pending"] for s in self.stacks):
                if all(s["stopped"] or s["search"].done for s in self.stacks):
                    break
            time.sleep(0.1)

    def row(self, st: dict[str, Any]) -> dict[str, Any]:
        search: LargestSearch = st["search"]
        got = search.result()
        row = {
            "stack": st["stack"],
            "precision": st["precision"],
            "techniques": [c["class_path"] for c in st["specs"]],
            "estimate_pick": search.pick,
            "estimate_bytes": st["estimate_bytes"],
            **got,
        }
        if got["error"]:
            row["status"] = f"error: {got['error']}"
        elif got["resolved"]:
            row["status"] = "ok"
        else:
            lo, hi = search.lo, search.hi
            left, need = st["stopped"] or (self.ctx.left(), self.probe_s())
            rounds = max(1, math.ceil(math.log(max(2, hi - lo), self.slots + 1)))
            row["needs_s"] = round(rounds * 1.3 * self.probe_s(), 1)
            row["status"] = (
                f"partial: {lo or 'no size'} trained, "
                + (f"{hi} out of memory" if hi <= search.top else "none out of memory")
                + f"; not settled: {max(0.0, left):.0f} s left in the part's cap, about "
                f"{rounds} more round(s) of ~{self.probe_s():.0f} s needed"
            )
        return row


def part_batch(ctx: Ctx, rec: Recorder) -> None:
    from lightning_efficient.planning import plan_stack

    p = ctx.profile
    kind, dims = "hf_gpt2", gpt2_dims(ctx)
    cap, top = ctx.cap_bytes, p["batch_top"]
    slots = probe_slots(ctx)
    rec.note(
        f"HF GPT-2 {describe(dims, kind)}, sequence {dims['seq']}, AdamW, cap {format_bytes(cap)}. "
        "The estimate's pick: the largest micro-batch whose estimate fits the cap (MemoryEstimate."
        "fits: on a CUDA target the caching allocator's reserve replayed under the cap). "
        f"The real largest: found by {p['real_steps']} real steps at each size tried, "
        + (
            "each in its own process under torch.cuda.set_per_process_memory_fraction(cap / "
            f"total) (a fresh allocator: an out-of-memory leaves it dirty), {slots} side by side"
            if ctx.cuda
            else "the cap emulated on the CPU (a run whose tracked peak passes it counts as out "
            "of memory); the first round in processes, 2 side by side, as on CUDA"
        )
        + ": the pick and twice it, then where the line through the sizes that trained meets "
        "the cap, then bisection; settled when n trains and n + 1 runs out of memory. The "
        "planner's stack is the rung plan_stack picks for batch "
        f"{p['planner_batch']}, run with every block checkpointed (its budget mode would refuse "
        "sizes by the estimate instead of by the device)."
    )

    def largest(precision: str, techniques: list[dict[str, Any]]) -> tuple[int, int, dict]:
        def fn(n: int) -> float:
            try:
                est = estimate(kind, dims, n, precision, techniques)
            except ValueError:  # e.g. a checkpointing budget that no block count reaches
                return math.inf
            # on a CUDA target: the allocator's reserve replayed under the cap, as the planner
            return est.peak_bytes if est.fits(cap) else math.inf

        n, seen = largest_fitting_batch(fn, cap, top)
        finite = {k: v for k, v in seen.items() if math.isfinite(v)}
        return n, int(seen.get(n, 0)), finite

    def spec(stack: dict[str, Any], batch: int) -> dict[str, Any]:
        return {
            "model": kind,
            "dims": dims,
            "batch": batch,
            "steps": p["real_steps"],
            "precision": stack["precision"],
            "callbacks": stack["specs"],
            "strategy": stack["strategy"],
            "device": ctx.device,
            "cap_bytes": cap,
        }

    pool = RunPool(ctx, warm=slots)
    probes = BatchProbes(ctx, pool, slots, spec)
    try:
        t0 = time.perf_counter()
        b_plain, est_plain, seen = largest("32-true", [])
        rec.figure(plain_search_s=time.perf_counter() - t0, plain_estimates=len(seen), slots=slots)
        probes.add(
            {
                "stack": "plain (fp32, as configured)",
                "precision": "32-true",
                "specs": [],
                "strategy": None,
                "estimate_bytes": est_plain,
                "search": LargestSearch("plain", b_plain, top, cap, estimate=seen),
            }
        )
        # the planner and the stack's estimate run here while the plain probes run
        t0 = time.perf_counter()
        target = p["planner_batch"]
        model = build_model(kind, dims, "meta")
        result = plan_stack(
            model,
            meta_batch(target, dims["seq"]),
            cap,
            ladder=_usable_ladder(ctx, rec, model),
            device=ctx.device,  # the dry run plans for its CPU, as its estimates do
        )
        rung = result.chosen
        rec.figure(
            planner_batch=target,
            planner_s=time.perf_counter() - t0,
            planner_tried=[
                [r.name, e.peak_bytes if e else None, problem or "fits"]
                for r, e, problem in result.tried
            ],
        )
        probes.step()
        if rung is None:
            rec.note(f"the planner found no stack for batch {target} within the cap")
        else:
            specs, strat = rung.specs()
            # every block checkpointed: the largest batch any subset of blocks reaches
            specs = [AC if s["class_path"] == "ActivationCheckpointing" else s for s in specs]
            b_stack, est_stack, seen = largest(rung.precision, specs + ([strat] if strat else []))
            rec.figure(stack_estimates=len(seen))
            probes.add(
                {
                    "stack": f"planner: {rung.name}",
                    "precision": rung.precision,
                    "specs": specs,
                    "strategy": strat,
                    "estimate_bytes": est_stack,
                    "search": LargestSearch("stack", b_stack, top, cap, estimate=seen),
                }
            )
            other = _chunked_loss_counterpart(rung.name, specs, model)
            if other is not None:  # issue 28: the same stack with / without the chunked loss
                name, other_specs = other
                b_other, est_other, seen = largest(
                    rung.precision, other_specs + ([strat] if strat else [])
                )
                probes.add(
                    {
                        "stack": name,
                        "precision": rung.precision,
                        "specs": other_specs,
                        "strategy": strat,
                        "estimate_bytes": est_other,
                        "search": LargestSearch("other", b_other, top, cap, estimate=seen),
                    }
                )
        probes.run()
        for st in probes.stacks:
            rec.row(**probes.row(st))
        _auto_efficient(ctx, rec, pool, kind, dims, rec.data["rows"])
    finally:
        pool.close()
    rec.figure(probe_rounds=probes.rounds, probes=sum(len(r["probes"]) for r in rec.data["rows"]))
    rows = rec.data["rows"]

    def said(r: dict[str, Any]) -> str:
        real = r["largest_real"] if r["resolved"] else f">= {r['largest_real']} (not settled)"
        return f"{real} (the estimate picked {r['estimate_pick']})"

    auto = rec.data["figures"].get("auto_efficient") or {}
    tail = f"; AutoEfficient: {auto['said']}" if auto.get("said") else ""
    if len(rows) > 1 and rows[0]["largest_real"]:
        a, b = rows[:2]
        ratio = f", {b['largest_real'] / a['largest_real']:.1f}x" if b["largest_real"] else ""
        rec.finish(
            f"largest micro-batch by real steps: plain {said(a)} -> "
            f"{b['stack'].removeprefix('planner: ')} {said(b)}{ratio}"
            + "".join(f"; {r['stack']} {said(r)}" for r in rows[2:])
            + tail
        )
    elif rows:
        rec.finish(f"largest micro-batch by real steps: plain {said(rows[0])}")
    else:
        rec.finish("nothing measured")


def _auto_efficient(
    ctx: Ctx, rec: Recorder, pool: RunPool, kind: str, dims: dict[str, Any], rows: list[dict]
) -> None:
    """Issue 31's row: ``AutoEfficient(budget=cap)`` on the same model, effective batch
    ``auto_batch``, ``auto_steps`` optimizer steps under the cap, in its own process; its choice
    against the largest micro-batch real steps found for the planner's stack (and for any stack)."""
    p = ctx.profile
    cap, batch, steps = ctx.cap_bytes, p["auto_batch"], p["auto_steps"]
    spec = {
        "model": kind,
        "dims": dims,
        "batch": batch,
        "steps": steps,
        "precision": "auto",  # bf16-mixed on a GPU: the stacks fit --auto would have
        # on the CPU the harness tracks the whole fit against the emulated cap: the decision's
        # trial steps with their copy of the weights, and the whole dataset (built inside the
        # tracked fit; the estimate counts one batch): no trial steps there, and 5% kept for it
        "callbacks": [
            {
                "class_path": "AutoEfficient",
                "init_args": {"budget": cap if ctx.cuda else int(0.95 * cap), "trial": ctx.cuda},
            }
        ],
        "strategy": None,
        "device": ctx.device,
        "cap_bytes": cap,
        "datamodule": True,
        "measure_memory": True,
    }
    need = p["auto_need_s"]
    if ctx.left() < need:
        rec.figure(
            auto_efficient={
                "status": f"skipped: {ctx.left():.0f} s left in the part's cap, about {need:.0f} s "
                "needed",
                "batch": batch,
                "steps": steps,
            }
        )
        return
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=True)])[0]
    d = res.get("auto") or {}
    planner = next((r for r in rows if str(r.get("stack", "")).startswith("planner:")), None)
    best = max((r.get("largest_real") or 0 for r in rows), default=0)
    real = (planner or {}).get("largest_real") or best
    micro = d.get("micro_batch")
    attainable = max((n for n in range(1, batch + 1) if batch % n == 0 and n <= real), default=0)
    out = {
        "status": "ok" if res.get("ok") else ("oom" if res.get("oom") else _status(res)),
        "budget_bytes": spec["callbacks"][0]["init_args"]["budget"],
        "cap_bytes": cap,
        "batch": batch,
        "steps": steps,
        "steps_run": res.get("steps_run"),
        "stack": d.get("rung"),
        "micro_batch": micro,
        "accumulation": d.get("accumulation"),
        "decision_s": d.get("seconds"),
        "trial_bytes": d.get("trial_bytes"),
        "peak_bytes": res.get("peak_bytes"),
        "reserved_bytes": res.get("reserved_bytes"),
        "out_of_memory": bool(res.get("oom")),
        "largest_real_planner_stack": (planner or {}).get("largest_real"),
        "largest_real_any_stack": best,
        "largest_divisor_within_real": attainable,
        "ratio": round(micro / real, 3) if micro and real else None,
        "notes": d.get("notes", []),
        "error": res.get("error"),
        "wall_s": res.get("wall_s"),
    }
    out["said"] = (
        f"{out['stack']}, micro-batch {micro} x {out['accumulation']}, {out['status']} after "
        f"{out['steps_run']} steps ({out['ratio']:.0%} of the real largest {real}; "
        f"{batch}'s largest divisor within it: {attainable})"
        if micro and real
        else f"{out['status']}: {out['error'] or 'no decision'}"
    )
    rec.figure(auto_efficient=out)


CHUNKED = {"class_path": "ChunkedCrossEntropy", "init_args": {}}


def _chunked_loss_counterpart(
    name: str, specs: list[dict[str, Any]], model: Any
) -> tuple[str, list[dict[str, Any]]] | None:
    """The planner's stack without ``ChunkedCrossEntropy`` when it has it, with it when it has
    not and the model's logits are wide; ``None`` otherwise (issue 28's row)."""
    from lightning_efficient.techniques.chunked_loss import worth_chunking

    without = [s for s in specs if s["class_path"] != "ChunkedCrossEntropy"]
    if len(without) < len(specs):
        return f"{name.replace(' + chunked loss', '')} (without the chunked loss)", without
    if worth_chunking(model):
        return f"{name} + chunked loss", [CHUNKED, *specs]
    return None


# -- part 4: largest model at batch 1 --------------------------------------------------------------
SETTINGS: list[tuple[str, dict[str, Any] | None]] = [
    ("plain Lightning", None),
    ("ZeRO-2, optimizer offloaded to CPU", {"stage": 2, "offload_optimizer": "cpu"}),
    (
        "ZeRO-3, optimizer and parameters offloaded to CPU",
        {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": True},
    ),
]


def _ladder_dims(ctx: Ctx, n_layer: int, n_embd: int) -> dict[str, Any]:
    p = ctx.profile
    return {
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": max(1, n_embd // 64),
        "vocab": p["ladder_vocab"],
        "seq": p["ladder_seq"],
        "dropout": 0.0,
    }


def _host_need(n_params: int, host_bytes: int, setting: dict[str, Any] | None) -> int:
    """Host memory a real run needs: the model built on the host (4 B/parameter), plus for
    ZeRO what the estimate offloads and DeepSpeed's fp32 master copy (4 B/parameter)."""
    return 4 * n_params + (host_bytes + 4 * n_params if setting else 0)


#: The longest part 4 waits for DeepSpeed's build (not charged to its cap).
BUILD_WAIT_S = 300.0


def wait_prebuild(ctx: Ctx, limit: float = BUILD_WAIT_S) -> str:
    """Wait for DeepSpeed's extension build the suite started first (``ok``, ``failed: ...``,
    ``still building``). The wait is not charged to the part's cap: its deadline moves by it."""
    if not ctx.prebuild_done:
        return "ok"
    t0 = time.time()
    flag = Path(ctx.prebuild_done)
    state = "still building"
    while time.time() - t0 < limit:
        if flag.exists():
            text = flag.read_text().strip()
            try:
                state = json.loads(text)["status"]
            except (ValueError, KeyError, TypeError):
                state = text or "ok"
            break
        time.sleep(0.5)
    waited = time.time() - t0
    ctx.extra_s += waited
    return state


def part_ladder(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    ladder = p["ladder"]
    cap, host_limit = ctx.cap_bytes, int(0.75 * ctx.host_ram_bytes)
    rec.note(
        f"TinyGPT at GPT-2/GPT-3 shapes (head size 64, vocabulary {p['ladder_vocab']}), batch 1 x "
        f"{p['ladder_seq']}, fp32, AdamW. Per setting: the largest size whose estimate (CUDA "
        f"rounding) fits {format_bytes(cap)} and whose host memory fits 75% of "
        f"{format_bytes(ctx.host_ram_bytes)}, then {p['real_steps']} real steps at it"
        + (
            " under the cap, each in its own process (the plain run while the ZeRO settings are "
            "estimated). Parts 1-3 run alongside (the other 25% of the host memory is theirs)."
            if ctx.cuda
            else " (dry run: on the CPU, cap emulated; ZeRO's device peak is not measured, as "
            "host and device memory are one)."
        )
        + " The ZeRO settings wait for DeepSpeed's cpu_adam build, started first by the suite; "
        "the wait is not counted in the part's cap."
    )
    cpus = os.cpu_count() or 1
    # DeepSpeed's CPU Adam takes every core; leave some to the parts alongside
    env = {"OMP_NUM_THREADS": str(cpus - 4)} if ctx.cuda and cpus > 8 else {}
    pool = RunPool(ctx, warm=1 if ctx.cuda else 0, env=env)
    try:
        _ladder(ctx, rec, pool, ladder, cap, host_limit)
    finally:
        pool.close()


def _plan_setting(ctx: Ctx, ladder: list, setting: dict | None, start: int, cap: int, limit: int):
    """The sizes tried by the estimate for one setting, from ``start`` up, and its choice."""
    plan: dict[str, Any] = {"tried": [], "choice": None}
    for i in range(start, len(ladder)):
        label, n_layer, n_embd = ladder[i]
        dims = _ladder_dims(ctx, n_layer, n_embd)
        techniques = [{"class_path": "ZeROOffload", "init_args": setting}] if setting else []
        est = estimate("tinygpt", dims, 1, "32-true", techniques)
        n = unique_params(build_model("tinygpt", dims, "meta"))
        host = _host_need(n, est.host_bytes, setting)
        fits = est.peak_bytes <= cap
        plan["tried"].append(
            {
                "model": label,
                "parameters": n,
                "device_bytes": est.peak_bytes,
                "host_bytes": est.host_bytes,
                "host_need_bytes": host,
                "fits_cap": fits,
                "fits_host": host <= limit,
            }
        )
        if not fits:
            break
        if host > limit:
            plan["host_bound"] = label
            break
        plan["choice"] = i
    return plan


def _ladder(ctx: Ctx, rec: Recorder, pool: RunPool, ladder: list, cap: int, limit: int) -> None:
    p = ctx.profile

    def spec(i: int, zero: dict[str, Any] | None) -> dict[str, Any]:
        _, n_layer, n_embd = ladder[i]
        return {
            "model": "tinygpt",
            "dims": _ladder_dims(ctx, n_layer, n_embd),
            "batch": 1,
            "steps": p["real_steps"],
            "precision": "32-true",
            "strategy": {"class_path": "ZeROOffload", "init_args": zero} if zero else None,
            "device": ctx.device,
            "cap_bytes": cap if ctx.cuda else None,
            "measure_memory": ctx.cuda or zero is None,
        }

    def entry(i: int, res: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": ladder[i][0],
            "parameters": res.get("parameters"),
            "status": _status(res),
            "measured_bytes": res.get("peak_bytes"),
            "reserved_bytes": res.get("reserved_bytes"),
            "wall_s": res.get("wall_s"),
        }

    plans: list[dict[str, Any]] = []
    first: Run | None = None
    start = 0
    for name, setting in SETTINGS:
        if setting is not None:
            try:
                build_technique({"class_path": "ZeROOffload", "init_args": setting})
            except ImportError as err:
                what = missing_package(err) or _first_line(err)
                plans.append({"setting": name, "zero": setting, "skip": f"skipped: {what} missing"})
                continue
        plan = _plan_setting(ctx, ladder, setting, start, cap, limit)
        plan.update(setting=name, zero=setting)
        plans.append(plan)
        if plan["choice"] is not None:
            start = plan["choice"]
            if setting is None:  # the plain run trains while the ZeRO settings are estimated
                first = pool.submit(spec(plan["choice"], None), ctx.left() - 2, isolate=True)

    zero_wall: float | None = None
    for plan in plans:
        row = {"setting": plan["setting"], "estimate_tried": plan.get("tried", [])}
        if plan.get("skip"):
            rec.row(**row, status=plan["skip"])
            continue
        if plan["choice"] is None:
            rec.row(**row, status="skipped: no size fits the cap by the estimate")
            continue
        if plan["zero"] is not None:
            state = wait_prebuild(ctx)
            if state != "ok":
                rec.row(**row, status=f"skipped: DeepSpeed's cpu_adam extension {state}")
                continue
        i, real = plan["choice"], []
        while i >= 0:
            if plan["zero"] is None and first is not None and i == plan["choice"]:
                res = pool.wait([first])[0]
            else:
                need = 1.2 * zero_wall if plan["zero"] and zero_wall else None
                if need and ctx.left() < need:
                    basis = f"the last ZeRO run took {zero_wall:.0f} s"
                    real.append({"model": ladder[i][0], **time_skip(ctx.left(), need, basis)})
                    break
                run = pool.submit(spec(i, plan["zero"]), ctx.left() - 2, isolate=ctx.cuda)
                res = pool.wait([run])[0]
                if plan["zero"] and isinstance(res.get("wall_s"), (int, float)):
                    zero_wall = res["wall_s"]
            real.append(entry(i, res))
            if res.get("ok") or not res.get("oom") or ctx.left() < 30:
                break
            i -= 1
        trained = [r for r in real if r["status"] == "ok"]
        rec.row(
            **row,
            estimate_choice=ladder[plan["choice"]][0],
            host_bound=plan.get("host_bound"),
            real=real,
            largest_trained=trained[-1]["model"] if trained else None,
            largest_trained_parameters=trained[-1]["parameters"] if trained else None,
            status="ok" if trained else real[-1]["status"],
            **({"needs_s": real[-1]["needs_s"]} if "needs_s" in real[-1] else {}),
        )
    rec.figure(build_wait_s=round(ctx.extra_s, 1))
    parts = []
    for r in rec.data["rows"]:
        short = r["setting"].split(",")[0]
        got = r.get("largest_trained")
        if got:
            bound = f" (host-RAM bound above {r['host_bound']})" if r.get("host_bound") else ""
            parts.append(f"{short} {got}{bound}")
        else:
            parts.append(f"{short} {r['status']}")
    rec.finish("largest trained at batch 1: " + ", ".join(parts))


def _timed_part(name: str) -> Any:
    """Parts 5 and 6 live in ``_gpu_speed.py`` (which imports this module): loaded when run."""

    def run(ctx: Ctx, rec: Recorder) -> None:
        import _gpu_speed

        getattr(_gpu_speed, name)(ctx, rec)

    return run


PARTS = {
    "estimate": part_estimate,
    "batch": part_batch,
    "ladder": part_ladder,
    "speed": _timed_part("part_speed"),
    "compile": _timed_part("part_compile"),
}


def child_main(key: str, ctx_file: str) -> int:
    """Run part ``key`` with the context in ``ctx_file``; its rows go to ``ctx.result_file``."""
    # started ahead of its turn: the imports are done; wait for the context (and the deadline)
    parent, path = os.getppid(), Path(ctx_file)
    while not path.exists():
        if os.getppid() != parent:  # the suite is gone
            return 3
        time.sleep(0.05)
    ctx = Ctx.load(ctx_file)
    # the dry run leaves a core to the process importing alongside; tiny models need no more
    torch.set_num_threads(1 if ctx.dry_run else min(torch.get_num_threads(), 8))
    rec = Recorder(ctx.result_file)
    try:
        PARTS[key](ctx, rec)
    except Exception as err:
        traceback.print_exc()
        rec.fail(err)
        return 1
    return 0


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
    """``gpu_suite.py --run-spec``: one real run in this fresh process. Started ahead of its
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
