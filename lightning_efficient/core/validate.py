"""Argument checks shared by every technique.

One helper per kind of check, so that every message has the same shape: the argument's name,
what was given, and what is allowed. Techniques call these in ``__init__`` (contract item 3).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "SettingsError",
    "check_choice",
    "check_int",
    "check_float",
    "check_bool",
    "check_module",
    "check_output_path",
    "same_file",
    "parse_bytes",
    "format_bytes",
    "import_object",
    "missing_extra",
    "missing_requirement",
    "error_text",
    "without_module_trees",
]


class SettingsError(ValueError):
    """Settings that cannot work together or cannot be met, found when fit starts (a conflict
    between techniques, a memory budget no setting reaches). The command line prints it as a
    short ``error:`` line instead of a traceback."""


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``; else raise a ``ValueError`` naming ``name``."""
    choices = tuple(choices)
    if isinstance(value, bool) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {allowed}; got {_given(value)}.")
    return value


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Check that ``value`` is an int (not a bool) within ``[minimum, maximum]``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        what = "an integer" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {what}; got {_given(value)}.")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be {_range(minimum, maximum)}; got {value!r}.")
    return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    max_exclusive: bool = False,
    allow_none: bool = False,
) -> float | None:
    """Check that ``value`` is a real number within ``[minimum, maximum]`` (or ``maximum)``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = "a number" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {what}; got {_given(value)}.")
    value = float(value)
    too_high = maximum is not None and (value >= maximum if max_exclusive else value > maximum)
    if value != value or (minimum is not None and value < minimum) or too_high:
        raise ValueError(
            f"`{name}` must be {_range(minimum, maximum, max_exclusive)}; got {value!r}."
        )
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False; got {_given(value)}.")
    return value


def check_module(name: str, value: Any) -> Any:
    """Return ``value`` if it is a ``torch.nn.Module``; else raise a ``TypeError`` naming
    ``name`` (what an ``apply_*`` changes in place)."""
    from torch import nn

    if not isinstance(value, nn.Module):
        raise TypeError(f"`{name}` must be a torch.nn.Module; got {_given(value)}.")
    return value


def check_output_path(
    name: str,
    value: Any,
    *,
    inputs: Iterable[Any] = (),
    allow_none: bool = True,
) -> str | None:
    """Check a file the user asks us to write, before anything runs, and return it as a ``str``.

    Refused (``ValueError``, naming ``name``): an existing folder; a folder that does not exist
    or that this user cannot write to; an existing file this user cannot write; one of
    ``inputs`` (files the run reads, e.g. its configs: written over, they would be lost).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not str(value):
        what = "a file path (str)" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {what}; got {_given(value)}.")
    path = Path(value)
    folder = path.parent
    if path.is_dir():
        raise ValueError(
            f"`{name}` {str(path)!r} is a folder; give the file to write, e.g. "
            f"{str(path / ('out' + (path.suffix or '.json')))!r}."
        )
    if not folder.is_dir():
        raise ValueError(
            f"`{name}` {str(path)!r}: its folder {str(folder)!r} does not exist; create it or "
            "choose another path."
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"`{name}` {str(path)!r}: the folder {str(folder)!r} is not writable.")
    if path.exists():
        for source in inputs:
            if source is not None and Path(source).exists() and same_file(source, path):
                raise ValueError(
                    f"`{name}` {str(path)!r} is an input of this run; writing it would replace "
                    "it. Choose another file."
                )
        if not os.access(path, os.W_OK):
            raise ValueError(f"`{name}` {str(path)!r} exists and is not writable.")
    return str(value)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether the paths ``a`` and ``b`` name one file: the same path once symbolic links are
    followed (the file need not exist yet), or, both existing, the same file on disk (a hard
    link)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _range(minimum: Any, maximum: Any, max_exclusive: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return f"in [{minimum}, {maximum}{')' if max_exclusive else ']'}"
    if minimum is not None:
        return f">= {minimum}"
    return f"{'<' if max_exclusive else '<='} {maximum}"


def parse_bytes(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    """Parse a memory size given as bytes (int) or a string such as ``"24GiB"`` or ``"500MB"``.

    Binary units (KiB, MiB, GiB, TiB and the short K, M, G, T) are powers of 1024; decimal units
    (KB, MB, GB, TB) are powers of 1000.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a number of bytes or a string like '24GiB'; got {_given(value)}."
        )
    if isinstance(value, (int, float)):
        return _whole_bytes(name, value, repr(value))
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}` could not be read as a memory size: {value!r}. Use bytes or a number "
                "with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of "
                "1024), e.g. '24GiB' or '500MB'."
            )
        return _whole_bytes(name, float(match.group(1)) * _UNITS[unit], repr(value))
    raise TypeError(
        f"`{name}` must be a number of bytes or a string like '24GiB'; got {_given(value)}."
    )


def _whole_bytes(name: str, size: float, given: str) -> int:
    """A size of at least one byte, finite (a fraction of a byte is not a budget)."""
    if size != size or size in (float("inf"), float("-inf")):
        raise ValueError(f"`{name}` must be a finite memory size; got {given}.")
    if size < 1:
        raise ValueError(
            f"`{name}` must be a memory size of at least 1 byte; got {given}"
            + (f" ({size:g} bytes)." if size > 0 else ".")
        )
    return int(size)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def import_object(name: str, path: str) -> Any:
    """Import ``"package.module.Object"``; errors name the argument that held the path."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"`{name}` must be a dotted import path like 'torch.optim.AdamW'; got {path!r}."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"`{name}`: could not import module {module_name!r} ({err}).") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"`{name}`: module {module_name!r} has no attribute {attr!r}.") from err


def missing_extra(package: str, extra: str, purpose: str) -> ImportError:
    """The error for a missing optional dependency, with the exact command that installs it."""
    return ImportError(
        f"{purpose} needs the optional dependency `{package}`, which is not installed. "
        f"Install it with: pip install 'lightning-efficient[{extra}]'"
    )


def _requirement(package: str) -> str:
    """``package`` as this installation requires it (``deepspeed>=0.14,<0.20``), read from the
    installed metadata; the bare name where that cannot be read."""
    from importlib import metadata

    try:
        requires = metadata.requires("lightning-efficient") or []
    except metadata.PackageNotFoundError:
        return package
    for line in requires:
        spec = line.split(";")[0].strip()
        name = re.split(r"[\[<>=!~ ]", spec, maxsplit=1)[0]
        if name.lower().replace("_", "-") == package.lower() and "extra ==" not in line:
            return spec
    return package


def missing_requirement(package: str, purpose: str) -> ImportError:
    """The error for an install requirement that is missing here (a partial or broken install):
    the base install has it, so the fix is to install it, in the range the package needs."""
    return ImportError(
        f"{purpose} needs `{package}`, an install requirement of lightning-efficient that is not "
        f"installed here. Install it with: pip install '{_requirement(package)}'"
    )


#: A module's printed tree inside an error message (Python's "X(...) argument after ** must be a
#: mapping" repeats the callable's repr: a whole model, hundreds of lines).
_MODULE_TREE = re.compile(r"(\w+)\(\n.*\n\)", re.S)


def without_module_trees(text: str) -> str:
    """``text`` with each module's printed tree shortened to ``Name(...)``."""
    return _MODULE_TREE.sub(r"\1(...)", text)


def error_text(err: BaseException, limit: int = 300) -> str:
    """``"TypeError: message"`` for a note or a warning: a module's printed tree shortened to
    ``Name(...)``, the whole cut to ``limit`` characters."""
    text = " ".join(without_module_trees(str(err)).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"
