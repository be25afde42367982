"""Spend fewer steps: ``EarlyStopper`` (stop on a plateau, a threshold or a budget, and put the
best weights back) and ``DivergenceGuard`` (no update from a NaN or a loss spike: stop, skip or
roll back). The maths lives in one module per idea (:mod:`.plateau`,
:mod:`.smoothing`, :mod:`.budgets`, :mod:`.divergence`, :mod:`.rollback`), usable without
Lightning."""

from lightning_efficient.techniques.early_stopping.budgets import (
    format_duration,
    parse_count,
    parse_duration,
)
from lightning_efficient.techniques.early_stopping.callback import (
    ACTIONS,
    DivergenceGuard,
    EarlyStopper,
)
from lightning_efficient.techniques.early_stopping.divergence import (
    DivergenceDetector,
    divergence_reason,
    is_spike,
)
from lightning_efficient.techniques.early_stopping.plateau import (
    MODES,
    PlateauTracker,
    is_improvement,
    threshold_reached,
)
from lightning_efficient.techniques.early_stopping.rollback import (
    drop_gradients,
    grad_norm,
    host_copy,
    restore_training_state,
    scale_lr,
    scale_lr_for_step,
    set_lr,
)
from lightning_efficient.techniques.early_stopping.smoothing import ema_alpha, ema_update

__all__ = [
    "EarlyStopper",
    "DivergenceGuard",
    "ACTIONS",
    "MODES",
    "DivergenceDetector",
    "PlateauTracker",
    "divergence_reason",
    "drop_gradients",
    "ema_alpha",
    "ema_update",
    "format_duration",
    "grad_norm",
    "host_copy",
    "is_improvement",
    "is_spike",
    "parse_count",
    "parse_duration",
    "restore_training_state",
    "scale_lr",
    "scale_lr_for_step",
    "set_lr",
    "threshold_reached",
]
