"""``TorchCompile``: the callback that decides when to compile and what to report; the compiling is
``functions.apply_compile``, the scope rule and its trial ``scope.py`` (on the instrument's
compile trial), Dynamo's counts ``watch.py``, the step times the instrument's ``StepTimes``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_efficient.core.change import Change
from lightning_efficient.core.technique import Technique
from lightning_efficient.core.validate import check_bool, check_choice, check_int
from lightning_efficient.measure.speed.timing import StepTimes
from lightning_efficient.measure.trials.compile_trial import describe_error
from lightning_efficient.techniques._blocks import check_policy
from lightning_efficient.techniques.compile.functions import (
    apply_compile,
    check_backend,
    check_mode,
    compiled_calls,
    whole_targets,
)
from lightning_efficient.techniques.compile.report import compile_line, no_graphs_warning
from lightning_efficient.techniques.compile.scope import (
    SCOPES,
    ScopeChoice,
    auto_scope,
    default_scope,
)
from lightning_efficient.techniques.compile.watch import (
    CompileWatch,
    cause_and_fix,
    recompile_reasons,
)

__all__ = ["TorchCompile"]


class TorchCompile(Technique):
    """Compile the model with ``torch.compile`` at fit start, in place and (by default) per block.

    State_dict keys never change. Compile time is reported apart from steady-state step time
    (``compile_s``, ``first_step_s``, ``steady_step_s``, ``recompiles``, ``graph_breaks``). A
    forward that fails to compile falls back to eager with one warning, unless ``strict=True``.
    After fit (and when it raises or is interrupted) every module runs as before.

    Args:
        mode: Inductor mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``, ...);
            ``None`` for the default. Only with the inductor backend.
        fullgraph: Fail on graph breaks instead of splitting the graph.
        dynamic: ``True`` compiles shape-generic graphs up front, ``False`` never, ``None`` (the
            default) after the first shape change.
        backend: A Dynamo backend name (``valid_backends()``) or a backend callable.
        strict: Re-raise compile errors instead of falling back to eager.
        blocks: Which blocks a regional compile compiles: ``"auto"`` (repeated blocks), a class
            name, a module class, a name glob or ``"re:<regex>"`` (as ``ActivationCheckpointing``).
        recompile_warning: Warn once when more recompilations than this happen during fit.
        scope: ``"regional"`` (each repeated block: one shared graph, short compile),
            ``"whole"`` (the module's forward) or ``"auto"`` (both compiled and timed on the
            device at the first batch by the instrument's compile trial, which puts the module
            back; the whole model kept when more than 3% faster, both figures reported).
            ``None``: ``"auto"`` on CUDA, ``"regional"`` elsewhere.
    """

    stacks = False

    def __init__(
        self,
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str | Callable[..., Any] = "inductor",
        strict: bool = False,
        blocks: str | list[str] = "auto",
        recompile_warning: int = 4,
        scope: str | None = None,
    ) -> None:
        super().__init__()
        self.backend = check_backend(backend)
        self.mode = check_mode(mode, self.backend)
        self.fullgraph = check_bool("fullgraph", fullgraph)
        self.dynamic = dynamic if dynamic is None else check_bool("dynamic", dynamic)
        self.scope = None if scope is None else check_choice("scope", scope, SCOPES)
        self.strict = check_bool("strict", strict)
        self.blocks = check_policy(blocks, argument="blocks")
        self.recompile_warning = check_int("recompile_warning", recompile_warning, minimum=1)
        self._compiled = Change("nothing compiled", value=[])
        self._watch: CompileWatch | None = None
        self._fell_back: str | None = None
        self._times: StepTimes | None = None
        self._no_graphs = False  # only torch.nn layers compiled, and Dynamo captured nothing
        self._scope: str | None = None  # the scope of this fit ("auto" until chosen)
        self.choice: ScopeChoice | None = None  # what scope="auto" measured and chose

    # -- compile and fall back ---------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch = CompileWatch(on_recompile=self._check_recompiles)
        self.record(trainer, self._watch.apply())
        self._fell_back, self.choice, self._no_graphs = None, None, False
        self._compiled = Change("nothing compiled", value=[])
        self._scope = self.scope or default_scope(trainer.strategy.root_device)
        if self._scope != "auto":  # else at the first batch, which the trial steps need
            self._install(trainer, pl_module, self._compile_as(pl_module, self._scope))
        watch = self._watch
        self._times = StepTimes(trainer.strategy.root_device, lambda: watch.events)
        self._report(trainer)

    def _compile_as(self, pl_module: Any, scope: str, on_error: Any = None) -> Change:
        how = dict(mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic)
        how.update(backend=self.backend, blocks=self.blocks, on_error=on_error or self._fall_back)
        return apply_compile(pl_module, regional=scope == "regional", **how)

    def _install(self, trainer: Any, pl_module: Any, change: Change) -> None:
        self._compiled = self.record(trainer, change)
        whole = [name for name, _ in whole_targets(pl_module)]
        if self._scope == "regional" and change.value == whole:
            self.note("no repeated blocks found; compiling the whole model instead.")

    def _choose(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """``scope="auto"``: the compile trial chooses (``scope.auto_scope``); this installs."""
        watch = self._watch
        done = auto_scope(
            lambda scope, on_error: self._compile_as(pl_module, scope, on_error),
            pl_module,
            batch,
            trainer.strategy,
            lambda: watch.seconds if watch else 0.0,
            self._fall_back,
            strict=self.strict,
        )
        self.choice = done.choice
        if done.change is not None:
            self._install(trainer, pl_module, done.change)
        if done.warning:
            self.warn(done.warning)
        self.note(done.choice.describe())

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
        if watch.recompiles == self.recompile_warning + 1:
            self.warn(
                f"{watch.recompiles} recompilations during fit (more than recompile_warning="
                f"{self.recompile_warning}); each one costs a full compile. "
                + cause_and_fix(recompile_reasons())
            )

    # -- timing: compile apart from steady state -------------------------------------------
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._scope == "auto" and self.choice is None:
            self._choose(trainer, pl_module, batch)
        if self._times is not None:
            self._times.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._times is not None:
            self._times.stop()
            if self._times.steps == 1:
                self._check_graphs(pl_module)

    def _check_graphs(self, pl_module: Any) -> None:
        steps = self._times.steps if self._times else 0
        names = self._compiled.value or []
        calls = compiled_calls(pl_module, names) if not self._compiled.undone else 0
        message = no_graphs_warning(pl_module, names, self._watch, steps, calls)
        if message and not self._fell_back and not self._no_graphs:
            self._no_graphs = True
            self.no_effect(message)

    def compile_state(self) -> dict[str, Any]:
        """For the profiler's advice: ``scope`` compiled (None: nothing runs compiled), ``mode``
        and the steady steps ``scope="auto"`` measured."""
        names = self._compiled.value or []
        scope = None
        if names and not self._fell_back and not self._no_graphs and not self._compiled.undone:
            chosen = self.choice.scope if self.choice is not None else self._scope
            scope = "whole" if names == [""] or chosen == "whole" else "regional"
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
            out.update(compile_s=self._watch.seconds, compiles=self._watch.compiles)
            out.update(recompiles=self._watch.recompiles)
            out["graph_breaks"] = sum(self._watch.breaks().values())
        return {**out, **(self._times.figures() if self._times is not None else {})}

    def _report(self, trainer: Any) -> None:
        steps = self._times.steps if self._times else 0
        change, note, compiled = compile_line(
            self._compiled, self._fell_back, self._no_graphs, self._watch, steps
        )
        if note:
            self.note(note)
        figures = {**self._compiled.figures, **self.timings()}
        figures.update(self.choice.figures() if self.choice else {"scope": self._scope})
        if not compiled:
            figures["compiled_modules"] = 0
        self.report(trainer, change, **figures)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._check_graphs(pl_module)
        self._report(trainer)
        super().on_fit_end(trainer, pl_module)
