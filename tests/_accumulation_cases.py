"""Shared pieces of the accumulation tests: padded variable-length samples, tiny language models
whose loss is a token mean, and the reference: one SGD step (lr 1) on the whole window."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

VOCAB, WIDTH = 64, 96


def padded_samples(n: int = 16, lo: int = 4, hi: int = 95, seed: int = 0, sort: bool = False):
    """``n`` samples of ``lo..hi`` tokens padded to ``WIDTH`` (labels -100 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(lo, hi, n).round().long()[torch.randperm(n, generator=g)]
    if sort:
        lengths = lengths.sort().values
    samples = []
    for length in lengths.tolist():
        ids = torch.randint(1, VOCAB, (WIDTH,), generator=g)
        mask = (torch.arange(WIDTH) < length).long()
        ids = ids * mask
        samples.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return samples


def tiny_llama() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


class HFModule(pl.LightningModule):
    """``self.model(**batch).loss``: Hugging Face's token mean after the causal shift; SGD lr 1."""

    def __init__(
        self, model: nn.Module | None = None, batch_size: int = 4, samples: Any = None
    ) -> None:
        super().__init__()
        self.model = model if model is not None else tiny_llama()
        self.batch_size = batch_size
        self.samples = samples if samples is not None else padded_samples()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch_size, shuffle=False)


class PlainModule(HFModule):
    """Its own shift and ``F.cross_entropy(ignore_index=-100)`` (``per_sample``: the mean over
    samples of each sample's token mean; ``smoothing``: label smoothing)."""

    def __init__(self, per_sample: bool = False, smoothing: float = 0.0, **kwargs: Any) -> None:
        super().__init__(model=tiny_llama(), **kwargs)
        self.per_sample, self.smoothing = per_sample, smoothing

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = logits[:, :-1]
        labels = batch["labels"][:, 1:]
        if not self.per_sample:
            return F.cross_entropy(
                logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                label_smoothing=self.smoothing,
            )  # fmt: skip
        each = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        return (each.sum(1) / (labels != -100).sum(1)).mean()


def collate(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def whole_window_update(module: HFModule, samples: list[dict], clip: float | None = None) -> dict:
    """The update of one SGD step (lr 1) on ``samples`` taken together (a copy of the module)."""
    return whole_batch_update(module, collate(samples), clip)


def update_error(before: dict, module: nn.Module, expected: dict) -> float:
    """Relative error of the update the fit made against ``expected``."""
    after = dict(module.named_parameters())
    num = sum(float((after[n].detach() - before[n] - e).pow(2).sum()) for n, e in expected.items())
    den = sum(float(e.pow(2).sum()) for e in expected.values())
    return (num / den) ** 0.5


def snapshot(module: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def fit_once(module: HFModule, callbacks: list, **trainer_kwargs: Any) -> pl.Trainer:
    kwargs = dict(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    trainer.fit(module)
    return trainer


class Batches(pl.Callback):
    """Keeps (a copy of) every batch the fit trained on, in order."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append({k: v.clone() for k, v in batch.items()})


def concat(batches: list[dict]) -> dict:
    width = max(b["input_ids"].shape[1] for b in batches)
    pads = {"labels": -100, "attention_mask": 0}
    out = {}
    for k in batches[0]:
        parts = [F.pad(b[k], (0, width - b[k].shape[1]), value=pads.get(k, 0)) for b in batches]
        out[k] = torch.cat(parts)
    return out


def whole_batch_update(module: nn.Module, batch: dict, clip: float | None = None) -> dict:
    """The update of one SGD step (lr 1) on ``batch`` (a copy of the module)."""
    ref = copy.deepcopy(module)
    ref.zero_grad()
    ref.training_step(batch, 0).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    return {n: -p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
