"""AutoEfficient, the planner and the batch sizing under a hostile but fair user (issue 37):
resume with every rung, the data's size, the optimizer family, the user's own errors, epoch
ends, crafted checkpoints, techniques given twice, unbounded targets."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _auto_families import FAMILIES, FamilyData, family
from helpers import TINY_MODEL, SaveAt, fit, params_of

from lightning_efficient import AutoEfficient
from lightning_efficient.planning import fit as auto_fit
from lightning_efficient.planning.decision import Decision

E = 16


def _usable_rungs() -> list[Any]:
    """Every rung the callback's ladder can pick for the decoder on a 32-true CPU trainer."""
    model, _ = family("decoder", batch_size=E)
    rungs = auto_fit.ladder_for(model, precision="32-true", bf16=False)
    return [r.within(2**30) for r in rungs if not auto_fit.fixed_by_trainer(r, "32-true")]


# -- 2: a resumed run is bit-identical to an uninterrupted one, with every rung -------------------
def _rung_params() -> list[Any]:
    # "fewest blocks" estimates at fit start (about 15 s a test here): slow
    return [
        pytest.param(i, id=r.name, marks=[pytest.mark.slow] if "fewest" in r.name else [])
        for i, r in enumerate(_usable_rungs())
    ]


@pytest.mark.parametrize("index", _rung_params())
def test_resume_bit_identical_with_every_rung(index: int, tmp_path) -> None:
    rung = _usable_rungs()[index]
    epoch = dict(limit_train_batches=4, limit_val_batches=0)  # 2 steps of 8 x 2: an epoch end

    def run(where: str, steps: int, callbacks: Any = (), ckpt: str | None = None) -> Any:
        model, data = family("decoder", batch_size=E)
        auto = AutoEfficient(budget="1GiB").preset(Decision(rung, 8, 2))
        trainer, model, _ = fit(tmp_path / where, [auto, *callbacks], model=model, data=data,
                                max_steps=steps, ckpt_path=ckpt, **epoch)  # fmt: skip
        return trainer, model, auto

    ckpt = tmp_path / "k.ckpt"
    _, full, _ = run("full", 4)
    run("first", 2, [SaveAt(2, ckpt)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, resumed, auto = run("resumed", 4, ckpt=str(ckpt))
    # the stack is put in place by AutoEfficient: no "add OptimizerSwap" to the user
    assert not [w for w in caught if "Please add the following callbacks" in str(w.message)]
    assert auto.decision.restored and auto.decision.rung.name == rung.name
    assert trainer.global_step == 4
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), (rung.name, name, (a - b).abs().max().item())


# -- 3: never more than the data per step; a target the data cannot hold is refused ---------------
def test_target_the_data_cannot_hold_is_refused_before_training(tmp_path, monkeypatch) -> None:
    from lightning_efficient.core.validate import SettingsError

    # 16 x accumulation 8 = 128 on 64 samples: no step can take it (the old pick: micro-batch
    # 128, which with drop_last trains 0 steps and returns normally)
    model, data = family("decoder", batch_size=16)
    with pytest.raises(SettingsError, match=r"training set has 64 \(64 per rank\)"):
        fit(tmp_path, [AutoEfficient(budget="1GiB")], model=model, data=data,
            accumulate_grad_batches=8, max_steps=1)  # fmt: skip
    # a target that fits the data: the micro-batch never exceeds it
    model, data = family("decoder", batch_size=16)
    auto = AutoEfficient(budget="1GiB", target_batch=64)
    trainer, _, _ = fit(tmp_path / "ok", [auto], model=model, data=data, max_steps=1,
                        limit_val_batches=0)  # fmt: skip
    assert auto.decision.micro * auto.decision.accumulation == 64 and trainer.global_step == 1


def test_fit_auto_refuses_a_target_the_data_cannot_hold(tmp_path, capsys, monkeypatch) -> None:
    from pathlib import Path

    from lightning_efficient.commands import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    common = ["--config", str(config), "--trainer.max_steps", "1", "--trainer.logger", "false"]
    with pytest.raises(SystemExit) as info:
        main(["fit", "--auto", "--budget", "1GiB", "--target-batch", "1000000", *common])
    assert info.value.code != 0
    assert "Lower target_batch" in capsys.readouterr().err
    # an unbounded target is refused at once (the divisor search would not end)
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--target-batch", str(10**20), *common])
    assert "--target-batch" in capsys.readouterr().err
    # a checkpoint that is not there: said before deciding, no traceback
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--ckpt_path", "nowhere.ckpt", *common])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--ckpt_path", str(tmp_path), *common])
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make",
    [
        lambda: AutoEfficient(target_batch=10**20),
        lambda: __import__("lightning_efficient").EfficientBatchSize(target_batch_size=10**20),
    ],
)
def test_unbounded_target_refused_at_construction(make) -> None:
    with pytest.raises(ValueError, match="target_batch"):
        make()


# -- 5: the user's optimizer family is kept ----------------------------------------------------------
class SGDGPT(__import__("lightning_efficient.demos", fromlist=["TinyGPT"]).TinyGPT):
    momentum = 0.9

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=self.momentum)


class AdamGPT(SGDGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _swaps(rungs: Any) -> set[str]:
    return {
        p.init_args["name"] for r in rungs for p in r.callbacks if p.class_path == "OptimizerSwap"
    }


def test_optimizer_family_kept_and_rungs_without_the_swap() -> None:
    from lightning_efficient.planning import default_ladder

    sgd, adam = SGDGPT(**TINY_MODEL), AdamGPT(**TINY_MODEL)
    # AutoEfficient's ladder: no 8-bit swap for SGD (with momentum or without), Adam's own form
    assert _swaps(auto_fit.ladder_for(sgd, precision="32-true", bf16=False)) == set()
    assert _swaps(auto_fit.ladder_for(adam, precision="32-true", bf16=False)) == {"adam8bit"}
    # checkpointing alone is a rung, before the same with 8-bit states
    names = [r.name for r in default_ladder()]
    assert names.index("bf16-mixed + checkpoint fewest blocks") < names.index(
        "bf16-mixed + adamw8bit + checkpoint fewest blocks"
    )
    assert _swaps(default_ladder(optimizer="sgd")) == set()
    assert not any(r.strategy for r in default_ladder(optimizer="sgd"))


@pytest.mark.slow
def test_planner_keeps_sgd() -> None:
    from lightning_efficient.planning import plan_stack

    sgd = SGDGPT(**TINY_MODEL)
    # no 8-bit swap, no ZeRO offload (DeepSpeed's CPU Adam would replace SGD)
    x = torch.zeros(1, 8, dtype=torch.long)
    tried = [r for r, _, _ in plan_stack(sgd, (x, x), "1TiB", try_all=True, device="cpu").tried]
    assert _swaps(tried) == set() and not any(r.strategy for r in tried)
    assert any("checkpoint fewest blocks" in r.name for r in tried)


# -- 6: the user's own error, or "the estimate cannot run this step because ..." -------------------
class BadShapeGPT(SGDGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), y.reshape(-1)[:-1]
        )


class MetricGPT(SGDGPT):
    def __init__(self, **kw: Any) -> None:
        import torchmetrics

        super().__init__(**kw)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        return loss


class ManualGPT(SGDGPT):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


@pytest.mark.parametrize(
    "cls,error,match",
    [
        (BadShapeGPT, ValueError, "Expected input batch_size"),
        (MetricGPT, RuntimeError, "the estimate cannot run this step because .*needs real values"),
        (
            ManualGPT,
            RuntimeError,
            "the estimate cannot run this step because .*manual optimization",
        ),
    ],
)
def test_the_real_error_is_said(cls: type, error: type, match: str, tmp_path) -> None:
    from helpers import tiny_data

    with pytest.raises(error, match=match) as info:
        fit(tmp_path, [AutoEfficient(budget="1GiB")], model=cls(**TINY_MODEL),
            data=tiny_data(batch_size=4), max_steps=1)  # fmt: skip
    assert "no usable stack fits" not in str(info.value)


# -- 7: an accumulation window cut by the epoch's end is said -----------------------------------------
def test_epoch_end_cutting_the_window_is_warned(tmp_path) -> None:
    from lightning_efficient import EfficientBatchSize
    from lightning_efficient.techniques.batch_size.sizing import epoch_end_step

    assert epoch_end_step(64, 16, 3, drop_last=False) == 16  # steps of 48, 16, 48, 16, ...
    assert epoch_end_step(64, 16, 2, drop_last=False) is None
    assert epoch_end_step(70, 16, 2, drop_last=True) is None  # 4 full micro-batches: 2 steps
    assert epoch_end_step(70, 16, 2, drop_last=False) == 6  # steps of 32, 32, 6
    model, data = family("decoder", batch_size=16)
    with pytest.warns(UserWarning, match="not kept at epoch ends.*last step of 16"):
        fit(tmp_path / "auto", [AutoEfficient(budget="1GiB", target_batch=48)], model=model,
            data=data, max_steps=1, limit_val_batches=0)  # fmt: skip
    model, data = family("decoder", batch_size=16)
    sizer = EfficientBatchSize(target_batch_size=48, budget="1GiB", max_batch_size=16)
    with pytest.warns(UserWarning, match="not kept at epoch ends.*last step of 16"):
        fit(tmp_path / "ebs", [sizer], model=model, data=data, max_steps=1, limit_val_batches=0)


# -- 9: a crafted checkpoint imports nothing ----------------------------------------------------------
def _state(**changes: Any) -> dict[str, Any]:
    state = {
        "rung": "as configured",
        "precision": "32-true",
        "callbacks": [],
        "strategy": None,
        "micro_batch": 8,
        "accumulation": 2,
        "world_size": 1,
        "goal": "speed",
        "budget_bytes": 2**30,
    }
    return {**state, **changes}


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"callbacks": [{"class_path": "OptimizerSwap", "init_args": {"name": "evilmod.Opt"}}]},
         "OptimizerSwap `name`"),
        ({"callbacks": [{"class_path": "os.system"}]}, "not a technique of the ladder"),
        ({"micro_batch": 3.7}, "micro_batch"),
        ({"accumulation": 0}, "accumulation"),
        ({"micro_batch": None}, "micro_batch"),
        ({"rung": "\x1b[31mred"}, "printable"),
        ({"precision": "8-bit"}, "precision"),
        ({"callbacks": "OptimizerSwap"}, "callbacks"),
        ({"trial_bytes": "many"}, "trial_bytes"),
    ],
)  # fmt: skip
def test_checkpoint_decision_validated(changes: dict[str, Any], match: str) -> None:
    from lightning_efficient.planning.decision import Decision, DecisionStateError

    with pytest.raises(DecisionStateError, match=match):
        Decision.from_state(_state(**changes), 1)
    with pytest.raises(DecisionStateError, match="not a multiple"):
        Decision.from_state(_state(micro_batch=3, accumulation=1), 2)
    assert Decision.from_state(_state(), 1).micro == 8


def test_crafted_checkpoint_imports_nothing(tmp_path, monkeypatch) -> None:
    import sys

    (tmp_path / "evilmod_37.py").write_text("import sys\nsys.evil_ran = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = tmp_path / "k.ckpt"
    model, data = family("decoder", batch_size=E)
    fit(tmp_path / "a", [AutoEfficient(budget="1GiB"), SaveAt(1, ckpt)], model=model, data=data,
        max_steps=1, limit_val_batches=0)  # fmt: skip
    checkpoint = torch.load(ckpt, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("AutoEfficient")]
    checkpoint["callbacks"][key]["decision"]["callbacks"] = [
        {"class_path": "OptimizerSwap", "init_args": {"name": "evilmod_37.Opt"}}
    ]
    torch.save(checkpoint, ckpt)
    model, data = family("decoder", batch_size=E)
    with pytest.raises(ValueError, match="OptimizerSwap `name` must be one of"):
        fit(tmp_path / "b", [AutoEfficient(budget="1GiB")], model=model, data=data, max_steps=2,
            limit_val_batches=0, ckpt_path=str(ckpt))  # fmt: skip
    assert "evilmod_37" not in sys.modules and not getattr(sys, "evil_ran", False)


# -- 10: a technique given twice is used as given; two sizers refused before deciding -----------
def test_configured_technique_used_as_given(tmp_path, monkeypatch) -> None:
    from lightning_efficient import EfficientBatchSize, OptimizerSwap
    from lightning_efficient.core.validate import SettingsError

    model, _ = family("decoder", batch_size=E)
    ladder = auto_fit.ladder_for(model, precision="32-true", bf16=False,
                                 configured=[OptimizerSwap("adamw8bit")])  # fmt: skip
    assert _swaps(ladder) == set() and len({repr(r.callbacks) for r in ladder}) == len(ladder)
    # a decision whose stack has the user's technique: the user's instance, once
    rung = next(r for r in _usable_rungs() if "adamw8bit" in r.name)
    mine = OptimizerSwap("adamw8bit")
    auto = AutoEfficient(budget="1GiB").preset(Decision(rung, 8, 2))
    model, data = family("decoder", batch_size=E)
    trainer, _, _ = fit(tmp_path / "a", [auto, mine], model=model, data=data, max_steps=1,
                        limit_val_batches=0)  # fmt: skip
    assert [cb for cb in trainer.callbacks if isinstance(cb, OptimizerSwap)] == [mine]
    assert trainer.global_step == 1

    def no_decision(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decided before refusing")

    monkeypatch.setattr(auto_fit, "decide_for", no_decision)
    model, data = family("decoder", batch_size=E)
    with pytest.raises(SettingsError, match="EfficientBatchSize would set the batch size too"):
        fit(tmp_path / "b", [AutoEfficient(budget="1GiB"), EfficientBatchSize()], model=model,
            data=data, max_steps=1)  # fmt: skip


# -- the smaller items ------------------------------------------------------------------------------
def test_live_batch_size_read_and_put_back(tmp_path) -> None:
    """A datamodule whose batch_size changed after construction: the live value is read (not the
    stale hparams), and each place gets its own value back after the fit."""

    class Data(FamilyData):
        def __init__(self, batch_size: int = 16) -> None:
            super().__init__(FAMILIES["decoder"][1], 64, batch_size)
            self.save_hyperparameters()

    model, _ = family("decoder", batch_size=E)
    data = Data(16)
    data.batch_size = 8  # hparams still say 16
    auto = AutoEfficient(budget="1GiB")
    fit(tmp_path, [auto], model=model, data=data, max_steps=1, limit_val_batches=0)
    assert auto.decision.effective == 8  # not 16 (the stale hparams)
    assert (data.batch_size, data.hparams.batch_size) == (8, 16)


def test_ddp_ladder_offers_checkpointing_and_8bit_without_fsdp() -> None:
    from lightning_efficient.planning import default_ladder

    ddp = default_ladder(world_size=2, configured_sharding="ddp")
    plain = [r for r in ddp if r.strategy is None]
    classes = {p.class_path for r in plain for p in r.callbacks}
    assert {"ActivationCheckpointing", "OptimizerSwap"} <= classes
    # under FSDP (sharded parameters) no 8-bit rung: bitsandbytes steps whole tensors
    fsdp = default_ladder(world_size=2, configured_sharding="full")
    assert _swaps(fsdp) == set()


def test_nothing_fits_says_when_the_weights_alone_exceed_the_budget() -> None:
    from types import SimpleNamespace

    from lightning_efficient.planning import Rung, decide

    def measure(rung: Rung, n: int) -> tuple[bool, float, Any]:
        return False, 3000.0 + n, SimpleNamespace(by_category={"parameters": 2000})

    with pytest.raises(ValueError, match="weights alone need 1.95 KiB"):
        decide([Rung("plain", "32-true")], measure, 1000, 4)
    with pytest.raises(ValueError) as info:
        decide([Rung("plain", "32-true")], measure, 2500, 4)
    assert "weights alone" not in str(info.value)
