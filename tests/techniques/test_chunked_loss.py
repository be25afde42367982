"""ChunkedCrossEntropy (issue 28): the loss from the output projection in chunks.

The plain run is the reference: losses and gradients equal it in fp32 (rtol 1e-5 of each
gradient's scale) on Hugging Face GPT-2, Llama, Mistral and Qwen2 tiny configs and on TinyGPT,
with padding and ``ignore_index``; under bf16 autocast the error against the fp32 run is the plain
bf16 run's (bf16 noise). The loss-phase memory it saves is measured with the instrument.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import fit
from torch import nn

from benchmarks.workloads import GPTLike, LossHead, llama_128k, logits_loss, tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.core.validate import SettingsError
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.chunked_loss import (
    ChunkedCrossEntropy,
    LazyLogits,
    apply_chunked_cross_entropy,
    chunk_rows,
    chunked_linear_cross_entropy,
    find_output_projection,
    loss_refusal,
)
from lightning_efficient.techniques.chunked_loss.backends import Call, check_library, choose_backend

transformers = pytest.importorskip("transformers")

V, SEQ = 101, 16
ROWS = 7  # rows per chunk in these tests: several chunks, the last one partial
CHUNK = 4 * V * ROWS


# -- models ---------------------------------------------------------------------------------------
def _causal(config_cls: type, model_cls: type, **extra: object) -> nn.Module:
    cfg = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        max_position_embeddings=SEQ,
        **extra,
    )
    return model_cls(cfg)


def _gpt2(vocab: int = V) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


HF = {
    "gpt2": _gpt2,
    "llama": lambda: _causal(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": lambda: _causal(
        transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=None
    ),
    "qwen2": lambda: _causal(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def _hf_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # padding: masked in attention, ignored by the loss
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (3, SEQ), generator=g), torch.randint(0, V, (3, SEQ), generator=g)
    y[0, -5:] = -100  # ignore_index (F.cross_entropy's default)
    return x, y


def _tinygpt() -> nn.Module:
    return tiny_model(vocab_size=V, seq_len=SEQ, n_layer=2, n_embd=32, n_head=2, dropout=0.0)


def _step(model: nn.Module, batch: object, bf16: bool = False, **kwargs: object):
    """Loss and gradients of one forward/backward (bf16: under CPU autocast, as bf16-mixed)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TinyGPT's self.log without a trainer
        if isinstance(batch, dict):
            loss = model(**batch, **kwargs).loss
        else:
            loss = model.training_step(batch, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def _assert_equal(got, want) -> None:
    loss, grads = got
    ref_loss, ref_grads = want
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()))


def _error(grads, truth) -> float:
    a = torch.cat([g.float().flatten() for g in grads])
    b = torch.cat([t.float().flatten() for t in truth])
    return float((a - b).norm() / b.norm())


MODELS = {**{k: (v, _hf_batch) for k, v in HF.items()}, "tinygpt": (_tinygpt, _tiny_batch)}


@pytest.fixture(params=sorted(MODELS))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def _pair(family: str) -> tuple[nn.Module, nn.Module, object]:
    build, batch = MODELS[family]
    torch.manual_seed(0)
    model = build()
    return model, copy.deepcopy(model), batch()


# -- the same maths ---------------------------------------------------------------------------------
def test_fp32_loss_and_gradients_equal_the_plain_run(family: str) -> None:
    model, plain, batch = _pair(family)
    change = apply_chunked_cross_entropy(model, chunk_bytes=CHUNK)
    got = _step(model, batch)
    assert change.value.by_backend == {"chunked": 1} and change.value.rows == ROWS
    assert not change.value.fallbacks
    _assert_equal(got, _step(plain, batch))


def test_bf16_autocast_within_bf16_noise(family: str) -> None:
    model, plain, batch = _pair(family)
    truth_loss, truth = _step(copy.deepcopy(plain), batch)
    ref_loss, ref = _step(plain, batch, bf16=True)
    change = apply_chunked_cross_entropy(model, chunk_bytes=CHUNK)
    loss, grads = _step(model, batch, bf16=True)
    assert change.value.by_backend == {"chunked": 1}
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert abs(float(loss - ref_loss)) <= 2**-8 * abs(float(ref_loss))
    # the error against fp32 is the plain bf16 run's own (measured: 0.93-1.00x of it)
    assert _error(grads, truth) <= 1.25 * _error(ref, truth)


def test_hugging_face_num_items_in_batch_sums_then_divides() -> None:
    model, plain, batch = _pair("gpt2")
    apply_chunked_cross_entropy(model, chunk_bytes=CHUNK)
    items = torch.tensor(29)  # e.g. the tokens of the whole accumulated batch
    _assert_equal(
        _step(model, batch, num_items_in_batch=items), _step(plain, batch, num_items_in_batch=items)
    )


class _Plain(nn.Module):
    """A plain language model whose loss shifts the logits itself and smooths the labels."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, V, bias=bias)
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)[:, :-1, :].contiguous()
        return self.loss(logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_label_smoothing_shifted_logits_and_a_bias(bias: bool) -> None:
    torch.manual_seed(0)
    model = _Plain(bias)
    plain = copy.deepcopy(model)
    x, y = _tiny_batch()
    y = y.clamp(min=0)  # ignore_index=0 here
    name, _, how = find_output_projection(model)
    assert (name, how) == ("out", "as wide as the largest embedding")
    change = apply_chunked_cross_entropy(model, chunk_bytes=CHUNK)
    _assert_equal(_step(model, (x, y)), _step(plain, (x, y)))
    assert change.value.by_backend == {"chunked": 1}


def test_the_kernel_alone_equals_cross_entropy_of_linear() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(V, 16, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    t = torch.randint(0, V, (37,), generator=g)
    t[::5] = -100
    for reduction in ("mean", "sum"):
        ref = F.cross_entropy(F.linear(h, w, b), t, reduction=reduction, label_smoothing=0.2)
        out = chunked_linear_cross_entropy(
            h, w, b, t, reduction=reduction, label_smoothing=0.2, rows=8
        )
        want = torch.autograd.grad(ref * 3.0, [h, w, b])  # an incoming gradient other than 1
        _assert_equal((out.detach(), torch.autograd.grad(out * 3.0, [h, w, b])), (ref, want))


def test_gradients_are_handed_over_once() -> None:
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    loss = chunked_linear_cross_entropy(h, w, None, torch.randint(0, V, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        loss.backward()


# -- what stays lazy, what falls back ---------------------------------------------------------------
def test_logits_outside_the_loss_are_computed_in_full_and_said_once() -> None:
    torch.manual_seed(0)
    model = _tinygpt()
    said: list[str] = []
    change = apply_chunked_cross_entropy(model, chunk_bytes=CHUNK, say=said.append)
    x, y = _tiny_batch()
    logits = model(x)
    assert isinstance(logits, LazyLogits) and logits.shape == (3, SEQ, V)
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    accuracy = (logits.argmax(-1) == y).float().mean()  # a metric reads them
    accuracy2 = (logits.argmax(-1) == y).float().mean()
    assert float(accuracy) == float(accuracy2)
    assert change.value.fallbacks == {"Tensor.argmax": 1}  # the full logits computed once
    assert len(said) == 1 and "Tensor.argmax" in said[0]
    with torch.no_grad():  # validation: plain logits
        assert type(model(x)) is torch.Tensor
    by_name = F.cross_entropy(input=model(x).view(-1, V), target=y.view(-1))  # keywords too
    torch.testing.assert_close(by_name, loss)
    assert change.value.by_backend == {"chunked": 2}
    per_row = F.cross_entropy(model(x).view(-1, V), y.view(-1), reduction="none")
    assert per_row.shape == (3 * SEQ,)
    assert any("reduction='none'" in k for k in change.value.fallbacks)
    assert torch.isfinite(loss)


def test_fsdp_marker_hooks_move_to_the_loss_other_hooks_need_the_logits() -> None:
    """FSDP2's pre-backward hook only marks that backward reached a module's output: on lazy
    logits it goes to the loss, whether registered before the loss is computed (TinyGPT returns
    the logits) or after (a Hugging Face model computes its loss inside forward)."""
    model = _tinygpt()
    change = apply_chunked_cross_entropy(model, chunk_bytes=CHUNK)
    x, y = _tiny_batch()
    calls: list[tuple[str, tuple]] = []

    def marker(name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            calls.append((name, tuple(grad.shape)))
            return grad

        hook.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"  # FSDP2's module
        return hook

    logits = model(x)
    logits.register_hook(marker("before"))
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    logits.register_hook(marker("after"))
    loss.backward()
    assert sorted(calls) == [("after", ()), ("before", ())]  # each once, with the loss's gradient
    assert change.value.by_backend == {"chunked": 1} and not change.value.fallbacks
    seen: list[tuple] = []
    logits = model(x)
    logits.register_hook(lambda g: seen.append(tuple(g.shape)))  # needs the logits' gradient
    F.cross_entropy(logits.view(-1, V), y.view(-1)).backward()
    assert seen == [(3, SEQ, V)] and "Tensor.register_hook" in change.value.fallbacks


def test_undo_puts_the_projection_back() -> None:
    model = _tinygpt()
    change = apply_chunked_cross_entropy(model)
    assert "forward" in vars(model.head)
    change.undo()
    change.undo()  # once
    assert "forward" not in vars(model.head) and type(model(_tiny_batch()[0])) is torch.Tensor


def test_models_that_transform_their_logits_are_refused() -> None:
    cfg = transformers.Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=V,
    )
    gemma = transformers.Gemma2ForCausalLM(cfg)
    assert "final_logit_softcapping=30.0" in loss_refusal(gemma)
    with pytest.raises(SettingsError, match="soft-capping"):
        apply_chunked_cross_entropy(gemma)
    assert "forward" not in vars(gemma.lm_head)
    assert loss_refusal(HF["llama"]()) is None


def test_worth_chunking_needs_wide_logits_and_a_loss_it_can_reproduce() -> None:
    from lightning_efficient.techniques.chunked_loss import worth_chunking

    assert worth_chunking(_gpt2(vocab=1024))  # 1024 outputs of width 32
    assert worth_chunking(tiny_model(vocab_size=1024, n_embd=32, n_head=2))  # tied
    assert not worth_chunking(_gpt2(vocab=101))  # 101 outputs of width 32: under 4x
    assert not worth_chunking(type(tiny_model())())  # TinyGPT's bytes: 256 outputs, width 128
    assert not worth_chunking(nn.Sequential(nn.Conv2d(3, 8, 3)))  # no linear layer


def test_head_must_name_a_linear_layer() -> None:
    model = _tinygpt()
    assert find_output_projection(model, "head")[0] == "head"
    with pytest.raises(ValueError, match="`head` must name an nn.Linear.*'ln_f'"):
        find_output_projection(model, "ln_f")
    assert find_output_projection(HF["gpt2"]())[:1] == ("lm_head",)


# -- backends ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("requested", "device", "bias", "smoothing", "available", "expected"),
    [
        ("auto", "cpu", False, 0.0, {"liger": True, "cce": True}, "chunked"),
        ("auto", "cuda", False, 0.0, {"liger": True, "cce": True}, "liger"),
        ("auto", "cuda", False, 0.0, {"liger": False, "cce": True}, "cce"),
        ("auto", "cuda", True, 0.0, {"liger": False, "cce": True}, "chunked"),
        ("auto", "cuda", False, 0.1, {"liger": False, "cce": True}, "chunked"),
        ("auto", "cuda", False, 0.0, {"liger": False, "cce": False}, "chunked"),
        ("cce", "cuda", False, 0.0, {"liger": True, "cce": True}, "cce"),
        ("liger", "cpu", False, 0.0, {"liger": True, "cce": False}, "chunked"),
        ("chunked", "cuda", False, 0.0, {"liger": True, "cce": True}, "chunked"),
    ],
)
def test_backend_rule(requested, device, bias, smoothing, available, expected) -> None:
    backend, why = choose_backend(requested, Call(device, bias, smoothing, "mean"), available)
    assert backend == expected and why


def test_a_library_backend_asked_for_must_be_installed() -> None:
    from lightning_efficient.techniques.chunked_loss.backends import available_libraries

    for name, installed in available_libraries().items():
        if not installed:
            with pytest.raises(ImportError, match="pip install .*backend='auto'"):
                check_library(name)


# -- the callback in a fit -----------------------------------------------------------------------------
class _WithAccuracy(type(tiny_model())):  # TinyGPT whose training step also reads the logits
    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_acc", (logits.argmax(-1) == y).float().mean())
        return loss


def test_fit_with_a_metric_on_the_logits_falls_back_and_says_so_once(tmp_path) -> None:
    _, _, plain = fit(tmp_path, [], max_steps=3, model=_with_accuracy())
    cb = ChunkedCrossEntropy(chunk_bytes="64KiB")
    with pytest.warns(NoEffectWarning, match="Tensor.argmax") as caught:
        trainer, model, rec = fit(tmp_path, [cb], max_steps=3, model=_with_accuracy())
    assert sum("Tensor.argmax" in str(w.message) for w in caught) == 1
    assert rec.losses == pytest.approx(plain.losses, rel=1e-5)
    row = report_for(trainer).entries[0]
    assert row.figures["losses_from_chunks"] == 3 and row.figures["full_logits_steps"] == 3
    assert "forward" not in vars(model.head)  # put back after fit


def _with_accuracy() -> _WithAccuracy:
    from benchmarks.workloads import TINY_MODEL

    torch.manual_seed(0)
    return _WithAccuracy(**TINY_MODEL)


class _HFModule(pl.LightningModule):
    """A Hugging Face causal LM in a LightningModule, as users write it (labels = inputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _gpt2(vocab=1024)  # 16 rows a chunk of 64 KiB: 4 chunks of a batch

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_hugging_face_model_in_a_bf16_mixed_fit(tmp_path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(0, 1024, (12, SEQ), generator=torch.Generator().manual_seed(0))

    def run(callbacks):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            default_root_dir=tmp_path, max_steps=3, precision="bf16-mixed", callbacks=callbacks,
            accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        module = _HFModule()
        losses = []

        class Losses(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"]))

        trainer.callbacks.append(Losses())
        trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4))
        return trainer, losses

    _, plain = run([])
    trainer, chunked = run([ChunkedCrossEntropy(chunk_bytes="64KiB")])
    row = report_for(trainer).entries[0]
    assert row.figures["losses_from_chunks"] == 3 and row.figures["full_logits_steps"] == 0
    assert row.figures["rows_per_chunk"] == 16
    assert chunked == pytest.approx(plain, rel=2**-7)  # bf16 noise, over 3 optimizer steps


def test_fit_refuses_a_soft_capped_model_at_fit_start() -> None:
    cfg = transformers.Gemma2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16, vocab_size=V
    )
    cb = ChunkedCrossEntropy()

    class Trainer:  # what setup reads: no other technique, no strategy
        callbacks = [cb]

    with pytest.raises(SettingsError, match="ChunkedCrossEntropy: Gemma2ForCausalLM caps"):
        cb.setup(Trainer(), transformers.Gemma2ForCausalLM(cfg), "fit")


@pytest.mark.slow
def test_under_fsdp_the_loss_comes_from_chunks_and_equals_the_plain_run(tmp_path) -> None:
    """FSDP2 registers its pre-backward hook on the root module's outputs (here the lazy
    logits): it is moved to the loss, so the loss still comes from chunks, and the gradients
    are reduced as in the plain run (two ranks at batch 4 read the plain run's batch of 8)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers import subprocess_timeout

    from benchmarks.workloads import interleaved_data

    multiprocess = Path(__file__).parents[1] / "multiprocess"
    run = {"callbacks": {"ChunkedCrossEntropy": {"chunk_bytes": "64KiB"}}, "steps": 3}
    proc = subprocess.run(
        [sys.executable, str(multiprocess / "fsdp_fit.py"), json.dumps(run), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=subprocess_timeout(600),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        row = rank["report"]["ChunkedCrossEntropy"]
        assert row["losses_from_chunks"] == 3 and row["full_logits_steps"] == 0, row
    _, _, plain = fit(None, data=interleaved_data(8), max_steps=3)
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(plain.losses), rtol=1e-5, atol=1e-5)


# the fit's strategy loads DeepSpeed's shm_comm: built by the session's fixture first (on a clean
# machine the one announced build, which test_zero_offload.py's build test observes)
@pytest.mark.deepspeed
def test_zero_stage_3_is_refused_stage_2_is_not(tmp_path) -> None:
    """ZeRO-3 holds a module's parameters only during its call; the loss uses the projection's
    weight after it (a real ZeRO-3 run fell back every step and its losses parted from the plain
    run's from step 2): refused when the fit starts. ZeRO-2 trains from chunks (a real run when
    this rule was written: losses equal to 1e-7)."""
    from lightning_efficient import ZeROOffload
    from lightning_efficient.core import compat

    stage3 = ZeROOffload(stage=3, offload_optimizer="cpu", offload_parameters=True)
    with pytest.raises(SettingsError, match="ChunkedCrossEntropy under ZeROOffload with stage 3"):
        fit(tmp_path, [ChunkedCrossEntropy()], strategy=stage3, max_steps=1)

    class Trainer:  # what the rule reads: the strategy
        strategy = ZeROOffload(stage=2, offload_optimizer="cpu")

    assert compat._parameters_after_call(Trainer(), [ChunkedCrossEntropy()]) is None


# -- memory: the instrument ------------------------------------------------------------------------------
def test_loss_phase_peak_is_several_times_lower_and_the_estimate_says_so() -> None:
    vocab, width, rows = 16384, 64, 2048
    torch.manual_seed(0)
    batch = (torch.randn(rows, width), torch.randint(0, vocab, (rows,)))
    sgd = "torch.optim.SGD"
    peaks = {}
    for chunks in (False, True):
        cbs = [ChunkedCrossEntropy(chunk_bytes="4MiB")] if chunks else []
        real = measure_step(LossHead(width, vocab), batch, sgd, loss_fn=logits_loss, callbacks=cbs)
        est = estimate_memory(
            LossHead(width, vocab), batch, optimizer=sgd, loss_fn=logits_loss, callbacks=cbs,
            device="cpu",
        )  # fmt: skip
        params = real.by_category["parameters"]
        assert est.peak_bytes == pytest.approx(real.peak_bytes, rel=0.02)
        peaks[chunks] = real.peak_bytes - params
    # the plain step holds the (rows, vocab) logits three times; the chunks hold the weight's
    # gradient (created in any step) and a few 4 MiB chunks
    assert peaks[False] / peaks[True] >= 4


def test_estimate_for_a_cuda_target_runs_the_chunks() -> None:
    with torch.device("meta"):
        model = tiny_model(vocab_size=8192, seq_len=256, n_layer=2, n_embd=64, dropout=0.0)
    batch = (torch.zeros(8, 256, dtype=torch.long, device="meta"),) * 2
    cb = ChunkedCrossEntropy(chunk_bytes="1MiB")  # 32 of the 2048 rows a chunk
    plain = estimate_memory(model, batch, precision="bf16-mixed", device="cuda")
    est = estimate_memory(model, batch, precision="bf16-mixed", device="cuda", callbacks=[cb])
    assert est.target == plain.target and est.reserved_bytes > 0
    assert est.by_category["workspaces"] == plain.by_category["workspaces"] > 0
    chunked, full = (e.peak_bytes - e.by_category["workspaces"] for e in (est, plain))
    assert chunked < 0.5 * full
    assert any("ChunkedCrossEntropy: cross-entropy from `head`" in n for n in est.notes)
    assert "forward" not in vars(model.head)  # the estimate put the projection back


# -- on a GPU (skipped without CUDA; not run on the machines these tests were written on) ------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_on_cuda_the_loss_phase_holds_less_and_equals_the_plain_run(backend: str) -> None:
    """GPT-2's width and vocabulary, 8192 rows, bf16 autocast on CUDA: loss and gradients within
    bf16 noise of the plain step, the allocator's peak of the loss phase at least 4x lower; the
    report names the backend ("auto": Liger or Cut Cross-Entropy where installed)."""
    from lightning_efficient.techniques.chunked_loss.backends import available_libraries

    vocab, width, rows = 50257, 768, 8192
    torch.manual_seed(0)
    h = torch.randn(rows, width, device="cuda")
    y = torch.randint(0, vocab, (rows,), device="cuda")
    y[:100] = -100

    def step(chunks: bool):
        torch.manual_seed(0)
        model = LossHead(width, vocab).cuda()
        change = apply_chunked_cross_entropy(model, backend=backend) if chunks else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = logits_loss(model, (h, y))
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        grads = [p.grad.float() for p in model.parameters()]
        return float(loss), grads, peak, change

    ref_loss, ref, ref_peak, _ = step(False)
    loss, grads, peak, change = step(True)
    assert abs(loss - ref_loss) <= 2**-7 * abs(ref_loss)
    assert _error(grads, ref) <= 2e-2
    assert ref_peak >= 4 * peak, (ref_peak, peak)
    ran = set(change.value.by_backend)
    if backend == "chunked" or not any(available_libraries().values()):
        assert ran == {"chunked"}
    else:
        assert ran <= {"liger", "cce"}, ran


# ChunkedCrossEntropy made reliable (issue 37, rows 1, 4, 12 and the out-of-range target): the
# plain step is the reference in every case.


def _tinygpt_one_layer() -> nn.Module:
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
    model = _tinygpt_one_layer()
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
    model = _tinygpt_one_layer()
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

    model = _tinygpt_one_layer()
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
