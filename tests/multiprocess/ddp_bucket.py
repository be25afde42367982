"""One epoch under DDP (2 CPU processes, gloo) with a LengthBucketSampler in the train loader;
each rank writes the sample ids it trained on, in order, to OUT/rank<r>.json. Run by
``tests/multiprocess/ddp_cases.py`` (case ``bucket``).
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_efficient.functional import LengthBucketSampler

N, BATCH = 48, 4
LENGTHS = [(i * 37) % 50 + 1 for i in range(N)]


class Ids(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.tensor([float(LENGTHS[i])])


class Module(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out, self.seen = out, []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        return self.layer(batch[1]).pow(2).mean()

    def train_dataloader(self):
        # built inside the fit (after the process group exists), as users do
        return DataLoader(
            Ids(), batch_size=BATCH, sampler=LengthBucketSampler(LENGTHS, bucket_size=16, seed=3)
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        sampler = self.trainer.train_dataloader.sampler
        record = {
            "seen": self.seen,
            "sampler": type(sampler).__name__,
            "world": sampler.num_replicas,
        }
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def case(out: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(str(out)))
