"""The packing benchmarks' workload: long-tail documents, their padded batches and the Llama that
trains on them. Used by ``packing.py`` (the CPU benchmark) and by the GPU suite's packing rows
(``_gpu_speed.py``, through ``_gpu_run.py``'s documents data), so both measure the same thing.

The documents: the paragraphs of the text that ships with Python (``pydoc_data.topics``), bytes
as tokens (vocabulary 256), cut to at most ``ROW`` tokens (a longer paragraph becomes pieces),
shuffled with a fixed seed: most are short, a few are long (2,729 in all, median 115 tokens).
"""

from __future__ import annotations

import random

import torch

__all__ = ["HELD_OUT", "ROW", "ROWS", "SEED", "VOCAB", "Items", "llama", "pad_batch", "paragraphs"]

ROW, ROWS, HELD_OUT, SEED = 512, 4, 64, 0
VOCAB = 256  # bytes


def paragraphs(count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``count`` training documents and ``HELD_OUT`` held-out ones: byte tokens, at most ROW."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    docs = []
    for p in text.split("\n\n"):
        data = p.strip().encode()
        for start in range(0, len(data), ROW):
            piece = data[start : start + ROW]
            if len(piece) >= 2:
                docs.append(torch.tensor(list(piece), dtype=torch.long))
    random.Random(SEED).shuffle(docs)
    return docs[HELD_OUT : HELD_OUT + count], docs[:HELD_OUT]


class Items(torch.utils.data.Dataset):
    """The documents as map-style items ``{"input_ids": ...}`` (what ``SequencePacking`` packs)."""

    def __init__(self, docs: list[torch.Tensor]) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.docs[i]}


def pad_batch(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Padded to the longest of the batch: ``attention_mask`` 0 and labels -100 on the padding."""
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for r, x in enumerate(items):
        ids[r, : len(x["input_ids"])] = x["input_ids"]
        mask[r, : len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def llama(width: int, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    """A Hugging Face Llama (GQA, RoPE) for byte tokens from a small config (no download):
    hidden ``width``, intermediate ``4 * width``, positions up to ``ROW``; fp32."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=ROW,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)
