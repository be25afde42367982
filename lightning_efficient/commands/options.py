"""The options several commands take, declared once, and what the commands share: a short error
(:func:`error_status`), a LightningCLI built from a command line without running (:func:`build_cli`) and
a config's model, batch and trainer built without fitting (:func:`config_workload`)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lightning_efficient.commands.cli import EfficientCLI
from lightning_efficient.core.validate import without_module_trees
from lightning_efficient.measure.memory.estimate import PRECISIONS

__all__ = ["OPTIONS", "build_cli", "command_parser", "config_workload", "error_status"]


#: The options several commands take, declared once: name -> (flag, argparse keywords, what the
#: default is when the command gives none).
OPTIONS: dict[str, tuple[str, dict[str, Any], str]] = {
    "config": (
        "--config",
        {"required": True, "action": "append", "help": "LightningCLI yaml (repeatable)"},
        "",
    ),
    "precision": ("--precision", {"choices": PRECISIONS}, "the config's trainer.precision"),
    "batch_size": (
        "--batch-size",
        {"type": int, "help": "override the datamodule's batch_size (one rank's batch)"},
        "the config's",
    ),
    "steps": ("--steps", {"type": int, "help": "optimizer steps to run"}, ""),
    "device": (
        "--device",
        {
            "help": "the device to model: cpu, cuda (this machine's GPU, else the H100/H200 "
            "class), cuda:sm80, cuda:a100, ..."
        },
        "the config's trainer's",
    ),
    "devices": ("--devices", {"type": int, "help": "processes per node"}, "the config's"),
    "num_nodes": ("--num-nodes", {"type": int, "help": "nodes"}, "the config's"),
}


def command_parser(
    command: str, description: str, options: Sequence[str], **defaults: Any
) -> argparse.ArgumentParser:
    """The parser of ``lightning-efficient <command>`` with the shared ``options`` (names of
    :data:`OPTIONS`, in that order); ``defaults`` give an option a default of its own. The command
    adds the options only it takes."""
    p = argparse.ArgumentParser(prog=f"lightning-efficient {command}", description=description)
    for name in options:
        flag, kwargs, default_text = OPTIONS[name]
        kwargs = {"default": None, **kwargs}
        if name in defaults:
            kwargs["default"], default_text = defaults[name], str(defaults[name])
        if default_text:
            kwargs["help"] = f"{kwargs.get('help', '')} (default: {default_text})".lstrip()
        p.add_argument(flag, **kwargs)
    return p


def error_status(message: str) -> int:
    """Print a short error for a command and return the exit status (2) for the command to
    return (it does not exit: :func:`~lightning_efficient.commands.cli.exit_with_error` does); a
    module's printed tree in it (an error the user's model raised) reads ``Name(...)``."""
    print(f"error: {without_module_trees(message)}", file=sys.stderr)
    return 2


def build_cli(configs: Sequence[str], args: Sequence[str] = (), **kwargs: Any) -> EfficientCLI:
    """The LightningCLI of ``--config`` files ``configs`` then the command-line ``args``, built
    without running (``kwargs`` go to ``EfficientCLI``); LightningCLI's note that ``args`` are meant
    for tests is silenced."""
    cli_args: list[str] = []
    for cfg in configs:
        cli_args += ["--config", cfg]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        return EfficientCLI(args=cli_args + list(args), run=False, **kwargs)


def config_workload(configs: Sequence[str], rest: Sequence[str], batch_size: int | None) -> Any:
    """Build a config's model, datamodule and trainer (without fitting) and take one training
    batch. Returns ``(model, batch, trainer, precision)``, or an exit code after an error."""
    if batch_size is not None and batch_size < 1:
        return error_status(f"--batch-size must be an integer >= 1; got {batch_size}.")
    cli = build_cli(configs, rest)
    model, trainer = cli.model, cli.trainer
    data = cli.datamodule if cli.datamodule is not None else model  # a model's own loaders
    if batch_size is not None:
        if not hasattr(data, "batch_size"):
            return error_status(
                f"--batch-size: the {'datamodule' if data is not model else 'model'} "
                f"{type(data).__name__} has no `batch_size` attribute."
            )
        data.batch_size = batch_size
    batch = _one_batch(data)
    hook = getattr(model, "configure_model", None)
    if callable(hook):
        hook()
    return model, batch, trainer, _trainer_precision(trainer)


def _trainer_precision(trainer: Any) -> str:
    value = str(getattr(trainer, "precision", "32-true"))
    return value if value in PRECISIONS else "32-true"


def _one_batch(data: Any) -> Any:
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))
