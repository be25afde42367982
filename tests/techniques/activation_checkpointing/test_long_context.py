"""Long context (issue 53): tiled position-wise layers and checkpoint boundaries in host memory,
both options of ``ActivationCheckpointing``; their maths, their memory and the estimate of both."""

from __future__ import annotations

import copy
import itertools

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, params_of
from torch import nn

from benchmarks.workloads import tiny_model
from lightning_efficient import ActivationCheckpointing
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
)
from lightning_efficient.techniques.activation_checkpointing.tiling import (
    apply_tiling,
    check_tile,
    tiled_layers,
)

transformers = pytest.importorskip("transformers")
VOCAB = 101


# -- models -----------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x)).cumsum(-2)  # not position-wise: mixes the sequence
        return x + self.ff(self.norm(x))


class Plain(nn.Module):
    """A plain module (no Lightning, no transformers) whose blocks hold a feed-forward ``ff``."""

    def __init__(self, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _hf(kind: str) -> nn.Module:
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=88, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, **heads))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, **heads))
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Plain() if kind == "plain" else _hf(kind)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Plain):
        return model(ids, ids)
    return model(input_ids=ids, labels=ids).loss


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0.0)
    for name, grad in want[1].items():  # fp32, rtol 1e-6 (atol for entries near zero)
        torch.testing.assert_close(got[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


# -- tiled position-wise layers -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", "plain"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["tiled", "tiled+boundaries"])
def test_tile_sequence_loss_and_gradients_equal_the_untiled(kind: str, checkpointed: bool) -> None:
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (2, 70))
    plain = _loss_and_grads(model, ids)
    tiling = apply_tiling(model, "auto", 16)
    calls = []
    mlps = [n for n in tiling.value if n.endswith(("mlp", "ff"))]
    first = dict(model.named_modules())[mlps[0]]
    linear = next(
        m for m in first.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    )
    handle = linear.register_forward_hook(lambda *a: calls.append(1))
    ckpt = apply_activation_checkpointing(model, offload_boundaries=True) if checkpointed else None
    try:
        got = _loss_and_grads(model, ids)
    finally:
        handle.remove()
        if ckpt is not None:
            ckpt.undo()
        tiling.undo()
    assert len(mlps) == 2  # one MLP per block, and its norms
    assert len(tiling.value) == (4 if kind == "plain" else 6)
    # 70 tokens in tiles of 16: 5 tiles in the forward and 5 in backward (+5 in the recompute)
    assert len(calls) == (15 if checkpointed else 10)
    _assert_same(got, plain)
    assert tiled_layers(model) == {} and checkpointed_blocks(model) == {}
    assert all("forward" not in vars(m) for m in model.modules())  # undone


def test_tiles_are_chosen_by_the_sequence_length() -> None:
    model = _model("llama")  # hidden size 32: "auto" tiles of 32 tokens
    tiling = apply_tiling(model)
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.up_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape[-2]))
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 32)))
        assert calls == [32]  # as long as a tile: untiled
        calls.clear()
        model(input_ids=torch.randint(0, VOCAB, (1, 80)))
        assert calls == [32, 32, 16]
    tiling.undo()


def test_tiling_frees_the_wide_intermediates() -> None:
    """Without checkpointing, a tiled MLP keeps only its input for backward: the measured peak
    drops by about the MLP intermediates of every block (4x wide, 3 of them)."""
    model = Plain(width=32, layers=4)
    ids = torch.randint(0, VOCAB, (1, 512))
    plain = measure_step(copy.deepcopy(model), ids, loss_fn=_loss, steps=1)
    tiling = apply_tiling(model, "auto", 64)
    tiled = measure_step(model, ids, loss_fn=_loss, steps=1)
    tiling.undo()
    intermediates = (
        4 * 3 * 512 * 4 * 32 * 4
    )  # layers x (fc out, gelu out, ...) x tokens x 4w x fp32
    saved = plain.peak_bytes - tiled.peak_bytes
    assert saved > 0.6 * intermediates, (plain, tiled)


def test_bad_tile_values() -> None:
    assert check_tile(False) is None and check_tile(True) == "auto" and check_tile(8) == 8
    for bad in (0, -3, "many", 2.5):
        with pytest.raises(ValueError, match="tile_sequence"):
            ActivationCheckpointing(tile_sequence=bad)
    with pytest.raises(TypeError, match="offload_boundaries"):
        ActivationCheckpointing(offload_boundaries="yes")


# -- checkpoint boundaries in host memory ------------------------------------------------------------
def test_boundaries_move_to_host_and_count_as_host_bytes() -> None:
    """The inputs of the 4 checkpointed blocks (4 x 512 x 32 fp32) leave the device: the tracker
    counts them as host bytes, and the activations on the device drop by as much."""
    model = Plain(width=32, layers=4)
    ids = torch.randint(0, VOCAB, (1, 512))
    ckpt = apply_activation_checkpointing(model, offload_boundaries=False)
    kept = measure_step(copy.deepcopy(model), ids, loss_fn=_loss, steps=1)
    ckpt.undo()
    ckpt = apply_activation_checkpointing(model, offload_boundaries=True)
    assert set(checkpointed_blocks(model).values()) == {"full+host"}
    moved = measure_step(model, ids, loss_fn=_loss, steps=1)
    ckpt.undo()
    boundary = 512 * 32 * 4
    assert moved.host_bytes == 4 * boundary
    assert kept.host_bytes == 0
    drop = kept.phase_peaks["forward"] - moved.phase_peaks["forward"]
    assert drop >= 3 * boundary  # the last block's output is kept by the head either way


def test_fit_with_boundaries_equals_the_plain_fit(tmp_path) -> None:
    """Boundaries in host memory change no number: the weights after 4 steps are the plain
    fit's, bit for bit; with tiled MLPs too the losses agree to 1e-6 and the weights to 1e-5
    (AdamW divides by the root of the squared gradient, so last-bit differences of the summed
    tile gradients of near-zero gradients show in the update)."""
    _, plain, losses = fit(tmp_path / "a", max_steps=4)
    cb = ActivationCheckpointing("Block", offload_boundaries=True)
    _, model, got = fit(tmp_path / "b", [cb], max_steps=4)
    assert cb.wrapped == ["blocks.0", "blocks.1"]
    assert got.losses == losses.losses
    for name, value in params_of(plain).items():
        assert torch.equal(params_of(model)[name], value), name
    assert all("forward" not in vars(m) for m in model.modules())  # undone after the fit
    cb = ActivationCheckpointing("Block", offload_boundaries=True, tile_sequence=8)
    _, model, got = fit(tmp_path / "c", [cb], max_steps=4)
    assert cb.tiled == [f"blocks.{i}.{n}" for i in (0, 1) for n in ("ln1", "ln2", "mlp")]
    assert got.losses == pytest.approx(losses.losses, rel=1e-6)
    for name, value in params_of(plain).items():
        torch.testing.assert_close(params_of(model)[name], value, rtol=0, atol=1e-5, msg=name)
    assert all("forward" not in vars(m) for m in model.modules())


# -- the estimate models both --------------------------------------------------------------------
@pytest.mark.parametrize(
    "boundaries,tile,precision",
    list(itertools.product([False, True], [False, 32], ["32-true", "bf16-mixed"])),
)
def test_estimate_within_two_percent_of_the_measured_peak(boundaries, tile, precision) -> None:
    model = tiny_model(seq_len=256, n_layer=3, n_embd=64)
    x = torch.randint(0, 64, (2, 257))
    batch = (x[:, :-1], x[:, 1:])

    def callbacks() -> list:
        return [ActivationCheckpointing("Block", offload_boundaries=boundaries, tile_sequence=tile)]

    est = estimate_memory(model, batch, callbacks=callbacks(), precision=precision, device="cpu")
    real = measure_step(copy.deepcopy(model), batch, callbacks=callbacks(), precision=precision)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    assert est.host_bytes == real.host_bytes == (3 * 2 * 256 * 64 * 4 if boundaries else 0)
    assert all("forward" not in vars(m) for m in model.modules())  # the estimate left nothing


def test_estimate_for_cuda_counts_pinned_host_bytes() -> None:
    """On a CUDA target the host copies are pinned, which CUDA's host allocator rounds up to a
    power of two; they are not on the device (nor in the allocator's replay)."""
    model = tiny_model(seq_len=96, n_layer=2, n_embd=48)
    x = torch.randint(0, 64, (1, 97))
    cb = ActivationCheckpointing("Block", offload_boundaries=True, tile_sequence=True)
    est = estimate_memory(model, (x[:, :-1], x[:, 1:]), callbacks=[cb], device="cuda:h100")
    assert est.host_bytes == 2 * 32768  # 96 x 48 fp32 = 18,432 bytes -> 32 KiB each
    plain = estimate_memory(
        model, (x[:, :-1], x[:, 1:]), callbacks=[ActivationCheckpointing("Block")], device="cuda"
    )
    assert plain.host_bytes == 0


# -- the planner's long-context rung and the host budget ---------------------------------------------
SEQ = 1024  # a sequence at which the checkpointed blocks' inputs and the MLP's intermediates rule


def _long_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_planner_takes_the_long_context_rung_within_the_host_budget() -> None:
    """A tiny Llama at 1,024 tokens, 8 MiB (fp32, SGD): checkpointing every block needs ~10 MiB;
    the long-context rung (boundaries in host memory, tiled MLPs) fits with 2 blocks' inputs
    (2 x 1,024 x 64 fp32 = 512 KiB) in host memory. With 256 KiB of host memory it is not
    chosen, and its row says why."""
    from lightning_efficient.planning import plan_stack
    from lightning_efficient.planning.ladder import LONG_CONTEXT, ladder_options

    model, ids = _long_llama(), torch.randint(0, 128, (1, SEQ))
    assert ladder_options(model)["long_context"]
    assert not ladder_options(nn.Linear(4, 4))["long_context"]  # no blocks: no rung
    kwargs = dict(device="cpu", loss_fn=_loss, optimizer="sgd", bf16=False)
    plan = plan_stack(model, ids, "8MiB", host_budget="1GiB", **kwargs)
    assert plan.chosen is not None and LONG_CONTEXT in plan.chosen.callbacks, plan.to_markdown()
    est = plan.estimate_of(plan.chosen)
    assert est.fits(plan.budget_bytes) and est.host_bytes == 2 * SEQ * 64 * 4
    rows = {row[0]: row for row in plan.rows()}
    assert rows[plan.chosen.name][2] == "512.00 KiB"  # the host bytes in the table
    assert rows["32-true + checkpoint all blocks"][3] == "over budget"
    assert "host memory 1.00 GiB" in plan.to_markdown()
    short = plan_stack(model, ids, "8MiB", host_budget="256KiB", **kwargs)
    assert short.chosen is None
    assert dict((r.name, why) for r, _, why in short.tried)[plan.chosen.name] == (
        "needs 512.00 KiB of host memory, 256.00 KiB available"
    )
    assert all("forward" not in vars(m) for m in model.modules())  # the plan left nothing


def test_long_context_rung_extends_checkpointing_every_block() -> None:
    """It is passed over where it saves nothing: it extends the rung checkpointing every block
    (and, with 4-bit frozen weights, that rung), so the search compares their estimates."""
    from lightning_efficient.planning.ladder import LONG_CONTEXT, default_ladder, extended_by

    rungs = default_ladder(long_context=True, frozen_4bit=True, optimizer="sgd")
    by_name = {r.name: r for r in rungs}
    long = [r for r in rungs if LONG_CONTEXT in r.callbacks]
    assert [r.name for r in long] == [
        "bf16-mixed + checkpoint all blocks, boundaries on host + tiled",
        "bf16-mixed + 4-bit frozen weights + checkpoint all blocks, boundaries on host + tiled",
    ]
    assert by_name["bf16-mixed + checkpoint all blocks"] in extended_by(long[0], rungs)
    four = by_name["bf16-mixed + 4-bit frozen weights + checkpoint all blocks"]
    assert four in extended_by(long[1], rungs)
    assert not default_ladder(long_context=True, world_size=2)[-1].callbacks.count(LONG_CONTEXT)
    assert not any(LONG_CONTEXT in r.callbacks for r in default_ladder())


class _LlamaModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _long_llama()
        self.batch_size = 1

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return _loss(self.model, batch)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        torch.manual_seed(1)
        data = torch.randint(0, 128, (4, SEQ))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_auto_efficient_applies_the_long_context_rung_and_fits_as_the_plain_fit(tmp_path) -> None:
    """AutoEfficient at 8 MiB takes the long-context rung (its host bytes in the decision and the
    report); two steps leave the weights of the plain fit (tiles sum the gradients: 1e-5)."""
    from lightning_efficient import AutoEfficient
    from lightning_efficient.core.report import report_for
    from lightning_efficient.planning.ladder import LONG_CONTEXT

    def run(callbacks: list) -> tuple[pl.Trainer, nn.Module]:
        pl.seed_everything(0, verbose=False)
        module = _LlamaModule()
        trainer = pl.Trainer(
            default_root_dir=tmp_path, accelerator="cpu", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module)
        return trainer, module

    _, plain = run([])
    auto = AutoEfficient(budget="8MiB", goal="memory", host_budget="1GiB")
    trainer, module = run([auto])
    d = auto.decision
    assert LONG_CONTEXT in d.rung.callbacks and d.micro == 1, d.tried
    assert d.host_bytes == 2 * SEQ * 64 * 4 and "host 512.00 KiB" in d.summary()
    assert report_for(trainer)["AutoEfficient"].figures["host_bytes"] == d.host_bytes
    for name, value in params_of(plain).items():
        torch.testing.assert_close(params_of(module)[name], value, rtol=0, atol=1e-5, msg=name)
    assert all("forward" not in vars(m) for m in module.modules())  # undone after the fit
    with pytest.raises(ValueError, match="host_budget"):
        AutoEfficient(budget="8MiB", host_budget="lots")
