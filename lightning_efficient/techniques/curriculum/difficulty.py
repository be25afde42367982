"""Difficulty of every sample of a dataset, and the easiest-first order a curriculum follows.

``difficulty_scores(dataset, source)`` reads one finite number per dataset index (higher is
harder) from one of these sources:

- ``"entropy"``: Shannon entropy (bits per token) of the sample's token histogram (its first
  token tensor: ``input_ids`` of a dict, the first tensor of a tuple, or the tensor itself);
- ``"length"``: the sample's token count (non-padding tokens when it holds an
  ``attention_mask``);
- ``"attr:NAME"``: a dataset attribute holding one score per index (through ``Subset``);
- ``"field:NAME"``: a field of every sample (a dict key or an attribute);
- ``"fn:package.module.function"``: a callable ``function(sample) -> float``, by import path;
- ``"file:PATH"``: a precomputed file of scores (``.pt``, ``.npy``, ``.json``, or text with one
  number per line);
- a sequence of numbers, or a callable ``(sample) -> float`` (from Python).

``easiest_first(scores, seed)`` is the order of the curriculum: ascending difficulty, ties broken
by a seeded shuffle (so equal scores do not favour low indices).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_efficient.core.validate import check_int, import_object

__all__ = [
    "DIFFICULTY_BUILTINS",
    "DIFFICULTY_PREFIXES",
    "MAX_SEED",
    "check_difficulty",
    "check_seed",
    "difficulty_scores",
    "easiest_first",
    "token_entropy",
    "token_count",
    "load_scores",
]

DIFFICULTY_BUILTINS: tuple[str, ...] = ("entropy", "length")
DIFFICULTY_PREFIXES: tuple[str, ...] = ("attr:", "field:", "fn:", "file:")
_SCORE_FILES = (".pt", ".pth", ".npy", ".json", ".txt", ".csv")


#: Seeds as Lightning's ``seed_everything`` takes them (the shuffles' generators are seeded from
#: ``seed`` times a constant plus the epoch, which must stay within torch's 64-bit seeds).
MAX_SEED = 2**32 - 1


def check_seed(seed: Any, name: str = "seed") -> int:
    """A curriculum seed: an int in [0, 2**32 - 1]."""
    return check_int(name, seed, minimum=0, maximum=MAX_SEED)


def _allowed() -> str:
    return (
        "'entropy', 'length', 'attr:NAME' (a dataset attribute), 'field:NAME' (a field of each "
        "sample), 'fn:package.module.function' (a callable sample -> float), 'file:PATH' (a "
        f"{'/'.join(_SCORE_FILES)} file of scores), or a sequence of numbers"
    )


def check_difficulty(source: Any) -> Any:
    """Check the form of a difficulty source at construction (files are read at fit start)."""
    if callable(source) and not isinstance(source, str):
        return source
    if isinstance(source, str):
        if source in DIFFICULTY_BUILTINS:
            return source
        prefix = next((p for p in DIFFICULTY_PREFIXES if source.startswith(p)), None)
        rest = source[len(prefix) :] if prefix else ""
        if prefix is None or not rest.strip():
            raise ValueError(f"`difficulty` must be {_allowed()}; got {source!r}.")
        if prefix == "fn:":
            fn = import_object("difficulty", rest)
            if not callable(fn):
                raise TypeError(f"`difficulty`: {rest!r} is a {type(fn).__name__}, not a callable.")
        if prefix == "file:" and not rest.lower().endswith(_SCORE_FILES):
            raise ValueError(
                f"`difficulty`: the scores file {rest!r} must end in one of "
                f"{', '.join(_SCORE_FILES)}."
            )
        return source
    if isinstance(source, (Sequence, torch.Tensor)) and not isinstance(source, bytes):
        values = list(source.tolist() if isinstance(source, torch.Tensor) else source)
        if not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(
                f"`difficulty` as a sequence must hold numbers, one per sample; got {source!r:.80}."
            )
        return values
    raise TypeError(f"`difficulty` must be {_allowed()}; got {source!r} ({type(source).__name__}).")


# -- built-in scorers ---------------------------------------------------------------------------
def _tokens_of(sample: Any) -> torch.Tensor | None:
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, Mapping):
        if "input_ids" in sample:
            return torch.as_tensor(sample["input_ids"])
        return next((torch.as_tensor(v) for v in sample.values() if _is_tokens(v)), None)
    if isinstance(sample, (tuple, list)):
        return next((torch.as_tensor(v) for v in sample if _is_tokens(v)), None)
    return None


def _is_tokens(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], int)
    )


def _need_tokens(sample: Any, what: str) -> torch.Tensor:
    tokens = _tokens_of(sample)
    if tokens is None or tokens.numel() == 0 or tokens.is_floating_point():
        raise ValueError(
            f"difficulty {what!r} needs samples that hold integer token ids (a tensor, a tuple "
            f"whose first tensor holds them, or a dict with 'input_ids'); found {_describe(sample)}."
        )
    return tokens


def token_entropy(sample: Any) -> float:
    """Shannon entropy, in bits per token, of the sample's token histogram."""
    tokens = _need_tokens(sample, "entropy").flatten().long()
    counts = torch.bincount(tokens - tokens.min()).double()
    p = counts[counts > 0] / tokens.numel()
    return float(-(p * p.log2()).sum())


def token_count(sample: Any) -> float:
    """Tokens in the sample; with an ``attention_mask``, only the attended ones."""
    if isinstance(sample, Mapping) and "attention_mask" in sample:
        return float(torch.as_tensor(sample["attention_mask"]).sum())
    return float(_need_tokens(sample, "length").numel())


def _describe(sample: Any) -> str:
    if isinstance(sample, torch.Tensor):
        return f"a {str(sample.dtype).replace('torch.', '')} tensor of shape {tuple(sample.shape)}"
    if isinstance(sample, Mapping):
        return "a dict with keys " + ", ".join(map(repr, list(sample)[:8]))
    if isinstance(sample, (tuple, list)):
        inner = ", ".join(_describe(x) for x in list(sample)[:4])
        return f"a {type(sample).__name__} of ({inner})"
    return f"a {type(sample).__name__}"


# -- sources ------------------------------------------------------------------------------------
def load_scores(path: str | Path) -> list[float]:
    """Scores from a ``.pt``/``.pth`` (1-D tensor or flat list), ``.npy`` (1-D array), ``.json``
    (flat list) or text file (one number per line or comma-separated). Anything else, a file
    that cannot be read, or a score that is not a number is a ``ValueError`` naming the file."""
    path = Path(path)
    where = f"`difficulty`: the scores file {str(path)!r}"
    if not path.is_file():
        raise ValueError(
            f"{where} does not exist" + (" (it is a folder)." if path.is_dir() else ".")
        )
    suffix = path.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            data = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".npy":
            import numpy as np

            data = torch.from_numpy(np.load(path, allow_pickle=False))
        elif suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = [x for x in path.read_text().replace(",", "\n").split() if x.strip()]
    except Exception as err:  # noqa: BLE001 - every reader's own error, said with the file
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ValueError(
            f"{where} could not be read as {suffix} ({type(err).__name__}"
            + (f": {detail}" if detail else "")
            + ")."
        ) from err
    if isinstance(data, torch.Tensor):
        if data.dim() != 1:
            raise ValueError(
                f"{where} holds a tensor of shape {tuple(data.shape)}; expected a 1-D tensor, "
                "one score per sample."
            )
        data = data.tolist()
    if not isinstance(data, list):
        raise ValueError(
            f"{where} holds a {type(data).__name__}; expected a flat list or 1-D tensor of "
            "numbers, one per sample."
        )
    out = []
    for i, x in enumerate(data):
        try:
            if isinstance(x, bool) or not isinstance(x, (int, float, str)):
                raise TypeError
            out.append(float(x))
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: entry {i} is {x!r:.60}, not a number; give a flat list of numbers, "
                "one per sample."
            ) from None
    return out


def _attribute(dataset: Any, name: str) -> list[float]:
    base, index = dataset, None
    while not hasattr(base, name) and hasattr(base, "dataset") and hasattr(base, "indices"):
        index = [base.indices[i] for i in index] if index is not None else list(base.indices)
        base = base.dataset
    if not hasattr(base, name):
        found = (
            sorted(a for a in vars(base) if not a.startswith("_"))
            if hasattr(base, "__dict__")
            else []
        )
        raise ValueError(
            f"`difficulty`='attr:{name}': the dataset ({type(dataset).__name__}) has no attribute "
            f"{name!r}; its attributes: {', '.join(found[:12]) or 'none'}."
        )
    values = getattr(base, name)
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if index is not None:
        values = [values[i] for i in index]
    return values


def _field(sample: Any, name: str, i: int) -> Any:
    if isinstance(sample, Mapping):
        if name in sample:
            return sample[name]
    elif hasattr(sample, name):
        return getattr(sample, name)
    raise ValueError(
        f"`difficulty`='field:{name}': sample {i} has no field {name!r}; it is {_describe(sample)}."
    )


def difficulty_scores(dataset: Any, source: Any) -> list[float]:
    """One finite difficulty per index of the map-style ``dataset`` (higher is harder).

    Raises:
        ValueError: the source cannot be read (missing attribute, field or file), does not hold
            one score per sample, or yields a value that is not finite (the message gives the
            first such index and value).
    """
    source = check_difficulty(source)
    try:
        n = len(dataset)
    except TypeError as err:
        raise ValueError(
            "a curriculum needs a map-style dataset with a length; an iterable dataset has no "
            "indices to order."
        ) from err
    per_sample: Callable[[Any], Any] | None = None
    if isinstance(source, list):
        values, what = source, "the given sequence"
    elif callable(source):
        per_sample, what = source, getattr(source, "__name__", "the callable")
    elif source == "entropy":
        per_sample, what = token_entropy, "'entropy'"
    elif source == "length":
        per_sample, what = token_count, "'length'"
    elif source.startswith("fn:"):
        per_sample, what = import_object("difficulty", source[3:]), source
    elif source.startswith("field:"):
        name = source[6:]
        values = [_field(dataset[i], name, i) for i in range(n)]
        what = source
    elif source.startswith("attr:"):
        values, what = _attribute(dataset, source[5:]), source
    else:
        values, what = load_scores(source[5:]), source
    if per_sample is not None:
        values = [per_sample(dataset[i]) for i in range(n)]
    if len(values) != n:
        raise ValueError(
            f"`difficulty` ({what}) gives {len(values)} scores but the dataset has {n} samples; "
            "give exactly one per dataset index."
        )
    out: list[float] = []
    for i, v in enumerate(values):
        try:
            f = float(v.item() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"`difficulty` ({what}) gave {v!r:.60} for sample {i}, not a number."
            ) from err
        if not math.isfinite(f):
            raise ValueError(
                f"`difficulty` ({what}) gave a non-finite value ({f}) for sample {i}; every "
                "score must be a finite number."
            )
        out.append(f)
    return out


def easiest_first(scores: Sequence[float], seed: int = 0) -> list[int]:
    """Dataset indices in ascending difficulty; equal scores in an order shuffled by ``seed``."""
    check_seed(seed)
    values = torch.as_tensor(list(scores), dtype=torch.float64)
    shuffle = torch.randperm(len(values), generator=torch.Generator().manual_seed(seed))
    by_score = torch.argsort(values[shuffle], stable=True)
    return shuffle[by_score].tolist()
