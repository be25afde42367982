"""FrozenWeights4bit, issue 49: no code that reads a frozen layer's weight sees the packed tensor
(T5's ``_keep_in_fp32_modules``), the output head by the package's one rule, GPT-2's ``Conv1D``,
adapter checkpoints, and its arguments."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import SaveAt, tiny_trainer
from torch import nn

from lightning_efficient.functional import apply_frozen_weights_4bit
from lightning_efficient.planning import fit as auto_fit
from lightning_efficient.planning.ladder import FROZEN_4BIT, Rung
from lightning_efficient.planning.search import decide
from lightning_efficient.techniques.quantize import FrozenWeights4bit

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, SEQ = 64, 8


def _t5() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _ids(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (rows, SEQ), generator=torch.Generator().manual_seed(1))


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
def _gpt2(*, vocab: int = V, positions: int = SEQ, tied: bool = True) -> nn.Module:
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
    model = peft.get_peft_model(_gpt2(positions=128, tied=False), lora)
    head = find_output_head(model)
    assert head.linear.out_features == V and not head.linear.weight.requires_grad
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
    model = peft.get_peft_model(_gpt2(), lora)
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
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
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
    ids = torch.randint(0, V, (8, SEQ), generator=torch.Generator().manual_seed(2))
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
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
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
        self.model = peft.get_peft_model(_gpt2(positions=128, tied=False), lora)

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
