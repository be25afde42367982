"""Memory-lean optimizers for an unmodified LightningModule: 8-bit, paged, Adafactor, fused, and
optimizer-in-backward.

Pure functions (no Lightning needed), exported from :mod:`lightning_efficient.functional`:

- :func:`optimizer_class` / :func:`build_optimizer`: an optimizer by short name or class path.
- :func:`swap_optimizer`: a new optimizer of another kind over the same param groups.
- :func:`repoint_scheduler`: an LR scheduler now drives the new optimizer.
- :func:`attach_optimizer_in_backward`: step each parameter from its post-accumulate-grad hook
  and free its gradient at once.

:class:`OptimizerSwap` is the thin callback that decides *when*: in ``on_fit_start``, after
Lightning created the module's optimizers and before it restores their state on resume.

How hyperparameters carry over (per param group)
------------------------------------------------
Every key of an old param group is looked at once:

- a key the new optimizer's constructor accepts (``lr``, ``betas``, ``eps``, ``weight_decay``,
  ...) is carried with its per-group value;
- a key that is an option of the *old* optimizer only (``foreach``, ``fused``, ``capturable``,
  ...) is dropped (the callback lists the dropped ones once);
- any other key (``initial_lr`` written by LR schedulers, ``max_lr`` of OneCycleLR, user keys)
  is carried as is, so schedulers keep working.

``overrides`` then replace a key in *every* group. An ``lr`` override keeps the schedule: each
group's current ``lr`` is scaled by ``override / initial_lr`` and ``initial_lr`` becomes the
override, so the scheduler's factor at the current step is kept.

Adafactor (``torch.optim.Adafactor``) is different: its ``lr`` is a *relative* step size. The
update of a parameter is scaled by ``max(eps2, RMS(parameter)) * min(lr, 1/sqrt(step))``, not by
``lr`` alone, so an AdamW ``lr`` of 3e-3 becomes "at most 0.3% of the parameter's RMS per step".
The carried ``lr`` (and any schedule on it) still caps the relative step; Adafactor's own default
is ``lr=1e-2`` (pass ``lr=1e-2`` as an override to get it, the schedule is kept). Adafactor has
no ``betas`` (it uses ``beta2_decay``) and its ``eps`` is a pair ``(eps1, eps2)`` with another
meaning, so neither is carried; ``weight_decay`` is decoupled as in AdamW and carries.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import wraps
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, import_object, missing_extra

__all__ = [
    "NAMES",
    "EIGHT_BIT_NAMES",
    "optimizer_class",
    "accepted_options",
    "build_optimizer",
    "swap_optimizer",
    "repoint_scheduler",
    "embedding_parameters",
    "attach_optimizer_in_backward",
    "InBackwardOptimizer",
    "optimizer_state_bytes",
    "EightBitStateModel",
    "AdafactorStateModel",
    "OptimizerSwap",
]

#: Short names -> class paths. bitsandbytes ones are imported lazily.
NAMES: dict[str, str] = {
    "adamw8bit": "bitsandbytes.optim.AdamW8bit",
    "adam8bit": "bitsandbytes.optim.Adam8bit",
    "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit",
    "paged_adamw32bit": "bitsandbytes.optim.PagedAdamW32bit",
    "lion8bit": "bitsandbytes.optim.Lion8bit",
    "adafactor": "torch.optim.Adafactor",
    "adamw_fused": "torch.optim.AdamW",
}
#: Names whose states are 8-bit (and so take ``min_8bit_size`` and the embedding override).
EIGHT_BIT_NAMES = ("adamw8bit", "adam8bit", "paged_adamw8bit", "lion8bit")
_DEFAULT_MIN_8BIT_SIZE = 4096
_BNB_PREFIX = "bitsandbytes."
#: constructor arguments that are not param-group keys (bitsandbytes' 8-bit options)
_CTOR_ONLY = frozenset(
    {"min_8bit_size", "optim_bits", "args", "is_paged", "percentile_clipping", "block_wise"}
)


# -- which optimizer ------------------------------------------------------------------------
def optimizer_class(name: str, *, argument: str = "name") -> type[Optimizer]:
    """The optimizer class for a short name (see :data:`NAMES`) or a class path.

    An unknown name raises a ``ValueError`` that lists the valid names; a bitsandbytes name
    without bitsandbytes installed raises the ImportError with the pip extra to install.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"`{argument}` must be an optimizer name or class path (str); got {name!r} ({type(name).__name__})."
        )
    path = NAMES.get(name)
    if path is None and "." not in name:
        raise ValueError(
            f"`{argument}` must be one of {', '.join(repr(n) for n in NAMES)} or the class path of "
            f"a torch.optim.Optimizer (e.g. 'torch.optim.SGD'); got {name!r}."
        )
    path = path or name
    if path.startswith(_BNB_PREFIX):
        try:
            import bitsandbytes.optim  # noqa: F401
        except ImportError as err:
            raise missing_extra("bitsandbytes", "bnb", f"The optimizer {name!r}") from err
    cls = import_object(argument, path)
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"`{argument}`: {path!r} is not a torch.optim.Optimizer subclass; got {cls!r}."
        )
    return cls


def accepted_options(cls: type[Optimizer]) -> set[str] | None:
    """Constructor arguments of an optimizer class other than ``params`` (None: takes **kwargs)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        n
        for n, p in params.items()
        if n not in ("self", "params") and p.kind is not inspect.Parameter.VAR_POSITIONAL
    }


def _check_overrides(
    name: str, cls: type[Optimizer], overrides: dict[str, Any], argument: str = "overrides"
) -> None:
    if "params" in overrides:
        raise ValueError(
            f"`{argument}` cannot set 'params': the parameters come from the module's optimizer."
        )
    accepted = accepted_options(cls)
    if accepted is None:
        return
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise ValueError(
            f"`{argument}`: {', '.join(repr(k) for k in unknown)} not accepted by {name!r} "
            f"({cls.__module__}.{cls.__qualname__}); it accepts: {', '.join(sorted(accepted))}."
        )


# -- building -------------------------------------------------------------------------------
def _signature_defaults(cls: type | None) -> dict[str, Any]:
    if cls is None:
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _carry_group(
    group: dict[str, Any],
    name: str,
    target: type[Optimizer],
    source: type | None,
    source_options: set[str],
) -> tuple[dict[str, Any], set[str]]:
    """Split one param group into the options carried to ``target`` and the names of dropped
    options that were set away from ``source``'s default (those are worth a note)."""
    accepted = accepted_options(target)
    defaults = _signature_defaults(source)
    carried, dropped = {}, set()
    for key, value in group.items():
        if key == "params":
            continue
        if (
            target is torch.optim.Adafactor
            and source is not torch.optim.Adafactor
            and key in ("eps", "betas")
        ):
            dropped.add(key)  # Adafactor's eps is (eps1, eps2) with another meaning; no betas
        elif name == "adamw_fused" and key in ("fused", "foreach"):
            pass  # set from the device
        elif accepted is None or key in accepted:
            carried[key] = value
        elif key in source_options:
            if key in defaults and defaults[key] != value:
                dropped.add(key)
        else:
            carried[key] = value
    return carried, dropped


def _apply_overrides(group: dict[str, Any], overrides: dict[str, Any], ctor_only: set[str]) -> None:
    for key, value in overrides.items():
        if key in ctor_only:
            continue
        if key == "lr" and "initial_lr" in group and group["initial_lr"]:
            group["lr"] = value * (group.get("lr", group["initial_lr"]) / group["initial_lr"])
            group["initial_lr"] = value
        else:
            group[key] = value


def _build(
    name: str,
    param_groups: Sequence[dict[str, Any]],
    *,
    source: Optimizer | None = None,
    keep_32bit: Iterable[torch.Tensor] = (),
    overrides: dict[str, Any] | None = None,
) -> tuple[Optimizer, set[str]]:
    overrides = dict(overrides or {})
    cls = optimizer_class(name)
    _check_overrides(name, cls, overrides)
    source_cls = type(source) if source is not None else None
    source_options = set(source.defaults) if source is not None else set()
    if source_cls is not None:
        source_options |= accepted_options(source_cls) or set()
    groups, dropped = [], set()
    for group in param_groups:
        carried, gone = _carry_group(group, name, cls, source_cls, source_options)
        dropped |= gone
        carried["params"] = list(group["params"])
        groups.append(carried)
    ctor: dict[str, Any] = {}
    accepted = accepted_options(cls) or set()
    # options that are constructor arguments but not param-group keys (bitsandbytes' 8-bit args)
    ctor_only = _CTOR_ONLY & accepted
    if name in EIGHT_BIT_NAMES:
        ctor["min_8bit_size"] = overrides.get("min_8bit_size", _DEFAULT_MIN_8BIT_SIZE)
    for key in ctor_only & set(overrides):
        ctor[key] = overrides[key]
    if name == "adamw_fused":
        on_cuda = all(p.is_cuda for g in groups for p in g["params"])
        ctor["fused" if on_cuda else "foreach"] = True
    for group in groups:
        _apply_overrides(group, overrides, ctor_only)
    optimizer = cls(groups, **ctor)
    keep = list(keep_32bit)
    if keep and name in EIGHT_BIT_NAMES:
        _keep_32bit_states(optimizer, keep)
    return optimizer, dropped


def build_optimizer(
    name: str,
    param_groups: Iterable[Any],
    *,
    keep_32bit: Iterable[torch.Tensor] = (),
    **overrides: Any,
) -> Optimizer:
    """Build the optimizer ``name`` (a short name of :data:`NAMES` or a class path) over
    ``param_groups`` (dicts with ``"params"`` and per-group options, or plain tensors).

    Group keys the optimizer accepts are kept per group; ``overrides`` replace a key in every
    group (see the module docstring for ``lr``). For 8-bit names, tensors with fewer than
    ``min_8bit_size`` (default 4096) elements and the tensors in ``keep_32bit`` (e.g.
    :func:`embedding_parameters`) keep 32-bit states.
    """
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return _build(name, groups, keep_32bit=keep_32bit, overrides=overrides)[0]


def swap_optimizer(
    old: Optimizer, name: str, *, keep_32bit: Iterable[torch.Tensor] = (), **overrides: Any
) -> Optimizer:
    """A new optimizer ``name`` over the param groups of ``old``: same parameters, per-group
    ``lr``/``weight_decay``/options carried as the module docstring says. ``old`` is not changed;
    its state (moments) is not converted."""
    return _build(name, old.param_groups, source=old, keep_32bit=keep_32bit, overrides=overrides)[0]


def _keep_32bit_states(optimizer: Optimizer, params: Sequence[torch.Tensor]) -> None:
    """bitsandbytes' GlobalOptimManager override (``optim_bits=32``) for ``params``, scoped to
    this optimizer: a private manager instance instead of the process-wide singleton, so that no
    config leaks into other optimizers through reused ``id()``s."""
    from bitsandbytes.optim import GlobalOptimManager

    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    chosen = [p for p in params if id(p) in mine]
    if not chosen:
        return
    manager = GlobalOptimManager.__new__(GlobalOptimManager)
    manager.initialize()
    manager.override_config(chosen, key_value_dict={"optim_bits": 32})
    optimizer.mng = manager


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights of every ``nn.Embedding`` (and ``nn.EmbeddingBag``) of ``model``: the tensors
    whose 8-bit states hurt stability most (rare tokens get large, sparse updates)."""
    seen: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            seen[id(module.weight)] = module.weight
    return list(seen.values())


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (each storage counted once; shared quantisation
    maps once). The instrument's tracker is the measurement; this is the quick count."""
    seen, total = set(), 0
    states = [optimizer.state]
    if isinstance(optimizer, InBackwardOptimizer):
        states = [o.state for o in optimizer.inner]
    for state in states:
        for per_param in state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    key = (value.untyped_storage().data_ptr(), value.device)
                    if key not in seen:
                        seen.add(key)
                        total += value.untyped_storage().nbytes()
    return total


# -- bitsandbytes' state layout, for estimates on fake tensors --------------------------------
#: bitsandbytes names -> (number of states, optim_bits, update rule)
_BNB_LAYOUT: dict[str, tuple[int, int, str]] = {
    "adamw8bit": (2, 8, "adam"),
    "adam8bit": (2, 8, "adam"),
    "paged_adamw8bit": (2, 8, "adam"),
    "paged_adamw32bit": (2, 32, "adam"),
    "lion8bit": (1, 8, "lion"),
}
_BNB_BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizers: one fp32 absmax per 256 elements
_QMAP_SIZE = 256  # a quantisation map: 256 fp32 code values


class EightBitStateModel(Optimizer):
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
        name: A bitsandbytes short name of :data:`NAMES` (``"adamw8bit"``, ``"adam8bit"``,
            ``"paged_adamw8bit"``, ``"paged_adamw32bit"``, ``"lion8bit"``).
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
        min_8bit_size: int = _DEFAULT_MIN_8BIT_SIZE,
        keep_32bit: Iterable[torch.Tensor] = (),
        optim_bits: int | None = None,
        max_unorm: float = 0.0,
        cpu_temporaries: bool = True,
        **defaults: Any,
    ) -> None:
        if name not in _BNB_LAYOUT:
            raise ValueError(
                f"`name` must be one of {', '.join(map(repr, _BNB_LAYOUT))}; got {name!r}."
            )
        super().__init__(
            params,
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **defaults},
        )
        n_states, bits, rule = _BNB_LAYOUT[name]
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

    def _init_state(self, p: torch.Tensor) -> None:
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                self._update(group, p)
        return loss

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
    Adafactor's own ``_init_group`` (``step``; factored ``row_var`` / ``col_var`` for tensors of
    2 or more dims, a full ``variance`` otherwise) and its step allocates what the single-tensor
    step (torch's choice off CUDA) allocates, but the two scalars Adafactor reads with ``.item()``
    (the parameter's and the update's RMS) stay tensors. Not for training (the step count is
    kept in Python). Args as ``torch.optim.Adafactor``.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        counts = self.__dict__.setdefault("_counts", {})
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            rows: list[Any] = []
            cols: list[Any] = []
            variances: list[Any] = []
            steps: list[torch.Tensor] = []
            self._init_group(group, params, grads, rows, cols, variances, steps)
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


def _estimate_factory(
    name: str, keep: Sequence[torch.Tensor], overrides: dict[str, Any]
) -> Callable[[list[dict]], Optimizer]:
    """``factory(groups)`` for the estimate plan: on fake tensors, the bitsandbytes names build an
    :class:`EightBitStateModel` (bitsandbytes reads values); on real tensors, the real optimizer."""
    from torch._subclasses.fake_tensor import FakeTensor

    def factory(groups: list[dict]) -> Optimizer:
        fake = any(isinstance(p, FakeTensor) for g in groups for p in g["params"])
        if fake and name == "adafactor":
            carried = build_optimizer(
                name, groups, **overrides
            ).param_groups  # as the fit carries them
            return AdafactorStateModel(carried)
        if not (fake and name in _BNB_LAYOUT):
            return build_optimizer(name, groups, keep_32bit=keep, **overrides)
        cls = optimizer_class(name)
        carried = []
        for group in groups:
            c, _ = _carry_group(group, name, cls, None, set())
            _apply_overrides(c, overrides, set(_CTOR_ONLY) | {"max_unorm", "skip_zeros"})
            c["params"] = list(group["params"])
            carried.append(c)
        ctor = {
            k: overrides[k] for k in ("min_8bit_size", "optim_bits", "max_unorm") if k in overrides
        }
        return EightBitStateModel(
            carried, name, keep_32bit=keep if name in EIGHT_BIT_NAMES else (), **ctor
        )

    return factory


# -- schedulers -----------------------------------------------------------------------------
def _patch_step_for_scheduler(optimizer: Optimizer) -> None:
    """Wrap ``optimizer.step`` as ``torch.optim.lr_scheduler.LRScheduler.__init__`` does, so the
    scheduler sees ``optimizer.step()`` called before ``lr_scheduler.step()``."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def repoint_scheduler(scheduler: Any, new_optimizer: Optimizer) -> Any:
    """Make ``scheduler`` drive ``new_optimizer`` (which has the same param groups, in order).

    Works for ``LRScheduler`` subclasses, ``ReduceLROnPlateau`` and the composite
    ``SequentialLR``/``ChainedScheduler``; ``base_lrs`` are re-read from the groups'
    ``initial_lr`` (so an ``lr`` override moves the whole schedule). Returns ``scheduler``.
    """
    old = getattr(scheduler, "optimizer", None)
    if old is not None and len(old.param_groups) != len(new_optimizer.param_groups):
        raise ValueError(
            f"repoint_scheduler: the new optimizer has {len(new_optimizer.param_groups)} param "
            f"groups, the scheduler's has {len(old.param_groups)}; they must match."
        )
    for inner in getattr(scheduler, "_schedulers", ()):
        repoint_scheduler(inner, new_optimizer)
    scheduler.optimizer = new_optimizer
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in new_optimizer.param_groups]
    _patch_step_for_scheduler(new_optimizer)
    if old is not None and getattr(old, "_opt_called", False):
        new_optimizer._opt_called = True  # type: ignore[attr-defined]
    return scheduler


# -- optimizer in backward ------------------------------------------------------------------
class InBackwardOptimizer(Optimizer):
    """The optimizer Lightning (and LR schedulers) see when each parameter is stepped from its
    post-accumulate-grad hook. ``step(closure)`` only runs the closure (forward + backward): the
    hooks do the per-parameter steps. Its param groups are the real ones: an LR scheduler writes
    ``lr`` here, and every hook copies the group's options into the parameter's own optimizer
    before stepping. ``state_dict`` holds every per-parameter optimizer's state.

    Args:
        param_groups: the groups (dicts with ``params``) the hyperparameters live in.
        factory: builds the optimizer of one parameter from ``[{**group_options, "params": [p]}]``.
    """

    def __init__(
        self, param_groups: Sequence[dict[str, Any]], factory: Callable[[list[dict]], Optimizer]
    ) -> None:
        super().__init__([dict(g) for g in param_groups], {})
        # parameter -> (its optimizer, the index of its group); by index, because
        # load_state_dict replaces the group dicts
        self._inner: dict[int, tuple[Optimizer, int]] = {}
        for index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self._inner[id(p)] = (factory([{**options, "params": [p]}]), index)
        self._handles: list[Any] = []

    @property
    def inner(self) -> list[Optimizer]:
        return [opt for opt, _ in self._inner.values()]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def attach(self) -> InBackwardOptimizer:
        self.detach()
        for p in self._params():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        opt, index = self._inner[id(p)]
        group, inner_group = self.param_groups[index], opt.param_groups[0]
        for key, value in group.items():
            if key != "params":
                inner_group[key] = value
        opt.step()
        p.grad = None

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["per_parameter"] = [self._inner[id(p)][0].state_dict() for p in self._params()]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        per_parameter = state_dict.pop("per_parameter", None)
        params = self._params()
        if per_parameter is None or len(per_parameter) != len(params):
            raise ValueError(
                "InBackwardOptimizer.load_state_dict: the state was not written by an "
                "optimizer-in-backward run with the same parameters."
            )
        super().load_state_dict(state_dict)
        for p, state in zip(params, per_parameter):
            self._inner[id(p)][0].load_state_dict(state)


def attach_optimizer_in_backward(
    model: nn.Module,
    optimizer_factory: Callable[[list[dict]], Optimizer],
    param_groups: Sequence[dict[str, Any]] | None = None,
) -> InBackwardOptimizer:
    """Step every parameter of ``model`` from its post-accumulate-grad hook and free its gradient
    at once, so gradients never all live at the same time.

    ``optimizer_factory(groups)`` builds one parameter's optimizer (e.g.
    ``lambda g: build_optimizer("adamw8bit", g)``). ``param_groups`` (default: one group with
    every trainable parameter) carry the per-group options. Returns the
    :class:`InBackwardOptimizer` to hand to Lightning / LR schedulers; ``.detach()`` removes the
    hooks. Gradients are never accumulated over micro-batches and cannot be clipped as a whole.
    """
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return InBackwardOptimizer(param_groups, optimizer_factory).attach()


# -- the callback ---------------------------------------------------------------------------
def _class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class OptimizerSwap(Technique):
    """Replace the optimizers that the module's ``configure_optimizers`` created by a memory-lean
    one, keeping param groups (per-group lr, weight decay, options), LR schedulers (with their
    interval, frequency and monitor) and multiple optimizers.

    Args:
        name: ``"adamw8bit"``, ``"adam8bit"``, ``"paged_adamw8bit"``, ``"paged_adamw32bit"``,
            ``"lion8bit"`` (bitsandbytes), ``"adafactor"`` (``torch.optim.Adafactor``),
            ``"adamw_fused"`` (fused AdamW on CUDA, foreach AdamW on CPU), or the class path of
            any ``torch.optim.Optimizer``.
        overrides: Constructor arguments of the new optimizer that replace the carried values in
            every group (e.g. ``{"lr": 1e-2}``, ``{"min_8bit_size": 16384}``). From yaml, give them
            here; from Python they may also be passed as keyword arguments.
        optimizer_in_backward: Step each parameter from its post-accumulate-grad hook and free its
            gradient at once (no full set of gradients in memory). Refused with gradient
            accumulation, gradient clipping, 16-mixed precision and multi-process training.
        embeddings_32bit: For 8-bit names, keep 32-bit states for ``nn.Embedding`` weights
            (bitsandbytes' GlobalOptimManager override). Tensors under ``min_8bit_size``
            (default 4096 elements) keep 32-bit states anyway.
        on_mismatch: What to do when resuming from a checkpoint whose optimizer state was written
            by another optimizer: ``"error"`` (default: stop with the choices) or ``"reset"``
            (start the new optimizer's state afresh; the learning rates are kept).
        **kwargs: More ``overrides``.

    Checkpoints: the swapped optimizer's state is stored in this callback's checkpoint entry and
    restored exactly on resume with the same swap. The checkpoint's ``optimizer_states`` holds a
    state the module's own optimizer can load (same learning rates, fresh moments), so the
    checkpoint also resumes without this callback.
    """

    swaps_optimizer = True

    @property
    def steps_in_backward(self) -> bool:  # read by the compatibility rules
        return self.optimizer_in_backward

    def __init__(
        self,
        name: str,
        overrides: dict[str, Any] | None = None,
        optimizer_in_backward: bool = False,
        embeddings_32bit: bool = True,
        on_mismatch: str = "error",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if overrides is not None and not isinstance(overrides, dict):
            raise TypeError(
                f"`overrides` must be a dict of optimizer arguments or None; got {overrides!r} ({type(overrides).__name__})."
            )
        both = sorted(set(overrides or {}) & set(kwargs))
        if both:
            raise ValueError(
                f"`overrides`: {both} given both in `overrides` and as keyword arguments."
            )
        merged = {**(overrides or {}), **kwargs}
        cls = optimizer_class(name)
        _check_overrides(name, cls, merged)
        self.optimizer_name = name
        self.overrides = merged
        self.optimizer_in_backward = check_bool("optimizer_in_backward", optimizer_in_backward)
        self.embeddings_32bit = check_bool("embeddings_32bit", embeddings_32bit)
        self.on_mismatch = check_choice("on_mismatch", on_mismatch, ("error", "reset"))
        self._originals: list[Optimizer] = []
        self._swapped: list[Optimizer] = []
        self._loaded_checkpoint: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None

    # -- the pure part, bound to this configuration --------------------------------------
    def _keep_32bit(self, model: nn.Module) -> list[nn.Parameter]:
        if self.embeddings_32bit and self.optimizer_name in EIGHT_BIT_NAMES:
            return embedding_parameters(model)
        return []

    def _swap(self, old: Optimizer, model: nn.Module) -> tuple[Optimizer, set[str]]:
        keep = self._keep_32bit(model)
        if not self.optimizer_in_backward:
            return _build(
                self.optimizer_name,
                old.param_groups,
                source=old,
                keep_32bit=keep,
                overrides=self.overrides,
            )
        cls = optimizer_class(self.optimizer_name)
        ctor_only = _CTOR_ONLY & (accepted_options(cls) or set())
        dropped: set[str] = set()
        groups = []
        for group in old.param_groups:
            carried, gone = _carry_group(
                group,
                self.optimizer_name,
                cls,
                type(old),
                set(old.defaults) | (accepted_options(type(old)) or set()),
            )
            dropped |= gone
            _apply_overrides(carried, self.overrides, ctor_only)
            carried["params"] = list(group["params"])
            groups.append(carried)
        # group options are in the groups now; the per-parameter optimizers get the rest
        ctor_overrides = {k: v for k, v in self.overrides.items() if k in ctor_only}
        factory = lambda g: _build(
            self.optimizer_name, g, keep_32bit=keep, overrides=ctor_overrides
        )[0]  # noqa: E731
        return attach_optimizer_in_backward(model, factory, groups), dropped

    def configure_estimate(self, plan: Any) -> None:
        """Swap the estimate's optimizer and switch optimizer-in-backward like the fit would."""
        keep = self._keep_32bit(plan.model)
        name, overrides = self.optimizer_name, dict(self.overrides)
        # on fake tensors, bitsandbytes' optimizers are modelled (they read values): same states
        plan.optimizer = _estimate_factory(name, keep, overrides)
        plan.optimizer_in_backward = self.optimizer_in_backward
        plan.note(
            f"{self.name}: optimizer {name!r}"
            + (", stepped in backward" if self.optimizer_in_backward else "")
        )

    # -- when -----------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        old = list(trainer.optimizers)
        if not old:
            self.no_effect("the module configured no optimizer; nothing to swap.")
            return
        new, dropped = [], set()
        for opt in old:
            swapped, gone = self._swap(opt, pl_module)
            new.append(swapped)
            dropped |= gone
        by_id = {id(o): n for o, n in zip(old, new)}
        for config in trainer.lr_scheduler_configs:
            target = by_id.get(id(getattr(config.scheduler, "optimizer", None)))
            if target is not None:
                repoint_scheduler(config.scheduler, target)
        trainer.optimizers = new
        self._originals, self._swapped = old, new
        self._prepare_restore()
        if self.optimizer_name == "adamw_fused" and not all(
            p.is_cuda for o in new for g in o.param_groups for p in g["params"]
        ):
            self.note(
                "'adamw_fused': parameters are not on CUDA, so AdamW runs with foreach=True (same maths) instead of fused."
            )
        if dropped:
            self.note(
                f"options of the old optimizer that {self.optimizer_name!r} does not take were dropped: {', '.join(sorted(dropped))}."
            )
        self.report(trainer, _change(self), optimizers=len(new))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # a restored param group replaces ours as a whole; keep the device-dependent flags
        if self.optimizer_name == "adamw_fused":
            for opt in self._swapped:
                for group in opt.param_groups:
                    on_cuda = all(p.is_cuda for p in group["params"])
                    group["fused"], group["foreach"] = (True, None) if on_cuda else (None, True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._swapped:
            self.report(
                trainer,
                _change(self),
                optimizers=len(self._swapped),
                optimizer_state_bytes=sum(optimizer_state_bytes(o) for o in self._swapped),
            )
        super().on_fit_end(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for opt in self._swapped:
            if isinstance(opt, InBackwardOptimizer):
                opt.detach()
        self._loaded_checkpoint = None

    # -- checkpoints ----------------------------------------------------------------------
    def _classes(self) -> list[str]:
        return [
            _class_path(o.inner[0] if isinstance(o, InBackwardOptimizer) and o.inner else o)
            for o in self._swapped
        ]

    def state_dict(self) -> dict[str, Any]:
        if not self._swapped:
            return {}
        return {
            "name": self.optimizer_name,
            "classes": self._classes(),
            "optimizer_in_backward": self.optimizer_in_backward,
            "optimizer_states": [o.state_dict() for o in self._swapped],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # the same dict Lightning restores the optimizers from after on_fit_start
        self._loaded_checkpoint = checkpoint

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("optimizer_states")
        if not states or not self._swapped:
            return
        for i, (orig, new) in enumerate(zip(self._originals, self._swapped)):
            if self._native_compatible(orig, new):
                continue
            # what the module's own optimizer can load: its groups at today's lr, no moments
            portable = orig.state_dict()
            for g_orig, g_new in zip(portable["param_groups"], new.param_groups):
                for key in ("lr", "initial_lr"):
                    if key in g_new:
                        g_orig[key] = g_new[key]
            portable["state"] = {}
            states[i] = portable

    def _native_compatible(self, orig: Optimizer, new: Optimizer) -> bool:
        return type(orig) is type(new)

    def _prepare_restore(self) -> None:
        ckpt, restored = self._loaded_checkpoint, self._restored
        self._loaded_checkpoint = self._restored = None
        if ckpt is None or not ckpt.get("optimizer_states"):
            return
        here = self._classes()
        if restored and restored.get("optimizer_states") is not None:
            same = (
                restored.get("classes") == here
                and bool(restored.get("optimizer_in_backward")) == self.optimizer_in_backward
            )
            if same and len(restored["optimizer_states"]) == len(self._swapped):
                ckpt["optimizer_states"] = list(restored["optimizer_states"])
                return
            written = f"OptimizerSwap({restored.get('name')!r}" + (
                ", optimizer_in_backward=True)" if restored.get("optimizer_in_backward") else ")"
            )
            self._mismatch(
                ckpt,
                f"by {written} ({', '.join(restored.get('classes') or [])})",
                restored.get("name"),
            )
            return
        if all(self._native_compatible(o, n) for o, n in zip(self._originals, self._swapped)):
            return  # the module's own optimizer class: its state loads as is
        written = ", ".join(sorted({_class_path(o) for o in self._originals}))
        self._mismatch(
            ckpt, f"by the module's own optimizer ({written}), without OptimizerSwap", None
        )

    def _mismatch(self, ckpt: dict[str, Any], written: str, written_name: str | None) -> None:
        current = f"OptimizerSwap({self.optimizer_name!r}" + (
            ", optimizer_in_backward=True)" if self.optimizer_in_backward else ")"
        )
        if self.on_mismatch == "reset":
            fresh = []
            for saved, new in zip(ckpt["optimizer_states"], self._swapped):
                sd = new.state_dict()
                sd = {**sd, "state": {}}
                if isinstance(new, InBackwardOptimizer):
                    sd["per_parameter"] = [{**s, "state": {}} for s in sd["per_parameter"]]
                for g_new, g_saved in zip(sd["param_groups"], saved.get("param_groups", [])):
                    for key in ("lr", "initial_lr"):
                        if key in g_saved:
                            g_new[key] = g_saved[key]
                fresh.append(sd)
            ckpt["optimizer_states"] = fresh
            self.warn(
                f"the checkpoint's optimizer state was written {written}; {current} starts its state afresh (on_mismatch='reset'), keeping the learning rates."
            )
            return
        swap_back = (
            f"OptimizerSwap({written_name!r})"
            if written_name
            else "no OptimizerSwap (or one whose optimizer is that class)"
        )
        raise ValueError(
            f"Cannot resume the optimizer: the checkpoint's optimizer state was written {written}, "
            f"but this run uses {current}; the states are not interchangeable (loading one into the "
            "other fails, e.g. bitsandbytes' KeyError: 'state1'). Choose one:\n"
            f"  - reset the optimizer state: OptimizerSwap({self.optimizer_name!r}, on_mismatch='reset') "
            "(model, loops and LR schedule resume; the optimizer's moments start afresh), or\n"
            f"  - swap to the matching optimizer: resume with {swap_back}."
        )


def _change(swap: OptimizerSwap) -> str:
    olds = ", ".join(sorted({type(o).__name__ for o in swap._originals}))
    return f"{olds} -> {swap.optimizer_name}" + (
        " (stepped in backward)" if swap.optimizer_in_backward else ""
    )
