"""torch.compile, in place and per block, with compile time measured apart from step time.

- ``apply_compile(model, ...)`` compiles in place with ``nn.Module.compile`` (state_dict keys
  never change: no ``_orig_mod.``) and returns the ``Change`` whose ``undo()`` puts back what
  each module ran before (its ``value``: the names compiled). Regional (the default) compiles
  each repeated block found by ``techniques._blocks`` (the detection activation checkpointing uses): identical blocks share one
  compiled graph, so compile time is about one block's, not the whole model's. The parts outside
  the blocks (embeddings, final norm, head; the loss in ``training_step``) stay eager: compiling
  each as a region of its own was measured no faster and costlier to compile
  (``benchmarks/compile.py``, variant ``regional+outer``; docs/compile.md), and compiling
  the parent's ``forward`` with a graph break at each block call does not work, because Dynamo
  skips a whole frame that breaks inside a ``for`` loop (``for block in self.blocks``), and
  ``torch.compiler.nested_compile_region`` on a block instance's ``forward`` gave outputs that
  differ from eager (torch 2.13, TinyGPT), so neither is used.
  Whole-model compilation compiles the module's ``forward`` (for a LightningModule:
  ``training_step`` itself stays eager, so ``self.log`` in it keeps working).
- A compile failure on a forward falls back to eager for every module compiled together, with
  one warning, unless ``strict=True``.
- ``CompileWatch`` counts Dynamo compilations and recompilations and sums their wall time through
  Dynamo's compile callbacks (``on_compile_start``/``on_compile_end``).
- What is compiled (``scope``): the repeated blocks, the whole model, or (``"auto"``, the default
  on CUDA) the one that measures faster on the device at fit start, with both figures reported
  (``techniques._compile_scope``: the rule, a pure function, and the trial steps).
- ``TorchCompile`` (callback) compiles at fit start, reports compile time, first-step time and
  steady-state step time apart, and warns once when recompilations pass a threshold, naming the
  cause (usually changing shapes) and the fix (pad or bucket lengths); after fit (and when it
  raises or is interrupted) it puts back what each module it compiled had before.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_efficient.core._internals import (
    compile_callbacks,
    compiled_call,
    dynamo_backends,
    guard_failure_reasons,
    inductor_modes,
    is_dynamo_error,
    set_compiled_call,
)
from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_int
from lightning_efficient.measure.timing import StepTimer
from lightning_efficient.techniques._blocks import (
    check_policy,
    find_repeated_blocks,
    select_modules,
)
from lightning_efficient.techniques._compile_scope import (
    ScopeChoice,
    choose_by_trial,
    default_scope,
    describe_error,
    resolve_scope,
)

__all__ = [
    "apply_compile",
    "uncompile_modules",
    "compiled_modules",
    "valid_backends",
    "valid_modes",
    "recompile_reasons",
    "CompileWatch",
    "TorchCompile",
]


def valid_backends() -> list[str]:
    """Every Dynamo backend name registered in this process."""
    return dynamo_backends()


def valid_modes() -> list[str]:
    """Inductor's compile modes."""
    return inductor_modes()


def _check_backend(backend: Any) -> Any:
    if callable(backend) and not isinstance(backend, str):
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"`backend` must be a backend name or a callable backend; got {backend!r} ({type(backend).__name__})."
        )
    return check_choice("backend", backend, valid_backends())


def _check_mode(mode: Any, backend: Any) -> str | None:
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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
    repeated blocks, the whole model. ``on_error(err)`` is called when a forward fails to compile
    (default: re-raise); after it returns, that forward runs eagerly.
    """
    targets: list[tuple[str, nn.Module]]
    if not regional or (blocks == "auto" and not find_repeated_blocks(model)):
        targets = [("", model)]
    else:
        targets = select_modules(model, blocks, argument="blocks")
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend}
    if mode is not None:
        kwargs["mode"] = mode

    def reraise(err: BaseException) -> None:
        raise err

    previous = {name: compiled_call(module) for name, module in targets}
    for _, module in targets:
        module.compile(**kwargs)
        set_compiled_call(module, _FallbackCall(module, compiled_call(module), on_error or reraise))
    names = [name for name, _ in targets]

    def undo() -> None:
        for name, module in targets:
            set_compiled_call(module, previous[name])

    what = _describe(names, backend, mode)
    return Change(what, undo, figures={"compiled_modules": len(names)}, value=names)


def _describe(names: list[str], backend: Any, mode: str | None) -> str:
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    how = f"{name}, mode={mode}" if mode else name
    if names == [""]:
        return f"compiled the whole model ({how})"
    return f"compiled {len(names)} blocks in place ({how}); the rest of the model runs eagerly"


class CompileWatch:
    """Counts Dynamo compilations and recompilations and sums their wall time while installed.

    Uses Dynamo's start/end compile callbacks. A compile id ``"f/n"`` with
    ``n > 0`` is the n-th recompilation of frame ``f``. ``on_recompile(watch)`` runs after each
    recompilation.
    """

    def __init__(self, on_recompile: Callable[[CompileWatch], None] | None = None) -> None:
        self.compiles = 0  # Dynamo frame compilations (graphs captured)
        self.recompiles = 0
        self.events = 0  # every compile event, deferred backward compiles included
        self.seconds = 0.0
        self.on_recompile = on_recompile
        self._started: float | None = None
        self._installed = False

    def _start(self, args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, args: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        self.events += 1
        if "DYNAMO" not in str(getattr(args, "callback_trigger", "DYNAMO")):
            return  # a deferred backward (or autotuning) compile of a graph already counted
        self.compiles += 1
        parts = str(getattr(args, "compile_id", "")).strip("[]").split("/")
        if len(parts) >= 2 and parts[-1].isdigit() and int(parts[-1]) > 0:
            self.recompiles += 1
            if self.on_recompile is not None:
                self.on_recompile(self)

    def install(self) -> CompileWatch:
        callback_handler = compile_callbacks()
        if not self._installed:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            self._installed = True
        return self

    def remove(self) -> None:
        callback_handler = compile_callbacks()
        if self._installed:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
            self._installed = False

    def apply(self) -> Change:
        """Install; the change's ``undo()`` removes the callbacks again."""
        self.install()
        return Change("compile callbacks installed", self.remove, value=self)

    def __enter__(self) -> CompileWatch:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def recompile_reasons(limit: int = 3) -> list[str]:
    """The latest guard failures Dynamo recorded (why it recompiled), newest last."""
    return guard_failure_reasons(limit)


def _cause_and_fix(reasons: list[str]) -> str:
    text = " ".join(reasons).lower()
    if "size" in text or "stride" in text or "shape" in text or not reasons:
        cause = "input shapes change between steps (dynamic shapes, e.g. variable sequence lengths or a smaller last batch)"
        fix = (
            "pad or bucket sequence lengths to a few fixed sizes (and drop_last=True), or pass "
            "dynamic=True so one graph covers every size"
        )
    else:
        cause = "a guard on a Python value or module attribute keeps failing"
        fix = "make that value constant during training, or move it out of the compiled module"
    last = f" Last reason: {reasons[-1]}." if reasons else ""
    return f"Cause: {cause}.{last} Fix: {fix}."


_TIMED_STEPS = 64  # steps timed one by one; the steady state is their median without compiles


def _reinstall(
    model: nn.Module, calls: dict[str, Any], on_error: Callable[[BaseException], None], what: str
) -> Change:
    # ``what``: ``_describe`` of the compile these calls came from
    """Put back compiled calls taken from an earlier ``apply_compile`` (the same compiled
    functions, so Dynamo's cache serves them: no second compile), failing over to ``on_error``."""
    targets = [(name, model.get_submodule(name) if name else model) for name in calls]
    previous = {name: compiled_call(module) for name, module in targets}
    for name, module in targets:
        set_compiled_call(module, _FallbackCall(module, calls[name].compiled, on_error))

    def undo() -> None:
        for name, module in targets:
            set_compiled_call(module, previous[name])

    return Change(what, undo, figures={"compiled_modules": len(targets)}, value=list(calls))


class TorchCompile(Technique):
    """Compile the model with ``torch.compile`` at fit start, in place and (by default) per block.

    State_dict keys never change. Compile time is reported apart from steady-state step time
    (``compile_s``, ``first_step_s``, ``steady_step_s``, ``recompiles``). A forward that fails to
    compile falls back to eager with one warning, unless ``strict=True``.

    Args:
        mode: Inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ...);
            ``None`` for the default. Only with the inductor backend.
        fullgraph: Fail on graph breaks instead of splitting the graph.
        dynamic: ``True`` compiles shape-generic graphs up front, ``False`` never, ``None`` (the
            default) after the first shape change.
        scope: ``"regional"`` (each repeated block: one shared graph, short compile),
            ``"whole"`` (the module's forward) or ``"auto"`` (both compiled and timed on the
            device at the first batch; the whole model kept when more than 3% faster, both
            figures reported: ``techniques._compile_scope``). ``None``: ``"auto"`` on CUDA,
            ``"regional"`` elsewhere.
        regional: The older form of ``scope`` (``True``: ``"regional"``, ``False``: ``"whole"``).
        backend: A Dynamo backend name (``valid_backends()``) or a backend callable.
        strict: Re-raise compile errors instead of falling back to eager.
        blocks: Which blocks a regional compile compiles: ``"auto"`` (repeated blocks), a class
            name, a module class, a name glob or ``"re:<regex>"`` (as ``ActivationCheckpointing``).
        recompile_warning: Warn once when more recompilations than this happen during fit.
    """

    stacks = False

    def __init__(
        self,
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        regional: bool | None = None,
        backend: str | Callable[..., Any] = "inductor",
        strict: bool = False,
        blocks: str | list[str] = "auto",
        recompile_warning: int = 4,
        scope: str | None = None,
    ) -> None:
        super().__init__()
        self.backend = _check_backend(backend)
        self.mode = _check_mode(mode, self.backend)
        self.fullgraph = check_bool("fullgraph", fullgraph)
        if dynamic is not None:
            check_bool("dynamic", dynamic)
        self.dynamic = dynamic
        self.regional = None if regional is None else check_bool("regional", regional)
        self.scope = resolve_scope(scope, self.regional)
        self.strict = check_bool("strict", strict)
        self.blocks = check_policy(blocks, argument="blocks")
        self.recompile_warning = check_int("recompile_warning", recompile_warning, minimum=1)
        self._names: list[str] = []
        self._compiled = Change("nothing compiled")
        self._watch: CompileWatch | None = None
        self._fell_back: str | None = None
        self._timer: Any = None
        self._step = 0
        self._step_compiles: list[bool] = []
        self._compiles_before = 0
        self._warned_recompiles = False
        self._torch_nn_only = False
        self._scope: str | None = None  # the scope of this fit ("auto" until chosen)
        self.choice: ScopeChoice | None = None  # what scope="auto" measured and chose

    # -- compile and fall back ---------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch = CompileWatch(on_recompile=self._check_recompiles)
        self.record(trainer, self._watch.apply())
        self._fell_back = None
        self._warned_recompiles = False
        self._names, self._compiled = [], Change("nothing compiled")
        self._scope = self.scope or default_scope(trainer.strategy.root_device)
        self.choice = None
        if self._scope != "auto":  # else at the first batch, which the trial steps need
            self._compile(trainer, pl_module, self._scope)
        self._timer = StepTimer(trainer.strategy.root_device)
        self._step = 0
        self._step_compiles = []
        self._report(trainer)

    def _compile_as(self, pl_module: Any, scope: str, on_error: Any) -> Change:
        how = dict(mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic)
        how.update(backend=self.backend, blocks=self.blocks, on_error=on_error)
        return apply_compile(pl_module, regional=scope == "regional", **how)

    def _compile(self, trainer: Any, pl_module: Any, scope: str) -> None:
        self._compiled = self.record(trainer, self._compile_as(pl_module, scope, self._fall_back))
        self._compiled_as(pl_module, scope)

    def _compiled_as(self, pl_module: Any, scope: str) -> None:
        self._names = self._compiled.value  # torch.nn's own layers: Dynamo skips their frames
        self._torch_nn_only = bool(self._names) and all(
            type(pl_module.get_submodule(n)).__module__.startswith("torch.nn.") for n in self._names
        )
        if scope == "regional" and self._names == [""]:
            self.note("no repeated blocks found; compiling the whole model instead.")

    def _choose(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """``scope="auto"``: compile and time each scope on ``batch``, keep the faster by the
        rule (``choose_scope``), the same choice on every rank (rank zero's)."""
        watch = self._watch
        choice, calls, errors = choose_by_trial(
            lambda scope, on_error: self._compile_as(pl_module, scope, on_error),
            pl_module,
            batch,
            trainer.strategy,
            lambda: watch.seconds if watch else 0.0,
            strict=self.strict,
        )
        self.choice = choice
        if choice.scope in calls:
            what = _describe(list(calls[choice.scope]), self.backend, self.mode)
            change = _reinstall(pl_module, calls[choice.scope], self._fall_back, what)
            self._compiled = self.record(trainer, change)
            self._compiled_as(pl_module, choice.scope)
        elif not errors.get(choice.scope):  # measured elsewhere (another rank): compile here
            self._compile(trainer, pl_module, choice.scope)
        if errors:
            failed = "; ".join(f"{s} failed ({e})" for s, e in errors.items())
            using = f"using {choice.scope}" if choice.scope in calls else "running eagerly"
            self.warn(f"scope auto: {failed}; {using}.")
        self.note(choice.describe())

    def _fall_back(self, err: BaseException) -> None:
        if self.strict:
            raise err
        self._compiled.undo()  # the modules this callback compiled run as before
        self._fell_back = describe_error(err)
        self.warn(
            f"torch.compile failed ({self._fell_back}); training continues in eager mode. "
            "Pass strict=True to raise instead."
        )

    def _check_recompiles(self, watch: CompileWatch) -> None:
        if watch.recompiles > self.recompile_warning and not self._warned_recompiles:
            self._warned_recompiles = True
            self.warn(
                f"{watch.recompiles} recompilations during fit (more than recompile_warning="
                f"{self.recompile_warning}); each one costs a full compile. {_cause_and_fix(recompile_reasons())}"
            )

    # -- timing: compile apart from steady state -------------------------------------------
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._scope == "auto" and self.choice is None:
            self._choose(trainer, pl_module, batch)
        if self._timer is not None and self._step < _TIMED_STEPS:
            self._compiles_before = self._watch.events if self._watch else 0
            self._timer.start(f"step{self._step}")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is not None and self._step < _TIMED_STEPS:
            self._timer.stop(f"step{self._step}")
            self._step_compiles.append(
                (self._watch.events if self._watch else 0) > self._compiles_before
            )
            self._step += 1
            if self._step == 1:
                self._check_graphs()

    def _no_graphs(self) -> bool:
        """True when only torch.nn layers were compiled, the model ran, and Dynamo captured no
        graph."""
        return (
            self._torch_nn_only
            and not self._fell_back
            and self._watch is not None
            and self._step > 0
            and bool(self._names)
            and self._watch.compiles == 0
        )

    def _check_graphs(self) -> None:
        if self._no_graphs():
            self.no_effect(
                f"0 graphs compiled for {len(self._names)} "
                f"{'blocks' if self._names != [''] else 'model'} ({_span(self._names)}): "
                "Dynamo skips these modules' frames (torch.nn's own layers are not traced on "
                "their own); everything runs eagerly. Pass `blocks=` a block class that contains "
                "such layers, or regional=False."
            )

    def compile_state(self) -> dict[str, Any]:
        """For the profiler's advice: ``scope`` compiled (None: nothing runs compiled), ``mode``
        and the steady steps ``scope="auto"`` measured."""
        scope = None
        if self._names and not self._fell_back and not self._no_graphs():
            scope = "whole" if self._names == [""] else "regional"
        steps = self.choice.figures() if self.choice is not None else {}
        return {
            "mode": self.mode,
            **{k: v for k, v in steps.items() if k.endswith("step_s")},
            "scope": scope,
        }

    @property
    def recompiles(self) -> int | None:  # read by the profiler's advice
        return self._watch.recompiles if self._watch is not None else None

    def timings(self) -> dict[str, Any]:
        """Compile time, first-step time and steady-state (compile-free) step time so far."""
        out: dict[str, Any] = {}
        if self._watch is not None:
            out.update(
                compile_s=self._watch.seconds,
                compiles=self._watch.compiles,
                recompiles=self._watch.recompiles,
            )
        if self._timer is not None and self._step:
            totals = self._timer.totals()
            steps = [totals.get(f"step{i}", 0.0) for i in range(self._step)]
            out["first_step_s"] = steps[0]
            steady = [s for s, compiled in zip(steps, self._step_compiles) if not compiled]
            if steady:
                out["steady_step_s"] = statistics.median(steady)
        return out

    def _report(self, trainer: Any) -> None:
        if self._fell_back:
            change = f"compile failed, fell back to eager ({self._fell_back})"
        elif self._no_graphs():
            change = f"0 graphs compiled: {len(self._names)} modules run eagerly"
        else:
            change = self._compiled.what + self._graphs()
        figures = {**self._compiled.figures, **self.timings()}
        if self.choice is not None:
            figures.update(self.choice.figures())
        elif self._scope is not None:
            figures["scope"] = self._scope
        if self._fell_back or self._no_graphs():
            figures["compiled_modules"] = 0
        self.report(trainer, change, **figures)

    def _graphs(self) -> str:
        """``"; 1 graph"`` once the model ran: how many graphs Dynamo captured for what was
        compiled (identical blocks share one)."""
        if self._watch is None or not self._step:
            return ""
        n = self._watch.compiles
        return f"; {n} graph{'' if n == 1 else 's'}"

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._check_graphs()
        self._report(trainer)
        super().on_fit_end(trainer, pl_module)


def _span(names: list[str]) -> str:
    shown = [n or "<model>" for n in names]
    return shown[0] if len(shown) == 1 else f"{shown[0]} .. {shown[-1]}"
