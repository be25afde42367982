"""The maths of early stopping and divergence guarding, usable without Lightning.

- Improvement and plateau: ``is_improvement`` (absolute or relative ``min_delta``),
  ``threshold_reached``, and ``PlateauTracker`` (best value and step, patience, optional
  smoothing) that ``EarlyStopper`` feeds one value per check.
- Smoothing: ``ema_alpha(half_life)`` and ``ema_update`` (exponential moving average whose
  weight halves every ``half_life`` observations).
- Budgets: ``parse_duration("1h30m") == 5400.0``, ``parse_count("2.5M") == 2_500_000``,
  ``format_duration``, ``budget_reason`` (which budget is spent), ``steps_saved`` and ``stop_summary`` (the report
  row); ``matching_checkpoint`` finds a ModelCheckpoint whose best file can be restored.
- Divergence: ``is_spike(value, baseline, factor)``, ``divergence_reason`` and
  ``DivergenceDetector`` (a smoothed baseline of the good values only).
- Skipping and rolling back an update: ``drop_gradients`` (no optimizer step from this batch:
  torch optimizers leave a parameter without a gradient untouched, states and step counts
  included), ``grad_norm``, ``host_copy`` (a copy on host memory that reuses its buffers),
  ``restore_training_state`` (weights and optimizer states back, learning rates kept),
  ``scale_lr`` / ``set_lr``, ``scale_lr_for_step`` (a lower rate for one optimizer step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.validate import check_float

__all__ = [
    "MODES",
    "is_improvement",
    "threshold_reached",
    "check_half_life",
    "ema_alpha",
    "ema_update",
    "PlateauTracker",
    "parse_duration",
    "format_duration",
    "parse_count",
    "budget_reason",
    "steps_saved",
    "stop_summary",
    "matching_checkpoint",
    "missing_metric_message",
    "is_spike",
    "divergence_reason",
    "DivergenceDetector",
    "drop_gradients",
    "grad_norm",
    "host_copy",
    "restore_training_state",
    "scale_lr",
    "scale_lr_for_step",
    "set_lr",
]

MODES = ("min", "max")


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# -- improvement and smoothing -----------------------------------------------------------------
def is_improvement(
    value: float,
    best: float | None,
    *,
    mode: str = "min",
    min_delta: float = 0.0,
    relative: bool = False,
) -> bool:
    """True when ``value`` beats ``best`` by more than ``min_delta`` (in the direction of
    ``mode``). With ``relative=True`` the margin is ``min_delta * |best|`` (``0.01``: 1%).
    A non-finite value never improves; anything finite improves on ``best=None``."""
    if not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    margin = min_delta * abs(best) if relative else min_delta
    return value < best - margin if mode == "min" else value > best + margin


def threshold_reached(value: float, threshold: float | None, mode: str = "min") -> bool:
    """True when ``value`` is at least as good as ``threshold`` ("good enough: stop")."""
    if threshold is None or not math.isfinite(value):
        return False
    return value <= threshold if mode == "min" else value >= threshold


def ema_alpha(half_life: float) -> float:
    """Weight of a new observation in an EMA whose older observations' weight halves every
    ``half_life`` observations: ``1 - 0.5 ** (1 / half_life)``."""
    check_float("half_life", half_life, minimum=0.0)
    if half_life <= 0:
        raise ValueError(f"`half_life` must be > 0 (observations); got {half_life!r}.")
    return 1.0 - 0.5 ** (1.0 / half_life)


def ema_update(previous: float | None, value: float, half_life: float | None) -> float:
    """The next value of an exponential moving average (``half_life=None``: no smoothing).
    The first value starts the average; a non-finite value leaves it unchanged."""
    if half_life is None or previous is None:
        return value if (previous is None or math.isfinite(value)) else previous
    if not math.isfinite(value):
        return previous
    return previous + ema_alpha(half_life) * (value - previous)


@dataclass
class PlateauTracker:
    """Best value, patience and smoothing of one monitored quantity, one ``observe`` per check.

    ``observe(value, step)`` returns ``(improved, reason)``: ``reason`` says why training should
    stop (patience used up, threshold reached, non-finite value) or is ``None``. The decision
    reads the smoothed value when ``half_life`` is set. The mutable fields (``best`` ...
    ``smoothed``) are the state to checkpoint: ``state()`` / ``load(state)``.
    """

    mode: str = "min"
    min_delta: float = 0.0
    relative: bool = False
    patience: int = 3
    half_life: float | None = None
    stopping_threshold: float | None = None
    check_finite: bool = True
    best: float | None = None
    best_step: int = -1
    wait: int = 0
    checks: int = 0
    smoothed: float | None = None

    _STATE = ("best", "best_step", "wait", "checks", "smoothed")

    def observe(self, value: float, step: int) -> tuple[bool, str | None]:
        self.checks += 1
        if not math.isfinite(value):
            self.wait += 1
            if self.check_finite:
                return False, f"the value is {value}"
            return False, self._patience_reason()
        self.smoothed = ema_update(self.smoothed, value, self.half_life)
        current = self.smoothed
        improved = is_improvement(
            current, self.best, mode=self.mode, min_delta=self.min_delta, relative=self.relative
        )
        if improved:
            self.best, self.best_step, self.wait = current, step, 0
        else:
            self.wait += 1
        if threshold_reached(current, self.stopping_threshold, self.mode):
            sign = "<=" if self.mode == "min" else ">="
            return improved, (
                f"reached the stopping threshold ({current:.4g} {sign} "
                f"{self.stopping_threshold:.4g})"
            )
        return improved, self._patience_reason()

    def _patience_reason(self) -> str | None:
        if self.wait >= self.patience:
            return f"no improvement in {self.wait} checks (patience {self.patience})"
        return None

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in self._STATE}

    def load(self, state: Mapping[str, Any]) -> None:
        for f in fields(self):
            if f.name in self._STATE and f.name in state:
                setattr(self, f.name, state[f.name])


# -- budgets -----------------------------------------------------------------------------------
_DURATION_UNITS = {
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "ms": 1e-3,
}
_DURATION_PART = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)")
_CLOCK = re.compile(r"^\s*(?:(\d+):)?(?:(\d+):)?(\d+):(\d+(?:\.\d*)?)\s*$")


def parse_duration(value: Any, name: str = "max_time") -> float | None:
    """Seconds from a duration: a number of seconds, a ``timedelta``, a string of number+unit
    parts (``"1h30m"``, ``"90s"``, ``"2.5h"``, ``"1d 2h"``; units d, h, m/min, s, ms) or a clock
    string ``"[DD:]HH:MM:SS"`` / ``"MM:SS"`` (Lightning's ``max_time`` form). ``None`` stays
    ``None``. Anything else, or a duration <= 0, raises a ``ValueError``/``TypeError`` naming
    ``name``."""
    allowed = "a number of seconds, or a string like '1h30m', '90s', '2.5h' or 'DD:HH:MM:SS'"
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration_str(value)
        if seconds is None:
            raise ValueError(f"`{name}` is not a duration: {value!r}. Use {allowed}.")
    else:
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"`{name}` must be a duration > 0; got {value!r}.")
    return seconds


def _parse_duration_str(text: str) -> float | None:
    clock = _CLOCK.match(text)
    if clock:
        parts = [p for p in clock.groups() if p is not None]
        scales = [86400.0, 3600.0, 60.0, 1.0][-len(parts) :]
        return sum(float(p) * s for p, s in zip(parts, scales))
    pos, total, found = 0, 0.0, False
    stripped = text.strip()
    while pos < len(stripped):
        match = _DURATION_PART.match(stripped, pos)
        if match is None or match.group(2).lower() not in _DURATION_UNITS:
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]
        pos, found = match.end(), True
        while pos < len(stripped) and stripped[pos] in " ,":
            pos += 1
    return total if found else None


def format_duration(seconds: float) -> str:
    """``5400 -> '1h30m'``, ``90 -> '1m30s'``, ``2.5 -> '2.5s'``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    total = int(round(seconds))
    d, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{u}" for n, u in ((d, "d"), (h, "h"), (m, "m"), (s, "s")) if n) or "0s"


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: Any, name: str) -> int | None:
    """A count of tokens or samples: an int, or a string like ``"2.5M"``, ``"500k"``, ``"10B"``
    or ``"1e9"`` (k = 10^3, M = 10^6, B/G = 10^9, T = 10^12). ``None`` stays ``None``."""
    allowed = "a positive integer or a string like '500k', '2.5M' or '10B'"
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if isinstance(value, (int, float)):
        count = value
    elif isinstance(value, str):
        match = _COUNT.match(value)
        if match is None or match.group(2).lower() not in _COUNT_UNITS:
            raise ValueError(f"`{name}` is not a count: {value!r}. Use {allowed}.")
        count = float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()]
    else:
        raise TypeError(f"`{name}` must be {allowed}; got {_given(value)}.")
    if not math.isfinite(count) or count < 1:
        raise ValueError(f"`{name}` must be >= 1; got {value!r}.")
    return int(count)


# -- divergence --------------------------------------------------------------------------------
def is_spike(value: float, baseline: float | None, factor: float) -> bool:
    """True when ``value`` is above ``factor`` times the baseline: ``value > baseline +
    (factor - 1) * |baseline|`` (the same as ``value > factor * baseline`` for a positive
    baseline, and meaningful for a negative one). No baseline: never a spike."""
    if baseline is None or not math.isfinite(value):
        return False
    return value > baseline + (factor - 1.0) * abs(baseline)


def divergence_reason(
    value: float, baseline: float | None, factor: float | None, name: str = "loss"
) -> str | None:
    """Why ``value`` trips the guard (``"non-finite loss (nan)"``, ``"loss spike: 9.1 > 3 x
    baseline 2.3"``), or ``None``. ``factor=None`` checks finiteness only."""
    if not math.isfinite(value):
        return f"non-finite {name} ({value})"
    if factor is not None and is_spike(value, baseline, factor):
        return f"{name} spike: {value:.4g} > {factor:g} x baseline {baseline:.4g}"
    return None


@dataclass
class DivergenceDetector:
    """Smoothed baselines of the loss (and optionally the gradient norm) over good steps only.

    ``check(loss, grad_norm)`` returns why a step trips the guard or ``None``; spikes count only
    after ``warmup`` accepted steps. ``accept(loss, grad_norm)`` adds a good step to the
    baselines. ``state()`` / ``load(state)`` checkpoint the mutable fields.
    """

    factor: float | None = 2.0
    half_life: float = 20.0
    warmup: int = 10
    baseline: float | None = None
    grad_baseline: float | None = None
    accepted: int = 0

    _STATE = ("baseline", "grad_baseline", "accepted")

    def check(self, loss: float, grad_norm: float | None = None) -> str | None:
        factor = self.factor if self.accepted >= self.warmup else None
        reason = divergence_reason(loss, self.baseline, factor, "loss")
        if reason is None and grad_norm is not None:
            reason = divergence_reason(grad_norm, self.grad_baseline, factor, "gradient norm")
        return reason

    def accept(self, loss: float, grad_norm: float | None = None) -> None:
        self.baseline = ema_update(self.baseline, loss, self.half_life)
        if grad_norm is not None:
            self.grad_baseline = ema_update(self.grad_baseline, grad_norm, self.half_life)
        self.accepted += 1

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in self._STATE}

    def load(self, state: Mapping[str, Any]) -> None:
        for key in self._STATE:
            if key in state:
                setattr(self, key, state[key])


# -- skipping and rolling back an update -------------------------------------------------------
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


def budget_reason(
    elapsed_s: float,
    tokens: int,
    samples: int,
    *,
    max_time_s: float | None = None,
    max_tokens: int | None = None,
    max_samples: int | None = None,
) -> str | None:
    """Which budget is spent (``"time budget 1h30m spent"``), or ``None``."""
    if max_time_s is not None and elapsed_s >= max_time_s:
        return f"time budget {format_duration(max_time_s)} spent"
    if max_tokens is not None and tokens >= max_tokens:
        return f"token budget {max_tokens:,} spent ({tokens:,} tokens)"
    if max_samples is not None and samples >= max_samples:
        return f"sample budget {max_samples:,} spent ({samples:,} samples)"
    return None


def steps_saved(stopped_step: int, total_steps: float | None) -> tuple[int, float] | None:
    """``(steps saved, fraction saved)`` of a run stopped at ``stopped_step`` out of
    ``total_steps`` (``None`` or infinite: unknown, ``None``)."""
    if total_steps is None or not math.isfinite(total_steps) or total_steps <= 0:
        return None
    saved = max(0, int(total_steps) - stopped_step)
    return saved, saved / total_steps


def stop_summary(
    monitor: str,
    tracker: PlateauTracker,
    *,
    stopped_step: int | None = None,
    reason: str | None = None,
    total_steps: float | None = None,
    restored_from: str = "",
    seconds_per_step: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """The report row of an early stopper: ``("stopped at step 140 of 300 (-53%): val_loss: no
    improvement in 3 checks (patience 3); best val_loss 2.31 at step 120 (restored from host
    copy)", figures)``."""
    figures: dict[str, Any] = {"checks": tracker.checks}
    best = f"no finite {monitor}"
    if tracker.best is not None:
        figures.update(best_value=tracker.best, best_step=tracker.best_step)
        best = f"best {monitor} {tracker.best:.4g} at step {tracker.best_step}"
        best += f" (restored from {restored_from})" if restored_from else ""
    if stopped_step is None:
        return f"did not stop ({tracker.checks} checks); {best}", figures
    change = f"stopped at step {stopped_step}"
    figures["stopped_step"] = stopped_step
    saved = steps_saved(stopped_step, total_steps)
    if saved is not None:
        change += f" of {int(total_steps)} (-{100 * saved[1]:.0f}%)"
        figures["steps_saved"] = saved[0]
        if seconds_per_step is not None:
            figures["est_time_saved_s"] = seconds_per_step * saved[0]
    return f"{change}: {reason}; {best}", figures


def matching_checkpoint(callbacks: Iterable[Any], monitor: str, mode: str) -> Any:
    """The first ``ModelCheckpoint``-like callback that keeps a best file of ``monitor`` in
    ``mode`` (``save_top_k != 0``), or ``None``."""
    for cb in callbacks:
        same = getattr(cb, "monitor", None) == monitor and getattr(cb, "mode", None) == mode
        if same and getattr(cb, "save_top_k", 0) != 0:
            return cb
    return None


def missing_metric_message(
    monitor: str, logged: Iterable[str], step: int, every_n_steps: int | None = None
) -> str:
    """What to say when the monitored metric is not among the logged ones."""
    names = ", ".join(sorted(logged)) or "none yet"
    message = (
        f"`monitor={monitor!r}` is not among the logged metrics at step {step} (logged: "
        f"{names}). Log it with `self.log({monitor!r}, ...)` or set `monitor` to one of the "
        "logged metrics"
    )
    if every_n_steps is not None:
        message += "; with `check_every_n_steps`, monitor a metric logged in training_step"
    return message


def check_half_life(value: Any, unit: str, name: str = "half_life") -> float | None:
    """A half-life: ``None`` or a finite number > 0 (of ``unit``)."""
    value = check_float(name, value, allow_none=True)
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"`{name}` must be a number of {unit} > 0; got {value!r}.")
    return value
