"""Skipping and rolling back an update: ``drop_gradients`` (no optimizer step from this batch:
torch optimizers leave a parameter without a gradient untouched, states and step counts
included), ``grad_norm``, ``host_copy`` (a copy on host memory that reuses its buffers),
``restore_training_state`` (weights and optimizer states back, learning rates kept),
``scale_lr`` / ``set_lr``, ``scale_lr_for_step`` (a lower rate for one optimizer step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "drop_gradients",
    "grad_norm",
    "host_copy",
    "restore_training_state",
    "scale_lr",
    "scale_lr_for_step",
    "set_lr",
]


def _params(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


def drop_gradients(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Set every gradient of the optimizers' parameters to ``None`` so that the coming
    ``optimizer.step()`` changes nothing: torch optimizers skip parameters without a gradient
    (no weight update, no weight decay, no state or step-count change). Under a ``GradScaler``
    call it after ``unscale_`` (Lightning's ``on_before_optimizer_step``): ``scaler.step`` then
    runs a step that changes nothing. Returns the number of gradients dropped."""
    dropped = 0
    for p in _params(optimizers):
        if p.grad is not None:
            p.grad = None
            dropped += 1
    return dropped


def grad_norm(optimizers: Iterable[torch.optim.Optimizer]) -> torch.Tensor:
    """The total 2-norm of the optimizers' gradients, as a tensor (no host sync)."""
    grads = [p.grad for p in _params(optimizers) if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g.float()).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def host_copy(tree: Any, into: Any = None) -> Any:
    """A copy of a nested structure of tensors (dicts, lists, tuples) on host memory. When
    ``into`` is an earlier copy of the same structure, its buffers are reused (copied into)."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach()
        if (
            isinstance(into, torch.Tensor)
            and into.shape == t.shape
            and into.dtype == t.dtype
            and into.device.type == "cpu"
        ):
            return into.copy_(t)
        return t.to("cpu", copy=True)
    if isinstance(tree, Mapping):
        prev = into if isinstance(into, Mapping) else {}
        return {k: host_copy(v, prev.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        prev = into if isinstance(into, (list, tuple)) and len(into) == len(tree) else None
        items = [host_copy(v, prev[i] if prev else None) for i, v in enumerate(tree)]
        return type(tree)(items) if isinstance(tree, tuple) else items
    return tree


def restore_training_state(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    weights: Mapping[str, torch.Tensor],
    optimizer_states: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Put the weights (a ``state_dict`` copy) back into ``module`` in place (parameters keep
    their identity, so optimizers still hold them) and the optimizer states into
    ``optimizers``; each parameter group keeps its current settings (learning rate, momentum,
    betas: what an LR scheduler sets), so a schedule goes on from where it is."""
    module.load_state_dict(weights, strict=True)
    for opt, state in zip(optimizers, optimizer_states):
        kept = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(state)
        for group, settings in zip(opt.param_groups, kept):
            group.update(settings)  # what a scheduler set (lr, momentum, betas) stays


def scale_lr(optimizers: Iterable[torch.optim.Optimizer], factor: float) -> list[float]:
    """Multiply every parameter group's learning rate by ``factor``; return the previous ones
    (for ``set_lr``)."""
    previous = []
    for opt in optimizers:
        for group in opt.param_groups:
            previous.append(group["lr"])
            group["lr"] = group["lr"] * factor
    return previous


def scale_lr_for_step(
    optimizers: Iterable[torch.optim.Optimizer], factor: float
) -> Callable[[], None]:
    """Multiply every parameter group's learning rate by ``factor`` for the coming
    ``optimizer.step()`` only: each optimizer puts its rates back right after its step (a step
    post-hook), before an LR scheduler steps, so the scheduler never sees the factor and any
    schedule goes on as without it. Returns ``undo()`` for a step that did not run (safe to call
    twice; a rate something else set meanwhile is kept)."""
    undos = [_LowerForStep(getattr(opt, "optimizer", opt), factor) for opt in optimizers]

    def undo() -> None:
        for one in undos:
            one.undo()

    return undo


class _LowerForStep:
    """One optimizer's rates lowered until its next step ends (or ``undo()``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        self.scaled = [(g, g["lr"], g["lr"] * factor) for g in optimizer.param_groups]
        for group, _, lowered in self.scaled:
            group["lr"] = lowered
        hook = getattr(optimizer, "register_step_post_hook", None)
        self.handle = hook(lambda *_: self.undo()) if hook is not None else None

    def undo(self) -> None:
        for group, before, lowered in self.scaled:
            if group["lr"] == lowered:
                group["lr"] = before
        self.scaled = []
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lrs: Sequence[float]) -> None:
    """Set the parameter groups' learning rates, in order (the inverse of ``scale_lr``)."""
    groups = [g for opt in optimizers for g in opt.param_groups]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
