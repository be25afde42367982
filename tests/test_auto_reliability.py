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
