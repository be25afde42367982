"""FrozenWeights4bit: frozen linear weights in 4 bits on adapters (PEFT LoRA on Llama and Qwen2,
LitGPT LoRA), its exact undo, its estimate, its refusal, checkpoints and resume; training without
the key/value cache; 8-bit AdamW on LoRA says it saves nothing."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import SaveAt, tiny_trainer
from torch import nn

from lightning_efficient import estimate_memory
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.core.validate import SettingsError
from lightning_efficient.functional import (
    apply_frozen_weights_4bit,
    apply_training_without_cache,
)
from lightning_efficient.measure.memory.kv_cache import training_caches
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.planning import fit as auto_fit
from lightning_efficient.planning.ladder import FROZEN_4BIT, Rung
from lightning_efficient.planning.search import decide
from lightning_efficient.techniques.quantize import FrozenWeights4bit, linear_weight_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, SEQ = 256, 32
_SMALL = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
)


def _peft(config_cls: Any, model_cls: Any) -> nn.Module:
    torch.manual_seed(0)
    base = model_cls(config_cls(**_SMALL))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def _litgpt() -> nn.Module:
    lora = pytest.importorskip("litgpt.lora")
    torch.manual_seed(0)
    cfg = lora.Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=V + 64, padded_vocab_size=V + 64, block_size=SEQ,
        lora_r=4, lora_alpha=8, lora_query=True, lora_key=True, lora_value=True,
        lora_projection=True, lora_mlp=True,
    )  # fmt: skip
    model = lora.GPT(cfg)
    lora.mark_only_lora_as_trainable(model)
    return model


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())


FAMILIES = {
    # builder, loss, frozen base projections (layers x projections)
    "llama": (lambda: _peft(transformers.LlamaConfig, transformers.LlamaForCausalLM), _hf_loss, 14),
    "qwen2": (lambda: _peft(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), _hf_loss, 14),
    "litgpt": (_litgpt, _gpt_loss, 8),
}


def _batch() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (2, SEQ), generator=g),)


def _train(model: nn.Module, loss_fn: Any, steps: int) -> list[float]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    batch, losses = _batch(), []
    for _ in range(steps):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_4bit_on_adapters_saves_trains_and_undoes_exactly(family: str) -> None:
    build, loss_fn, count = FAMILIES[family]
    plain_losses = _train(build(), loss_fn, 20)
    model = build()
    given = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    storages = {n: p.data.data_ptr() for n, p in frozen.items()}
    start = _adapters(model)
    change = apply_frozen_weights_4bit(model)
    chosen = change.value.chosen
    # every frozen base projection of the blocks, never an adapter or the head
    assert len(chosen) == count and not any("lora" in n or "head" in n for n in chosen)
    bf16 = sum(dict(model.named_modules())[n].weight_4bit_absmax.numel() * 64 * 2 for n in chosen)
    assert linear_weight_bytes(model, chosen) <= 0.3 * bf16
    assert set(model.state_dict()) == set(given)  # keys (and values: the originals) kept
    losses = _train(model, loss_fn, 20)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=0.02, atol=0)
    assert losses[-1] < 0.9 * losses[0]  # the adapters learned
    moved = _adapters(model)
    assert all(not torch.equal(moved[n], start[n]) for n in moved if "lora_B" in n)
    change.undo()
    after = model.state_dict()
    for key, value in given.items():
        if not any("lora" in part for part in key.split(".")):
            assert torch.equal(after[key], value), key  # bit-exact original weights
    assert {n: p.data.data_ptr() for n, p in frozen.items()} == storages  # the same storage
    assert not any("weight_4bit" in n for n, _ in model.named_buffers())


@pytest.mark.parametrize("family", ["llama", "litgpt"])
def test_estimate_within_2_percent_of_measured_peak(family: str) -> None:
    build, loss_fn, count = FAMILIES[family]
    model, batch = build(), _batch()
    measured_model = copy.deepcopy(model)
    est = estimate_memory(
        model, batch, loss_fn=loss_fn, callbacks=[FrozenWeights4bit()], device="cpu"
    )
    measured = measure_step(measured_model, batch, loss_fn=loss_fn, callbacks=[FrozenWeights4bit()])
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    assert est.by_category["parameters"] < 0.6 * fp32  # the frozen projections in 4 bits
    assert any(f"FrozenWeights4bit: {count} frozen linear weights" in n for n in est.notes)


def test_refuses_a_trainable_weight() -> None:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))  # all trainable
    name = "model.layers.0.mlp.up_proj"
    with pytest.raises(SettingsError, match=r"model\.layers\.0\.mlp\.up_proj.*require grad"):
        apply_frozen_weights_4bit(model, modules=[name])
    assert not any("weight_4bit" in n for n, _ in model.named_buffers())
    # unnamed trainable layers are simply left as they are
    change = apply_frozen_weights_4bit(model)
    assert change.figures["layers_4bit"] == 0 and change.value.left[name] == "trainable"


def test_bad_arguments_name_themselves() -> None:
    for kwargs, arg in (
        ({"quant_type": "int4"}, "quant_type"),
        ({"blocksize": 100}, "blocksize"),
        ({"modules": [3]}, "modules"),
        ({"skip": "lm_head"}, None),  # a single pattern is accepted
    ):
        if arg is None:
            assert FrozenWeights4bit(**kwargs).skip == ["lm_head"]
            continue
        with pytest.raises((ValueError, TypeError), match=arg):
            FrozenWeights4bit(**kwargs)


def test_state_dict_holds_the_originals_and_loading_requantizes() -> None:
    model = _peft(transformers.LlamaConfig, transformers.LlamaForCausalLM)
    given = {k: v.clone() for k, v in model.state_dict().items()}
    change = apply_frozen_weights_4bit(model)
    q = dict(model.named_modules())[change.value.chosen[0]]
    packed = q.weight.detach().clone()
    assert q.weight.dtype == torch.uint8 and all(
        torch.equal(v, given[k]) for k, v in model.state_dict().items()
    )
    other = {
        k: v.flip(0) if k.endswith("q_proj.base_layer.weight") else v for k, v in given.items()
    }
    model.load_state_dict(other, strict=True)  # re-quantized from the full weights loaded
    assert not torch.equal(q.weight, packed)
    model.load_state_dict(given, strict=True)
    assert torch.equal(q.weight, packed)
    change.undo()
    assert all(torch.equal(v, given[k]) for k, v in model.state_dict().items())


# -- in a fit: checkpoint, resume, the undo after fit ------------------------------------------------
class _LoRAModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _peft(transformers.LlamaConfig, transformers.LlamaForCausalLM)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _loader() -> Any:
    ids = torch.randint(0, V, (8, SEQ), generator=torch.Generator().manual_seed(2))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def _fit(tmp_path: Any, steps: int, *, ckpt: str | None = None, callbacks: Any = ()) -> Any:
    pl.seed_everything(0, verbose=False)
    module = _LoRAModule()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[FrozenWeights4bit(), *callbacks], limit_train_batches=2,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=_loader(), ckpt_path=ckpt)
    return trainer, module


def test_checkpoint_saves_originals_and_resume_continues(tmp_path) -> None:
    from helpers import SaveAt

    given = _LoRAModule().state_dict()
    path = tmp_path / "k.ckpt"
    save = SaveAt(2, path, snapshot=lambda t: copy.deepcopy(t.lightning_module.state_dict()))
    full, full_module = _fit(tmp_path / "full", 4, callbacks=[save])
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert set(saved) == set(given)
    frozen = [k for k in given if "lora" not in k]
    assert all(torch.equal(saved[k], given[k]) for k in frozen)  # the original weights
    _LoRAModule().load_state_dict(saved, strict=True)  # loads without the technique
    assert all(torch.equal(full_module.state_dict()[k], given[k]) for k in frozen)  # undone
    resumed, resumed_module = _fit(tmp_path / "resumed", 4, ckpt=str(path))
    assert resumed.global_step == full.global_step == 4
    lora = [k for k in given if "lora_B" in k]
    assert any(not torch.equal(full_module.state_dict()[k], save.snapshot[k]) for k in lora)
    for k in lora:
        torch.testing.assert_close(resumed_module.state_dict()[k], full_module.state_dict()[k])


def test_no_effect_on_an_all_trainable_module(tmp_path) -> None:
    class Plain(_LoRAModule):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[FrozenWeights4bit()],
    )  # fmt: skip
    with pytest.warns(NoEffectWarning, match="trainable"):
        trainer.fit(Plain(), train_dataloaders=_loader())


# -- the key/value cache --------------------------------------------------------------------------
def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    assert cfg.use_cache is True  # the default config
    return transformers.GPT2LMHeadModel(cfg)


def test_training_without_cache_keeps_it_for_eval() -> None:
    model, (ids,) = _gpt2(), _batch()
    assert training_caches(model) == ["GPT2LMHeadModel"]
    assert model(ids).past_key_values is not None  # what a training forward builds by default
    change = apply_training_without_cache(model)
    assert training_caches(model) == [] and model.config.use_cache is True
    assert model(ids).past_key_values is None
    assert model(ids, use_cache=True).past_key_values is not None  # asked for explicitly
    model.eval()
    with torch.no_grad():
        assert model(ids).past_key_values is not None  # validation / generation keep theirs
    model.train()
    change.undo()
    assert model(ids).past_key_values is not None and training_caches(model)


def test_estimate_names_the_cache_and_the_techniques_switch_it_off() -> None:
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    model, batch = _gpt2(), _batch()
    plain = estimate_memory(model, batch, loss_fn=_hf_loss, device="cpu")
    assert any("key/value cache built while training" in n for n in plain.notes)
    off = copy.deepcopy(model)
    off.config.use_cache = False
    for callbacks in ([FrozenWeights4bit()], [ActivationCheckpointing()]):
        with_cache = estimate_memory(model, batch, loss_fn=_hf_loss, callbacks=callbacks)
        without = estimate_memory(off, batch, loss_fn=_hf_loss, callbacks=callbacks)
        assert with_cache.peak_bytes == without.peak_bytes
        assert not any("key/value cache built" in n for n in with_cache.notes)
    assert training_caches(model) == ["GPT2LMHeadModel"]  # the estimate undid its change


def test_adamw8bit_on_lora_says_it_saves_nothing(tmp_path) -> None:
    from lightning_efficient.techniques.optimizers import OptimizerSwap

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[OptimizerSwap("adamw8bit")],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(_LoRAModule(), train_dataloaders=_loader())
    said = [w for w in seen if issubclass(w.category, NoEffectWarning)]
    assert len(said) == 1 and "4,096" in str(said[0].message)


def test_fsdp_and_deepspeed_refused_ddp_served() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from lightning_efficient.core import compat

    for strategy, refused in (
        (DeepSpeedStrategy(), True),
        (FSDPStrategy(), True),
        (DDPStrategy(), False),
    ):
        assert compat._quantized_weights_sharded in compat.RULES
        message = compat._quantized_weights_sharded(
            SimpleNamespace(strategy=strategy), [FrozenWeights4bit()]
        )
        problems = [message] if message else []
        assert bool(problems) is refused, (type(strategy).__name__, problems)
        if refused:
            assert "FrozenWeights4bit" in problems[0] and "strategy='ddp'" in problems[0]


# FrozenWeights4bit, issue 49: no code that reads a frozen layer's weight sees the packed tensor
# (T5's ``_keep_in_fp32_modules``), the output head by the package's one rule, GPT-2's ``Conv1D``,
# adapter checkpoints, and its arguments.


V_HF, SEQ_HF = 64, 8  # the small vocabulary and length of the models built from configs below


def _t5() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=V_HF, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _ids(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, V_HF, (rows, SEQ_HF), generator=torch.Generator().manual_seed(1))


# -- row 3: T5 reads `wo.weight.dtype`: kept in full precision, as transformers keeps it ---------
def test_t5_feed_forward_output_kept_in_full_precision() -> None:
    model = _t5().requires_grad_(False)
    ids = _ids()
    plain = model(input_ids=ids, labels=ids).loss
    change = apply_frozen_weights_4bit(model)
    wo = [n for n, m in model.named_modules() if n.endswith(".wo")]
    assert len(wo) == 4 and not set(wo) & set(change.value.chosen)
    assert all("_keep_in_fp32_modules" in change.value.left[n] for n in wo)
    assert all(model.get_submodule(n).weight.dtype == torch.float32 for n in wo)
    assert change.figures["layers_4bit"] == 28  # every other projection of the blocks
    quantized = model(input_ids=ids, labels=ids).loss  # train mode: dropout on float activations
    torch.testing.assert_close(quantized, plain, rtol=0.02, atol=0)
    change.undo()


class _LoRAT5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0)
        self.model = peft.get_peft_model(_t5(), lora)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def test_autoefficient_estimates_the_4bit_rung_of_a_lora_t5() -> None:
    model, ids = _LoRAT5(), _ids(4)
    settings = {"precision": "32-true", "device": "cpu", "optimizer": "adamw"}
    measure = auto_fit.estimate_measure(
        model, lambda n: (ids[:n],), 2**40, 4, {**settings, "loss_fn": lambda m, b: m(b[0])}
    )
    plain = measure(Rung("as configured", "32-true"), 2)
    fits, used, est = measure(Rung("32-true + 4-bit", "32-true", (FROZEN_4BIT,)), 2)
    assert fits and used < plain[1]  # estimated, and the frozen projections take less
    assert any("28 frozen linear weights in 4 bits" in n for n in est.notes)


def test_a_rung_that_cannot_be_estimated_is_read_as_such() -> None:
    from lightning_efficient.core.technique import Technique

    class Unestimable(Technique):
        def configure_estimate(self, plan: Any) -> None:
            raise RuntimeError("A must be float16, bfloat16, or float32, got torch.uint8")

    model, ids = _LoRAT5(), _ids(4)
    settings = {"precision": "32-true", "device": "cpu", "loss_fn": lambda m, b: m(b[0])}
    measure = auto_fit.estimate_measure(model, lambda n: (ids[:n],), 2**40, 4, settings)
    bad = Rung("32-true + 4-bit", "32-true", (FROZEN_4BIT,), configured=(Unestimable(),))
    fits, used, err = measure(bad, 2)
    assert not fits and used == float("inf") and isinstance(err, RuntimeError)
    plain = Rung("as configured", "32-true")
    decision = decide([bad, plain], measure, 2**40, 4)
    assert decision.rung is plain
    assert ("32-true + 4-bit", "cannot estimate: A must be float16, bfloat16, or float32, got "
            "torch.uint8") in decision.tried  # fmt: skip


# -- row 10: the output head by the package's one rule ------------------------------------------
def _gpt2_tied(*, vocab: int = V_HF, positions: int = SEQ_HF, tied: bool = True) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=2,
        tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def test_head_found_by_the_one_rule_not_the_largest_embedding() -> None:
    from lightning_efficient.measure.memory.heads import find_output_head

    # 64 tokens, 128 positions (the position table is the largest Embedding), an untied head
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
    model = peft.get_peft_model(_gpt2_tied(positions=128, tied=False), lora)
    head = find_output_head(model)
    assert head.linear.out_features == V_HF and not head.linear.weight.requires_grad
    change = apply_frozen_weights_4bit(model)
    assert head.name not in change.value.chosen and "output head" in change.value.left[head.name]
    assert head.linear.weight.dtype == torch.float32  # the chunked loss reads it as it is
    change.undo()
    # a Llama whose intermediate size is its vocabulary: every projection of the blocks is stored
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config).requires_grad_(False)
    chosen = apply_frozen_weights_4bit(llama).value.chosen
    assert len(chosen) == 14 and "lm_head" not in chosen  # 7 projections x 2 layers, not the head


# -- row 12: GPT-2's Conv1D is a transposed linear: served ----------------------------------------
def test_gpt2_conv1d_served_as_a_transposed_linear() -> None:
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True
    )
    model = peft.get_peft_model(_gpt2_tied(), lora)
    ids = _ids(4)
    plain = model(input_ids=ids, labels=ids).loss
    given = {k: v.clone() for k, v in model.state_dict().items()}
    change = apply_frozen_weights_4bit(model)
    chosen = change.value.chosen
    assert len(chosen) == 8  # c_attn's base layer, c_proj, c_fc, mlp.c_proj in each of 2 layers
    assert all(type(model.get_submodule(n)).__name__ == "Conv1D" for n in chosen)
    assert change.figures["weight_bytes_after"] < 0.2 * change.figures["weight_bytes_before"]
    loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, plain, rtol=0.02, atol=0)
    loss.backward()  # the adapters get their gradient through the 4-bit base
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    state = model.state_dict()  # the original weights, in Conv1D's in x out layout
    assert all(torch.equal(state[k], v) for k, v in given.items())
    layer = model.get_submodule(chosen[0])
    packed = layer.weight.detach().clone()
    key = chosen[0] + ".weight"
    model.load_state_dict({**given, key: given[key].flip(0)})  # re-quantized from what it loads
    assert not torch.equal(layer.weight, packed)
    model.load_state_dict(given)
    assert torch.equal(layer.weight, packed)
    change.undo()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in given.items())


# -- row 13: a frozen-base fit's checkpoint holds the trainable state; resume bit-identical -------
class _LoRALlama(pl.LightningModule):
    """The base is built from a seed, as a pretrained one is read from its files."""

    def __init__(self, base_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(base_seed)
        config = transformers.LlamaConfig(
            vocab_size=V_HF, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_HF,
        )  # fmt: skip
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        self.model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _adapter_fit(tmp_path: Any, *, ckpt: Any = None, callbacks: Any = (), seed: int = 0) -> Any:
    pl.seed_everything(0, verbose=False)
    module = _LoRALlama(seed)
    ids = torch.randint(0, V_HF, (8, SEQ_HF), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = tiny_trainer(
        tmp_path, [FrozenWeights4bit(save_frozen=False), *callbacks], max_steps=4,
        limit_train_batches=2, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt)
    return trainer, module


def test_adapter_checkpoint_holds_the_trainable_state_and_resumes_bit_identical(tmp_path) -> None:
    path = tmp_path / "k.ckpt"
    save = SaveAt(2, path)
    _, full = _adapter_fit(tmp_path / "full", callbacks=[save])
    saved = torch.load(path, weights_only=True)["state_dict"]
    trainable = {n for n, p in full.named_parameters() if p.requires_grad}
    assert set(saved) <= set(full.state_dict()) and trainable <= set(saved)
    assert not any(k in saved for k, p in full.named_parameters() if not p.requires_grad)
    whole = tmp_path / "whole.ckpt"  # the same checkpoint with the frozen weights in it
    torch.save({**torch.load(path, weights_only=True), "state_dict": full.state_dict()}, whole)
    ratio = path.stat().st_size / whole.stat().st_size
    print(f"trainable-only checkpoint: {path.stat().st_size} B, with the frozen weights: "
          f"{whole.stat().st_size} B ({ratio:.3f}x)")  # fmt: skip
    assert ratio < 0.2  # the adapters, their optimizer state, the norms
    _, resumed = _adapter_fit(tmp_path / "resumed", ckpt=str(path))
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # bit-identical, the base read from the module
    # a module built with another base is refused, naming the entry
    with pytest.raises(ValueError, match=r"frozen `model\.base_model.*is not the one"):
        _adapter_fit(tmp_path / "other", ckpt=str(path), seed=1)


# -- smaller items: DoRA, weight averaging, names, compute_dtype, a non-module -------------------
def _llama(**kw: Any) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V_HF, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, **kw,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_dora_base_layers_stay_in_full_precision() -> None:
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    model = peft.get_peft_model(_llama(), lora)
    ids = _ids()
    plain = model(input_ids=ids, labels=ids).loss
    change = apply_frozen_weights_4bit(model)
    dora = [n for n in change.value.left if n.endswith(("q_proj.base_layer", "v_proj.base_layer"))]
    assert len(dora) == 2 and all("DoRA" in change.value.left[n] for n in dora)
    assert change.figures["layers_4bit"] == 5  # k, o, gate, up, down
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, plain, rtol=0.02, atol=0)
    change.undo()


def test_weight_averaging_refused_with_the_reason(tmp_path) -> None:
    from lightning.pytorch.callbacks import WeightAveraging

    from lightning_efficient.core.validate import SettingsError

    module = _LoRALlama()
    given = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = tiny_trainer(tmp_path, [FrozenWeights4bit(), WeightAveraging()], max_steps=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_ids(4)), batch_size=2)
    with pytest.raises(SettingsError, match="WeightAveraging: weight averaging keeps a full"):
        trainer.fit(module, train_dataloaders=loader)
    assert all(torch.equal(v, given[k]) for k, v in module.state_dict().items())


def test_names_and_compute_dtype_checked() -> None:
    from lightning_efficient.core.validate import SettingsError

    model = _llama().requires_grad_(False)
    with pytest.raises(SettingsError, match=r"`modules` pattern\(s\) \['q_proj'\] match no"):
        apply_frozen_weights_4bit(model, modules=["q_proj"])
    with pytest.warns(UserWarning, match=r"`skip` pattern\(s\) \['nah'\] match no .*skip nothing"):
        apply_frozen_weights_4bit(model, skip=["nah"]).undo()
    # a string is one pattern, not its characters
    with apply_frozen_weights_4bit(model, modules="model.layers.0.mlp") as change:
        mlp = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        assert change.value.chosen == mlp
    with apply_frozen_weights_4bit(model, skip="model.layers.0.mlp") as change:
        assert change.figures["layers_4bit"] == 4
    for name in ("bf16", "float16", torch.float32, None):
        with apply_frozen_weights_4bit(model, compute_dtype=name) as change:
            out = model(input_ids=_ids()).logits
            assert out.dtype == torch.float32 and change.figures["layers_4bit"] == 7
    for bad in (torch.int8, "int4", 3):
        with pytest.raises(ValueError, match="`compute_dtype` must be None, torch.bfloat16"):
            apply_frozen_weights_4bit(model, compute_dtype=bad)
    with pytest.raises(TypeError, match=r"`model` must be a torch.nn.Module; got 3 \(int\)"):
        apply_frozen_weights_4bit(3)  # type: ignore[arg-type]
    assert not any("weight_4bit" in n for n, _ in model.named_buffers())  # each one undone


class _LoRAGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
        self.model = peft.get_peft_model(_gpt2_tied(positions=128, tied=False), lora)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_chunked_loss_reads_the_full_precision_head_under_4bit(tmp_path) -> None:
    """Row 10 in a fit: the head left as it is, every training loss comes from the chunks (the
    4-bit head made the chunked loss fall back every step and advise `head=`)."""
    from lightning_efficient import ChunkedCrossEntropy
    from lightning_efficient.core.report import report_for

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_ids(8)), batch_size=2)
    callbacks = [FrozenWeights4bit(), ChunkedCrossEntropy()]
    trainer = tiny_trainer(tmp_path, callbacks, max_steps=3, limit_val_batches=0)
    trainer.fit(_LoRAGPT2(), train_dataloaders=loader)
    assert report_for(trainer)["ChunkedCrossEntropy"].figures["losses_from_chunks"] == 3
    assert report_for(trainer)["FrozenWeights4bit"].figures["layers_4bit"] == 8
