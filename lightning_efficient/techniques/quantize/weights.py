"""Frozen linear weights stored in 4 bits (NF4, double quantization) with bitsandbytes.

The module keeps its class, its ``weight`` Parameter object and its ``state_dict`` keys: only
the Parameter's storage changes (``weight.data`` becomes bitsandbytes' packed 4-bit tensor, the
block scales become non-persistent buffers of the layer) and the layer's ``forward`` becomes
bitsandbytes' ``matmul_4bit`` (which dequantizes one weight at a time, in forward and again in
backward, and saves only the packed weight for backward). Adapters that call the base layer
(PEFT's ``lora.Linear.base_layer``, LitGPT's ``LoRALinear.linear``) keep working unchanged.

- :func:`select_frozen_linears`: which layers qualify (a pure rule, with the reason for every
  layer left alone).
- :func:`apply_frozen_weights_4bit`: quantize them; the ``Change``'s undo puts the original
  weights back bit-exactly from the host copy it keeps (the original tensor itself on a CPU).
- While quantized, ``state_dict()`` returns the original weights (from the host copy) and
  ``load_state_dict`` re-quantizes what it loads: checkpoints are those of the plain model.
"""

from __future__ import annotations

import contextlib
import fnmatch
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import FakeTensor
from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.validate import (
    SettingsError,
    check_choice,
    check_int,
    check_module,
    missing_requirement,
)
from lightning_efficient.measure.memory.heads import find_output_head

__all__ = [
    "QUANT_TYPES",
    "Selection",
    "apply_frozen_weights_4bit",
    "compute_dtype_for",
    "check_blocksize",
    "linear_weight_bytes",
    "patterns",
    "select_frozen_linears",
    "frozen_linear_share",
    "worth_quantizing",
    "FROZEN_SHARE",
]

QUANT_TYPES = ("nf4", "fp4")
_BUFFERS = ("absmax", "code", "offset", "absmax2", "code2")
_PREFIX = "weight_4bit_"


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional  # noqa: F401
    except ImportError as err:
        raise missing_requirement("bitsandbytes", "FrozenWeights4bit") from err
    return bnb


@dataclass
class Selection:
    """Which linear layers get 4-bit weights: ``chosen`` (names, in model order), ``left`` (name
    -> why it stays as it is), ``refused`` (names a user asked for that hold trainable
    weights) and ``unmatched`` (``"modules"``/``"skip"`` -> the patterns that name no linear
    layer)."""

    chosen: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    unmatched: dict[str, list[str]] = field(default_factory=dict)


def _kept_in_fp32(model: nn.Module) -> set[str]:
    """The module names a Hugging Face model keeps in full precision (``_keep_in_fp32_modules``
    and ``_strict``, as transformers' own 4-bit loading does): its code reads their weight's dtype
    (T5's feed-forward casts its input to ``wo.weight.dtype``: a packed weight makes it uint8)."""
    names: set[str] = set()
    for mod in model.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            value = getattr(mod, attr, None)
            if isinstance(value, (list, tuple, set, frozenset)):
                names.update(v for v in value if isinstance(v, str) and v)
    return names


def _conv1d_class() -> type | None:
    """Hugging Face's ``Conv1D`` (GPT-2's projections: a linear layer whose weight is stored
    transposed, ``in x out``) when transformers is loaded (a model holding one has loaded it)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _linear_forward(mod: nn.Module, conv1d: type | None) -> Any:
    """The plain forward of ``mod``'s kind of linear layer (``nn.Linear`` or HF ``Conv1D``),
    ``None`` when it is neither."""
    if isinstance(mod, nn.Linear):
        return nn.Linear.forward
    if conv1d is not None and isinstance(mod, conv1d):
        return conv1d.forward
    return None


def _read_by_dora(model: nn.Module) -> set[int]:
    """The base layers of PEFT DoRA adapters (``use_dora``): DoRA reads its base layer's weight
    (the norm of the adapted weight), which a packed weight would make the wrong size."""
    found = set()
    for mod in model.modules():
        dora = getattr(mod, "use_dora", None)
        base = getattr(mod, "base_layer", None)
        if isinstance(dora, dict) and any(dora.values()) and isinstance(base, nn.Module):
            found.add(id(base))
    return found


def patterns(name: str, value: Any, allow_none: bool) -> list[str] | None:
    """``value`` as a list of layer names or ``fnmatch`` patterns (a string is one pattern);
    anything else raises a ``TypeError`` naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        allowed = "a list of module names or patterns" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {allowed}; got {value!r} ({type(value).__name__}).")
    return list(value)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(_match(name, p) for p in patterns)


def _match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")


#: The dtypes the 4-bit layers can compute in, by the names a user writes.
COMPUTE_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "16": torch.float16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def check_blocksize(value: Any) -> int:
    """``blocksize`` checked: an int, a power of two from 64 to 4096."""
    check_int("blocksize", value, minimum=64, maximum=4096)
    if value & (value - 1):
        raise ValueError(f"`blocksize` must be a power of two from 64 to 4096; got {value}.")
    return value


def _compute_dtype(value: Any) -> torch.dtype | None:
    """``compute_dtype`` checked: ``None``, a floating dtype bitsandbytes computes in, or its
    name (``"bf16"``, ``"float16"``, ...)."""
    if value is None or (
        isinstance(value, torch.dtype) and value in (torch.bfloat16, torch.float16, torch.float32)
    ):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[value.lower().removeprefix("torch.")]
    allowed = ", ".join(repr(k) for k in COMPUTE_DTYPES)
    raise ValueError(
        "`compute_dtype` must be None, torch.bfloat16, torch.float16, torch.float32 or one of "
        f"{allowed}; got {value!r} ({type(value).__name__})."
    )


def select_frozen_linears(
    model: nn.Module,
    *,
    modules: Sequence[str] | None = None,
    skip: Sequence[str] = (),
) -> Selection:
    """The plain ``nn.Linear`` layers of ``model`` (and Hugging Face ``Conv1D``, GPT-2's
    transposed linear) whose weight is frozen, owned by that layer alone, not the output head (by
    the package's one rule, ``measure.memory.heads``: the chunked loss and most recipes keep it in
    full precision; name it in ``modules`` to include it), not a layer the model keeps in full
    precision (a Hugging Face model's ``_keep_in_fp32_modules``, whose forward reads the weight's
    dtype) and not the base of a PEFT DoRA adapter (which reads the base weight).

    Args:
        model: The module searched.
        modules: Patterns (``fnmatch``, or a module name and everything under it) of the layers
            to quantize; ``None``: every qualifying layer. A named layer with a trainable weight
            is ``refused``.
        skip: Patterns of layers left in full precision.
    """
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found = find_output_head(model)
    head = found.linear if found is not None else None
    kept = _kept_in_fp32(model)
    dora = _read_by_dora(model)
    modules = patterns("modules", modules, allow_none=True)
    skip = patterns("skip", skip, allow_none=False) or []
    out = Selection()
    conv1d = _conv1d_class()
    used: set[str] = set()
    for name, mod in model.named_modules():
        plain_forward = _linear_forward(mod, conv1d)
        if plain_forward is None:
            continue
        used.update(p for p in [*(modules or ()), *skip] if _match(name, p))
        named = modules is not None and _matches(name, modules)
        w = mod.weight
        if modules is not None and not named:
            continue
        if skip and _matches(name, skip):
            out.left[name] = "in `skip`"
        elif any(f".{k}." in f".{name}." for k in kept):
            out.left[name] = (
                "kept in full precision by the model (`_keep_in_fp32_modules`: its forward "
                "reads this weight's dtype)"
            )
        elif id(mod) in dora:
            out.left[name] = (
                "its PEFT DoRA adapter reads this weight (the norm of the adapted weight)"
            )
        elif type(mod).forward is not plain_forward:
            out.left[name] = f"{type(mod).__name__} has a forward of its own"
        elif hasattr(mod, _PREFIX + "absmax"):
            out.left[name] = "already in 4 bits"
        elif not w.is_floating_point() or w.device.type == "meta":
            out.left[name] = f"weight is {w.dtype} on {w.device.type}"
        elif w.requires_grad:
            if named:
                out.refused.append(name)
            else:
                out.left[name] = "trainable"
        elif owners.get(id(w), 0) > 1:
            out.left[name] = "weight shared with another module (tied)"
        elif mod is head and not named:
            out.left[name] = "output head (full precision; name it in `modules` to include it)"
        else:
            out.chosen.append(name)
    for arg, given in (("modules", modules or ()), ("skip", skip)):
        if [p for p in given if p not in used]:
            out.unmatched[arg] = [p for p in given if p not in used]
    return out


#: The share of a model's parameter bytes its frozen linear weights must hold for the planner
#: to offer 4-bit frozen weights (:func:`worth_quantizing`).
FROZEN_SHARE = 0.5


def frozen_linear_share(model: nn.Module) -> float:
    """The share of ``model``'s parameter bytes (each tensor once) held by the weights that
    :func:`select_frozen_linears` would store in 4 bits: frozen, plain, untied, not the output
    head. 0.0 for a model without parameters."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if not total:
        return 0.0
    layers = dict(model.named_modules())
    chosen = {id(layers[n].weight): layers[n].weight for n in select_frozen_linears(model).chosen}
    return sum(w.numel() * w.element_size() for w in chosen.values()) / total


def worth_quantizing(model: nn.Module, share: float = FROZEN_SHARE) -> bool:
    """Whether frozen weights dominate ``model``: the frozen linear weights that 4 bits would
    store hold at least ``share`` of its parameter bytes (adapters such as LoRA on a pretrained
    model, a frozen backbone under a small head). Then 4-bit frozen weights save most of the
    weights' memory; on full-weight training nothing is frozen and nothing would be quantized
    (the planner offers the rung only where this holds)."""
    return frozen_linear_share(model) >= share


def compute_dtype_for(precision: Any) -> torch.dtype | None:
    """The dtype the 4-bit layers compute in for a trainer precision (``"bf16-mixed"`` ->
    bfloat16, ``"16-mixed"`` -> float16); ``None``: the input's dtype."""
    text = str(precision)
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16") or text.startswith("fp16"):
        return torch.float16
    return None


def linear_weight_bytes(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Bytes held by the weights of ``model``'s Linear layers (``names``: only those), the 4-bit
    block scales included."""
    seen: dict[int, int] = {}
    conv1d = _conv1d_class()
    for name, mod in model.named_modules():
        if _linear_forward(mod, conv1d) is not None and (names is None or name in names):
            tensors = [mod.weight, *(getattr(mod, _PREFIX + b, None) for b in _BUFFERS)]
            for t in tensors:
                if t is not None:  # the code tables are one tensor shared by every layer
                    seen[id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _mode_of(t: torch.Tensor) -> Any:
    """Run the quantization under ``t``'s fake mode when it is fake (the estimate)."""
    return t.fake_mode if isinstance(t, FakeTensor) else contextlib.nullcontext()


def _quantize(w: torch.Tensor, quant_type: str, double_quant: bool, blocksize: int) -> Any:
    bnb = _bitsandbytes()
    if isinstance(w, FakeTensor):  # bitsandbytes builds (and caches) its code tables from values
        bnb.functional.quantize_4bit(
            torch.zeros(blocksize), blocksize=blocksize, compress_statistics=double_quant,
            quant_type=quant_type,
        )  # fmt: skip
    with _mode_of(w), torch.no_grad():
        packed, state = bnb.functional.quantize_4bit(
            w, blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
        )
    tensors = {"absmax": state.absmax, "code": state.code}
    if state.nested:
        tensors.update(offset=state.offset, absmax2=state.state2.absmax, code2=state.state2.code)
    return packed, state, tensors


def _state_of(lin: nn.Linear, template: Any) -> Any:
    """bitsandbytes' QuantState from the layer's buffers (which follow ``module.to``)."""
    bnb = _bitsandbytes()
    buf = {b: getattr(lin, _PREFIX + b, None) for b in _BUFFERS}
    state2 = None
    if template.nested:
        state2 = bnb.functional.QuantState(
            absmax=buf["absmax2"],
            code=buf["code2"],
            blocksize=template.state2.blocksize,
            dtype=template.state2.dtype,
        )
    return bnb.functional.QuantState(
        absmax=buf["absmax"],
        shape=template.shape,
        code=buf["code"],
        blocksize=template.blocksize,
        quant_type=template.quant_type,
        dtype=template.dtype,
        offset=buf["offset"],
        state2=state2,
    )


def _quantize_layer(
    lin: nn.Module,
    shared: dict[str, torch.Tensor],
    compute_dtype: torch.dtype | None,
    quant_type: str,
    double_quant: bool,
    blocksize: int,
) -> Change:
    bnb = _bitsandbytes()
    w = lin.weight
    original = w.data
    device = original.device
    host = original if device.type == "cpu" else original.to("cpu")  # the undo's copy

    def as_linear(t: torch.Tensor) -> torch.Tensor:  # HF Conv1D stores ``in x out``
        return t if isinstance(lin, nn.Linear) else t.t().contiguous()

    packed, template, tensors = _quantize(as_linear(original), quant_type, double_quant, blocksize)
    names = []
    for b, t in tensors.items():
        if b in ("code", "code2"):  # constant tables: one tensor for every layer
            t = shared.setdefault(f"{b}:{t.device}", t)
        lin.register_buffer(_PREFIX + b, t, persistent=False)
        names.append(_PREFIX + b)
    w.data = packed
    del original

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype or x.dtype
        bias = None if lin.bias is None else lin.bias.to(dtype)
        state = _state_of(lin, template)
        out = bnb.matmul_4bit(x.to(dtype), lin.weight.t(), bias=bias, quant_state=state)
        return out if torch.is_autocast_enabled(x.device.type) else out.to(x.dtype)

    def saved(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        if prefix + "weight" in state_dict:  # the original weight, as the plain model has it
            state_dict[prefix + "weight"] = host

    def loading(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if incoming is None or tuple(incoming.shape) != tuple(host.shape):
            return
        with torch.no_grad():
            host.copy_(incoming)
            new, _, fresh = _quantize(
                as_linear(host.to(lin.weight.device)), quant_type, double_quant, blocksize
            )
            for b, t in fresh.items():
                if b not in ("code", "code2"):
                    getattr(lin, _PREFIX + b).copy_(t)
        state_dict[key] = new  # what load_state_dict copies into the packed weight

    handles = [
        lin.register_state_dict_post_hook(saved),
        lin.register_load_state_dict_pre_hook(loading),
    ]
    forward_change = patch_attribute(lin, "forward", forward)

    def undo() -> None:
        for h in handles:
            h.remove()
        forward_change.undo()
        for name in names:
            delattr(lin, name)
        w.data = host if host.device == w.device else host.to(w.device)

    return Change("4-bit weight", undo)


def apply_frozen_weights_4bit(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    quant_type: str = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
    modules: Sequence[str] | None = None,
    skip: Sequence[str] = (),
) -> Change:
    """Store the frozen weights of ``model``'s plain Linear (and HF ``Conv1D``) layers in 4 bits
    (see the module docstring); trainable weights, adapters, tied weights, the output head and
    the layers the model keeps in full precision are left alone.

    Args:
        model: The module changed in place (its class, parameters' identity and state_dict keys
            are kept).
        compute_dtype: The dtype the layers compute in (``None``: the input's): ``torch.bfloat16``,
            ``float16``, ``float32`` or a name (``"bf16"``, ``"fp16"``, ``"float32"``, ...).
        quant_type: ``"nf4"`` (NormalFloat4, QLoRA's) or ``"fp4"``.
        double_quant: Quantize the block scales too (about 0.52 instead of 0.56 bytes per
            weight).
        blocksize: Weights per scale (64 as in QLoRA).
        modules: Patterns of the layers to quantize (``None``: every frozen Linear); a named
            layer with a trainable weight raises ``SettingsError``.
        skip: Patterns of layers left in full precision.

    Returns:
        A ``Change`` whose ``value`` is the :class:`Selection` and whose figures compare the
        linear weight bytes before and after; ``undo()`` restores the original weights exactly.
    """
    check_module("model", model)
    compute_dtype = _compute_dtype(compute_dtype)
    check_choice("quant_type", quant_type, QUANT_TYPES)
    check_blocksize(blocksize)
    selection = select_frozen_linears(model, modules=modules, skip=skip)
    example = next((n for n, m in model.named_modules() if _linear_forward(m, _conv1d_class())), "")
    names_look = f" (its linear layers are named like {example!r})" if example else ""
    if "modules" in selection.unmatched:
        raise SettingsError(
            f"`modules` pattern(s) {selection.unmatched['modules']} match no nn.Linear or Conv1D "
            f"layer of the module{names_look}: name the layers to store in 4 bits, or None for "
            "every frozen one."
        )
    if "skip" in selection.unmatched:
        warnings.warn(
            f"`skip` pattern(s) {selection.unmatched['skip']} match no nn.Linear or Conv1D layer "
            f"of the module{names_look}: they skip nothing.",
            stacklevel=2,
        )
    if selection.refused:
        names = ", ".join(f"`{n}`" for n in selection.refused)
        raise SettingsError(
            f"4-bit weights would be trainable weights: {names} require grad, and a 4-bit "
            "weight receives no gradient. Freeze them first (e.g. PEFT's get_peft_model, or "
            "`requires_grad_(False)` on the backbone) or leave them out of `modules`."
        )
    layers = dict(model.named_modules())
    before = linear_weight_bytes(model, selection.chosen)
    shared: dict[str, torch.Tensor] = {}
    changes = [
        _quantize_layer(layers[n], shared, compute_dtype, quant_type, double_quant, blocksize)
        for n in selection.chosen
    ]
    after = linear_weight_bytes(model, selection.chosen)
    what = (
        f"{len(changes)} frozen linear weights in 4 bits ({quant_type}"
        f"{', double quantization' if double_quant else ''})"
        if changes
        else "no frozen linear weight to store in 4 bits"
    )
    figures = {
        "layers_4bit": len(changes),
        "weight_bytes_before": before,
        "weight_bytes_after": after,
    }
    return Change.of(what, changes, figures=figures, value=selection)
