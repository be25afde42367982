"""The workloads the benchmarks and the tests train and estimate: tiny models and data built
from code or from ``transformers`` configs (no download), one definition each.

- Language models: ``tiny_model``/``tiny_data`` (the demo's TinyGPT and text at test size),
  ``TinyHFGPT2`` (a tiny Hugging Face GPT-2, SGD), ``gpt2`` (GPT-2 124M on ``meta``),
  ``llama3_8b_lora`` (Llama-3-8B + LoRA on ``meta``), the GPU suite's Lightning modules
  (``build_model``: TinyGPT, ``HFGPT2``, ``HFLlamaLoRA``, ``HFLlamaDocs``) and ``hf_loss``, the
  loss all the Hugging Face ones train on.
- Logits that dominate a step's memory (the chunked-loss benchmark and its tests): ``LossHead``
  (the loss phase alone), ``GPTLike`` (one block, an untied 64,000-token head), ``llama_128k``
  (a one-block HF Llama with Llama 3's vocabulary) and ``logits_loss`` (cross-entropy of their
  logits, every position).
- Documents (the packing benchmarks' workload, CPU and GPU alike): the paragraphs of the text
  that ships with Python (``pydoc_data.topics``), bytes as tokens (vocabulary 256), cut to at most
  ``ROW`` tokens (a longer paragraph becomes pieces), shuffled with a fixed seed: most are short, a
  few are long (2,729 in all, median 115 tokens); ``pad_batch``, the byte-token ``llama`` and
  ``docs_llama``, the one the packing and accumulation benchmarks train.
- The gallery: the model families "auto" must handle (``GALLERY``): ResNet-, ConvNeXt-, U-Net- and
  DenseNet-like CNNs written here (no torchvision: its wheels in the registry are CUDA builds) and
  ViT, T5, Llama (SDPA) and BERT built from tiny ``transformers`` configs.

Imported as ``benchmarks.workloads`` by the benchmarks and by the tests (the repository root is
on pytest's path); not part of the installed package.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure.memory.targets import DeviceTarget

__all__ = [
    "GALLERY",
    "GPTLike",
    "LossHead",
    "HELD_OUT",
    "LLAMA3_8B",
    "ROW",
    "ROWS",
    "SEED",
    "TARGET",
    "TINY_DATA",
    "TINY_MODEL",
    "VOCAB",
    "HFGPT2",
    "HFLlamaDocs",
    "HFLlamaLoRA",
    "Items",
    "ResNetLike",
    "TinyHFGPT2",
    "build_model",
    "docs_llama",
    "gpt2",
    "hf_loss",
    "interleaved_data",
    "llama",
    "llama3_8b_lora",
    "llama_128k",
    "logits_loss",
    "meta_batch",
    "pad_batch",
    "paragraphs",
    "tiny_data",
    "tiny_model",
]

# -- language models -------------------------------------------------------------------------------
TINY_MODEL = dict(seq_len=32, n_layer=2, n_embd=32, n_head=2, dropout=0.0, warmup_steps=2)
TINY_DATA = dict(batch_size=4, seq_len=32, max_train_samples=64)


def tiny_model(**overrides: Any) -> TinyGPT:
    """The demo's TinyGPT at test size (``TINY_MODEL``, then ``overrides``)."""
    return TinyGPT(**{**TINY_MODEL, **overrides})


def tiny_data(**overrides: Any) -> TextDataModule:
    """The demo's text at test size (``TINY_DATA``, then ``overrides``)."""
    return TextDataModule(**{**TINY_DATA, **overrides})


class _Interleaved(torch.utils.data.Sampler):
    """Rank r of w reads samples r, r + w, r + 2w, ... (the world read when iterated)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        return len(range(0, self.n, world))

    def __iter__(self):
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank, self.n, world))


def interleaved_data(batch_size: int, **overrides: Any) -> Any:
    """``tiny_data`` in a fixed order, each rank reading every world-size-th sample: with
    ``use_distributed_sampler=False``, w ranks at ``batch_size`` read together what one process
    reads at ``w * batch_size`` (the same samples, step by step)."""
    from torch.utils.data import DataLoader

    data = tiny_data(batch_size=batch_size, **overrides)

    def train_dataloader() -> DataLoader:
        n = len(data.train_set)
        return DataLoader(
            data.train_set, batch_size=batch_size, sampler=_Interleaved(n), drop_last=True
        )

    data.train_dataloader = train_dataloader
    return data


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A Hugging Face model's own loss: on a dict of its inputs, or on token ids (a tensor, or the
    first of a tuple) as both inputs and labels (next-token loss)."""
    if isinstance(batch, dict):
        return model(**batch).loss
    ids = batch[0] if isinstance(batch, (tuple, list)) else batch
    return model(input_ids=ids, labels=ids).loss


class TinyHFGPT2(pl.LightningModule):
    """A tiny Hugging Face GPT-2 built from its default config (``use_cache=True``) unless told,
    trained with SGD (no 8-bit rung, so a planner's stacks are exact)."""

    def __init__(self, use_cache: bool = True, *, n_embd: int = 64, momentum: float = 0.0) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2, use_cache=use_cache
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.momentum = momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return hf_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)


def gpt2() -> nn.Module:
    """GPT-2 124M (transformers' default config, no key/value cache) on ``meta``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


#: The device the fine-tuning and long-context estimates are made for.
TARGET = DeviceTarget("cuda", (9, 0), (2, 11), name="H100")
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def llama3_8b_lora(dims: dict[str, Any] = LLAMA3_8B) -> nn.Module:
    """The Llama-3-8B shape on ``meta`` in bf16, with PEFT LoRA r=16 on every block's linear."""
    import peft
    import transformers

    config = transformers.LlamaConfig(**dims, use_cache=True)  # the default a user loads
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


# -- logits that dominate a step (what ChunkedCrossEntropy is for) -------------------------------
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


# -- documents ------------------------------------------------------------------------------------
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


def docs_llama(quick: bool) -> nn.Module:
    """The packing benchmark's byte-token Llama (width 64 quick, else 128), seeded."""
    torch.manual_seed(SEED)
    return llama(64 if quick else 128)


# -- the GPU suite's Lightning modules ----------------------------------------------------------------------------------------
class _HFCausalLM(pl.LightningModule):
    """A transformers causal LM in ``self.model``: next-token loss on the batch's inputs, AdamW
    (``self.lr``) on the trainable parameters (all of them, unless the model froze some)."""

    model: torch.nn.Module
    lr: float

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):  # documents: padded, or packed rows (SequencePacking)
            keys = ("input_ids", "labels", "attention_mask")  # as a user's step passes them
            loss = self.model(**{k: batch[k] for k in keys if k in batch}).loss
        else:
            loss = hf_loss(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class HFGPT2(_HFCausalLM):
    """A transformers GPT-2 built from its config (no download), trained on next-token loss."""

    def __init__(
        self,
        n_layer: int = 12,
        n_embd: int = 768,
        n_head: int = 12,
        vocab: int = 50257,
        seq: int = 1024,
        dropout: float = 0.1,
        lr: float = 1e-4,
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)
        self.lr = lr


class HFLlamaLoRA(_HFCausalLM):
    """A transformers Llama built from its config (no download; its default ``use_cache=True``,
    as a user loads it), its weights in ``dtype``, wrapped with PEFT LoRA (rank ``lora_r``,
    alpha ``2 * lora_r``) on every linear layer of the blocks; next-token loss, AdamW on the
    adapters only (the base is frozen by PEFT)."""

    def __init__(
        self,
        n_layer: int = 16,
        n_embd: int = 2048,
        n_head: int = 32,
        n_kv_head: int = 8,
        intermediate: int = 8192,
        vocab: int = 128256,
        seq: int = 2048,
        dtype: str = "bfloat16",
        lora_r: int = 16,
        lr: float = 1e-4,
    ) -> None:
        super().__init__()
        import peft
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=n_embd,
            intermediate_size=intermediate,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv_head,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        base = LlamaForCausalLM(config).to(getattr(torch, dtype))
        lora = peft.LoraConfig(
            r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", lora_dropout=0.0
        )
        self.model = peft.get_peft_model(base, lora)
        self.lr = lr


class HFLlamaDocs(_HFCausalLM):
    """The packing benchmarks' Llama for byte tokens (``workloads.llama``: hidden ``n_embd``,
    intermediate 4x, GQA ``n_head``/``n_kv_head``), every weight trained, on dict batches of
    documents (padded, or packed rows)."""

    def __init__(
        self, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_kv_head: int = 2,
        lr: float = 1e-4,
    ) -> None:  # fmt: skip
        super().__init__()
        self.model = llama(n_embd, n_layer, n_head, n_kv_head)
        self.lr = lr


def build_model(kind: str, dims: dict[str, Any], device: str = "cpu") -> pl.LightningModule:
    """``kind`` ``"tinygpt"`` (the demo module), ``"hf_gpt2"``, ``"llama_lora"``
    (``HFLlamaLoRA``'s arguments) or ``"llama_docs"`` (``HFLlamaDocs``'s); ``dims``: n_layer,
    n_embd, n_head, vocab, seq and optionally dropout (the Llamas: their own). Parameters are
    created on ``device``."""
    with torch.device(device):
        if kind == "tinygpt":
            return TinyGPT(
                vocab_size=dims["vocab"],
                seq_len=dims["seq"],
                n_layer=dims["n_layer"],
                n_embd=dims["n_embd"],
                n_head=dims["n_head"],
                dropout=dims.get("dropout", 0.1),
            )
        if kind == "hf_gpt2":
            return HFGPT2(**dims)
        if kind == "llama_lora":
            return HFLlamaLoRA(**dims)
        if kind == "llama_docs":
            return HFLlamaDocs(**dims)
    raise ValueError(f"unknown model kind {kind!r}")


def meta_batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return ids, ids


# -- ResNet-like: BasicBlocks with BatchNorm, stages of decreasing resolution ---------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNetLike(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width)
        )
        self.layer3 = nn.Sequential(  # resnet34-like: the deepest stage has the most blocks
            BasicBlock(2 * width, 4 * width, 2),
            BasicBlock(4 * width, 4 * width),
            BasicBlock(4 * width, 4 * width),
        )
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean((2, 3)))


# -- ConvNeXt-like: depthwise conv, LayerNorm, inverted MLP, layer scale --------------------------
class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 32), depth: int = 2) -> None:
        super().__init__()
        self.downsample_layers = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 2, 2), LayerNorm2d(dims[0]))]
            + [
                nn.Sequential(LayerNorm2d(a), nn.Conv2d(a, b, 2, 2))
                for a, b in zip(dims[:-1], dims[1:])
            ]
        )
        self.stages = nn.ModuleList(
            nn.Sequential(*[ConvNeXtBlock(d) for _ in range(depth)]) for d in dims
        )
        self.head = nn.Linear(dims[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(x.mean((2, 3)))


# -- U-Net-like: ModuleDicts of conv blocks with skips ---------------------------------------------
class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNetLike(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        w = width
        self.down = nn.ModuleDict(
            {"d0": DoubleConv(3, w), "d1": DoubleConv(w, 2 * w), "d2": DoubleConv(2 * w, 4 * w)}
        )
        self.bottleneck = DoubleConv(4 * w, 8 * w)
        self.up = nn.ModuleDict(
            {
                "u2": nn.ConvTranspose2d(8 * w, 4 * w, 2, 2),
                "u1": nn.ConvTranspose2d(4 * w, 2 * w, 2, 2),
                "u0": nn.ConvTranspose2d(2 * w, w, 2, 2),
            }
        )
        self.dec = nn.ModuleDict(
            {
                "c2": DoubleConv(8 * w, 4 * w),
                "c1": DoubleConv(4 * w, 2 * w),
                "c0": DoubleConv(2 * w, w),
            }
        )
        self.out = nn.Conv2d(w, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down.values():
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for (_, up), (_, dec), skip in zip(self.up.items(), self.dec.items(), reversed(skips)):
            x = dec(torch.cat([up(x), skip], 1))
        return self.out(x)


# -- DenseNet-like: each layer takes the growing list of earlier feature maps ------------------------
class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(F.relu(self.norm1(torch.cat(features, 1))))
        return self.conv2(F.relu(self.norm2(x)))


class DenseNetLike(nn.Module):
    def __init__(self, ch: int = 8, growth: int = 8, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(DenseLayer(ch + i * growth, growth) for i in range(n))
        self.norm = nn.BatchNorm2d(ch + n * growth)
        self.head = nn.Linear(ch + n * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer saw grows after the call
        return self.head(F.relu(self.norm(torch.cat(features, 1))).mean((2, 3)))


# -- the gallery: name -> (build, batch, loss_fn, best single block class) --------------------------
def _image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _pixel_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).square().mean()


def _images(n: int = 4, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def _ids(n: int, seq: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))


def _vit() -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(cfg)


def _t5() -> nn.Module:
    import transformers

    cfg = transformers.T5Config(
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        vocab_size=64,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _bert() -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(cfg)


def _text(seq: int = 64) -> dict[str, torch.Tensor]:
    ids = _ids(4, seq)
    return {"input_ids": ids, "labels": ids}


GALLERY: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any, str]] = {
    "resnet": (ResNetLike, _images, _image_loss, "BasicBlock"),
    "convnext": (ConvNeXtLike, _images, _image_loss, "ConvNeXtBlock"),
    "unet": (UNetLike, lambda: torch.randn(2, 3, 32, 32), _pixel_loss, "DoubleConv"),
    "densenet": (DenseNetLike, _images, _image_loss, "DenseLayer"),
    "vit": (
        _vit,
        lambda: {"pixel_values": _images()[0], "labels": _images()[1]},
        hf_loss,
        "ViTLayer",
    ),
    "t5": (
        _t5,
        lambda: {"input_ids": _ids(4, 64), "labels": _ids(4, 32)},
        hf_loss,
        "T5Block",
    ),
    "llama": (_llama, _text, hf_loss, "LlamaDecoderLayer"),
    "bert": (_bert, _text, hf_loss, "BertLayer"),
}
