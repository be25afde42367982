"""``lightning-efficient export-zero CKPT_DIR OUT [--force]``: consolidate a ZeRO (DeepSpeed)
checkpoint directory into one plain fp32 ``state_dict`` file (:func:`export_fp32`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from lightning_efficient.core.validate import format_bytes
from lightning_efficient.techniques.zero_offload.loading import load_checkpoint_file
from lightning_efficient.techniques.zero_offload.state import export_fp32

__all__ = ["HELP", "export_zero_command"]

#: The line ``lightning-efficient --help`` shows for this command.
HELP = "consolidate a ZeRO checkpoint dir into a plain state_dict (CKPT_DIR OUT [--force])"


def export_zero_command(argv: Sequence[str]) -> int:
    """``lightning-efficient export-zero CKPT_DIR OUT``: consolidate a ZeRO checkpoint."""
    parser = argparse.ArgumentParser(
        prog="lightning-efficient export-zero",
        description="Consolidate a ZeRO (DeepSpeed) checkpoint directory into one plain fp32 "
        "state_dict file that the unmodified module loads without DeepSpeed.",
    )
    parser.add_argument("checkpoint_dir", help="the directory trainer.save_checkpoint wrote")
    parser.add_argument("out", help="the .pt file to write (never an input; see --force)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load the input with full unpickling, which can run code from the file: only for "
        "a checkpoint you trust that holds types outside the allow-list",
    )
    args = parser.parse_args(list(argv))
    try:
        out = export_fp32(
            args.checkpoint_dir, args.out, overwrite=args.force, trusted=args.trust_checkpoint
        )
    except (ValueError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = load_checkpoint_file(out)
    n = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    print(f"wrote {out}: {len(state)} tensors, {n:,} elements ({format_bytes(out.stat().st_size)})")
    return 0
