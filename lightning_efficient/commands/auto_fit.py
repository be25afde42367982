"""``lightning-efficient fit --auto [--budget 24GiB] [--goal speed] [--target-batch N]``.

The callback cannot change what Lightning fixed when the Trainer was built (the precision plugin,
the strategy). Here the config is read first, AutoEfficient's decision is made on its model, data
and trainer (every rung of the ladder usable, the bf16-mixed ones included where the device has
bf16), then the Trainer is built again with the plan's precision and strategy, and the fit runs
with AutoEfficient holding the decision (so it applies the stack, the micro-batch and the
accumulation at setup, reports it and keeps it in the checkpoint).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_efficient.commands.cli import exit_with_error
from lightning_efficient.commands.options import build_cli
from lightning_efficient.core.stack import Stack
from lightning_efficient.techniques.batch_size.choice import batch_size_of

__all__ = ["auto_fit_command", "wants_auto"]


def wants_auto(args: Sequence[str]) -> bool:
    """``fit ... --auto ...``."""
    return bool(args) and args[0] == "fit" and "--auto" in args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-efficient fit --auto", add_help=False)
    p.add_argument("--auto", action="store_true")
    p.add_argument("--budget", default=None, help="one rank's device memory, e.g. 24GiB")
    p.add_argument("--goal", default="speed", help="speed (default) or memory")
    p.add_argument("--target-batch", type=int, default=None, help="effective batch to keep")
    p.add_argument("--no-trial", action="store_true", help="no real trial steps before fit")
    p.add_argument("--ckpt_path", "--ckpt-path", default=None, help="checkpoint to resume from")
    return p


def _plan_config(decision: Any, folder: Path) -> Path:
    """A config with the trainer settings a callback cannot apply (precision, strategy)."""
    stack = decision.rung.stack(configured=False)
    path = folder / "auto_plan.yaml"
    path.write_text(Stack(stack.precision, strategy=stack.strategy).to_yaml())
    return path


def _batch_size(model: Any, datamodule: Any, name: str) -> int:
    """The batch size where ``train_dataloader()`` reads it (before the fit; the same reading
    as the callback's: the datamodule's attribute first, an hparams entry last)."""
    value = batch_size_of(datamodule, model, name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    exit_with_error(
        f"fit --auto: no `{name}` on the model, the datamodule or their hparams; the micro-batch "
        "is set there (add a `batch_size` attribute that `train_dataloader()` uses)"
    )
    raise AssertionError  # exit_with_error exits


def _checkpoint_error(path: str | None) -> str:
    """Why ``--ckpt_path`` cannot be resumed from ("" when it can, or Lightning resolves it:
    ``last``, ``best``, ``hpc``, ``registry``, a URL)."""
    if path is None or path in ("last", "best", "hpc", "registry") or "://" in path:
        return ""
    if not Path(path).exists():
        return f"fit --auto: --ckpt_path {path!r} does not exist"
    if not Path(path).is_file():
        return f"fit --auto: --ckpt_path {path!r} is not a file (give the .ckpt file)"
    return ""


def auto_fit_command(argv: Sequence[str]) -> int:
    """Run ``fit`` with the stack AutoEfficient picks (``argv``: the arguments after ``fit``)."""
    from lightning_efficient.core.validate import parse_bytes
    from lightning_efficient.measure.memory.estimate import EstimateError
    from lightning_efficient.planning import AutoEfficient
    from lightning_efficient.planning.fit import decide_for
    from lightning_efficient.planning.search import resolve_host_budget
    from lightning_efficient.techniques.precision import best_precision

    args, rest = _parser().parse_known_args(list(argv))
    try:
        auto = AutoEfficient(
            budget=args.budget,
            goal=args.goal,
            target_batch=args.target_batch,
            trial=not args.no_trial,
        )
    except (TypeError, ValueError) as err:
        exit_with_error(
            str(err)
            .replace("`budget`", "--budget")
            .replace("`goal`", "--goal")
            .replace("`target_batch`", "--target-batch")
        )
    if _checkpoint_error(args.ckpt_path):
        exit_with_error(_checkpoint_error(args.ckpt_path))
    first = build_cli((), rest)  # the command line given, less `fit --auto ...`
    trainer, model = first.trainer, first.model
    source = first.datamodule if first.datamodule is not None else model
    if first.datamodule is not None:  # as the fit does before the loaders are built
        first.datamodule.prepare_data()
        first.datamodule.setup("fit")
    micro = _batch_size(model, first.datamodule, auto.batch_arg_name)
    world = trainer.world_size
    effective = args.target_batch or micro * trainer.accumulate_grad_batches * world
    if effective % world:
        exit_with_error(
            f"fit --auto: the effective batch {effective} is not a multiple of {world} ranks"
        )
    budget = (
        auto.budget_for(trainer) if args.budget is None else parse_bytes("--budget", args.budget)
    )
    device = trainer.strategy.root_device
    try:
        decision = decide_for(
            trainer,
            model,
            source,
            budget,
            effective // world,
            goal=auto.goal,
            trial=auto.trial,
            bf16=str(trainer.precision) == "32-true" and best_precision(device) == "bf16-mixed",
            trainer_fixed=False,
            host_budget_bytes=resolve_host_budget(auto.host_budget),
        )
    except (ValueError, EstimateError) as err:  # nothing fits, the data, the estimate
        exit_with_error(f"fit --auto: {err}")
    print(f"AutoEfficient (fit --auto): {decision.summary()}")
    for note in decision.notes:
        print(f"AutoEfficient: {note}")
    for warning in decision.warnings:
        print(f"AutoEfficient: warning: {warning}")
    with tempfile.TemporaryDirectory() as folder:
        plan = _plan_config(decision, Path(folder))
        final = build_cli((), [*rest, "--config", str(plan)])
    final.trainer.callbacks.append(auto.preset(decision))
    final.trainer.fit(final.model, datamodule=final.datamodule, ckpt_path=args.ckpt_path)
    return 0
