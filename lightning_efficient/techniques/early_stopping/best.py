"""Where ``EarlyStopper`` keeps the best weights, and how it puts them back.

The weights of the best check live in a copy on host memory, or in the best file of a
``ModelCheckpoint`` that monitors the same metric the same way. Which one is decided after the
check, once the checkpoint callbacks have run and before the weights change again (the next
batch, or the end of training): the file is relied on only when the callback wrote a new best
file in that window (it then holds exactly these weights); otherwise (a callback that saves
every N steps, or skips a step it saved already) a host copy is taken.

Putting them back reads the file without side effects (``read_checkpoint``: a strategy's own
``load_checkpoint`` may load the module and optimizers, as FSDP's does) and loads a full state
dict whatever the sharding (``load_full_state_dict``). Checkpoints written after that during the
fit (``ModelCheckpoint``'s last file at train end, ``OnExceptionCheckpoint``) get the weights
training reached, so their weights, step and optimizer state belong together and a run resumed
from them continues where it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_efficient.techniques.early_stopping.rollback import host_copy

__all__ = ["BestWeights", "load_full_state_dict", "not_kept_message", "read_checkpoint"]


def not_kept_message(step: int) -> str:
    return (
        f"restore_best: the best weights (step {step}) were not kept on host and no "
        "ModelCheckpoint file holds them; the module keeps its last weights."
    )


def read_checkpoint(strategy: Any, path: str) -> dict[str, Any]:
    """The checkpoint file ``path`` as a dict, read with the strategy's ``CheckpointIO`` and
    loaded into nothing."""
    return strategy.checkpoint_io.load_checkpoint(path)


def _sharded(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load a full (unsharded) state dict into ``module`` in place (strict), also when its
    parameters are DTensors (FSDP2): each rank then keeps its shard of the full tensors. Under
    sharding every rank must call it (it communicates)."""
    if _sharded(module):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(module, dict(state_dict), options=options)
    else:
        module.load_state_dict(state_dict, strict=True)


class BestWeights:
    """The best weights of one ``EarlyStopper``: a host copy or a checkpoint file (see the
    module docstring). ``state()``/``load(state)`` checkpoint it."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] | None = None  # host copy
        self.file = ""  # a ModelCheckpoint best file that holds them
        self.pending: tuple[str, float | None] | None = None  # that callback's best at a check
        self.last: dict[str, Any] | None = None  # the trained weights, once the best are back

    def improved(self, module: nn.Module, callback: Any) -> None:
        """The check just improved: copy the weights now, or (with a ``ModelCheckpoint`` that
        may save them) note its best file, to be settled before the weights change."""
        if callback is None:
            self.weights = host_copy(module.state_dict(), into=self.weights)
            self.file, self.pending = "", None
        else:
            self.pending = _best_of(callback)

    def settle(self, strategy: Any, module: nn.Module, callback: Any) -> None:
        """Before the weights change: the callback's new best file holds them, or copy them."""
        if self.pending is None:
            return
        noted, self.pending = self.pending, None
        now = _best_of(callback) if callback is not None else ("", None)
        wrote = strategy.reduce_boolean_decision(bool(now[0]) and now != noted, all=True)
        if wrote:
            self.file, self.weights = now[0], None
        else:
            self.weights = host_copy(module.state_dict(), into=self.weights)
            self.file = ""

    def restore(self, trainer: Any, module: nn.Module, step: int, callback: Any = None) -> str:
        """Load the best weights (of optimizer step ``step``) into ``module``; returns where
        they came from, ``""`` when nothing holds them. Every rank must call it. Without a file
        noted (a checkpoint written before files were noted), ``callback``'s best file is read
        and used when its step is ``step``. A best still pending is settled first."""
        strategy, state = trainer.strategy, None
        self.settle(strategy, module, callback)
        if self.weights is not None:
            source = "host copy"
        else:
            path, checkpoint = self.file or _best_of(callback)[0], None
            if path and os.path.isfile(path):
                try:
                    checkpoint = read_checkpoint(strategy, path)
                except Exception:  # noqa: BLE001 - unreadable here: said by the caller's warning
                    checkpoint = None
            ok = checkpoint is not None and checkpoint.get("global_step") == step
            if not strategy.reduce_boolean_decision(ok, all=True):
                return ""
            source, state = os.path.basename(path), checkpoint["state_dict"]
        if getattr(trainer, "checkpoint_callbacks", None):  # kept for checkpoints from now on
            self.last = host_copy(strategy.lightning_module_state_dict())
        if state is None:
            module.load_state_dict(self.weights, strict=True)
        else:
            load_full_state_dict(module, state)
        return source

    def into_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written after the best weights came back holds the trained weights."""
        if self.last is not None and "state_dict" in checkpoint:
            checkpoint["state_dict"] = self.last

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.weights is not None:
            state["best_weights"] = self.weights
        if self.file:
            state["best_file"] = self.file
        if self.pending is not None:
            state["best_pending"] = list(self.pending)
        return state

    def load(self, state: Mapping[str, Any]) -> None:
        weights = state.get("best_weights")
        self.weights = host_copy(weights) if weights is not None else None
        self.file = str(state.get("best_file", ""))
        pending = state.get("best_pending")
        self.pending = (str(pending[0]), pending[1]) if pending else None


def _best_of(callback: Any) -> tuple[str, float | None]:
    """A ModelCheckpoint's best file and score, as plain values (comparable after a resume)."""
    score = getattr(callback, "best_model_score", None)
    return str(getattr(callback, "best_model_path", "") or ""), (
        None if score is None else float(score)
    )
