"""Commands that are not trainer methods: ``estimate`` and ``profile``.

- ``lightning-efficient estimate --config X.yaml [--precision P] [--batch-size N]`` builds the
  model, datamodule and trainer callbacks of a LightningCLI config (without fitting), takes one
  batch of the training dataloader and prints the memory estimate's breakdown table.
- ``lightning-efficient profile --config X.yaml [--steps N]`` runs N training steps of the config
  (no validation, no checkpoints, no logger) under ``StepProfiler`` and prints its table: where a
  step's time goes, FLOPs and MFU, memory, and the verdict.

Other options are passed to the config parser (e.g. ``--model.init_args.n_layer=12``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_efficient.core.validate import check_output_path
from lightning_efficient.measure.estimate import PRECISIONS, EstimateError, estimate_memory
from lightning_efficient.measure.per_rank import SHARDINGS, world_size_of
from lightning_efficient.measure.settings import estimate_settings
from lightning_efficient.measure.targets import resolve_target

__all__ = [
    "OPTIONS",
    "command_parser",
    "estimate_command",
    "profile_command",
    "config_workload",
    "fail",
]


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


def _parser() -> argparse.ArgumentParser:
    p = command_parser(
        "estimate",
        "Print the memory of training steps of a config's model on one batch, estimated on "
        "fake tensors (no GPU, no allocation).",
        ("config", "precision", "batch_size", "steps", "device", "devices", "num_nodes"),
        steps=2,
    )
    p.add_argument(
        "--optimizer",
        default=None,
        help="adamw | adam | sgd | an Optimizer class path (default: what the model's "
        "configure_optimizers returns)",
    )
    p.add_argument(
        "--cuda-rounding", action="store_true", help="round allocations as the CUDA allocator does"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks the state is divided over (default: --devices x --num-nodes, else the "
        "config's trainer's)",
    )
    p.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default=None,
        help="how the state is divided: ddp (default with several ranks), full / grad_op "
        "(FSDP), zero1 / zero2 / zero3 (default: the config's strategy's); the table is one "
        "rank's peak",
    )
    p.add_argument("--markdown", action="store_true", help="print Markdown instead of a rich table")
    return p


def fail(message: str) -> int:
    """Print a short error for a command and return its exit code (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def config_workload(configs: Sequence[str], rest: Sequence[str], batch_size: int | None) -> Any:
    """Build a config's model, datamodule and trainer (without fitting) and take one training
    batch. Returns ``(model, batch, trainer, precision)``, or an exit code after an error."""
    if batch_size is not None and batch_size < 1:
        return fail(f"--batch-size must be an integer >= 1; got {batch_size}.")
    from lightning_efficient.cli import EfficientCLI

    cli_args: list[str] = []
    for cfg in configs:
        cli_args += ["--config", cfg]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = EfficientCLI(args=cli_args + list(rest), run=False)
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    if batch_size is not None:
        if not hasattr(data, "batch_size"):
            return fail(
                f"--batch-size: the datamodule {type(data).__name__} has no `batch_size` attribute."
            )
        data.batch_size = batch_size
    batch = _one_batch(data)
    hook = getattr(model, "configure_model", None)
    if callable(hook):
        hook()
    return model, batch, trainer, _trainer_precision(trainer)


def estimate_command(argv: Sequence[str]) -> int:
    args, rest = _parser().parse_known_args(list(argv))
    work = config_workload(args.config, rest, args.batch_size)
    if isinstance(work, int):
        return work
    model, batch, trainer, precision = work
    precision = args.precision or precision
    settings = estimate_settings(trainer)
    settings["precision"] = precision
    if args.optimizer is not None:
        settings["optimizer"] = args.optimizer
    try:
        world = args.world_size or settings["world_size"]
        if args.world_size is None and (args.devices is not None or args.num_nodes is not None):
            world = world_size_of(
                args.devices if args.devices is not None else getattr(trainer, "num_devices", 1),
                args.num_nodes if args.num_nodes is not None else trainer.num_nodes,
            )
        sharding = args.sharding or settings["sharding"]
        settings["world_size"], settings["sharding"] = world, sharding
        if args.device is not None:
            settings["device"] = resolve_target(args.device)
        est = estimate_memory(
            model,
            batch,
            steps=args.steps,
            **settings,
            cuda_rounding=True if args.cuda_rounding else None,
        )
    except (EstimateError, ValueError, TypeError) as err:
        return fail(str(err))
    optimizer = args.optimizer or "configured optimizer"
    title = f"{type(model).__name__}, batch {_batch_shape(batch)}, {precision}, {optimizer}"
    if world > 1 or sharding:
        title += f", one rank of {world} ({sharding or 'ddp'})"
    if args.markdown:
        print(f"{title}, on {est.target}\n\n{est.to_markdown()}")
    else:
        from rich.console import Console

        Console().print(est.table(title=title))
    return 0


def _trainer_precision(trainer: Any) -> str:
    value = str(getattr(trainer, "precision", "32-true"))
    return value if value in PRECISIONS else "32-true"


def _one_batch(data: Any) -> Any:
    data.prepare_data()
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _batch_shape(batch: Any) -> str:
    import torch

    from lightning_efficient.core._internals import tree_flatten

    shapes = [tuple(t.shape) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return "x".join(map(str, shapes[0])) if shapes else "?"


# -- profile ---------------------------------------------------------------------------------
def _profile_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "profile",
        "Run N training steps of a config under StepProfiler and print where a step's time "
        "goes, FLOPs and MFU, memory, and what to turn on next.",
        ("config", "steps"),
        steps=20,
    )
    p.add_argument(
        "--json",
        default=None,
        help="also write the profile summary to this file (checked before the run; never one of "
        "the configs; an existing file only with --force)",
    )
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    return p


def profile_command(argv: Sequence[str]) -> int:
    args, rest = _profile_parser().parse_known_args(list(argv))
    if args.steps < 2:
        return fail(
            f"--steps must be an integer >= 2 (one warm-up step, one measured); got {args.steps}."
        )
    try:  # before the run: a bad path found after it loses the profile
        check_output_path("--json", args.json, inputs=args.config)
    except (TypeError, ValueError) as err:
        return fail(str(err))
    if args.json and Path(args.json).exists() and not args.force:
        return fail(
            f"--json {args.json!r} exists; pass --force to replace it, or choose another file."
        )
    from lightning_efficient.cli import EfficientCLI
    from lightning_efficient.measure.profiler import StepProfiler

    cli_args: list[str] = []
    for cfg in args.config:
        cli_args += ["--config", cfg]
    forced = [
        f"--trainer.max_steps={args.steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = EfficientCLI(
            args=cli_args + list(rest) + forced, run=False, save_config_callback=None
        )
    trainer = cli.trainer
    profiler = next((cb for cb in trainer.callbacks if isinstance(cb, StepProfiler)), None)
    if profiler is None:
        profiler = StepProfiler(skip_steps=min(2, args.steps - 1), compare_plain=True)
        trainer.callbacks.append(profiler)
    elif profiler.skip_steps >= args.steps:
        return fail(
            f"--steps {args.steps} leaves no step to measure after the config's StepProfiler "
            f"skip_steps={profiler.skip_steps}; give more steps."
        )
    else:
        try:  # the config's own output files must not replace a config either
            for name in ("trace", "png"):
                check_output_path(name, getattr(profiler, name), inputs=args.config)
        except (TypeError, ValueError) as err:
            return fail(f"StepProfiler: {err}")
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if profiler.summary is None:
        return fail(f"no training step was measured in {args.steps} steps.")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(profiler.summary, indent=2, default=str))
    return 0
