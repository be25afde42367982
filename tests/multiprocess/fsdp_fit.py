"""Fit the tiny model under FullyShardedStrategy with 2 CPU processes (gloo); each rank writes
``OUT/rank<r>.json``: its losses, what was sharded and checkpointed, its report (with
MemoryBreakdown's tracked peak of each sampled step when asked). Options come as one JSON object.

Usage: python tests/multiprocess/fsdp_fit.py '{"callbacks": {"ActivationCheckpointing": {}}, ...}'
OUT (keys: callbacks, strategy, trainer, model (``tiny_model`` overrides), steps, save_at,
allocator_step: also the CPU allocator's peak over that step, from the profiler's events)
(Lightning re-launches this script for rank 1.)

Each rank reads every other sample (``interleaved_data``), so the two ranks' batches of 4 together
are the plain run's batch of 8 (``interleaved_data(8)`` on one process).
"""

import json
import os
import sys
from pathlib import Path

import torch
from helpers import SaveAt, fit
from lightning.pytorch import Callback

from benchmarks.workloads import interleaved_data, tiny_model
from lightning_efficient import techniques
from lightning_efficient.core.report import report_for
from lightning_efficient.techniques import fsdp
from lightning_efficient.techniques.activation_checkpointing import checkpointed_blocks


class AllocatorPeak(Callback):
    """The CPU allocator's peak in the backward of optimizer step ``step`` (``torch.profiler``
    memory events, ``measure.memory.allocator``): an instrument that does not share the storage
    tracker's view."""

    def __init__(self, step: int) -> None:
        self.step, self.prof, self.result = step, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        from torch.profiler import ProfilerActivity, profile

        from lightning_efficient.measure.memory.allocator import live_bytes
        from lightning_efficient.measure.memory.optimizer_models import optimizer_state_tensors

        # the profiler sees no free of a block allocated before it started: the last step's
        # gradients, freed by zero_grad before backward (where the peak is), are left out
        params = [p.to_local() for p in pl_module.parameters()]
        states = [optimizer_state_tensors(o) for o in trainer.optimizers]
        states = [getattr(t, "to_local", lambda t=t: t)() for s in states for t in s]
        self.start = live_bytes([*params, *states, *pl_module.buffers(), *batch])
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.prof is None:
            return
        import tempfile

        from lightning_efficient.measure.memory.allocator import memory_events, running_peak

        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            self.prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = json.loads(Path(tmp, "trace.json").read_text())
        self.prof = None
        self.result = {
            "start_bytes": self.start,
            "peak_bytes": self.start + running_peak(memory_events(trace)),
        }


class Seen(Callback):
    """What the model looks like during the first training step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            self.checkpointed = sorted(checkpointed_blocks(pl_module))
            self.sharded = fsdp.sharded_modules(pl_module)
            params = list(pl_module.parameters())
            self.dtensors = sum(type(p).__name__ == "DTensor" for p in params)
            self.local_numel = sum(p.to_local().numel() for p in params)
            self.numel = sum(p.numel() for p in params)


def main(options: dict, out: Path) -> None:
    callbacks = [getattr(techniques, n)(**a) for n, a in options.get("callbacks", {}).items()]
    seen = Seen()
    callbacks.append(seen)
    steps = options.get("steps", 4)
    allocator = AllocatorPeak(options["allocator_step"]) if "allocator_step" in options else None
    if allocator is not None:
        callbacks.append(allocator)
    if options.get("save_at"):
        callbacks.append(SaveAt(options["save_at"], out / "fsdp.ckpt"))
    strategy = fsdp.FullyShardedStrategy(**options.get("strategy", {}))
    kwargs = {"accelerator": "cpu", "devices": 2, "max_steps": steps, **options.get("trainer", {})}
    try:
        trainer, model, rec = fit(
            str(out),
            callbacks,
            strategy=strategy,
            model=tiny_model(**options["model"]) if options.get("model") else None,
            data=interleaved_data(4),
            use_distributed_sampler=False,
            **kwargs,
        )
    except Exception as err:  # a refusal: each rank writes what stopped it
        rank = os.environ.get("LOCAL_RANK", "0")
        (out / f"rank{rank}.json").write_text(json.dumps({"error": f"{type(err).__name__}: {err}"}))
        raise
    result = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "losses": rec.losses,
        **{
            k: getattr(seen, k)
            for k in ("checkpointed", "sharded", "dtensors", "local_numel", "numel")
        },
        "report": report_for(trainer).to_dict(),
        "allocator": allocator.result if allocator is not None else None,
        "tracked_peaks": {  # MemoryBreakdown's peak of each sampled step
            step: m.peak_bytes
            for c in callbacks
            if isinstance(c, techniques.MemoryBreakdown)
            for step, m in c.measurements.items()
        },
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
