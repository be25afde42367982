"""Reading checkpoint files without running code from them.

``torch.load(..., weights_only=False)`` unpickles anything, so a crafted ``.ckpt`` runs code on
load. Here every user-supplied file loads with ``weights_only=True`` and an allow-list of the few
types real checkpoints hold (:func:`safe_types`); a file that needs more is refused with an
error that says how to opt in for a trusted file. Empty, truncated and non-checkpoint files
fail with an error that names the file, before torch sees them.

- :func:`load_checkpoint_file`: one file, checked and loaded safely (or trusted).
- :func:`check_checkpoint_directory`: every shard of a DeepSpeed checkpoint directory checked.
- :func:`weights_only_loading`: a block in which ``torch.load`` accepts the allow-list, and,
  with ``force=True``, loads with ``weights_only=True`` even where a library (DeepSpeed's
  loaders) passes ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "safe_types",
    "weights_only_loading",
    "check_checkpoint_file",
    "check_checkpoint_directory",
    "load_checkpoint_file",
]

#: torch's switch (read on every ``torch.load``) that forces ``weights_only=True``.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: empty, truncated, damaged or not a checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds objects outside the allow-list (loading it could run code)."""


def safe_types() -> list[type]:
    """Types a real checkpoint may hold besides tensors and Python literals: DeepSpeed's ZeRO
    shard files (stage enum, loss scaler, fragment addresses) and paths in hyperparameters."""
    import pathlib

    types: list[type] = [
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ]
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        types += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    return types


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


@contextlib.contextmanager
def weights_only_loading(force: bool = False) -> Iterator[None]:
    """``torch.load`` inside this block accepts :func:`safe_types` with ``weights_only=True``;
    with ``force`` it loads with ``weights_only=True`` even where the caller passes False."""
    with torch.serialization.safe_globals(safe_types()):
        if not force:
            yield
            return
        before = os.environ.get(FORCE_WEIGHTS_ONLY)
        os.environ[FORCE_WEIGHTS_ONLY] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(FORCE_WEIGHTS_ONLY, None)
            else:
                os.environ[FORCE_WEIGHTS_ONLY] = before


def check_checkpoint_file(path: str | os.PathLike) -> Path:
    """Raise ``CheckpointError`` naming ``path`` when it is missing, empty, truncated or not a
    file ``torch.save`` wrote; return it as a ``Path``. Reads the first bytes and the zip index
    only (a file ``torch.save`` writes is a zip archive; older ones start with a pickle)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist.")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a directory, not a file.")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is empty (0 bytes): the file is truncated (an interrupted "
            "save?); use an earlier checkpoint."
        )
    with path.open("rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        if not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is truncated or damaged ({size:,} bytes, its zip "
                "index is missing): use an earlier checkpoint."
            )
    elif not head.startswith(b"\x80"):
        raise CheckpointError(
            f"{str(path)!r} is not a PyTorch checkpoint (it starts with {head!r}; a text file?)."
        )
    return path


def unsafe_globals(path: str | os.PathLike) -> list[str]:
    """The classes and functions a checkpoint file would import that are not allowed (zip
    checkpoints; an empty list when the file cannot be inspected)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - an old-format or damaged file: torch.load says more
        return []
    allowed = {_qualname(t) for t in safe_types()}
    return sorted(n for n in names if n not in allowed)


def _refused(path: Path, how_to_trust: str, names: list[str]) -> UnsafeCheckpointError:
    held = f" ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})" if names else ""
    return UnsafeCheckpointError(
        f"refusing to load {str(path)!r}: it holds objects outside the types a checkpoint "
        f"needs{held}, and unpickling them could run code. If you trust the file, "
        f"{how_to_trust}."
    )


def load_checkpoint_file(
    path: str | os.PathLike,
    *,
    trusted: bool = False,
    how_to_trust: str = "pass trusted=True",
    load: Callable[[Any, bool], Any] | None = None,
) -> Any:
    """Load a user-supplied checkpoint file safely: ``weights_only=True`` with
    :func:`safe_types` unless ``trusted``. Raises ``CheckpointError`` (empty, truncated, not a
    checkpoint) or ``UnsafeCheckpointError`` (needs other types; the message says how to opt in:
    ``how_to_trust``), naming the file.

    ``load(path, weights_only)`` reads the file (default: ``torch.load`` to the CPU); a path
    that is not a local file (a URL ``load`` understands) skips the local checks.
    """
    if load is None:
        path = check_checkpoint_file(path)

        def load(p: Any, weights_only: bool) -> Any:
            return torch.load(p, map_location="cpu", weights_only=weights_only)

    elif os.path.exists(path):
        path = check_checkpoint_file(path)
    try:
        if trusted:
            return load(path, False)
        with weights_only_loading():
            return load(path, True)
    except pickle.UnpicklingError as err:
        if trusted:
            raise CheckpointError(f"checkpoint {str(path)!r} cannot be unpickled: {err}") from err
        raise _refused(Path(path), how_to_trust, unsafe_globals(path)) from None
    except (EOFError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or damaged ({first}): use an earlier "
            "checkpoint."
        ) from err


def check_checkpoint_directory(
    directory: str | os.PathLike, *, trusted: bool = False, how_to_trust: str = "pass trusted=True"
) -> list[Path]:
    """Check every ``*.pt`` shard of a DeepSpeed checkpoint directory (and its tag folders) as
    :func:`check_checkpoint_file` does, and, unless ``trusted``, refuse one that holds types
    outside the allow-list (``UnsafeCheckpointError`` naming the shard). Returns the shards."""
    root = Path(directory)
    shards = sorted([*root.glob("*.pt"), *root.glob("*/*.pt")])
    for shard in shards:
        check_checkpoint_file(shard)
        if not trusted:
            names = unsafe_globals(shard)
            if names:
                raise _refused(shard, how_to_trust, names)
    return shards
