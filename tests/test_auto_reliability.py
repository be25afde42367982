"""AutoEfficient, the planner and the batch sizing under a hostile but fair user (issue 37):
resume with every rung, the data's size, the optimizer family, the user's own errors, epoch
ends, crafted checkpoints, techniques given twice, unbounded targets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _auto_families import FAMILIES, FamilyData, family
from helpers import TINY_MODEL, SaveAt, fit, params_of

from lightning_efficient import AutoEfficient
from lightning_efficient.techniques.auto import fit as auto_fit
from lightning_efficient.techniques.auto.decide import Decision

E = 16


def _usable_rungs() -> list[Any]:
    """Every rung the callback's ladder can pick for the decoder on a 32-true CPU trainer."""
    model, _ = family("decoder", batch_size=E)
    rungs = auto_fit.ladder_for(model, 2**30, precision="32-true", bf16=False)
    return [r for r in rungs if not auto_fit.fixed_by_trainer(r, "32-true")]


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
    trainer, resumed, auto = run("resumed", 4, ckpt=str(ckpt))
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

    from lightning_efficient.cli import main

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
    return {p.init_args["name"] for r in rungs for p in r.callbacks if p.class_path == "OptimizerSwap"}


def test_optimizer_family_kept_and_rungs_without_the_swap() -> None:
    from lightning_efficient.planner import default_ladder, plan_stack

    sgd, adam = SGDGPT(**TINY_MODEL), AdamGPT(**TINY_MODEL)
    # AutoEfficient's ladder: no 8-bit swap for SGD (with momentum or without), Adam's own form
    assert _swaps(auto_fit.ladder_for(sgd, 2**30, precision="32-true", bf16=False)) == set()
    assert _swaps(auto_fit.ladder_for(adam, 2**30, precision="32-true", bf16=False)) == {"adam8bit"}
    # the planner: the same, and no ZeRO offload (DeepSpeed's CPU Adam would replace SGD)
    x = torch.zeros(2, 32, dtype=torch.long)
    tried = [r for r, _, _ in plan_stack(sgd, (x, x), "1TiB", try_all=True, device="cpu").tried]
    assert _swaps(tried) == set() and not any(r.strategy for r in tried)
    assert any("checkpoint fewest blocks" in r.name for r in tried)
    # checkpointing alone is a rung, before the same with 8-bit states
    names = [r.name for r in default_ladder(2**30)]
    assert names.index("bf16-mixed + checkpoint fewest blocks") < names.index(
        "bf16-mixed + adamw8bit + checkpoint fewest blocks"
    )
    assert _swaps(default_ladder(2**30, optimizer="sgd")) == set()


def test_sgd_fit_keeps_sgd(tmp_path) -> None:
    # a budget only checkpointing (or, before, 8-bit AdamW states) reaches: the fit keeps SGD
    model, data = family("decoder", batch_size=E)
    sgd = SGDGPT(**TINY_MODEL)
    sgd.load_state_dict(model.state_dict())
    measure = auto_fit.estimate_measure(
        sgd, _sampler(data), 10**12, E, {"precision": "32-true"}
    )
    plain = measure(_usable_rungs()[0], E)[1]
    auto = AutoEfficient(budget=int(plain * 0.9), goal="memory")
    trainer, _, _ = fit(tmp_path, [auto], model=sgd, data=data, max_steps=1, limit_val_batches=0)
    assert "OptimizerSwap" not in [p.class_path for p in auto.decision.rung.callbacks]
    assert isinstance(trainer.optimizers[0], torch.optim.SGD)


def _sampler(data: Any) -> Any:
    from lightning_efficient.techniques.batch_size.choice import worst_case_sampler

    return worst_case_sampler(data.train_dataloader(), 100)[0]
