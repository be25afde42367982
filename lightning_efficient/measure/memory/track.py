"""Live storage bytes by category, on fake or real tensors: the one tracker of the instrument.

``StorageTracker`` is a ``TorchDispatchMode``. Every tensor an operation returns is looked up by
its storage; a storage not seen before is a new allocation of ``storage.nbytes()`` bytes, and a
weak reference tells when it is freed. Views and in-place results share a storage and so cost
nothing. The tracker keeps an event log (allocation / free, phase); categories are labels on the
storages that can be settled later in the step (a gradient is known as one only once autograd
stores it in ``.grad``), and ``summary()`` replays the log with the final labels. Because it
follows storages, not modules, forwards that activation checkpointing re-runs during backward are
counted as they happen.

A storage can also change size without an operation: FSDP2 frees each block's gathered
parameters with ``untyped_storage().resize_(0)`` after its forward and backward and allocates them
again with ``resize_(n)`` before the next use, on the same storage object. A dispatch mode does
not see that (on a 2-process FSDP2 run every gathered block looked live for the whole step).
While a tracker is active, ``UntypedStorage.resize_`` reports to
it: a resize of a tracked storage is logged as the free of the old size and the allocation of
the new one.

``run_steps`` is the training step both the estimate (fake tensors) and ``measure_step`` (real
tensors on the CPU) run, so the two are compared on the same steps and categories.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import (
    FakeTensor,
    TorchDispatchMode,
    dispatch_modes_off,
    tree_flatten,
    tree_map,
)
from lightning_efficient.measure.memory.optimizer_models import (
    optimizer_state_tensors,
    steps_compiled,
)
from lightning_efficient.measure.memory.types import (
    CATEGORIES,
    EstimatePlan,
    MemoryEstimate,
    check_common,
    cuda_round,
    resolve_optimizer,
)
from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.step import autocast_for, is_lightning_module, loss_of, run_step

__all__ = ["StorageTracker", "run_steps", "measure_step", "keep_on_host"]

# a label only moves up this order (a parameter saved for backward stays a parameter)
_RANK = {
    c: i
    for i, c in enumerate(
        ("temporaries", "activations", "gradients", "optimizer_state", "parameters", "workspaces")
    )
}


class _Storage:
    __slots__ = ("nbytes", "requested", "category", "host", "__weakref__")

    def __init__(self, nbytes: int, category: str, requested: int | None = None) -> None:
        self.nbytes = nbytes  # as counted (rounded like the CUDA allocator when asked)
        self.requested = nbytes if requested is None else requested  # as asked for
        self.category = category
        self.host = False  # a copy in host memory (``keep_on_host``): counted as host bytes


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    for x in tree_flatten(obj)[0]:
        if isinstance(x, torch.Tensor):
            if hasattr(x, "placements") and callable(getattr(x, "to_local", None)):
                x = x.to_local()  # a DTensor (FSDP2): this rank holds its local shard only
            yield x


#: Trackers active now; ``UntypedStorage.resize_`` reports to them while there are any.
_RESIZE_LISTENERS: list[StorageTracker] = []
_ORIGINAL_RESIZE: list[Any] = []  # the method replaced while trackers listen (0 or 1 item)


def _reporting_resize(storage: Any, size: int) -> Any:
    out = _ORIGINAL_RESIZE[0](storage, size)
    for tracker in _RESIZE_LISTENERS:
        tracker._resized(storage)
    return out


def _listen_to_resizes(tracker: StorageTracker) -> None:
    if not _RESIZE_LISTENERS:
        _ORIGINAL_RESIZE.append(torch.UntypedStorage.resize_)
        torch.UntypedStorage.resize_ = _reporting_resize  # type: ignore[method-assign]
    _RESIZE_LISTENERS.append(tracker)


def keep_on_host(t: torch.Tensor) -> None:
    """``t`` stands for a copy in host memory (a tensor moved off the device, modelled on the CPU
    by a copy): every active tracker counts its storage as host bytes, not device bytes. On a
    CUDA target it is counted as the pinned host allocator holds it (a power of two)."""
    for tracker in _RESIZE_LISTENERS:
        tracker.to_host(t)


def _stop_listening(tracker: StorageTracker) -> None:
    if tracker in _RESIZE_LISTENERS:
        _RESIZE_LISTENERS.remove(tracker)
    if not _RESIZE_LISTENERS and _ORIGINAL_RESIZE:
        original = _ORIGINAL_RESIZE.pop()
        if "resize_" in vars(torch.UntypedStorage):  # the base class's own method comes back
            del torch.UntypedStorage.resize_
        if torch.UntypedStorage.resize_ is not original:  # pragma: no cover - defensive
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


class StorageTracker(TorchDispatchMode):
    """Counts live storage bytes by category while active (``with tracker: ...``).

    Args:
        rounding: Optional ``rounding(nbytes) -> nbytes`` applied to each allocation (e.g.
            ``estimate.cuda_round`` for the CUDA caching allocator's block sizes).
        fake: ``True`` counts only fake tensors, ``False`` only real ones, ``None`` both. With
            two trackers active (an estimate made during a measured step of a fit), each one
            then counts only its own tensors.
        op_hook: Optional ``hook(tracker, func)`` called after every operator (e.g. the CUDA
            model's workspaces, which a library allocates at its first use: ``hold``).

    New storages start as ``"temporaries"``; ``label(tensors, category)`` raises their category
    (order: temporaries < activations < gradients < optimizer_state < parameters);
    ``end_forward()`` labels everything still live that is a temporary as an activation (what
    autograd keeps for backward). ``phase`` names the current phase for the log.
    """

    def __init__(
        self,
        rounding: Callable[[int], int] | None = None,
        fake: bool | None = None,
        op_hook: Callable[[StorageTracker, Any], None] | None = None,
    ) -> None:
        super().__init__()
        self.rounding = rounding
        self.fake = fake
        self.op_hook = op_hook
        self._held: dict[Any, _Storage] = {}
        self._live: dict[int, _Storage] = {}
        self._refs: dict[int, Any] = {}
        self._events: list[tuple[_Storage | None, int, str]] = []
        self._phase = "forward"

    @property
    def phase(self) -> str:
        """The phase of the step now (``"forward"``, ``"backward"``, ``"optimizer"``)."""
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        if phase != self._phase:  # the bytes live on entering a phase are part of its peak
            self._events.append((None, 0, phase))
        self._phase = phase

    # -- bookkeeping -----------------------------------------------------------------------
    def _storage(self, t: torch.Tensor, category: str) -> _Storage | None:
        if self.fake is not None and isinstance(t, FakeTensor) != self.fake:
            return None
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError, TypeError):  # sparse, nested, odd subclasses
            return None
        key = id(st)
        rec = self._live.get(key)
        if rec is not None:
            return rec
        requested = nbytes = int(st.nbytes())
        if self.rounding is not None:
            nbytes = int(self.rounding(nbytes))
        rec = _Storage(nbytes, category, requested)
        self._live[key] = rec
        self._refs[key] = weakref.ref(st, lambda _r, key=key, rec=rec: self._free(key, rec))
        self._events.append((rec, 1, self.phase))
        return rec

    def _resized(self, st: Any) -> None:
        """``st`` was resized in place (FSDP2's free / re-allocation of gathered parameters)."""
        key = id(st)
        rec = self._live.get(key)
        if rec is None:
            return
        requested = nbytes = int(st.nbytes())
        if nbytes and self.rounding is not None:
            nbytes = int(self.rounding(nbytes))
        if nbytes == rec.nbytes:
            return
        self._events.append((rec, -1, self.phase))
        new = _Storage(nbytes, rec.category, requested)
        self._live[key] = new
        self._refs[key] = weakref.ref(st, lambda _r, key=key, rec=new: self._free(key, rec))
        self._events.append((new, 1, self.phase))

    def _free(self, key: int, rec: _Storage) -> None:
        if self._live.get(key) is rec:
            del self._live[key]
            del self._refs[key]
            self._events.append((rec, -1, self.phase))

    def hold(self, key: Any, nbytes: int, category: str = "workspaces") -> None:
        """A device allocation outside any tensor (a library's workspace), made once per
        ``key`` now and held to the end."""
        if key in self._held or nbytes <= 0:
            return
        rec = _Storage(int(self.rounding(nbytes) if self.rounding else nbytes), category, nbytes)
        self._held[key] = rec
        self._events.append((rec, 1, self.phase))

    def to_host(self, t: torch.Tensor) -> None:
        """Count the storage of ``t`` in host memory from its allocation on (``keep_on_host``)."""
        rec = self._storage(t, "activations")
        if rec is not None:
            rec.host = True
            if self.rounding is not None:  # pinned memory: CUDA's host allocator, powers of two
                rec.nbytes = 1 << max(rec.requested - 1, 0).bit_length()

    def track(self, tensors: Any, category: str = "temporaries") -> None:
        """Register the storages of ``tensors`` (any nesting) not seen yet, and label them."""
        self.label(tensors, category)

    def label(self, tensors: Any, category: str) -> None:
        if category not in _RANK:
            raise ValueError(
                f"`category` must be one of {', '.join(CATEGORIES)}; got {category!r}."
            )
        for t in _tensors(tensors):
            rec = self._storage(t, category)
            if rec is not None and _RANK[category] > _RANK[rec.category]:
                rec.category = category

    def end_forward(self) -> None:
        """Everything live that is still a temporary is kept for backward: an activation."""
        for rec in self._live.values():
            if rec.category == "temporaries":
                rec.category = "activations"

    @property
    def allocations(self) -> int:
        """Storages allocated while active (operations that produced new data)."""
        return sum(1 for _, sign, _ in self._events if sign > 0)

    def live_bytes(self, category: str | None = None) -> int:
        return sum(
            r.nbytes for r in self._live.values() if category is None or r.category == category
        )

    # -- the dispatch hook -------------------------------------------------------------------
    def __enter__(self) -> StorageTracker:
        out = super().__enter__()
        _listen_to_resizes(self)
        return out

    def __exit__(self, *exc: Any) -> Any:
        _stop_listening(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._storage(t, "temporaries")
        if self.op_hook is not None:
            self.op_hook(self, func)
        return out

    # -- results -----------------------------------------------------------------------------
    def requests(self, offload: dict[str, bool] | None = None) -> list[tuple[Any, int, int]]:
        """The device's allocations and frees in order, ``(record, +1 or -1, requested bytes)``,
        without the categories kept in host memory (``offload``): what the caching allocator is
        asked for (:func:`~lightning_efficient.measure.memory.caching_allocator.replay`)."""
        offload = offload or {}
        return [
            (rec, sign, rec.requested)
            for rec, sign, _ in self._events
            if rec is not None and not rec.host and not offload.get(rec.category, False)
        ]

    def summary(self, offload: dict[str, bool] | None = None) -> MemoryEstimate:
        """Replay the log with the final labels (:func:`_replay`): peak, bytes per category at
        the peak, phases; categories with ``offload[category]`` true count in host memory."""
        return _replay(self._events, offload)


def _replay(events: list, offload: dict[str, bool] | None = None) -> MemoryEstimate:
    """Replay a tracker's log (``StorageTracker._events``: ``(record or None, +1/-1, phase)``)
    with its final labels: peak, bytes per category at the peak, phases.

    Categories with ``offload[category]`` true are counted in host memory, not the device.
    """
    offload = offload or {}
    device = host = host_peak = 0
    current = dict.fromkeys(CATEGORIES, 0)
    peak, at_peak, peak_phase = 0, dict(current), "forward"
    phase_peaks: dict[str, int] = {}
    phase_by_category: dict[str, dict[str, int]] = {}
    levels: dict[int, dict[str, int]] = {}  # backward: gradient bytes -> the most at that level
    for rec, sign, phase in events:
        if rec is None:  # entering ``phase``: what is live now counts for it
            if device > phase_peaks.get(phase, -1):
                phase_peaks[phase] = device
                phase_by_category[phase] = dict(current)
            continue
        n = sign * rec.nbytes
        if rec.host or offload.get(rec.category, False):
            host += n
            host_peak = max(host_peak, host)
            continue
        device += n
        current[rec.category] += n
        if phase not in phase_peaks or device > phase_peaks[phase]:
            phase_peaks[phase] = device
            phase_by_category[phase] = dict(current)
        if phase == "backward":
            level = levels.get(current["gradients"])
            if level is None or device > sum(level.values()):
                levels[current["gradients"]] = dict(current)
        if device > peak:
            peak, at_peak, peak_phase = device, dict(current), phase
    return MemoryEstimate(
        peak_bytes=peak,
        by_category=at_peak,
        peak_phase=peak_phase,
        phase_peaks=phase_peaks,
        host_bytes=host_peak,
        phase_by_category=phase_by_category,
        backward_levels=_frontier(levels),
    )


def _frontier(levels: dict[int, dict[str, int]]) -> list[dict[str, int]]:
    """The backward moments no later moment exceeds in the bytes other than gradients (the
    candidates for the peak once a strategy divides the gradients), and the first moment with
    gradients (whose amount tells the head's gradients), ordered by gradients."""
    out: list[dict[str, int]] = []
    best_rest = -1
    for grads in sorted(levels, reverse=True):
        cats = levels[grads]
        rest = sum(cats.values()) - grads
        if rest > best_rest:
            out.append(cats)
            best_rest = rest
    first = min((g for g in levels if g > 0), default=None)
    if first is not None and all(c["gradients"] != first for c in out):
        out.append(levels[first])
    return sorted(out, key=lambda c: c["gradients"])


# -- the training step both the estimate and the real measurement run -----------------------------
def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def run_steps(plan: EstimatePlan, tracker: StorageTracker, *, steps: int = 2) -> None:
    """Run ``steps`` optimizer steps of ``plan`` under ``tracker`` (fake or real tensors).

    Order of a step, as Lightning's automatic optimization runs it: forward (``training_step``
    or ``loss_fn``) for each micro-batch, then ``zero_grad(set_to_none=True)`` before the first
    backward, backward, optimizer step. For a plain module the gradients are dropped after the
    step instead (the usual loop). With ``plan.optimizer_in_backward`` every parameter is stepped
    and its gradient freed as soon as it is accumulated. Run inside
    :func:`~lightning_efficient.measure.scratch.scratch` (train mode, logging muted, the module
    put back after).
    """
    model, batch = plan.model, plan.batch
    lightning = is_lightning_module(model) and plan.loss_fn is None
    params = _unique_params(model)
    trainable = [p for p in params if p.requires_grad]
    device_type = params[0].device.type if params else "cpu"  # autocast where the model is
    handles = []
    grad_scale = 65536.0 if plan.precision == "16-mixed" else None
    try:
        with tracker:
            tracker.phase = "forward"
            tracker.label(params, "parameters")
            tracker.label(list(model.buffers()), "parameters")
            tracker.label(batch, "activations")
            for p in trainable:  # gradients and state left by earlier steps (real runs)
                if p.grad is not None:
                    tracker.label(p.grad, "gradients")
            per_param: dict[int, torch.optim.Optimizer] = {}
            optimizer = None
            if plan.optimizer_in_backward:
                for p in trainable:
                    per_param[id(p)] = plan.optimizer([{"params": [p]}])
            else:
                optimizer = plan.optimizer([{"params": trainable}])
                tracker.label(optimizer_state_tensors(optimizer), "optimizer_state")

            def on_grad(p: torch.Tensor) -> None:
                tracker.label(p.grad, "gradients")
                opt = per_param.get(id(p))
                if opt is not None:
                    prev = tracker.phase
                    tracker.phase = "optimizer"
                    opt.step()
                    tracker.label(optimizer_state_tensors(opt), "optimizer_state")
                    p.grad = None
                    tracker.phase = prev

            for p in trainable:
                handles.append(p.register_post_accumulate_grad_hook(on_grad))
            micro = plan.accumulate_grad_batches
            for _ in range(steps):
                for i in range(micro):
                    tracker.phase = "forward"
                    with autocast_for(plan.precision, device_type):
                        out = run_step(model, batch, plan.loss_fn)
                    loss = loss_of(out)
                    del out
                    tracker.end_forward()
                    if micro > 1:
                        loss = loss / micro
                    if lightning and i == 0 and optimizer is not None:
                        optimizer.zero_grad(set_to_none=True)
                    tracker.phase = "backward"
                    if grad_scale is not None:
                        loss = loss * grad_scale
                    loss.backward()
                    del loss
                tracker.phase = "optimizer"
                if optimizer is not None:
                    if steps_compiled(optimizer):  # torch.compile refuses a dispatch mode;
                        with dispatch_modes_off():  # its new state is registered just below
                            optimizer.step()
                    else:
                        optimizer.step()
                    tracker.label(optimizer_state_tensors(optimizer), "optimizer_state")
                    if not lightning:
                        optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()


def measure_step(
    model: nn.Module,
    batch: Any,
    optimizer_factory: Any = "adamw",
    *,
    precision: str = "32-true",
    steps: int = 2,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    callbacks: Iterable[Any] = (),
    cuda_rounding: bool = False,
    accumulate_grad_batches: int = 1,
    copies: bool = True,
) -> MemoryEstimate:
    """Run ``steps`` REAL training steps of ``model`` (on its device, usually the CPU) under the
    storage tracker, and return what it measured, in the same fields as ``estimate_memory``.

    The steps run inside :func:`~lightning_efficient.measure.scratch.scratch`: the model is put
    back afterwards (its weights, buffers, gradients, dtype and the RNG), as after every
    measurement. ``precision="bf16-true"`` runs it in bfloat16. Techniques with
    ``configure_estimate(plan)`` are applied to the real model as they are to the fake one.
    ``copies=False``: the tensors' values are not copied to the host (to be put back) here; for a
    caller that holds its own ``scratch`` around this one (``allocator_step_peak``, whose
    profiler must see the steps' allocations only).
    """
    check_common(model, precision, steps, loss_fn, cuda_rounding, accumulate_grad_batches)
    factory = resolve_optimizer(optimizer_factory)
    tracker = StorageTracker(rounding=cuda_round if cuda_rounding else None, fake=False)
    with scratch(model, values=copies):
        if precision == "bf16-true":
            model.to(torch.bfloat16)
            batch = _floats_to(batch, torch.bfloat16)
        plan = EstimatePlan(
            model=model,
            batch=batch,
            optimizer=factory,
            precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            loss_fn=loss_fn,
        )
        try:
            plan.configure(callbacks)
            run_steps(plan, tracker, steps=steps)
        finally:
            plan.undo()
    result = tracker.summary(offload=plan.offload)
    result.notes = list(plan.notes)
    return result


def _floats_to(batch: Any, dtype: torch.dtype) -> Any:
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch
    )
