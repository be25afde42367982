"""The output head, one rule in one place (``measure.memory.heads.find_output_head``, issue 39): the
profiler, the chunked loss and the planner's ``worth_chunking`` read it; LitGPT's ``GPT`` (its
``lm_head`` registered before the blocks) and ``litgpt.lora.GPT`` are served."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.measure.memory.heads import find_output_head
from lightning_efficient.measure.profiling.profile_summary import output_head
from lightning_efficient.techniques.chunked_loss import (
    ChunkedCrossEntropy,
    find_output_projection,
    worth_chunking,
)

litgpt = pytest.importorskip("litgpt")
from litgpt import lora  # noqa: E402
from litgpt.model import GPT, Config  # noqa: E402

V, SEQ = 101, 16
_DIMS = dict(block_size=SEQ, vocab_size=V, padded_vocab_size=128, n_layer=2, n_head=2, n_embd=32)


def _gpt(use_lora: bool) -> nn.Module:
    torch.manual_seed(0)
    if not use_lora:
        return GPT(Config(name="tiny", **_DIMS))
    cfg = lora.Config(
        name="tiny", **_DIMS, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True
    )
    model = lora.GPT(cfg)
    lora.mark_only_lora_as_trainable(model)
    return model


def test_the_rule_finds_the_vocabulary_head_of_each_kind_of_model() -> None:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2)
    )
    assert find_output_head(gpt2)[:2] == ("lm_head", gpt2.lm_head)
    assert find_output_head(tiny_model(vocab_size=V)).how == "tied to the input embedding"
    litgpt_head = find_output_head(_gpt(False))
    assert (litgpt_head.name, litgpt_head.how) == ("lm_head", "as wide as the largest embedding")
    assert find_output_head(_gpt(True)).name == "lm_head.linear"  # inside LoRALinear
    # no vocabulary: a classifier's two outputs, a model without an embedding
    classifier = nn.ModuleDict({"tok": nn.Embedding(1000, 16), "cls": nn.Linear(16, 2)})
    assert find_output_head(classifier) is None and find_output_head(nn.Linear(4, 4)) is None


def test_the_profiler_and_the_chunked_loss_read_the_same_rule() -> None:
    for use_lora in (False, True):
        model = _gpt(use_lora)
        name, linear, _ = find_output_projection(model)
        assert name == find_output_head(model).name and name.startswith("lm_head")
        assert output_head(model) == (linear.out_features, linear.in_features) == (128, 32)
        assert worth_chunking(model)  # the planner and AutoEfficient offer it for LitGPT


def test_head_names_an_nn_linear_with_a_clear_error() -> None:
    model = _gpt(True)
    with pytest.raises(ValueError, match=r"`head` .*'lm_head' \(LoRALinear\).*'lm_head.linear'"):
        find_output_projection(model, "lm_head")
    with pytest.raises(ValueError, match="'nope' \\(no such module\\)"):
        find_output_projection(model, "nope")
    with pytest.raises(TypeError, match="`head` must be the name"):
        ChunkedCrossEntropy(head=3)  # type: ignore[arg-type]
    assert find_output_projection(model, "lm_head.linear")[2] == "named by `head`"
    cb = ChunkedCrossEntropy(head="transformer.wte")

    class Trainer:  # what setup reads: no other technique, no strategy
        callbacks = [cb]

    with pytest.raises(ValueError, match="'transformer.wte' \\(Embedding\\)"):
        cb.setup(Trainer(), model, "fit")  # refused before anything runs


class _LitGPTModule(pl.LightningModule):
    """LitGPT's GPT (or its LoRA GPT) in a LightningModule, next-token loss."""

    def __init__(self, use_lora: bool) -> None:
        super().__init__()
        self.model = _gpt(use_lora)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


@pytest.mark.parametrize("use_lora", [False, True], ids=["gpt", "lora"])
def test_litgpt_loss_from_chunks_equals_the_plain_run(tmp_path, use_lora: bool) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(0, V, (12, SEQ), generator=torch.Generator().manual_seed(0))

    def run(callbacks):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            default_root_dir=tmp_path, max_steps=3, callbacks=callbacks, accelerator="cpu",
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        losses: list[float] = []

        class Losses(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        trainer.callbacks.append(Losses())
        module = _LitGPTModule(use_lora)
        trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4))
        return trainer, module, losses

    _, _, plain = run([])
    trainer, module, chunked = run([ChunkedCrossEntropy(chunk_bytes="64KiB")])
    row = report_for(trainer).entries[0]
    assert row.figures["losses_from_chunks"] == 3 and row.figures["full_logits_steps"] == 0
    assert chunked == pytest.approx(plain, rel=1e-5)
    head = module.model.lm_head.linear if use_lora else module.model.lm_head
    assert "forward" not in vars(head)  # put back after fit
