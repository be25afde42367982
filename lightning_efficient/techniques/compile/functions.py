"""torch.compile in place and per block, as pure functions.

- ``apply_compile(model, ...)`` compiles in place with ``nn.Module.compile`` (state_dict keys
  never change: no ``_orig_mod.``) and returns the ``Change`` whose ``undo()`` puts back exactly
  what each module had (its own compiled call, or none: the attribute absent again); its
  ``value`` is the names compiled. Regional (the default) compiles each repeated block found by
  ``techniques._blocks`` (the detection activation checkpointing uses): identical blocks share
  one compiled graph, so compile time is about one block's, not the whole model's. The parts
  outside the blocks (embeddings, final norm, head; the loss in ``training_step``) stay eager:
  compiling each as a region of its own was measured no faster and costlier to compile
  (``benchmarks/compile.py``, variant ``regional+outer``; docs/compile.md), and compiling the
  parent's ``forward`` with a graph break at each block call does not work, because Dynamo skips
  a whole frame that breaks inside a ``for`` loop (``for block in self.blocks``), and
  ``torch.compiler.nested_compile_region`` on a block instance's ``forward`` gave outputs that
  differ from eager (torch 2.13, TinyGPT), so neither is used. Whole-model compilation compiles
  the module's ``forward`` (for a LightningModule: ``training_step`` itself stays eager, so
  ``self.log`` in it keeps working); a module whose class defines no ``forward`` of its own (a
  LightningModule whose ``training_step`` calls ``self.model(...)``) has each child that holds
  parameters compiled whole instead (``whole_targets``): its own call would never run.
- Every compiled call counts its calls (``compiled_calls``): a compiled module the step never
  calls is found, not reported as compiled.
- A compile failure on a forward falls back to eager for every module compiled together
  (``on_error``), unless it re-raises.
- ``reinstall``: compiled calls an earlier ``apply_compile`` made, put back (no second compile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_efficient.core._internals import (
    compiled_call,
    dynamo_backends,
    inductor_modes,
    install_compiled_call,
    is_dynamo_error,
    set_compiled_call,
)
from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import check_choice
from lightning_efficient.techniques._blocks import find_repeated_blocks, select_modules

__all__ = [
    "apply_compile",
    "check_backend",
    "check_mode",
    "compiled_calls",
    "compiled_modules",
    "describe_compile",
    "reinstall",
    "uncompile_modules",
    "valid_backends",
    "valid_modes",
    "whole_targets",
]


def valid_backends() -> list[str]:
    """Every Dynamo backend name registered in this process."""
    return dynamo_backends()


def valid_modes() -> list[str]:
    """Inductor's compile modes."""
    return inductor_modes()


def check_backend(backend: Any) -> Any:
    if callable(backend) and not isinstance(backend, str):
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"`backend` must be a backend name or a callable backend; got {backend!r} ({type(backend).__name__})."
        )
    return check_choice("backend", backend, valid_backends())


def check_mode(mode: Any, backend: Any) -> str | None:
    if mode is None:
        return None
    mode = check_choice("mode", mode, valid_modes())
    if backend != "inductor":
        raise ValueError(
            f"`mode`={mode!r} applies to the 'inductor' backend only; got backend={backend!r}. "
            "Use backend='inductor' or mode=None."
        )
    return mode


class _FallbackCall:
    """Stands in for a module's ``_compiled_call_impl``: calls the compiled function and, when
    compilation fails, hands the error to ``on_error`` (which switches the modules back to eager
    or re-raises) and runs this call eagerly."""

    def __init__(
        self,
        module: nn.Module,
        compiled: Callable[..., Any],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.module, self.compiled, self.on_error = module, compiled, on_error
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            if not is_dynamo_error(err):
                raise
            self.on_error(err)  # raises when strict
            return self.module._call_impl(*args, **kwargs)


def compiled_modules(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` (``""``: itself) compiled in place."""
    return [n for n, m in model.named_modules() if compiled_call(m) is not None]


def uncompile_modules(model: nn.Module) -> list[str]:
    """Every in-place compiled submodule of ``model`` runs eagerly again, whoever compiled it."""
    names = compiled_modules(model)
    for name in names:
        set_compiled_call(model.get_submodule(name), None)
    return names


def compiled_calls(model: nn.Module, names: list[str]) -> int:
    """How many times the modules ``names`` of ``model`` that ``apply_compile`` compiled were
    called since."""
    modules = (model.get_submodule(name) for name in names)
    return sum(getattr(compiled_call(m), "calls", 0) for m in modules)


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class (or a base of the user's) defines ``forward``: not torch.nn's
    placeholder nor LightningModule's, which only calls it."""
    defined_in = getattr(type(module).forward, "__module__", "") or ""
    return not defined_in.startswith(("torch.nn.modules.module", "lightning.pytorch.core."))


def whole_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What a whole-model compile compiles: the model, or, where its class defines no ``forward``
    of its own (its step calls ``self.model(...)``), each child that holds parameters."""
    if has_own_forward(model):
        return [("", model)]
    children = [(n, m) for n, m in model.named_children() if next(m.parameters(), None) is not None]
    return children or [("", model)]


def apply_compile(
    model: nn.Module,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    regional: bool = True,
    backend: str | Callable[..., Any] = "inductor",
    blocks: Any = "auto",
    on_error: Callable[[BaseException], None] | None = None,
) -> Change:
    """Compile ``model`` in place; the change's ``value`` is the names compiled (``""``: the
    model itself), its ``undo()`` makes each of them run as before (eagerly, or under the
    user's own ``module.compile()``).

    Regional: every block ``select_modules(model, blocks)`` picks; with ``blocks="auto"`` and no
    repeated blocks, the whole model (``whole_targets``). ``on_error(err)`` is called when a
    forward fails to compile (default: re-raise); after it returns, that forward runs eagerly.
    """
    targets: list[tuple[str, nn.Module]]
    whole = not regional or (blocks == "auto" and not find_repeated_blocks(model))
    if whole:
        targets = whole_targets(model)
    else:
        targets = select_modules(model, blocks, argument="blocks")
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    if mode is not None:
        kwargs["mode"] = mode

    def reraise(err: BaseException) -> None:
        raise err

    changes = []
    for _, module in targets:
        before = install_compiled_call(module, compiled_call(module))  # what it had, kept
        module.compile(**kwargs)
        set_compiled_call(module, _FallbackCall(module, compiled_call(module), on_error or reraise))
        changes.append(before)
    names = [name for name, _ in targets]
    what = describe_compile(names, backend, mode, whole=whole)
    return Change.of(what, changes, figures={"compiled_modules": len(names)}, value=names)


def describe_compile(
    names: list[str], backend: Any, mode: str | None, *, whole: bool | None = None
) -> str:
    """The report's words for the modules ``names`` compiled (``whole``: by a whole-model compile;
    ``None``: only ``[""]`` is)."""
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    how = f"{name}, mode={mode}" if mode else name
    if names == [""]:
        return f"compiled the whole model ({how})"
    if whole:
        shown = ", ".join(f"`{n}`" for n in names)
        return (
            f"compiled {shown} whole ({how}): the module defines no forward of its own, its "
            "step calls " + ("it" if len(names) == 1 else "them")
        )
    return f"compiled {len(names)} blocks in place ({how}); the rest of the model runs eagerly"


def reinstall(
    model: nn.Module,
    calls: dict[str, Any],
    on_error: Callable[[BaseException], None],
    *,
    backend: Any = "inductor",
    mode: str | None = None,
    whole: bool | None = None,
) -> Change:
    """Put back compiled calls taken from an earlier ``apply_compile`` (the same compiled
    functions, so Dynamo's cache serves them: no second compile), failing over to ``on_error``;
    the change puts back exactly what each module had (``whole``: as ``describe_compile``)."""
    changes = []
    for name, call in calls.items():
        module = model.get_submodule(name) if name else model
        compiled = getattr(call, "compiled", call)
        changes.append(install_compiled_call(module, _FallbackCall(module, compiled, on_error)))
    names = list(calls)
    figures = {"compiled_modules": len(names)}
    what = describe_compile(names, backend, mode, whole=whole)
    return Change.of(what, changes, figures=figures, value=names)
