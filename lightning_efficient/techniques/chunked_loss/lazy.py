"""Logits that are not computed until something needs them: what the output projection returns.

A ``LazyLogits`` is a tensor with the logits' shape, dtype and device and no data. It holds the
hidden states the projection was called with and answers, through ``__torch_function__``:

- metadata (``shape``, ``size()``, ``dtype``, ``device``, ``dim()``, ...) from itself;
- conversions and reshapes that keep the vocabulary as the last dimension (``float()``,
  ``to(dtype)``, ``view``/``reshape`` to ``(..., V)``, ``contiguous()``, indexing that leaves the
  last dimension whole: ``logits[..., :-1, :]``) with another ``LazyLogits``, the same operation
  applied to the hidden states (and the conversions remembered, to round each chunk's logits
  as the plain step does);
- ``F.cross_entropy`` on ``(N, V)`` lazy logits with integer targets, ``mean`` or ``sum``
  reduction, no class weights: with the loss computed from the hidden states and the projection's
  weight in chunks (the session's ``loss``);
- anything else (a metric reading the logits, ``detach()``, ``argmax``, a soft-cap, ...): the
  full logits are computed once, exactly as the projection would have computed them (its own
  forward, under the autocast state of the call), and the operation runs on them; the session
  is told, so the technique can say so once.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_efficient.core._internals import TENSOR_BASE_GETTER, make_wrapper_tensor, tree_map

__all__ = ["LazyLogits", "LogitsSource", "LOSS_DTYPES"]

#: Dtypes the chunked loss reproduces (its float32 arithmetic would be less exact than float64).
LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_CE_SIGNATURE = inspect.signature(F.cross_entropy)

#: Answered from the lazy tensor's own metadata.
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.get_device,
    torch.Tensor.__len__,
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.grad_fn.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_sparse.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_meta.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_quantized.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_nested.__get__,  # type: ignore[attr-defined]
    TENSOR_BASE_GETTER,  # not a view of anything
}

#: Modules whose tensor hooks only mark that backward has reached a module's output (FSDP2's
#: pre-backward hook on a root module's outputs): on lazy logits they are moved to what the
#: logits become, the loss (or the full logits), instead of needing the logits' gradient.
_MARKER_HOOK_MODULES = ("torch.distributed.fsdp",)


class LogitsSource:
    """What one call of the output projection was: its own forward, the hidden states, the
    weight and bias, the autocast state of the call. ``session`` (``apply.LossSession``) decides
    and computes the loss (``why_not``, ``loss``) and hears when the full logits were needed
    (``fell_back(source, what)``)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        session: Any,
    ) -> None:
        self.forward, self.hidden, self.weight, self.bias = forward, hidden, weight, bias
        self.session = session
        self.device_type = hidden.device.type
        self.autocast = (
            torch.is_autocast_enabled(self.device_type),
            torch.get_autocast_dtype(self.device_type),
        )
        self.logits: torch.Tensor | None = None  # the full logits, once something needed them
        self.hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()  # marker hooks
        self._became: list[weakref.ref] = []  # the losses (or full logits) made from these

    def add_hook(self, hook: Callable[..., Any]) -> torch.utils.hooks.RemovableHandle:
        """Keep a marker hook (see ``_MARKER_HOOK_MODULES``) for what the logits become (and
        put it on what they became already: a Hugging Face model's loss is computed before its
        forward returns, when FSDP2 registers the hook)."""
        handle = torch.utils.hooks.RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        for ref in self._became:
            tensor = ref()
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(hook)
        return handle

    def attach_hooks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Register the kept marker hooks on ``tensor`` (the loss, or the full logits), and
        the ones added later."""
        if tensor.requires_grad:
            for hook in self.hooks.values():
                tensor.register_hook(hook)
            self._became.append(weakref.ref(tensor))
        return tensor

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype ``F.linear`` runs in for this call (autocast casts both operands)."""
        enabled, dtype = self.autocast
        return dtype if enabled else self.hidden.dtype

    def materialize(self) -> torch.Tensor:
        """The full logits, as the projection computes them (once per call), with their graph
        even when first read under ``no_grad`` or through ``detach()`` (an accuracy metric): the
        loss computed from them later needs it, as in the plain step."""
        if self.logits is None:
            enabled, dtype = self.autocast
            device_type = self.device_type
            now = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            with torch.enable_grad():  # the projection was called with grad enabled
                if now == self.autocast:
                    logits = self.forward(self.hidden)
                else:
                    with torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=False
                    ):
                        logits = self.forward(self.hidden)
            self.logits = self.attach_hooks(logits)
        return self.logits


class LazyLogits(torch.Tensor):
    """The output projection's result, computed only when needed (see the module docstring)."""

    source: LogitsSource
    hidden: torch.Tensor
    casts: tuple[torch.dtype, ...]
    replay: tuple[tuple[Any, tuple, dict], ...]

    @staticmethod
    def __new__(
        cls,
        source: LogitsSource,
        hidden: torch.Tensor,
        dtype: torch.dtype,
        casts: tuple[torch.dtype, ...] = (),
        replay: tuple[tuple[Any, tuple, dict], ...] = (),
    ) -> LazyLogits:
        shape = (*hidden.shape[:-1], source.weight.shape[0])
        wants_grad = torch.is_grad_enabled() and (
            hidden.requires_grad
            or source.weight.requires_grad
            or (source.bias is not None and source.bias.requires_grad)
        )
        out = make_wrapper_tensor(cls, shape, dtype, hidden.device, requires_grad=wants_grad)
        out.source, out.hidden, out.casts, out.replay = source, hidden, casts, replay
        return out

    @classmethod
    def of(cls, source: LogitsSource) -> LazyLogits:
        """The lazy result of one call of the projection."""
        return cls(source, source.hidden, source.compute_dtype)

    def _then(self, hidden: torch.Tensor, func: Any, args: tuple, kwargs: dict) -> LazyLogits:
        """Another lazy result: ``func(self, *args, **kwargs)`` on the logits, ``hidden`` the same
        operation on the hidden states."""
        return LazyLogits(
            self.source, hidden, self.dtype, self.casts, (*self.replay, (func, args, kwargs))
        )

    def _cast(self, dtype: torch.dtype, func: Any, args: tuple, kwargs: dict) -> LazyLogits:
        return LazyLogits(
            self.source,
            self.hidden,
            dtype,
            (*self.casts, dtype),
            (*self.replay, (func, args, kwargs)),
        )

    def full(self) -> torch.Tensor:
        """The full logits this lazy tensor stands for (computed once per projection call)."""
        out = self.source.materialize()
        for func, args, kwargs in self.replay:
            out = func(out, *args, **kwargs)
        return out

    # -- torch's entry points ----------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        if func is F.cross_entropy:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            logits = bound.arguments["input"]
            if isinstance(logits, LazyLogits) and logits.source.logits is None:
                session = logits.source.session
                why = session.why_not(logits, bound.arguments)
                if why is None:
                    return session.loss(logits, bound.arguments)
                return _fall_back(func, args, kwargs, f"F.cross_entropy with {why}")
            return _fall_back(func, args, kwargs)
        first = args[0] if args else None
        if isinstance(first, LazyLogits) and first.source.logits is None:
            if func is torch.Tensor.register_hook and _is_marker(args[1:], kwargs):
                return first.source.add_hook(args[1])
            lazy = _lazy_op(first, func, args[1:], kwargs)
            if lazy is not None:
                return lazy
        return _fall_back(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"lazy logits reached the operator {func} below autograd; every use should have "
            "computed the full logits first. Please report this with the model's code."
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype})"


def _fall_back(func: Any, args: tuple, kwargs: dict, what: str | None = None) -> Any:
    """Run ``func`` on the full logits of every lazy argument (telling their sessions what
    needed them: ``what``, by default the function's name)."""
    told: set[int] = set()

    def full(x: Any) -> Any:
        if not isinstance(x, LazyLogits):
            return x
        source = x.source
        if id(source) not in told and source.logits is None:
            told.add(id(source))
            source.session.fell_back(source, what or _name(func))
        return x.full()

    return func(*tree_map(full, args), **tree_map(full, kwargs))


def _is_marker(args: tuple, kwargs: dict) -> bool:
    """Whether ``register_hook(*args, **kwargs)`` registers a marker hook."""
    if kwargs or len(args) != 1:
        return False
    module = getattr(args[0], "__module__", None) or ""
    return module.startswith(_MARKER_HOOK_MODULES)


def _name(func: Any) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", None) or ""
    if qual.startswith("_TensorBase.") or qual.startswith("TensorBase."):
        qual = "Tensor." + qual.split(".", 1)[1]
    if module.startswith("torch.nn.functional"):
        return f"F.{qual}"
    return qual if qual.startswith("Tensor.") else f"{module}.{qual}".lstrip(".")


# -- operations that stay lazy ------------------------------------------------------------------
def _lazy_op(x: LazyLogits, func: Any, args: tuple, kwargs: dict) -> LazyLogits | None:
    """``func(x, *args, **kwargs)`` as a lazy result, or ``None`` when it cannot stay lazy."""
    if func in (torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.half):
        if args or kwargs:
            return None
        dtype = {
            torch.Tensor.float: torch.float32,
            torch.Tensor.bfloat16: torch.bfloat16,
            torch.Tensor.half: torch.float16,
        }[func]
        return x._cast(dtype, func, args, kwargs)
    if func is torch.Tensor.to:
        dtype = _to_dtype(x, args, kwargs)
        return None if dtype is None else x._cast(dtype, func, args, kwargs)
    if func is torch.Tensor.contiguous and not args and not kwargs:
        return x._then(x.hidden, func, args, kwargs)
    if func in (torch.Tensor.view, torch.Tensor.reshape) and not kwargs:
        shape = _new_shape(x, args)
        if shape is None:
            return None
        hidden = x.hidden.reshape(*shape[:-1], x.hidden.shape[-1])
        return x._then(hidden, func, args, kwargs)
    if func is torch.Tensor.__getitem__ and len(args) == 1 and not kwargs:
        index = args[0]
        if not _keeps_last_dim(index, x.dim()):
            return None
        return x._then(x.hidden[index], func, args, kwargs)
    return None


def _to_dtype(x: LazyLogits, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of ``x.to(*args, **kwargs)`` when it only converts the dtype (a device that is
    ``x``'s own is allowed); ``None`` for anything else (a copy, another device, a layout)."""
    if set(kwargs) - {"dtype", "device"}:
        return None
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype) and dtype is None:
            dtype = a
        elif isinstance(a, (str, torch.device)) and device is None:
            device = a
        else:
            return None
    if device is not None and torch.device(device) != x.device:
        if not (torch.device(device).index is None and torch.device(device).type == x.device.type):
            return None
    dtype = dtype or x.dtype
    return dtype if dtype in LOSS_DTYPES else None


def _new_shape(x: LazyLogits, args: tuple) -> tuple[int, ...] | None:
    """The shape ``x.view(*args)`` has, when its last dimension is still the vocabulary."""
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        return None
    shape = tuple(shape)
    numel, vocab = x.numel(), x.shape[-1]
    if shape.count(-1) > 1:
        return None
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if known <= 0 or numel % known:
            return None
        shape = tuple(numel // known if s == -1 else s for s in shape)
    size = 1
    for s in shape:
        size *= s
    if size != numel or shape[-1] != vocab:
        return None
    return shape


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    """Whether ``t[index]`` leaves the last of ``ndim`` dimensions whole (and last)."""
    items = [i for i in (index if isinstance(index, tuple) else (index,)) if i is not None]
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1 :]
        return not after or _whole(after[-1])
    consumed = sum(
        i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in items
    )
    if consumed < ndim:
        return True
    return consumed == ndim and _whole(items[-1])


def _whole(item: Any) -> bool:
    return isinstance(item, slice) and item == slice(None)
