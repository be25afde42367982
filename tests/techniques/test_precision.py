"""Precision selection, MatmulPrecision (TF32) and FP8 (torchao float8)."""

from __future__ import annotations

import importlib.util
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit

from benchmarks.workloads import tiny_data, tiny_model
from lightning_efficient.commands.cli import EfficientCLI
from lightning_efficient.core import technique as _base
from lightning_efficient.core.report import report_for
from lightning_efficient.techniques import precision as P
from lightning_efficient.techniques.precision import (
    Float8Training,
    MatmulPrecision,
    apply_float8,
    apply_matmul_precision,
    best_precision,
    check_precision,
)


# -- best_precision ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability,expected",
    [((7, 0), "16-mixed"), ((7, 5), "16-mixed"), ((8, 0), "bf16-mixed"), ((9, 0), "bf16-mixed")],
)
def test_best_precision_on_cuda_by_capability(monkeypatch, capability, expected) -> None:
    # the decision logic, given what the CUDA runtime would report for each GPU generation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert best_precision("cuda:0") == best_precision() == expected


def test_best_precision_on_cpu_follows_bf16_support(monkeypatch) -> None:
    assert best_precision("cpu") == ("bf16-mixed" if P.cpu_supports_bf16() else "32-true")
    monkeypatch.setattr(P, "cpu_supports_bf16", lambda: False)
    assert best_precision("cpu") == "32-true"
    monkeypatch.setattr(P, "cpu_supports_bf16", lambda: True)
    assert best_precision("cpu") == "bf16-mixed"
    assert best_precision("meta") == "32-true"  # any other device


def test_unknown_precision_lists_valid_values() -> None:
    with pytest.raises(ValueError, match="`precision`.*'bf16-mixed'.*'32-true'.*got 'bf15-mixed'"):
        check_precision("bf15-mixed")
    assert check_precision("auto") == "auto" and check_precision(32) == 32


def _cli(*args: str) -> EfficientCLI:
    return EfficientCLI(
        args=["--trainer.accelerator", "cpu", "--trainer.logger", "false", *args], run=False
    )


def test_cli_precision_auto_resolves_through_best_precision() -> None:
    cli = _cli("--trainer.precision", "auto")
    assert cli.trainer.precision == best_precision("cpu")
    assert _cli("--trainer.precision", "bf16-true").trainer.precision == "bf16-true"


def test_cli_unknown_precision_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _cli("--trainer.precision", "fp8-magic")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "trainer.precision" in err
        and "'fp8-magic'" in err
        and "'bf16-mixed'" in err
        and "'auto'" in err
    )


# -- bf16 versus fp32 on the demo ----------------------------------------------------------------
def test_bf16_mixed_validation_loss_within_2_percent_of_fp32(tmp_path) -> None:
    def val_loss(precision: str) -> float:
        trainer, _, rec = fit(
            tmp_path / precision,
            max_steps=20,
            precision=precision,
            limit_val_batches=2,
            model=tiny_model(warmup_steps=5),
            data=tiny_data(max_train_samples=256),
        )
        trainer.validate(trainer.lightning_module, datamodule=trainer.datamodule, verbose=False)
        assert (
            rec.losses[-1] < rec.losses[0] - 0.5
        )  # it learned something, so the comparison means something
        return float(trainer.callback_metrics["val_loss"])

    fp32, bf16 = val_loss("32-true"), val_loss("bf16-mixed")
    assert fp32 != bf16  # bf16 did change the arithmetic
    print(f"val loss fp32 {fp32:.4f}, bf16-mixed {bf16:.4f}, {abs(bf16 - fp32) / fp32:.2%} apart")
    assert abs(bf16 - fp32) / fp32 < 0.02


# -- MatmulPrecision -----------------------------------------------------------------------------
def test_apply_matmul_precision_and_undo() -> None:
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    medium = apply_matmul_precision("medium")
    assert (
        torch.get_float32_matmul_precision() == "medium" and torch.backends.cudnn.allow_tf32 is True
    )
    assert medium.what == f"float32 matmul precision {before[0]!r} -> 'medium', cuDNN TF32 on"
    with apply_matmul_precision("highest"):
        assert torch.backends.cudnn.allow_tf32 is False
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (
        "medium",
        True,
    )
    medium.undo()
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_matmul_precision_on_cpu_is_a_noop_with_one_note(tmp_path) -> None:
    before = torch.get_float32_matmul_precision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = fit(tmp_path, [MatmulPrecision("medium")], max_steps=3)
    notes = [w for w in caught if issubclass(w.category, _base.NoEffectWarning)]
    assert len(notes) == 1 and "TF32" in str(notes[0].message)
    assert torch.get_float32_matmul_precision() == before
    assert "no effect" in report_for(trainer)["MatmulPrecision"].change


class _Seen(pl.Callback):
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.seen = fail_at, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        if batch_idx == self.fail_at:
            raise RuntimeError("stop here")


@pytest.fixture
def pretend_tf32(monkeypatch):
    """The callback's timing logic (set at fit start, restore at the end / on error) on a CPU:
    ``has_tf32`` answers as on an Ampere GPU; the torch flags themselves are set for real."""
    monkeypatch.setattr(P, "has_tf32", lambda device=None: True)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True


def test_matmul_precision_set_during_fit_and_restored(tmp_path, pretend_tf32) -> None:
    seen = _Seen()
    trainer, _, _ = fit(tmp_path, [MatmulPrecision("high"), seen], max_steps=3)
    assert seen.seen == [("high", True)] * 3
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (
        "highest",
        False,
    )
    assert "'highest' -> 'high'" in report_for(trainer)["MatmulPrecision"].change


def test_matmul_precision_restored_on_exception(tmp_path, pretend_tf32) -> None:
    seen = _Seen(fail_at=1)
    with pytest.raises(RuntimeError, match="stop here"):
        fit(tmp_path, [MatmulPrecision("medium"), seen], max_steps=3)
    assert seen.seen[0] == ("medium", True)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (
        "highest",
        False,
    )


def test_matmul_level_checked() -> None:
    with pytest.raises(ValueError, match="`level`.*'highest', 'high', 'medium'"):
        MatmulPrecision("tf32")


# -- FP8 -----------------------------------------------------------------------------------------
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs the `fp8` extra (torchao)"
)


@needs_torchao
def test_apply_float8_keeps_keys_trains_close_to_fp32_and_undoes() -> None:
    # torch 2.13 runs float8 matmuls (torch._scaled_mm) on the CPU too: the numerics are testable
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    ref, fp8 = tiny_model(n_embd=32), tiny_model(n_embd=32)
    fp8.load_state_dict(ref.state_dict())
    keys = list(fp8.state_dict())
    change = apply_float8(fp8, exclude=["head"])
    names = change.value
    assert names and all(isinstance(fp8.get_submodule(n), Float8Linear) for n in names)
    assert "head" not in names and not isinstance(fp8.head, Float8Linear)
    assert list(fp8.state_dict()) == keys
    x = torch.randint(0, 256, (4, 32))
    y = torch.randint(0, 256, (4, 32))
    losses = {}
    for name, m in (("ref", ref), ("fp8", fp8)):
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses[name] = float(loss)
    assert losses["fp8"] != losses["ref"]  # the matmuls did run in float8
    assert abs(losses["fp8"] - losses["ref"]) / losses["ref"] < 0.02
    g_ref, g_fp8 = ref.blocks[0].mlp[0].weight.grad, fp8.blocks[0].mlp[0].weight.grad
    assert torch.nn.functional.cosine_similarity(g_ref.flatten(), g_fp8.flatten(), dim=0) > 0.95
    trained = fp8.blocks[0].mlp[0].weight
    change.undo()  # the original layers are back, holding the same (trained) parameters
    assert not any(isinstance(m, Float8Linear) for m in fp8.modules())
    assert type(fp8.blocks[0].mlp[0]) is torch.nn.Linear and fp8.blocks[0].mlp[0].weight is trained


def test_float8_training_on_cpu_says_it_did_nothing(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model, _ = fit(tmp_path, [Float8Training()], max_steps=2)
    notes = [str(w.message) for w in caught if issubclass(w.category, _base.NoEffectWarning)]
    assert len(notes) == 1 and "compute capability 8.9" in notes[0]
    assert type(model.blocks[0].mlp[0]) is torch.nn.Linear


@needs_torchao
def test_float8_training_puts_the_layers_back_after_fit_and_on_error(tmp_path, monkeypatch) -> None:
    """On a CPU with the device check answered as on an FP8 GPU (torch runs float8 matmuls on
    the CPU too): the layers train in FP8 during the fit, and are nn.Linear again after it."""
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(P, "supports_fp8", lambda device=None: True)

    class Types(pl.Callback):
        def __init__(self, fail_at: int | None = None) -> None:
            self.fail_at, self.seen = fail_at, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.seen.append(type(pl_module.blocks[0].mlp[0]))
            if batch_idx == self.fail_at:
                raise RuntimeError("stop here")

    for fail_at in (None, 1):
        model, types = tiny_model(), Types(fail_at)
        weight = model.blocks[0].mlp[0].weight
        if fail_at is None:
            trainer, _, _ = fit(tmp_path, [Float8Training(), types], model=model, max_steps=2)
            assert report_for(trainer)["Float8Training"].figures["converted_layers"] > 0
        else:
            with pytest.raises(RuntimeError, match="stop here"):
                fit(tmp_path, [Float8Training(), types], model=model, max_steps=3)
        assert types.seen[0] is Float8Linear
        assert not any(isinstance(m, Float8Linear) for m in model.modules())
        assert model.blocks[0].mlp[0].weight is weight  # the trained parameter, in place


def test_missing_torchao_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-efficient\[fp8\]'"):
        apply_float8(tiny_model())


def test_float8_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`recipe`.*tensorwise"):
        Float8Training(recipe="delayed")
    with pytest.raises(TypeError, match="`exclude`"):
        Float8Training(exclude="head")


@pytest.mark.gpu
def test_float8_training_on_fp8_gpu(tmp_path) -> None:
    pytest.importorskip("torchao", reason="FP8 training needs torchao: the fp8 extra")
    if not P.supports_fp8():
        pytest.skip("needs compute capability 8.9+")
    _, _, ref = fit(
        tmp_path / "ref",
        max_steps=8,
        accelerator="gpu",
        precision="bf16-mixed",
        model=tiny_model(n_embd=64),
    )
    trainer, model, rec = fit(
        tmp_path / "fp8",
        [Float8Training()],
        max_steps=8,
        accelerator="gpu",
        precision="bf16-mixed",
        model=tiny_model(n_embd=64),
    )
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.blocks[0].mlp[0], Float8Linear)
    assert report_for(trainer)["Float8Training"].figures["converted_layers"] > 0
    assert abs(rec.losses[-1] - ref.losses[-1]) / ref.losses[-1] < 0.05


@pytest.mark.gpu
def test_matmul_precision_on_ampere_gpu(tmp_path) -> None:
    if not P.has_tf32():
        pytest.skip("needs compute capability 8.0+")
    torch.set_float32_matmul_precision("highest")
    seen = _Seen()
    fit(tmp_path, [MatmulPrecision("high"), seen], max_steps=2, accelerator="gpu")
    assert seen.seen == [("high", True)] * 2 and torch.get_float32_matmul_precision() == "highest"
