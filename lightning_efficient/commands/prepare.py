"""``lightning-efficient prepare``: build DeepSpeed's CPU extensions ahead of time
(:func:`ensure_extensions`; once per machine, e.g. in CI or a Dockerfile)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_efficient.core.validate import missing_requirement
from lightning_efficient.techniques.zero_offload.extensions import (
    DEFAULT_EXTENSIONS,
    EXTENSIONS,
    STALE_AFTER_S,
    ExtensionBuildError,
    check_stale_after,
    ensure_extensions,
)

__all__ = ["HELP", "prepare_command"]

#: The line ``lightning-efficient --help`` shows for this command.
HELP = "build DeepSpeed's CPU extensions ahead of time (once per machine; CI, Dockerfiles)"


def prepare_command(argv: Sequence[str]) -> int:
    """``lightning-efficient prepare``: build DeepSpeed's CPU extensions ahead of time."""
    parser = argparse.ArgumentParser(
        prog="lightning-efficient prepare",
        description="Build DeepSpeed's CPU extensions that ZeROOffload uses (a one-time compile "
        "of about 2 minutes on 2 cores) into torch's extensions cache ($TORCH_EXTENSIONS_DIR, "
        "default ~/.cache/torch_extensions), so that no fit or test waits on it. Run it once "
        "after installing, e.g. in a Dockerfile or a CI step before the tests.",
    )
    parser.add_argument(
        "--extensions",
        nargs="+",
        choices=list(EXTENSIONS),
        default=list(DEFAULT_EXTENSIONS),
        help=f"which to build (default: {' '.join(DEFAULT_EXTENSIONS)})",
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=STALE_AFTER_S,
        help="seconds after which a build lock no process holds is removed "
        f"(default {STALE_AFTER_S:.0f})",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(list(argv))
    try:
        check_stale_after(args.stale_after)
    except ValueError as err:  # e.g. nan: no lock would ever be old enough (a wait without end)
        print(f"error: --stale-after: {err}", file=sys.stderr)
        return 2
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print(f"error: {missing_requirement('deepspeed', 'prepare')}", file=sys.stderr)
        return 2
    try:
        done = ensure_extensions(
            args.extensions, stale_after=args.stale_after, out=sys.stdout, verbose=args.verbose
        )
    except ExtensionBuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for ext in done:
        where = f" (cached in {ext.folder})" if ext.folder else ""
        what = {
            "built": f"built in {ext.seconds:.0f} s",
            "cached": "already built",
            "installed": "prebuilt with DeepSpeed",
            "not used": "not used on this machine's accelerator",
        }[ext.status]
        print(f"{ext.name}: {what}{where}")
    return 0
