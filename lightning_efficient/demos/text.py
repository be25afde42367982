"""TextDataModule: byte-level language modelling over the text that ships with Python.

``pydoc_data.topics`` holds ~465 KB of English prose and code (Python's help topics): a corpus
that needs no download. Like TinyGPT, this module imports nothing from lightning_efficient.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["TextDataModule", "ByteChunks", "EpochShuffle", "load_corpus"]


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of UTF-8 bytes, in a fixed (sorted-topic) order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes, as ``(input, target)`` int64 pairs."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class EpochShuffle(Sampler[int]):
    """A random permutation that depends only on ``(seed, epoch)``, so a run resumed at an
    epoch boundary sees the same order as an uninterrupted one. Lightning calls ``set_epoch``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


class TextDataModule(pl.LightningDataModule):
    """Train/validation split of the pydoc corpus: the first ``1 - val_fraction`` of the bytes
    train, the rest validate (deterministic, no overlap).

    Args:
        batch_size: Samples per batch.
        seq_len: Bytes per sample (the model's context length).
        val_fraction: Share of the corpus held out for validation.
        num_workers: DataLoader worker processes.
        seed: Seed of the training shuffle (the order depends on seed and epoch only).
        max_train_samples: Keep only this many training windows (None: all).
    """

    def __init__(
        self,
        batch_size: int = 16,
        seq_len: int = 128,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 0,
        max_train_samples: int | None = None,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction` must be in (0, 1); got {val_fraction!r}.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = load_corpus()
        cut = int(len(data) * (1 - self.hparams.val_fraction))
        self.train_set = ByteChunks(data[:cut], self.hparams.seq_len)
        if self.hparams.max_train_samples is not None:
            n = min(len(self.train_set), self.hparams.max_train_samples)
            self.train_set = torch.utils.data.Subset(self.train_set, range(n))
        self.val_set = ByteChunks(data[cut:], self.hparams.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=EpochShuffle(len(self.train_set), self.hparams.seed),
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.batch_size, num_workers=self.hparams.num_workers
        )
