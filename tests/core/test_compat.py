"""What the package refuses before training (``core/compat.py``'s rules, ``core/validate.py``):
a budget under a byte or not finite, a technique given twice. The other bad-input cases of
issue 21 live with their subject (commands/, planning/, measure/memory/,
activation_checkpointing/)."""

from __future__ import annotations

import math

import pytest
from helpers import fit, tiny_data, tiny_model

from lightning_efficient import (
    ActivationCheckpointing,
    EfficientBatchSize,
    OptimizerSwap,
    TorchCompile,
)
from lightning_efficient.core.validate import SettingsError, parse_bytes


@pytest.mark.parametrize("value", [math.inf, float("nan"), 0.5, "0.1B", 0, -3, "-1GiB"])
def test_budgets_under_a_byte_or_not_finite_are_refused(value) -> None:
    with pytest.raises(ValueError, match="`budget`"):
        parse_bytes("budget", value)
    with pytest.raises(ValueError, match="`budget`"):
        ActivationCheckpointing(budget=value)


@pytest.mark.parametrize("make", [ActivationCheckpointing, TorchCompile])
def test_a_technique_that_does_not_stack_is_refused_twice(tmp_path, make) -> None:
    with pytest.raises(SettingsError, match="more than once"):
        fit(tmp_path, [make(), make()], max_steps=1)


@pytest.mark.parametrize(
    "make",
    [lambda: OptimizerSwap("adamw_fused"), EfficientBatchSize],
    ids=["OptimizerSwap", "EfficientBatchSize"],
)
def test_a_stateful_technique_added_twice_is_refused_by_the_rules(tmp_path, make) -> None:
    # Lightning checks state keys only for the callbacks given to Trainer(...); one appended
    # later would silently share the first one's checkpoint entry
    from helpers import tiny_trainer

    trainer = tiny_trainer(tmp_path, [make()], max_steps=1)
    trainer.callbacks.append(make())
    name = type(trainer.callbacks[-1]).__name__
    with pytest.raises(SettingsError, match=f"{name} is given more than once.*under one key"):
        trainer.fit(tiny_model(), datamodule=tiny_data())
