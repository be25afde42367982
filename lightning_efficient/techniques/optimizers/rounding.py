"""torchao's AdamW with bf16 stochastic rounding, drawing its random bits from a generator state
of its own that is optimizer state (so a resumed run rounds exactly as the uninterrupted one, and
the user's RNG stream, e.g. dropout, is the same as without the swap). Imported lazily: needs
torchao (``pip install 'lightning-efficient[bf16]'``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchao.optim import AdamW8bit, _AdamW
from torchao.optim.subclass_8bit import OptimState8bit

__all__ = ["StochasticRoundingAdamW", "StochasticRoundingAdamW8bit"]

_RNG_KEY = "rounding_rng"
_PACKED = "optim_state_8bit"


def _pack(value: Any) -> Any:
    """torchao's 8-bit state as plain tensors (a tensor subclass does not survive Lightning's
    checkpoint loading: ``torch.load`` with a callable ``map_location`` refuses it)."""
    if isinstance(value, OptimState8bit):
        names, attributes = value.__tensor_flatten__()
        return {_PACKED: {n: getattr(value, n) for n in names}, "attributes": list(attributes)}
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, dict) and _PACKED in value:
        return OptimState8bit.__tensor_unflatten__(value[_PACKED], value["attributes"])
    return value


class _OwnRoundingRng:
    """A torchao ``_AdamBase`` whose rounding draws from its own RNG state (one per device),
    seeded from ``torch.initial_seed()`` at construction and saved in ``state_dict()``."""

    param_groups: list[dict[str, Any]]

    def _own_rng(self) -> None:
        self.rounding_seed = torch.initial_seed()
        self.rounding_rng: dict[str, torch.Tensor] = {}

    def _devices(self) -> list[torch.device]:
        return sorted(
            {p.device for g in self.param_groups for p in g["params"] if p.device.type == "cuda"},
            key=str,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:  # the forward and backward draw from the user's RNG
            with torch.enable_grad():
                loss = closure()
        cuda = self._devices()
        with torch.random.fork_rng(devices=[d.index or 0 for d in cuda]):
            self._load_rng(cuda)
            super().step()  # type: ignore[misc]
            self.rounding_rng = {"cpu": torch.get_rng_state()}
            for d in cuda:
                self.rounding_rng[str(d)] = torch.cuda.get_rng_state(d)
        return loss

    def _load_rng(self, cuda: list[torch.device]) -> None:
        if "cpu" in self.rounding_rng:
            torch.set_rng_state(self.rounding_rng["cpu"])
        else:
            torch.random.default_generator.manual_seed(self.rounding_seed)
        for d in cuda:
            if str(d) in self.rounding_rng:
                torch.cuda.set_rng_state(self.rounding_rng[str(d)], d)
            else:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(self.rounding_seed)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        state["state"] = {
            i: {k: _pack(v) for k, v in per_param.items()}
            for i, per_param in state["state"].items()
        }
        state[_RNG_KEY] = {k: v.clone() for k, v in self.rounding_rng.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        rng = state_dict.pop(_RNG_KEY, None)
        state_dict["state"] = {
            i: {k: _unpack(v) for k, v in per_param.items()}
            for i, per_param in state_dict.get("state", {}).items()
        }
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for group in self.param_groups:  # a state written by another optimizer has a float lr
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
        if rng is not None:
            self.rounding_rng = {k: v.clone() for k, v in rng.items()}


class StochasticRoundingAdamW(_OwnRoundingRng, _AdamW):
    """torchao's ``_AdamW(bf16_stochastic_round=True)``: moments of the weights' dtype (bf16 for
    bf16 weights); bf16 weights are rounded stochastically after each update."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, bf16_stochastic_round=True)
        self._own_rng()


class StochasticRoundingAdamW8bit(_OwnRoundingRng, AdamW8bit):
    """torchao's ``AdamW8bit(bf16_stochastic_round=True)``: 8-bit blockwise moments (tensors of
    at least 4,096 values divisible by ``block_size``), bf16 weights rounded stochastically."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        block_size: int = 256,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            block_size=block_size,
            bf16_stochastic_round=True,
        )
        self._own_rng()
