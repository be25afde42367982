"""AutoEfficient's decision, as pure functions: no trainer, no Lightning.

Given the planner's ladder (:func:`~lightning_efficient.planning.ladder.default_ladder`), a
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

Never a rung that saves nothing: a rung whose estimate is not lower than that of an earlier rung
it extends (:func:`~lightning_efficient.planning.ladder.extended_by`: the same precision, all of
its techniques and more) at every size estimated for both is passed over, and ``tried`` says so
(8-bit states on tensors that stay 32-bit, ZeRO offload of a tiny optimizer state), also where
the rung it extends ran out of memory in real steps (it would too).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.validate import format_bytes, parse_bytes
from lightning_efficient.measure.memory.estimate import MemoryEstimate, estimate_memory
from lightning_efficient.measure.memory.kv_cache import apply_training_without_cache
from lightning_efficient.measure.memory.settings import strategy_sharding
from lightning_efficient.measure.speed.host import available_bytes
from lightning_efficient.measure.trials.trial import trial_within
from lightning_efficient.planning.decision import GOALS, Decision, divisors
from lightning_efficient.planning.ladder import Rung, extended_by

__all__ = [
    "GOALS",
    "Decision",
    "Option",
    "decide",
    "divisors",
    "estimate_rung",
    "host_shortfall",
    "measured_as",
    "resolve_host_budget",
    "rung_sharding",
    "try_rung",
]

#: The largest size estimated for a rung's line (larger ones only to confirm a prediction).
PROBE = 64

#: measure(rung, micro) -> (fits, bytes, estimate): the estimate of one rung at one micro-batch
Measure = Callable[[Rung, int], tuple[bool, float, Any]]
#: trial(rung, micro) -> TrialResult-like (``ok``, ``reserved_bytes``) or None (cannot be tried)
Trial = Callable[[Rung, int], Any]


def rung_sharding(rung: Rung, strategy: Any, configured: str | None, world_size: int) -> str | None:
    """The sharding a rung is estimated with: its strategy's, else the rung's, else the
    configured one (``"ddp"`` on several ranks); ``None`` on one rank."""
    if world_size == 1:
        return None
    own = strategy_sharding(strategy) if strategy is not None else None
    return own or rung.sharding or configured or "ddp"


def estimate_rung(
    model: Any,
    batch: Any,
    rung: Rung,
    *,
    existing: Sequence[Any] = (),
    without_cache: bool = False,
    **settings: Any,
) -> MemoryEstimate:
    """Estimate a rung: ``estimate_memory`` of ``model`` on ``batch`` with the rung's precision
    and techniques (built fresh) on top of ``existing`` (the fit's own); ``settings``: the
    estimate's other keywords (on several ranks, the sharding is :func:`rung_sharding`'s).
    ``without_cache``: trained without a Hugging Face key/value cache, as AutoEfficient runs the
    rung (:func:`~lightning_efficient.planning.ladder.trains_without_cache`); otherwise the
    rung's own techniques decide, and a cache still built is named in the estimate's notes."""
    callbacks, strategy = rung.build()
    kwargs = {**settings, "precision": rung.precision}
    world_size = kwargs.get("world_size", 1)
    if world_size > 1:
        kwargs["sharding"] = rung_sharding(rung, strategy, kwargs.get("sharding"), world_size)
    techniques = [*existing, *callbacks, *([strategy] if strategy is not None else [])]
    with _cache_off(model, without_cache):
        return estimate_memory(model, batch, callbacks=techniques, **kwargs)


@contextlib.contextmanager
def _cache_off(model: Any, off: bool) -> Iterator[None]:
    """While it runs, ``model``'s Hugging Face models train without their key/value cache (when
    ``off``); undone after."""
    change = apply_training_without_cache(model) if off and isinstance(model, nn.Module) else None
    try:
        yield
    finally:
        if change is not None:
            change.undo()


def try_rung(
    module: Any,
    batch: Any,
    rung: Rung,
    budget_bytes: int | None,
    *,
    device: Any,
    optimizer: Any,
    existing: Sequence[Any] = (),
    accumulate_grad_batches: int = 1,
    without_cache: bool = False,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Try a rung: real training steps of ``module`` on ``device`` (a name, ``torch.device`` or
    ``DeviceTarget``) with the rung's techniques on top of ``existing``, within the budget
    (``measure.trials.trial.trial_within``: on CUDA under the allocator's cap). ``None`` for a rung
    with a strategy (it runs only inside a fit). ``without_cache``: as :func:`estimate_rung`;
    ``loss_fn``: the estimate's (``None``: the module's ``training_step``)."""
    callbacks, strategy = rung.build()
    if strategy is not None:
        return None
    if not isinstance(device, torch.device):
        kind = getattr(device, "kind", None) or str(device)
        device = torch.device("cuda" if kind.startswith("cuda") else "cpu")
    with _cache_off(module, without_cache):
        return trial_within(
            module,
            batch,
            budget_bytes,
            callbacks=[*existing, *callbacks],
            optimizer=optimizer,
            precision=rung.precision,
            device=device,
            accumulate_grad_batches=accumulate_grad_batches,
            loss_fn=loss_fn,
        )


def measured_as(rung: Rung) -> Rung:
    """The rung whose estimate gives ``rung``'s largest micro-batch: each part as it says it is
    estimated (``Part.estimated_as``: checkpointing "the fewest blocks within the budget" as
    every block, and it wins the tie as the cheaper rung)."""
    parts = tuple(p.estimated_as or p for p in rung.callbacks)
    if parts == rung.callbacks:
        return rung
    return Rung(rung.name, rung.precision, parts, rung.strategy, rung.cost, rung.sharding)


def resolve_host_budget(value: int | str | None, name: str = "host_budget") -> int | None:
    """The host-memory budget in bytes: ``value`` (bytes or ``"64GiB"``); ``None``: what this
    machine has available (``MemAvailable``), or no limit where that cannot be read."""
    return parse_bytes(name, value) if value is not None else available_bytes()


def host_shortfall(estimate: Any, budget_bytes: int | None) -> str:
    """Why ``estimate`` does not fit the host budget ("" when it does, or without a budget): its
    host bytes (the pinned memory of offloading techniques, rounded as the pinned allocator
    holds it on a CUDA target) exceed ``budget_bytes``."""
    host = getattr(estimate, "host_bytes", 0) or 0
    if budget_bytes is None or host <= budget_bytes:
        return ""
    return f"needs {format_bytes(int(host))} of host memory, {format_bytes(budget_bytes)} available"


@dataclass
class Option:
    """A usable rung and the largest exact-divisor micro-batch it fits, with its estimate."""

    rung: Rung
    micro: int
    bytes: float
    estimate: Any = None


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


def _cannot(estimate: Any) -> str:
    """The verdict on a rung whose estimate raised (its error stands for the estimate), else ""
    (a ``ValueError``: what the rung adds cannot serve this budget, read as "does not fit")."""
    if not isinstance(estimate, BaseException) or isinstance(estimate, ValueError):
        return ""
    lines = str(estimate).strip().splitlines()
    return f"cannot estimate: {lines[0] if lines else type(estimate).__name__}"


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
    estimated_as: Callable[[Rung], Rung] = measured_as,
    host_budget_bytes: int | None = None,
) -> Decision:
    """The stack and micro-batch to train with (see the module's docstring for the rule).

    ``effective``: one rank's effective batch (micro-batch x accumulation); the micro-batch is
    one of its exact divisors. ``unusable(rung)``: why a rung cannot be applied here ("" when it
    can), recorded in ``tried``. ``trial(rung, micro)``: real steps confirming an option (None:
    none); on out-of-memory the next size down is tried, then the next option.
    ``estimated_as(rung)``: the rung whose estimate stands for ``rung``'s (:func:`measured_as`;
    at one size, ``plan_stack`` estimates each rung as itself). ``host_budget_bytes``: host
    memory for the offloading techniques (:func:`host_shortfall`: an estimate whose host bytes
    exceed it does not fit, and ``tried`` says why; ``None``: no limit). Raises
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
        stand_in = estimated_as(rung)
        key = repr((stand_in.precision, stand_in.callbacks, stand_in.strategy, n))
        if key not in cache:
            count += 1
            fits, used, est = measure(stand_in, n)
            cache[key] = (fits and not host_shortfall(est, host_budget_bytes), used, est)
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

    def known(rung: Rung, n: int) -> float | None:
        """The bytes of ``rung`` at ``n`` if estimated already (finite), else ``None``."""
        stand_in = estimated_as(rung)
        hit = cache.get(repr((stand_in.precision, stand_in.callbacks, stand_in.strategy, n)))
        return hit[1] if hit is not None and math.isfinite(hit[1]) else None

    def saves_nothing(rung: Rung, applicable: list[Rung], at: list[int]) -> str:
        """Why ``rung`` is passed over ("" when it is not): an earlier rung that can be applied
        here and that it extends (:func:`~lightning_efficient.planning.ladder.extended_by`)
        needs no more at every size of ``at``: what the rung adds saves nothing."""
        for base in extended_by(rung, applicable[: applicable.index(rung)]):
            pairs = [(known(rung, n), known(base, n)) for n in at]
            if pairs and all(r is not None and b is not None and r >= b for r, b in pairs):
                n, (r, b) = at[-1], pairs[-1]
                return (
                    f"saves nothing over {base.name} ({format_bytes(int(r))} vs "
                    f"{format_bytes(int(b))} at micro-batch {n}): passed over"
                )
        return ""

    def evaluate(excluded: set[str]) -> list[Option]:
        order = {id(r): i for i, r in enumerate(rungs)}
        usable: list[Rung] = []
        applicable: list[Rung] = []  # usable, or out of memory in real steps
        for rung in rungs:
            reason = unusable(rung) if unusable is not None else ""
            why = reason or ("ran out of memory in real steps" if rung.name in excluded else "")
            if not reason:
                applicable.append(rung)
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
                nothing = (
                    _cannot(est)
                    or host_shortfall(est, host_budget_bytes)
                    or saves_nothing(rung, applicable, [sizes[-1]])
                )
                tried.append((rung.name, nothing or f"{fit} micro-batch {sizes[-1]} ({size})"))
                if ok and not nothing:
                    return [Option(rung, sizes[-1], used, est)]
        guesses: list[tuple[Rung, int]] = []
        for rung in usable:
            guess = predicted(rung)
            if guess == 0:
                est = estimate(rung, sizes[0])[2]
                why = (
                    _cannot(est)
                    or host_shortfall(est, host_budget_bytes)
                    or "does not fit at micro-batch 1"
                )
                tried.append((rung.name, why))
                continue
            nothing = saves_nothing(rung, applicable, sorted({sizes[0], probe}))
            if nothing:
                tried.append((rung.name, nothing))
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
                used, est = option.bytes, option.estimate
                if micro != option.micro:
                    _, used, est = estimate(option.rung, micro)
                return Decision(
                    option.rung,
                    micro,
                    effective // micro,
                    world_size,
                    goal,
                    budget_bytes,
                    target,
                    estimate_bytes=used,
                    host_bytes=int(getattr(est, "host_bytes", 0) or 0),
                    trial_bytes=int(result.reserved_bytes) if result is not None else None,
                    trial_ok=None if result is None else True,
                    seconds=time.perf_counter() - start,
                    estimates=count,
                    tried=list(tried),
                    notes=notes,
                )
            excluded.add(option.rung.name)
