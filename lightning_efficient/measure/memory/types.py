"""The instrument's data types: what an estimate plans and what it returns.

``MemoryEstimate`` (peak, bytes by category, phase of the peak), ``EstimatePlan`` (what the
techniques change before the steps run), the categories, precisions and phases, and the few
helpers that the estimate and the tracker share. It imports nothing of the package above ``core``
but the optimizer names and models of :mod:`lightning_efficient.measure.memory.optimizer_models`
and the key/value cache switch of :mod:`lightning_efficient.measure.memory.kv_cache`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import fsdp_sharded
from lightning_efficient.core.change import Change, ChangeLog
from lightning_efficient.core.kv_cache import apply_training_without_cache
from lightning_efficient.core.technique import ChangesEstimate, Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_int, format_bytes
from lightning_efficient.measure.memory.caching_allocator import replay
from lightning_efficient.measure.memory.optimizer_models import estimate_factory, optimizer_class

__all__ = [
    "CATEGORIES",
    "PHASES",
    "PRECISIONS",
    "AllocationLog",
    "EstimateError",
    "EstimatePlan",
    "MemoryEstimate",
    "check_common",
    "check_unsharded",
    "cuda_round",
    "resolve_optimizer",
]

#: The categories every figure of the instrument is split into (their sum is the total).
#: ``workspaces``: buffers a library holds on the device outside any tensor (cuBLAS's, on a CUDA
#: target), allocated once and kept.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "workspaces",
)
#: Precisions the estimate understands (Lightning's names).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
#: Phases of a training step.
PHASES = ("forward", "backward", "optimizer")

#: The estimate's settings for its own short names (any other name resolves with its defaults).
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    # foreach: what torch picks on CUDA (and its list-wide temporaries are part of the peak)
    "adamw": {"lr": 1e-3, "foreach": True},
    "adam": {"lr": 1e-3, "foreach": True},
    "sgd": {"lr": 1e-3, "momentum": 0.9, "foreach": True},
}


class EstimateError(RuntimeError):
    """The model could not run on fake tensors (it needs real values); the message says why."""


@dataclass
class MemoryEstimate:
    """Device memory of training steps: the peak and what was live at the peak.

    Attributes:
        peak_bytes: Device-side peak over the steps.
        by_category: Bytes live at the peak per ``CATEGORIES`` (their sum is ``peak_bytes``).
        peak_phase: ``"forward"``, ``"backward"`` or ``"optimizer"``: when the peak happened.
        phase_peaks: The peak of each phase.
        host_bytes: Peak bytes kept in host memory by offloading techniques.
        notes: What the techniques changed.
        figures: Numbers the techniques decided for these steps (``checkpointed_blocks``: the
            blocks ``ActivationCheckpointing`` recomputes), from ``EstimatePlan.figures``.
        phase_by_category: Bytes live at each phase's peak per category (empty when unknown); the
            per-rank estimate (``measure.memory.per_rank``) divides each phase as a strategy does.
        backward_levels: Moments of backward by category, one for each amount of gradients
            live (those no other moment exceeds in both gradients and the rest): sharding
            divides finished gradients, so the rank's peak can be earlier in backward.
        target: The device the figures are for (``DeviceTarget.label``; empty: measured, not
            estimated).
        reserved_bytes: On a CUDA target, the peak the caching allocator *reserves* for these
            steps (cached blocks and fragmentation included; 0 elsewhere): what the device must
            have. ``fits(budget)`` answers for a given budget.
        allocations: The device's allocations and frees in order (a CUDA target on one device),
            kept to replay them under a budget (:func:`fits`).
    """

    peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    phase_peaks: dict[str, int]
    host_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    phase_by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    backward_levels: list[dict[str, int]] = field(default_factory=list)
    target: str = ""
    reserved_bytes: int = 0
    allocations: AllocationLog | None = field(default=None, repr=False, compare=False)
    figures: dict[str, int] = field(default_factory=dict)

    @property
    def required_bytes(self) -> int:
        """What the device must have for these steps: the reserved peak where it is modelled
        (a CUDA target), else the peak."""
        return max(self.peak_bytes, self.reserved_bytes)

    def fits(self, budget_bytes: int) -> bool:
        """Whether the steps run within ``budget_bytes`` of device memory. On a CUDA target the
        allocations are replayed through the caching allocator under that cap (which frees its
        cached blocks when a new segment would pass the cap, then runs out of memory); else
        the peak (and the reserved peak, when known) is compared with the budget."""
        if self.allocations is not None:
            return not replay(self.allocations, cap=int(budget_bytes)).out_of_memory
        return self.required_bytes <= budget_bytes

    def fragmentation_advice(self, threshold: float = 0.05) -> str:
        """A line on ``expandable_segments`` when the reserve exceeds the peak by more than
        ``threshold`` (the caching allocator's fragmentation); empty otherwise."""
        if self.reserved_bytes <= self.peak_bytes * (1 + threshold):
            return ""
        waste = format_bytes(self.reserved_bytes - self.peak_bytes)
        return (
            f"The CUDA caching allocator is expected to reserve {waste} more than the peak "
            f"({format_bytes(self.reserved_bytes)} for {format_bytes(self.peak_bytes)}): "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the first CUDA "
            "allocation, is expected to cut that gap (not measured; the plan does not count on it)."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "peak_bytes": int(self.peak_bytes),
            "reserved_bytes": int(self.reserved_bytes),
            "by_category": {k: int(v) for k, v in self.by_category.items()},
            "peak_phase": self.peak_phase,
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "host_bytes": int(self.host_bytes),
            "notes": list(self.notes),
        }

    def table(self, title: str = "Memory at the peak"):  # -> rich.table.Table
        from rich.table import Table

        on = f" on {self.target}" if self.target else ""
        table = Table(title=f"{title}{on}: peak in {self.peak_phase}")
        table.add_column("Category")
        table.add_column("Bytes", justify="right")
        table.add_column("Share", justify="right")
        for cat in CATEGORIES:
            n = self.by_category.get(cat, 0)
            share = n / self.peak_bytes if self.peak_bytes else 0.0
            table.add_row(cat.replace("_", " "), format_bytes(n), f"{share:.1%}")
        table.add_row("[b]peak[/b]", f"[b]{format_bytes(self.peak_bytes)}[/b]", "100.0%")
        if self.reserved_bytes:
            table.add_row("reserved by the allocator", format_bytes(self.reserved_bytes), "")
        for phase, n in self.phase_peaks.items():
            table.add_row(f"peak in {phase}", format_bytes(n), "")
        if self.host_bytes:
            table.add_row("host (offloaded)", format_bytes(self.host_bytes), "")
        for note in self.notes:
            table.add_row(f"[dim]{note}[/dim]", "", "")
        return table

    def to_markdown(self) -> str:
        lines = ["| Category | Bytes | Share |", "|---|---:|---:|"]
        for cat in CATEGORIES:
            n = self.by_category.get(cat, 0)
            share = n / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"| {cat} | {format_bytes(n)} | {share:.1%} |")
        lines.append(
            f"| **peak ({self.peak_phase})** | **{format_bytes(self.peak_bytes)}** | 100.0% |"
        )
        if self.reserved_bytes:
            lines.append(f"| reserved by the allocator | {format_bytes(self.reserved_bytes)} | |")
        if self.host_bytes:
            lines.append(f"| host (offloaded) | {format_bytes(self.host_bytes)} | |")
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = ", ".join(f"{c} {format_bytes(self.by_category.get(c, 0))}" for c in CATEGORIES)
        host = f"; host {format_bytes(self.host_bytes)}" if self.host_bytes else ""
        on = f" on {self.target}" if self.target else ""
        return f"peak {format_bytes(self.peak_bytes)}{on} in {self.peak_phase} ({parts}){host}"


class AllocationLog:
    """A compact log of device allocations and frees, ``(key, +1 or -1, requested bytes)`` in order
    (three ints each), that :func:`~lightning_efficient.measure.memory.caching_allocator.replay`
    iterates."""

    def __init__(self, events: Iterable[tuple[Any, int, int]] = ()) -> None:
        self._data = array("q")
        keys: dict[int, int] = {}
        for key, sign, nbytes in events:
            self._data.extend((keys.setdefault(id(key), len(keys)), sign, nbytes))

    def __len__(self) -> int:
        return len(self._data) // 3

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        d = self._data
        return (tuple(d[i : i + 3]) for i in range(0, len(d), 3))


@dataclass
class EstimatePlan:
    """What the estimated steps will run; techniques change it in ``configure_estimate(plan)``.

    Attributes:
        model: The model the steps run (already the fake-tensor version; modify it in place).
        batch: The (fake) batch.
        optimizer: Factory ``optimizer(param_groups) -> Optimizer``; replace it to swap optimizers.
        precision: One of ``PRECISIONS``.
        accumulate_grad_batches: Micro-batches (forward + backward) per optimizer step.
        optimizer_in_backward: Step and free each gradient in a post-accumulate-grad hook.
        offload: Categories kept in host memory (counted as ``host_bytes``, not device bytes).
        notes: What the techniques changed (``plan.note(...)`` appends); shown with the estimate.
        figures: Numbers the techniques decided (``checkpointed_blocks``), kept in the result.
        world_size: Ranks the state is divided over, and ``sharding`` how (the result is one
            rank's peak); a technique that runs nested estimates passes both on, and
            ``cuda_rounding`` (allocations rounded as the CUDA allocator does) and ``device``
            (the ``DeviceTarget`` modelled).
    """

    model: nn.Module
    batch: Any
    optimizer: Callable[[list[dict]], torch.optim.Optimizer]
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    optimizer_in_backward: bool = False
    offload: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, int] = field(default_factory=dict)
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    world_size: int = 1
    sharding: str | None = None
    cuda_rounding: bool = False
    device: Any = None
    changes: ChangeLog = field(default_factory=ChangeLog, repr=False)

    def record(self, change: Change) -> Change:
        """Keep ``change`` (what a technique did to the plan's model or globals); undone, last
        first, after the steps (``undo()``). Returns it."""
        return self.changes.record(change)

    def configure(self, callbacks: Iterable[Any]) -> None:
        """Let each of ``callbacks`` that takes part in the estimate
        (:class:`~lightning_efficient.core.technique.ChangesEstimate`) change this plan, in order:
        the one loop the estimate, ``measure_step`` and the trials share. First, where one of
        them ``trains_without_cache``, the model's Hugging Face key/value cache is switched off
        for training (recorded once, as the fit does it)."""
        callbacks = list(callbacks)
        if any(isinstance(cb, Technique) and cb.trains_without_cache for cb in callbacks):
            self.record(apply_training_without_cache(self.model))
        for cb in callbacks:
            if isinstance(cb, ChangesEstimate):
                cb.configure_estimate(self)

    def note(self, message: str) -> None:
        self.notes.append(message)

    def undo(self) -> None:
        """Undo every recorded change, last first; an undo that raises does not stop the others
        (the first error is raised after)."""
        self.changes.undo_all()


def cuda_round(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes``
    (``torch.cuda.memory_allocated``), when the request is served from a fresh segment.

    Every request is rounded up to 512 bytes. Requests below 10 MiB are cut from a 2 MiB (small
    pool) or 20 MiB (large pool) segment, which is split, so they take just that. Larger requests
    get a segment of their own rounded up to 2 MiB; the allocator splits off the rest only when
    more than 1 MiB is left over, otherwise the whole segment counts as allocated to the tensor.
    Empty requests take nothing.
    """
    if nbytes <= 0:
        return 0
    size = -(-nbytes // 512) * 512
    if size < 10 * 2**20:
        return size
    segment = -(-size // 2**21) * 2**21
    return size if segment - size > 2**20 else segment


def resolve_optimizer(optimizer: Any) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """``optimizer`` as a factory ``factory(param_groups) -> Optimizer``: a short name (``"adamw"``,
    ``"adam"``, ``"sgd"`` with the estimate's settings below, or any other name of
    :data:`~lightning_efficient.measure.memory.optimizer_models.OPTIMIZER_NAMES`), a class path, an
    ``Optimizer`` class, or a factory (returned as is).

    ``"adamw"``/``"adam"`` step with ``foreach=True`` (torch's choice on CUDA, whose list-wide
    temporaries are part of the peak), ``"sgd"`` with momentum 0.9. Classes that read tensor
    values in their step (bitsandbytes, Adafactor) are modelled on fake tensors by their
    estimate-only state models."""
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key in _OPTIMIZERS:
            cls = optimizer_class(key, argument="optimizer")
            kwargs = _OPTIMIZERS[key]
            return lambda groups: cls(groups, **kwargs)
        optimizer = optimizer_class(optimizer, argument="optimizer")
    if isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` class must subclass torch.optim.Optimizer; got {optimizer!r}."
            )
        return estimate_factory(optimizer)
    if callable(optimizer):
        return optimizer
    raise TypeError(
        "`optimizer` must be a name ('adamw', 'adam', 'sgd', ...), a class path, an Optimizer "
        f"class or a factory(param_groups); got {optimizer!r} ({type(optimizer).__name__})."
    )


# -- faking the model ----------------------------------------------------------------------------
def check_unsharded(model: nn.Module) -> None:
    """Refuse a module FSDP2 has sharded, before touching it: its forward gathers parameters
    from every rank, and its first forward sets up FSDP's state, which a run on fake tensors
    would leave pointing at fake parameters (the next real step then fails)."""
    sharded = fsdp_sharded(model)
    if sharded:
        shown = ", ".join(repr(n or "<root>") for n in sharded[:3])
        raise ValueError(
            f"`model` is sharded by FSDP2's fully_shard ({shown}"
            f"{f' and {len(sharded) - 3} more' if len(sharded) > 3 else ''}): the estimate cannot "
            "run it on fake tensors. Estimate the module before it is sharded, with the sharding "
            "as an argument: estimate_memory(model, batch, world_size=<ranks>, sharding='full')."
        )


def check_common(
    model: Any, precision: str, steps: int, loss_fn: Any, cuda_rounding: bool, accumulate: int
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"`model` must be a torch.nn.Module or LightningModule; got {type(model).__name__}."
        )
    check_choice("precision", precision, PRECISIONS)
    check_int("steps", steps, minimum=1)
    check_int("accumulate_grad_batches", accumulate, minimum=1)
    check_bool("cuda_rounding", cuda_rounding)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be callable(model, batch) -> loss; got {type(loss_fn).__name__}."
        )
    if loss_fn is None and not hasattr(model, "training_step"):
        raise ValueError(
            "`loss_fn` is required for a plain nn.Module (give loss_fn(model, batch) -> scalar loss); "
            "a LightningModule's training_step is used when loss_fn is None."
        )
    if loss_fn is None and getattr(model, "automatic_optimization", True) is False:
        raise ValueError(
            "`model` uses manual optimization (automatic_optimization=False): its training_step "
            "steps optimizers itself, which the estimate cannot follow; pass `loss_fn(model, batch)`."
        )
