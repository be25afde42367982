"""bf16 weights with compensated optimizer updates (``precision="bf16-true"``).

With bf16 weights an AdamW update smaller than half a bf16 step of the weight (``2**-9`` of it)
is rounded away: at a fine-tuning learning rate a weight near 1.0 (a norm's gain) never moves.
Three names of ``OptimizerSwap`` keep the updates:

- ``"adamw_kahan"``: torch-optimi's ``AdamW(kahan_sum=True)``: a bf16 compensation buffer holds
  what each update's rounding lost and adds it back (weights 2 + gradients 2 + moments 4 +
  buffer 2 = 10 bytes a parameter).
- ``"adamw_sr"``: torchao's ``_AdamW(bf16_stochastic_round=True)``: the fp32 result is rounded
  up or down at random, with the probability that makes it exact on average; bf16 moments
  (8 bytes a parameter).
- ``"adamw8bit_sr"``: the same rounding on torchao's 8-bit AdamW (about 6 bytes a parameter).

The stochastic rounding draws from a generator state of its own, kept in the optimizer's state
(:mod:`.rounding`). Needs ``pip install 'lightning-efficient[bf16]'``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_efficient.measure.memory.optimizer_models import optimizer_class

__all__ = [
    "BF16_NAMES",
    "GATE",
    "compensation_options",
    "swap_class",
    "check_low_precision_weights",
    "gate_summary",
]

#: name -> the weight dtypes its compensation works on
BF16_NAMES: dict[str, tuple[torch.dtype, ...]] = {
    "adamw_kahan": (torch.bfloat16, torch.float16),
    "adamw_sr": (torch.bfloat16,),
    "adamw8bit_sr": (torch.bfloat16,),
}

#: The quality gate (``benchmarks/bf16_weights.py``, results/bf16_weights.json; a test keeps
#: these equal to the results): the worst held-out loss against fp32 masters over its learning
#: rates, for plain bf16 AdamW and each compensated form.
GATE: dict[str, float] = {
    "adamw": 0.0048,
    "adamw_kahan": 0.0,
    "adamw_sr": -0.0001,
    "adamw8bit_sr": 0.0002,
}


def gate_summary(name: str) -> str:
    """The gate's figure for ``name`` in words, for a decision's cost."""
    return (
        f"{name} held-out loss {GATE[name]:+.2%} of fp32 masters in the quality gate "
        f"(plain bf16 AdamW {GATE['adamw']:+.2%}; benchmarks/bf16_weights.py)"
    )


def swap_class(name: str) -> type[Optimizer]:
    """The class a swap to ``name`` builds: :func:`optimizer_class`, except the stochastic
    rounding names, whose torchao class gets its own rounding RNG (:mod:`.rounding`)."""
    cls = optimizer_class(name)  # the pip command when the extra is missing
    if name == "adamw_sr":
        from lightning_efficient.techniques.optimizers.rounding import StochasticRoundingAdamW

        return StochasticRoundingAdamW
    if name == "adamw8bit_sr":
        from lightning_efficient.techniques.optimizers.rounding import (
            StochasticRoundingAdamW8bit,
        )

        return StochasticRoundingAdamW8bit
    return cls


def compensation_options(name: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Constructor options that turn the compensation on (torch-optimi takes no default ``lr``:
    the first group's; every group carries its own)."""
    if name == "adamw_kahan":
        return {"kahan_sum": True, "lr": groups[0].get("lr", 1e-3) if groups else 1e-3}
    return {}


def check_low_precision_weights(name: str, params: Iterable[torch.Tensor]) -> str | None:
    """Refuse ``name`` when none of the trainable ``params`` has a dtype its compensation works
    on (32-bit weights: ``32-true`` or ``bf16-mixed`` keep fp32 masters, whose updates are not
    rounded away, so the swap would cost memory and do nothing). Returns a note when only some
    are (those others step as plain AdamW), else ``None``."""
    if name not in BF16_NAMES:
        return None
    allowed = BF16_NAMES[name]
    dtypes = [p.dtype for p in params if p.requires_grad]
    low = sum(d in allowed for d in dtypes)
    if dtypes and not low:
        found = ", ".join(sorted({str(d).replace("torch.", "") for d in dtypes}))
        wanted = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(
            f"OptimizerSwap({name!r}) compensates the rounding of {wanted} weights, but the "
            f"module's trainable weights are {found}: 32-bit weights lose no update to rounding, "
            "so it would only cost memory. Train with Trainer(precision='bf16-true') (the module "
            "in bf16), or keep 32-bit weights with OptimizerSwap('adamw_fused') or 'adamw8bit'."
        )
    if low < len(dtypes):
        return (
            f"{len(dtypes) - low} of {len(dtypes)} trainable tensors are not "
            f"{'/'.join(str(d).replace('torch.', '') for d in allowed)}: {name!r} steps them "
            "as plain AdamW (nothing to compensate)."
        )
    return None
