"""measure/speed/tokens.py: one definition of a batch's samples and tokens, used by the profiler,
EarlyStopper(max_tokens=) and the OOM split's loss weighting."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from helpers import tiny_trainer
from torch.utils.data import DataLoader

from lightning_efficient.measure.profiling.profiler import StepProfiler
from lightning_efficient.measure.speed.tokens import (
    BatchCounter,
    batch_counts,
    count_loss_tokens,
    count_tokens,
)
from lightning_efficient.techniques.early_stopping import EarlyStopper

ROWS, SEQ, PAD_FROM = 4, 32, 20  # every row padded after 20 tokens


def _padded(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[:, PAD_FROM:] = 0
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_what_a_token_is() -> None:
    ids = torch.zeros(4, 32, dtype=torch.long)
    assert batch_counts((ids, ids)) == (4, 128)  # token ids without padding: every element
    padded = _padded()
    assert batch_counts(padded) == (ROWS, ROWS * PAD_FROM)  # the attention mask's ones
    assert count_tokens({**padded, "attention_mask": padded["attention_mask"].bool()}) == 80
    images, classes = torch.zeros(8, 3, 4, 4), torch.arange(8)
    assert batch_counts((images, classes)) == (8, None)  # class labels are not a sequence
    assert batch_counts(torch.ones(8, 5, dtype=torch.bool)) == (8, None)  # a mask alone
    # what a token-mean loss averages over: the labels that are not ignore_index, which for
    # a padded batch whose labels mark the padding is the same count
    assert count_loss_tokens(padded) == count_tokens(padded) == ROWS * PAD_FROM
    assert count_loss_tokens((ids, ids)) == 128


def _summed(batches) -> tuple[int, int | None]:
    samples, tokens = 0, 0
    for b in batches:
        s, t = batch_counts(b)
        samples += s
        tokens = None if tokens is None or t is None else tokens + t
    return samples, tokens


def test_batch_counter_counts_as_batch_counts_at_o1() -> None:
    """The profiler's per-step count: the same sums as ``batch_counts``, whatever the batches
    (the structure changing between batches, nested ones, images), and a mask's ones summed on
    its device and read once."""
    ids = torch.zeros(4, 32, dtype=torch.long)
    images, classes = torch.zeros(8, 3, 4, 4), torch.arange(8)
    padded = [_padded(i) for i in range(3)]
    short = {**_padded(5), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    short["input_ids"] = torch.zeros(2, 7, dtype=torch.long)
    cases = [
        [(ids, ids)] * 5,
        padded * 70,  # more than 64 mask sums: folded on the way
        [(ids, ids), padded[0], (ids, ids, ids), [ids], {"x": ids}, padded[1]],
        [padded[0], short, padded[1]],  # same keys, other shapes
        [{"a": {"b": ids}}, (ids, [ids, ids]), (ids, ids)],  # nested: the general rule
        [(images, classes)] * 3,  # no tokens: None, samples from the first tensor
        [(ids, ids), (images, classes), (ids, ids)],  # None once a batch had no tokens
        [(torch.tensor(1.0), ids)],  # a 0-d tensor first
    ]
    for batches in cases:
        counter = BatchCounter()
        for b in batches:
            counter.add(b)
        assert (counter.samples, counter.tokens) == _summed(batches), batches[:2]
        assert counter.batches == len(batches)
        assert counter.tokens == counter.tokens  # reading twice reads the same


def test_batch_counter_costs_less_than_batch_counts() -> None:
    import time

    ids = torch.zeros(8, 128, dtype=torch.long)
    counter, n = BatchCounter(), 2000

    def per_call(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    fast = min(per_call(lambda: counter.add((ids, ids))) for _ in range(3))
    slow = min(per_call(lambda: batch_counts((ids, ids))) for _ in range(3))
    assert fast < slow / 2, (fast, slow)


class _Padded(pl.LightningModule):
    """A tiny token model on dict batches with padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.emb(batch["input_ids"]))
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
        )
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader([_padded(i) for i in range(8)], batch_size=None)


def test_profiler_and_max_tokens_count_the_same_tokens(tmp_path) -> None:
    """Before, the profiler counted every element of input_ids (padding included) and the early
    stopper the attention mask's ones: two numbers for one padded batch."""
    profiler = StepProfiler(skip_steps=0, print_table=False, log_metrics=False)
    stopper = EarlyStopper(monitor="train_loss", max_tokens="1M")
    trainer = tiny_trainer(tmp_path, [profiler, stopper], max_steps=4)
    trainer.fit(_Padded())
    summary = profiler.summary
    seconds = summary["step_s"] * summary["steps"]
    assert summary["steps"] == 4 and stopper.tokens == 4 * ROWS * PAD_FROM
    assert summary["tokens_per_s"] * seconds == pytest.approx(stopper.tokens, rel=1e-9)
