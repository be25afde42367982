"""The pieces of a training step that the estimate, the real measurements and the techniques
share: ``run_step``, the one call of the user's step (real or fake tensors; every measurement
runs it inside :func:`~lightning_efficient.measure.scratch.scratch`, which puts the module
back), the loss out of a step's output, autocast for a Lightning precision string, a
LightningModule whose ``self.log`` is muted while the instrument runs its step, and
``forward_backward``: the real training step (forward + backward) the trials time."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "autocast_for",
    "forward_backward",
    "is_lightning_module",
    "loss_of",
    "run_step",
    "silenced_logging",
]


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a training step's output: a tensor, a mapping with a ``"loss"`` tensor, or an
    object with a ``.loss`` tensor (Hugging Face's ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        "the training step must return a loss tensor, a dict with a 'loss' tensor, or an object "
        f"with a .loss tensor; got {type(output).__name__}."
    )


def autocast_for(precision: str, device_type: str = "cpu") -> Any:
    """The autocast context of a Lightning precision string (``"bf16-mixed"`` -> bfloat16
    autocast on ``device_type``; a ``*-true`` or ``32`` precision -> no autocast)."""
    precision = str(precision)
    # as Lightning's MixedPrecision plugin: without autocast's weight cache, so the low-precision
    # copies of the weights live only as long as something (autograd) keeps them
    if precision.startswith("bf16-mixed"):
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
    if precision.startswith("16-mixed"):
        return torch.autocast(device_type, dtype=torch.float16, cache_enabled=False)
    return contextlib.nullcontext()


def is_lightning_module(model: nn.Module) -> bool:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, LightningModule)


@contextlib.contextmanager
def silenced_logging(model: nn.Module) -> Iterator[None]:
    """``self.log``/``self.log_dict`` of a LightningModule do nothing inside (an instance
    override, removed on exit; an override the module had is put back).

    Fake tensors must not reach Lightning's logging store (device mismatch, and logging outside
    the loop raises); the instrument's steps measure memory and time, not metrics.
    """
    if not is_lightning_module(model):
        yield
        return
    had = {name: name in vars(model) for name in ("log", "log_dict")}
    saved = {name: vars(model)[name] for name, present in had.items() if present}
    object.__setattr__(model, "log", lambda *a, **k: None)
    object.__setattr__(model, "log_dict", lambda *a, **k: None)
    try:
        yield
    finally:
        for name, present in had.items():
            if present:
                object.__setattr__(model, name, saved[name])
            else:
                vars(model).pop(name, None)


def run_step(
    module: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> Any:
    """The user's step on ``batch``, the one place the package calls it: ``loss_fn(module,
    batch)`` when given; else a LightningModule's ``training_step(batch, 0)`` (``(batch)`` when
    it takes no batch index); else the module's forward, ``module(batch)``. Returns what it
    returned (:func:`loss_of` reads the loss). Measurements call it inside
    :func:`~lightning_efficient.measure.scratch.scratch` (the module put back after)."""
    if loss_fn is not None:
        return loss_fn(module, batch)
    step = getattr(module, "training_step", None)
    if step is None:
        return module(batch)
    return step(batch, 0) if _takes_batch_idx(step) else step(batch)


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2


def forward_backward(
    module: nn.Module,
    batch: Any,
    *,
    precision: str = "32-true",
    device_type: str = "cpu",
    context: Callable[[], Any] | None = None,
    keep_grads: bool = True,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> Callable[[], torch.Tensor]:
    """The real training step the instrument times: ``step()`` runs :func:`run_step` (``loss_fn``
    or the module's ``training_step``) under ``context()`` (a strategy's
    ``precision_plugin.forward_context``) or else the autocast of ``precision`` on
    ``device_type``, backward of its loss, and returns the loss (detached). ``keep_grads=False``
    drops the gradients after backward (steps timed without an optimizer)."""

    def step() -> torch.Tensor:
        with context() if context is not None else autocast_for(precision, device_type):
            loss = loss_of(run_step(module, batch, loss_fn))
        loss.backward()
        if not keep_grads:
            for p in module.parameters():
                p.grad = None
        return loss.detach()

    return step
