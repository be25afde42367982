"""Five model families as LightningModules with their data, for tests/planning/test_auto.py: a
decoder LM (TinyGPT), an encoder (HF BERT), a ViT (HF), a CNN with BatchNorm (written in the
gallery) and T5 (HF). Samples are separate tensors (a dataset that hands out views of one large
tensor would
make the CPU tracker count that whole tensor when the next micro-batch is fetched inside a
measured step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.workloads import GALLERY, ResNetLike
from lightning_efficient.demos import TinyGPT


class Samples(Dataset):
    def __init__(self, make: Callable[[int], Any], n: int) -> None:
        self.items = [make(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        item = self.items[i]
        if isinstance(item, dict):
            return {k: v.clone() for k, v in item.items()}
        return tuple(v.clone() for v in item)


class FamilyData(pl.LightningDataModule):
    def __init__(self, make: Callable[[int], Any], n: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set = Samples(make, n)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)


class FamilyModule(pl.LightningModule):
    """A plain nn.Module and its loss, trained with AdamW."""

    def __init__(self, build: Callable[[], torch.nn.Module], loss: Callable) -> None:
        super().__init__()
        self.model = build()
        self._loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _gen(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(i)


def _tokens(i: int, seq: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (seq,), generator=_gen(i))


def _gpt_sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _tokens(i, 33, 256)
    return ids[:-1], ids[1:]


def _image(i: int) -> torch.Tensor:
    return torch.randn(3, 32, 32, generator=_gen(i))


def _label(i: int) -> torch.Tensor:
    return torch.randint(0, 10, (), generator=_gen(i + 10_000))


def _two_layers(name: str) -> Callable[[], torch.nn.Module]:
    """The gallery's Hugging Face model ``name`` with two layers instead of three: for BERT the
    same decision (checkpoint the fewest blocks, the whole batch of 16 at once) at two thirds of
    the estimates' cost. (ViT with two layers, or T5 with one block each, would choose the plain
    stack at 8 x 2: their three-layer / two-block models stay, for the checkpointing pick.)"""

    def build() -> torch.nn.Module:
        model = GALLERY[name][0]()
        config = model.config
        config.num_hidden_layers = 2
        return type(model)(config)

    return build


FAMILIES: dict[str, tuple[Callable[[], pl.LightningModule], Callable[[int], Any]]] = {
    "decoder": (
        lambda: TinyGPT(seq_len=32, n_layer=2, n_embd=32, n_head=2, dropout=0.0, warmup_steps=2),
        _gpt_sample,
    ),
    "encoder": (
        lambda: FamilyModule(_two_layers("bert"), GALLERY["bert"][2]),
        lambda i: {"input_ids": _tokens(i, 32), "labels": _tokens(i, 32)},
    ),
    "vit": (
        lambda: FamilyModule(GALLERY["vit"][0], GALLERY["vit"][2]),
        lambda i: {"pixel_values": _image(i), "labels": _label(i)},
    ),
    "cnn": (
        lambda: FamilyModule(ResNetLike, GALLERY["resnet"][2]),
        lambda i: (_image(i), _label(i)),
    ),
    "t5": (
        lambda: FamilyModule(GALLERY["t5"][0], GALLERY["t5"][2]),
        lambda i: {"input_ids": _tokens(i, 32), "labels": _tokens(i + 1, 16)},
    ),
}


def family(name: str, batch_size: int = 16, n: int = 64) -> tuple[pl.LightningModule, FamilyData]:
    build, make = FAMILIES[name]
    torch.manual_seed(0)
    return build(), FamilyData(make, n, batch_size)
