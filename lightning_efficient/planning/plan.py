"""Pick the cheapest stack of techniques whose estimated peak fits a memory budget.

The planner walks a ladder of stacks ordered by what they cost in speed (precision first, then
the chunked loss where the logits are wide, 8-bit optimizer states, the fewest checkpointed
blocks, then all blocks, 4-bit frozen weights where frozen weights dominate, then ZeRO offload to
host memory) and estimates each one with the instrument (``estimate_memory`` on fake tensors:
no GPU, no allocation). The first stack that fits is the plan; the table shows every rung tried
(a rung that needs no less than a rung it extends: "saves nothing over ...").

On several ranks (``world_size > 1``) every rung is one rank's peak (``batch`` is one rank's
batch), and the ladder shards the state across the ranks (FSDP SHARD_GRAD_OP, then FULL_SHARD,
then with checkpointing) before it offloads to the host; see :func:`default_ladder`. The walk is
the one search of :mod:`lightning_efficient.planning.search` (AutoEfficient's and ``fit --auto``'s)
at one size.

The command ``lightning-efficient plan`` (:mod:`lightning_efficient.commands.plan`) prints the
table and the yaml to add to the config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.validate import (
    check_bool,
    check_choice,
    check_int,
    format_bytes,
    parse_bytes,
)
from lightning_efficient.measure.memory.estimate import PRECISIONS, EstimateError, MemoryEstimate
from lightning_efficient.measure.memory.per_rank import SHARDINGS
from lightning_efficient.measure.memory.settings import (
    configured_optimizer,
    configured_optimizer_class,
)
from lightning_efficient.measure.memory.targets import resolve_target
from lightning_efficient.planning.ladder import Rung, default_ladder, ladder_options
from lightning_efficient.planning.search import (
    decide,
    estimate_rung,
    host_shortfall,
    resolve_host_budget,
    rung_sharding,
    saves_nothing,
    try_rung,
)

__all__ = ["PlanResult", "plan_stack"]


@dataclass
class PlanResult:
    """What the planner tried and what it picked (``chosen`` is None when nothing fits)."""

    budget_bytes: int
    tried: list[tuple[Rung, MemoryEstimate | None, str]] = field(default_factory=list)
    chosen: Rung | None = None
    errors: list[EstimateError] = field(default_factory=list)
    world_size: int = 1
    #: the sharding each tried rung was estimated with (by ``id`` of the rung)
    shardings: dict[int, str | None] = field(default_factory=dict)
    #: the device the estimates model (``DeviceTarget.label``)
    target: str = ""
    #: real steps that confirmed (or refused) rungs on the device (``plan_stack(confirm=)``)
    trials: list[tuple[Rung, Any]] = field(default_factory=list)
    #: host memory the offloading rungs may use (``None``: no limit known)
    host_budget_bytes: int | None = None

    @property
    def not_estimable(self) -> EstimateError | None:
        """The estimate's own error when no rung could be estimated at all (the model, not the
        budget, is the problem)."""
        if self.tried and len(self.errors) == len(self.tried):
            return self.errors[0]
        return None

    def estimate_of(self, rung: Rung) -> MemoryEstimate | None:
        """The estimate of a tried ``rung`` (``None``: not estimated or not tried)."""
        return next((est for r, est, _ in self.tried if r is rung), None)

    @property
    def _reserved(self) -> bool:
        return any(est is not None and est.reserved_bytes for _, est, _ in self.tried)

    def fragmentation_advice(self, threshold: float = 0.05) -> str:
        """``MemoryEstimate.fragmentation_advice`` of the pick (empty without one)."""
        est = self.estimate_of(self.chosen) if self.chosen is not None else None
        return est.fragmentation_advice(threshold) if est is not None else ""

    def trial_of(self, rung: Rung) -> Any:
        """The real steps of ``rung`` on the device (a ``TrialResult``), if it was tried."""
        return next((t for r, t in self.trials if r is rung), None)

    def columns(self) -> tuple[str, ...]:
        per = " per rank" if self.world_size > 1 else ""
        cols = ["Stack", f"Device peak{per}", f"Host memory{per}", "Verdict", "Costs"]
        if self.trials:
            cols.insert(-2, "Real steps")
        if self._reserved:  # what the caching allocator reserves: what the budget must hold
            cols.insert(2, f"Reserved{per}")
        if self.world_size > 1:
            cols.insert(1, "Sharding")
        return tuple(cols)

    def rows(self) -> list[tuple[str, ...]]:
        out = []
        for rung, est, problem in self.tried:
            peak = format_bytes(est.peak_bytes) if est else "-"
            host = format_bytes(est.host_bytes) if est and est.host_bytes else "-"
            verdict = "fits" if est and not problem else (problem or "over budget")
            mark = "<- plan" if rung is self.chosen else ""
            cells = [rung.name, peak, host, f"{verdict} {mark}".strip(), rung.cost]
            if self.trials:
                trial = self.trial_of(rung)
                cells.insert(-2, trial.describe() if trial is not None else "-")
            if self._reserved:
                cells.insert(2, format_bytes(est.reserved_bytes) if est else "-")
            if self.world_size > 1:
                sharding = self.shardings.get(id(rung)) or "ddp"
                cells.insert(1, f"{sharding} x {self.world_size}")
            out.append(tuple(cells))
        return out

    def title(self) -> str:
        ranks = f", one rank of {self.world_size}" if self.world_size > 1 else ""
        on = f", on {self.target}" if self.target else ""
        return f"Plan for a budget of {format_bytes(self.budget_bytes)}{ranks}{on}{self._host()}"

    def _host(self) -> str:
        if self.host_budget_bytes is None:
            return ""
        return f"; host memory {format_bytes(self.host_budget_bytes)}"

    def to_markdown(self) -> str:
        columns = self.columns()
        align = [
            "---" if c in ("Stack", "Sharding", "Verdict", "Costs") else "---:" for c in columns
        ]
        lines = [
            f"Budget: {format_bytes(self.budget_bytes)}"
            + (f" per rank, {self.world_size} ranks" if self.world_size > 1 else "")
            + (f"; target: {self.target}" if self.target else "")
            + self._host(),
            "",
            f"| {' | '.join(columns)} |",
            f"|{'|'.join(align)}|",
        ]
        lines += [f"| {' | '.join(r)} |" for r in self.rows()]
        return "\n".join(lines)

    def table(self):  # -> rich.table.Table
        from rich.table import Table

        table = Table(title=self.title())
        for col in self.columns():
            table.add_column(col, overflow="fold")
        for row in self.rows():
            table.add_row(*row)
        return table

    def to_yaml(self, *, devices: int | None = None, num_nodes: int | None = None) -> str:
        """The ``trainer:`` section to add to a LightningCLI config for the chosen stack;
        ``devices``/``num_nodes`` (when given) are written too."""
        if self.chosen is None:
            return ""
        stack = self.chosen.stack()
        if devices is not None:
            stack.trainer["devices"] = check_int("devices", devices, minimum=1)
        if num_nodes is not None:
            stack.trainer["num_nodes"] = check_int("num_nodes", num_nodes, minimum=1)
        return stack.to_yaml()


def plan_stack(
    model: Any,
    batch: Any,
    budget: int | str,
    *,
    precision: str = "32-true",
    bf16: bool = True,
    optimizer: Any = None,
    accumulate_grad_batches: int = 1,
    configured: Sequence[Any] = (),
    ladder: Sequence[Rung] | None = None,
    try_all: bool = False,
    cuda_rounding: bool | None = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    world_size: int = 1,
    sharding: str | None = None,
    device: Any = "cuda",
    confirm: bool | Callable[[Rung], Any] = False,
    host_budget: int | str | None = None,
) -> PlanResult:
    """Estimate each rung of ``ladder`` (default: :func:`default_ladder`) and pick the first that
    fits ``budget`` (bytes or a string like ``"24GiB"``): the one search
    (:func:`~lightning_efficient.planning.search.decide`, ``goal="memory"``) at one size, the
    batch given, each rung estimated as itself. With ``try_all`` every rung is
    estimated (for the table); otherwise the walk stops at the first fit. ``model``, ``batch``,
    ``optimizer`` and ``loss_fn`` are as for :func:`estimate_memory` (``optimizer=None``: the
    model's ``configure_optimizers``); ``configured`` as for :func:`default_ladder`.

    ``world_size``: ranks of the run (``batch`` is one rank's batch; every peak and the budget
    are one rank's). ``sharding``: how the configured strategy divides the state (``None``:
    ``"ddp"`` on several ranks); a rung with a strategy is estimated with that strategy's
    sharding (its ``estimate_sharding``), a rung without one with ``sharding``. The default
    ladder offers ``ChunkedCrossEntropy`` where the model's logits are wide (``worth_chunking``).

    ``host_budget``: host memory the offloading rungs may keep (bytes or ``"64GiB"``; ``None``:
    what this machine has available). A rung whose estimated host bytes exceed it is not chosen;
    its row says "needs X of host memory, Y available".
    """
    budget_bytes = parse_bytes("budget", budget)
    host_bytes = resolve_host_budget(host_budget)
    check_choice("precision", precision, PRECISIONS)
    check_bool("bf16", bf16)
    check_int("world_size", world_size, minimum=1)
    if sharding is not None:
        check_choice("sharding", sharding, SHARDINGS)
    rungs = (
        list(ladder)
        if ladder is not None
        else default_ladder(
            precision=precision,
            bf16=bf16,
            accumulate_grad_batches=accumulate_grad_batches,
            configured=configured,
            world_size=world_size,
            configured_sharding=sharding,
            optimizer=optimizer if optimizer is not None else configured_optimizer_class(model),
            **ladder_options(model),
        )
    )
    rungs = [rung.within(budget_bytes) for rung in rungs]  # as the search builds them
    target = resolve_target(device)
    result = PlanResult(
        budget_bytes, world_size=world_size, target=target.label, host_budget_bytes=host_bytes
    )
    trial = confirm if callable(confirm) else None
    if confirm is True:
        own = optimizer if optimizer is not None else configured_optimizer(model)[0] or "adamw"

        def trial(rung: Rung) -> Any:
            return try_rung(
                model, batch, rung, budget_bytes, device=target, optimizer=own, loss_fn=loss_fn
            )

    #: each rung's estimate, what stops it ("" when it fits) and the estimate's own error
    outcomes: dict[int, tuple[MemoryEstimate | None, str, EstimateError | None]] = {}

    def outcome(rung: Rung) -> tuple[MemoryEstimate | None, str, EstimateError | None]:
        if id(rung) in outcomes:
            return outcomes[id(rung)]
        try:
            fits, _, est = estimate_rung(
                model,
                batch,
                rung,
                budget_bytes,
                accumulation=accumulate_grad_batches,
                optimizer=optimizer,
                cuda_rounding=cuda_rounding,
                device=target,
                loss_fn=loss_fn,
                **({"world_size": world_size, "sharding": sharding} if world_size > 1 else {}),
            )
        except EstimateError as err:  # a rung the fake-tensor estimate cannot run
            outcomes[id(rung)] = (None, f"not estimated: {_first_line(err)}", err)
        except ValueError as err:  # e.g. a checkpointing budget no block count reaches
            outcomes[id(rung)] = (None, f"does not fit: {_first_line(err)}", None)
        else:
            problem = "" if fits else "over budget"
            outcomes[id(rung)] = (est, problem or host_shortfall(est, host_bytes), None)
        return outcomes[id(rung)]

    def measure(rung: Rung, _micro: int) -> tuple[bool, float, Any]:
        est, problem, _ = outcome(rung)
        fits = est is not None and not problem
        return fits, float(est.required_bytes) if est is not None else math.inf, est

    def on_device(rung: Rung, _micro: int) -> Any:
        if trial is None or rung.strategy is not None:  # a strategy runs only inside a fit
            return None
        tried = trial(rung)
        result.trials.append((rung, tried))
        if not tried.ok:
            est = outcomes[id(rung)][0]
            outcomes[id(rung)] = (est, "fits by the estimate; real steps: out of memory", None)
        return tried

    # the one search at one size (the batch given): the cheapest rung that fits and runs
    try:
        chosen: Rung | None = decide(
            rungs, measure, budget_bytes, 1, goal="memory", trial=on_device, estimated_as=_itself
        ).rung
    except ValueError:  # no rung fits (each one's reason is in the table)
        chosen = None
    shown = rungs if chosen is None or try_all else rungs[: rungs.index(chosen) + 1]
    for rung in shown:
        est, problem, err = outcome(rung)
        found = None if rung is chosen or est is None else saves_nothing(
            rung, rungs[: rungs.index(rung)], lambda r, _n: _known(outcomes, r), [1]
        )  # fmt: skip
        problem = f"saves nothing over {found[0].name}" if found is not None else problem
        result.shardings[id(rung)] = rung_sharding(rung, rung.build()[1], sharding, world_size)
        result.tried.append((rung, est, problem))
        if err is not None:
            result.errors.append(err)
    result.chosen = chosen
    return result


def _known(outcomes: dict[int, Any], rung: Rung) -> tuple[float, MemoryEstimate] | None:
    """``(bytes, estimate)`` of a rung estimated at the batch given, else None."""
    est = outcomes.get(id(rung), (None,))[0]
    return (float(est.required_bytes), est) if est is not None else None


def _itself(rung: Rung) -> Rung:
    """At one size each rung is estimated as itself (its real peak for the table)."""
    return rung


def _first_line(err: BaseException, limit: int = 100) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
