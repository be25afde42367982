"""Real trial steps: one training step of a module on a device, measured by the instrument.

Where the fake-tensor estimate cannot answer (a confirmation on the real device, a model the
estimate cannot run, samples/s), a technique runs a *real* step here. The peak comes from the
instrument's one peak meter (:class:`~lightning_efficient.measure.memory.peak.PeakMemory`): the
CUDA caching allocator's statistics on a GPU, the :class:`StorageTracker` (live storage bytes of
real tensors) anywhere else. The module is put back exactly afterwards (weights, buffers,
gradients, device, train mode), and ``self.log`` is muted during the step.

- :func:`trial_step`: peak bytes of forward + backward + optimizer step.
- :func:`trial_within`: do real steps with a stack of techniques run within a budget (CUDA:
  under that cap, as the fit will run), and what did the allocator reserve.
- :func:`throughput`: samples/s of (forward + backward) x accumulation + one optimizer step,
  timed with :func:`~lightning_efficient.measure.speed.timing.time_fn`; ``None`` on out-of-memory.
- :func:`is_out_of_memory` / :func:`free_memory`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import tree_flatten
from lightning_efficient.measure.memory.peak import PeakMemory
from lightning_efficient.measure.memory.track import StorageTracker, run_steps
from lightning_efficient.measure.memory.types import EstimatePlan, resolve_optimizer
from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.speed.timing import time_fn
from lightning_efficient.measure.step import forward_backward

__all__ = [
    "TrialResult",
    "free_memory",
    "is_out_of_memory",
    "memory_cap",
    "scratch_step",
    "throughput",
    "trial_step",
    "trial_within",
]


def is_out_of_memory(err: BaseException) -> bool:
    """True for CUDA OOM (``torch.OutOfMemoryError``), cuDNN's OOM-in-disguise and a CPU
    allocation failure (``DefaultCPUAllocator: can't allocate memory``)."""
    from lightning.pytorch.utilities.memory import is_oom_error

    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    if oom_type is not None and isinstance(err, oom_type):
        return True
    if isinstance(err, RuntimeError) and err.args and isinstance(err.args[0], str):
        message = err.args[0]
        if "out of memory" in message.lower() or "can't allocate memory" in message:
            return True
    return is_oom_error(err)


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def scratch_step(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run real steps on ``module`` and put it back exactly (:func:`~lightning_efficient.measure.
    scratch.scratch`: weights, buffers, attributes, metric states, gradients, device, mode and
    the RNG), then free the device's cache."""
    try:
        with scratch(module, device):
            yield
    finally:
        free_memory()


def _to(batch: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor)]


def _optimizer(optimizer: Any, module: nn.Module) -> torch.optim.Optimizer:
    return resolve_optimizer(optimizer)(
        [{"params": [p for p in module.parameters() if p.requires_grad]}]
    )


def trial_step(
    module: nn.Module,
    batch: Any,
    optimizer: Any = "adamw",
    *,
    device: torch.device | str = "cpu",
    precision: str = "32-true",
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> int:
    """One real training step (forward, backward, optimizer step) of ``module`` on ``device``;
    returns its peak bytes (CUDA: ``max_memory_allocated``; else the storage tracker's peak of
    the parameters, buffers, batch and everything the step allocates). Leaves the module
    unchanged. Raises what the step raises (an out-of-memory error included).

    ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"``, a class path, an Optimizer class or a
    factory, as for the estimate. ``precision``: a Lightning precision string (autocast for the
    ``*-mixed`` ones). ``loss_fn``: ``loss_fn(module, batch) -> loss``, as for the estimate
    (``None``: the module's ``training_step``).
    """
    device = torch.device(device)
    precision = str(precision)
    with scratch_step(module, device):
        batch = _to(batch, device)
        opt = _optimizer(optimizer, module)
        forward_backward_ = forward_backward(
            module, batch, precision=precision, device_type=device.type, loss_fn=loss_fn
        )

        def step() -> None:
            forward_backward_()
            opt.step()

        alive = [*module.parameters(), *module.buffers(), *_batch_tensors(batch)]
        with PeakMemory(device, alive) as meter:
            step()
        return int(meter.peak_allocated or 0)


def throughput(
    module: nn.Module,
    batch: Any,
    optimizer: Any = "adamw",
    *,
    device: torch.device | str = "cpu",
    precision: str = "32-true",
    samples: int,
    accumulation: int = 1,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> float | None:
    """Samples/s of training with micro-batch ``batch``: ``(forward + backward) x accumulation``
    plus one optimizer step, each timed with the instrument's ``time_fn`` (median of 3 after one
    warm-up); ``None`` when the step runs out of memory. ``samples``: the micro-batch's number of
    samples. ``loss_fn``: as for :func:`trial_step`."""
    device = torch.device(device)
    precision = str(precision)
    try:
        with scratch_step(module, device):
            batch = _to(batch, device)
            opt = _optimizer(optimizer, module)
            step = forward_backward(
                module, batch, precision=precision, device_type=device.type, loss_fn=loss_fn
            )
            t_fb = time_fn(step, warmup=1, repeats=3, device=device)
            t_opt = time_fn(opt.step, warmup=1, repeats=3, device=device)
            del opt
    except BaseException as err:  # noqa: BLE001 - only OOM is handled, the rest re-raised
        if not is_out_of_memory(err):
            raise
        free_memory()
        return None
    return samples * accumulation / (accumulation * t_fb + t_opt)


# -- a stack confirmed on the device ---------------------------------------------------------------
@dataclass
class TrialResult:
    """What :func:`trial_within` found: whether the steps ran within the budget, and the peaks
    (CUDA: the caching allocator's allocated and reserved bytes; CPU: the tracker's peak for
    both)."""

    ok: bool
    allocated_bytes: int
    reserved_bytes: int
    budget_bytes: int | None
    error: str = ""

    def describe(self) -> str:
        """``"ran, reserved 7.5 GiB"`` / ``"out of memory (23.6 GiB reserved)"``."""
        from lightning_efficient.core.validate import format_bytes

        reserved = format_bytes(self.reserved_bytes)
        return f"ran, reserved {reserved}" if self.ok else f"out of memory ({reserved} reserved)"


@contextlib.contextmanager
def memory_cap(device: torch.device, budget_bytes: int | None) -> Iterator[None]:
    """On a CUDA device, limit this process's caching allocator to ``budget_bytes`` while
    inside (``torch.cuda.set_per_process_memory_fraction``; put back after). Elsewhere nothing."""
    if device.type != "cuda" or budget_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = float(getter(device)) if callable(getter) else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def trial_within(
    module: nn.Module,
    batch: Any,
    budget_bytes: int | None = None,
    *,
    callbacks: Iterable[Any] = (),
    optimizer: Any = "adamw",
    precision: str = "32-true",
    device: torch.device | str = "cpu",
    steps: int = 2,
    accumulate_grad_batches: int = 1,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> TrialResult:
    """``steps`` real training steps of ``module`` on ``device`` with the techniques in
    ``callbacks`` applied as they are for an estimate (``configure_estimate``: checkpointed
    blocks, a swapped optimizer, ...), within ``budget_bytes``: on CUDA under that cap, so
    that the caching allocator frees its cache and runs out of memory where the fit would; on
    a CPU the tracker's peak is compared with the budget. An out-of-memory error is a result
    (``ok=False``), any other error is raised. The module is put back exactly.
    ``accumulate_grad_batches``: micro-batches per step (gradients live through the next
    micro-batch's forward, as in the fit). ``loss_fn``: as for :func:`trial_step` (the
    estimate's own)."""
    device = torch.device(device)
    precision = str(precision)
    cuda = device.type == "cuda"
    tracker = StorageTracker(fake=False)
    meter = PeakMemory(device, enabled=cuda)  # a CPU's peak is the tracker's, which the steps run
    error = ""
    with scratch_step(module, device):
        plan = EstimatePlan(
            model=module,
            batch=_to(batch, device),
            optimizer=resolve_optimizer(optimizer),
            precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            loss_fn=loss_fn,
        )
        try:
            plan.configure(callbacks)
            if cuda:
                free_memory()
            with meter, memory_cap(device, budget_bytes):
                run_steps(plan, tracker, steps=steps)
        except BaseException as err:  # noqa: BLE001 - only OOM is a result, the rest re-raised
            if not is_out_of_memory(err):
                raise
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        finally:
            plan.undo()
            del plan
    if cuda:  # no figures (0) when the steps never began: an out-of-memory error in a hook
        allocated, reserved = int(meter.peak_allocated or 0), int(meter.reserved or 0)
    else:
        allocated = reserved = tracker.summary().peak_bytes
    ok = not error and (budget_bytes is None or reserved <= budget_bytes)
    return TrialResult(ok, allocated, reserved, budget_bytes, error)
