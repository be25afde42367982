"""What every part process of ``benchmarks/gpu/suite.py`` shares: the context a part is given
(``Ctx``), the ``Recorder`` that writes its rows, the instrument's estimate of a spec (its
models are ``benchmarks.workloads.build_model``'s), the suite's MFU terms (the device's bf16 peak
from the package's ``measure.speed.flops`` table, FLOPs per token), and ``child_main``, which
runs one part in its own process (``python -m benchmarks.gpu.<part> --ctx FILE``; the parts'
scripts are named in ``registry.PARTS``).

Each part takes a ``Ctx`` (device, profile of shapes, deadline) and a ``Recorder`` that saves
its rows to a JSON file after every row, so a part stopped at its cap keeps what it measured.
Imported by the part processes only (it imports torch, Lightning and the package).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import lightning_efficient as le
from benchmarks.workloads import build_model, meta_batch
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.speed.flops import gpu_peak

ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "AC",
    "CHUNKED",
    "SWAP8",
    "Ctx",
    "INCOMPLETE",
    "Recorder",
    "bf16_peak",
    "build_technique",
    "child_main",
    "describe",
    "estimate",
    "first_line",
    "flops_per_token",
    "gpt2_dims",
    "missing_package",
    "params_text",
    "pos_params",
    "time_skip",
    "unique_params",
]


def bf16_peak(device_name: str) -> tuple[float | None, str]:
    """``(dense bf16 peak FLOP/s or None, source)`` of a GPU by its name: the package's table
    (``measure.speed.flops.gpu_peak``, which ``peak_flops`` reads for a CUDA device)."""
    found = gpu_peak(device_name, "bf16")
    return found if found is not None else (None, f"no bf16 peak known for {device_name!r}")


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
        self.data["reason"] = f"{type(err).__name__}: {first_line(err)}"
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


def first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_package(err: BaseException) -> str | None:
    """The package an ImportError (or the package's missing-extra error) names, if any."""
    if isinstance(err, ModuleNotFoundError) and err.name:
        return err.name.split(".")[0]
    text = str(err)
    for name in ("bitsandbytes", "deepspeed", "transformers", "torchao"):
        if name in text and ("install" in text or "No module" in text):
            return name
    return None


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


AC = {"class_path": "ActivationCheckpointing", "init_args": {}}
SWAP8 = {"class_path": "OptimizerSwap", "init_args": {"name": "adamw8bit"}}
CHUNKED = {"class_path": "ChunkedCrossEntropy", "init_args": {}}


def gpt2_dims(ctx: Ctx, **extra: Any) -> dict[str, Any]:
    p = ctx.profile
    return {**p["gpt2"], "vocab": p["vocab"], "seq": p["seq"], **extra}


# -- a part in its own process -------------------------------------------------------------------
def child_main(part: Callable[[Ctx, Recorder], None], argv: list[str] | None = None) -> int:
    """Run ``part`` with the context in ``--ctx FILE``; its rows go to ``ctx.result_file``.

    Started ahead of its turn (the imports done), the process waits for the context file the
    suite writes with the deadline, and ends if the suite is gone first."""
    parser = argparse.ArgumentParser(description="one part of benchmarks/gpu/suite.py")
    parser.add_argument("--ctx", required=True, help="the context file the suite writes")
    ctx_file = parser.parse_args(argv).ctx
    parent, path = os.getppid(), Path(ctx_file)
    while not path.exists():
        if os.getppid() != parent:  # the suite is gone
            return 3
        time.sleep(0.05)
    ctx = Ctx.load(ctx_file)
    # the dry run leaves a core to the process importing alongside; tiny models need no more
    torch.set_num_threads(1 if ctx.dry_run else min(torch.get_num_threads(), 8))
    rec = Recorder(ctx.result_file)
    code = 0
    cpu = time.process_time()
    try:
        part(ctx, rec)
    except Exception as err:
        traceback.print_exc()
        rec.fail(err)
        code = 1
    # into the part's log: what the part cost this process (its run processes not included)
    print(f"{part.__name__}: {time.process_time() - cpu:.1f} CPU-s in this process", flush=True)
    # the part has ended (a process shared by several parts in the dry run goes on to the next)
    path.with_suffix(".done").write_text(str(code))
    return code
