"""Part 3 of ``benchmarks/gpu/suite.py``: the largest micro-batch within the cap.

Plain fp32 against the planner's stack (``plan_stack``) and the same stack with and without the
chunked loss: the estimate's pick, and the real largest found by real steps (each size in its own
process under ``torch.cuda.set_per_process_memory_fraction``, several side by side), then
AutoEfficient under the same cap. Run by the suite as ``python -m benchmarks.gpu.batch --ctx
FILE``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from benchmarks.gpu.common import (
    AC,
    CHUNKED,
    Ctx,
    Recorder,
    child_main,
    describe,
    estimate,
    gpt2_dims,
    missing_package,
)
from benchmarks.gpu.run import RunPool, run_status
from benchmarks.gpu.search import LargestSearch, Probe
from benchmarks.workloads import build_model, meta_batch
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.functional import largest_fitting_batch

__all__ = ["BatchProbes", "part_batch"]


def _usable_ladder(ctx: Ctx, rec: Recorder, model: Any) -> list[Any]:
    """The planner's default ladder for ``model``, without the rungs whose techniques cannot be
    built here."""
    from lightning_efficient.planning import default_ladder
    from lightning_efficient.techniques.chunked_loss import worth_chunking

    rungs = []
    for rung in default_ladder(chunked_loss=worth_chunking(model)):
        rung = rung.within(ctx.cap_bytes)  # the budget handed to the parts that take one
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
    parts' own processes, CUDA contexts), at most 4; in the dry run 2 (the same code path; one
    run of the first round in a process, the others in the part's own)."""
    if not ctx.cuda:
        return 2
    room = ctx.device_total_bytes - (ctx.cap_bytes + GIB) - 8 * GIB
    return max(1, min(4, int(room // (ctx.cap_bytes + GIB))))


def _probe_status(res: dict[str, Any]) -> str:
    if res.get("ok"):
        return "ok"
    if res.get("oom"):
        return "oom"
    return run_status(res)


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
            # the dry run sends the first probe of its first round through a process (the
            # code path of CUDA's runs) and runs every other one here, alongside it
            if not self.ctx.cuda:
                self.pool.warm = 0  # no process waits for a round that will not come
            for j, n in enumerate(sizes):
                isolate = self.ctx.cuda or (self.rounds == 0 and j == 0)
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
            "of memory); 2 side by side, as on CUDA, the first in a process of its own"
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

    pool = RunPool(ctx, warm=slots if ctx.cuda else 1)  # the dry run: one run in a process
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
    # in its own process on CUDA (a fresh allocator under the cap); the dry run runs it here,
    # as its later probe rounds (the first round exercised the run processes)
    res = pool.wait([pool.submit(spec, ctx.left() - 2, isolate=ctx.cuda)])[0]
    d = res.get("auto") or {}
    planner = next((r for r in rows if str(r.get("stack", "")).startswith("planner:")), None)
    best = max((r.get("largest_real") or 0 for r in rows), default=0)
    real = (planner or {}).get("largest_real") or best
    micro = d.get("micro_batch")
    attainable = max((n for n in range(1, batch + 1) if batch % n == 0 and n <= real), default=0)
    out = {
        "status": "ok" if res.get("ok") else ("oom" if res.get("oom") else run_status(res)),
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


if __name__ == "__main__":
    sys.exit(child_main(part_batch))
