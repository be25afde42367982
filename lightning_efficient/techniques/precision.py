"""Numeric precision: pick the best mixed precision for a device, TF32 matmuls, FP8 training.

- ``best_precision(device)`` returns the Lightning precision string to use on a device:
  ``"bf16-mixed"`` where bf16 is supported (CUDA compute capability 8.0+, or a CPU with bf16),
  ``"16-mixed"`` on older CUDA devices, ``"32-true"`` otherwise. The CLI accepts
  ``trainer.precision: auto`` and resolves it through this function.
- ``check_precision(value)`` validates a precision value against the ones Lightning knows.
- ``apply_matmul_precision(level)`` sets float32 matmul precision and cuDNN's TF32 flag; the
  ``Change`` it returns puts the previous settings back. The ``MatmulPrecision`` callback does
  this around a fit (undone after it, and when it raises or is interrupted).
- ``apply_float8(model)`` swaps ``nn.Linear`` layers for torchao's ``Float8Linear`` (state_dict
  keys unchanged; its ``Change`` puts the original layers back); the ``Float8Training`` callback
  does so in setup on devices with FP8 tensor cores (compute capability 8.9+), undoes it after
  fit, and says clearly that it did nothing elsewhere.

``Float8Training`` is a callback of its own, not an option of ``MatmulPrecision``: TF32 is a
process-wide flag that is set and restored around a fit, FP8 is model surgery (module classes
change for the fit) that must happen before the optimizer is built and before compilation; the two
have different devices, lifecycles and failure modes, and combine freely.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import cpu_supports_bf16, lightning_precision_values
from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_choice, check_module, missing_extra

__all__ = [
    "best_precision",
    "check_precision",
    "resolve_precision",
    "valid_precisions",
    "has_tf32",
    "supports_fp8",
    "apply_matmul_precision",
    "apply_float8",
    "MatmulPrecision",
    "Float8Training",
    "MATMUL_LEVELS",
    "FP8_RECIPES",
]

MATMUL_LEVELS = ("highest", "high", "medium")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _device(device: Any = None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def best_precision(device: torch.device | str | int | None = None) -> str:
    """The Lightning precision string that trains fastest without losing accuracy on ``device``
    (default: the first CUDA device if there is one, else the CPU).

    ``"bf16-mixed"`` on CUDA compute capability 8.0+ (Ampere and newer) and on CPUs with bf16
    support (AVX512-BF16/AMX or oneDNN's bf16 path); ``"16-mixed"`` on older CUDA devices;
    ``"32-true"`` elsewhere.
    """
    dev = _device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "32-true"
        return "bf16-mixed" if torch.cuda.get_device_capability(dev) >= (8, 0) else "16-mixed"
    if dev.type == "cpu":
        return "bf16-mixed" if cpu_supports_bf16() else "32-true"
    return "32-true"


def valid_precisions() -> tuple[Any, ...]:
    """Every precision value Lightning's Trainer accepts (strings and ints)."""
    return lightning_precision_values()


def check_precision(value: Any, *, name: str = "precision", allow_auto: bool = True) -> Any:
    """Return ``value`` if Lightning knows it (or it is ``"auto"``); else a ``ValueError`` that
    lists every valid value."""
    choices = (("auto",) if allow_auto else ()) + valid_precisions()
    return check_choice(name, value, choices)


def resolve_precision(value: Any, accelerator: Any = None) -> Any:
    """``"auto"`` -> ``best_precision`` for the accelerator (``"cpu"`` -> the CPU, else the
    default device); other values are checked and returned unchanged. ``None`` stays ``None``."""
    if value is None:
        return None
    check_precision(value, name="trainer.precision")
    if value != "auto":
        return value
    acc = str(accelerator or "auto")
    return best_precision("cpu" if acc == "cpu" else None)


# -- TF32 --------------------------------------------------------------------------------------
def has_tf32(device: torch.device | str | int | None = None) -> bool:
    """True where float32 matmuls can run on TF32 tensor cores (CUDA compute capability 8.0+)."""
    dev = _device(device)
    return (
        dev.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(dev) >= (8, 0)
    )


def apply_matmul_precision(level: str) -> Change:
    """Set ``torch.set_float32_matmul_precision(level)`` and cuDNN's TF32 flag (on unless
    ``level == "highest"``); the change's ``undo()`` puts the previous settings back."""
    check_choice("level", level, MATMUL_LEVELS)
    matmul, cudnn_tf32 = torch.get_float32_matmul_precision(), bool(torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision(level)
    torch.backends.cudnn.allow_tf32 = level != "highest"

    def undo() -> None:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32

    return Change(
        f"float32 matmul precision {matmul!r} -> {level!r}, "
        f"cuDNN TF32 {'on' if level != 'highest' else 'off'}",
        undo,
    )


class MatmulPrecision(Technique):
    """Run float32 matmuls and convolutions on TF32 tensor cores during fit.

    At fit start it calls ``torch.set_float32_matmul_precision(level)`` and sets
    ``torch.backends.cudnn.allow_tf32`` (``apply_matmul_precision``); after fit (and when it
    raises or is interrupted) both are put back.
    On a device without TF32 (a CPU, CUDA before Ampere) it changes nothing and says so once.

    Args:
        level: ``"high"`` (TF32, ~10 mantissa bits, the usual choice), ``"medium"`` (bf16-based
            where the backend has it) or ``"highest"`` (full fp32, TF32 off).
    """

    def __init__(self, level: str = "high") -> None:
        super().__init__()
        self.level = check_choice("level", level, MATMUL_LEVELS)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        device = trainer.strategy.root_device
        if not has_tf32(device):
            self.no_effect(
                f"{device.type} device has no TF32 tensor cores; float32 matmul precision left as is."
            )
            self.report(trainer, f"no effect: no TF32 on {device}")
            return
        self.report(trainer, self.record(trainer, apply_matmul_precision(self.level)))


# -- FP8 ---------------------------------------------------------------------------------------
def supports_fp8(device: torch.device | str | int | None = None) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9+: Ada, Hopper, newer)."""
    dev = _device(device)
    return (
        dev.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(dev) >= (8, 9)
    )


def _fp8_eligible(module: nn.Module) -> bool:
    # torchao's float8 matmul needs both dimensions divisible by 16
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_float8(
    model: nn.Module, *, recipe: str = "tensorwise", exclude: list[str] | tuple[str, ...] = ()
) -> Change:
    """Swap ``model``'s ``nn.Linear`` layers for torchao ``Float8Linear`` in place; the change's
    ``value`` is the names converted and its ``undo()`` puts the original layers back. Layers
    whose name matches a glob in ``exclude`` and layers whose dimensions are not multiples of 16
    stay as they are. Parameters (and so state_dict keys and optimizer references) are kept, and
    shared with the original layers; the matmuls run in float8 with dynamic scaling
    (``recipe``)."""
    check_module("model", model)
    check_choice("recipe", recipe, FP8_RECIPES)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise missing_extra("torchao", "fp8", "FP8 training") from err
    originals: dict[str, nn.Module] = {}

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = (
            bool(fqn)  # the model itself cannot be swapped in place
            and _fp8_eligible(module)
            and not any(fnmatch.fnmatchcase(fqn, g) for g in exclude)
        )
        if ok:
            originals[fqn] = module
        return ok

    convert_to_float8_training(
        model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe)
    )

    def undo() -> None:
        for fqn, original in originals.items():
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, original)

    return Change(
        f"{len(originals)} linear layers to FP8 ({recipe})",
        undo,
        figures={"converted_layers": len(originals)},
        value=list(originals),
    )


class Float8Training(Technique):
    """Train the model's linear layers in FP8 (torchao float8) on devices that have FP8 tensor
    cores (CUDA compute capability 8.9+). Needs ``pip install 'lightning-efficient[fp8]'``.

    The layers are converted in ``setup`` (before the optimizer is built and before
    ``TorchCompile`` compiles in ``on_fit_start``) and put back after fit (and when it raises or
    is interrupted), with the trained weights. On other devices nothing changes and the callback
    says so once. Use with ``precision="bf16-mixed"``.

    Args:
        recipe: torchao scaling recipe: ``"tensorwise"`` (fastest), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"`` (more accurate).
        exclude: name globs of linear layers to keep in high precision (e.g. ``["head"]``);
            layers whose dimensions are not multiples of 16 are always kept.
    """

    def __init__(self, recipe: str = "tensorwise", exclude: list[str] | None = None) -> None:
        super().__init__()
        self.recipe = check_choice("recipe", recipe, FP8_RECIPES)
        if exclude is not None and (
            not isinstance(exclude, (list, tuple)) or not all(isinstance(g, str) for g in exclude)
        ):
            raise TypeError(
                f"`exclude` must be a list of name globs or None; got {exclude!r} ({type(exclude).__name__})."
            )
        self.exclude = list(exclude or [])

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if not supports_fp8(device):
            self.no_effect(
                f"FP8 needs a CUDA device with compute capability 8.9 or newer (Ada, Hopper); "
                f"this run is on {device}, so the model trains without FP8."
            )
            self.report(trainer, f"no effect: no FP8 tensor cores on {device}")
            return
        change = self.record(
            trainer, apply_float8(pl_module, recipe=self.recipe, exclude=self.exclude)
        )
        if not change.value:
            self.no_effect("no nn.Linear layer with dimensions divisible by 16 to convert to FP8.")
        self.report(trainer, change)
