"""The optimizers the instrument knows: by name, as estimate-only state models, and by their
state bytes.

- :func:`optimizer_class`: the one resolver of an optimizer short name (:data:`OPTIMIZER_NAMES`)
  or class path to its class (the estimate, ``OptimizerSwap`` and the batch-size trial steps use
  it).
- :class:`EightBitStateModel` / :class:`AdafactorStateModel`: estimate-only stand-ins for the
  optimizers that read tensor values in their step (bitsandbytes, Adafactor's ``.item()``), which
  allocate exactly their states and the temporaries of their CPU step on fake tensors.
- :func:`state_model` / :func:`estimate_factory`: the stand-in for a class when it needs one;
  :func:`running_estimate_factory`: the same for an optimizer a fit is running.
- :func:`optimizer_state_tensors` / :func:`optimizer_state_bytes`: the state of an optimizer,
  through Lightning's and DeepSpeed's wrappers and optimizer-in-backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_efficient.core._internals import FakeTensor, adafactor_init_group, tree_flatten
from lightning_efficient.core.validate import import_object, missing_extra, missing_requirement

__all__ = [
    "OPTIMIZER_NAMES",
    "AdafactorStateModel",
    "CompiledAdamStateModel",
    "EightBitStateModel",
    "estimate_factory",
    "optimizer_class",
    "optimizer_state_bytes",
    "optimizer_state_tensors",
    "running_estimate_factory",
    "state_model",
    "steps_compiled",
]

#: Short names -> class paths; bitsandbytes ones are imported lazily.
OPTIMIZER_NAMES: dict[str, str] = {
    "adamw": "torch.optim.AdamW",
    "adam": "torch.optim.Adam",
    "sgd": "torch.optim.SGD",
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
    "adam8bit": "bitsandbytes.optim.Adam8bit",
    "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit",
    "paged_adamw32bit": "bitsandbytes.optim.PagedAdamW32bit",
    "lion8bit": "bitsandbytes.optim.Lion8bit",
    "adafactor": "torch.optim.Adafactor",
    "adamw_fused": "torch.optim.AdamW",
    # bf16 weights with compensated updates (OptimizerSwap sets the compensation on)
    "adamw_kahan": "optimi.AdamW",
    "adamw_sr": "torchao.optim._AdamW",
    "adamw8bit_sr": "torchao.optim.AdamW8bit",
}
_BNB_PREFIX = "bitsandbytes."

DEFAULT_MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep 32-bit states


def optimizer_class(name: Any, *, argument: str = "name") -> type[Optimizer]:
    """The optimizer class for a short name of :data:`OPTIMIZER_NAMES` or a class path.

    Errors name ``argument``: a ``ValueError`` listing the valid names for an unknown name, a
    ``TypeError`` for a path that is not a ``torch.optim.Optimizer`` subclass, and the
    ``ImportError`` with the pip extra for a bitsandbytes name without bitsandbytes.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"`{argument}` must be an optimizer name or class path (str); got {name!r} "
            f"({type(name).__name__})."
        )
    path = OPTIMIZER_NAMES.get(name)
    if path is None and "." not in name:
        raise ValueError(
            f"`{argument}` must be one of {', '.join(repr(n) for n in OPTIMIZER_NAMES)} or the "
            f"class path of a torch.optim.Optimizer (e.g. 'torch.optim.SGD'); got {name!r}."
        )
    path = path or name
    if path.startswith(_BNB_PREFIX):
        try:
            import bitsandbytes.optim  # noqa: F401
        except ImportError as err:
            raise missing_requirement("bitsandbytes", f"The optimizer {name!r}") from err
    if path.startswith(("optimi.", "torchao.")):
        _import_bf16_extra(path, name)
    cls = import_object(argument, path)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"`{argument}`: {path!r} is not a torch.optim.Optimizer subclass; got {cls!r}."
        )
    return cls


def _import_bf16_extra(path: str, name: str) -> None:
    """The bf16-weight optimizers' packages (the ``bf16`` extra), or the pip command."""
    package = "torch-optimi" if path.startswith("optimi.") else "torchao"
    try:
        if package == "torch-optimi":
            import optimi  # noqa: F401
        else:
            import torchao.optim  # noqa: F401
    except ImportError as err:
        raise missing_extra(package, "bf16", f"The optimizer {name!r}") from err


# -- bitsandbytes' state layout ----------------------------------------------------------------
#: bitsandbytes names -> (number of states, optim_bits, update rule)
BNB_LAYOUT: dict[str, tuple[int, int, str]] = {
    "adamw8bit": (2, 8, "adam"),
    "adam8bit": (2, 8, "adam"),
    "paged_adamw8bit": (2, 8, "adam"),
    "paged_adamw32bit": (2, 32, "adam"),
    "lion8bit": (1, 8, "lion"),
}
#: bitsandbytes class names -> their layout name
_BNB_CLASSES = {
    "AdamW8bit": "adamw8bit",
    "Adam8bit": "adam8bit",
    "PagedAdamW8bit": "paged_adamw8bit",
    "PagedAdamW32bit": "paged_adamw32bit",
    "Lion8bit": "lion8bit",
}
_BNB_BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per 256 elements
_QMAP_SIZE = 256  # a quantisation map: 256 fp32 code values
#: constructor arguments of the state model (the rest are group options)
_MODEL_OPTIONS = ("min_8bit_size", "optim_bits", "max_unorm")


def _run_closure(closure: Callable[[], Any] | None) -> Any:
    """An optimizer step's closure (forward and backward) with gradients on; ``None`` without."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _PerParameterModel(Optimizer):
    """An estimate-only optimizer that steps parameter by parameter: ``_init_state(p, group)`` the
    first time ``p`` has a gradient, then ``_update(group, p)``."""

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p, group)
                self._update(group, p)
        return loss


class EightBitStateModel(_PerParameterModel):
    """Estimate-only stand-in for bitsandbytes' optimizers (``Optimizer2State`` /
    ``Optimizer1State``) that runs on fake tensors: it allocates exactly the state bitsandbytes
    allocates and the temporaries its CPU step allocates, and never reads a tensor's value.

    Not for training: its arithmetic only mimics the update (no quantisation maths). State per
    parameter, as bitsandbytes' ``init_state``: ``step`` (an int); for a parameter with at least
    ``min_8bit_size`` elements that is not in ``keep_32bit``, and ``optim_bits == 8``: uint8
    ``state1`` (and ``state2``) of the parameter's shape, fp32 ``absmax1`` (and ``absmax2``) of
    ``ceil(numel / 256)`` blocks and the shared quantisation maps ``qmap1`` (``qmap2``), 256 fp32
    each, created once in the constructor; otherwise fp32 ``state1`` (and ``state2``).
    ``unorm_vec`` (one fp32) when ``max_unorm > 0``.

    Args:
        params: Parameters or param groups (group options are kept, not used).
        name: A bitsandbytes short name (``"adamw8bit"``, ``"adam8bit"``, ``"paged_adamw8bit"``,
            ``"paged_adamw32bit"``, ``"lion8bit"``).
        min_8bit_size: Tensors with fewer elements keep 32-bit states.
        keep_32bit: Tensors that keep 32-bit states (the GlobalOptimManager override).
        optim_bits: 8 or 32 (default: the name's).
        max_unorm: As bitsandbytes' (``> 0`` adds ``unorm_vec``).
        cpu_temporaries: Allocate, per parameter, the fp32 copies bitsandbytes' CPU step makes
            (dequantised states, the scaled gradient, the denominator, the re-quantised output);
            ``False`` models the fused CUDA kernels, which make none.
    """

    def __init__(
        self,
        params: Iterable[Any],
        name: str,
        *,
        min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
        keep_32bit: Iterable[torch.Tensor] = (),
        optim_bits: int | None = None,
        max_unorm: float = 0.0,
        cpu_temporaries: bool = True,
        **defaults: Any,
    ) -> None:
        if name not in BNB_LAYOUT:
            raise ValueError(
                f"`name` must be one of {', '.join(map(repr, BNB_LAYOUT))}; got {name!r}."
            )
        super().__init__(
            params,
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **defaults},
        )
        n_states, bits, rule = BNB_LAYOUT[name]
        self.name, self.n_states, self.rule = name, n_states, rule
        self.optim_bits = bits if optim_bits is None else optim_bits
        self.min_8bit_size, self.max_unorm = min_8bit_size, max_unorm
        self.cpu_temporaries = cpu_temporaries
        self._keep = {id(p) for p in keep_32bit}
        self.name2qmap: dict[str, torch.Tensor] = {}
        if self.optim_bits == 8:  # bitsandbytes' fill_qmap: both maps, whatever the name
            device = next(
                (p.device for g in self.param_groups for p in g["params"]), torch.device("cpu")
            )
            self.name2qmap = {
                k: torch.empty(_QMAP_SIZE, dtype=torch.float32, device=device)
                for k in ("dynamic", "udynamic")
            }

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] = 0
        eight = self.optim_bits == 8 and p.numel() >= self.min_8bit_size and id(p) not in self._keep
        names = ("state1", "state2")[: self.n_states]
        for i, key in enumerate(names, start=1):
            state[key] = torch.zeros_like(
                p,
                dtype=torch.uint8 if eight else torch.float32,
                memory_format=torch.contiguous_format,
            )
            if eight:
                state[f"qmap{i}"] = self.name2qmap["dynamic" if i == 1 else "udynamic"]
        if eight:
            blocks = -(-p.numel() // _BNB_BLOCKSIZE)
            for i in range(1, self.n_states + 1):
                state[f"absmax{i}"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        if self.max_unorm > 0.0:
            state["unorm_vec"] = torch.zeros((1,), device=p.device)

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """The allocations of bitsandbytes' CPU kernels (backends/cpu/ops.py), in their order."""
        state = self.state[p]
        state["step"] += 1
        beta1, beta2 = group["betas"][0], group["betas"][1]
        lr, eps = group["lr"], group["eps"]
        s1, s2 = state["state1"], state.get("state2")
        eight = s1.dtype == torch.uint8
        if not self.cpu_temporaries:  # the fused CUDA kernels update in place
            return
        # dequantise (8-bit) or use the fp32 states as they are
        m = torch.empty_like(s1, dtype=torch.float32) if eight else s1
        v = (torch.empty_like(s2, dtype=torch.float32) if eight else s2) if s2 is not None else None
        grad = p.grad.float() * 1.0  # gnorm_scale
        weights = p.data.float()  # an alias for fp32 parameters, a copy otherwise
        if self.rule == "adam":
            m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            if eight:
                denom = (v.sqrt() / 1.0).add_(eps)
                weights.addcdiv_(m, denom, value=-lr)
            else:
                update = m / (v.sqrt() + eps)
                weights.add_(update, alpha=-lr)
        else:  # lion
            if eight:
                direction = torch.sign(m.mul(beta1) + grad.mul(1.0 - beta1))
            else:
                direction = m.mul(beta1).add(grad, alpha=1.0 - beta1).sign()
            weights.add_(direction, alpha=-lr)
            m.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        p.data.copy_(weights)
        if eight:  # re-quantise: a uint8 copy and the block maxima, copied into the state
            for i, fp32 in enumerate((m, v)[: self.n_states], start=1):
                out = torch.empty_like(fp32, dtype=torch.uint8)
                absmax = torch.empty_like(state[f"absmax{i}"])
                state[f"state{i}"].copy_(out)
                state[f"absmax{i}"].copy_(absmax)


class AdafactorStateModel(torch.optim.Adafactor):
    """Estimate-only ``torch.optim.Adafactor`` that runs on fake tensors: its states come from
    Adafactor's own group initialisation (``step``; factored ``row_var`` / ``col_var`` for
    tensors of 2 or more dims, a full ``variance`` otherwise) and its step allocates what the
    single-tensor step (torch's choice off CUDA) allocates, but the two scalars Adafactor reads
    with ``.item()`` (the parameter's and the update's RMS) stay tensors. Not for training (the
    step count is kept in Python). Args as ``torch.optim.Adafactor``.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _run_closure(closure)
        counts = self.__dict__.setdefault("_counts", {})
        for group in self.param_groups:
            params, grads, rows, cols, variances, steps = adafactor_init_group(self, group)
            eps1, eps2 = group["eps"]
            lr, d, wd = group["lr"], group["d"], group["weight_decay"]
            for param, grad, row_var, col_var, variance, step_t in zip(
                params, grads, rows, cols, variances, steps
            ):
                if eps1 is None:
                    eps1 = torch.finfo(param.dtype).eps
                step_t += 1
                counts[id(param)] = n = counts.get(id(param), 0) + 1
                beta = n ** group["beta2_decay"]
                rho = min(lr, 1 / n**0.5)
                alpha = (param.norm(2) / param.numel() ** 0.5).clamp_(min=eps2) * rho
                if wd != 0:
                    param.mul_(1 - lr * wd)
                if grad.dim() > 1:
                    row_var.lerp_(
                        torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), beta
                    )
                    col_var.lerp_(
                        torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), beta
                    )
                    var_estimate = row_var @ col_var
                    var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
                else:
                    variance.lerp_(grad * grad, beta)
                    var_estimate = variance.clone()
                update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
                update.mul_(grad)
                denom = (update.norm(2) / (update.numel() ** 0.5 * d)).clamp_(min=1.0)
                update.mul_(-alpha / denom)
                param.add_(update)
        return loss


_TORCHAO_PREFIX = "torchao.optim"
_TORCHAO_MIN_QUANTISED = 4096  # torchao quantises states of tensors with at least this many values


class CompiledAdamStateModel(_PerParameterModel):
    """Estimate-only stand-in for torchao's AdamW family (``_AdamW`` and ``AdamW8bit``, with
    ``bf16_stochastic_round`` or not), whose step is a ``torch.compile``d function that neither
    fake tensors nor a dispatch mode can enter. It allocates exactly torchao's state: ``step`` (one
    fp32), ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``): for a tensor
    of at least 4,096 values divisible by ``block_size``, uint8 codes of its shape, one fp32
    scale per ``block_size`` values and a quantisation map of 256 fp32 values each; otherwise a
    tensor of its shape and dtype (bf16 for bf16 weights). The compiled step updates weights and
    states in place in fused kernels: modelled with no temporaries. Not for training.

    Args:
        params: Parameters or param groups (group options are kept, not used).
        block_size: torchao's (``256`` for ``AdamW8bit``, ``inf`` for ``_AdamW``: never
            quantised).
    """

    def __init__(self, params: Iterable[Any], *, block_size: float, **defaults: Any) -> None:
        super().__init__(
            params,
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **defaults},
        )
        self.block_size = block_size

    def _buffer(self, p: torch.Tensor) -> Any:
        n = p.numel()
        if n >= _TORCHAO_MIN_QUANTISED and n % self.block_size == 0:
            return [
                torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format),
                torch.zeros((n // int(self.block_size),), dtype=torch.float32, device=p.device),
                torch.zeros((_QMAP_SIZE,), dtype=torch.float32, device=p.device),
            ]
        return torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ["exp_avg", "exp_avg_sq"] + ["max_exp_avg_sq"] * bool(group.get("amsgrad")):
            state[key] = self._buffer(p)

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        self.state[p]["step"] += 1  # weights and states are updated in place


def steps_compiled(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or its class) steps through ``torch.compile`` (torchao's AdamW
    family), which a dispatch mode cannot enter: the tracker steps it with its modes off."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return any(c.__module__.startswith(_TORCHAO_PREFIX) for c in cls.__mro__)


def _torchao_block_size(cls: type, options: dict[str, Any]) -> float:
    if "block_size" in options:
        return options["block_size"]
    param = inspect.signature(cls.__init__).parameters.get("block_size")
    return param.default if param is not None else float("inf")


# -- which optimizer runs in an estimate -----------------------------------------------------------
def _bnb_layout(cls: type) -> str | None:
    if not cls.__module__.startswith(_BNB_PREFIX):
        return None
    return _BNB_CLASSES.get(cls.__name__)


def needs_state_model(cls: type) -> bool:
    """True when ``cls`` reads tensor values in its step and so has an estimate-only model."""
    return (
        _bnb_layout(cls) is not None
        or issubclass(cls, torch.optim.Adafactor)
        or steps_compiled(cls)
    )


def state_model(
    cls: type[Optimizer],
    param_groups: Iterable[Any],
    *,
    keep_32bit: Iterable[torch.Tensor] = (),
    **options: Any,
) -> Optimizer | None:
    """The estimate-only model of ``cls`` over ``param_groups`` (``options`` as ``cls`` takes
    them), or ``None`` when ``cls`` runs on fake tensors itself."""
    layout = _bnb_layout(cls)
    if layout is not None:
        ctor = {k: options[k] for k in _MODEL_OPTIONS if k in options}
        return EightBitStateModel(param_groups, layout, keep_32bit=keep_32bit, **ctor)
    if issubclass(cls, torch.optim.Adafactor):
        return AdafactorStateModel(param_groups, **options)
    if steps_compiled(cls):
        block_size = _torchao_block_size(cls, options)
        return CompiledAdamStateModel(
            param_groups,
            block_size=block_size,
            **{
                k: v for k, v in options.items() if k not in ("block_size", "bf16_stochastic_round")
            },
        )
    return None


def _is_fake(param_groups: Iterable[dict[str, Any]]) -> bool:
    return any(isinstance(p, FakeTensor) for g in param_groups for p in g["params"])


def estimate_factory(
    cls: type[Optimizer], *, keep_32bit: Iterable[torch.Tensor] = (), **options: Any
) -> Callable[[list[dict]], Optimizer]:
    """``factory(param_groups)`` for the estimate: ``cls(param_groups, **options)``, or on fake
    tensors its :func:`state_model` when ``cls`` reads tensor values in its step."""
    keep = list(keep_32bit)

    def factory(param_groups: list[dict]) -> Optimizer:
        if _is_fake(param_groups) and needs_state_model(cls):
            model = state_model(cls, param_groups, keep_32bit=keep, **options)
            assert model is not None  # needs_state_model said so
            return model
        return cls(param_groups, **options)

    return factory


def running_estimate_factory(optimizer: Optimizer) -> Callable[[list[dict]], Optimizer]:
    """The estimate's ``factory(param_groups)`` for an optimizer a fit runs: its class with the
    options it was built with (the constructor arguments among its ``defaults``, and for
    bitsandbytes its 8-bit settings), modelled on fake tensors where the class needs it."""
    cls = type(optimizer)
    params = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in optimizer.defaults.items() if k in params}
    args = getattr(optimizer, "args", None)  # bitsandbytes keeps its 8-bit settings here
    if _bnb_layout(cls) is not None and args is not None:
        for key in ("min_8bit_size", "max_unorm"):
            if key in params and hasattr(args, key):
                options[key] = getattr(args, key)
    if not needs_state_model(cls):
        return lambda groups: cls(groups, **options)
    return estimate_factory(cls, **options)


# -- state bytes ---------------------------------------------------------------------------------
def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in the state of ``optimizer``. Lightning's and DeepSpeed's wrappers are seen
    through (``.optimizer``), and an optimizer that steps each parameter from its gradient hook
    (optimizer-in-backward) through its per-parameter optimizers (``.inner``)."""
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, (list, tuple)):
        return [t for opt in inner for t in optimizer_state_tensors(opt)]
    wrapped = getattr(optimizer, "optimizer", None)
    if wrapped is not None and wrapped is not optimizer and hasattr(wrapped, "state"):
        return optimizer_state_tensors(wrapped)
    leaves = tree_flatten(list(optimizer.state.values()))[0]
    return [t for leaf in leaves if isinstance(leaf, torch.Tensor) for t in _inner_tensors(leaf)]


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor subclass's data (torchao's 8-bit states: codes,
    scales, quantisation map), through ``__tensor_flatten__``; a plain tensor itself, and a
    DTensor (FSDP2) itself: its callers take this rank's shard (``to_local``)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or type(tensor) is torch.Tensor or isinstance(tensor, FakeTensor):
        return [tensor]
    if callable(getattr(tensor, "to_local", None)):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [t for n in names for t in _inner_tensors(getattr(tensor, n))]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in the state of ``optimizer`` (:func:`optimizer_state_tensors`; each
    storage counted once, so shared quantisation maps count once). The instrument's tracker is
    the measurement; this is the quick count."""
    seen, total = set(), 0
    for value in optimizer_state_tensors(optimizer):
        if callable(getattr(value, "to_local", None)):  # a DTensor (FSDP2): this rank's shard
            value = value.to_local()
        storage = value.untyped_storage()
        key = (storage.data_ptr(), value.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
