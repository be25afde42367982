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
the largest divisor that fits. Only the best predictions are confirmed, by the one search of a
micro-batch in a budget (:func:`~lightning_efficient.measure.memory.budget.largest_within`:
the size next to the prediction, then a bracket closed by interpolation and bisection); a
confirmed micro-batch that no other prediction beats (or ties, cheaper) ends the search.

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

from lightning_efficient.core.kv_cache import apply_training_without_cache
from lightning_efficient.core.validate import format_bytes, parse_bytes
from lightning_efficient.measure.memory.budget import compared_bytes, largest_within, step_within
from lightning_efficient.measure.memory.settings import strategy_sharding
from lightning_efficient.measure.memory.types import MemoryEstimate
from lightning_efficient.measure.speed.host import available_bytes
from lightning_efficient.measure.trials.trial import trial_within
from lightning_efficient.planning.decision import GOALS, Decision, divisors
from lightning_efficient.planning.ladder import Rung, extended_by

__all__ = [
    "GOALS",
    "Decision",
    "Option",
    "Search",
    "decide",
    "divisors",
    "estimate_rung",
    "host_shortfall",
    "measured_as",
    "resolve_host_budget",
    "rung_sharding",
    "saves_nothing",
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
    budget_bytes: int,
    *,
    accumulation: int = 1,
    existing: Sequence[Any] = (),
    without_cache: bool = False,
    **settings: Any,
) -> tuple[bool, float, MemoryEstimate]:
    """A rung's step at the micro-batch of ``batch`` with ``accumulation``, against
    ``budget_bytes``: :func:`~lightning_efficient.measure.memory.budget.step_within` (``(fits,
    bytes, estimate)``) of ``model`` with the rung's precision and techniques (built fresh) on top
    of ``existing`` (the fit's own); ``settings``: the estimate's other keywords (on several
    ranks, the sharding is :func:`rung_sharding`'s). ``without_cache``: trained without a Hugging
    Face key/value cache, as AutoEfficient runs the rung
    (:func:`~lightning_efficient.planning.ladder.trains_without_cache`); otherwise the rung's own
    techniques decide, and a cache still built is named in the estimate's notes."""
    callbacks, strategy = rung.build()
    kwargs = {**settings, "precision": rung.precision}
    world_size = kwargs.get("world_size", 1)
    if world_size > 1:
        kwargs["sharding"] = rung_sharding(rung, strategy, kwargs.get("sharding"), world_size)
    techniques = [*existing, *callbacks, *([strategy] if strategy is not None else [])]
    with _cache_off(model, without_cache):
        return step_within(
            model, batch, budget_bytes, accumulation=accumulation, callbacks=techniques, **kwargs
        )


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


#: known(rung, n) -> (bytes, estimate) of ``rung`` at micro-batch ``n``, or None (not estimated)
Known = Callable[[Rung, int], "tuple[float, Any] | None"]


def saves_nothing(
    rung: Rung, earlier: Sequence[Rung], known: Known, at: Sequence[int]
) -> tuple[Rung, float, float] | None:
    """``(base, bytes of rung, bytes of base)`` at the last size of ``at`` for the first rung of
    ``earlier`` that ``rung`` extends (:func:`~lightning_efficient.planning.ladder.extended_by`)
    and that needs no more at every size of ``at``, where ``rung`` recomputes no fewer
    checkpointed blocks (reaching the budget with fewer saves time, whatever the peak); None:
    what ``rung`` adds saves memory (or it is not known). The planner's table and the search
    pass such a rung over."""
    for base in extended_by(rung, earlier):
        pairs = [(known(rung, n), known(base, n)) for n in at]
        if pairs and all(
            r is not None and b is not None and r[0] >= b[0] and not _fewer_blocks(r[1], b[1])
            for r, b in pairs
        ):
            return base, pairs[-1][0][0], pairs[-1][1][0]  # type: ignore[index]
    return None


def _fewer_blocks(estimate: Any, base: Any) -> bool:
    def blocks(est: Any) -> int:
        return getattr(est, "figures", {}).get("checkpointed_blocks", 0) if est is not None else 0

    return blocks(estimate) < blocks(base)


class Search:
    """One decision's search (the rule: the module's docstring): the rungs, the exact divisors
    of the effective batch, and every estimate made (each stand-in at each size once).
    :meth:`options` ranks the usable rungs' largest micro-batches (``tried`` says why for each
    rung); :func:`decide` confirms them with real steps. The largest micro-batch of a rung is
    :func:`~lightning_efficient.measure.memory.budget.largest_within`'s."""

    def __init__(
        self,
        rungs: Sequence[Rung],
        measure: Measure,
        budget_bytes: int,
        effective: int,
        *,
        goal: str = "speed",
        unusable: Callable[[Rung], str] | None = None,
        estimated_as: Callable[[Rung], Rung] = measured_as,
        host_budget_bytes: int | None = None,
    ) -> None:
        self.rungs, self.measure, self.budget_bytes = list(rungs), measure, budget_bytes
        self.goal, self.unusable, self.estimated_as = goal, unusable, estimated_as
        self.host_budget_bytes = host_budget_bytes
        self.sizes = divisors(effective)
        # the second point of each rung's line: the largest divisor up to PROBE (an estimate at
        # a much larger size costs more: a chunked loss or checkpointed blocks run more fake
        # operations)
        s = self.sizes
        self.probe = max(n for n in s if n <= max(PROBE, s[min(1, len(s) - 1)]))
        self.cache: dict[str, tuple[bool, float, Any]] = {}
        self.tried: list[tuple[str, str]] = []
        self.order = {id(r): i for i, r in enumerate(self.rungs)}

    def built(self, rung: Rung) -> Rung:
        """``rung`` as the search builds it: the budget handed to its parts that take one."""
        return rung.within(self.budget_bytes)

    def _key(self, rung: Rung, n: int) -> str:
        stand_in = self.estimated_as(self.built(rung))
        return repr((stand_in.precision, stand_in.callbacks, stand_in.strategy, n))

    def estimate(self, rung: Rung, n: int) -> tuple[bool, float, Any]:
        """``(fits, bytes, estimate)`` of ``rung`` at micro-batch ``n`` (its stand-in's, once;
        host bytes over the host budget do not fit)."""
        key = self._key(rung, n)
        if key not in self.cache:
            fits, used, est = self.measure(self.estimated_as(self.built(rung)), n)
            fits = fits and not host_shortfall(est, self.host_budget_bytes)
            self.cache[key] = (fits, used, est)
        return self.cache[key]

    def known(self, rung: Rung, n: int) -> tuple[float, Any] | None:
        """``(bytes, estimate)`` of ``rung`` at ``n`` if estimated already (finite), else None."""
        hit = self.cache.get(self._key(rung, n))
        return (hit[1], hit[2]) if hit is not None and math.isfinite(hit[1]) else None

    def largest(self, rung: Rung, *, guess_only: bool = False) -> int:
        """The largest divisor ``rung`` fits (0: none); ``guess_only``: the line's guess."""

        def bytes_at(n: int) -> float:
            return compared_bytes(*self.estimate(rung, n)[:2], self.budget_bytes)

        return largest_within(
            self.sizes, bytes_at, self.budget_bytes, probe=self.probe, guess_only=guess_only
        )

    def passed_over(self, rung: Rung, applicable: list[Rung], at: Sequence[int]) -> str:
        """Why ``rung`` is passed over (:func:`saves_nothing` over an earlier applicable rung),
        else ""."""
        found = saves_nothing(rung, applicable[: applicable.index(rung)], self.known, at)
        if found is None:
            return ""
        base, r, b = found
        return (
            f"saves nothing over {base.name} ({format_bytes(int(r))} vs {format_bytes(int(b))} "
            f"at micro-batch {at[-1]}): passed over"
        )

    def rank(self, option: Option) -> tuple[int, int]:
        """The larger micro-batch first; among equal ones the cheaper (earlier) rung."""
        return -option.micro, self.order[id(option.rung)]

    def options(self, excluded: set[str]) -> list[Option]:
        """The usable rungs' options, best first (``excluded``: rungs that ran out of memory in
        real steps); ``tried`` says what became of each rung."""
        self.tried.clear()
        usable: list[Rung] = []
        applicable: list[Rung] = []  # usable, or out of memory in real steps
        for rung in self.rungs:
            reason = self.unusable(rung) if self.unusable is not None else ""
            why = reason or ("ran out of memory in real steps" if rung.name in excluded else "")
            applicable += [] if reason else [rung]
            if why:
                self.tried.append((rung.name, why))
            else:
                usable.append(rung)
        if self.goal == "speed" and self.probe == self.sizes[-1]:
            whole = self._whole_batch(usable, applicable)
            if whole is not None:
                return [whole]
        return self._confirmed(self._guesses(usable, applicable))

    def _whole_batch(self, usable: list[Rung], applicable: list[Rung]) -> Option | None:
        """The cheapest rung that holds the whole effective batch, if one does: nothing does
        better (one estimate per rung, at that size)."""
        n = self.sizes[-1]
        for rung in usable:
            ok, used, est = self.estimate(rung, n)
            size = format_bytes(int(used)) if math.isfinite(used) else "not estimated"
            nothing = (
                _cannot(est)
                or host_shortfall(est, self.host_budget_bytes)
                or self.passed_over(rung, applicable, [n])
            )
            fit = "fits" if ok else "does not fit"
            self.tried.append((rung.name, nothing or f"{fit} micro-batch {n} ({size})"))
            if ok and not nothing:
                return Option(rung, n, used, est)
        return None

    def _guesses(self, usable: list[Rung], applicable: list[Rung]) -> list[tuple[Rung, int]]:
        """Each usable rung's guess (a line through 2 estimates), cheapest first, until one
        reaches the whole batch (``goal="memory"``: the first that fits at all)."""
        guesses: list[tuple[Rung, int]] = []
        for rung in usable:
            guess = self.largest(rung, guess_only=True)
            if guess == 0:
                est = self.estimate(rung, self.sizes[0])[2]
                why = _cannot(est) or host_shortfall(est, self.host_budget_bytes)
                self.tried.append((rung.name, why or "does not fit at micro-batch 1"))
                continue
            nothing = self.passed_over(rung, applicable, sorted({self.sizes[0], self.probe}))
            if nothing:
                self.tried.append((rung.name, nothing))
                continue
            guesses.append((rung, guess))
            self.tried.append((rung.name, f"about micro-batch {guess} (line through 2 estimates)"))
            if self.goal == "memory" or guess == self.sizes[-1]:
                break
        return guesses

    def _confirmed(self, guesses: list[tuple[Rung, int]]) -> list[Option]:
        """The best guesses' largest micro-batches, until no guess left can beat (or tie,
        cheaper) the best one found."""
        pending = sorted(guesses, key=lambda g: -g[1]) if self.goal == "speed" else guesses
        found: list[Option] = []
        while pending:
            rung, _ = pending.pop(0)
            micro = self.largest(rung)
            if micro:
                _, used, est = self.estimate(rung, micro)
                found.append(Option(rung, micro, used, est))
                self.tried.append(
                    (rung.name, f"fits micro-batch {micro} ({format_bytes(int(used))})")
                )
            if not found or not pending:
                continue
            rival = Option(pending[0][0], pending[0][1], 0.0)
            if self.goal == "memory" or min(map(self.rank, found)) <= self.rank(rival):
                break
        return sorted(found, key=self.rank)

    def steps_down(self, option: Option) -> list[int]:
        """The sizes real steps try for ``option``: its micro-batch, then one size down."""
        return [n for n in self.sizes if n <= option.micro][-2:][::-1]

    def nothing_fits(self, excluded: set[str]) -> ValueError:
        return ValueError(
            f"no usable stack fits {format_bytes(self.budget_bytes)} even at micro-batch 1"
            + (" in real steps" if excluded else "")
            + _weights_alone(self.cache.values(), self.budget_bytes)
            + ": "
            + "; ".join(f"{name}: {why}" for name, why in self.tried)
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
    estimated_as: Callable[[Rung], Rung] = measured_as,
    host_budget_bytes: int | None = None,
) -> Decision:
    """The stack and micro-batch to train with (see the module's docstring for the rule).

    ``effective``: one rank's effective batch (micro-batch x accumulation); the micro-batch is
    one of its exact divisors. ``unusable(rung)``: why a rung cannot be applied here ("" when it
    can), recorded in ``tried``. ``trial(rung, micro)``: real steps confirming an option (None:
    none); on out-of-memory the next size down is tried, then the next option.
    The budget is handed to the rungs' parts that take one (``Rung.within``) when the search
    builds them: for ``measure``, ``trial`` and the decision.
    ``estimated_as(rung)``: the rung whose estimate stands for ``rung``'s (:func:`measured_as`;
    at one size, ``plan_stack`` estimates each rung as itself). ``host_budget_bytes``: host
    memory for the offloading techniques (:func:`host_shortfall`: an estimate whose host bytes
    exceed it does not fit, and ``tried`` says why; ``None``: no limit). Raises
    ``ValueError`` when no usable rung fits even a micro-batch of 1 (or none ran).
    """
    start = time.perf_counter()
    search = Search(
        rungs, measure, budget_bytes, effective, goal=goal, unusable=unusable,
        estimated_as=estimated_as, host_budget_bytes=host_budget_bytes,
    )  # fmt: skip
    notes: list[str] = []
    excluded: set[str] = set()
    while True:
        options = search.options(excluded)
        if not options:
            raise search.nothing_fits(excluded)
        for option in options:
            for micro in search.steps_down(option):
                rung = search.built(option.rung)
                result = trial(rung, micro) if trial is not None else None
                if result is None or result.ok:
                    _, used, est = search.estimate(option.rung, micro)
                    return Decision(
                        rung, micro, effective // micro, world_size, goal, budget_bytes,
                        target, estimate_bytes=used,
                        host_bytes=int(getattr(est, "host_bytes", 0) or 0),
                        trial_bytes=int(result.reserved_bytes) if result is not None else None,
                        trial_ok=None if result is None else True,
                        seconds=time.perf_counter() - start, estimates=len(search.cache),
                        tried=list(search.tried), notes=notes,
                    )  # fmt: skip
                down = "next stack" if micro == search.steps_down(option)[-1] else "one size down"
                notes.append(
                    f"{option.rung.name} at micro-batch {micro}: a real step ran out of memory "
                    f"({format_bytes(int(result.reserved_bytes))} reserved); {down}"
                )
            excluded.add(option.rung.name)
