"""Part 4 of ``benchmarks/gpu/suite.py``: the largest GPT-2-shaped model at batch 1 within the cap.

Plain Lightning against ZeRO-2 and ZeRO-3 with CPU offload (``ZeROOffload``): per setting the
largest size whose estimate fits the cap and whose host memory fits, then real steps at it (one
size down after an out-of-memory); the ZeRO-3 offload run goes before ZeRO-2's (``RUN_ORDER``).
The ZeRO settings wait for DeepSpeed's extension build the suite started first. Run by the suite
as ``python -m benchmarks.gpu.ladder --ctx FILE``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import (
    Ctx,
    Recorder,
    build_technique,
    child_main,
    estimate,
    first_line,
    missing_package,
    time_skip,
    unique_params,
)
from benchmarks.gpu.run import Run, RunPool, run_status
from benchmarks.workloads import build_model
from lightning_efficient.core.validate import format_bytes

__all__ = ["RUN_ORDER", "SETTINGS", "part_ladder", "wait_prebuild"]

SETTINGS: list[tuple[str, dict[str, Any] | None]] = [
    ("plain Lightning", None),
    ("ZeRO-2, optimizer offloaded to CPU", {"stage": 2, "offload_optimizer": "cpu"}),
    (
        "ZeRO-3, optimizer and parameters offloaded to CPU",
        {"stage": 3, "offload_optimizer": "cpu", "offload_parameters": True},
    ),
]
#: The order of the real runs (indices into ``SETTINGS``; the estimates go in ``SETTINGS``'
#: order, each starting from the size the one before chose). Plain first (it trains while the
#: ZeRO settings are estimated), then ZeRO-3 with offload: the run of the headline, the largest
#: model that trains, gets the part's time before ZeRO-2 takes what is left.
RUN_ORDER = (0, 2, 1)


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


def wait_prebuild(ctx: Ctx, need_s: float) -> tuple[str, float]:
    """Wait for DeepSpeed's extension build the suite started first, while the part's cap still
    leaves ``need_s`` for a ZeRO run after it: ``(state, seconds waited)``, the state ``ok``,
    ``failed to build: ...`` or ``still building ...``. The wait is part of the part's cap (and
    so of the suite's budget)."""
    if not ctx.prebuild_done:
        return "ok", 0.0
    t0 = time.time()
    flag = Path(ctx.prebuild_done)
    state = ""
    while ctx.left() > need_s:
        if flag.exists():
            text = flag.read_text().strip()
            try:
                state = json.loads(text)["status"]
            except (ValueError, KeyError, TypeError):
                state = text or "ok"
            break
        time.sleep(0.5)
    waited = time.time() - t0
    if not state:
        state = (
            f"still building with {max(0.0, ctx.left()):.0f} s left in the part's cap (a ZeRO "
            f"run needs about {need_s:.0f} s; waited {waited:.0f} s)"
        )
    return state, waited


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
        + " The ZeRO settings wait for DeepSpeed's cpu_adam build, started first by the suite, "
        f"within the part's cap: while it leaves {p['zero_need_s']:.0f} s for a ZeRO run (then "
        "they are skipped, saying so)."
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
            "status": run_status(res),
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
                what = missing_package(err) or first_line(err)
                plans.append({"setting": name, "zero": setting, "skip": f"skipped: {what} missing"})
                continue
        plan = _plan_setting(ctx, ladder, setting, start, cap, limit)
        plan.update(setting=name, zero=setting)
        plans.append(plan)
        if plan["choice"] is not None:
            start = plan["choice"]
            if setting is None:  # the plain run trains while the ZeRO settings are estimated
                # (the dry run: here, before them; part 3's probes exercise the run processes)
                first = pool.submit(spec(plan["choice"], None), ctx.left() - 2, isolate=ctx.cuda)

    zero_wall: float | None = None
    waited = 0.0
    for plan in (plans[k] for k in RUN_ORDER if k < len(plans)):
        row = {"setting": plan["setting"], "estimate_tried": plan.get("tried", [])}
        if plan.get("skip"):
            rec.row(**row, status=plan["skip"])
            continue
        if plan["choice"] is None:
            rec.row(**row, status="skipped: no size fits the cap by the estimate")
            continue
        if plan["zero"] is not None:
            state, wait = wait_prebuild(ctx, p["zero_need_s"])
            waited += wait
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
    rec.figure(build_wait_s=round(waited, 1))
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


if __name__ == "__main__":
    sys.exit(child_main(part_ladder))
