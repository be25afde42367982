"""One optimizer step of micro-batch 4 x accumulation 2 on each of 2 CPU processes (gloo), the
ranks' samples of unequal tokens (padded, 4..95 tokens): Lightning's own accumulation, then
ExactAccumulation. Rank zero saves the parameters after each to OUT/{plain,exact}.pt and the
window loss logged to OUT/exact.json. Run by ``tests/multiprocess/ddp_cases.py`` (case
``accumulation``)."""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from _accumulation_cases import HFModule, padded_samples

from lightning_efficient.techniques.accumulation import WINDOW_LOSS, ExactAccumulation


def case(out: Path) -> None:
    for name, callbacks in (("plain", []), ("exact", [ExactAccumulation()])):
        module = HFModule(samples=padded_samples())
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=1, accumulate_grad_batches=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module)
        if trainer.is_global_zero:
            torch.save({n: p.detach() for n, p in module.named_parameters()}, out / f"{name}.pt")
            if callbacks:
                record = {
                    "loss": float(trainer.callback_metrics[WINDOW_LOSS]),
                    "weighting": callbacks[0].weights.weighting,
                    "span": callbacks[0].weights.tokens_per_window(),
                }
                (out / "exact.json").write_text(json.dumps(record))
