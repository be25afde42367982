"""Fit the tiny model under FullyShardedStrategy with 2 CPU processes (gloo); each rank writes
``OUT/rank<r>.json``: its losses, what was sharded and checkpointed, its report (with
MemoryBreakdown's tracked peak of step 1 when asked). Options come as one JSON object.

Usage: python tests/_fsdp_fit.py '{"callbacks": {"ActivationCheckpointing": {}}, ...}' OUT
(keys: callbacks, strategy, trainer, model (``tiny_model`` overrides), steps, save_at)
(Lightning re-launches this script for rank 1.)

Each rank reads every other sample (``interleaved_data``), so the two ranks' batches of 4 together
are the plain run's batch of 8 (``interleaved_data(8)`` on one process).
"""

import json
import os
import sys
from pathlib import Path

import torch
from helpers import SaveAt, fit, interleaved_data, tiny_model
from lightning.pytorch import Callback

from lightning_efficient import techniques
from lightning_efficient.core.report import report_for
from lightning_efficient.techniques import fsdp
from lightning_efficient.techniques.activation_checkpointing import checkpointed_blocks


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
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result, default=str))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
