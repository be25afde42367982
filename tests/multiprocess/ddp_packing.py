"""One epoch of SequencePacking under DDP (2 CPU processes, gloo), on a plain module that takes
``position_ids`` and calls F.scaled_dot_product_attention; each rank writes the documents it
trained on to OUT/rank<r>.json. Run by ``tests/multiprocess/ddp_cases.py`` (case ``packing``).
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from test_packing import ROW, Documents, PlainLM, documents_in, lengths_of
from torch.utils.data import DataLoader

from lightning_efficient.techniques.packing import SequencePacking

N = 30


class Module(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.model, self.out, self.seen = PlainLM(), out, []

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():  # not the packing check's calls
            self.seen.append(documents_in(batch))
        return self.model(batch["input_ids"], batch["labels"], batch["position_ids"])

    def train_dataloader(self):
        return DataLoader(Documents(lengths_of(N)), batch_size=2, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        packing = next(c for c in self.trainer.callbacks if isinstance(c, SequencePacking))
        record = {
            "seen": self.seen, "batches": len(self.seen), "documents": N,
            "path": packing.session.path, "check_error": packing._figures["check_error"],
        }  # fmt: skip
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def case(out: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SequencePacking(row_length=ROW, seed=5)],
    )  # fmt: skip
    trainer.fit(Module(str(out)))
