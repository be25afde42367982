"""Pick the cheapest stack of techniques whose estimated peak fits a memory budget.

The planner walks a ladder of stacks ordered by what they cost in speed (precision first, then
8-bit optimizer states, then the fewest checkpointed blocks, then all blocks, then ZeRO offload
to host memory) and estimates each one with the instrument (``estimate_memory`` on fake tensors:
no GPU, no allocation). The first stack that fits is the plan; the table shows every rung tried.

    lightning-efficient plan --config my.yaml --budget 24GiB

prints the table and the yaml to add to the config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_efficient.core.validate import check_bool, check_choice, format_bytes, parse_bytes
from lightning_efficient.measure.estimate import (
    PRECISIONS,
    EstimateError,
    MemoryEstimate,
    estimate_memory,
)
from lightning_efficient.measure.settings import estimate_settings

__all__ = ["Rung", "PlanResult", "default_ladder", "plan_stack", "plan_command"]


@dataclass
class Rung:
    """One stack to try: a precision, callbacks and an optional strategy, built fresh on demand."""

    name: str
    precision: str
    make_callbacks: Callable[[], list[Any]] = list
    make_strategy: Callable[[], Any] | None = None
    cost: str = ""

    def build(self) -> tuple[list[Any], Any]:
        return self.make_callbacks(), (self.make_strategy() if self.make_strategy else None)


@dataclass
class PlanResult:
    """What the planner tried and what it picked (``chosen`` is None when nothing fits)."""

    budget_bytes: int
    tried: list[tuple[Rung, MemoryEstimate | None, str]] = field(default_factory=list)
    chosen: Rung | None = None
    errors: list[EstimateError] = field(default_factory=list)

    @property
    def not_estimable(self) -> EstimateError | None:
        """The estimate's own error when no rung could be estimated at all (the model, not the
        budget, is the problem)."""
        if self.tried and len(self.errors) == len(self.tried):
            return self.errors[0]
        return None

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        out = []
        for rung, est, problem in self.tried:
            peak = format_bytes(est.peak_bytes) if est else "-"
            host = format_bytes(est.host_bytes) if est and est.host_bytes else "-"
            verdict = "fits" if est and not problem else (problem or "over budget")
            mark = "<- plan" if rung is self.chosen else ""
            out.append((rung.name, peak, host, f"{verdict} {mark}".strip(), rung.cost))
        return out

    def to_markdown(self) -> str:
        lines = [
            f"Budget: {format_bytes(self.budget_bytes)}",
            "",
            "| Stack | Device peak | Host memory | Verdict | Costs |",
            "|---|---:|---:|---|---|",
        ]
        lines += [f"| {' | '.join(r)} |" for r in self.rows()]
        return "\n".join(lines)

    def table(self):  # -> rich.table.Table
        from rich.table import Table

        table = Table(title=f"Plan for a budget of {format_bytes(self.budget_bytes)}")
        for col in ("Stack", "Device peak", "Host memory", "Verdict", "Costs"):
            table.add_column(col, overflow="fold")
        for row in self.rows():
            table.add_row(*row)
        return table

    def to_yaml(self) -> str:
        """The ``trainer:`` section to add to a LightningCLI config for the chosen stack."""
        if self.chosen is None:
            return ""
        import yaml

        callbacks, strategy = self.chosen.build()
        trainer: dict[str, Any] = {"precision": self.chosen.precision}
        if callbacks:
            trainer["callbacks"] = [_class_spec(cb) for cb in callbacks]
        if strategy is not None:
            trainer["strategy"] = _class_spec(strategy)
        return yaml.safe_dump({"trainer": trainer}, sort_keys=False)


def _class_spec(obj: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"class_path": type(obj).__name__}
    args = getattr(obj, "plan_init_args", None)
    if args:
        spec["init_args"] = dict(args)
    return spec


def default_ladder(
    budget_bytes: int,
    *,
    precision: str = "32-true",
    bf16: bool = True,
    accumulate_grad_batches: int = 1,
    configured: Sequence[Any] = (),
) -> list[Rung]:
    """The stacks the planner tries, cheapest first. ``configured``: the techniques (callbacks
    and strategy) the config already has; the first rung, "as configured", estimates them."""
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
    from lightning_efficient.techniques.optimizers import OptimizerSwap
    from lightning_efficient.techniques.zero_offload import ZeROOffload

    low = "bf16-mixed" if bf16 and precision == "32-true" else precision

    def swap() -> Any:
        return _with_args(OptimizerSwap("adamw8bit"), name="adamw8bit")

    def ac(budget: int | None = None) -> Any:
        return _with_args(
            ActivationCheckpointing(budget=budget), **({"budget": budget} if budget else {})
        )

    rungs = [Rung("as configured", precision, lambda: list(configured), cost="none")]
    if low != precision:
        rungs.append(Rung(low, low, cost="none on bf16 hardware; loss within ~2% of fp32"))
    rungs += [
        Rung(
            f"{low} + adamw8bit",
            low,
            lambda: [swap()],
            cost="8-bit optimizer states (lossy, small)",
        ),
        Rung(
            f"{low} + adamw8bit + checkpoint fewest blocks",
            low,
            lambda: [swap(), ac(budget_bytes)],
            cost="recompute some blocks' forward",
        ),
        Rung(
            f"{low} + adamw8bit + checkpoint all blocks",
            low,
            lambda: [swap(), ac()],
            cost="recompute every block's forward (~+30% step time)",
        ),
    ]
    if accumulate_grad_batches == 1:
        rungs.append(
            Rung(
                f"{low} + adamw8bit in backward + checkpoint all blocks",
                low,
                lambda: [
                    _with_args(
                        OptimizerSwap("adamw8bit", optimizer_in_backward=True),
                        name="adamw8bit",
                        optimizer_in_backward=True,
                    ),
                    ac(),
                ],
                cost="no gradient clipping or accumulation",
            )
        )
    rungs += [
        Rung(
            f"{low} + checkpoint all blocks + ZeRO-2 optimizer offload",
            low,
            lambda: [ac()],
            lambda: _with_args(
                ZeROOffload(stage=2, offload_optimizer="cpu"), stage=2, offload_optimizer="cpu"
            ),
            cost="optimizer step on the host (PCIe traffic every step)",
        ),
        Rung(
            f"{low} + checkpoint all blocks + ZeRO-3 parameter offload",
            low,
            lambda: [ac()],
            lambda: _with_args(
                ZeROOffload(stage=3, offload_optimizer="cpu", offload_parameters=True),
                stage=3,
                offload_optimizer="cpu",
                offload_parameters=True,
            ),
            cost="weights streamed from the host for every layer (slowest)",
        ),
    ]
    return rungs


def _with_args(obj: Any, **init_args: Any) -> Any:
    """Remember the constructor arguments, so the plan can be written back as yaml."""
    obj.plan_init_args = init_args
    return obj


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
    cuda_rounding: bool = True,
    loss_fn: Callable[[Any, Any], Any] | None = None,
) -> PlanResult:
    """Estimate each rung of ``ladder`` (default: :func:`default_ladder`) and pick the first that
    fits ``budget`` (bytes or a string like ``"24GiB"``). With ``try_all`` every rung is
    estimated (for the table); otherwise the walk stops at the first fit. ``model``, ``batch``,
    ``optimizer`` and ``loss_fn`` are as for :func:`estimate_memory` (``optimizer=None``: the
    model's ``configure_optimizers``); ``configured`` as for :func:`default_ladder`."""
    budget_bytes = parse_bytes("budget", budget)
    check_choice("precision", precision, PRECISIONS)
    check_bool("bf16", bf16)
    rungs = (
        list(ladder)
        if ladder is not None
        else default_ladder(
            budget_bytes,
            precision=precision,
            bf16=bf16,
            accumulate_grad_batches=accumulate_grad_batches,
            configured=configured,
        )
    )
    result = PlanResult(budget_bytes)
    for rung in rungs:
        callbacks, strategy = rung.build()
        techniques = [*callbacks, *([strategy] if strategy is not None else [])]
        try:
            est = estimate_memory(
                model,
                batch,
                optimizer=optimizer,
                precision=rung.precision,
                callbacks=techniques,
                accumulate_grad_batches=accumulate_grad_batches,
                cuda_rounding=cuda_rounding,
                loss_fn=loss_fn,
            )
        except EstimateError as err:  # a rung the fake-tensor estimate cannot run
            result.tried.append((rung, None, f"not estimated: {_first_line(err)}"))
            result.errors.append(err)
            continue
        except ValueError as err:  # e.g. a checkpointing budget no block count reaches
            result.tried.append((rung, None, f"does not fit: {_first_line(err)}"))
            continue
        fits = est.peak_bytes <= budget_bytes
        result.tried.append((rung, est, "" if fits else "over budget"))
        if fits and result.chosen is None:
            result.chosen = rung
            if not try_all:
                break
    return result


def _first_line(err: BaseException, limit: int = 100) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-efficient plan",
        description="Pick the cheapest stack of techniques whose estimated peak fits a memory budget.",
    )
    p.add_argument(
        "--config", required=True, action="append", help="LightningCLI yaml (repeatable)"
    )
    p.add_argument("--budget", required=True, help="device memory budget, e.g. 24GiB or 80GB")
    p.add_argument(
        "--batch-size", type=int, default=None, help="override the datamodule's batch_size"
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="default: the config's trainer.precision",
    )
    p.add_argument("--no-bf16", action="store_true", help="the target device has no bf16")
    p.add_argument(
        "--all", action="store_true", help="estimate every rung, not just up to the first fit"
    )
    return p


def plan_command(argv: Sequence[str]) -> int:
    from rich.console import Console

    from lightning_efficient.commands import config_workload, fail

    args, rest = _parser().parse_known_args(list(argv))
    try:
        budget = parse_bytes("--budget", args.budget)
    except ValueError as err:
        return fail(str(err))
    work = config_workload(args.config, rest, args.batch_size)
    if isinstance(work, int):
        return work
    model, batch, trainer, _ = work
    precision = args.precision or work[3]
    settings = estimate_settings(trainer)
    result = plan_stack(
        model,
        batch,
        budget,
        precision=precision,
        bf16=not args.no_bf16,
        try_all=args.all,
        accumulate_grad_batches=settings["accumulate_grad_batches"],
        optimizer=settings["optimizer"],
        configured=settings["callbacks"],
    )
    if result.not_estimable is not None:
        return fail(
            f"the model cannot be estimated, so no stack can be planned: {result.not_estimable}"
        )
    Console().print(result.table())
    if result.chosen is None:
        return fail(
            f"no stack fits {format_bytes(budget)}: lower the batch size or sequence length, or "
            "use more devices."
        )
    print(f"\nAdd to your config ({result.chosen.name}):\n\n{result.to_yaml()}")
    return 0
