"""Tiled position-wise layers: a block's MLP and norms run in tiles along the sequence.

A position-wise layer (a transformer block's MLP or norm: each token's output depends on that
token's input only) is run tile by tile along the sequence axis (dim -2), in the forward without
keeping anything but its input, and again tile by tile in backward, so its wide intermediates
(Llama-3-8B: the MLP's 14,336-wide ones, 3.5x the hidden size; an RMSNorm's fp32 upcasts under
bf16 autocast, 2x) exist for one tile at a time, never for the whole sequence. The gradients are the untiled ones (the input's are the same rows; a parameter's are
the sum of the tiles'). Chosen by the sequence length: a call with at most ``tile`` tokens runs
untiled. The tile (``"auto"``) is the layer's input width in tokens (a tile's intermediate is
then the size of one of its weight matrices), as ALST's TiledMLP does (arXiv 2506.13996).

The layer's instance ``forward`` is shadowed in place (no module replaced or renamed, so
``state_dict`` keys never change); ``remove_tiling`` puts it back. Which layers: the children of
the blocks ``techniques._blocks.select_modules`` finds whose attribute or class name says MLP or
feed-forward (``mlp``, ``feed_forward``, ``ffn``, ``LlamaMLP``, ``GPT2MLP``, ...), and their
``LayerNorm`` / ``RMSNorm`` layers (``LlamaRMSNorm``, ...; never batch or group norms).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.techniques._blocks import select_modules
from lightning_efficient.techniques.activation_checkpointing.recompute import (
    ShadowedForward,
    unshadow,
)

__all__ = [
    "apply_tiling",
    "remove_tiling",
    "positionwise_layers",
    "tiled_layers",
    "check_tile",
    "TILE_ATTR",
]

TILE_ATTR = "_le_tiled"  # the layer's tile setting; forward is shadowed while present
_WORDS = ("mlp", "ffn", "feedforward", "feed_forward")
_NORMS = ("rmsnorm", "layernorm")  # per token; not batch / group norms


def _positionwise(name: str, layer: nn.Module) -> bool:
    words = (name.lower(), type(layer).__name__.lower())
    mlp = name == "ff" or any(w in n for w in _WORDS for n in words)
    norm = isinstance(layer, (nn.LayerNorm, nn.RMSNorm)) or words[1].endswith(_NORMS)
    return (mlp or norm) and any(True for _ in layer.parameters())


def positionwise_layers(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The position-wise children of ``blocks``: MLP / feed-forward layers (by attribute or
    class name) and layer / RMS norms, with their qualified names."""
    return [
        (f"{name}.{child_name}" if name else child_name, child)
        for name, block in blocks
        for child_name, child in block.named_children()
        if _positionwise(child_name, child)
    ]


def check_tile(value: Any, argument: str = "tile_sequence") -> int | str | None:
    """``False``/``None``: off; ``True``/``"auto"``: tiles of the layer's input width in tokens;
    an int >= 1: tiles of that many tokens. Returns the tile (``None``: off)."""
    if value is None or value is False:
        return None
    if value is True or value == "auto":
        return "auto"
    if isinstance(value, int) and value >= 1:
        return value
    raise ValueError(
        f"`{argument}` must be False, True / 'auto' (tiles of the layer's input width in "
        f"tokens) or a number of tokens >= 1; got {value!r}."
    )


def apply_tiling(module: nn.Module, policy: Any = "auto", tile: int | str = "auto") -> Change:
    """Run the position-wise layers (MLP / feed-forward, norms) of each block ``policy``
    selects (as activation checkpointing selects blocks) in tiles of ``tile`` tokens along the
    sequence, in place;
    returns the ``Change`` (``value``: the tiled layers' names; ``undo()`` puts them back)."""
    tile = check_tile(tile, "tile")
    before = tiled_layers(module)
    layers = positionwise_layers(select_modules(module, policy, argument="policy"))
    for _, layer in layers:
        _tile_layer(layer, tile)
    names = [n for n, _ in layers]
    size = "its input width" if tile == "auto" else f"{tile}"
    kinds = ", ".join(dict.fromkeys(type(m).__name__ for _, m in layers))
    what = (
        f"{len(names)} position-wise layers ({kinds}) run in tiles of {size} tokens along "
        "longer sequences"
        if names
        else "no position-wise layer (MLP / feed-forward, norm) found in the blocks: nothing tiled"
    )
    return Change(
        what,
        functools.partial(_restore, module, before),
        figures={"layers_tiled": len(names)},
        value=names,
    )


def remove_tiling(module: nn.Module) -> list[str]:
    """Untile every tiled layer of ``module``; returns their names."""
    names = list(tiled_layers(module))
    for m in module.modules():
        _untile_layer(m)
    return names


def _restore(module: nn.Module, state: dict[str, int | str]) -> None:
    remove_tiling(module)
    mods = dict(module.named_modules())
    for name, tile in state.items():
        _tile_layer(mods[name], tile)


def tiled_layers(module: nn.Module) -> dict[str, int | str]:
    """The tiled layers of ``module``: name -> tile (tokens, or ``"auto"``)."""
    return {n: m.__dict__[TILE_ATTR] for n, m in module.named_modules() if TILE_ATTR in m.__dict__}


class _TiledForward(ShadowedForward):
    """Shadows ``layer.forward``: a call with one tensor of more than ``tile`` tokens runs
    through ``_Tiles``; any other call runs the layer as it was."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        setting = self.module.__dict__.get(TILE_ATTR)
        x = args[0] if len(args) == 1 and not kwargs else None
        if setting is None or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self._forward(*args, **kwargs)
        tile = x.shape[-1] if setting == "auto" else int(setting)
        if x.shape[-2] <= tile:
            return self._forward(x)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():
                return _run_tiles(self._forward, x, tile)
        return _Tiles.apply(self._forward, tile, x, *params)


def _spans(n: int, tile: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, tile):
        yield start, min(tile, n - start)


def _run_tiles(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> Any:
    out = None
    for start, size in _spans(x.shape[-2], tile):
        y = run(x.narrow(-2, start, size).contiguous())
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-2] + (size,):
            owner = getattr(getattr(run, "__self__", None), "module", None)
            raise TypeError(
                f"tiled layer {type(owner).__name__}: a tile's output must be one tensor of the "
                f"tile's tokens; got {type(y).__name__}. Leave this layer untiled."
            )
        if out is None:
            out = y.new_empty((*x.shape[:-1], y.shape[-1]))
        out.narrow(-2, start, size).copy_(y)
        del y
    return out


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in ("cpu", "cuda")
        if torch.amp.is_autocast_available(d)
    ]


@contextlib.contextmanager
def _as_in_forward(autocast: list[tuple[str, bool, torch.dtype]], rng: Any, device: Any):
    """Autocast as in the forward, and the RNG state the forward started from (dropout draws
    the same masks in the recompute)."""
    cuda = [device] if device.type == "cuda" else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=cuda))
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state(rng[1], device)
        for d, enabled, dtype in autocast:
            stack.enter_context(torch.autocast(d, dtype=dtype, enabled=enabled))
        yield


class _Tiles(torch.autograd.Function):
    """Forward: the tiles without autograd, only ``x`` saved. Backward: each tile recomputed
    with autograd and differentiated against its rows of the output's gradient; parameter
    gradients summed over tiles and returned once (hooks, DDP and optimizer-in-backward see one
    gradient per parameter, as without tiling)."""

    @staticmethod
    def forward(ctx: Any, run: Any, tile: int, x: torch.Tensor, *params: torch.Tensor) -> Any:
        ctx.run, ctx.tile = run, tile
        ctx.autocast = _autocast_state()
        cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        ctx.rng = (torch.get_rng_state(), cuda)
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _run_tiles(run, x, tile)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with _as_in_forward(ctx.autocast, ctx.rng, x.device):
            for start, size in _spans(x.shape[-2], ctx.tile):
                xi = x.narrow(-2, start, size).contiguous().requires_grad_(want_x)
                with torch.enable_grad():
                    y = ctx.run(xi)
                inputs = ([xi] if want_x else []) + params
                grads = torch.autograd.grad(
                    y, inputs, grad.narrow(-2, start, size), allow_unused=True
                )
                del y
                if want_x:
                    grad_x.narrow(-2, start, size).copy_(grads[0])
                for i, g in enumerate(grads[int(want_x) :]):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        return (None, None, grad_x, *sums)


def _tile_layer(layer: nn.Module, tile: int | str) -> None:
    inner = layer.__dict__.get("forward")
    if TILE_ATTR not in layer.__dict__:
        object.__setattr__(layer, "forward", _TiledForward(layer, inner))
    object.__setattr__(layer, TILE_ATTR, tile)


def _untile_layer(layer: nn.Module) -> None:
    unshadow(layer, _TiledForward, TILE_ATTR)
