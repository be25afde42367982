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
