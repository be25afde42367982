"""The package's house rules, read from the code itself (every import, including those inside
functions): layers import one way only, no import cycles, no call named by a string (which the
import graph cannot see), private library names only in ``core/_internals.py``, no module over 600
lines, no callback or strategy class over 200 lines."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.strategies import Strategy

PACKAGE = "lightning_efficient"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Layers, lowest first. A module may import from its own layer and the ones below.
LAYERS = {"core": 0, "measure": 1, "techniques": 2, "planning": 3, "commands": 5}
TOP = 4  # functional, the package itself
#: Modules outside ``commands/`` that belong to its layer: the entry points that run it.
COMMAND_ENTRIES = {"__main__": LAYERS["commands"]}
#: Libraries whose private names only core/_internals.py may touch.
GUARDED = ("torch", "lightning", "pytorch_lightning", "deepspeed", "jsonargparse", "transformers")
#: Private attributes of those libraries' objects, read or written on instances (not reachable
#: through a module path, so listed by name).
PRIVATE_ATTRIBUTES = {
    "_parameters",
    "_buffers",
    "_compiled_call_impl",
    "_opt_called",
    "_wrapped_by_lr_sched",
    "_option_string_actions",
    "_typehint",
    "_iterator",
    "_parallel_devices",
    "_hp_optimizer_states_linked",
    "_lazy_init_hp_params_optimizer_state",
    "_init_optimizers",
    "_restore_zero_state",
    "_PRECISION_INPUT",
    "_data_parallel_size",
    "_tensor_parallel_size",
}
INTERNALS = f"{PACKAGE}.core._internals"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module an import of ``name`` loads (``a.b.c`` -> the longest known prefix)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """Package modules imported anywhere in ``module`` (top level or inside functions)."""
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        found |= {r for n in names if n.startswith(PACKAGE) and (r := _resolve(n))}
    found.discard(module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "demos":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    if len(parts) == 2 and parts[1] in COMMAND_ENTRIES:
        return COMMAND_ENTRIES[parts[1]]
    return TOP


def test_the_graph_was_read() -> None:
    # the test reads something: the package has its layers and they import each other
    assert {
        "lightning_efficient.core.technique",
        "lightning_efficient.measure.memory.estimate",
    } <= set(MODULES)
    assert "lightning_efficient.core.compat" in GRAPH["lightning_efficient.core.technique"]
    assert sum(len(v) for v in GRAPH.values()) > 50


def test_no_upward_import() -> None:
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_main_imports_every_command() -> None:
    """Every command ``main`` runs is an edge of the graph (imported, not named by a string), and
    the commands sit above the planning floor, which does not import them."""
    from lightning_efficient.commands import EXTRA_COMMANDS, auto_fit_command

    room = f"{PACKAGE}.commands"
    runs = {fn.__module__ for _, fn in EXTRA_COMMANDS.values()} | {auto_fit_command.__module__}
    assert len(runs) == 6 and all(m.startswith(f"{room}.") for m in runs), runs
    assert runs <= GRAPH[room], runs - GRAPH[room]
    planning = f"{PACKAGE}.planning"
    assert _layer(f"{planning}.plan") < _layer(f"{room}.plan") == _layer(f"{PACKAGE}.__main__")
    assert f"{room}.options" in GRAPH[f"{room}.plan"] and planning in GRAPH[f"{room}.plan"]


def test_planning_sits_between_techniques_and_commands() -> None:
    """The planning floor imports the techniques it stacks (classes, not names) and nothing
    above it; the techniques never import it."""
    planning = {m for m in MODULES if m.startswith(f"{PACKAGE}.planning")}
    assert f"{PACKAGE}.techniques.activation_checkpointing" in GRAPH[f"{PACKAGE}.planning.ladder"]
    assert _layer(f"{PACKAGE}.techniques") < _layer(f"{PACKAGE}.planning") < _layer(PACKAGE)
    below = [f"{m} imports {d}" for m in MODULES if _layer(m) == 2 for d in GRAPH[m] & planning]
    assert not below, "\n".join(below)


#: The measure floor's rooms, each with the rooms it may import besides its own and the floor's
#: root (``step``, ``scratch``, ``plots``: what every room runs on, importing no room).
MEASURE = f"{PACKAGE}.measure"
MEASURE_ROOMS = {
    "memory": set(),
    "speed": {"memory"},  # FLOPs are counted on the estimate's fake tensors
    "trials": {"memory", "speed"},  # a real step's peak and time
    "profiling": {"memory", "speed"},  # the profiler reads both; it runs no trial
}


def _room(module: str) -> str | None:
    """The measure room of ``module``: ``""`` at the floor's root, ``"measure"`` for the floor's
    package itself (its public names and old paths: no module of the floor imports it), None
    outside the floor."""
    if module == MEASURE:
        return "measure"
    if not module.startswith(f"{MEASURE}."):
        return None
    room = module.split(".")[2]
    return room if room in MEASURE_ROOMS else ""


def test_measure_rooms_import_one_way() -> None:
    """memory <- speed <- trials, profiling: a room imports the floor's root, itself and the
    rooms before it; the root imports no room."""
    floor = {m: _room(m) for m in MODULES if m.startswith(f"{MEASURE}.")}
    assert set(floor.values()) == {"", *MEASURE_ROOMS}  # the rule sees every room
    assert f"{MEASURE}.memory.peak" in GRAPH[f"{MEASURE}.trials.trial"]  # it reads real edges
    wrong = [
        f"{m} ({room or 'root'}) imports {d}"
        for m, room in floor.items()
        for d in GRAPH[m]
        if (other := _room(d)) not in (None, "", room) and other not in MEASURE_ROOMS.get(room, ())
    ]
    assert not wrong, "\n".join(wrong)


#: The one module that imports by name: the class paths a user writes in yaml or a checkpoint.
NAME_IMPORTER = f"{PACKAGE}.core.validate"
#: ``"package.module:function"``: a call named by a string.
ENTRY_STRING = re.compile(rf"{PACKAGE}(\.\w+)*:\w+")
#: ``"package.module.name"``: a module or an object of the package named by a string.
DOTTED_STRING = re.compile(rf"{PACKAGE}(\.\w+)+")


def _string_named_calls(source: str, module: str = "") -> list[str]:
    """Strings that name a function or module of the package (``"pkg.mod:fn"``, ``"pkg.mod.fn"``;
    the demos, a user's model named as a user would in yaml, excepted) and imports by name
    (``import_module``, ``__import__``) outside :data:`NAME_IMPORTER`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            target = _resolve(text) if DOTTED_STRING.fullmatch(text) else None
            if ENTRY_STRING.fullmatch(text) or (target and _layer(target) is not None):
                found.append(f"line {node.lineno}: {text!r}")
        elif isinstance(node, ast.Call) and module != NAME_IMPORTER:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                found.append(f"line {node.lineno}: {name}(...)")
    return found


def test_no_string_named_calls() -> None:
    # what the rule looks for: the old command table and its runner
    sample = (
        'TABLE = {"plan": ("help", "lightning_efficient.planner:plan_command")}\n'
        'LATER = "lightning_efficient.commands.estimate.estimate_command"\n'
        'DEMO = "lightning_efficient.demos.TinyGPT"\n'
        "def run(name, argv):\n"
        "    import importlib\n"
        '    module, _, function = TABLE[name][1].partition(":")\n'
        "    return getattr(importlib.import_module(module), function)(argv)\n"
    )
    assert sorted(f.split(":")[0] for f in _string_named_calls(sample)) == [
        "line 1",
        "line 2",
        "line 7",
    ]
    found = {m: f for m in MODULES if (f := _string_named_calls(MODULES[m].read_text(), m))}
    assert not found, "import what you call:\n" + "\n".join(
        f"{m}: {', '.join(f)}" for m, f in found.items()
    )


def test_demos_import_nothing_of_the_package() -> None:
    demos = {m: d for m, d in GRAPH.items() if ".demos" in m}
    assert demos
    outside = [f"{m} imports {d}" for m, deps in demos.items() for d in deps if ".demos" not in d]
    assert not outside, "\n".join(outside)


def _cycles(graph: dict[str, set[str]] = GRAPH) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle() -> None:
    cycles = _cycles()
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _private_uses(module: str) -> list[str]:
    tree = ast.parse(MODULES[module].read_text())
    uses = []
    guarded_names = set(GUARDED)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                + [f"{node.module}.{a.name}" for a in node.names if node.module]
            )
            for name in names:
                parts = name.split(".")
                if parts[0] in GUARDED and any(
                    p.startswith("_") and not p.startswith("__") for p in parts[1:]
                ):
                    uses.append(f"line {node.lineno}: import {name}")
        elif isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in guarded_names:
                private = [a for a in chain if a.startswith("_") and not a.startswith("__")]
                if private:
                    uses.append(f"line {node.lineno}: {cur.id}.{'.'.join(reversed(chain))}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                uses.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            uses.append(f"line {node.lineno}: {node.value!r}")  # getattr(obj, "_name")
    return uses


def test_private_library_names_only_in_internals() -> None:
    assert _private_uses(INTERNALS), "the check must find the uses in _internals itself"
    found = {m: u for m in MODULES if m != INTERNALS and (u := _private_uses(m))}
    assert not found, "\n".join(f"{m}: {', '.join(u)}" for m, u in found.items())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= 600, f"{module} has {lines} lines (at most 600): split it by responsibility"


def _classes() -> list[tuple[str, type, int]]:
    found = []
    for module in MODULES:
        if module.endswith("__main__"):  # runs the command line when imported
            continue
        mod = importlib.import_module(module)
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == module and issubclass(cls, (Callback, Strategy)):
                source, _ = inspect.getsourcelines(cls)
                found.append((f"{module}.{cls.__name__}", cls, len(source)))
    return found


def test_callbacks_and_strategies_are_thin() -> None:
    classes = _classes()
    assert any(name.endswith(".ActivationCheckpointing") for name, _, _ in classes)
    fat = [f"{name}: {n} lines" for name, _, n in classes if n > 200]
    assert not fat, "callback/strategy classes over 200 lines:\n" + "\n".join(fat)


def _functions_taking_self(module: str) -> list[str]:
    """Module-level functions whose first parameter is ``self``: methods written outside their
    class (and attached to it), which hides the class's real size and responsibilities."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args]
            if params and params[0].arg == "self":
                found.append(f"line {node.lineno}: {node.name}(self, ...)")
    return found


def test_no_module_function_takes_self() -> None:
    sample = "def _count(self, batch):\n    return 1\n"  # what the rule looks for
    params = ast.parse(sample).body[0].args.args
    assert params[0].arg == "self"
    found = {m: f for m in MODULES if (f := _functions_taking_self(m))}
    assert not found, "split the class by responsibility instead:\n" + "\n".join(
        f"{m}: {', '.join(f)}" for m, f in found.items()
    )


def test_techniques_undo_through_the_base_only() -> None:
    """Every undo takes one path (``Technique.restore``, run at teardown and on an exception or
    interrupt): a technique records its changes and does not override ``restore``; a
    ``teardown`` or ``on_exception`` of its own (bookkeeping, e.g. putting the best weights
    back) still calls the base's."""
    from lightning_efficient.core.technique import Technique

    techniques = [
        cls for _, cls, _ in _classes() if issubclass(cls, Technique) and cls is not Technique
    ]
    assert len(techniques) >= 15
    own = [f"{cls.__qualname__}.restore" for cls in techniques if "restore" in vars(cls)]
    own += [
        f"{cls.__qualname__}.{hook} does not call super().{hook}"
        for cls in techniques
        for hook in ("teardown", "on_exception")
        if hook in vars(cls) and f"super().{hook}" not in inspect.getsource(vars(cls)[hook])
    ]
    assert not own, "record a Change instead (core/change.py):\n" + "\n".join(own)


def test_every_fetch_watch_sees_the_fetch_return() -> None:
    """A ``training_step(self, dataloader_iter)`` fetches inside the step: a ``FetchWatch`` that is
    not told when the fetch has returned (``on_fetched``) counts the rest of the step as waiting
    for data (StepProfiler did). Every user passes it, and times that fetch with the one
    ``StepFetch`` (``measure/speed/fetch_watch.py``)."""
    users = {}
    for module, path in MODULES.items():
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FetchWatch"
        ]
        if calls:
            users[module] = [len(c.args) + len(c.keywords) for c in calls]
    assert len(users) >= 2, users  # InputStallMonitor, StepProfiler
    blind = [m for m, arities in users.items() if min(arities) < 3]
    assert not blind, f"FetchWatch without on_fetched in: {blind}"
    timing = [m for m in MODULES if "StepFetch(" in MODULES[m].read_text()]
    assert set(timing) <= {f"{MEASURE}.speed.input_stall", f"{MEASURE}.profiling.step_phases"}
    assert len(timing) == 2, timing


# -- issue 50: the user's step runs through one function, the module is put back by one ----------
#: The one call of the user's step (``loss_fn`` or ``training_step``) and the one put-back.
STEP_RUNNER = (f"{PACKAGE}.measure.step", "run_step")
PUT_BACK = f"{PACKAGE}.measure.scratch"
#: The pieces of the put-back: only ``scratch`` (its module) calls them.
PUT_BACK_PIECES = {"keep_module_state", "keep_rng", "silenced_logging"}
#: Code that touches the user's step outside the runner, and why: the fit's own step, not a
#: measurement of it.
FIT_STEP = {
    f"{PACKAGE}.techniques.batch_size.guard": "wraps the fit's step on the instance; runs it in "
    "parts after an out-of-memory error, logging muted for the re-run",
    f"{PACKAGE}.techniques.accumulation.window": "binds the class's step past the guard's wrapper "
    "for the weighting probe, which runs it inside scratch (accumulation.probe.quiet_forward)",
}
#: The modules that call the runner, and where their ``scratch`` is (a module named here runs
#: it inside its own ``scratch``/``faked``, or says which callers hold it).
STEP_CALLERS = {
    f"{PACKAGE}.measure.step": "forward_backward: inside the trials' scratch",
    f"{PACKAGE}.measure.memory.track": "run_steps: inside the scratch of estimate_memory "
    "(swap_to_fake), measure_step and trial_within",
    f"{PACKAGE}.measure.speed.flops": "faked",
    f"{PACKAGE}.measure.speed.step_rate": "scratch",
    f"{PACKAGE}.techniques.packing.callback": "scratch",
}


def _step_uses(source: str) -> list[tuple[str, str, int]]:
    """``(what, enclosing function, line)`` for each use of the user's step (an attribute
    ``training_step`` read, ``getattr(x, "training_step")``, a call of ``loss_fn``), each call of
    a put-back piece, of ``run_step`` and of ``scratch``/``faked``."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name if func == "<module>" else func
        if isinstance(node, ast.Attribute) and node.attr == "training_step":
            found.append(("training_step", func, node.lineno))
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if name == "getattr" and "training_step" in args:
                found.append(("training_step", func, node.lineno))
            elif name in ("loss_fn", "run_step", "scratch", "faked", *PUT_BACK_PIECES):
                found.append((name, func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(source), "<module>")
    return found


def test_the_users_step_runs_through_one_function_inside_scratch() -> None:
    sample = (
        "def trial(m, b, loss_fn):\n    m.training_step(b, 0)\n    loss_fn(m, b)\n"
        "    keep_module_state(m)\n    getattr(m, 'training_step')(b)\n"
    )
    assert [w for w, _, _ in _step_uses(sample)] == [
        "training_step",
        "loss_fn",
        "keep_module_state",
        "training_step",
    ]  # what the rule looks for
    uses = {m: _step_uses(MODULES[m].read_text()) for m in MODULES}
    runner, function = STEP_RUNNER
    assert {w for w, f, _ in uses[runner] if f == function} == {"loss_fn", "training_step"}
    outside = [
        f"{m}:{line} {what} (in {func})"
        for m, found in uses.items()
        for what, func, line in found
        if what in ("training_step", "loss_fn") and (m, func) != STEP_RUNNER and m not in FIT_STEP
    ]
    outside += [
        f"{m}:{line} {what} (in {func})"
        for m, found in uses.items()
        for what, func, line in found
        if what in PUT_BACK_PIECES and m != PUT_BACK and m not in FIT_STEP
    ]
    assert not outside, (
        "run the user's step with measure.step.run_step, inside measure.scratch.scratch (which "
        "puts the module back), not on its own:\n" + "\n".join(outside)
    )
    callers = {m for m, found in uses.items() for what, _, _ in found if what == "run_step"}
    assert callers - {runner} == set(STEP_CALLERS) - {runner}, (
        "a new caller of run_step: run it inside scratch and name it in STEP_CALLERS"
    )
    unscratched = [
        m
        for m, where in STEP_CALLERS.items()
        if where in ("scratch", "faked") and not any(w == where for w, _, _ in uses[m])
    ]
    assert not unscratched, f"these run the step outside their scratch: {unscratched}"


# -- benchmarks/: a package of scripts over shared modules (issue 50) ------------------------------
BENCHMARKS = ROOT.parent / "benchmarks"
#: What a benchmark must not import: tests/ and every module in it (``helpers``, ...).
TEST_MODULES = {p.stem for p in Path(__file__).resolve().parent.rglob("*.py")} | {"tests"}
SYS_PATH_EDIT = re.compile(
    r"\bsys\.path\s*(\.\s*(insert|append|extend|remove)\b|\[[^\]]*\]\s*=(?!=)|\+?=(?!=))"
)


def _bench_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(BENCHMARKS.rglob("*.py"))}


def _is_script(source: str) -> bool:
    """A runnable script: it has an ``if __name__ == "__main__":`` block."""
    return any(
        isinstance(n, ast.If)
        and {"__name__", "__main__"} <= set(re.findall(r"\w+", ast.unparse(n.test)))
        for n in ast.parse(source).body
    )


def _imported_names(source: str, known: Iterable[str]) -> set[str]:
    """Every module ``source`` imports, inside functions too (``from a import b`` as ``a.b``
    where that is a module in ``known``; a relative import keeps its dots)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            }
    return found


def benchmark_rule_breaks(sources: dict[str, str]) -> list[str]:
    """What breaks the rules of ``benchmarks/`` (``sources``: dotted name -> code): an edit of
    ``sys.path`` (in a string run as a child's code too), a relative import, an import of
    ``tests/``, of a module by its file name (what only a ``sys.path`` edit finds), or of
    another runnable script (shared code lives in a module that is no script)."""
    scripts = {m for m, s in sources.items() if _is_script(s)}
    stems = {m.rpartition(".")[2] for m in sources}
    breaks = []
    for module, source in sorted(sources.items()):
        lines = source.splitlines()
        breaks += [
            f"{module}: line {i} edits sys.path"
            for i, ln in enumerate(lines, 1)
            if SYS_PATH_EDIT.search(ln)
        ]
        for name in sorted(_imported_names(source, sources)):
            top = name.split(".")[0]
            if name.startswith("."):
                breaks.append(f"{module} imports {name}: relative (import benchmarks.<module>)")
            elif top in TEST_MODULES:
                breaks.append(f"{module} imports {name} from tests/")
            elif top in stems and top != "benchmarks":
                breaks.append(f"{module} imports {name} by its file name (a sys.path import)")
            elif name in scripts and name != module:
                breaks.append(f"{module} imports {name}, a runnable script")
    return breaks


def test_benchmark_rules_see_what_they_look_for() -> None:
    sources = {
        "benchmarks.a": (
            "import sys\nsys.path.insert(0, 'x')\nfrom benchmarks.b import f\n"
            "if __name__ == '__main__':\n    f()\n"
        ),
        "benchmarks.b": "def f():\n    from helpers import tiny_model\n    from benchmarks import a\n",
        "benchmarks.c": "import _results\nfrom . import b\nCODE = 'import sys; sys.path[:0] = [x]'\n",
        "benchmarks._results": "PATHS = sys.path == []\n",
    }
    assert benchmark_rule_breaks(sources) == [
        "benchmarks.a: line 2 edits sys.path",
        "benchmarks.b imports benchmarks.a, a runnable script",
        "benchmarks.b imports helpers from tests/",
        "benchmarks.c: line 3 edits sys.path",
        "benchmarks.c imports .: relative (import benchmarks.<module>)",
        "benchmarks.c imports _results by its file name (a sys.path import)",
    ]
    graph = {m: _imported_names(s, sources) & set(sources) - {m} for m, s in sources.items()}
    assert _cycles(graph) == [["benchmarks.a", "benchmarks.b", "benchmarks.a"]]


def test_benchmarks_follow_their_rules() -> None:
    sources = _bench_sources()
    assert {"benchmarks.workloads", "benchmarks.gpu.suite", "benchmarks.site.make_index"} <= set(
        sources
    )
    breaks = benchmark_rule_breaks(sources)
    assert not breaks, "\n".join(breaks)


def test_benchmarks_have_no_import_cycle() -> None:
    sources = _bench_sources()
    graph = {m: _imported_names(s, sources) & set(sources) - {m} for m, s in sources.items()}
    assert graph["benchmarks.gpu.speed"] and graph["benchmarks.gpu.suite"], "the graph is read"
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_package_imports_no_benchmark_nor_test() -> None:
    """The package sits below ``benchmarks/`` and ``tests/``: it imports neither."""
    upward = [
        f"{m} imports {n}"
        for m, path in MODULES.items()
        for n in sorted(_imported_names(path.read_text(), ()))
        if n.split(".")[0] in TEST_MODULES | {"benchmarks"}
    ]
    assert not upward, "\n".join(upward)


def _folders_without_callback(techniques: Path) -> list[str]:
    """Technique folders (public packages under ``techniques``) without a ``callback.py``."""
    return sorted(
        p.name
        for p in techniques.iterdir()
        if (p / "__init__.py").exists() and not p.name.startswith("_")
        if not (p / "callback.py").exists()
    )


def test_every_technique_folder_keeps_its_callback_in_callback_py(tmp_path) -> None:
    """One place to open a technique: ``techniques/<name>/callback.py`` holds its callback (or
    strategy) class; the maths lives in the folder's other modules, named by idea."""
    from lightning_efficient.techniques import TECHNIQUES

    (tmp_path / "new_idea").mkdir()
    (tmp_path / "new_idea" / "__init__.py").write_text("")
    assert _folders_without_callback(tmp_path) == ["new_idea"]  # the rule sees a missing one
    assert not _folders_without_callback(ROOT / "techniques")
    folder = f"{PACKAGE}.techniques."
    in_folders = [c for c in TECHNIQUES if c.__module__.startswith(folder)]
    in_folders = [c for c in in_folders if "." in c.__module__.removeprefix(folder)]
    assert len(in_folders) >= 12
    elsewhere = [f"{c.__name__}: {c.__module__}" for c in in_folders]
    elsewhere = [line for line in elsewhere if not line.endswith(".callback")]
    assert not elsewhere, "move the class to its folder's callback.py:\n" + "\n".join(elsewhere)


def _classes_over(limit: int, modules: dict[str, Path]) -> list[str]:
    """Classes (nested ones too, decorators included) of ``modules`` longer than ``limit`` lines."""
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - start + 1) > limit:
                    found.append(f"{module}.{node.name}: {n} lines")
    return found


def test_no_class_over_200_lines(tmp_path) -> None:
    """Every class of the package, not only the callbacks and strategies: a class that grows past
    200 lines holds two responsibilities; move its pure parts to module functions."""
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * 200)
    assert _classes_over(200, {"big": big}) == ["big.Big: 201 lines"]  # the rule sees one
    over = _classes_over(200, MODULES)
    assert not over, "classes over 200 lines:\n" + "\n".join(over)


def _same_names(folder: Path) -> list[str]:
    """Module names that two files under ``folder`` share (``conftest.py`` aside)."""
    names: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        if path.name != "conftest.py":
            names.setdefault(path.stem, []).append(str(path.relative_to(folder)))
    return [f"{stem}: {', '.join(paths)}" for stem, paths in names.items() if len(paths) > 1]


def test_test_modules_have_unique_names(tmp_path) -> None:
    """The test folders mirror the package and every one is on the path (tests/conftest.py), so
    that tests and the 2-process scripts import each other by name: a second file of the same
    name would shadow the first."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_x.py").write_text("")
    assert _same_names(tmp_path) == ["test_x: a/test_x.py, b/test_x.py"]  # the rule sees one
    same = _same_names(Path(__file__).parent)
    assert not same, "rename one of each:\n" + "\n".join(same)


#: The one search of the largest micro-batch within a budget (issue 50): the planner, AutoEfficient
#: and EfficientBatchSize call it; no other function may search sizes against a budget.
SIZE_SEARCH = (f"{PACKAGE}.measure.memory.budget", "largest_within")
#: Names that say a function is about micro-batch sizes (a block count is another search).
_SIZE_WORDS = ("size", "micro", "divisor", "candidate")


def _mentions(node: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    names |= {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    return {n.lower() for n in names}


def _about_budget(node: ast.AST) -> bool:
    return any("budget" in n or n == "usable" for n in _mentions(node))


def _size_searches(source: str) -> list[tuple[str, str]]:
    """``(function, what)`` for each search of micro-batch sizes against a budget in ``source``
    (a top-level function or method, its closures included): a line to the budget (``(budget -
    x) / slope``), a bisection (``(lo + hi) // 2`` in a ``while``), or a loop over sizes that
    compares them with the budget."""
    tree = ast.parse(source)
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    defs += [
        m
        for c in tree.body
        if isinstance(c, ast.ClassDef)
        for m in c.body
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    found = []
    for fn in defs:
        if not any(w in n for n in _mentions(fn) for w in _SIZE_WORDS):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Div)
                and isinstance(node.left, ast.BinOp)
                and isinstance(node.left.op, ast.Sub)
                and _about_budget(node.left)
            ):
                found.append((fn.name, "a line to the budget"))
            elif isinstance(node, ast.While) and any(
                isinstance(b, ast.BinOp)
                and isinstance(b.op, ast.FloorDiv)
                and isinstance(b.left, ast.BinOp)
                and isinstance(b.left.op, ast.Add)
                for b in ast.walk(node)
            ):
                found.append((fn.name, "a bisection"))
            elif isinstance(node, (ast.For, ast.comprehension)) and any(
                w in n for n in _mentions(node.iter) for w in _SIZE_WORDS
            ):
                body = node.body if isinstance(node, ast.For) else node.ifs
                if any(
                    isinstance(c, ast.Compare) and _about_budget(c)
                    for b in body
                    for c in ast.walk(b)
                ):
                    found.append((fn.name, "sizes compared with the budget"))
    return found


def test_one_micro_batch_search() -> None:
    """The largest micro-batch within a budget is searched in one function
    (:data:`SIZE_SEARCH`); a second implementation (the planner's line through two estimates
    and EfficientBatchSize's bisection, issue 50) fails here."""
    module, function = SIZE_SEARCH
    seen = {(m, name) for m in MODULES for name, _ in _size_searches(MODULES[m].read_text())}
    assert (module, function) in seen  # the rule sees the one search
    others = sorted(f"{m}.{name}" for m, name in seen - {SIZE_SEARCH})
    assert not others, f"a second search of the micro-batch against a budget: {others}"
    # it can fail: the two engines of d4a4bb9, in short
    line = "def guess(sizes, low, slope, budget_bytes):\n    return (budget_bytes - low) / slope\n"
    bisect = (
        "def largest(fits, lo, hi, max_batch_size):\n    while hi - lo > 1:\n"
        "        mid = (lo + hi) // 2\n        lo, hi = (mid, hi) if fits(mid) else (lo, mid)\n"
    )
    walk = "def best(sizes, est, budget):\n    return max(n for n in sizes if est(n) <= budget)\n"
    assert [what for src in (line, bisect, walk) for _, what in _size_searches(src)] == [
        "a line to the budget",
        "a bisection",
        "sizes compared with the budget",
    ]


# -- issue 50: "trains without the key/value cache", declared once, read once per side -----------
#: The modules that switch a Hugging Face model's cache off for training: the fit's one reader of
#: ``trains_without_cache`` (the technique base), the estimate's (its plan), and the planner's
#: estimates and trials of a rung as AutoEfficient runs it.
CACHE_SWITCHERS = {
    f"{PACKAGE}.core.technique",
    f"{PACKAGE}.measure.memory.types",
    f"{PACKAGE}.planning.search",
}


def _cache_switchers(sources: dict[str, str]) -> set[str]:
    return {
        m
        for m, src in sources.items()
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None))
        == "apply_training_without_cache"
    }


def test_the_cache_is_switched_by_the_flags_readers_only() -> None:
    """A technique declares ``trains_without_cache``; only the readers switch the cache (the three
    techniques and AutoEfficient each switched it themselves before)."""
    sources = {m: p.read_text() for m, p in MODULES.items()}
    assert _cache_switchers(sources) == CACHE_SWITCHERS
    # it can fail: a technique that switches it in its own hook
    own = "def on_fit_start(self, trainer, m):\n    self.record(trainer, apply_training_without_cache(m))\n"
    assert _cache_switchers({"x": own}) == {"x"}
    # a flagged technique that overrides on_train_start calls the base's (the reader)
    from lightning_efficient.core.technique import Technique

    for _, cls, _ in _classes():
        if issubclass(cls, Technique) and "on_train_start" in vars(cls):
            flagged = cls.trains_without_cache or cls.__name__ == "AutoEfficient"
            body = inspect.getsource(vars(cls)["on_train_start"])
            assert not flagged or "super().on_train_start" in body, cls.__name__
