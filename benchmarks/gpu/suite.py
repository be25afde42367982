"""The one prepared GPU run: the project's headline figures measured on one CUDA device.

    python -m benchmarks.gpu.suite                 # on a CUDA machine, at most 9 minutes
    python -m benchmarks.gpu.suite --dry-run       # the same script on the CPU, tiny shapes

Seven parts, each in its own process with its own time cap (a part that would pass the suite's
limit is skipped and says so; a failure in one does not stop the others; the dry run runs the
parts of one lane in one process, which imports once, and parts 4-7 in the memory lane's
process, ``DRY_PROCESS``). DeepSpeed's CPU extensions are built first, in a process of their
own, while parts 1-4 run (part 4's ZeRO rows wait for it within part 4's cap); the parts that
measure memory or correctness (1-4) run side by side, each within its own caps, and the parts
that time something (5-7) run alone afterwards:

1. ``pytest -m gpu``: the GPU-marked tests, from the files that carry the mark (dry run:
   collected only, ``--co``).
2. Estimate vs reality: HF GPT-2 124M and TinyGPT at GPT-2 small shape, sequence 1024, for
   fp32, bf16-mixed, + checkpointing, + adamw8bit: ``estimate_memory``'s peak against
   ``torch.cuda.max_memory_allocated`` of the same two Lightning steps (goal: within 10%).
3. Largest micro-batch within a 24 GiB cap: plain fp32 vs the planner's stack (``plan_stack``):
   the estimate's pick, and the real largest found by real steps (each size in its own process
   under ``torch.cuda.set_per_process_memory_fraction``, several side by side).
4. Largest GPT-2-shaped model at batch 1 x 1024 within the cap: plain vs ZeRO-2 and ZeRO-3
   with CPU offload (``ZeROOffload``), real steps at the estimate's choice.
5. Speed, one lever at a time (issue 29): tokens/s, step time and MFU of TinyGPT at GPT-2
   124M shape from plain fp32 Lightning through bf16-mixed, TF32, fused AdamW, compile
   (``TorchCompile(scope="auto")``: both scopes measured, its choice kept), a larger
   micro-batch (the effective batch kept) and the chunked loss; each row's ``StepProfiler``
   verdict, and the profiler's own cost on the last stack. Then packing (issue 52):
   ``packing.py``'s long-tail documents on a 244M Llama, padded batches against
   ``SequencePacking``'s rows, tokens/s of the documents' own tokens (goal: >= 2x). Last, where
   time is left: CUDA graphs on the ablation's last stack.
6. Compile: regional vs whole-model compile time and steady step time, and the auto choice.
7. Fine-tuning (issue 39): a Llama shape (8 layers of Llama-3.2-1B's, vocabulary 128,256, bf16
   weights) with PEFT LoRA r=16 on every linear layer, seq 2048, bf16-mixed: LoRA alone and
   LoRA + ``FrozenWeights4bit`` + ``ActivationCheckpointing`` + ``ChunkedCrossEntropy``, each
   a real run: its peak against ``estimate_memory``'s for the same stack, and tokens/s; where
   time is left (issue 52), the second stack again with ``PYTORCH_CUDA_ALLOC_CONF=
   expandable_segments:True``, in processes of its own: its reserved bytes against the default's.

Writes ``gpu_<device>.md``, ``.json`` and ``.log`` to ``--out`` (default
``benchmarks/results``; a dry run writes to a temporary folder unless ``--out`` is given). The
output format and the caps are described in ``benchmarks/README.md``.

This parent process imports no torch for the parts: it starts them, enforces their caps and
writes the results. The parts, their caps and the script each part's process runs are one
registry, ``benchmarks/gpu/registry.py`` (standard library only); the measuring code is in those
scripts (``estimate.py``, ``batch.py``, ``ladder.py``, ``speed.py``,
``compile.py``, ``finetune.py``) over ``common.py`` and ``run.py`` (a real
run and its processes). This script is the runner; what it runs with is in ``processes.py``
(a part's process and its cap, DeepSpeed's build), ``pytest_part.py`` (part 1) and
``markdown.py`` (the ``.md``), all standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._results import environment, host_ram_bytes, save_results
from benchmarks.gpu.markdown import markdown
from benchmarks.gpu.processes import Build, Child, finish_part
from benchmarks.gpu.pytest_part import finish_pytest, start_pytest
from benchmarks.gpu.registry import (
    PARTS,
    PHASE_A,
    PHASE_B,
    UNFINISHED,
    Part,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FORMAT_VERSION = 2
TOTAL_S = 540.0  # 9 minutes, on a cold GPU machine
GIB = 2**30


# -- the shapes of a GPU run and of a dry run ------------------------------------------------------
PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        "seq": 1024,
        "vocab": 50257,
        "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
        "estimate_batch": 8,
        "batch_top": 256,
        "planner_batch": 32,
        # issue 31: AutoEfficient(budget=cap) at this effective batch for this many steps
        "auto_batch": 128,
        "auto_steps": 100,
        "auto_need_s": 90.0,
        # GPT-2 / GPT-3 shapes (name, n_layer, n_embd), head size 64: benchmarks/zero_offload.py
        "ladder": [
            ["124M", 12, 768],
            ["350M", 24, 1024],
            ["774M", 36, 1280],
            ["1.5B", 48, 1600],
            ["2.7B", 32, 2560],
            ["6.7B", 32, 4096],
            ["13B", 40, 5120],
        ],
        "ladder_seq": 1024,
        "ladder_vocab": 50257,
        # part 4 waits for DeepSpeed's build while its cap leaves this for a ZeRO run (one took
        # more than 83 s on an H200, stopped there)
        "zero_need_s": 90.0,
        "speed_batch": 8,
        "speed_accumulate": 2,
        "speed_steps": 300,
        "speed_warmup": 5,
        "speed_window_s": 3.0,
        # part 5's packing rows: workloads' long-tail paragraphs, padded batches of "rows"
        # documents against SequencePacking's rows of 512 tokens, "rows" a batch; a Llama of
        # 16 x 1024 (16/4 heads, 244M parameters); "need_s": the time the ablation keeps for
        # the pair (expected: 2 runs of about 10 s, each in a process started ahead)
        "packing": {
            "documents": 2000,
            "rows": 8,
            "n_layer": 16,
            "n_embd": 1024,
            "n_head": 16,
            "n_kv_head": 4,
            "precision": "bf16-mixed",
            "steps": 300,
            "warmup": 5,
            "window_s": 2.0,
            "need_s": 24.0,
        },
        "compile_batch": 8,
        "compile_repeats": 10,
        "compile_backend": "inductor",
        "compile_precision": "bf16-mixed",
        "real_steps": 2,
        # part 7 (issue 39): the Llama-3.2-1B block shape at 8 of its 16 layers, LoRA r=16
        "finetune": {
            "n_layer": 8,
            "n_embd": 2048,
            "n_head": 32,
            "n_kv_head": 8,
            "intermediate": 8192,
            "vocab": 128256,
            "seq": 2048,
            "long_seq": 16384,
            "batch": 1,
            "lora_r": 16,
            "dtype": "bfloat16",
            "precision": "bf16-mixed",
            "steps": 30,
            "warmup": 3,
            "window_s": 3.0,
        },
    },
    "dry": {
        "seq": 64,
        "vocab": 512,
        "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 2},
        "estimate_batch": 4,
        # part 2: the first and the last stack (the last holds every technique of the others)
        "estimate_stacks": ["fp32", "bf16-mixed + checkpointing + adamw8bit"],
        "batch_top": 64,
        "planner_batch": 16,
        # divisors 8, 16, 32: the whole batch fits no rung, a line through 2 sizes places 16
        # (the real largest of the planner's stack); 2 steps of 2 micro-batches each
        "auto_batch": 32,
        "auto_steps": 2,
        "auto_need_s": 10.0,
        "ladder": [["tiny-1", 1, 64], ["tiny-2", 2, 64], ["tiny-3", 2, 128], ["tiny-4", 4, 128]],
        "ladder_seq": 64,
        "ladder_vocab": 512,
        "zero_need_s": 10.0,
        "speed_batch": 4,
        "speed_accumulate": 2,
        "speed_steps": 6,
        "speed_warmup": 2,
        "speed_window_s": 3.0,
        "packing": {
            "documents": 120,
            "rows": 4,
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "n_kv_head": 2,
            "precision": "32-true",
            "steps": 6,
            "warmup": 2,
            "window_s": 3.0,
            "need_s": 10.0,
        },
        "compile_batch": 4,
        "compile_repeats": 3,
        "compile_backend": "aot_eager",
        "compile_precision": "32-true",
        "real_steps": 2,
        "finetune": {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "n_kv_head": 2,
            "intermediate": 128,
            "vocab": 512,
            "seq": 64,
            "long_seq": 256,
            "batch": 2,
            "lora_r": 16,
            "dtype": "float32",
            "precision": "32-true",
            "steps": 4,
            "warmup": 1,
            "window_s": 3.0,
        },
    },
}


#: The dry run's processes, by lane: part 4 runs in the memory lane's process after parts 2
#: and 3 (the two lanes one after the other), and the timed parts there once phase A has ended:
#: two imports fewer (~11 CPU-s each). A GPU run gives each part a fresh process.
DRY_PROCESS = {"ladder": "memory", PHASE_B: "memory"}

#: Caps of the dry run's emulated memory limits (parts 3 and 4), by the estimate only.
DRY_CAPS = {"batch": 16 * 2**20, "ladder": 4 * 2**20}


# -- helpers ---------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text, flags=re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"a size like 24GiB or 80GB; got {text!r}")
    units = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
    units.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
    return int(float(m.group(1)) * units[(m.group(2) or "B").lower()])


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"`` (the results file's name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def probe_device(dry_run: bool) -> dict[str, Any]:
    """Name, memory, capability and driver of CUDA device 0 (or the CPU in a dry run)."""
    if dry_run:
        import platform

        return {"name": f"CPU ({platform.machine()}), dry run", "type": "cpu", "driver": "-"}
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {
        "name": props.name,
        "type": "cuda",
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "cudnn": str(torch.backends.cudnn.version()),
        "devices": torch.cuda.device_count(),
        "driver": "unknown",
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def time_for(
    part: Part, later: list[Part], elapsed: float, budget_s: float, scale: float
) -> tuple[float, float]:
    """``(left, timeout)`` of ``part`` after ``elapsed`` s: what the budget leaves it once the
    ``later`` timed parts' time is kept (their caps for a part of phase A, their minimums for a
    timed one), and its time limit: that, at most its cap; a part with ``spare_s`` may take that
    much more where the budget still holds the later parts' caps."""
    keep = sum((p.cap_s if part.lane != PHASE_B else p.min_s) * scale for p in later)
    left = budget_s - elapsed - keep
    timeout = min(part.cap_s * scale, left)
    if part.spare_s:  # its rows that run only where time is left
        spare = budget_s - elapsed - sum(p.cap_s * scale for p in later)
        timeout = max(timeout, min((part.cap_s + part.spare_s) * scale, spare))
    return left, timeout


# -- the suite -------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the same script on the CPU, tiny shapes")
    p.add_argument(
        "--out",
        help="folder for gpu_<device>.{md,json,log} (default: benchmarks/results"
        "; a dry run: a new temporary folder)",
    )
    p.add_argument(
        "--parts",
        default=",".join(str(p.number) for p in PARTS),
        help="parts to run, e.g. 2,3 (default: all)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=TOTAL_S,
        help="the suite's time limit in seconds (default 540); the caps scale with it",
    )
    p.add_argument(
        "--cap",
        type=parse_size,
        default=24 * GIB,
        help="device memory cap of parts 3 and 4 (default 24GiB)",
    )
    p.add_argument(
        "--host-ram",
        type=parse_size,
        default=None,
        help="host memory the ZeRO runs may plan with (default: MemTotal)",
    )
    p.add_argument(
        "--commit",
        default=None,
        help="the commit the results are of (default: git rev-parse; a copy of the checkout "
        "sent to a GPU machine may carry other git metadata)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        selected = {int(x) for x in args.parts.split(",") if x.strip()}
    except ValueError:
        print(
            f"error: --parts takes numbers 1-{len(PARTS)} separated by commas; got {args.parts!r}"
        )
        return 2
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device here. Run with --dry-run to check the script on the CPU.")
            return 2
    started = time.time()
    name = "dry_run_cpu" if args.dry_run else None
    if args.out:
        out_dir = Path(args.out)
    elif args.dry_run:
        out_dir = Path(tempfile.mkdtemp(prefix="gpu_suite_dry_"))
    else:
        out_dir = RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_work_"))
    log = out_dir / "gpu_suite.log.tmp"
    log.write_text(f"gpu_suite {datetime.datetime.now().isoformat(timespec='seconds')}\n")
    # first of all, DeepSpeed's build: minutes on a cold machine, alongside parts 1-3
    build = Build(work, log) if 4 in selected else None
    device = probe_device(args.dry_run)
    name = name or slug(device["name"])
    scale = args.budget_s / TOTAL_S
    host_ram = args.host_ram or host_ram_bytes() or 16 * GIB
    base_ctx = {
        "dry_run": args.dry_run,
        "device": "cpu" if args.dry_run else "cuda",
        "device_name": device["name"],
        "device_total_bytes": int(device.get("total_memory_bytes", 0)),
        "profile": PROFILES["dry" if args.dry_run else "gpu"],
        "work_dir": str(work),
        "host_ram_bytes": host_ram,
        "cap_bytes": args.cap,
        "prebuild_done": str(build.flag) if build else "",
    }
    command = "python -m benchmarks.gpu.suite" + " ".join(
        [""] + [a for a in (argv if argv is not None else sys.argv[1:])]
    )
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "dry_run": args.dry_run,
        "command": command,
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "commit": args.commit or _git_commit(),
        "device": device,
        "environment": environment(),
        "budget_s": args.budget_s,
        "cap_bytes": args.cap,
        "host_ram_bytes": host_ram,
        "parts": [],
    }
    entries: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        entries[part.key] = {
            "number": part.number,
            "key": part.key,
            "title": part.title,
            "lane": part.lane,
            "cap_s": part.cap_s * scale,
            "spare_s": part.spare_s * scale,
            "cap_basis": part.basis,
            "rows": [],
            "figures": {},
            "notes": [],
            "status": UNFINISHED[0],
        }
        data["parts"].append(entries[part.key])
    chosen = [p for p in PARTS if p.number in selected]
    children: dict[str, Child] = {}
    every_child: list[Child] = []
    say = threading.Lock()
    closed = False  # the last write is done: a lane still ending writes no more

    def record(entry: dict[str, Any], **fields: Any) -> None:
        """``fields`` into a part's entry, then the results so far written (atomically): a suite
        stopped from outside still leaves every part that ended."""
        with say:
            entry.update(fields)
            if not closed:
                data["total_s"] = time.time() - started
                save_results(out_dir / f"gpu_{name}", markdown(data), data, echo=False)

    def run_one(part: Part) -> None:
        entry = entries[part.key]
        if part.number not in selected:
            record(entry, status="skipped", reason="not selected (--parts)", seconds=0.0)
            return
        later = [p for p in chosen if p.lane == PHASE_B and p.number > part.number]
        left, timeout = time_for(part, later, time.time() - started, args.budget_s, scale)
        if left < part.min_s * scale:
            record(
                entry,
                status="skipped",
                seconds=0.0,
                reason=f"would pass the {args.budget_s:.0f} s limit: {max(0, left):.0f} s left "
                f"for it, the part needs at least {part.min_s * scale:.0f} s "
                f"(its cap: {part.cap_s * scale:.0f} s)",
            )
            if part.key in children:
                child = children.pop(part.key)
                if not child.shared:  # a shared process goes on to the lane's next part
                    child.kill()
            return
        with say:
            print(f"[{part.number}/{len(PARTS)}] {part.title} (cap {timeout:.0f} s)", flush=True)
        record(entry, status=UNFINISHED[1])
        if part.key == "pytest":
            child = start_pytest(args.dry_run, work)
            child.go(None, timeout)
            result = finish_pytest(child, args.dry_run, work, log)
        else:
            ctx = dict(base_ctx)
            if args.dry_run and part.key in DRY_CAPS:
                ctx["cap_bytes"] = DRY_CAPS[part.key]
            result = {"cap_bytes": ctx["cap_bytes"] if part.key in DRY_CAPS else None}
            child = children.pop(part.key, None) or Child.part(part, work)
            child.go(ctx, timeout)
            result.update(finish_part(child, log))
        record(entry, **result, seconds=time.time() - child.started)
        with say:
            print(
                f"[{part.number}/{len(PARTS)}] {part.title}: {entry['status']}: "
                f"{entry.get('headline') or entry.get('reason', '')}",
                flush=True,
            )

    def lane(name: str) -> None:
        for part in PARTS:
            if part.lane == name:
                run_one(part)

    def lanes(names: list[str]) -> None:
        for lane_name in names:
            lane(lane_name)

    try:
        # every part's process starts now and imports while it waits for its turn; in the dry
        # run the parts of a lane share one, parts 4-7 the memory lane's (DRY_PROCESS; a
        # GPU run gives each part a fresh process and allocator)
        scripted = [p for p in chosen if p.script]
        dry = DRY_PROCESS if args.dry_run else {}
        process_of = {p.key: dry.get(p.lane, p.lane) for p in scripted}
        for process in dict.fromkeys(process_of.values()):
            group = [p for p in scripted if process_of[p.key] == process]
            shared = Child.shared_by(group, work) if args.dry_run and len(group) > 1 else None
            for i, part in enumerate(group):
                children[part.key] = shared[i] if shared else Child.part(part, work)
        every_child = list(children.values())
        # phase A's lanes side by side; lanes whose parts share a process (the dry run) one
        # after the other
        together: dict[str, list[str]] = {}
        for lane_name in PHASE_A:
            together.setdefault(dry.get(lane_name, lane_name), []).append(lane_name)
        threads = [threading.Thread(target=lanes, args=(n,), name=n[0]) for n in together.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if build is not None:
            build.stop()  # part 4 has ended: nothing needs it any more
        lane(PHASE_B)  # alone: nothing else of the suite runs while these time anything
    finally:
        with say:
            closed = True
        for child in [*children.values(), *every_child]:
            child.kill()
        data["total_s"] = time.time() - started
        if build is not None:
            build.stop()
            data["build"] = build.info()
            waited = entries["ladder"].get("figures", {}).get("build_wait_s")
            if waited is not None:
                data["build"]["part_4_waited_s"] = waited
        text = markdown(data)
        md, js = save_results(out_dir / f"gpu_{name}", text, data, echo=False)
        final_log = out_dir / f"gpu_{name}.log"
        os.replace(log, final_log)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {md}, {js} and {final_log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
