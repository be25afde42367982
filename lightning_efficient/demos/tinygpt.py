"""TinyGPT: a plain, byte-level, decoder-only transformer LightningModule.

This module deliberately imports nothing from lightning_efficient: it is the "unmodified
LightningModule" that every technique of the package is tested on.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.text import Perplexity

__all__ = ["TinyGPT", "Block", "CausalSelfAttention"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    """A small GPT over bytes (vocabulary 256).

    Args:
        vocab_size: Number of token ids (256 for bytes).
        seq_len: Longest sequence the position embedding covers.
        n_layer: Number of transformer blocks.
        n_embd: Width of the residual stream.
        n_head: Attention heads; must divide ``n_embd``.
        dropout: Dropout after embeddings, attention and MLP.
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to matrices only (not biases, norms).
        betas: AdamW betas.
        warmup_steps: Linear warmup steps before the cosine decay.
        min_lr_ratio: The cosine decays to ``lr * min_lr_ratio``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        dropout: float = 0.1,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"`n_head` ({n_head}) must divide `n_embd` ({n_embd}).")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        self.val_ppl = Perplexity()
        self.val_ppl_history: list[float] = []

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        return loss, logits

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits = self._loss(batch)
        self.val_ppl.update(logits.float(), batch[1])
        self.log("val_loss", loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        ppl = self.val_ppl.compute()
        self.val_ppl.reset()
        self.log("val_ppl", ppl, prog_bar=True)
        self.val_ppl_history.append(float(ppl))

    def on_fit_end(self) -> None:
        if self.val_ppl_history:
            first, last = self.val_ppl_history[0], self.val_ppl_history[-1]
            self.print(
                f"validation perplexity: {first:.2f} -> {last:.2f} "
                f"(over {len(self.val_ppl_history)} validations)"
            )

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=tuple(self.hparams.betas),
        )
        total = self._total_steps()
        warmup = max(1, min(self.hparams.warmup_steps, total))
        floor = self.hparams.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _total_steps(self) -> int:
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            return 1000
        try:
            steps = trainer.estimated_stepping_batches
        except Exception:  # no dataloader yet (e.g. the optimizer is built outside fit)
            steps = trainer.max_steps
        if steps is None or steps == float("inf") or steps < 1:
            return 1000
        return int(steps)
