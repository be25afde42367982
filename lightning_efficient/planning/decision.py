"""AutoEfficient's decision: the stack and micro-batch chosen, its figures, and its checkpoint
form (:meth:`Decision.state` / :meth:`Decision.from_state`, every value checked on the way back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.stack import Stack
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.measure.memory.estimate import PRECISIONS
from lightning_efficient.planning.ladder import Part, Rung, technique_class

#: Added to a stack whose micro-batch x accumulation (or ranks) makes up the effective batch: the
#: update stays one step on the whole batch for a token-mean loss (issue 48).
EXACT_ACCUMULATION = Part("ExactAccumulation")

__all__ = [
    "CHECKPOINT_OPTIMIZERS",
    "GOALS",
    "Decision",
    "DecisionStateError",
    "divisors",
    "rung_from_state",
]

GOALS = ("speed", "memory")


def divisors(n: int, cap: int | None = None) -> list[int]:
    """The exact divisors of ``n`` (ascending), at most ``cap``."""
    found = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}
    return sorted(d for d in found if cap is None or d <= cap)


@dataclass
class Decision:
    """What AutoEfficient chose and why: the stack, micro-batch x accumulation, the figures."""

    rung: Rung
    micro: int
    accumulation: int
    world_size: int = 1
    goal: str = "speed"
    budget_bytes: int = 0
    target: str = ""
    estimate_bytes: float | None = None
    #: the estimate's host bytes (pinned memory of offloading techniques); 0: none
    host_bytes: int = 0
    trial_bytes: int | None = None
    trial_ok: bool | None = None
    seconds: float = 0.0
    estimates: int = 0
    tried: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    restored: bool = False

    @property
    def effective(self) -> int:
        return self.micro * self.accumulation * self.world_size

    def describe(self) -> str:
        """``"bf16-mixed + chunked loss: micro-batch 8 x accumulation 4 (x 1 rank) = 32"``."""
        ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
        return (
            f"{self.rung.name}: micro-batch {self.micro} x accumulation {self.accumulation}"
            f"{ranks} = {self.effective}"
        )

    def figures(self) -> dict[str, Any]:
        """The numbers the efficiency report compares."""
        out: dict[str, Any] = {
            "micro_batch": self.micro,
            "accumulation": self.accumulation,
            "budget_bytes": self.budget_bytes,
            "decision_s": round(self.seconds, 2),
            "estimates": self.estimates,
        }
        if self.estimate_bytes is not None and math.isfinite(self.estimate_bytes):
            out["estimated_peak_bytes"] = int(self.estimate_bytes)
        if self.host_bytes:
            out["host_bytes"] = int(self.host_bytes)
        if self.trial_bytes is not None:
            out["trial_peak_bytes"] = int(self.trial_bytes)
        return out

    def summary(self) -> str:
        """One line: the choice, the estimate, the trial's peak against the budget, the time."""
        parts = [self.describe()]
        if self.estimate_bytes is not None and math.isfinite(self.estimate_bytes):
            parts.append(f"estimate {format_bytes(int(self.estimate_bytes))}")
        if self.host_bytes:
            parts.append(f"host {format_bytes(self.host_bytes)}")
        if self.trial_bytes is not None:
            parts.append(
                f"trial peak {format_bytes(self.trial_bytes)} of {format_bytes(self.budget_bytes)}"
            )
        else:
            parts.append(f"budget {format_bytes(self.budget_bytes)}")
        how = (
            "restored from the checkpoint" if self.restored else f"decided in {self.seconds:.1f} s"
        )
        parts.append(how)
        return "; ".join(parts)

    def stack(self, batch_key: str | None = None, batch_arg_name: str = "batch_size") -> Stack:
        """The config that reproduces the choice without AutoEfficient: the rung's stack with the
        accumulation, and the micro-batch where the batch size lives (``batch_key``: ``"data"``
        or ``"model"``; None: not written)."""
        stack = self.rung.stack(configured=False)
        stack.trainer["accumulate_grad_batches"] = self.accumulation
        if self.accumulation > 1 or self.world_size > 1:  # as AutoEfficient adds it
            stack.callbacks = [*stack.callbacks, EXACT_ACCUMULATION.spec()]
        if batch_key is not None:
            stack.sections[batch_key] = {"init_args": {batch_arg_name: self.micro}}
        return stack

    def trainer_config(self) -> dict[str, Any]:
        """The ``trainer:`` settings that reproduce the choice without AutoEfficient."""
        return self.stack().trainer_config()

    def to_yaml(self, batch_key: str | None = "data", batch_arg_name: str = "batch_size") -> str:
        """LightningCLI yaml that reproduces the decision without AutoEfficient: the trainer's
        precision, accumulation, callbacks (and strategy), and the micro-batch where the batch
        size lives (``batch_key``: ``"data"`` or ``"model"``; None: not written)."""
        return self.stack(batch_key, batch_arg_name).to_yaml()

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (:meth:`from_state` reads it back)."""
        return {
            "rung": self.rung.name,
            "precision": self.rung.precision,
            "callbacks": [p.spec() for p in self.rung.callbacks],
            "strategy": self.rung.strategy.spec() if self.rung.strategy is not None else None,
            "micro_batch": self.micro,
            "accumulation": self.accumulation,
            "world_size": self.world_size,
            "goal": self.goal,
            "budget_bytes": self.budget_bytes,
            "estimate_bytes": self.estimate_bytes,
            "host_bytes": self.host_bytes,
            "trial_bytes": self.trial_bytes,
            "seconds": self.seconds,
            "target": self.target,
        }

    @classmethod
    def from_state(cls, saved: Any, world_size: int, goal: str = "speed") -> Decision:
        """The decision a checkpoint holds (:meth:`state`), for ``world_size`` ranks: the same
        effective batch (on another world size, the largest micro-batch not above the saved one
        that divides one rank's share). Every value is checked first: a
        :class:`DecisionStateError` says what is wrong."""
        if not isinstance(saved, dict):
            raise _bad(f"expected a dict; got {type(saved).__name__}")
        micro = _count(saved, "micro_batch")
        effective = micro * _count(saved, "accumulation") * _count(saved, "world_size", 1)
        if effective % world_size:
            raise _bad(
                f"its effective batch {effective} is not a multiple of this run's {world_size} ranks"
            )
        per_rank = effective // world_size
        if per_rank % micro:
            micro = max(d for d in divisors(per_rank) if d <= micro)
        figures = {}
        for key in ("estimate_bytes", "trial_bytes", "seconds", "budget_bytes", "host_bytes"):
            value = saved.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
            ):
                raise _bad(f"`{key}` must be a number >= 0; got {value!r}")
            figures[key] = value
        saved_goal = saved.get("goal", goal)
        if saved_goal not in GOALS:
            raise _bad(f"`goal` must be one of {', '.join(GOALS)}; got {saved_goal!r}")
        return cls(
            rung_from_state(saved),
            micro,
            per_rank // micro,
            world_size,
            saved_goal,
            int(figures["budget_bytes"] or 0),
            _text(saved.get("target", ""), "target"),
            estimate_bytes=figures["estimate_bytes"],
            host_bytes=int(figures["host_bytes"] or 0),
            trial_bytes=None if figures["trial_bytes"] is None else int(figures["trial_bytes"]),
            seconds=float(figures["seconds"] or 0.0),
            restored=True,
        )


#: The ``OptimizerSwap`` names a checkpoint's decision may carry: the ladder's own (never a class
#: path: a name in a file is not imported).
CHECKPOINT_OPTIMIZERS = ("adamw8bit", "adam8bit")


class DecisionStateError(ValueError):
    """A checkpoint's AutoEfficient decision that cannot be used (what is wrong, and what to do)."""


def _bad(what: str) -> DecisionStateError:
    return DecisionStateError(
        f"AutoEfficient: the checkpoint's decision is not valid: {what}. Resume without "
        "AutoEfficient, or start the fit afresh (no ckpt_path) so that it decides again."
    )


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.isprintable() or len(value) > 200:
        raise _bad(f"`{key}` must be printable text; got {value!r}")
    return value


def _count(state: dict[str, Any], key: str, default: int | None = None) -> int:
    value = state.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"`{key}` must be a positive int; got {value!r}")
    return value


def _part(spec: Any) -> Part:
    """A ladder part from a checkpoint: its class on the ladder's allowlist, its arguments plain
    data, an optimizer name from the ladder's own (checked before anything is built)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise _bad(f"a technique must be {{class_path, init_args}}; got {spec!r}")
    args = spec.get("init_args") or {}
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise _bad(f"`init_args` of {spec['class_path']!r} must be a dict; got {args!r}")
    name = args.get("name")
    if spec["class_path"] == "OptimizerSwap" and name not in CHECKPOINT_OPTIMIZERS:
        raise _bad(
            f"OptimizerSwap `name` must be one of {', '.join(CHECKPOINT_OPTIMIZERS)}; got {name!r}"
        )
    try:
        technique_class(spec["class_path"])
        part = Part(spec["class_path"], dict(args))
        part.build()  # the constructor's own checks
    except (TypeError, ValueError) as err:
        raise _bad(str(err)) from None
    return part


def rung_from_state(state: dict[str, Any]) -> Rung:
    """The rung a :meth:`Decision.state` names, every value checked (:class:`DecisionStateError`)."""
    precision = state.get("precision", "32-true")
    if precision not in PRECISIONS:
        raise _bad(f"`precision` must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    callbacks = state.get("callbacks") or ()
    if not isinstance(callbacks, (list, tuple)):
        raise _bad(f"`callbacks` must be a list; got {callbacks!r}")
    strategy = state.get("strategy")
    return Rung(
        _text(state.get("rung", "restored"), "rung"),
        precision,
        tuple(_part(s) for s in callbacks),
        _part(strategy) if strategy else None,
    )
