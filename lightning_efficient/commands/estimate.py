"""``lightning-efficient estimate --config X.yaml [--precision P] [--batch-size N]``: builds the
model, datamodule and trainer callbacks of a LightningCLI config (without fitting), takes one
batch of the training dataloader and prints the memory estimate's breakdown table.

Other options are passed to the config parser (e.g. ``--model.init_args.n_layer=12``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lightning_efficient.commands.options import command_parser, config_workload, error_status
from lightning_efficient.core.report import print_table
from lightning_efficient.measure.memory.estimate import EstimateError, estimate_memory
from lightning_efficient.measure.memory.per_rank import SHARDINGS, world_size_of
from lightning_efficient.measure.memory.settings import estimate_settings
from lightning_efficient.measure.memory.targets import resolve_target

__all__ = ["HELP", "estimate_command"]

#: The line ``lightning-efficient --help`` shows for this command.
HELP = (
    "print the memory estimate of a config's model (--config X.yaml [--precision P] "
    "[--batch-size N])"
)


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
        return error_status(str(err))
    optimizer = args.optimizer or "configured optimizer"
    title = f"{type(model).__name__}, batch {_batch_shape(batch)}, {precision}, {optimizer}"
    if world > 1 or sharding:
        title += f", one rank of {world} ({sharding or 'ddp'})"
    if args.markdown:
        print(f"{title}, on {est.target}\n\n{est.to_markdown()}")
    else:
        print_table(est.table(title=title))
    return 0


def _batch_shape(batch: Any) -> str:
    import torch

    from lightning_efficient.core._internals import tree_flatten

    shapes = [tuple(t.shape) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return "x".join(map(str, shapes[0])) if shapes else "?"
