"""Spend fewer steps: ``EarlyStopper`` (stop on a plateau, a threshold or a budget, and put the
best weights back) and ``DivergenceGuard`` (no update from a NaN or a loss spike: stop, skip or
roll back). The maths lives in :mod:`.functions` and is usable without Lightning."""

from lightning_efficient.techniques.early_stopping.functions import (
    MODES,
    DivergenceDetector,
    PlateauTracker,
    divergence_reason,
    drop_gradients,
    ema_alpha,
    ema_update,
    format_duration,
    grad_norm,
    host_copy,
    is_improvement,
    is_spike,
    parse_count,
    parse_duration,
    restore_training_state,
    scale_lr,
    scale_lr_for_step,
    set_lr,
    threshold_reached,
)
from lightning_efficient.techniques.early_stopping.guard import ACTIONS, DivergenceGuard
from lightning_efficient.techniques.early_stopping.stopper import EarlyStopper

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
