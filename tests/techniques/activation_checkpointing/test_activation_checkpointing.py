"""ActivationCheckpointing: block choice, equivalence (dropout included), memory via the instrument."""

from __future__ import annotations

import copy
import functools
import importlib
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import fit
from torch import nn

from benchmarks.workloads import tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.core.validate import SettingsError
from lightning_efficient.demos.tinygpt import Block
from lightning_efficient.functional import (
    apply_activation_checkpointing,
    blocks_for_budget,
    checkpointed_blocks,
)
from lightning_efficient.techniques.activation_checkpointing import (
    ActivationCheckpointing,
    remove_activation_checkpointing,
)
from lightning_efficient.techniques.compile import TorchCompile

FOUR = [f"blocks.{i}" for i in range(4)]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on a loaded 2-core machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpt(
    n_layer: int = 4, dropout: float = 0.0, seq_len: int = 32, n_embd: int = 32
) -> pl.LightningModule:
    torch.manual_seed(0)
    return tiny_model(n_layer=n_layer, dropout=dropout, seq_len=seq_len, n_embd=n_embd)


def batch_for(seq_len: int = 32, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_and_grads(model: nn.Module, batch, seed: int = 7) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


class ForwardCounter:
    """Counts forward calls of a module: a checkpointed block's layers run again in backward."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.handle = module.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.calls += 1


def calls_per_step(model: nn.Module, sub: nn.Module, batch) -> int:
    counter = ForwardCounter(sub)
    loss_and_grads(model, batch)
    counter.handle.remove()
    return counter.calls


# -- choosing the blocks -------------------------------------------------------------------
def test_auto_finds_tinygpt_blocks_and_recomputes_them() -> None:
    model, batch = gpt(), batch_for()
    assert calls_per_step(model, model.blocks[0].attn.qkv, batch) == 1
    assert apply_activation_checkpointing(model).value == FOUR
    assert checkpointed_blocks(model) == {n: "full" for n in FOUR}
    assert calls_per_step(model, model.blocks[0].attn.qkv, batch) == 2  # forward + recompute
    assert calls_per_step(model, model.head, batch) == 1  # outside the blocks: not recomputed


@pytest.mark.parametrize(
    "policy,expected",
    [
        (Block, FOUR),
        ("Block", FOUR),
        ("blocks.*", FOUR),  # the glob also matches sub-modules; the outermost are kept
        (r"re:blocks\.[13]", ["blocks.1", "blocks.3"]),
        (["blocks.0", r"re:blocks\.3"], ["blocks.0", "blocks.3"]),
        ("CausalSelfAttention", [f"blocks.{i}.attn" for i in range(4)]),
    ],
    ids=["class", "class-name", "glob", "regex", "list", "other-class"],
)
def test_policy_forms(policy, expected) -> None:
    model = gpt()
    assert apply_activation_checkpointing(model, policy).value == expected
    assert sorted(checkpointed_blocks(model)) == sorted(expected)


@pytest.mark.parametrize(
    "every_n,expected",
    [(2, ["blocks.0", "blocks.2"]), (3, ["blocks.0", "blocks.3"]), (5, ["blocks.0"])],
)
def test_every_n(every_n: int, expected: list[str]) -> None:
    model, batch = gpt(), batch_for()
    assert apply_activation_checkpointing(model, every_n=every_n).value == expected
    assert calls_per_step(model, model.blocks[1].attn.qkv, batch) == 1
    assert calls_per_step(model, model.blocks[0].attn.qkv, batch) == 2


HF_MODELS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False),
        "transformer.h",
        "GPT2Block",
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
            use_cache=False,
            attention_dropout=0.1,
        ),
        "model.layers",
        "LlamaDecoderLayer",
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=64,
        ),
        "bert.encoder.layer",
        "BertLayer",
    ),
}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_auto_on_transformers_models(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, cfg, prefix, block_cls = HF_MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).train()
    assert not model.is_gradient_checkpointing  # the model's own flag stays off
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # dropout is active (GPT-2 and BERT 0.1, Llama attention 0.1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach()), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    keys = list(model.state_dict())
    plain_loss, plain_grads = step()
    names = apply_activation_checkpointing(model).value
    assert names == [f"{prefix}.{i}" for i in range(3)]
    assert {type(model.get_submodule(n)).__name__ for n in names} == {block_cls}
    counter = ForwardCounter(
        model.get_submodule(names[1]).get_submodule(_first_leaf(model.get_submodule(names[1])))
    )
    loss, grads = step()
    assert counter.calls == 2  # really recomputed
    assert loss == plain_loss
    for n, g in plain_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=0, atol=0, msg=n)
    assert list(model.state_dict()) == keys and not model.is_gradient_checkpointing


def test_warns_when_the_model_checkpoints_itself(tmp_path) -> None:
    model = gpt(n_layer=2)
    model.blocks[0].gradient_checkpointing = True  # what transformers' layers carry when enabled
    with pytest.warns(UserWarning, match="own gradient checkpointing is on \\(blocks.0\\)"):
        fit(tmp_path, [ActivationCheckpointing()], model=model, max_steps=1, limit_val_batches=0)


def _first_leaf(block: nn.Module) -> str:
    return next(
        n for n, m in block.named_modules() if n and not list(m.children()) and list(m.parameters())
    )


# -- bad input ---------------------------------------------------------------------------------
def test_unmatched_pattern_names_it_and_lists_candidates() -> None:
    model = gpt()
    for policy in ("TransformerLayer", "layers.*", "re:h\\.[0-9]+"):
        with pytest.raises(ValueError) as info:
            apply_activation_checkpointing(model, policy)
        msg = str(info.value)
        assert repr(policy) in msg and "Block" in msg and "blocks.0" in msg
    assert checkpointed_blocks(model) == {}


@pytest.mark.parametrize(
    "kwargs,error,arg",
    [
        (dict(policy=3), TypeError, "policy"),
        (dict(policy="re:(x"), ValueError, "policy"),
        (dict(policy=[]), ValueError, "policy"),
        (dict(every_n=0), ValueError, "every_n"),
        (dict(every_n="2"), TypeError, "every_n"),
        (dict(selective=1), TypeError, "selective"),
        (dict(offload_activations="no"), TypeError, "offload_activations"),
    ],
)
def test_bad_arguments(kwargs, error, arg) -> None:
    with pytest.raises(error, match=f"`{arg}`"):
        apply_activation_checkpointing(gpt(n_layer=2), **kwargs)
    with pytest.raises(error, match=f"`{arg}`"):
        ActivationCheckpointing(**kwargs)


def test_callback_unmatched_pattern_fails_when_fit_starts(tmp_path) -> None:
    with pytest.raises(ValueError, match="'decoder.layers.\\*'.*Candidate block classes: Block"):
        fit(tmp_path, [ActivationCheckpointing(policy="decoder.layers.*")], max_steps=1)


# -- in place, removable, idempotent, copyable -------------------------------------------------
def test_in_place_idempotent_removable_and_copyable() -> None:
    model, batch = gpt(), batch_for()
    keys, ids = list(model.state_dict()), [id(b) for b in model.blocks]
    apply_activation_checkpointing(model)
    apply_activation_checkpointing(model)  # again: not nested (would recompute twice)
    assert calls_per_step(model, model.blocks[2].attn.qkv, batch) == 2
    assert list(model.state_dict()) == keys and [id(b) for b in model.blocks] == ids
    every_2 = apply_activation_checkpointing(model, every_n=2)  # replaces
    assert every_2.value == ["blocks.0", "blocks.2"]
    assert checkpointed_blocks(model) == {"blocks.0": "full", "blocks.2": "full"}
    apply_activation_checkpointing(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert checkpointed_blocks(clone) == checkpointed_blocks(model)
        assert clone.blocks[1].forward.module is clone.blocks[1]  # bound to the copy, not to model
        assert calls_per_step(clone, clone.blocks[1].attn.qkv, batch) == 2
        assert calls_per_step(model, model.blocks[1].attn.qkv, batch) == 2
    assert remove_activation_checkpointing(model) == FOUR
    assert checkpointed_blocks(model) == {} and all(
        "forward" not in b.__dict__ for b in model.blocks
    )
    assert calls_per_step(model, model.blocks[1].attn.qkv, batch) == 1


def test_the_change_says_what_it_did_and_undoes_it() -> None:
    model, batch = gpt(), batch_for()
    with apply_activation_checkpointing(model, every_n=2) as outer:
        assert outer.what == "full checkpointing of 2/4 blocks (Block: blocks.0 .. blocks.2)"
        assert outer.figures == {"blocks_wrapped": 2}
        inner = apply_activation_checkpointing(model, selective=True, num_blocks=1)
        assert checkpointed_blocks(model) == {"blocks.0": "selective"}
        inner.undo()  # back to what the model had: the outer change's blocks
        assert checkpointed_blocks(model) == {"blocks.0": "full", "blocks.2": "full"}
        inner.undo()  # once only: the outer change stays
        assert checkpointed_blocks(model) == {"blocks.0": "full", "blocks.2": "full"}
    assert outer.undone and checkpointed_blocks(model) == {}
    assert all("forward" not in vars(b) for b in model.blocks)
    assert calls_per_step(model, model.blocks[0].attn.qkv, batch) == 1


def test_layered_with_another_forward_wrapper() -> None:
    """Another technique may shadow ``forward`` on top of ours (a compiled forward) or below."""
    model, batch = gpt(), batch_for()
    block = model.blocks[1]
    below = block.forward  # the class forward, bound
    object.__setattr__(block, "forward", lambda *a, **k: below(*a, **k))  # a foreign wrapper, below
    foreign = block.forward
    apply_activation_checkpointing(model)
    assert block.forward.inner is foreign and calls_per_step(model, block.attn.qkv, batch) == 2
    remove_activation_checkpointing(model)
    assert block.forward is foreign  # the foreign wrapper is restored, not dropped
    apply_activation_checkpointing(model)
    ours = block.forward
    object.__setattr__(block, "forward", lambda *a, **k: ours(*a, **k))  # foreign, on top of ours
    assert calls_per_step(model, block.attn.qkv, batch) == 2
    remove_activation_checkpointing(model)  # ours is under the foreign one: it passes through
    assert checkpointed_blocks(model) == {} and calls_per_step(model, block.attn.qkv, batch) == 1
    apply_activation_checkpointing(model)  # the stale one stays a pass-through: no double recompute
    assert calls_per_step(model, block.attn.qkv, batch) == 2


# -- same maths --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(selective=True), dict(every_n=2, offload_activations=True)],
    ids=["full", "selective", "every2-offload"],
)
def test_same_loss_and_gradients_with_dropout(kwargs) -> None:
    model, batch = gpt(dropout=0.2), batch_for()
    plain_loss, plain_grads = loss_and_grads(model, batch)
    other_seed_loss, _ = loss_and_grads(model, batch, seed=8)
    assert other_seed_loss != plain_loss  # dropout is live: the test can fail
    apply_activation_checkpointing(model, **kwargs)
    loss, grads = loss_and_grads(model, batch)
    assert loss == plain_loss
    for n, g in plain_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=0, atol=0, msg=n)


def test_fit_with_dropout_matches_plain_run(tmp_path) -> None:
    kw = dict(max_steps=3, limit_val_batches=0)
    _, plain_model, plain = fit(tmp_path / "p", model=gpt(n_layer=2, dropout=0.1), **kw)
    cb = ActivationCheckpointing(selective=True)
    trainer, model, tech = fit(tmp_path / "t", [cb], model=gpt(n_layer=2, dropout=0.1), **kw)
    assert tech.losses == plain.losses
    for (n, a), b in zip(plain_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    assert cb.wrapped == ["blocks.0", "blocks.1"]
    entry = report_for(trainer)["ActivationCheckpointing"]
    assert (
        entry.figures["blocks_wrapped"] == 2
        and "selective checkpointing of 2/2 blocks" in entry.change
    )
    assert checkpointed_blocks(model) == {}  # unwrapped at teardown


def test_bf16_mixed_same_losses(tmp_path) -> None:
    kw = dict(max_steps=2, limit_val_batches=0, precision="bf16-mixed")
    _, _, plain = fit(tmp_path / "p", model=gpt(n_layer=2), **kw)
    _, _, tech = fit(tmp_path / "t", [ActivationCheckpointing()], model=gpt(n_layer=2), **kw)
    assert tech.losses == plain.losses


class LateLayers(pl.LightningModule):
    """Builds its layers in ``configure_model`` (after callback ``setup``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.ModuleList | None = None
        self.calls = 0

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
            self.layers[0][0].register_forward_hook(self._count)

    def _count(self, module, args, out) -> None:
        if type(out).__name__ != "FakeTensor":  # auto's measuring runs the model on fake tensors
            self.calls += 1

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4
        )


def test_layers_built_in_configure_model_are_checkpointed(tmp_path) -> None:
    model = LateLayers()
    cb = ActivationCheckpointing()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    assert cb.wrapped == ["layers.0", "layers.1", "layers.2"]
    assert checkpointed_blocks(model) == {}  # unwrapped at teardown
    assert model.calls == 4  # 2 steps x (forward + recompute)
    assert "checkpointing of 3/3 blocks" in report_for(trainer)["ActivationCheckpointing"].change


def test_offload_on_cpu_is_a_noop_with_one_note(tmp_path, caplog) -> None:
    cb = ActivationCheckpointing(every_n=2, offload_activations=True)
    with caplog.at_level("INFO"):
        trainer, _, tech = fit(
            tmp_path, [cb], model=gpt(n_layer=2), max_steps=2, limit_val_batches=0
        )
    notes = [r.getMessage() for r in caplog.records if "offload_activations" in r.getMessage()]
    assert len(notes) == 1 and "CPU" in notes[0]
    change = report_for(trainer)["ActivationCheckpointing"].change
    assert "1/2 blocks" in change and "saved activations of 1 other blocks offloaded" in change
    model = gpt(n_layer=2)
    apply_activation_checkpointing(model, every_n=2, offload_activations=True)
    assert checkpointed_blocks(model) == {"blocks.0": "full", "blocks.1": "offload"}
    est = _estimate(
        gpt(n_layer=2),
        batch_for(),
        callbacks=[ActivationCheckpointing(every_n=2, offload_activations=True)],
    )
    assert any("not modelled by the estimate" in n for n in est.notes)


@pytest.mark.gpu
def test_offload_on_cuda_moves_activations_to_host_and_keeps_maths() -> None:
    model, batch = gpt(dropout=0.0, n_layer=4).cuda(), tuple(t.cuda() for t in batch_for())
    plain_loss, plain_grads = loss_and_grads(model, batch)
    torch.cuda.synchronize()
    apply_activation_checkpointing(model, policy=r"re:blocks\.0", offload_activations=True)
    loss, grads = loss_and_grads(model, batch)
    assert abs(loss - plain_loss) < 1e-5
    for n, g in plain_grads.items():
        torch.testing.assert_close(grads[n], g, msg=n)


# -- memory, via the instrument ---------------------------------------------------------------
def _estimate(model, batch, **kw):
    from lightning_efficient.measure.memory.estimate import estimate_memory

    return estimate_memory(model, batch, **kw)


@functools.cache
def _plain_peak() -> int:
    """The estimated peak of the plain ``gpt(n_layer=4)`` on ``batch_for()``: deterministic, so
    estimated once for the budget tests that start from it."""
    return _estimate(gpt(n_layer=4), batch_for()).peak_bytes


def test_auto_halves_activation_memory_and_estimate_matches_tracking() -> None:
    from lightning_efficient.measure.memory.track import measure_step

    model, batch = gpt(n_layer=4, seq_len=64, n_embd=64), batch_for(seq_len=64, batch=8)
    plain = _estimate(model, batch)
    est = _estimate(model, batch, callbacks=[ActivationCheckpointing()])
    assert checkpointed_blocks(model) == {}  # the estimate undid its change
    a_plain, a_ckpt = plain.by_category["activations"], est.by_category["activations"]
    assert a_ckpt <= 0.5 * a_plain, (a_plain, a_ckpt)
    assert est.peak_bytes < plain.peak_bytes
    assert any("checkpointing of 4/4 blocks" in n for n in est.notes)
    real = measure_step(
        gpt(n_layer=4, seq_len=64, n_embd=64), batch, "adamw", callbacks=[ActivationCheckpointing()]
    )
    real_plain = measure_step(gpt(n_layer=4, seq_len=64, n_embd=64), batch, "adamw")
    for e, r in ((est, real), (plain, real_plain)):
        assert abs(e.peak_bytes - r.peak_bytes) <= 0.02 * r.peak_bytes, (e, r)
        assert (
            abs(e.by_category["activations"] - r.by_category["activations"]) <= 0.02 * r.peak_bytes
        )


def test_bf16_mixed_estimate_saves_too() -> None:
    model, batch = gpt(n_layer=4), batch_for()
    plain = _estimate(model, batch, precision="bf16-mixed")
    est = _estimate(model, batch, precision="bf16-mixed", callbacks=[ActivationCheckpointing()])
    assert est.by_category["activations"] <= 0.5 * plain.by_category["activations"]


@pytest.mark.slow
def test_budget_picks_fewest_blocks() -> None:
    # with transformers' mask utilities imported (by any earlier test in this process), the
    # estimate's mask checks must not read values of the already-fake batch of the search
    importlib.util.find_spec("transformers") and importlib.import_module(
        "transformers.masking_utils"
    )
    model, batch = gpt(n_layer=4), batch_for()
    peaks = {0: _plain_peak()}
    for k in (1, 2, 4):  # the peaks the search visits
        apply_activation_checkpointing(model, num_blocks=k)
        peaks[k] = _estimate(model, batch).peak_bytes
        remove_activation_checkpointing(model)
    assert peaks[4] < peaks[2] < peaks[0]
    budget = (peaks[1] + peaks[2]) // 2  # 2 blocks fit, 1 does not
    choice = blocks_for_budget(model, batch, budget)
    assert choice.num_blocks == 2 and choice.total == 4
    assert (
        choice.peak_bytes == peaks[2] <= budget < peaks[1] and choice.plain_peak_bytes == peaks[0]
    )
    assert sorted(choice.peaks) == [0, 1, 2, 4]  # a binary search, not a sweep
    assert checkpointed_blocks(model) == {}
    fits = blocks_for_budget(model, batch, peaks[0])
    assert fits.num_blocks == 0 and list(fits.peaks) == [0]  # the plain run fits: one estimate
    # the callback's estimate runs the same search and shows its result
    est = _estimate(model, batch, callbacks=[ActivationCheckpointing(budget=budget)])
    assert est.peak_bytes == peaks[2] and any("2/4 blocks" in n for n in est.notes)
    with pytest.raises(ValueError, match="smallest achievable peak") as info:
        blocks_for_budget(model, batch, peaks[4] - 1)
    assert str(peaks[4]) in str(info.value) and "`budget`" in str(info.value)


def test_a_budget_the_plain_run_meets_says_so(tmp_path) -> None:
    """Issue 33 item 10: 0 blocks needed was reported as "the model has no repeated blocks"."""
    model, batch = gpt(n_layer=4), batch_for()
    plain = _plain_peak()
    est = _estimate(model, batch, callbacks=[ActivationCheckpointing(budget=plain)])
    assert any("the plain run fits the budget" in n for n in est.notes), est.notes
    assert not any("no repeated blocks" in n for n in est.notes)
    cb = ActivationCheckpointing(budget=plain * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = fit(tmp_path, [cb], model=gpt(n_layer=4), max_steps=1, limit_val_batches=0)
    assert cb.choice.num_blocks == 0 and not any(
        "no repeated blocks" in str(w.message) for w in caught
    )
    assert "the plain peak" in report_for(trainer)["ActivationCheckpointing"].change


def test_budget_callback_in_fit(tmp_path) -> None:
    model, batch = gpt(n_layer=4), batch_for()
    full = _estimate(model, batch, callbacks=[ActivationCheckpointing()]).peak_bytes
    plain = _plain_peak()
    cb = ActivationCheckpointing(budget=(full + plain) // 2)
    trainer, _, tech = fit(tmp_path, [cb], model=gpt(n_layer=4), max_steps=2, limit_val_batches=0)
    assert 0 < cb.choice.num_blocks < 4 and cb.choice.peak_bytes <= cb.budget
    figures = report_for(trainer)["ActivationCheckpointing"].figures
    assert figures["blocks_wrapped"] == cb.choice.num_blocks
    assert figures["peak_after_bytes"] < figures["peak_before_bytes"]
    with pytest.raises(ValueError, match="smallest achievable peak"):
        fit(
            tmp_path / "x",
            [ActivationCheckpointing(budget=full // 2)],
            model=gpt(n_layer=4),
            max_steps=1,
        )


def test_budget_callback_with_8bit_optimizer_in_fit(tmp_path) -> None:
    """The planner's rung "adamw8bit + checkpoint fewest blocks": the budget search at the first
    batch estimates with the swapped optimizer modelled (bitsandbytes cannot step fake tensors)."""
    pytest.importorskip("bitsandbytes")
    from lightning_efficient.techniques.optimizers import OptimizerSwap

    # width 64: the matrices pass bitsandbytes' min_8bit_size, so the states are really 8-bit
    model, batch = gpt(n_layer=4, n_embd=64), batch_for()
    swap = [OptimizerSwap("adamw8bit")]
    full = _estimate(model, batch, callbacks=[*swap, ActivationCheckpointing()]).peak_bytes
    plain = _estimate(model, batch, callbacks=swap).peak_bytes
    cb = ActivationCheckpointing(budget=(full + plain) // 2)
    trainer, _, _ = fit(
        tmp_path,
        [OptimizerSwap("adamw8bit"), cb],
        model=gpt(n_layer=4, n_embd=64),
        max_steps=2,
        limit_val_batches=0,
    )
    assert trainer.global_step == 2
    assert 0 < cb.choice.num_blocks < 4 and cb.choice.peak_bytes <= cb.budget
    # the 8-bit states were estimated, not the AdamW states of the module's own optimizer (the
    # fit's two param groups change the optimizer temporaries by a few bytes)
    adamw = _estimate(model, batch).peak_bytes
    assert cb.choice.plain_peak_bytes == pytest.approx(plain, rel=0.01)
    assert cb.choice.plain_peak_bytes < 0.95 * adamw


# -- with TorchCompile, in both orders -----------------------------------------------------------
class _Seen(pl.Callback):
    """Records, during training, which blocks are checkpointed."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.blocks = checkpointed_blocks(pl_module)


@pytest.mark.parametrize("order", ["checkpoint-first", "compile-first"])
def test_with_torch_compile_both_orders(order: str, tmp_path) -> None:
    seen = _Seen()
    cbs = [ActivationCheckpointing(), TorchCompile(backend="aot_eager")]  # aot_eager: no C++ build
    if order == "compile-first":
        cbs.reverse()
    kw = dict(max_steps=2, limit_val_batches=0)
    _, _, plain = fit(tmp_path / "p", model=gpt(n_layer=2), **kw)
    _, model, tech = fit(tmp_path / "t", [*cbs, seen], model=gpt(n_layer=2), **kw)
    torch.testing.assert_close(
        torch.tensor(tech.losses), torch.tensor(plain.losses), rtol=1e-4, atol=1e-5
    )
    assert seen.blocks == {"blocks.0": "full", "blocks.1": "full"}
    assert set(model.state_dict()) == set(gpt(n_layer=2).state_dict())


# -- any model: BatchNorm, container arguments, leaf layers ----------------------------------------
class ConvBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """Conv2d + BatchNorm2d + ReLU blocks, plus a stem and a head."""

    def __init__(self, ch: int = 8, n: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(ch) for _ in range(n)])
        self.head = nn.Linear(ch, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _train_two_steps(model: nn.Module) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    grads: dict[str, torch.Tensor] = {}
    for _ in range(2):
        x = torch.randn(4, 3, 8, 8, generator=gen)
        y = torch.randint(0, 4, (4,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return grads


def test_batchnorm_statistics_update_once_per_forward() -> None:
    torch.manual_seed(0)
    plain = SmallCNN()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, ConvBlock).value == [
        f"blocks.{i}" for i in range(3)
    ]
    counter = ForwardCounter(ckpt.blocks[0].bn)
    grads_plain, grads_ckpt = _train_two_steps(plain), _train_two_steps(ckpt)
    assert counter.calls == 4  # 2 steps, each with a recompute in backward
    for n in grads_plain:
        torch.testing.assert_close(grads_ckpt[n], grads_plain[n], rtol=0, atol=0)
    for (n, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)  # weights and BN buffers
    assert int(ckpt.blocks[0].bn.num_batches_tracked) == 2
    assert ckpt.blocks[0].bn.momentum == 0.1  # restored after the recompute


class DenseLayer(nn.Module):
    """Takes the list of all earlier feature maps (torchvision DenseNet's calling convention)."""

    def __init__(self, in_ch: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(in_ch)
        self.conv = nn.Conv2d(in_ch, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(F.relu(self.bn(torch.cat(features, 1))))


class TinyDenseNet(nn.Module):
    def __init__(self, ch: int = 4, growth: int = 4, n: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.layers = nn.ModuleList(DenseLayer(ch + i * growth, growth) for i in range(n))
        self.head = nn.Linear(ch + n * growth, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))  # the list the layer saw grows after the call
        return self.head(torch.cat(features, 1).mean((2, 3)))


def test_list_argument_that_grows_after_the_call_trains() -> None:
    torch.manual_seed(0)
    plain = TinyDenseNet()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, "DenseLayer").value == [
        f"layers.{i}" for i in range(3)
    ]
    grads_plain, grads_ckpt = _train_two_steps(plain), _train_two_steps(ckpt)
    for n in grads_plain:
        torch.testing.assert_close(grads_ckpt[n], grads_plain[n], rtol=0, atol=0)
    for (n, a), (_, b) in zip(plain.state_dict().items(), ckpt.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


class Stage(nn.Module):
    """A VGG-like stage: its conv layers are its direct children."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)  # same shape as conv1: a "repeated" leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class TwoStageCNN(nn.Module):
    """Residual blocks at full resolution, then a wide low-resolution stage of bare convs."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(ConvBlock(4), ConvBlock(4))
        self.down = nn.Conv2d(4, 16, 2, stride=2)
        self.stage2 = Stage(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage2(self.down(self.stage1(x))).mean((1, 2, 3))


def test_auto_never_picks_leaf_layers() -> None:
    # before: stage2.conv1/conv2, two bare Conv2d (the sibling group with the most parameters)
    model = TwoStageCNN()
    names = apply_activation_checkpointing(model).value
    assert names == ["stage1.0", "stage1.1"]
    counter = ForwardCounter(model.stage1[0].conv)
    model(torch.randn(2, 4, 8, 8)).sum().backward()
    assert counter.calls == 2  # really recomputed
    assert (
        apply_activation_checkpointing(Stage(4)).value == []
    )  # only leaf layers repeat: no blocks
    with pytest.raises(ValueError, match="matches no module"):
        apply_activation_checkpointing(Stage(4), "ConvBlock")  # an explicit policy still raises


# -- issue 37 row 11: the decision costs the same at any accumulation ------------------------------
class _FakeForwards:
    """Counts the forwards of ``model`` that run on fake tensors (the estimate's)."""

    def __init__(self, model: nn.Module) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        self.count, self._fake = 0, FakeTensor
        self._handle = model.register_forward_pre_hook(self._seen)

    def _seen(self, module: nn.Module, args: tuple) -> None:
        self.count += any(isinstance(a, self._fake) for a in args)

    def remove(self) -> int:
        self._handle.remove()
        return self.count


def test_budget_search_estimates_two_micro_batches_at_any_accumulation() -> None:
    """Issue 37 row 11: every micro-batch of the window was estimated (166 s at 256). Two hold
    the window's peak: the same choice and peaks, and the whole window's estimate agrees."""
    model, batch = gpt(n_layer=2), batch_for()
    one = {"accumulate_grad_batches": 2, "steps": 1}
    full = _estimate(model, batch, callbacks=[ActivationCheckpointing()], **one).peak_bytes
    budget = (full + _estimate(model, batch, **one).peak_bytes) // 2
    counts, choices = {}, {}
    for accumulation in (2, 5):
        counter = _FakeForwards(model)
        choices[accumulation] = blocks_for_budget(
            model, batch, budget, accumulate_grad_batches=accumulation, steps=1
        )
        counts[accumulation] = counter.remove()
    assert counts[5] == counts[2] == 2 * len(choices[2].peaks) > 0
    assert choices[5] == choices[2] and choices[5].num_blocks == 1
    with apply_activation_checkpointing(model, num_blocks=1):  # the whole window's estimate
        whole = _estimate(model, batch, accumulate_grad_batches=5, steps=1).peak_bytes
    assert whole == choices[5].peak_bytes
    assert checkpointed_blocks(model) == {}


def test_budget_callback_cost_does_not_grow_with_accumulation(tmp_path) -> None:
    counts, choices = {}, {}
    for accumulation in (2, 8):
        model = gpt(n_layer=2)
        counter = _FakeForwards(model)
        real = _RealForwards(model)
        cb = ActivationCheckpointing(budget="64MiB")
        fit(
            tmp_path / str(accumulation),
            [cb],
            model=model,
            max_steps=1,
            limit_val_batches=0,
            accumulate_grad_batches=accumulation,
        )
        counts[accumulation], choices[accumulation] = counter.remove(), cb.choice
        assert real.remove() == accumulation  # the fit itself ran the whole window
    assert counts[8] == counts[2] > 0
    assert choices[8] == choices[2]


class _RealForwards(_FakeForwards):
    def _seen(self, module: nn.Module, args: tuple) -> None:
        self.count += not any(isinstance(a, self._fake) for a in args)


class _FreezeAllButFinalNorm(pl.Callback):
    """A frozen backbone: only the final norm trains (the blocks' inputs need no gradient)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name, p in pl_module.named_parameters():
            p.requires_grad_(name.startswith("ln_f"))


def test_frozen_backbone_said_to_free_nothing(tmp_path) -> None:
    """Issue 49: "auto" on a model with one candidate group did not measure it; on a frozen
    backbone checkpointing frees 0 B, and that is said once, with the figure."""
    cb = ActivationCheckpointing()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer, _, _ = fit(tmp_path, [_FreezeAllButFinalNorm(), cb], max_steps=2)
    said = [str(w.message) for w in seen if issubclass(w.category, NoEffectWarning)]
    assert len(said) == 1 and "frees 0 B of" in said[0], said
    entry = report_for(trainer)["ActivationCheckpointing"]
    assert entry.figures["activations_saved_bytes"] == 0 and "frees 0 B" in entry.change


def test_an_unreachable_budget_is_a_short_error_with_the_smallest_peak(tmp_path) -> None:
    with pytest.raises(SettingsError, match="smallest achievable peak"):
        fit(tmp_path, [ActivationCheckpointing(budget="1KiB")], max_steps=1)
