"""The measuring half of ``benchmarks/gpu_suite.py``: parts 2-6 and the real training runs.

Imported only by the suite's child processes (it imports torch, Lightning and the package).
Each part takes a ``Ctx`` (device, profile of shapes, deadline) and a ``Recorder`` that saves
its rows to a JSON file after every row, so a part stopped at its cap keeps what it measured.

A *real run* (``real_fit``) trains a model with Lightning's ``Trainer`` from a JSON-able spec
(model, batch, precision, the package's techniques as ``{"class_path", "init_args"}``, a
strategy, a memory cap, timing) and returns the peak memory (CUDA: the allocator's
``max_memory_allocated``; CPU: the instrument's storage tracker on the real tensors), step
timing and whether it trained. On CUDA, runs that need a fresh allocator (a memory cap, an
out-of-memory, DeepSpeed, cold compiles) run in their own process (``gpu_suite.py --run-spec``).
"""

from __future__ import annotations

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
import torch.nn.functional as F  # noqa: E402
from _results import QUIET_TRAINER  # noqa: E402

import lightning_efficient as le  # noqa: E402
from lightning_efficient.core.validate import format_bytes  # noqa: E402
from lightning_efficient.demos import TinyGPT  # noqa: E402
from lightning_efficient.functional import compile_modules, largest_fitting_batch  # noqa: E402
from lightning_efficient.measure.estimate import estimate_memory  # noqa: E402
from lightning_efficient.measure.timing import time_fn  # noqa: E402
from lightning_efficient.measure.track import StorageTracker  # noqa: E402
from lightning_efficient.techniques.compile import CompileWatch  # noqa: E402
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
    prebuild_done: str = ""  # a file the DeepSpeed prebuild writes when it ends ("ok"/"failed")

    @classmethod
    def load(cls, path: str) -> Ctx:
        return cls(**json.loads(Path(path).read_text()))

    def left(self) -> float:
        return self.deadline - time.time()

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
        skipped = [r for r in self.data["rows"] if str(r.get("status", "")).startswith("skipped")]
        self.data["status"] = "partial" if skipped else "ok"
        if skipped and not self.data["reason"]:
            self.data["reason"] = f"{len(skipped)} of {len(self.data['rows'])} rows skipped: " + (
                skipped[0]["status"].removeprefix("skipped: ")
            )
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


def class_spec(obj: Any) -> dict[str, Any]:
    """The ``{"class_path", "init_args"}`` of a technique the planner built."""
    return {
        "class_path": type(obj).__name__,
        "init_args": dict(getattr(obj, "plan_init_args", {}) or {}),
    }


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
    n = spec["batch"] * (spec["steps"] + 1)
    ids = torch.randint(0, spec["dims"]["vocab"], (n, spec["dims"]["seq"] + 1), generator=g)
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return DataLoader(data, batch_size=spec["batch"], shuffle=False, drop_last=True)


def real_fit(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec`` for real with Lightning's Trainer; what happened, as a JSON-able dict.

    spec keys: ``model`` (kind), ``dims``, ``batch``, ``steps``, ``precision`` (``"auto"``:
    the package's ``best_precision``), ``callbacks`` and ``strategy`` (technique specs),
    ``device``, ``cap_bytes`` (CUDA: ``set_per_process_memory_fraction``), ``measure_memory``,
    ``timing`` (``{"warmup", "window_s"}``), ``seed``.
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
    # parameters are initialised on the device (fast), then handed to the Trainer from the host
    model = build_model(spec["model"], spec["dims"], "cuda" if cuda else "cpu")
    if cuda:
        model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    out["parameters"] = unique_params(model)
    out["init_s"] = time.perf_counter() - t_start
    precision = resolve_precision(spec.get("precision", "32-true"), spec["device"])
    out["precision"] = precision
    if cuda and spec.get("cap_bytes"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_bytes"] / total), 0)
    timing = spec.get("timing") or {}
    clock = Clock(cuda, timing.get("warmup", 0), timing.get("window_s", 1e9))
    meter = PeakMeter(cuda, model, enabled=spec.get("measure_memory", True))
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=spec["steps"],
        callbacks=[*callbacks, clock],
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        with meter:
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
    out["first_step_s"] = clock.first_step_s
    if clock.seconds and clock.steps:
        tokens = clock.steps * spec["batch"] * spec["dims"]["seq"]
        out.update(
            timed_steps=clock.steps,
            step_s=clock.seconds / clock.steps,
            tokens_per_s=tokens / clock.seconds,
            loss=clock.loss,
        )
    out["report"] = _report_rows(trainer)
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


def run_real(spec: dict[str, Any], ctx: Ctx, isolate: bool, timeout: float) -> dict[str, Any]:
    """``real_fit(spec)`` in this process, or in a fresh one (``gpu_suite.py --run-spec``)
    killed after ``timeout`` seconds."""
    if timeout <= 5:
        return {"ok": False, "skipped": True, "error": "no time left in the part's cap"}
    if not isolate:
        return real_fit(spec)
    tag = f"{int(time.time() * 1000) % 10**9}"
    spec_file = Path(ctx.work_dir) / f"spec_{tag}.json"
    result_file = Path(ctx.work_dir) / f"result_{tag}.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, str(SUITE), "--run-spec", str(spec_file), "--result", str(result_file)]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"ok": False, "error": f"stopped at its {timeout:.0f} s limit", "timeout": True}
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"ok": False, "error": f"the run's process exited with code {proc.returncode}"}


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
        return f"timeout: {res['error']}"
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
                rec.row(**row, status=f"skipped: {ctx.left():.0f} s left in the part's cap")
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
def _usable_ladder(ctx: Ctx, rec: Recorder) -> list[Any]:
    """The planner's default ladder, without the rungs whose techniques cannot be built here."""
    from lightning_efficient.planner import default_ladder

    rungs = []
    for rung in default_ladder(ctx.cap_bytes):
        try:
            rung.build()
        except ImportError as err:
            rec.note(f"planner rung {rung.name!r} left out: {missing_package(err) or err} missing")
            continue
        rungs.append(rung)
    return rungs


def part_batch(ctx: Ctx, rec: Recorder) -> None:
    from lightning_efficient.planner import plan_stack

    p = ctx.profile
    kind, dims = "hf_gpt2", gpt2_dims(ctx)
    cap = ctx.cap_bytes
    rec.note(
        f"HF GPT-2 {describe(dims, kind)}, sequence {dims['seq']}, AdamW. The largest micro-batch "
        f"whose estimate (CUDA rounding) fits {format_bytes(cap)}, then 2 real steps at that size "
        + (
            "under torch.cuda.set_per_process_memory_fraction(cap / total)."
            if ctx.cuda
            else "on the CPU (dry run: the cap is emulated by the estimate only)."
        )
    )

    def largest(precision: str, techniques: list[dict[str, Any]]) -> tuple[int, int, int]:
        def fn(n: int) -> float:
            try:
                return estimate(kind, dims, n, precision, techniques).peak_bytes
            except ValueError:  # e.g. a checkpointing budget that no block count reaches
                return math.inf

        n, seen = largest_fitting_batch(fn, cap, p["batch_top"])
        return n, int(seen.get(n, 0)), len(seen)

    t0 = time.perf_counter()
    b_plain, est_plain, n_est = largest("32-true", [])
    rec.figure(plain_search_s=time.perf_counter() - t0, plain_estimates=n_est)

    t0 = time.perf_counter()
    target = p["planner_batch"]
    result = plan_stack(
        build_model(kind, dims, "meta"),
        meta_batch(target, dims["seq"]),
        cap,
        ladder=_usable_ladder(ctx, rec),
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
    runs: list[tuple[str, str, list[dict[str, Any]], dict[str, Any] | None, int, int]] = [
        ("plain (fp32, as configured)", "32-true", [], None, b_plain, est_plain)
    ]
    if rung is None:
        rec.note(f"the planner found no stack for batch {target} within the cap")
    else:
        callbacks, strategy = rung.build()
        specs = [class_spec(c) for c in callbacks]
        strat = class_spec(strategy) if strategy is not None else None
        # the largest batch with any subset of blocks checkpointed is the largest with all of them:
        # search with every block checkpointed; the real run keeps the planner's own callbacks
        search = [AC if s["class_path"] == "ActivationCheckpointing" else s for s in specs]
        search += [strat] if strat else []
        b_stack, est_stack, n_est = largest(rung.precision, search)
        rec.figure(stack_estimates=n_est)
        runs.append((f"planner: {rung.name}", rung.precision, specs, strat, b_stack, est_stack))
    for i, (name, precision, specs, strat, b, est) in enumerate(runs):
        row = {
            "stack": name,
            "precision": precision,
            "largest_micro_batch": b,
            "estimate_bytes": est,
            "techniques": [s["class_path"] for s in specs]
            + ([strat["class_path"]] if strat else []),
        }
        if b < 1:
            rec.row(**row, status="skipped: not even batch 1 fits the cap")
            continue
        spec = {
            "model": kind,
            "dims": dims,
            "batch": b,
            "steps": p["real_steps"],
            "precision": precision,
            "callbacks": specs,
            "strategy": strat,
            "device": ctx.device,
            "cap_bytes": cap if ctx.cuda else None,
        }
        # a fresh process per run on CUDA (the cap is per process); the dry run sends its
        # first run through the same path, to check it before a GPU is lent
        res = run_real(spec, ctx, isolate=ctx.cuda or i == 0, timeout=ctx.left() - 2)
        rec.row(
            **row,
            measured_bytes=res.get("peak_bytes"),
            reserved_bytes=res.get("reserved_bytes"),
            status=_status(res),
            wall_s=res.get("wall_s"),
        )
    rows = rec.data["rows"]
    plain = rows[0]["largest_micro_batch"] if rows else 0
    if len(rows) > 1 and plain:
        stack = rows[1]
        ran = "; ".join(f"{r['stack'].split(':')[0]} real step {r['status']}" for r in rows)
        rec.finish(
            f"largest micro-batch {plain} plain -> {stack['largest_micro_batch']} with "
            f"{stack['stack'].removeprefix('planner: ')} "
            f"({stack['largest_micro_batch'] / plain:.1f}x); {ran}"
        )
    else:
        rec.finish(f"largest micro-batch {plain} plain; the planner's stack not measured")


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


def _wait_prebuild(ctx: Ctx, limit: float) -> str:
    if not ctx.prebuild_done:
        return "ok"
    end = time.time() + limit
    flag = Path(ctx.prebuild_done)
    while time.time() < end:
        if flag.exists():
            return flag.read_text().strip() or "ok"
        time.sleep(1.0)
    return "still building"


def part_ladder(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    ladder = p["ladder"]
    cap, host_limit = ctx.cap_bytes, int(0.75 * ctx.host_ram_bytes)
    isolate = ctx.cuda
    rec.note(
        f"TinyGPT at GPT-2/GPT-3 shapes (head size 64, vocabulary {p['ladder_vocab']}), batch 1 x "
        f"{p['ladder_seq']}, fp32, AdamW. Per setting: the largest size whose estimate (CUDA "
        f"rounding) fits {format_bytes(cap)} and whose host memory fits 75% of "
        f"{format_bytes(ctx.host_ram_bytes)}, then {p['real_steps']} real steps at it"
        + (
            " under the cap."
            if ctx.cuda
            else " (dry run: on the CPU, cap emulated; ZeRO's device peak is not measured, as "
            "host and device memory are one)."
        )
    )
    plans: list[dict[str, Any]] = []
    start = 0
    for name, setting in SETTINGS:
        plan: dict[str, Any] = {"setting": name, "zero": setting, "tried": [], "choice": None}
        plans.append(plan)
        if setting is not None:
            try:
                build_technique({"class_path": "ZeROOffload", "init_args": setting})
            except ImportError as err:
                plan["skip"] = f"skipped: {missing_package(err) or _first_line(err)} not installed"
                continue
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
                    "fits_host": host <= host_limit,
                }
            )
            if not fits:
                break
            if host > host_limit:
                plan["host_bound"] = label
                break
            plan["choice"] = i
        if plan["choice"] is not None:
            start = plan["choice"]

    # real runs at each setting's choice; one size down after an out-of-memory
    for plan in plans:
        row = {"setting": plan["setting"], "estimate_tried": plan["tried"]}
        if plan.get("skip"):
            rec.row(**row, status=plan["skip"])
            continue
        if plan["choice"] is None:
            rec.row(**row, status="skipped: no size fits the cap by the estimate")
            continue
        if plan["zero"] is not None:
            state = _wait_prebuild(ctx, min(120.0, max(0.0, ctx.left() - 30)))
            if state != "ok":
                rec.row(**row, status=f"skipped: DeepSpeed's cpu_adam extension {state}")
                continue
        i, real = plan["choice"], []
        while i >= 0:
            label, n_layer, n_embd = ladder[i]
            spec = {
                "model": "tinygpt",
                "dims": _ladder_dims(ctx, n_layer, n_embd),
                "batch": 1,
                "steps": p["real_steps"],
                "precision": "32-true",
                "strategy": {"class_path": "ZeROOffload", "init_args": plan["zero"]}
                if plan["zero"]
                else None,
                "device": ctx.device,
                "cap_bytes": cap if ctx.cuda else None,
                "measure_memory": ctx.cuda or plan["zero"] is None,
            }
            res = run_real(spec, ctx, isolate=isolate, timeout=ctx.left() - 2)
            real.append(
                {
                    "model": label,
                    "parameters": res.get("parameters"),
                    "status": _status(res),
                    "measured_bytes": res.get("peak_bytes"),
                    "reserved_bytes": res.get("reserved_bytes"),
                    "wall_s": res.get("wall_s"),
                }
            )
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
        )
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


# -- part 5: speed -------------------------------------------------------------------------------
SPEED_STACK = [
    {"class_path": "MatmulPrecision", "init_args": {"level": "high"}},
    {"class_path": "TorchCompile", "init_args": {}},
    {"class_path": "OptimizerSwap", "init_args": {"name": "adamw_fused"}},
    {"class_path": "DataLoaderTuning", "init_args": {}},
]


def part_speed(ctx: Ctx, rec: Recorder) -> None:
    p = ctx.profile
    dims = gpt2_dims(ctx)
    batch, seq = p["speed_batch"], dims["seq"]
    compile_spec = {
        "class_path": "TorchCompile",
        "init_args": {"backend": p["compile_backend"]},
    }
    stack = [compile_spec if s["class_path"] == "TorchCompile" else s for s in SPEED_STACK]
    variants = [
        ("plain Lightning, fp32", "32-true", []),
        (
            "speed stack: precision auto + TF32 + regional compile + fused AdamW + loader tuning",
            "auto",
            stack,
        ),
    ]
    rec.note(
        f"TinyGPT {describe(dims)}, batch {batch} x {seq}, random tokens. Tokens/s "
        f"over the steps after {p['speed_warmup']} warm-up steps (compile happens there), "
        f"synchronised wall time, at most {p['speed_window_s']:.0f} s or {p['speed_steps']} steps. "
        "The speed stack is assembled here from the package's techniques (the planner picks for "
        "memory only)."
    )
    peak = peak_bf16(ctx.device_name) if ctx.cuda else None
    if ctx.cuda and peak is None:
        rec.note(f"no bf16 peak known for {ctx.device_name!r}: MFU not computed")
    model = build_model("tinygpt", dims, "meta")
    fpt = flops_per_token(
        unique_params(model), pos_params(model), dims["n_layer"], dims["n_embd"], seq
    )
    rec.figure(flops_per_token=fpt, peak_bf16_flops=peak)
    for name, precision, techniques in variants:
        spec = {
            "model": "tinygpt",
            "dims": dims,
            "batch": batch,
            "steps": p["speed_steps"],
            "precision": precision,
            "callbacks": techniques,
            "device": ctx.device,
            "measure_memory": False,
            "timing": {"warmup": p["speed_warmup"], "window_s": p["speed_window_s"]},
        }
        res = run_real(spec, ctx, isolate=ctx.cuda, timeout=ctx.left() - 2)
        row = {
            "variant": name,
            "precision": res.get("precision", precision),
            "status": _status(res),
            "tokens_per_s": res.get("tokens_per_s"),
            "step_s": res.get("step_s"),
            "timed_steps": res.get("timed_steps"),
            "first_step_s": res.get("first_step_s"),
            "loss": res.get("loss"),
            "report": res.get("report"),
        }
        if peak and res.get("tokens_per_s"):
            row["mfu"] = res["tokens_per_s"] * fpt / peak
        rec.row(**row)
    rows = rec.data["rows"]
    if len(rows) == 2 and all(r.get("tokens_per_s") for r in rows):
        a, b = rows
        speedup = b["tokens_per_s"] / a["tokens_per_s"]
        rec.figure(speedup=speedup)
        mfu = f", MFU {a['mfu']:.1%} -> {b['mfu']:.1%}" if a.get("mfu") and b.get("mfu") else ""
        rec.finish(
            f"tokens/s {a['tokens_per_s']:,.0f} -> {b['tokens_per_s']:,.0f} ({speedup:.2f}x){mfu}"
        )
    else:
        rec.finish("speed not measured for both variants")


# -- part 6: compile -----------------------------------------------------------------------------
def _compile_variant(
    variant: str, ctx: Ctx, dims: dict[str, Any], batch: Any, backend: str, bf16: bool
) -> dict[str, Any]:
    """One cold compile (or eager) of TinyGPT's training step: compile time, first and steady
    step time."""
    import torch._dynamo

    device = torch.device(ctx.device)
    x, y = batch
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("tinygpt", dims, ctx.device)
    names = []
    if variant != "eager":
        names = compile_modules(model, regional=variant == "regional", backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with CompileWatch() as watch:
        t0 = time.perf_counter()
        step()
        if ctx.cuda:
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        steady = time_fn(step, warmup=2, repeats=ctx.profile["compile_repeats"], device=device)
    return {
        "variant": variant,
        "status": "ok",
        "modules_compiled": len(names),
        "compile_s": watch.seconds,
        "graphs": watch.compiles,
        "recompiles": watch.recompiles,
        "first_step_s": first,
        "steady_step_s": steady,
    }


def part_compile(ctx: Ctx, rec: Recorder) -> None:
    import torch._inductor.config

    p = ctx.profile
    dims = gpt2_dims(ctx)
    batch, seq, backend = p["compile_batch"], dims["seq"], p["compile_backend"]
    torch._inductor.config.force_disable_caches = True  # every compile is a cold one
    bf16 = p["compile_precision"] == "bf16-mixed"
    rec.note(
        f"TinyGPT {describe(dims)}, batch {batch} x {seq}, "
        f"{'bf16 autocast' if bf16 else 'fp32'}, AdamW; one training step = forward + "
        f"cross-entropy + backward + step. Backend {backend}, caches disabled (cold compiles); "
        f"compile time = Dynamo compile events (CompileWatch); steady step = median of "
        f"{p['compile_repeats']} (measure.timing.time_fn). One process, variants in this order."
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, dims["vocab"], (batch, seq + 1), generator=g).to(ctx.device)
    data = (tokens[:, :-1], tokens[:, 1:])
    per_variant = None
    for variant in ("regional", "whole", "eager"):
        need = per_variant * 1.5 if per_variant and variant != "eager" else 10.0
        if ctx.left() < need:
            rec.row(variant=variant, status=f"skipped: {ctx.left():.0f} s left in the part's cap")
            continue
        t0 = time.perf_counter()
        rec.row(**_compile_variant(variant, ctx, dims, data, backend, bf16))
        per_variant = time.perf_counter() - t0
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
    by = {r["variant"]: r for r in rec.data["rows"] if r.get("status") == "ok"}
    if "eager" in by:
        for r in by.values():
            r["speed_vs_eager"] = by["eager"]["steady_step_s"] / r["steady_step_s"]
    if "regional" in by and "whole" in by and by["whole"]["compile_s"] > 0:
        t = by["regional"]["compile_s"] / by["whole"]["compile_s"]
        s = by["whole"]["steady_step_s"] / by["regional"]["steady_step_s"]
        rec.figure(regional_compile_over_whole=t, regional_speed_over_whole=s)
        rec.finish(
            f"regional compile takes {t:.2f}x the whole model's compile time and runs at "
            f"{s:.2f}x its steady speed"
        )
    else:
        rec.finish("regional and whole-model compile not both measured")


PARTS = {
    "estimate": part_estimate,
    "batch": part_batch,
    "ladder": part_ladder,
    "speed": part_speed,
    "compile": part_compile,
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


def run_spec_main(spec_file: str, result_file: str) -> int:
    """``gpu_suite.py --run-spec``: one real run in this fresh process."""
    spec = json.loads(Path(spec_file).read_text())
    try:
        res = real_fit(spec)
    except Exception as err:
        traceback.print_exc()
        res = {
            "ok": False,
            "error": f"{type(err).__name__}: {_first_line(err)}",
            "oom": is_oom(err),
        }
    Path(result_file).write_text(json.dumps(res, default=str))
    return 0
