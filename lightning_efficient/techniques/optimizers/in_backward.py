"""Optimizer-in-backward: each parameter is stepped from its post-accumulate-grad hook and its
gradient freed at once, so the full set of gradients never exists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_efficient.core.change import Change

__all__ = ["InBackwardOptimizer", "apply_optimizer_in_backward", "attach_optimizer_in_backward"]


class InBackwardOptimizer(Optimizer):
    """The optimizer Lightning (and LR schedulers) see when each parameter is stepped from its
        post-accumulate-grad hook. ``step(closure)`` only runs the closure (forward + backward): the
        hooks do the per-parameter steps. Its param groups are the real ones: an LR scheduler writes
        ``lr`` here, and every hook copies the group's options into the parameter's own optimizer
        before stepping. ``state_dict`` holds every per-parameter optimizer's state; ``inner`` lists the
    per-parameter optimizers (the instrument counts their state through it).

        Args:
            param_groups: the groups (dicts with ``params``) the hyperparameters live in.
            factory: builds the optimizer of one parameter from ``[{**group_options, "params": [p]}]``.
    """

    def __init__(
        self, param_groups: Sequence[dict[str, Any]], factory: Callable[[list[dict]], Optimizer]
    ) -> None:
        super().__init__([dict(g) for g in param_groups], {})
        # parameter -> (its optimizer, the index of its group); by index, because
        # load_state_dict replaces the group dicts
        self._inner: dict[int, tuple[Optimizer, int]] = {}
        for index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self._inner[id(p)] = (factory([{**options, "params": [p]}]), index)
        self._handles: list[Any] = []

    @property
    def inner(self) -> list[Optimizer]:
        return [opt for opt, _ in self._inner.values()]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def attach(self) -> InBackwardOptimizer:
        self.detach()
        for p in self._params():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        opt, index = self._inner[id(p)]
        group, inner_group = self.param_groups[index], opt.param_groups[0]
        for key, value in group.items():
            if key != "params":
                inner_group[key] = value
        opt.step()
        p.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["per_parameter"] = [self._inner[id(p)][0].state_dict() for p in self._params()]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        per_parameter = state_dict.pop("per_parameter", None)
        params = self._params()
        if per_parameter is None or len(per_parameter) != len(params):
            raise ValueError(
                "InBackwardOptimizer.load_state_dict: the state was not written by an "
                "optimizer-in-backward run with the same parameters."
            )
        super().load_state_dict(state_dict)
        for p, state in zip(params, per_parameter):
            self._inner[id(p)][0].load_state_dict(state)


def attach_optimizer_in_backward(
    model: nn.Module,
    optimizer_factory: Callable[[list[dict]], Optimizer],
    param_groups: Sequence[dict[str, Any]] | None = None,
) -> InBackwardOptimizer:
    """Step every parameter of ``model`` from its post-accumulate-grad hook and free its gradient
    at once, so gradients never all live at the same time.

    ``optimizer_factory(groups)`` builds one parameter's optimizer (e.g.
    ``lambda g: build_optimizer("adamw8bit", g)``). ``param_groups`` (default: one group with
    every trainable parameter) carry the per-group options. Returns the
    :class:`InBackwardOptimizer` to hand to Lightning / LR schedulers; ``.detach()`` removes the
    hooks. Gradients are never accumulated over micro-batches and cannot be clipped as a whole.
    """
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return InBackwardOptimizer(param_groups, optimizer_factory).attach()


def apply_optimizer_in_backward(
    model: nn.Module,
    optimizer_factory: Callable[[list[dict]], Optimizer],
    param_groups: Sequence[dict[str, Any]] | None = None,
) -> Change:
    """:func:`attach_optimizer_in_backward` as a change: its ``value`` is the
    :class:`InBackwardOptimizer` to hand to Lightning or LR schedulers, its ``undo()`` takes the
    gradient hooks off the parameters."""
    optimizer = attach_optimizer_in_backward(model, optimizer_factory, param_groups)
    return Change(
        f"{len(optimizer.inner)} parameters stepped in backward",
        optimizer.detach,
        figures={"parameters": len(optimizer.inner)},
        value=optimizer,
    )
