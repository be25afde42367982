"""AutoEfficient's decision, as pure functions: no trainer, no Lightning.

Given the planner's ladder (:func:`~lightning_efficient.techniques._ladder.default_ladder`), a
way to estimate one rung at one micro-batch, and the effective batch of one rank, find for each
usable rung the largest micro-batch that fits the budget among the exact divisors of that batch
(so micro-batch x accumulation is the effective batch, exactly), rank the options by the goal,
and confirm the best with real trial steps, stepping down a size and then a stack on
out-of-memory.

- ``goal="speed"``: the largest micro-batch wins (fewer, larger steps keep a GPU busy); among
  stacks that reach the same micro-batch the cheapest (the earliest rung) wins. The walk stops
  at the first rung that can reach the whole effective batch.
- ``goal="memory"``: the cheapest rung that fits at all (the planner's rule), at the largest
  micro-batch it fits: the fewest techniques, with accumulation making up the batch.

How few estimates (an estimate at a large micro-batch costs more: a chunked loss or
checkpointed blocks run more fake operations). ``goal="speed"`` with an effective batch of at
most ``PROBE``: each stack at the whole batch, cheapest first; the first that fits is the
answer. Otherwise each stack is estimated at the smallest divisor and at the largest up to
``PROBE``, and a line through the two (memory is close to linear in the micro-batch) predicts
the largest divisor that fits. Only the best predictions are estimated at their size, a size
down while the estimate does not fit and a size up while the next one fits too; a confirmed
micro-batch that no other prediction beats (or ties, cheaper) ends the search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.validate import format_bytes
from lightning_efficient.techniques._ladder import CHECKPOINT_ALL, Part, Rung

__all__ = [
    "GOALS",
    "Decision",
    "Option",
    "CHECKPOINT_OPTIMIZERS",
    "DecisionStateError",
    "decide",
    "decision_from_state",
    "divisors",
    "measured_as",
    "rung_from_state",
]

GOALS = ("speed", "memory")
#: The largest size estimated for a rung's line (larger ones only to confirm a prediction).
PROBE = 64

#: measure(rung, micro) -> (fits, bytes, estimate): the estimate of one rung at one micro-batch
Measure = Callable[[Rung, int], tuple[bool, float, Any]]
#: trial(rung, micro) -> TrialResult-like (``ok``, ``reserved_bytes``) or None (cannot be tried)
Trial = Callable[[Rung, int], Any]


def divisors(n: int, cap: int | None = None) -> list[int]:
    """The exact divisors of ``n`` (ascending), at most ``cap``."""
    found = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}
    return sorted(d for d in found if cap is None or d <= cap)


def measured_as(rung: Rung) -> Rung:
    """The rung whose estimate gives ``rung``'s largest micro-batch: checkpointing "the fewest
    blocks within the budget" fits exactly where checkpointing every block fits (it picks the
    fewest blocks at the size it is given), so it is estimated with every block checkpointed,
    and it wins the tie as the cheaper rung."""
    parts = tuple(
        CHECKPOINT_ALL
        if p.class_path == "ActivationCheckpointing" and "budget" in p.init_args
        else p
        for p in rung.callbacks
    )
    if parts == rung.callbacks:
        return rung
    return Rung(rung.name, rung.precision, parts, rung.strategy, rung.cost, rung.sharding)


@dataclass
class Option:
    """A usable rung and the largest exact-divisor micro-batch it fits, with its estimate."""

    rung: Rung
    micro: int
    bytes: float
    estimate: Any = None


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
        if self.trial_bytes is not None:
            out["trial_peak_bytes"] = int(self.trial_bytes)
        return out

    def summary(self) -> str:
        """One line: the choice, the estimate, the trial's peak against the budget, the time."""
        parts = [self.describe()]
        if self.estimate_bytes is not None and math.isfinite(self.estimate_bytes):
            parts.append(f"estimate {format_bytes(int(self.estimate_bytes))}")
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

    def trainer_config(self) -> dict[str, Any]:
        """The ``trainer:`` settings that reproduce the choice without AutoEfficient."""
        callbacks = [p.spec() for p in self.rung.callbacks]
        trainer: dict[str, Any] = {
            "precision": self.rung.precision,
            "accumulate_grad_batches": self.accumulation,
        }
        if callbacks:
            trainer["callbacks"] = callbacks
        if self.rung.strategy is not None:
            trainer["strategy"] = self.rung.strategy.spec()
        return trainer

    def to_yaml(self, batch_key: str | None = "data", batch_arg_name: str = "batch_size") -> str:
        """LightningCLI yaml that reproduces the decision without AutoEfficient: the trainer's
        precision, accumulation, callbacks (and strategy), and the micro-batch where the batch
        size lives (``batch_key``: ``"data"`` or ``"model"``; None: not written)."""
        import yaml

        config: dict[str, Any] = {"trainer": self.trainer_config()}
        if batch_key is not None:
            config[batch_key] = {"init_args": {batch_arg_name: self.micro}}
        return yaml.safe_dump(config, sort_keys=False)

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (:func:`rung_from_state` reads the rung back)."""
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
            "trial_bytes": self.trial_bytes,
            "seconds": self.seconds,
            "target": self.target,
        }


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
    from lightning_efficient.techniques._ladder import technique_class

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
    from lightning_efficient.measure.estimate import PRECISIONS

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


def decision_from_state(saved: Any, world_size: int, goal: str = "speed") -> Decision:
    """The decision a checkpoint holds (:meth:`Decision.state`), for ``world_size`` ranks: the
    same effective batch (on another world size, the largest micro-batch not above the saved one
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
    for key in ("estimate_bytes", "trial_bytes", "seconds", "budget_bytes"):
        value = saved.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
        ):
            raise _bad(f"`{key}` must be a number >= 0; got {value!r}")
        figures[key] = value
    saved_goal = saved.get("goal", goal)
    if saved_goal not in GOALS:
        raise _bad(f"`goal` must be one of {', '.join(GOALS)}; got {saved_goal!r}")
    return Decision(
        rung_from_state(saved),
        micro,
        per_rank // micro,
        world_size,
        saved_goal,
        int(figures["budget_bytes"] or 0),
        _text(saved.get("target", ""), "target"),
        estimate_bytes=figures["estimate_bytes"],
        trial_bytes=None if figures["trial_bytes"] is None else int(figures["trial_bytes"]),
        seconds=float(figures["seconds"] or 0.0),
        restored=True,
    )


def _weights_alone(estimates: Any, budget_bytes: int) -> str:
    """ " (the weights alone need X ...)" when every estimate's weights exceed the budget."""
    weights = [
        est.by_category.get("parameters", 0)
        for _, _, est in estimates
        if isinstance(getattr(est, "by_category", None), dict)
    ]
    if not weights or min(weights) < budget_bytes:
        return ""
    return (
        f" (the model's weights alone need {format_bytes(int(min(weights)))}, more than the "
        "budget: no stack of one device shrinks them; more devices with `lightning-efficient "
        "plan`, or a larger budget)"
    )


def decide(
    rungs: Sequence[Rung],
    measure: Measure,
    budget_bytes: int,
    effective: int,
    *,
    goal: str = "speed",
    world_size: int = 1,
    unusable: Callable[[Rung], str] | None = None,
    trial: Trial | None = None,
    target: str = "",
) -> Decision:
    """The stack and micro-batch to train with (see the module's docstring for the rule).

    ``effective``: one rank's effective batch (micro-batch x accumulation); the micro-batch is
    one of its exact divisors. ``unusable(rung)``: why a rung cannot be applied here ("" when it
    can), recorded in ``tried``. ``trial(rung, micro)``: real steps confirming an option (None:
    none); on out-of-memory the next size down is tried, then the next option. Raises
    ``ValueError`` when no usable rung fits even a micro-batch of 1 (or none ran).
    """
    start = time.perf_counter()
    sizes = divisors(effective)
    tried: list[tuple[str, str]] = []
    options: list[Option] = []
    cache: dict[str, tuple[bool, float, Any]] = {}
    count = 0

    def estimate(rung: Rung, n: int) -> tuple[bool, float, Any]:
        nonlocal count
        stand_in = measured_as(rung)
        key = repr((stand_in.precision, stand_in.callbacks, stand_in.strategy, n))
        if key not in cache:
            count += 1
            cache[key] = measure(stand_in, n)
        return cache[key]

    # the second point of each rung's line: the largest divisor up to PROBE (an estimate at a
    # much larger size costs more: a chunked loss or checkpointed blocks run more fake operations)
    probe = max(n for n in sizes if n <= max(PROBE, sizes[min(1, len(sizes) - 1)]))

    def predicted(rung: Rung) -> int:
        """The largest divisor that a line through the estimates at the smallest size and at
        ``probe`` (memory is close to linear in the micro-batch) keeps within the budget; 0:
        the smallest does not fit."""
        ok, low, _ = estimate(rung, sizes[0])
        if not ok or probe == sizes[0]:
            return sizes[0] if ok else 0
        high_n = probe
        ok, high, _ = estimate(rung, high_n)
        if ok and high_n == sizes[-1]:
            return high_n
        if not math.isfinite(high):  # the estimate could not run there: a line through 2 sizes
            high_n = sizes[1]
            high = estimate(rung, high_n)[1]
        slope = (high - low) / (high_n - sizes[0]) if math.isfinite(high) else math.inf
        slope = max(slope, 1e-9)
        return max(
            n for n in sizes if n == sizes[0] or low + slope * (n - sizes[0]) <= budget_bytes
        )

    def confirmed(rung: Rung, guess: int) -> Option | None:
        """The estimate at the predicted size: down a size while it does not fit; up a size
        while the next one fits too."""
        i = sizes.index(guess)
        while i >= 0 and not estimate(rung, sizes[i])[0]:
            i -= 1
        if i < 0:
            return None
        while i + 1 < len(sizes) and sizes[i] == guess and estimate(rung, sizes[i + 1])[0]:
            i, guess = i + 1, sizes[i + 1]
        _, used, est = estimate(rung, sizes[i])
        return Option(rung, sizes[i], used, est)

    def evaluate(excluded: set[str]) -> list[Option]:
        order = {id(r): i for i, r in enumerate(rungs)}
        usable = []
        for rung in rungs:
            why = (unusable(rung) if unusable is not None else "") or (
                "ran out of memory in real steps" if rung.name in excluded else ""
            )
            if why:
                tried.append((rung.name, why))
            else:
                usable.append(rung)
        if goal == "speed" and probe == sizes[-1]:
            # the cheapest stack that holds the whole effective batch, if one does: nothing does
            # better (one estimate per stack, at that size)
            for rung in usable:
                ok, used, est = estimate(rung, sizes[-1])
                fit = "fits" if ok else "does not fit"
                size = format_bytes(int(used)) if math.isfinite(used) else "not estimated"
                tried.append((rung.name, f"{fit} micro-batch {sizes[-1]} ({size})"))
                if ok:
                    return [Option(rung, sizes[-1], used, est)]
        guesses: list[tuple[Rung, int]] = []
        for rung in usable:
            guess = predicted(rung)
            if guess == 0:
                tried.append((rung.name, "does not fit at micro-batch 1"))
                continue
            guesses.append((rung, guess))
            tried.append((rung.name, f"about micro-batch {guess} (line through 2 estimates)"))
            if goal == "memory" or guess == sizes[-1]:
                break
        # confirm the best guesses with an estimate at their size, until no guess left can beat
        # the best confirmed micro-batch
        pending = sorted(guesses, key=lambda g: -g[1]) if goal == "speed" else guesses
        found: list[Option] = []
        while pending:
            rung, guess = pending.pop(0)
            option = confirmed(rung, guess)
            if option is not None:
                found.append(option)
                tried.append(
                    (
                        rung.name,
                        f"fits micro-batch {option.micro} ({format_bytes(int(option.bytes))})",
                    )
                )
            if not found or not pending:
                continue
            best = min(found, key=lambda o: (-o.micro, order[id(o.rung)]))
            rival = pending[0]  # the next guess: can it beat (or tie, cheaper) the best found?
            if goal == "memory" or (-best.micro, order[id(best.rung)]) <= (
                -rival[1],
                order[id(rival[0])],
            ):
                break
        return sorted(found, key=lambda o: (-o.micro, order[id(o.rung)]))

    notes: list[str] = []
    excluded: set[str] = set()
    while True:
        tried.clear()
        options = evaluate(excluded)
        if not options:
            raise ValueError(
                f"no usable stack fits {format_bytes(budget_bytes)} even at micro-batch 1"
                + (" in real steps" if excluded else "")
                + _weights_alone(cache.values(), budget_bytes)
                + ": "
                + "; ".join(f"{name}: {why}" for name, why in tried)
            )
        ranked = options
        for option in ranked:
            steps_down = [n for n in sizes if n <= option.micro][-2:][::-1]
            for micro in steps_down:
                result = trial(option.rung, micro) if trial is not None else None
                if result is not None and not result.ok:
                    last = micro == steps_down[-1]
                    notes.append(
                        f"{option.rung.name} at micro-batch {micro}: a real step ran out of "
                        f"memory ({format_bytes(int(result.reserved_bytes))} reserved); "
                        + ("next stack" if last else "one size down")
                    )
                    continue
                used = option.bytes if micro == option.micro else estimate(option.rung, micro)[1]
                return Decision(
                    option.rung,
                    micro,
                    effective // micro,
                    world_size,
                    goal,
                    budget_bytes,
                    target,
                    estimate_bytes=used,
                    trial_bytes=int(result.reserved_bytes) if result is not None else None,
                    trial_ok=None if result is None else True,
                    seconds=time.perf_counter() - start,
                    estimates=count,
                    tried=list(tried),
                    notes=notes,
                )
            excluded.add(option.rung.name)
