"""Exact memory estimate of training steps, without allocating memory and without a GPU.

``estimate_memory`` runs real training steps (the LightningModule's ``training_step`` or a plain
module with a loss function; backward; optimizer step; zero_grad) on *fake* tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and strides, no data) under the
storage tracker of :mod:`lightning_efficient.measure.track`, which counts the bytes of every live
storage by category. The result is the peak, the bytes live at the peak per category and the phase
of the peak. Because storages are tracked directly, recomputed forwards (activation
checkpointing) are counted as they happen.

Techniques of this package take part through ``configure_estimate(plan)``: they change the
``EstimatePlan`` (the fake model, the optimizer factory, offloading, ...) before the steps run.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_efficient._validate import check_bool, check_choice, check_int, format_bytes, import_object

__all__ = [
    "CATEGORIES",
    "PRECISIONS",
    "PHASES",
    "MemoryEstimate",
    "EstimatePlan",
    "EstimateError",
    "estimate_memory",
    "resolve_optimizer",
    "cuda_round",
]

#: The categories every figure of the instrument is split into (their sum is the total).
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
#: Precisions the estimate understands (Lightning's names).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
#: Phases of a training step.
PHASES = ("forward", "backward", "optimizer")

_OPTIMIZERS = {
    # foreach: what torch picks on CUDA (and its list-wide temporaries are part of the peak)
    "adamw": ("torch.optim.AdamW", {"lr": 1e-3, "foreach": True}),
    "adam": ("torch.optim.Adam", {"lr": 1e-3, "foreach": True}),
    "sgd": ("torch.optim.SGD", {"lr": 1e-3, "momentum": 0.9, "foreach": True}),
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
    """

    peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    phase_peaks: dict[str, int]
    host_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": int(self.peak_bytes),
            "by_category": {k: int(v) for k, v in self.by_category.items()},
            "peak_phase": self.peak_phase,
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "host_bytes": int(self.host_bytes),
            "notes": list(self.notes),
        }

    def table(self, title: str = "Memory at the peak"):  # -> rich.table.Table
        from rich.table import Table

        table = Table(title=f"{title}: peak in {self.peak_phase}")
        table.add_column("Category")
        table.add_column("Bytes", justify="right")
        table.add_column("Share", justify="right")
        for cat in CATEGORIES:
            n = self.by_category.get(cat, 0)
            share = n / self.peak_bytes if self.peak_bytes else 0.0
            table.add_row(cat.replace("_", " "), format_bytes(n), f"{share:.1%}")
        table.add_row("[b]peak[/b]", f"[b]{format_bytes(self.peak_bytes)}[/b]", "100.0%")
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
        lines.append(f"| **peak ({self.peak_phase})** | **{format_bytes(self.peak_bytes)}** | 100.0% |")
        if self.host_bytes:
            lines.append(f"| host (offloaded) | {format_bytes(self.host_bytes)} | |")
        return "\n".join(lines)

    def __str__(self) -> str:
        parts = ", ".join(f"{c} {format_bytes(self.by_category.get(c, 0))}" for c in CATEGORIES)
        host = f"; host {format_bytes(self.host_bytes)}" if self.host_bytes else ""
        return f"peak {format_bytes(self.peak_bytes)} in {self.peak_phase} ({parts}){host}"


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
    """

    model: nn.Module
    batch: Any
    optimizer: Callable[[list[dict]], torch.optim.Optimizer]
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    optimizer_in_backward: bool = False
    offload: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def on_exit(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` to undo a change; run (last first) in ``finally`` after the steps."""
        self._undo.append(fn)

    def note(self, message: str) -> None:
        self.notes.append(message)

    def _run_undo(self) -> None:
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as err:  # keep undoing the rest; report the first failure
                errors.append(err)
        if errors:
            raise errors[0]


def cuda_round(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of ``nbytes``.

    Requests are rounded up to 512 bytes; requests above 1 MiB (the large pool) are served in
    2 MiB blocks. Empty requests take nothing.
    """
    if nbytes <= 0:
        return 0
    if nbytes > 2**20:
        return -(-nbytes // 2**21) * 2**21
    return -(-nbytes // 512) * 512


def resolve_optimizer(optimizer: Any) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """``"adamw" | "adam" | "sgd"``, a class path, an ``Optimizer`` class or a factory
    ``factory(param_groups) -> Optimizer``, as a factory."""
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key in _OPTIMIZERS:
            path, kwargs = _OPTIMIZERS[key]
            cls = import_object("optimizer", path)
            return lambda groups: cls(groups, **kwargs)
        if "." not in optimizer:
            raise ValueError(
                f"`optimizer` must be one of {', '.join(map(repr, _OPTIMIZERS))}, a class path such as "
                f"'torch.optim.AdamW', an Optimizer class or a factory(param_groups); got {optimizer!r}."
            )
        optimizer = import_object("optimizer", optimizer)
    if isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise TypeError(f"`optimizer` class must subclass torch.optim.Optimizer; got {optimizer!r}.")
        cls = optimizer
        return lambda groups: cls(groups)
    if callable(optimizer):
        return optimizer
    raise TypeError(
        "`optimizer` must be a name ('adamw', 'adam', 'sgd'), a class path, an Optimizer class or a "
        f"factory(param_groups); got {optimizer!r} ({type(optimizer).__name__})."
    )


# -- faking the model ----------------------------------------------------------------------------
def _fake_like(t: torch.Tensor, fake_mode: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty fake CPU tensor with ``t``'s shape, strides and dtype (works for meta tensors)."""
    with fake_mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype or t.dtype, device="cpu")


def _param_dtype(t: torch.Tensor, precision: str) -> torch.dtype:
    if precision == "bf16-true" and t.is_floating_point():
        return torch.bfloat16
    return t.dtype


@contextlib.contextmanager
def swap_to_fake(model: nn.Module, fake_mode: Any, precision: str = "32-true") -> Iterator[nn.Module]:
    """Replace ``model``'s parameters and buffers in place by fake tensors; restore them on exit.

    A memo keeps shared (tied) parameters shared. Nothing real is allocated, so this works for
    models on the ``meta`` device.
    """
    memo: dict[int, torch.Tensor] = {}
    undo: list[tuple[dict, str, Any]] = []
    try:
        for mod in model.modules():
            for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    fake = memo.get(id(t))
                    if fake is None:
                        fake = _fake_like(t, fake_mode, _param_dtype(t, precision))
                        if is_param:
                            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                        memo[id(t)] = fake
                    undo.append((store, name, t))
                    store[name] = fake
        yield model
    finally:
        for store, name, t in reversed(undo):
            store[name] = t


def fake_batch(batch: Any, fake_mode: Any, precision: str = "32-true") -> Any:
    """The batch with every tensor replaced by an empty fake CPU tensor (``torch.Size`` entries
    become float tensors of that shape)."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _fake_like(x, fake_mode, _param_dtype(x, precision))
        if isinstance(x, torch.Size):
            return _fake_like(torch.empty(x, device="meta"), fake_mode)
        if isinstance(x, dict):
            return type(x)((k, convert(v)) for k, v in x.items()) if type(x) is dict else {k: convert(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(convert(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        if hasattr(x, "items") and hasattr(x, "keys"):  # Mapping-like (e.g. HF BatchEncoding)
            return {k: convert(v) for k, v in x.items()}
        return x

    return convert(batch)


# -- the error for models that need real values --------------------------------------------------
def _fake_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException", "UnsupportedFakeTensorException")
    errors = tuple(getattr(ft, n) for n in names if hasattr(ft, n))
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors += (GuardOnDataDependentSymNode,)
    except ImportError:  # pragma: no cover - depends on the torch version
        pass
    return errors


def _user_frame(tb: Any) -> str:
    """The innermost traceback frame outside torch and this package (the user's line)."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or "/lightning_efficient/measure/" in f or "/contextlib.py" in f:
            continue
        return f"{fr.filename}:{fr.lineno} ({fr.line})"
    return ""


def explain_fake_failure(err: BaseException) -> EstimateError:
    func = getattr(err, "func", None)
    op = str(func) if func is not None else type(err).__name__
    why = {
        "aten._local_scalar_dense.default": (
            "it reads a tensor's value (`.item()`, `float(t)`, `bool(t)`, `if t > 0:` or other "
            "Python control flow on tensor values)"
        ),
    }.get(op, "its output shape or result depends on the tensor values (e.g. `nonzero`, boolean masking, `unique`)")
    where = _user_frame(err.__traceback__)
    return EstimateError(
        f"estimate_memory could not run the model on fake tensors: the operation `{op}` needs real "
        f"values because {why}."
        + (f" It was called at {where}." if where else "")
        + " Fake tensors carry shapes, not values. Fallback: measure on the real device with a small "
        "batch, e.g. `lightning_efficient.measure.track.measure_step(model, small_batch)` or a short "
        "fit with the `MemoryBreakdown` callback, and scale the activations with the batch size."
    )


# -- the estimate ----------------------------------------------------------------------------------
def estimate_memory(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: Any = "adamw",
    precision: str = "32-true",
    callbacks: Any = (),
    steps: int = 2,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    cuda_rounding: bool = False,
    accumulate_grad_batches: int = 1,
) -> MemoryEstimate:
    """Device memory of ``steps`` training steps of ``model`` on ``batch``, without allocating.

    Args:
        model: A LightningModule (its ``training_step`` is run, with ``self.log`` silenced) or a
            plain ``nn.Module`` (then ``loss_fn(model, batch) -> loss`` is required). It may live
            on the ``meta`` device. It is restored unchanged afterwards.
        batch: An example batch: tensors (real or meta) or ``torch.Size`` shapes, nested in
            tuples/lists/dicts. Only shapes and dtypes are used.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` (momentum 0.9), a class path, an
            ``Optimizer`` class or a factory ``factory(param_groups) -> Optimizer``.
        precision: ``"32-true"``, ``"bf16-mixed"`` / ``"16-mixed"`` (autocast: fp32 weights,
            low-precision activations), or ``"bf16-true"`` (bf16 weights and optimizer state).
        callbacks: Techniques of this package; those with ``configure_estimate(plan)`` change the
            plan before the steps run.
        steps: Optimizer steps to run (2 sees the optimizer state live during a forward).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; required for a plain ``nn.Module``.
        cuda_rounding: Round every allocation the way the CUDA caching allocator does
            (512 bytes; 2 MiB blocks above 1 MiB).
        accumulate_grad_batches: Micro-batches per optimizer step.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_efficient.measure.track import StorageTracker, run_steps

    _check_common(model, precision, steps, loss_fn, cuda_rounding, accumulate_grad_batches)
    factory = resolve_optimizer(optimizer)
    callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    was_training = model.training
    with swap_to_fake(model, fake_mode, precision):
        plan = EstimatePlan(
            model=model,
            batch=fake_batch(batch, fake_mode, precision),
            optimizer=factory,
            precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            loss_fn=loss_fn,
        )
        try:
            for cb in callbacks:
                hook = getattr(cb, "configure_estimate", None)
                if hook is not None:
                    hook(plan)
            tracker = StorageTracker(rounding=cuda_round if cuda_rounding else None)
            try:
                with fake_mode:
                    run_steps(plan, tracker, steps=steps)
            except _fake_errors() as err:
                raise explain_fake_failure(err) from err
        finally:
            try:
                plan._run_undo()
            finally:
                model.train(was_training)
    result = tracker.summary(offload=plan.offload)
    result.notes = list(plan.notes)
    return result


def _check_common(model: Any, precision: str, steps: int, loss_fn: Any, cuda_rounding: bool, accumulate: int) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module or LightningModule; got {type(model).__name__}.")
    check_choice("precision", precision, PRECISIONS)
    check_int("steps", steps, minimum=1)
    check_int("accumulate_grad_batches", accumulate, minimum=1)
    check_bool("cuda_rounding", cuda_rounding)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable(model, batch) -> loss; got {type(loss_fn).__name__}.")
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
