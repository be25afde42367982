"""ChunkedCrossEntropy made reliable (issue 37, rows 1, 4, 12 and the out-of-range target): the
plain step is the reference in every case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import GPTLike, llama_128k, logits_loss, tiny_model
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.chunked_loss import (
    ChunkedCrossEntropy,
    apply_chunked_cross_entropy,
    chunk_rows,
    chunked_linear_cross_entropy,
)

V, SEQ = 101, 16


def _tinygpt() -> nn.Module:
    torch.manual_seed(0)
    return tiny_model(vocab_size=V, seq_len=SEQ, n_layer=1, n_embd=32, n_head=2, dropout=0.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (3, SEQ), generator=g), torch.randint(0, V, (3, SEQ), generator=g)


# -- row 1: the logits read under no_grad or through detach() before the loss ---------------------
def _step_with_accuracy(model: nn.Module, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch()
    logits = model(x)
    if how == "detach":
        accuracy = (logits.detach().argmax(-1) == y).float().mean()
    else:
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == y).float().mean()
    l2 = sum(p.pow(2).sum() for p in model.parameters())
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1)) + 1e-4 * l2
    loss.backward()
    return loss.detach(), accuracy


@pytest.mark.parametrize("how", ["detach", "no_grad"])
def test_logits_read_without_grad_before_the_loss_keep_its_gradient(how: str) -> None:
    model = _tinygpt()
    plain = copy.deepcopy(model)
    said: list[str] = []
    change = apply_chunked_cross_entropy(model, say=said.append)
    loss, accuracy = _step_with_accuracy(model, how)
    ref_loss, ref_accuracy = _step_with_accuracy(plain, how)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert float(accuracy) == float(ref_accuracy)
    assert model.head.weight is model.tok_emb.weight  # TinyGPT ties the head to the embedding
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(
            got.grad, want.grad, rtol=1e-5, atol=1e-6 * float(want.grad.abs().max())
        )
    assert change.value.fallback_calls >= 1 and len(said) == 1  # fell back, said once


# -- row 4: a batch whose labels are all ignored ---------------------------------------------------
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_fully_ignored_batch_is_the_plain_loss(reduction: str, smoothing: float) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(V, 8, generator=g, requires_grad=True)
    t = torch.full((12,), -100)
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    ref = F.cross_entropy(F.linear(h, w), t, **kw)
    out = chunked_linear_cross_entropy(h, w, None, t, rows=5, **kw)
    torch.testing.assert_close(out, ref, equal_nan=True)  # NaN for the mean, 0 for the sum
    want = torch.autograd.grad(ref, [h, w])
    got = torch.autograd.grad(out, [h, w])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # zeros, as the plain step's


def test_a_fully_padded_step_leaves_the_weights_finite() -> None:
    model = _tinygpt()
    apply_chunked_cross_entropy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch()
    for labels in (y, torch.full_like(y, -100), y):  # a fully padded batch at step 2
        opt.zero_grad()
        F.cross_entropy(model(x).view(-1, V), labels.view(-1), label_smoothing=0.1).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- out-of-range targets --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [V, -5])
def test_an_out_of_range_target_raises_torchs_error(bad: int) -> None:
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(V, 8, requires_grad=True)
    t = torch.tensor([1, -100, bad, 2])
    with pytest.raises(IndexError) as plain:
        F.cross_entropy(F.linear(h, w), t)
    with pytest.raises(IndexError) as chunked:
        chunked_linear_cross_entropy(h, w, None, t)
    assert str(chunked.value) == str(plain.value) == f"Target {bad} is out of bounds."


# -- row 12: the chunk scales with the logits ----------------------------------------------------
def test_a_chunk_holds_a_fraction_of_the_logits() -> None:
    assert chunk_rows(64000, 512) == 32  # 1/16 of 2 x 256 rows; 128 MiB would hold all 512
    assert chunk_rows(128256, 8192) == 261  # long sequences: the 128 MiB cap
    assert chunk_rows(101, 40) == 16  # never fewer than 16 rows (unless the cap says so)
    assert chunk_rows(101, 7) == 7
    assert chunk_rows(64000, 512, chunk_bytes=2**20) == 4


def test_moderate_logits_peak_is_three_times_lower() -> None:
    """131 MB of fp32 logits (2 x 256 rows of 64,000), which the 128 MiB default chunk held
    whole (the step's peak fell 2.0x): measured by the tracker, loss phase and whole step."""
    torch.manual_seed(0)
    batch = (torch.randint(0, 64000, (2, 256)), torch.randint(0, 64000, (2, 256)))
    sgd = "torch.optim.SGD"
    peaks = {}
    for on in (False, True):
        cbs = [ChunkedCrossEntropy()] if on else []
        real = measure_step(GPTLike(), batch, sgd, loss_fn=logits_loss, callbacks=cbs, steps=1)
        peaks[on] = real.peak_bytes
    assert peaks[False] / peaks[True] >= 3


def test_a_128k_vocabulary_hugging_face_model_peak_is_three_times_lower() -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = llama_128k()
    ids = torch.zeros(2, 256, dtype=torch.long, device="meta")
    peaks = {}
    for on in (False, True):
        cbs = [ChunkedCrossEntropy()] if on else []
        est = estimate_memory(
            model, (ids, ids), optimizer="torch.optim.SGD", loss_fn=logits_loss, callbacks=cbs,
            device="cpu",
        )  # fmt: skip
        peaks[on] = est.peak_bytes
    assert peaks[False] / peaks[True] >= 3


# -- row 13: under a compiled whole model -------------------------------------------------------
def test_a_compiled_whole_model_ends_its_graph_at_the_head_once_silently() -> None:
    import warnings

    model = _tinygpt()
    plain = copy.deepcopy(model)
    change = apply_chunked_cross_entropy(model)
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    model.compile(backend=backend)
    x, y = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        loss.backward()
    assert len(graphs) == 1  # one graph, up to the hidden states: no break inside the model
    assert not [w for w in caught if "dynamo" in str(w.message).lower()]  # no raw Dynamo text
    assert change.value.by_backend == {"chunked": 1} and not change.value.fallbacks
    ref = F.cross_entropy(plain(x).view(-1, V), y.view(-1))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(
            got.grad, want.grad, rtol=1e-5, atol=1e-6 * float(want.grad.abs().max())
        )
