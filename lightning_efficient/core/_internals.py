"""The one module that touches private names of torch, Lightning, DeepSpeed and jsonargparse.

Every use is a small named function (or a name imported once, here) so that a release that moves
one breaks in one place, loudly: ``tests/core/test_internals.py`` calls each of them against the
installed versions. ``TESTED`` states the ranges the project is tested with (setup.cfg pins the
same); outside them a use that fails raises ``InternalsError`` naming the private name, the
installed version and the tested range, instead of a bare ``AttributeError``.

No other module of the package may import a ``_``-prefixed module or read a ``_``-prefixed
attribute of these libraries (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "TESTED",
    "dispatch_modes_off",
    "foreach_mul_",
    "FakeTensor",
    "FakeTensorMode",
    "InternalsError",
    "TorchDispatchMode",
    "compile_callbacks",
    "compiled_call",
    "cpu_supports_bf16",
    "kernel_overrides",
    "ops_with_kernel",
    "without_cpu_autocast",
    "dynamo_backends",
    "fake_tensor_errors",
    "hf_mask_functions",
    "hf_mask_function_sites",
    "guard_failure_reasons",
    "inductor_modes",
    "is_dynamo_error",
    "kept_iterator",
    "make_wrapper_tensor",
    "TENSOR_BASE_GETTER",
    "module_tensor_slots",
    "set_compiled_call",
    "install_compiled_call",
    "has_own_compiled_call",
    "graph_break_counts",
    "graph_break_sites",
    "set_option_type",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "DEEPSPEED_STRATEGY_HOOKS",
    "DeepSpeedStrategyHooks",
    "check_deepspeed_strategy_hooks",
    "link_zero_optimizer_states",
    "torch_extension_dir",
    "set_model_parallel_sizes",
    "fsdp_sharded",
    "class_before_fsdp",
    "fit_loader_source",
]

#: Versions the package is tested with: (lowest, highest) release, inclusive by minor version.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.4", "2.13"),
    "lightning": ("2.4", "2.6"),
    "deepspeed": ("0.14", "0.19"),
    "jsonargparse": ("4.27", "4.53"),
}


class InternalsError(RuntimeError):
    """A private name this package relies on is missing from the installed library."""


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _moved(package: str, name: str) -> InternalsError:
    low, high = TESTED.get(package, ("?", "?"))
    return InternalsError(
        f"lightning-efficient needs `{name}` from {package}, which the installed {package} "
        f"{installed_version(package)} does not have; the package is tested with {package} "
        f"{low} to {high}.x. Install a tested version, or report the new release."
    )


# --- torch: fake tensors, dispatch modes, pytrees ---------------------------------------------
try:
    from torch._subclasses import fake_tensor as _fake_tensor
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
except ImportError as err:  # pragma: no cover - depends on the torch release
    raise _moved("torch", "torch._subclasses.fake_tensor / torch.utils._pytree") from err


def dispatch_modes_off() -> Any:
    """A context in which no ``TorchDispatchMode`` is active (``torch.compile`` refuses to run
    under one): the storage tracker steps a compiled optimizer inside it."""
    return _disable_current_modes()


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply ``tensors`` (one device and dtype) by the 0-dim ``factor`` in place, in one
    ``torch._foreach_mul_`` (no synchronisation)."""
    torch._foreach_mul_(tensors, factor)


def fake_tensor_errors() -> tuple[type[BaseException], ...]:
    """The exceptions torch raises when a model needs real values under fake tensors."""
    names = (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
    )
    errors = tuple(getattr(_fake_tensor, n) for n in names if hasattr(_fake_tensor, n))
    with contextlib.suppress(ImportError):
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors += (GuardOnDataDependentSymNode,)
    return errors


def module_tensor_slots(module: nn.Module) -> Iterator[tuple[dict[str, Any], bool]]:
    """The module's own parameter and buffer dicts, as ``(dict, is_parameter)``: writing to
    them swaps a tensor in place without ``register_*``'s checks (used to fake a model)."""
    yield module._parameters, True
    yield module._buffers, False


# --- torch: the dispatcher (the estimate's model of CUDA kernels on a CPU) ----------------------
def ops_with_kernel(dispatch_key: str) -> list[str]:
    """Names (``"aten::pow.Tensor_Scalar"``) of the operators with a kernel registered for
    ``dispatch_key`` in this process; e.g. ``"AutocastCUDA"``: the ops CUDA autocast casts (a
    CPU build registers them too)."""
    C = torch._C
    return sorted(
        name
        for name in C._dispatch_get_all_op_names()
        if C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    )


@contextlib.contextmanager
def kernel_overrides() -> Iterator[Any]:
    """A ``torch.library.Library("aten", "IMPL")``: kernels registered on it replace the
    registered ones while inside (torch warns once per replaced kernel; silenced); on exit they
    are removed and the originals serve again."""
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*[Oo]verrid")
            yield lib
    finally:
        if not hasattr(lib, "_destroy"):  # pragma: no cover - depends on torch
            raise _moved("torch", "torch.library.Library._destroy")
        lib._destroy()


def without_cpu_autocast() -> Any:
    """A context in which CPU autocast does not apply: what an autocast kernel runs its op in
    (the ``AutocastCPU`` dispatch key excluded), so casts made before it stay as made."""
    C = torch._C
    return C._ExcludeDispatchKeyGuard(C.DispatchKeySet(C.DispatchKey.AutocastCPU))


#: The getter of ``Tensor._base`` (the tensor a view was made from): what a ``__torch_function__``
#: subclass sees when code asks whether a tensor is a view (FSDP2 asks it of a module's outputs).
TENSOR_BASE_GETTER = torch.Tensor._base.__get__  # type: ignore[attr-defined]


def make_wrapper_tensor(
    cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: Any, *, requires_grad: bool
) -> Any:
    """An instance of the tensor subclass ``cls`` with this shape, dtype and device and no data
    (``torch.Tensor._make_wrapper_subclass``): what a subclass that computes its values only on
    demand (``__torch_function__``) is made of."""
    make = getattr(torch.Tensor, "_make_wrapper_subclass", None)
    if make is None:  # pragma: no cover - depends on torch
        raise _moved("torch", "torch.Tensor._make_wrapper_subclass")
    return make(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)


# --- torch: Dynamo and Inductor ----------------------------------------------------------------
def dynamo_backends() -> list[str]:
    """Every Dynamo backend name registered in this process."""
    import torch._dynamo

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def inductor_modes() -> list[str]:
    """Inductor's compile modes (``mode=`` of ``torch.compile``)."""
    import torch._inductor

    return list(torch._inductor.list_mode_options())


def is_dynamo_error(err: BaseException) -> bool:
    """True for errors raised by Dynamo while compiling."""
    import torch._dynamo.exc as exc

    return isinstance(err, exc.TorchDynamoException)


def compiled_call(module: nn.Module) -> Any:
    """What ``module.compile()`` installed (``None``: the module runs eagerly)."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: nn.Module, call: Any) -> None:
    """Replace (or, with ``None``, remove) what ``module.compile()`` installed, in place."""
    if not hasattr(module, "_compiled_call_impl"):  # pragma: no cover - depends on torch
        raise _moved("torch", "nn.Module._compiled_call_impl")
    module._compiled_call_impl = call


def install_compiled_call(module: nn.Module, call: Any, what: str = "compiled call") -> Any:
    """Install ``call`` as what ``module`` runs (as ``module.compile()`` does) and return the
    ``Change`` whose ``undo()`` puts back exactly what the instance had: its own compiled call,
    or none (the attribute absent again, so the class's default shows)."""
    from lightning_efficient.core.change import patch_attribute

    if not hasattr(module, "_compiled_call_impl"):  # pragma: no cover - depends on torch
        raise _moved("torch", "nn.Module._compiled_call_impl")
    return patch_attribute(module, "_compiled_call_impl", call, what)


def has_own_compiled_call(module: nn.Module) -> bool:
    """True when ``module`` itself holds a compiled-call attribute (``None`` included)."""
    return "_compiled_call_impl" in vars(module)


def graph_break_counts() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process: reason -> count."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def graph_break_sites() -> dict[str, int]:
    """Where Dynamo resumed after a graph break so far: ``"forward at line 7"`` -> count."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for key, n in counters["resumes"].items():
        body = str(key).removeprefix("torch_dynamo_resume_in_")
        fn, _, line = body.rpartition("_at_")
        site = f"{fn} at line {line}" if fn and line.isdigit() else body
        out[site] = out.get(site, 0) + int(n)
    return out


def compile_callbacks() -> Any:
    """Dynamo's compile-start/end callback registry (``register_start_callback``, ...)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError as err:  # pragma: no cover - depends on torch
        raise _moved("torch", "torch._dynamo.callback.callback_handler") from err
    return callback_handler


def guard_failure_reasons(limit: int = 3) -> list[str]:
    """The latest guard failures Dynamo recorded (why it recompiled), newest last."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - older/newer torch
        return []
    reasons = [str(r) for failures in guard_failures.values() for r in failures]
    return reasons[-limit:]


# --- torch: CPU features -----------------------------------------------------------------------
def cpu_supports_bf16() -> bool:
    """True when oneDNN has fast bf16 kernels on this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


# --- jsonargparse -----------------------------------------------------------------------------
def set_option_type(parser: Any, option: str, typehint: Any, help: str | None = None) -> bool:
    """Widen the type an option of a jsonargparse parser accepts (e.g. ``--trainer.precision``
    also takes ``"auto"``). Returns False when the parser has no such option."""
    action = parser._option_string_actions.get(option)
    if action is None:
        return False
    if not hasattr(action, "_typehint"):  # pragma: no cover - depends on jsonargparse
        raise _moved("jsonargparse", "ActionTypeHint._typehint")
    action._typehint = typehint
    if help is not None:
        action.help = help
    return True


# --- torch: LR scheduler bookkeeping ------------------------------------------------------------
def track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as ``LRScheduler.__init__`` does (it sets ``_opt_called``), so a
    scheduler re-pointed at this optimizer sees ``optimizer.step()`` run before its own step and
    does not warn about the order."""
    import weakref
    from functools import wraps

    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
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


def step_was_called(optimizer: Any) -> bool:
    """True when the wrapped ``step`` of ``optimizer`` ran at least once."""
    return bool(getattr(optimizer, "_opt_called", False))


def mark_step_called(optimizer: Any) -> None:
    """Record that ``optimizer.step`` ran (carried over when a scheduler changes optimizer)."""
    optimizer._opt_called = True


# --- torch: DataLoader ------------------------------------------------------------------------
def kept_iterator(loader: Any) -> Any:
    """The iterator a DataLoader keeps for reuse (``persistent_workers=True`` after the first
    ``iter()``); ``None`` when it keeps none, so the next ``iter()`` starts workers afresh."""
    if "_iterator" not in vars(loader):  # pragma: no cover - depends on torch
        raise _moved("torch", "DataLoader._iterator")
    return loader._iterator


# --- Lightning: the loaders given to trainer.fit ----------------------------------------------
def fit_loader_source(trainer: Any, hook: str) -> Any:
    """Where the fit loop reads the loaders given to ``trainer.fit`` directly
    (``train_dataloaders=``/``val_dataloaders=``) for ``hook`` (``"train_dataloader"`` or
    ``"val_dataloader"``): Lightning's ``_DataLoaderSource``, whose ``dataloader()`` the loop
    calls each time it (re)loads them, inside its argument-capturing context, as it calls a
    module's hook; ``None`` when the fit's loaders come from a module's or datamodule's hook."""
    loop = trainer.fit_loop if hook == "train_dataloader" else trainer.fit_loop.epoch_loop.val_loop
    source = vars(loop).get("_data_source")
    if not (callable(getattr(source, "dataloader", None)) and hasattr(source, "instance")):
        raise _moved("lightning", "_FitLoop._data_source")  # pragma: no cover
    return None if source.instance is None or source.is_module() else source


# --- Lightning / DeepSpeed: the ZeRO-Offload strategy -------------------------------------------
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402  (imports no deepspeed)

#: Private hooks of Lightning's ``DeepSpeedStrategy`` that ``DeepSpeedStrategyHooks`` overrides
#: or calls; a Lightning release without one of them fails at strategy construction, by name.
DEEPSPEED_STRATEGY_HOOKS = (
    "_init_optimizers",
    "_auto_select_batch_size",
    "_restore_zero_state",
)


def check_deepspeed_strategy_hooks() -> None:
    """Raise ``InternalsError`` when Lightning's ``DeepSpeedStrategy`` lacks a hook we override:
    an override of a renamed hook would never run (the optimizer would not be converted)."""
    for name in DEEPSPEED_STRATEGY_HOOKS:
        if not callable(getattr(DeepSpeedStrategy, name, None)):
            raise _moved("lightning", f"DeepSpeedStrategy.{name}")


class DeepSpeedStrategyHooks(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` with its private hooks routed to public methods, so a
    subclass (``ZeROOffload``) overrides only public names:

    - ``convert_optimizer(optimizer, scheduler_config)``: the module's optimizer and scheduler
      config before DeepSpeed wraps them; returns the pair DeepSpeed gets.
    - ``restore_zero_state(checkpoint, strict)``: Lightning's gathered ZeRO-3 ``load_state_dict``.
    - The batch size read from the loader for DeepSpeed's throughput logging falls back to 1 for
      loaders without a batch sampler (Lightning raises there).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_deepspeed_strategy_hooks()
        super().__init__(*args, **kwargs)

    def convert_optimizer(self, optimizer: Any, scheduler_config: Any) -> tuple[Any, Any]:
        """The optimizer (and scheduler config) DeepSpeed wraps; unchanged by default."""
        return optimizer, scheduler_config

    def restore_zero_state(self, checkpoint: Any, strict: bool) -> None:
        """Load ``checkpoint["state_dict"]`` into a ZeRO-3 partitioned module (collective)."""
        self._restore_zero_state(checkpoint, strict=strict)

    def _init_optimizers(self) -> tuple[Any, Any]:
        return self.convert_optimizer(*super()._init_optimizers())

    def _auto_select_batch_size(self) -> int:
        try:
            return super()._auto_select_batch_size() or 1
        except (AttributeError, TypeError):
            return 1


def link_zero_optimizer_states(zero_optimizer: Any) -> bool:
    """Link each parameter of a ZeRO-1/2 optimizer to its slice of the optimizer state again.

    DeepSpeed links them lazily after the first step but one param group at a time, so groups
    2+ stay unlinked (``safe_get_full_optimizer_state`` then finds nothing). Returns False for
    optimizers that need no linking (ZeRO-3, plain optimizers)."""
    if not hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        with contextlib.suppress(ImportError):
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

            if isinstance(zero_optimizer, DeepSpeedZeroOptimizer):  # pragma: no cover
                raise _moved(
                    "deepspeed", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state"
                )
        return False
    if not hasattr(zero_optimizer, "_hp_optimizer_states_linked"):  # pragma: no cover
        raise _moved("deepspeed", "DeepSpeedZeroOptimizer._hp_optimizer_states_linked")
    zero_optimizer._hp_optimizer_states_linked = False
    zero_optimizer._lazy_init_hp_params_optimizer_state()
    return True


def torch_extension_dir(name: str) -> str:
    """The folder where ``torch.utils.cpp_extension.load(name=...)`` builds and caches ``name``
    (``$TORCH_EXTENSIONS_DIR/name`` or the user cache's ``py311_cpu/name``); created if absent."""
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is None:  # pragma: no cover - depends on torch
        raise _moved("torch", "torch.utils.cpp_extension._get_build_directory")
    return get(name, verbose=False)


# --- torch: optimizers (Adafactor's state, composite LR schedulers) -----------------------------
def adafactor_init_group(
    optimizer: torch.optim.Adafactor, group: dict[str, Any]
) -> tuple[list, ...]:
    """``Adafactor._init_group``: creates the states of ``group``'s parameters that have a
    gradient and returns ``(params, grads, row_vars, col_vars, variances, state_steps)``."""
    init = getattr(optimizer, "_init_group", None)
    if init is None:
        raise _moved("torch", "torch.optim.Adafactor._init_group")
    lists: tuple[list, ...] = ([], [], [], [], [], [])
    init(group, *lists)
    return lists


def inner_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers a ``SequentialLR`` or ``ChainedScheduler`` drives (``[]`` for others)."""
    from torch.optim.lr_scheduler import ChainedScheduler, SequentialLR

    if not isinstance(scheduler, (SequentialLR, ChainedScheduler)):
        return list(getattr(scheduler, "_schedulers", ()))  # a user's composite of the same shape
    if not hasattr(scheduler, "_schedulers"):
        raise _moved("torch", f"torch.optim.lr_scheduler.{type(scheduler).__name__}._schedulers")
    return list(scheduler._schedulers)


# --- Lightning: accepted precision values ------------------------------------------------------
def lightning_precision_values() -> tuple[Any, ...]:
    """Every precision value Lightning's Trainer accepts (strings and ints)."""
    from typing import get_args

    try:
        from lightning.fabric.connector import _PRECISION_INPUT
    except ImportError as err:  # pragma: no cover - depends on Lightning
        raise _moved("lightning", "lightning.fabric.connector._PRECISION_INPUT") from err
    values: list[Any] = []
    for literal in get_args(_PRECISION_INPUT):
        values.extend(get_args(literal))
    return tuple(values)


# --- transformers: the SDPA mask checks on fake tensors ------------------------------------------
#: ``transformers.masking_utils`` functions that read a padding mask's values to decide whether
#: the attention mask can be skipped (SDPA then runs with ``is_causal`` or no mask). On a fake
#: tensor they answer "tracing, cannot tell" and the mask is built, which a real run does not do.
HF_MASK_SKIP_CHECKS = (
    "_ignore_causal_mask_sdpa",
    "_ignore_bidirectional_mask_sdpa",
    "_can_skip_bidirectional_mask_xpu",
)
#: Reads position ids' values to detect packed sequences (several per row: a mask is built).
HF_PACKED_CHECK = "find_packed_sequence_indices"
#: Receives the model's ``attention_mask`` and ``position_ids`` as the model passed them.
HF_MASK_ARGUMENTS = "_preprocess_mask_arguments"


def hf_mask_functions() -> dict[str, Any]:
    """The mask functions above that ``transformers.masking_utils`` has (name -> function);
    empty when transformers' masking is not imported (nothing to answer for)."""
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    names = (*HF_MASK_SKIP_CHECKS, HF_PACKED_CHECK, HF_MASK_ARGUMENTS)
    return {n: getattr(mu, n) for n in names if callable(getattr(mu, n, None))}


def hf_mask_function_sites(functions: dict[str, Any]) -> list[tuple[Any, str]]:
    """Every ``(transformers module, name)`` that holds one of ``functions`` under its name:
    ``masking_utils`` itself, and the modules that imported one by name (read from each
    module's own namespace, so that no lazy module is imported)."""
    import sys

    modules = [m for k, m in list(sys.modules.items()) if k.startswith("transformers") and m]
    return [
        (module, name)
        for module in modules
        for name, fn in functions.items()
        if vars(module).get(name) is fn
    ]


# --- Lightning: FullyShardedStrategy (the model-parallel strategy's mesh sizes) ------------------
def set_model_parallel_sizes(strategy: Any, *, data_parallel: int, tensor_parallel: int) -> None:
    """Set the mesh sizes ``ModelParallelStrategy.setup_environment`` builds its device mesh
    from (its constructor takes them, but the world size is known only once the trainer set the
    devices and nodes)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy) or not hasattr(
        strategy, "_data_parallel_size"
    ):
        raise _moved("lightning", "ModelParallelStrategy._data_parallel_size")
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


# --- torch: FSDP2's policies of a sharded module (what FullyShardedStrategy's options set) -------
def fsdp_policies(module: Any) -> tuple[Any, Any]:
    """The ``(MixedPrecisionPolicy, OffloadPolicy)`` that ``fully_shard`` stored for ``module``
    (an ``FSDPModule``; torch keeps them on the module's parameter group, with no public getter).
    On a CPU machine CPU offload moves nothing, so the policy is what can be checked."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise _moved("torch", "FSDPModule._get_fsdp_state")
    group = getattr(get_state(), "_fsdp_param_group", None)
    if group is None or not hasattr(group, "offload_policy") or not hasattr(group, "mp_policy"):
        raise _moved("torch", "FSDPState._fsdp_param_group.offload_policy")
    return group.mp_policy, group.offload_policy


# --- torch: FSDP2's sharded modules (``fully_shard`` swaps each module's class) ----------------
def _fsdp_module_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp_sharded(module: nn.Module) -> list[str]:
    """Names of the modules of ``module`` that FSDP2's ``fully_shard`` has sharded ("" is the
    root)."""
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return []
    return [name for name, m in module.named_modules() if isinstance(m, fsdp)]


def class_before_fsdp(module: nn.Module) -> type:
    """``type(module)`` as it was before ``fully_shard``, which swaps in a subclass of
    ``FSDPModule`` and the module's class named ``FSDP<Name>`` (state-dict keys stay; class
    names, as a block policy gives them, do not)."""
    fsdp = _fsdp_module_class()
    cls = type(module)
    if fsdp is None or not isinstance(module, fsdp):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, fsdp))
