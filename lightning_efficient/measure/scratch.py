"""The one instrument for real (and fake) steps on the user's module: what they change is put back.

A measurement changes nothing on the user's module. Steps run to measure (a trial of a stack, a
throughput, the compile trial, the fake-tensor estimate) change more than the ``state_dict``: a
forward registers a buffer or caches a tensor attribute at its first call (LitGPT's LoRA index
buffer), a counter counts samples, a torchmetrics metric accumulates, dropout draws from the RNG.

- :func:`keep_module_state`: a snapshot of ``module`` and every submodule now; the returned
  :class:`~lightning_efficient.core.change.Change` puts it back on ``undo()``: each module's own
  attributes (added ones removed, rebound ones restored; dicts, lists and sets, among them the
  parameter, buffer, submodule and hook dicts, get their items back in place), the values of the
  tensors they hold (parameters, buffers, plain tensor attributes, metric states: copied back in
  place, so a tensor keeps its identity), the parameters' gradients and ``requires_grad``, and
  the RNG (torch's CPU and CUDA generators, Python's ``random``). ``values=False`` keeps
  references only (the fake-tensor estimate, which changes no real tensor's data).
- :func:`scratch`: ``with scratch(module, device) as change:`` the module on ``device`` in train
  (or eval) mode with ``self.log`` muted; put back on leaving, whatever happened inside. Every
  run of the user's step (:func:`~lightning_efficient.measure.step.run_step`) is inside one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import fsdp_sharded, module_tensor_slots
from lightning_efficient.core.change import Change
from lightning_efficient.measure.step import silenced_logging

__all__ = ["keep_module_state", "keep_rng", "scratch"]


def keep_rng() -> Change:
    """The RNG now (torch's CPU generator, every initialised CUDA device's, Python's
    ``random``); ``undo()`` sets it back."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()

    def undo() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)

    return Change("RNG state kept", undo)


class _Values:
    """Copies (on the host) of the data of tensors, put back in place on restore."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.device, bool | None]] = {}

    def keep(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or id(t) in self._saved or t.is_meta:
            return
        flag = t.requires_grad if t.is_leaf else None
        self._saved[id(t)] = (t, t.detach().to("cpu", copy=True), t.device, flag)

    def restore(self) -> None:
        with torch.no_grad():
            for t, data, device, flag in self._saved.values():
                _put(t, data, device)
                if flag is not None and t.requires_grad != flag:
                    t.requires_grad_(flag)


def _put(t: torch.Tensor, data: torch.Tensor, device: torch.device) -> None:
    """``t`` holds ``data`` on ``device`` again: copied into its storage when it is still there
    with the shape and dtype (views of it see the values), else its ``.data`` replaced."""
    same = t.device == device and t.shape == data.shape and t.dtype == data.dtype
    if same and t.layout == data.layout:
        t.data.copy_(data)
    else:  # moved to the trial's device, or resized in place
        t.data = data.to(device)


def _containers(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, set):
        return set(value)
    return None


def _refill(obj: Any, items: Any) -> None:
    if isinstance(obj, dict):  # (never compared with ==: tensor values would be compared)
        obj.clear()
        obj.update(items)
    elif isinstance(obj, list):
        obj[:] = items
    else:
        obj.clear()
        obj.update(items)


def _tensors_in(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))
    elif isinstance(value, (list, tuple, set)):
        yield from (v for v in value if isinstance(v, torch.Tensor))


def keep_module_state(module: nn.Module, *, values: bool = True, rng: bool = True) -> Change:
    """Snapshot ``module`` (every submodule's own attributes, the tensors they hold, gradients
    and, with ``rng``, the RNG); the returned change's ``undo()`` puts all of it back.

    ``values``: also copy the data of every tensor held (to the host) and copy it back in place
    on undo; ``False`` keeps references only (for steps that change no real tensor's data).

    Under FSDP2 (``fully_shard``) the parameter dicts are FSDP's: a forward registers the
    unsharded parameters and the root keeps them until its backward, with FSDP's own record
    saying so; putting the sharded ones back would leave that record wrong (the next forward
    met a sharded weight). Their entries are left to FSDP; their values are still kept."""
    modules = list(dict.fromkeys(module.modules()))
    fsdp = bool(fsdp_sharded(module))
    saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
    grads: list[tuple[nn.Parameter, Any]] = []
    kept = _Values()
    for m in modules:
        own = dict(vars(m))
        fsdps = [d for d, is_param in module_tensor_slots(m) if is_param] if fsdp else []
        items = {
            k: c
            for k, v in own.items()
            if not any(v is d for d in fsdps) and (c := _containers(v)) is not None
        }
        saved.append((m, own, items))
        for store, is_param in module_tensor_slots(m):
            for t in store.values():
                if is_param and t is not None:
                    grads.append((t, t.grad))
                if values:
                    kept.keep(t)
                    kept.keep(t.grad if is_param and t is not None else None)
        if values:
            for v in own.values():
                for t in _tensors_in(v):
                    kept.keep(t)
    rng_change = keep_rng() if rng else None

    def undo() -> None:
        for m, own, items in saved:
            state = vars(m)
            for name in [k for k in state if k not in own]:
                del state[name]
            for name, value in own.items():
                if state.get(name, _ABSENT) is not value:
                    state[name] = value
                if name in items:
                    _refill(value, items[name])
        for p, _ in grads:  # the step's gradients go first (they may live on another device)
            p.grad = None
        kept.restore()
        for p, grad in grads:
            p.grad = grad
        if rng_change is not None:
            rng_change.undo()

    return Change(f"state of {type(module).__name__} kept", undo)


_ABSENT = object()


@contextlib.contextmanager
def scratch(
    module: nn.Module,
    device: torch.device | str | None = None,
    *,
    train: bool = True,
    values: bool = True,
) -> Iterator[Change]:
    """Steps on ``module`` (moved to ``device``, in train mode, or eval mode with
    ``train=False``; ``self.log`` muted) that leave no trace: on leaving, whatever happened
    inside, :func:`keep_module_state`'s change puts the module back (its device, modes, weights,
    buffers, attributes, metric states, gradients and the RNG). ``values=False``: for steps that
    change no real tensor's data (fake tensors), references are kept, not copies.

    The one put-back of the instrument: every run of the user's step
    (:func:`~lightning_efficient.measure.step.run_step`: the estimate, the trials, the FLOP
    count, the step rate, packing's check) happens inside it."""
    change = keep_module_state(module, values=values)
    try:
        if device is not None:
            module.to(torch.device(device))
        module.train(train)
        with silenced_logging(module):
            yield change
    finally:
        change.undo()
