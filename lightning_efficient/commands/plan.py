"""``lightning-efficient plan --config my.yaml --budget 24GiB [--devices 8 --num-nodes 2]``: the
planner (:func:`lightning_efficient.planning.plan_stack`) on a config's model and one batch of its
data; prints the table of the rungs tried and the yaml to add to the config.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lightning_efficient.commands.options import command_parser, config_workload, error_status
from lightning_efficient.core.report import print_table
from lightning_efficient.core.validate import check_int, format_bytes, parse_bytes
from lightning_efficient.measure.memory.settings import estimate_settings
from lightning_efficient.measure.memory.targets import is_local_gpu, resolve_target
from lightning_efficient.planning import plan_stack

__all__ = ["HELP", "plan_command"]

#: The line ``lightning-efficient --help`` shows for this command.
HELP = "pick the techniques that fit a memory budget (--config X.yaml --budget 24GiB)"


def _parser() -> argparse.ArgumentParser:
    p = command_parser(
        "plan",
        "Pick the cheapest stack of techniques whose estimated peak fits a memory budget.",
        ("config", "batch_size", "precision", "devices", "num_nodes", "device"),
        device="cuda",
    )
    p.add_argument("--budget", required=True, help="device memory budget (one rank's), e.g. 24GiB")
    p.add_argument(
        "--host-budget",
        help="host memory the offloading stacks may keep, e.g. 64GiB (default: what this "
        "machine has available)",
    )
    p.add_argument("--no-bf16", action="store_true", help="the target device has no bf16")
    p.add_argument(
        "--all", action="store_true", help="estimate every rung, not just up to the first fit"
    )
    p.add_argument(
        "--no-trial",
        action="store_true",
        help="on a machine with the GPU planned for: do not confirm the pick with real steps",
    )
    return p


def plan_command(argv: Sequence[str]) -> int:
    args, rest = _parser().parse_known_args(list(argv))
    try:
        budget = parse_bytes("--budget", args.budget)
        host = parse_bytes("--host-budget", args.host_budget, allow_none=True)
        for name, value in (("--devices", args.devices), ("--num-nodes", args.num_nodes)):
            if value is not None:
                check_int(name, value, minimum=1)
        target = resolve_target(args.device)
    except (TypeError, ValueError) as err:
        return error_status(str(err).replace("`device`", "--device"))
    work = config_workload(args.config, rest, args.batch_size)
    if isinstance(work, int):
        return work
    model, batch, trainer, _ = work
    precision = args.precision or work[3]
    settings = estimate_settings(trainer)
    devices, num_nodes, world_size = _ranks(trainer, args.devices, args.num_nodes, settings)
    sharding = settings["sharding"] if world_size > 1 else None
    if world_size > 1 and sharding is None:
        sharding = "ddp"
    result = plan_stack(
        model,
        batch,
        budget,
        precision=precision,
        bf16=not args.no_bf16,
        try_all=args.all,
        accumulate_grad_batches=settings["accumulate_grad_batches"],
        optimizer=settings["optimizer"],
        configured=settings["callbacks"],
        world_size=world_size,
        sharding=sharding,
        device=target,
        # this machine's own GPU: the pick runs real steps within the budget before it is given
        confirm=not args.no_trial and is_local_gpu(args.device) and world_size == 1,
        host_budget=host,
    )
    if result.not_estimable is not None:
        return error_status(
            f"the model cannot be estimated, so no stack can be planned: {result.not_estimable}"
        )
    print_table(result.table())
    if result.chosen is None:
        return error_status(
            f"no stack fits {format_bytes(budget)}: lower the batch size or sequence length, or "
            "use more devices."
        )
    yaml_text = result.to_yaml(devices=devices, num_nodes=num_nodes)
    print(f"\nAdd to your config ({result.chosen.name}):\n\n{yaml_text}")
    advice = result.fragmentation_advice()
    if advice:
        print(advice)
    return 0


def _ranks(
    trainer: Any, devices: int | None, num_nodes: int | None, settings: dict[str, Any]
) -> tuple[int | None, int | None, int]:
    """``(devices, num_nodes, world_size)``: the ones given on the command line, else the
    config's trainer's (``None``: not given, so not written to the yaml)."""
    if devices is None and num_nodes is None:
        return None, None, int(settings.get("world_size", 1) or 1)
    per_node = devices if devices is not None else _trainer_devices(trainer)
    nodes = num_nodes if num_nodes is not None else int(getattr(trainer, "num_nodes", 1) or 1)
    return devices, num_nodes, per_node * nodes


def _trainer_devices(trainer: Any) -> int:
    """Processes per node of a built trainer (its devices; 1 when it does not say)."""
    devices = getattr(trainer, "num_devices", None)
    return int(devices) if isinstance(devices, int) and devices >= 1 else 1
