"""``lightning-efficient profile --config X.yaml [--steps N]``: runs N training steps of the config
(no validation, no checkpoints, no logger) under ``StepProfiler`` and prints its table: where a
step's time goes, FLOPs and MFU, memory, and the verdict.

Other options are passed to the config parser (e.g. ``--model.init_args.n_layer=12``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from lightning_efficient.commands.options import build_cli, command_parser, error_status
from lightning_efficient.core.validate import check_output_path, same_file
from lightning_efficient.measure.profiling.profiler import StepProfiler

__all__ = ["HELP", "profile_command"]

#: The line ``lightning-efficient --help`` shows for this command.
HELP = (
    "run N training steps and say where the time goes and what to turn on (--config X.yaml "
    "[--steps N])"
)


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
        help="also write the profile summary to this file (checked before the run; never a file "
        "the run reads nor one the config's StepProfiler writes; an existing file or link only "
        "with --force)",
    )
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    return p


def _files_read(configs: Sequence[str], rest: Sequence[str]) -> list[str]:
    """The files the run reads: the configs and every file named on the rest of the command line
    (a ``--trainer FILE`` sub-config, ``--data.init_args.path=FILE``, ...)."""
    values = [arg.partition("=")[2] if arg.startswith("-") else arg for arg in rest]
    return [*configs, *(v for v in values if v and os.path.isfile(v))]


def _exists_message(path: str) -> str:
    """Why ``--json`` needs ``--force``: an existing file, or a link (even one to nothing)."""
    if os.path.islink(path):
        target = os.readlink(path)
        what = "exists" if os.path.exists(path) else "does not exist yet"
        return (
            f"--json {path!r} is a symbolic link to {target!r}, which {what}; pass --force to "
            "write through it, or choose another file."
        )
    return f"--json {path!r} exists; pass --force to replace it, or choose another file."


def profile_command(argv: Sequence[str]) -> int:
    args, rest = _profile_parser().parse_known_args(list(argv))
    if args.steps < 2:
        return error_status(
            f"--steps must be an integer >= 2 (one warm-up step, one measured); got {args.steps}."
        )
    inputs = _files_read(args.config, rest)
    try:  # before the run: a bad path found after it loses the profile
        check_output_path("--json", args.json, inputs=inputs)
    except (TypeError, ValueError) as err:
        return error_status(str(err))
    if args.json and os.path.lexists(args.json) and not args.force:
        return error_status(_exists_message(args.json))
    forced = [
        f"--trainer.max_steps={args.steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=false",
    ]
    cli = build_cli(args.config, [*rest, *forced], save_config_callback=None)
    trainer = cli.trainer
    profiler = next((cb for cb in trainer.callbacks if isinstance(cb, StepProfiler)), None)
    if profiler is None:
        profiler = StepProfiler(skip_steps=min(2, args.steps - 1), compare_plain=True)
        trainer.callbacks.append(profiler)
    elif profiler.skip_steps >= args.steps:
        return error_status(
            f"--steps {args.steps} leaves no step to measure after the config's StepProfiler "
            f"skip_steps={profiler.skip_steps}; give more steps."
        )
    else:
        try:  # the config's own output files must not replace a config either
            for name in ("trace", "plot"):
                check_output_path(name, getattr(profiler, name), inputs=inputs)
        except (TypeError, ValueError) as err:
            return error_status(f"StepProfiler: {err}")
        for name in ("trace", "plot"):
            own = getattr(profiler, name)
            if args.json and own and same_file(own, args.json):
                return error_status(
                    f"--json {args.json!r} is the file the config's StepProfiler writes as "
                    f"`{name}`; the summary would replace it. Choose another file."
                )
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if profiler.summary is None:
        return error_status(f"no training step was measured in {args.steps} steps.")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(profiler.summary, indent=2, default=str))
    return 0
