"""Workloads whose logits dominate a step's memory (what ``ChunkedCrossEntropy`` is for), and their
loss. Plain torch modules that import nothing of this package; the chunked-loss benchmark and its
tests build the same ones from here.

- ``LossHead(width, vocab)``: the loss phase alone, hidden states through a gain (as a final norm)
  and the output projection.
- ``GPTLike(vocab, width)``: embedding, one transformer block, norm and an untied head
  ``width -> vocab`` (64 -> 64,000 by default: 131 MB of fp32 logits at 2 x 256 rows).
- ``llama_128k()``: a one-block Hugging Face Llama with Llama 3's 128,256-token vocabulary
  (needs ``transformers``; build it under ``torch.device("meta")`` for an estimate).
- ``logits_loss(model, (inputs, targets))``: cross-entropy of the model's logits (a tensor or a
  Hugging Face output) against the targets, every position.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTLike", "LossHead", "llama_128k", "logits_loss"]


class LossHead(nn.Module):
    """The loss phase alone: hidden states through a gain and the output projection.

    Args:
        width: Hidden size.
        vocab: Vocabulary (the projection's outputs).
    """

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.proj = nn.Linear(width, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h * self.gain)


class GPTLike(nn.Module):
    """A plain GPT-like module: embedding, one block, norm, an untied head ``width -> vocab``.

    Args:
        vocab: Vocabulary (embedding rows and head outputs).
        width: Hidden size (two heads, feed-forward 4x, no dropout).
    """

    def __init__(self, vocab: int = 64000, width: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.emb(x))))


def llama_128k() -> nn.Module:
    """A Hugging Face Llama of one block (width 64, grouped-query attention 2:1, 256 positions)
    with Llama 3's vocabulary of 128,256 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def logits_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)``'s logits against ``targets`` (``batch`` is the pair)."""
    x, y = batch
    logits = model(x)
    if not isinstance(logits, torch.Tensor):  # a Hugging Face model's output
        logits = logits.logits
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
