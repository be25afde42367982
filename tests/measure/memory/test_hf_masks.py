"""measure/memory/hf_masks.py: transformers' SDPA mask checks answered from the real batch under
fake tensors (the estimate end to end is in tests/measure/memory/test_estimate_hf.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_efficient.core._internals import (
    HF_MASK_ARGUMENTS,
    HF_MASK_SKIP_CHECKS,
    FakeTensorMode,
)
from lightning_efficient.measure.memory.hf_masks import NO_PADDING_NOTE, hf_mask_checks_on_values


def test_hf_mask_checks_answer_from_the_real_batch() -> None:
    """transformers' SDPA mask under fake tensors: built by default (it cannot read the values);
    inside ``hf_mask_checks_on_values`` skipped for an unpadded batch, built for a padded one,
    assumed unpadded (and said so) for a batch known by shape only."""
    transformers = pytest.importorskip("transformers")
    mu = pytest.importorskip("transformers.masking_utils")
    present = [n for n in HF_MASK_SKIP_CHECKS if hasattr(mu, n)]
    assert present and hasattr(mu, HF_MASK_ARGUMENTS), "transformers moved its mask checks"
    cfg = transformers.LlamaConfig(hidden_size=8, num_attention_heads=1, num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    ones = torch.ones(2, 16, dtype=torch.long)
    padded = ones.clone()
    padded[0, -4:] = 0
    originals = {n: getattr(mu, n) for n in present}

    def mask(real: torch.Tensor | None) -> tuple[object, list[str]]:
        with FakeTensorMode() as mode:
            embeds = torch.empty(2, 16, 8)
        fake = mode.from_tensor(ones)
        with hf_mask_checks_on_values([(fake, real)]) as assumed, mode:
            return mu.create_causal_mask(cfg, embeds, fake, None), assumed

    with FakeTensorMode():
        built = mu.create_causal_mask(cfg, torch.empty(2, 16, 8), torch.ones(2, 16), None)
    assert built is not None and built.shape[-2:] == (16, 16)  # what the issue was about
    assert mask(ones) == (None, [])  # the real run skips it: SDPA's is_causal
    got, assumed = mask(padded)
    assert got is not None and got.shape[-2:] == (16, 16) and assumed == []
    got, assumed = mask(None)
    assert got is None and assumed == [NO_PADDING_NOTE]
    assert {n: getattr(mu, n) for n in present} == originals  # put back


def test_nested_blocks_leave_the_answer_to_the_outer_one() -> None:
    pytest.importorskip("transformers")
    mu = pytest.importorskip("transformers.masking_utils")
    given = getattr(mu, HF_MASK_ARGUMENTS)
    with hf_mask_checks_on_values([]) as outer:
        answered = getattr(mu, HF_MASK_ARGUMENTS)
        assert answered is not given
        with hf_mask_checks_on_values([]) as inner:
            assert getattr(mu, HF_MASK_ARGUMENTS) is answered and inner == [] and inner is not outer
        assert getattr(mu, HF_MASK_ARGUMENTS) is answered
    assert getattr(mu, HF_MASK_ARGUMENTS) is given
