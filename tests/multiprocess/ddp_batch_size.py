"""EfficientBatchSize under DDP (2 CPU processes, gloo); each rank writes its result. Two fits,
one after the other in the same two processes (MODE: plain, then oom; each writes
OUT/MODE.rank{0,1}.json and .pt). Run by ``tests/multiprocess/ddp_cases.py`` (case ``batch_size``).
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from _batch_size_helpers import OOMGPT
from helpers import fit, params_of

from benchmarks.workloads import TINY_MODEL
from lightning_efficient.techniques.batch_size import EfficientBatchSize


def main(prefix: str, mode: str) -> None:
    pl.seed_everything(0, verbose=False)
    model = OOMGPT(oom_above=2 if mode == "oom" else None, from_step=1, on_rank=1, **TINY_MODEL)
    cb = EfficientBatchSize(target_batch_size=16, budget="1GiB", max_batch_size=4)
    trainer, model, rec = fit(
        None, [cb], model=model, accelerator="cpu", devices=2, strategy="ddp", max_steps=3
    )
    rank = trainer.global_rank
    with open(f"{prefix}.rank{rank}.json", "w") as f:
        json.dump(
            {
                "world_size": trainer.world_size,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "micro": trainer.train_dataloader.batch_size,
                "global_step": trainer.global_step,
                "samples_seen": model.samples_seen,
                "injected": model.injected,
                "splits": cb.splits,
                "losses": rec.losses,
            },
            f,
        )
    torch.save(params_of(model), f"{prefix}.rank{rank}.pt")


def case(out: Path) -> None:
    for mode in ("plain", "oom"):
        main(f"{out}/{mode}", mode)
