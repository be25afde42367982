"""Finding a model's repeated blocks (transformer layers, residual blocks) with no user input.

Shared by activation checkpointing and regional compilation. A block group is a set of
structurally identical sibling modules that have children of their own (leaf layers are never
blocks), joined by their siblings of the same class (T5's first block differs from the others: it
holds the relative-attention bias). Without an example input, "auto" picks the group holding the
most parameters (not the most members: a 3-layer transformer has 4 identical attention
projections per layer); a model with one block in a ``ModuleList``/``Sequential``/``ModuleDict``
gets that block. ``candidate_groups`` lists every group worth measuring (sibling groups, every
block class across the model, single blocks in containers); activation checkpointing ranks them
by the activation memory they free, measured by the estimate.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_efficient.core._internals import class_before_fsdp

__all__ = [
    "structure_key",
    "find_repeated_blocks",
    "candidate_groups",
    "BlockGroup",
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


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _is_block(module: nn.Module) -> bool:
    """Has parameters and children: parameter-free modules (activations, dropout) and leaf layers
    (a bare Conv2d, BatchNorm2d, Linear) are not blocks: Dynamo skips torch.nn's own frames and
    one layer's recompute saves little."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # hold blocks; never called
        return False
    return _numel(module) > 0 and any(True for _ in module.children())


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _sibling_groups(
    model: nn.Module, min_count: int, memo: dict[int, Any]
) -> list[tuple[int, list[tuple[str, nn.Module]]]]:
    """(depth, members) for each group of at least ``min_count`` structurally identical sibling
    blocks, joined by the siblings of the same class; members in forward (definition) order."""
    out: list[tuple[int, list[tuple[str, nn.Module]]]] = []
    for parent_name, parent in model.named_modules():
        children = [(_join(parent_name, n), c) for n, c in parent.named_children() if _is_block(c)]
        groups: dict[Any, list[tuple[str, nn.Module]]] = defaultdict(list)
        for full, child in children:
            groups[structure_key(child, memo)].append((full, child))
        depth = parent_name.count(".") + (1 if parent_name else 0)
        seen: set[frozenset[str]] = set()
        for members in groups.values():
            if len(members) < min_count:
                continue
            classes = {type(m) for _, m in members}
            joined = [(n, c) for n, c in children if type(c) in classes]
            key = frozenset(n for n, _ in joined)
            if key not in seen:
                seen.add(key)
                out.append((depth, joined))
    return out


def _class_siblings(model: nn.Module) -> list[tuple[int, list[tuple[str, nn.Module]]]]:
    """(depth, members) for each class with at least two sibling blocks under one parent, of any
    structure (a U-Net's encoder blocks of growing width)."""
    out = []
    for parent_name, parent in model.named_modules():
        by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for name, child in parent.named_children():
            if _is_block(child):
                by_class[type(child)].append((_join(parent_name, name), child))
        depth = parent_name.count(".") + (1 if parent_name else 0)
        out.extend((depth, members) for members in by_class.values() if len(members) >= 2)
    return out


def _single_blocks(model: nn.Module) -> list[tuple[int, list[tuple[str, nn.Module]]]]:
    """(depth, [block]) for every block held alone in a ModuleList/Sequential/ModuleDict (a
    one-layer transformer's only layer)."""
    out = []
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, _CONTAINERS):
            continue
        depth = parent_name.count(".") + (1 if parent_name else 0)
        blocks = [(_join(parent_name, n), c) for n, c in parent.named_children() if _is_block(c)]
        if len(blocks) == 1:
            out.append((depth, blocks))
    return out


def _score(depth: int, members: list[tuple[str, nn.Module]]) -> tuple[int, int, int]:
    return (sum(_numel(m) for _, m in members), len(members), -depth)


def find_repeated_blocks(model: nn.Module, min_count: int = 2) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as ``(qualified name, module)`` in forward order, chosen
    by structure alone (no input needed).

    Among all groups of at least ``min_count`` structurally identical sibling blocks (joined by
    their siblings of the same class), the group with the most parameters wins (ties: more
    members, then the shallower group). Without such a group, the sibling blocks of one class
    (any structure: a U-Net's encoder blocks) with the most parameters; without those, the block
    with the most parameters held alone in a ``ModuleList``/``Sequential``/``ModuleDict`` (a
    one-layer model's only layer).
    Returns ``[]`` when there is none.
    """
    memo: dict[int, Any] = {}
    groups = (
        _sibling_groups(model, min_count, memo)
        or (_class_siblings(model) if min_count <= 2 else [])
        or _single_blocks(model)
    )
    if not groups:
        return []
    return max(groups, key=lambda g: _score(*g))[1]


@dataclass
class BlockGroup:
    """A candidate set of blocks to checkpoint or compile together.

    Attributes:
        names: Qualified module names, in definition order.
        block_class: The class name of the members (``"A/B"`` when siblings of several classes).
        kind: ``"siblings"`` (children of one parent), ``"class"`` (every outermost block of a
            class, across the model) or ``"single"`` (a block alone in a container).
        parameters: Parameters held by the members.
    """

    names: list[str]
    block_class: str
    kind: str
    parameters: int

    @property
    def policy(self) -> Any:
        """The policy that selects this group: the class name for a class group, else a
        ``"re:"`` policy matching exactly its names."""
        if self.kind == "class":
            return self.block_class
        return "re:" + "|".join(re.escape(n) for n in self.names)


def candidate_groups(model: nn.Module, limit: int | None = 6) -> list[BlockGroup]:
    """Candidate block groups of ``model``, most parameters first, at most ``limit``.

    Sibling groups (as ``find_repeated_blocks``, and siblings of one class of any structure, at
    every depth), every block class with at least two outermost instances anywhere in the model
    (generic containers excepted), and blocks alone in a container. Dropped: duplicates, groups
    whose blocks are a subset of another group's (checkpointing more blocks never raises the
    peak: one block is recomputed at a time) and groups nested inside a group with at least as
    many members (checkpointing the outer one frees what the inner one would).
    """
    memo: dict[int, Any] = {}
    raw: list[tuple[tuple[int, int, int], BlockGroup]] = []

    def add(depth: int, members: list[tuple[str, nn.Module]], kind: str) -> None:
        classes = list(dict.fromkeys(class_before_fsdp(m).__name__ for _, m in members))
        group = BlockGroup([n for n, _ in members], "/".join(classes), kind, 0)
        group.parameters = sum(_numel(m) for _, m in members)
        raw.append((_score(depth, members), group))

    for depth, members in _sibling_groups(model, 2, memo) + _class_siblings(model):
        add(depth, members, "siblings")
    by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, m in model.named_modules():
        if name and _is_block(m) and not isinstance(m, _CONTAINERS):
            by_class[type(m)].append((name, m))
    for members in by_class.values():
        outer = [(n, m) for n, m in members if not any(n.startswith(o + ".") for o, _ in members)]
        if len(outer) >= 2:
            add(min(n.count(".") for n, _ in outer), outer, "class")
    for depth, members in _single_blocks(model):
        add(depth, members, "single")
    raw.sort(key=lambda r: r[0], reverse=True)
    groups: list[BlockGroup] = []
    seen: set[frozenset[str]] = set()
    for _, group in raw:
        key = frozenset(group.names)
        if key not in seen:
            seen.add(key)
            groups.append(group)

    def inside(inner: BlockGroup, outer: BlockGroup) -> bool:
        return (
            inner is not outer
            and len(outer.names) >= len(inner.names)
            and all(any(n.startswith(o + ".") for o in outer.names) for n in inner.names)
        )

    def subset(small: BlockGroup, large: BlockGroup) -> bool:
        return small is not large and set(small.names) < set(large.names)

    kept = [g for g in groups if not any(inside(g, o) or subset(g, o) for o in groups)]
    return kept if limit is None else kept[:limit]


def candidate_block_names(model: nn.Module, limit: int = 12) -> list[str]:
    """Class names worth suggesting in an error: the auto blocks first, then other containers."""
    names: list[str] = [class_before_fsdp(m).__name__ for _, m in find_repeated_blocks(model)[:1]]
    for _, m in model.named_modules():
        n = class_before_fsdp(m).__name__
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
    never a silent no-op, except ``"auto"`` on a model without blocks, which selects nothing
    (the caller says so). Nested matches keep the outermost module only.
    """
    policies = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    found: dict[str, nn.Module] = {}
    for p in policies:
        matches = _match(model, p, argument)
        if not matches and p != "auto":
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
    # by the class's own name, also once FSDP2 sharded the module (its class is FSDP<Name> then)
    by_class = [(n, m) for n, m in named if class_before_fsdp(m).__name__ == p]
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
