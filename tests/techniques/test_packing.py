"""Sequence packing (issue 40): the packer's rows, the equivalence of a packed step with the same
documents run one by one (Llama, GPT-2, Qwen2 and a plain SDPA module), the check that stops a
module whose documents would mix, resume mid-epoch, DDP and the fill on a long-tail corpus."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import SaveAt, params_of
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_efficient.core.validate import SettingsError
from lightning_efficient.measure.speed.tokens import count_tokens
from lightning_efficient.techniques.packing import (
    PackedRowSampler,
    SequencePacking,
    apply_document_attention,
    build_row,
    cu_seqlens,
    document_mask,
    fill,
    pack_dataloader,
    pack_rows,
)

VOCAB, ROW = 96, 32


def lengths_of(n: int, seed: int = 0, low: int = 3, high: int = 24) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


class Documents(Dataset):
    """Documents of the given lengths; document ``i`` starts with token ``i + 1`` (its id)."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.docs = [
            torch.cat([torch.tensor([i + 1]), torch.randint(1, VOCAB, (n - 1,), generator=g)])
            for i, n in enumerate(lengths)
        ]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.docs[i]}


def documents_in(batch: dict[str, torch.Tensor]) -> list[int]:
    """The ids of the documents of a packed batch (padding, whose first token is 0, left out)."""
    starts = batch["position_ids"] == 0
    return [int(t) - 1 for t in batch["input_ids"][starts] if int(t) > 0]


# -- the packer ------------------------------------------------------------------------------
def test_rows_hold_every_document_once_and_their_shape_does_not_depend_on_the_order() -> None:
    lengths = lengths_of(200, high=60) + [130]  # one document longer than a row of 64: split
    shapes = set()
    for seed in range(4):
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
        rows = pack_rows(lengths, 64, order.tolist())
        tokens: dict[int, int] = {}
        for row in rows:
            assert sum(stop - start for _, start, stop in row) <= 64
            for doc, start, stop in row:
                tokens[doc] = tokens.get(doc, 0) + stop - start
        assert tokens == dict(enumerate(lengths))
        shapes.add(tuple(sorted(tuple(sorted(s - a for _, a, s in r)) for r in rows)))
    assert len(shapes) == 1  # so every epoch has as many rows
    assert fill(rows, 64) > 0.95
    with pytest.raises(ValueError, match="1 documents are longer than `row_length`=64: #200"):
        pack_rows(lengths, 64, oversize="refuse")


def test_a_row_restarts_positions_and_masks_targets_across_documents() -> None:
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    row = build_row([(a, None), (b, None)], 8, pad_id=0)
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row["labels"].tolist() == [-100, 6, 7, -100, 9, -100, -100, -100]
    assert row["attention_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    # the instrument's one definition of a token count sees the real tokens, not the slots
    assert count_tokens({k: v[None] for k, v in row.items()}) == 5
    shifted = build_row([(a, a + 1), (b, b + 1)], 8, shifted_labels=True)
    assert shifted["labels"].tolist() == [6, 7, 8, 9, 10, -100, -100, -100]
    mask = document_mask(row["position_ids"][None])[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert cu_seqlens(row["position_ids"][None]).tolist() == [0, 3, 5, 8]


def test_sampler_epochs_shuffle_resume_and_shard() -> None:
    lengths = lengths_of(60)
    sampler = PackedRowSampler(lengths, ROW, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        rows = list(sampler)
        assert len(rows) == len(sampler)  # len holds, every epoch
        assert sorted(doc for row in rows for doc, _, _ in row) == list(range(60))
        epochs.append(rows)
    assert epochs[0] != epochs[1] != epochs[2]
    assert PackedRowSampler(lengths, ROW, seed=3).rank_rows(1) == epochs[1]  # deterministic
    # resume: a sampler loaded with the position continues with the same rows
    sampler.set_epoch(1)
    it = iter(sampler)
    [next(it) for _ in range(4)]
    resumed = PackedRowSampler(lengths, ROW, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == epochs[1][4:]
    # two ranks: as many rows each, disjoint, every document once
    ranks = [PackedRowSampler(lengths, ROW, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])
    docs = [sorted(d for row in s for d, _, _ in row) for s in ranks]
    assert set(docs[0]).isdisjoint(docs[1]) and sorted(docs[0] + docs[1]) == list(range(60))


def test_fill_on_a_long_tail_corpus_against_padded_batches() -> None:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lengths = [len(p.encode()) for p in text.split("\n\n") if p.strip()]
    assert max(lengths) > 20 * sorted(lengths)[len(lengths) // 2]  # a long tail
    rows = pack_rows(lengths, 1024)
    padded = sum(
        max(lengths[i : i + 8]) * len(lengths[i : i + 8]) for i in range(0, len(lengths), 8)
    )
    assert fill(rows, 1024) >= 0.95 and sum(lengths) / padded < 0.6


# -- the equivalence: a packed step is the documents run one by one ---------------------------
def hf_model(family: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    if family == "llama":  # grouped-query attention, RoPE
        cfg = tf.LlamaConfig(**small, num_attention_heads=4, num_key_value_heads=2)
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**small, num_attention_heads=4, num_key_value_heads=2)
        return tf.Qwen2ForCausalLM(cfg)
    cfg = tf.GPT2Config(  # learned absolute positions
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(cfg)


class PlainLM(nn.Module):
    """A language model of one's own: learned positions from ``position_ids``, causal SDPA."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(VOCAB, 32), nn.Embedding(64, 32)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        x = self.tok(input_ids) + self.pos(position_ids)
        q, k, v = (t.view(*t.shape[:2], 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(x + y.transpose(1, 2).reshape(x.shape))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor], with_positions: bool) -> torch.Tensor:
    kwargs = {"position_ids": batch["position_ids"]} if with_positions else {}
    if isinstance(model, PlainLM):
        return model(batch["input_ids"], batch["labels"], **kwargs)
    return model(input_ids=batch["input_ids"], labels=batch["labels"], **kwargs).loss


def one_by_one(model: nn.Module, docs: Documents, ids: list[int]) -> tuple[torch.Tensor, list]:
    """The token mean of the documents' losses, each run alone without padding, and its grads."""
    model.zero_grad()
    total, count = 0.0, 0
    for i in ids:
        ids_ = docs.docs[i][None]
        n = ids_.shape[1] - 1
        alone = {"input_ids": ids_, "labels": ids_, "position_ids": torch.arange(n + 1)[None]}
        total = total + loss_of(model, alone, with_positions=False) * n
        count += n
    loss = total / count
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def packed_steps(model: nn.Module, isolate: bool) -> list[tuple]:
    lengths = lengths_of(14)
    docs = Documents(lengths)
    loader = pack_dataloader(DataLoader(docs, batch_size=2), ROW, seed=1)
    change = apply_document_attention(model) if isolate else None
    out = []
    try:
        for batch in loader:
            model.zero_grad()
            if change is not None:
                change.value.current(batch["position_ids"])
            # the training step passes no position_ids: the HF path gives them
            loss = loss_of(model, batch, with_positions=isinstance(model, PlainLM) or not isolate)
            loss.backward()
            if change is not None:
                change.value.current(None)
            grads = [p.grad.clone() for p in model.parameters()]
            seen = documents_in(batch)
            out.append((loss.detach(), grads, one_by_one(model, docs, seen), seen))
    finally:
        if change is not None:
            change.undo()
    return out


def assert_same(steps: list[tuple]) -> None:
    for loss, grads, (ref_loss, ref_grads), _ in steps:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "plain"])
def test_packed_steps_equal_the_documents_one_by_one(family: str) -> None:
    model = PlainLM() if family == "plain" else hf_model(family)
    steps = packed_steps(model, isolate=True)
    assert len(steps) >= 3
    assert sorted(d for *_, seen in steps for d in seen) == list(range(14))  # each once
    assert_same(steps)


@pytest.mark.parametrize("family", ["llama", "plain"])
def test_a_mixed_row_fails_the_same_assertion(family: str) -> None:
    model = PlainLM() if family == "plain" else hf_model(family)
    steps = packed_steps(model, isolate=False)  # positions restart, attention is not kept apart
    with pytest.raises(AssertionError):
        assert_same(steps)


# -- in a Lightning fit ------------------------------------------------------------------------
class DocsStep(pl.LightningModule):
    """An unmodified module: its training step passes no position_ids to the model; its loader
    is given to ``trainer.fit`` or comes from a datamodule."""

    def __init__(
        self, model: nn.Module, n_docs: int = 24, lr: float = 0.05, workers: int = 0
    ) -> None:
        super().__init__()
        self.model, self.n_docs, self.lr, self.workers = model, n_docs, lr, workers
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():  # not the packing check's calls (no_grad, before training)
            self.seen.append(documents_in(batch))
        if isinstance(self.model, PlainLM):
            loss = self.model(batch["input_ids"], batch["labels"])  # positions from arange
        else:
            keys = ("input_ids", "labels", "attention_mask")  # no position_ids
            loss = self.model(**{k: batch[k] for k in keys}).loss
        if torch.is_grad_enabled():
            self.losses.append(float(loss.detach()))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DocsModule(DocsStep):
    """The same module, owning its loader (``train_dataloader()``)."""

    def train_dataloader(self):
        return docs_loader(self.n_docs, num_workers=self.workers)


def docs_loader(n_docs: int = 24, **kwargs) -> DataLoader:
    return DataLoader(Documents(lengths_of(n_docs)), batch_size=2, shuffle=True, **kwargs)


class DocsData(pl.LightningDataModule):
    def train_dataloader(self):
        return docs_loader()


def packed_fit(module: pl.LightningModule, tmp_path: Path, **kwargs) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    packing = kwargs.pop("packing", None) or SequencePacking(row_length=ROW, seed=2)
    callbacks = [packing, *kwargs.pop("callbacks", [])]
    if "callbacks_before" in kwargs:
        callbacks = [*kwargs.pop("callbacks_before"), *callbacks]
    fit = {
        k: kwargs.pop(k) for k in ("ckpt_path", "train_dataloaders", "datamodule") if k in kwargs
    }
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks, **kwargs,
    )  # fmt: skip
    trainer.fit(module, **fit)
    return trainer


def test_fit_packs_keeps_documents_apart_and_reports(tmp_path) -> None:
    from lightning_efficient.core.report import report_for

    model = hf_model("llama")
    first = {k: v.clone() for k, v in model.state_dict().items()}
    module = DocsModule(model)
    trainer = packed_fit(module, tmp_path, max_epochs=2)
    packing = next(c for c in trainer.callbacks if isinstance(c, SequencePacking))
    per_epoch = len(packing.loader)
    assert trainer.global_step == 2 * per_epoch and per_epoch < 24 // 2  # fewer batches than padded
    for epoch in range(2):
        docs = [
            d for step in module.seen[epoch * per_epoch : (epoch + 1) * per_epoch] for d in step
        ]
        assert sorted(docs) == list(range(24))  # every document once per epoch
    assert module.seen[:per_epoch] != module.seen[per_epoch:]  # shuffled per epoch
    # the first step's loss is the token mean of its documents run one by one
    fresh = hf_model("llama")
    fresh.load_state_dict(first)
    ref, _ = one_by_one(fresh, Documents(lengths_of(24)), module.seen[0])
    assert module.losses[0] == pytest.approx(float(ref), rel=1e-5)
    row = report_for(trainer)["SequencePacking"]
    assert row.figures["path"] == "hf-position-ids" and row.figures["served_calls"] >= 2 * per_epoch
    assert row.figures["fill"] > row.figures["padded_fill"]
    assert row.figures["check_error"] < 1e-5
    assert "forward" not in vars(model)  # undone after fit


def test_a_module_that_computes_its_positions_is_refused_before_training(tmp_path) -> None:
    model, sdpa = PlainLM(), F.scaled_dot_product_attention
    given = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SettingsError, match="LengthBucketSampler"):
        packed_fit(DocsModule(model), tmp_path, max_steps=2)
    assert all(torch.equal(given[k], v) for k, v in model.state_dict().items())  # no update
    assert F.scaled_dot_product_attention is sdpa  # put back


def test_resume_mid_epoch_continues_bit_identically(tmp_path) -> None:
    k, total = 3, 9  # the epoch has about 6 batches: step 3 is mid-epoch, 9 in the next epoch
    ckpt = tmp_path / "k.ckpt"
    full = DocsModule(hf_model("llama"))
    packed_fit(full, tmp_path / "full", max_steps=total, callbacks=[SaveAt(k, ckpt)])
    resumed = DocsModule(hf_model("qwen2"))  # other weights: all must come from the checkpoint
    resumed.model = hf_model("llama")
    packed_fit(resumed, tmp_path / "resumed", max_steps=total, ckpt_path=str(ckpt))
    assert resumed.seen == full.seen[k:]  # the same rows, mid-epoch and in the next epoch
    assert full.seen[:k] != full.seen[k : 2 * k]
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # two processes that each import Lightning and torch: ~30 s on 2 idle cores
@pytest.mark.ddp_case("packing")  # tests/multiprocess/ddp_packing.py
def test_ddp_two_processes_each_document_once(ddp_case) -> None:
    ranks = [json.loads((ddp_case / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["batches"] == ranks[1]["batches"] > 0
    seen = [[d for step in r["seen"] for d in step] for r in ranks]
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(ranks[0]["documents"]))
    assert ranks[0]["path"] == "sdpa-document-mask" and ranks[0]["check_error"] < 1e-5


# -- issue 49: what is trained is what the user's loader gives, in every way of giving it -------
@pytest.mark.parametrize("given_by", ["module", "datamodule", "fit"])
def test_every_way_of_giving_the_loader_is_packed_the_same(tmp_path, given_by: str) -> None:
    from lightning_efficient.core.report import report_for

    module = (DocsModule if given_by == "module" else DocsStep)(hf_model("llama"))
    where = {"datamodule": {"datamodule": DocsData()}, "fit": {"train_dataloaders": docs_loader()}}
    trainer = packed_fit(module, tmp_path, max_epochs=1, **where.get(given_by, {}))
    row = report_for(trainer)["SequencePacking"]
    assert row.figures["rows"] == 2 * len(module.seen) and row.figures["fill"] > 0.9
    assert row.figures["served_calls"] == len(module.seen)  # every training forward served
    assert sorted(d for step in module.seen for d in step) == list(range(24))
    reference = DocsModule(hf_model("llama"))
    packed_fit(reference, tmp_path / "reference", max_epochs=1)
    assert module.seen == reference.seen and module.losses == reference.losses


@pytest.mark.parametrize("order", ["saver after", "saver before"])
def test_resume_in_a_later_epoch_with_accumulation_and_workers(tmp_path, order: str) -> None:
    # 5 batches of 2 rows an epoch, 2 batches a step: 3 steps an epoch; step 5 is in epoch 1
    k, total, ckpt = 5, 10, tmp_path / "k.ckpt"
    save = SaveAt(k, ckpt, snapshot=lambda trainer: len(trainer.lightning_module.seen))
    saver = {"callbacks" if order == "saver after" else "callbacks_before": [save]}
    fit = dict(max_steps=total, accumulate_grad_batches=2)
    full = DocsModule(hf_model("llama"), workers=1)
    trainer = packed_fit(full, tmp_path / "full", **fit, **saver)
    per_epoch, at = trainer.num_training_batches, save.snapshot  # batches trained at the save
    assert per_epoch < at < 2 * per_epoch  # inside epoch 1
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    packer = next(v for key, v in state.items() if key.startswith("SequencePacking"))
    assert packer["epoch"] == 1 and packer["position"] == 2 * (at - per_epoch)
    resumed = DocsModule(hf_model("qwen2"), workers=1)
    resumed.model = hf_model("llama")
    packed_fit(resumed, tmp_path / "resumed", **fit, ckpt_path=str(ckpt))
    assert resumed.seen == full.seen[at:]  # the same rows, in epoch 1 and in epoch 2
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), name


def test_the_loaders_collate_is_kept_per_document(tmp_path) -> None:
    prompt = 3  # a completion-only collate: the first 3 tokens of each document are the prompt

    def completion_only(items):
        ids = torch.nn.utils.rnn.pad_sequence([i["input_ids"] for i in items], batch_first=True)
        labels = ids.clone()
        labels[:, :prompt] = -100
        lengths = torch.tensor([len(i["input_ids"]) for i in items])
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        return {
            "input_ids": ids,
            "labels": labels.masked_fill(mask == 0, -100),
            "attention_mask": mask,
        }

    lengths = lengths_of(24)
    loader = DataLoader(Documents(lengths), batch_size=2, collate_fn=completion_only)
    packed = pack_dataloader(loader, ROW)
    targets = sum(int((b["labels"] != -100).sum()) for b in packed)
    assert targets == sum(n - prompt for n in lengths)  # not sum(n - 1): the prompts stay masked
    for batch in packed:
        starts = batch["position_ids"] < prompt
        assert (batch["labels"][starts & (batch["attention_mask"] == 1)] == -100).all()


def test_a_sampler_that_picks_documents_is_refused_not_replaced(tmp_path) -> None:
    from torch.utils.data import SubsetRandomSampler

    loader = DataLoader(
        Documents(lengths_of(24)), batch_size=2, sampler=SubsetRandomSampler(range(8))
    )
    with pytest.raises(ValueError, match="SubsetRandomSampler"):
        pack_dataloader(loader, ROW)
    with pytest.raises(SettingsError, match="SubsetRandomSampler"):
        packed_fit(DocsStep(hf_model("llama")), tmp_path, max_steps=1, train_dataloaders=loader)


def test_prepadded_items_pack_their_tokens_not_their_padding() -> None:
    lengths = lengths_of(24)

    class Padded(Documents):
        def __getitem__(self, i):
            ids = self.docs[i]
            pad = ROW - len(ids)
            return {
                "input_ids": F.pad(ids, (0, pad), value=0),
                "attention_mask": F.pad(torch.ones_like(ids), (0, pad), value=0),
            }

    packed = pack_dataloader(DataLoader(Padded(lengths), batch_size=2), ROW)
    batches = list(packed)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    targets = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert tokens == sum(lengths) and targets == sum(n - 1 for n in lengths)
    assert packed.sampler.fill() == pytest.approx(sum(lengths) / (len(packed.sampler) * ROW))
    assert sorted(d for b in batches for d in documents_in(b)) == list(range(24))


class Counting(DocsModule):
    """Counts its training steps, feeds a metric and draws from Python's RNG in each."""

    def __init__(self, model: nn.Module) -> None:
        import torchmetrics

        super().__init__(model)
        self.calls = 0
        self.mean_loss = torchmetrics.MeanMetric()
        self.draws: list[float] = []

    def training_step(self, batch, batch_idx):
        import random

        self.calls += 1
        self.draws.append(random.random())
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        return loss


def test_the_check_leaves_no_trace_on_the_module(tmp_path) -> None:
    import random

    module = Counting(hf_model("llama"))
    random.seed(7)
    trainer = packed_fit(module, tmp_path, max_steps=3)
    assert module.calls == trainer.global_step == 3
    assert int(module.mean_loss.weight) == 3  # the metric saw the 3 training steps only
    random.seed(7)
    pl.seed_everything(0, verbose=False)
    assert module.draws[0] == random.random()  # the check consumed none of the stream


class SplitOnce(DocsModule):
    """Runs out of memory on every batch of more than one row (as a GPU would), so
    ``OOMRecovery`` splits each batch into its rows."""

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled() and batch["input_ids"].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return super().training_step(batch, batch_idx)


def test_after_an_oom_split_each_half_keeps_its_documents_apart(tmp_path) -> None:
    from lightning_efficient import OOMRecovery
    from lightning_efficient.core.report import report_for

    model = hf_model("llama")
    first = {k: v.clone() for k, v in model.state_dict().items()}
    module = SplitOnce(model)
    trainer = packed_fit(module, tmp_path, max_steps=3, callbacks=[OOMRecovery()])
    assert report_for(trainer)["OOMRecovery"].figures["recoveries"] == 1
    assert len(module.seen) == 6  # 3 batches, each run as its 2 rows
    assert report_for(trainer)["SequencePacking"].figures["served_calls"] == 6
    fresh = hf_model("llama")
    fresh.load_state_dict(first)
    for half in range(2):  # the first step: both rows against the initial weights
        ref, _ = one_by_one(fresh, Documents(lengths_of(24)), module.seen[half])
        assert module.losses[half] == pytest.approx(float(ref), rel=1e-5)


def test_an_oom_split_on_the_sdpa_path_is_refused(tmp_path) -> None:
    from lightning_efficient import OOMRecovery

    class OwnPositions(SplitOnce):  # a module of one's own that passes the rows' positions
        def training_step(self, batch, batch_idx):
            if torch.is_grad_enabled() and batch["input_ids"].shape[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return self.model(batch["input_ids"], batch["labels"], batch["position_ids"])

    with pytest.raises(RuntimeError, match="cannot tell which rows"):
        packed_fit(OwnPositions(PlainLM()), tmp_path, max_steps=2, callbacks=[OOMRecovery()])


def test_pack_dataloader_checks_what_it_is_given() -> None:
    docs = Documents(lengths_of(10))
    loader = DataLoader(docs, batch_size=2)
    with pytest.raises(ValueError, match=r"`lengths` has 3 entries but the loader's dataset 10"):
        pack_dataloader(loader, ROW, lengths=[5, 5, 5])
    cut = pack_dataloader(loader, ROW, lengths=[2] * 10)  # fewer tokens than the items have
    with pytest.raises(ValueError, match=r"item #\d+ has \d+ tokens but `lengths` gave 2"):
        next(iter(cut))
    with pytest.raises(TypeError, match="`shifted_labels` must be True or False; got .no."):
        pack_dataloader(loader, ROW, shifted_labels="no")
    with pytest.raises(ValueError, match="`rows_per_batch` must be >= 1; got 0"):
        pack_dataloader(loader, ROW, rows_per_batch=0)
    with pytest.raises(
        ValueError, match=r"`pad_id` must be in \[0, 2147483647\]; got 1099511627776"
    ):
        pack_dataloader(loader, ROW, pad_id=2**40)
    given = pack_dataloader(loader, ROW, lengths=lengths_of(10))  # the right lengths: served
    assert sorted(d for b in given for d in documents_in(b)) == list(range(10))


@pytest.mark.parametrize("other", ["DevicePreload", "Curriculum"])
@pytest.mark.parametrize("packing_first", [True, False])
def test_packing_with_another_order_or_a_preload_is_refused(tmp_path, other, packing_first) -> None:
    import lightning_efficient as le

    made = le.DevicePreload() if other == "DevicePreload" else le.Curriculum(difficulty="length")
    where = "callbacks" if packing_first else "callbacks_before"
    model = hf_model("llama")
    given = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SettingsError, match=f"SequencePacking with {other}: packing builds"):
        packed_fit(DocsModule(model), tmp_path, max_steps=1, **{where: [made]})
    assert all(torch.equal(given[k], v) for k, v in model.state_dict().items())


def test_bad_settings_and_states_are_refused_naming_them(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"`seed` must be in \[0, 4294967295\]; got 1125899906842624"
    ):
        SequencePacking(seed=2**50)
    with pytest.raises(ValueError, match=r"`pad_id` must be in \[0, 2147483647\]"):
        SequencePacking(pad_id=2**63)
    with pytest.raises(
        SettingsError,
        match=r"`pad_id` must be a token id below the vocabulary of `model` \(96 tokens\); got 96",
    ):
        packed_fit(DocsModule(hf_model("llama")), tmp_path, max_steps=1,
                   packing=SequencePacking(row_length=ROW, pad_id=VOCAB))  # fmt: skip
    # the packer's state in a checkpoint: checked, not trained from
    sampler = PackedRowSampler(lengths_of(24), ROW)
    for bad, key in (({"position": -3}, "position"), ({"position": 10**6}, "position"),
                     ({"epoch": -1}, "epoch"), ({"seed": 2**40}, "seed")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"`state\['{key}'\]` must be"):
            sampler.load_state_dict(bad)
    ckpt = tmp_path / "1.ckpt"
    packed_fit(DocsModule(hf_model("llama")), tmp_path, max_steps=1, callbacks=[SaveAt(1, ckpt)])
    saved = torch.load(ckpt, weights_only=False)
    key = next(k for k in saved["callbacks"] if k.startswith("SequencePacking"))
    for position in (-3, 10**6):
        saved["callbacks"][key]["position"] = position
        torch.save(saved, tmp_path / "bad.ckpt")
        with pytest.raises(
            SettingsError, match=rf"`state\['position'\]` must be in \[0, 10\]; got {position}"
        ):
            packed_fit(DocsModule(hf_model("llama")), tmp_path, max_steps=2,
                       ckpt_path=str(tmp_path / "bad.ckpt"))  # fmt: skip


def test_documents_without_tokens_or_labels_of_another_length_are_named(tmp_path) -> None:
    class Empty(Documents):
        def __getitem__(self, i):
            return {"input_ids": torch.zeros(0, dtype=torch.long)}

    class Module(DocsModule):
        def train_dataloader(self):
            return DataLoader(Empty(lengths_of(4)), batch_size=2)

    for row_length in (None, ROW):  # none given (was "row_length must be >= 1"), or given (0 steps)
        with pytest.raises(SettingsError, match="every one of the 4 documents has 0 tokens"):
            packed_fit(Module(hf_model("llama")), tmp_path, max_steps=1, callbacks=[],
                       packing=SequencePacking(row_length=row_length))  # fmt: skip

    class BadLabels(Documents):
        def __getitem__(self, i):
            return {
                "input_ids": self.docs[i],
                "labels": self.docs[i][:-1] if i == 3 else self.docs[i],
            }

    with pytest.raises(ValueError, match=r"item #3's `labels` has \d+ entries"):
        pack_dataloader(DataLoader(BadLabels(lengths_of(6)), batch_size=2), ROW)


def test_manual_optimization_is_refused_with_the_reason(tmp_path) -> None:
    class Manual(DocsModule):
        def __init__(self, model):
            super().__init__(model)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    with pytest.raises(
        SettingsError,
        match="under manual optimization would step the optimizers: .* pass check=False",
    ):
        packed_fit(Manual(hf_model("llama")), tmp_path, max_steps=1)
    module = Manual(hf_model("llama"))  # check=False: served
    packed_fit(module, tmp_path, max_steps=2, packing=SequencePacking(row_length=ROW, check=False))
    assert len(module.seen) == 2 and all(len(s) > 1 for s in module.seen)


class SaveAtValidation(pl.Callback):
    """Saves a checkpoint when validation ends at optimizer step ``step`` (ModelCheckpoint's
    moment with a val_check_interval), counting the batches trained then."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path, self.batches = step, str(path), None

    def on_validation_end(self, trainer, pl_module) -> None:
        if (
            trainer.global_step == self.step
            and self.batches is None
            and not trainer.sanity_checking
        ):
            trainer.save_checkpoint(self.path)
            self.batches = len(pl_module.seen)


class Validated(DocsStep):
    def validation_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


class DocsWithValidation(DocsData):
    def val_dataloader(self):
        return DataLoader(Documents(lengths_of(2, seed=5)), batch_size=1)


def test_resume_from_a_validation_checkpoint_with_a_datamodule(tmp_path) -> None:
    k, total, ckpt = 7, 12, tmp_path / "val.ckpt"  # 5 batches an epoch: step 7 is in epoch 1
    fit = dict(max_steps=total, val_check_interval=2, num_sanity_val_steps=0)
    full, save = Validated(hf_model("llama")), SaveAtValidation(k, ckpt)
    packed_fit(full, tmp_path / "full", callbacks=[save], datamodule=DocsWithValidation(), **fit)
    assert save.batches == k
    resumed = Validated(hf_model("llama"))
    packed_fit(
        resumed, tmp_path / "resumed", datamodule=DocsWithValidation(), ckpt_path=str(ckpt), **fit
    )
    assert resumed.seen == full.seen[k:]
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), name
