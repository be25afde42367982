"""The estimate on Hugging Face models with their default attention (SDPA) at sequence 512.

Under fake tensors transformers believes it is being traced and, unable to read the padding mask or
the position ids, builds a batch x 1 x seq x seq attention mask that a real run on a batch without
padding never builds. The estimate answers those checks from the real batch's values
(``measure.memory.hf_masks.hf_mask_checks_on_values``), so it takes the real run's path: within 2%
of the same steps tracked on real tensors, with and without padding, and within 5% of the CPU
allocator's own peak (``torch.profiler`` memory events, ``measure.memory.allocator``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_efficient.measure import estimate_memory
from lightning_efficient.measure.memory.allocator import allocator_step_peak
from lightning_efficient.measure.memory.hf_masks import NO_PADDING_NOTE

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 512, 2, 128


def _mistral() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        sliding_window=None,
    )
    return transformers.MistralForCausalLM(cfg)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attention_probs_dropout_prob=0.0,  # dropout in SDPA takes the math path: mask is minor
    )
    return transformers.BertForMaskedLM(cfg)


MODELS = {"mistral": _mistral, "bert": _bert}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, labels=batch["input_ids"]).loss


def _batch(padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -SEQ // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padded"])
def test_sdpa_estimate_matches_real_steps_and_the_allocator(family: str, padded: bool) -> None:
    model = MODELS[family]()
    assert model.config._attn_implementation == "sdpa"
    batch = _batch(padded)
    est = estimate_memory(model, batch, loss_fn=_loss, steps=1)
    real, allocator = allocator_step_peak(copy.deepcopy(model), batch, loss_fn=_loss, steps=1)
    assert est.peak_bytes == pytest.approx(real.peak_bytes, rel=0.02), (str(est), str(real))
    assert est.peak_bytes == pytest.approx(allocator, rel=0.05), (str(est), allocator)
    assert NO_PADDING_NOTE not in est.notes  # the values were known: nothing assumed


def test_the_mask_matters_and_unknown_values_are_noted(family: str) -> None:
    """Fake-only: the padded batch builds the B x 1 x S x S mask, the unpadded one does not
    (so the test above is not vacuous); a batch given by shape is assumed unpadded, said so."""
    model = MODELS[family]()
    plain = estimate_memory(model, _batch(False), loss_fn=_loss, steps=1)
    padded = estimate_memory(model, _batch(True), loss_fn=_loss, steps=1)
    mask_bytes = BATCH * SEQ * SEQ  # one bool mask; the attention keeps it (and more) alive
    assert padded.peak_bytes - plain.peak_bytes >= mask_bytes
    meta = {k: v.to("meta") for k, v in _batch(True).items()}
    by_shape = estimate_memory(model, meta, loss_fn=_loss, steps=1)
    assert by_shape.peak_bytes == plain.peak_bytes
    assert NO_PADDING_NOTE in by_shape.notes


def test_the_estimate_reads_trains_without_cache_once() -> None:
    """A technique declares once that it trains without the key/value cache
    (``Technique.trains_without_cache``); the estimate's plan reads the flag: a technique that
    declares it and changes nothing else estimates GPT-2 (``use_cache=True``) as without the
    cache, once for two of them, the config and the module untouched."""
    from benchmarks.workloads import TinyHFGPT2
    from lightning_efficient.core.technique import Technique
    from lightning_efficient.techniques import (
        ActivationCheckpointing,
        ChunkedCrossEntropy,
        FrozenWeights4bit,
    )

    class NoCache(Technique):
        trains_without_cache = True

    def estimate(use_cache: bool, *callbacks: Technique) -> object:
        return estimate_memory(
            TinyHFGPT2(use_cache), (torch.zeros(4, 32, dtype=torch.long),), callbacks=callbacks
        )

    cached, plain = estimate(True), estimate(False)
    off, twice = estimate(True, NoCache()), estimate(True, NoCache(), NoCache())
    assert off.peak_bytes == twice.peak_bytes == plain.peak_bytes < cached.peak_bytes
    assert any("key/value cache built while training" in n for n in cached.notes)
    assert not any("key/value cache" in n for n in off.notes + twice.notes)
    assert all(t.trains_without_cache for t in (ActivationCheckpointing, ChunkedCrossEntropy))
    assert FrozenWeights4bit.trains_without_cache and not Technique.trains_without_cache
