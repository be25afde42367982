"""A fine-tuning user's smallest module, named by class path in yaml: a PEFT LoRA model on a
tiny Llama that builds its own training loader (no datamodule). It records the batches it trained
on, so a test run through the command can tell whose data was used."""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


def documents(n: int, vocab: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """``n`` documents of 6..``seq_len`` tokens, padded to ``seq_len`` with their mask and labels
    (-100 on the padding)."""
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        length = 6 + (i * 7) % (seq_len - 6)
        ids = torch.zeros(seq_len, dtype=torch.long)
        ids[:length] = torch.randint(1, vocab, (length,), generator=g)
        mask = (torch.arange(seq_len) < length).long()
        items.append(
            dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        )
    return items


class LoRAWithoutData(pl.LightningModule):
    """PEFT LoRA on a tiny Llama, without loaders of its own.

    Args:
        vocab: The vocabulary.
        seq_len: Tokens per padded document.
        batch_size: Documents per batch.
    """

    #: the keys and the first document's length of every batch trained on, by any instance
    trained_on: ClassVar[list[tuple[tuple[str, ...], int]]] = []

    def __init__(self, vocab: int = 128, seq_len: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        import peft
        import transformers

        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4 * seq_len,
        )  # fmt: skip
        base = transformers.LlamaForCausalLM(config)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        self.model = peft.get_peft_model(base, lora)

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # the loop's batches only (a technique's estimate calls training_step on batches of its own)
        LoRAWithoutData.trained_on.append((tuple(sorted(batch)), int(batch["input_ids"].shape[1])))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class OwnLoaderLoRA(LoRAWithoutData):
    """:class:`LoRAWithoutData` whose ``train_dataloader`` is its own (same arguments)."""

    def train_dataloader(self) -> Any:
        return DataLoader(documents(16, self.vocab, self.seq_len), batch_size=self.batch_size)


class DocumentsData(pl.LightningDataModule):
    """The same documents from a datamodule.

    Args:
        batch_size: Documents per batch.
        seq_len: Tokens per padded document.
    """

    def __init__(self, batch_size: int = 2, seq_len: int = 32) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len

    def train_dataloader(self) -> Any:
        return DataLoader(documents(16, 128, self.seq_len), batch_size=self.batch_size)
