"""One epoch under DDP (2 CPU processes, gloo) with the Curriculum callback on a module whose
loader has a plain shuffle; each rank writes the sample ids it trained on, per step, to
OUT/rank<r>.json. Run by ``tests/multiprocess/ddp_cases.py`` (case ``curriculum``).
"""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_efficient.techniques import Curriculum

N, BATCH, DURATION, START, SEED = 48, 3, 6, 0.25, 5
SCORES = [float((i * 29) % N) for i in range(N)]  # a permutation of 0..47: sample i's difficulty


def check_disjoint_shards(ranks: list[dict]) -> None:
    """Assert what each rank wrote: 8 steps, the two ranks' samples disjoint at every step and
    all drawn from the curriculum's pool of that step."""
    from lightning_efficient.techniques.curriculum import CurriculumSampler, easiest_first

    assert all(r["sampler"] == "CurriculumSampler" and r["world"] == 2 for r in ranks)
    ranked = easiest_first(SCORES, seed=SEED)
    reference = CurriculumSampler(
        SCORES, BATCH, start_fraction=START, duration=DURATION, seed=SEED, num_replicas=2, rank=0
    )
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 8
    for step, (a, b) in enumerate(zip(ranks[0]["seen"], ranks[1]["seen"])):
        assert set(a).isdisjoint(b), f"step {step}: both ranks trained on {set(a) & set(b)}"
        assert set(a) | set(b) <= set(ranked[: reference.pool_at(step)])


def trainer_args() -> dict:
    """The Trainer keywords of the one-epoch curriculum run, under any 2-rank strategy."""
    return {
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [
            Curriculum("attr:scores", start_fraction=START, duration=DURATION, seed=SEED)
        ],
    }


class Ids(Dataset):
    scores = SCORES

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.tensor([float(i)])


class Module(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out, self.seen = out, []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        return self.layer(batch[1]).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(Ids(), batch_size=BATCH, shuffle=True)

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
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", **trainer_args())
    trainer.fit(Module(str(out)))
