"""Finding a model's repeated blocks (transformer layers, residual blocks) with no user input.

Shared by activation checkpointing and regional compilation. A block group is a set of
structurally identical sibling modules that have children of their own (leaf layers are never
blocks); "auto" picks the group holding the most parameters (not
the most members: a 3-layer transformer has 4 identical attention projections per layer).
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from typing import Any

from torch import nn

__all__ = [
    "structure_key",
    "find_repeated_blocks",
    "select_modules",
    "candidate_block_names",
    "check_policy",
]


def structure_key(module: nn.Module, _memo: dict[int, Any] | None = None) -> Any:
    """A hashable description of a module's structure: its class, its parameters' and buffers'
    shapes and dtypes, and the same for its children, recursively."""
    memo = {} if _memo is None else _memo
    cached = memo.get(id(module))
    if cached is not None:
        return cached
    key = (
        type(module),
        tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters(recurse=False)),
        tuple(
            (n, tuple(b.shape), b.dtype)
            for n, b in module.named_buffers(recurse=False)
            if b is not None
        ),
        tuple((n, structure_key(c, memo)) for n, c in module.named_children()),
    )
    memo[id(module)] = key
    return key


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_repeated_blocks(model: nn.Module, min_count: int = 2) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as ``(qualified name, module)`` in forward order.

    Among all groups of at least ``min_count`` structurally identical siblings, the group with
    the most parameters wins (ties: more members, then the shallower group). Returns ``[]`` when
    the model has no repeated structure.
    """
    memo: dict[int, Any] = {}
    best: tuple[tuple[int, int, int], list[tuple[str, nn.Module]]] | None = None
    for parent_name, parent in model.named_modules():
        groups: dict[Any, list[tuple[str, nn.Module]]] = defaultdict(list)
        for child_name, child in parent.named_children():
            if _numel(child) == 0 or not any(True for _ in child.children()):
                # parameter-free siblings (activations, dropout) and leaf layers (a bare Conv2d,
                # BatchNorm2d, Linear) are not blocks: Dynamo skips torch.nn's own frames and
                # one layer's recompute saves little
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            groups[structure_key(child, memo)].append((full, child))
        depth = parent_name.count(".") + (1 if parent_name else 0)
        for members in groups.values():
            if len(members) < min_count:
                continue
            score = (sum(_numel(m) for _, m in members), len(members), -depth)
            if best is None or score > best[0]:
                best = (score, members)
    return [] if best is None else best[1]


def candidate_block_names(model: nn.Module, limit: int = 12) -> list[str]:
    """Class names worth suggesting in an error: the auto blocks first, then other containers."""
    names: list[str] = [type(m).__name__ for _, m in find_repeated_blocks(model)[:1]]
    for _, m in model.named_modules():
        n = type(m).__name__
        if n not in names and any(True for _ in m.children()):
            names.append(n)
    return names[:limit]


def select_modules(
    model: nn.Module, policy: Any, *, argument: str = "policy"
) -> list[tuple[str, nn.Module]]:
    """Resolve a block policy to ``(name, module)`` pairs.

    ``policy`` is ``"auto"`` (repeated blocks), a module class, a class name (``"GPT2Block"``),
    a name glob (``"transformer.h.*"``) or a regex written ``"re:<pattern>"``, or a list of these.
    A policy that matches nothing raises a ``ValueError`` naming it and listing candidates; it is
    never a silent no-op. Nested matches keep the outermost module only.
    """
    policies = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    found: dict[str, nn.Module] = {}
    for p in policies:
        matches = _match(model, p, argument)
        if not matches:
            raise ValueError(
                f"`{argument}`={p!r} matches no module of {type(model).__name__}. Candidate "
                f"block classes: {', '.join(candidate_block_names(model)) or 'none'}. Auto-detected "
                f"blocks: {[n for n, _ in find_repeated_blocks(model)][:4] or 'none'}."
            )
        for name, m in matches:
            found.setdefault(name, m)
    names = sorted(found, key=list(dict(model.named_modules())).index)
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return [(n, found[n]) for n in outer]


def _match(model: nn.Module, p: Any, argument: str) -> list[tuple[str, nn.Module]]:
    if p == "auto":
        return find_repeated_blocks(model)
    named = [(n, m) for n, m in model.named_modules() if n]
    if isinstance(p, type) and issubclass(p, nn.Module):
        return [(n, m) for n, m in named if isinstance(m, p)]
    if not isinstance(p, str) or not p:
        raise TypeError(
            f"`{argument}` entries must be 'auto', a module class, a class name, a name glob or "
            f"'re:<regex>'; got {p!r} ({type(p).__name__})."
        )
    if p.startswith("re:"):
        try:
            rx = re.compile(p[3:])
        except re.error as err:
            raise ValueError(
                f"`{argument}`={p!r} is not a valid regular expression: {err}."
            ) from err
        return [(n, m) for n, m in named if rx.fullmatch(n)]
    by_class = [(n, m) for n, m in named if type(m).__name__ == p]
    if by_class:
        return by_class
    return [(n, m) for n, m in named if fnmatch.fnmatchcase(n, p)]


def check_policy(policy: Any, *, argument: str = "policy") -> Any:
    """Check a block policy's form without a model (for constructors): ``"auto"``, a module
    class, a non-empty name/glob string, a valid ``"re:<regex>"``, or a non-empty list of these.
    Raises ``TypeError``/``ValueError`` naming ``argument``; returns ``policy``."""
    policies = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    if not policies:
        raise ValueError(
            f"`{argument}` must name at least one block kind; got an empty {type(policy).__name__}."
        )
    for p in policies:
        if isinstance(p, type) and issubclass(p, nn.Module):
            continue
        if not isinstance(p, str):
            raise TypeError(
                f"`{argument}` entries must be 'auto', a module class, a class name, a name glob or "
                f"'re:<regex>'; got {p!r} ({type(p).__name__})."
            )
        if not p.strip():
            raise ValueError(f"`{argument}` entries must be non-empty strings; got {p!r}.")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as err:
                raise ValueError(
                    f"`{argument}`={p!r} is not a valid regular expression: {err}."
                ) from err
    return policy
