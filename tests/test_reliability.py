"""Bad input, conflicts and files: each case here failed on the first stage's main (issue 21)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from command_runner import run_command
from helpers import fit, tiny_data, tiny_model

from lightning_efficient import (
    ActivationCheckpointing,
    EfficientBatchSize,
    OptimizerSwap,
    TorchCompile,
)
from lightning_efficient.commands.cli import reason_first
from lightning_efficient.core.validate import SettingsError, parse_bytes
from lightning_efficient.measure.memory.types import resolve_optimizer
from lightning_efficient.planning import plan_stack

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("value", [math.inf, float("nan"), 0.5, "0.1B", 0, -3, "-1GiB"])
def test_budgets_under_a_byte_or_not_finite_are_refused(value) -> None:
    with pytest.raises(ValueError, match="`budget`"):
        parse_bytes("budget", value)
    with pytest.raises(ValueError, match="`budget`"):
        ActivationCheckpointing(budget=value)


def test_an_optimizer_path_must_name_an_optimizer_class() -> None:
    with pytest.raises(TypeError, match="Optimizer subclass"):
        resolve_optimizer("os.system")
    assert resolve_optimizer("torch.optim.SGD") is not None


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


def test_a_stateful_technique_twice_in_a_config_is_said_before_the_trainer(capsys) -> None:
    from lightning_efficient.commands.cli import EfficientCLI

    swap = "--trainer.callbacks+=OptimizerSwap"
    with pytest.raises(SystemExit) as info:
        EfficientCLI(
            args=["--trainer.accelerator=cpu", swap, "--trainer.callbacks.name=adamw8bit", swap,
                  "--trainer.callbacks.name=adamw_fused"],
            run=False,
        )  # fmt: skip
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "OptimizerSwap is given more than once" in error and "Keep one instance" in error
    assert "Found more than one stateful callback" not in error  # not Lightning's generic one


def test_an_unreachable_budget_is_a_short_error_with_the_smallest_peak(tmp_path) -> None:
    with pytest.raises(SettingsError, match="smallest achievable peak"):
        fit(tmp_path, [ActivationCheckpointing(budget="1KiB")], max_steps=1)


def test_the_reason_of_a_bad_callback_argument_comes_first() -> None:
    message = (
        "Does not validate against any of the Union subtypes\nErrors:\n"
        "  - `every_n` must be >= 1; got -3.\n  - Not a valid subclass of Callback\n"
    )
    assert reason_first(message).splitlines()[0] == "`every_n` must be >= 1; got -3."
    assert reason_first("plain message") == "plain message"


def test_fit_without_a_logger_writes_no_config_in_the_working_folder(tmp_path, capsys) -> None:
    """The command in the test's process (``main``), from ``tmp_path`` as its working folder."""
    mine = tmp_path / "config.yaml"
    mine.write_text("# my own notes\ntrainer: {max_steps: 1}\n")
    proc = run_command(
        capsys,
        "fit",
        "--config",
        str(mine),
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.limit_val_batches=0",
        "--data.max_train_samples=16",
        "--data.batch_size=4",
        "--model.n_layer=1",
        "--model.n_embd=16",
        "--model.n_head=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert mine.read_text().startswith("# my own notes")  # not replaced by the saved config
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".yaml") == ["config.yaml"]


def test_fit_with_a_budget_that_cannot_be_met_ends_with_a_short_error(tmp_path, capsys) -> None:
    proc = run_command(
        capsys,
        "fit",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks+=ActivationCheckpointing",
        "--trainer.callbacks.budget=1KiB",
        "--data.max_train_samples=16",
        "--data.batch_size=4",
        "--model.n_layer=2",
        "--model.n_embd=16",
        "--model.n_head=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:") or "\nerror: `budget`" in proc.stderr
    assert "smallest achievable peak" in proc.stderr


class NeedsReal(type(tiny_model())):
    def training_step(self, batch, batch_idx):
        if float(batch[0].float().sum()) < 0:  # reads a value: fake tensors cannot
            raise RuntimeError("unreachable")
        return super().training_step(batch, batch_idx)


def test_plan_says_when_the_model_cannot_be_estimated() -> None:
    import torch
    from helpers import TINY_MODEL

    x = torch.zeros(2, 32, dtype=torch.long)
    result = plan_stack(NeedsReal(**TINY_MODEL), (x, x), "1GiB", try_all=True)
    assert result.chosen is None and result.not_estimable is not None
    assert "item" in str(result.not_estimable) or "value" in str(result.not_estimable)


def test_plan_as_configured_counts_the_configured_techniques() -> None:
    import torch

    model = tiny_model(n_layer=4)
    x = torch.zeros(4, 32, dtype=torch.long)
    bare = plan_stack(model, (x, x), "1TiB")
    configured = plan_stack(model, (x, x), "1TiB", configured=[ActivationCheckpointing()])
    assert bare.tried[0][0].name == configured.tried[0][0].name == "as configured"
    assert configured.tried[0][1].peak_bytes < bare.tried[0][1].peak_bytes


@pytest.mark.slow
def test_every_stack_the_planner_can_emit_fits(tmp_path) -> None:
    """Each rung of the default ladder, built as the planner would write it, trains 2 steps of
    the demo (issue 21: the checkpointing budget next to an 8-bit optimizer crashed)."""
    from lightning_efficient.planning import default_ladder
    from lightning_efficient.techniques.zero_offload import ZeROOffload

    for rung in default_ladder(bf16=True):
        callbacks, strategy = rung.within(2**40).build()
        if isinstance(strategy, ZeROOffload):
            continue  # DeepSpeed rungs: fitted in tests/test_zero_offload.py
        for cb in callbacks:
            if isinstance(cb, ActivationCheckpointing) and cb.budget is not None:
                cb.budget = 2**20  # a budget the tiny model must work for
        precision = "bf16-mixed" if rung.precision != "32-true" else "32-true"
        kwargs = {"strategy": strategy} if strategy is not None else {}
        trainer, _, rec = fit(
            tmp_path, callbacks, max_steps=2, precision=precision, data=tiny_data(), **kwargs
        )
        assert trainer.global_step == 2 and len(rec.losses) == 2, rung.name
        assert all(math.isfinite(v) for v in rec.losses), rung.name
