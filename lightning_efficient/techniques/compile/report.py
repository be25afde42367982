"""What ``TorchCompile`` tells the user: one line for the efficiency report (what runs compiled,
how many graphs, how many graph breaks) and, when it applies, one note on the breaks in words,
or the warning that Dynamo captured no graph."""

from __future__ import annotations

from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.techniques.compile.watch import CompileWatch, describe_breaks

__all__ = ["compile_line", "no_graphs_warning"]


def _span(names: list[str]) -> str:
    shown = [n or "<model>" for n in names]
    return shown[0] if len(shown) == 1 else f"{shown[0]} .. {shown[-1]}"


def no_graphs_warning(
    module: nn.Module, names: list[str] | None, watch: CompileWatch | None, steps: int, calls: int
) -> str:
    """The warning when the training steps never called a module that was compiled (``calls``:
    the compiled modules' calls), or when only torch.nn's own layers were compiled, the model ran,
    and Dynamo captured no graph (it skips their frames); ``""`` otherwise."""
    names = names or []
    if names and steps > 0 and calls == 0:
        what = "the module's own forward" if names == [""] else f"the compiled {_span(names)}"
        return (
            f"0 graphs compiled: the training step never calls {what} (it calls other modules "
            "directly), so everything runs eagerly. Compile what `training_step` calls: its "
            "blocks (scope='regional', `blocks=`), or call the model through `self(...)`."
        )
    torch_nn_only = bool(names) and all(
        type(module.get_submodule(n)).__module__.startswith("torch.nn.") for n in names
    )
    if not (torch_nn_only and watch is not None and steps > 0 and watch.compiles == 0):
        return ""
    return (
        f"0 graphs compiled for {len(names)} {'blocks' if names != [''] else 'model'} "
        f"({_span(names)}): Dynamo skips these modules' frames (torch.nn's own layers are not "
        "traced on their own); everything runs eagerly. Pass `blocks=` a block class that "
        "contains such layers, or regional=False."
    )


def compile_line(
    compiled: Change,
    fell_back: str | None,
    no_graphs: bool,
    watch: CompileWatch | None,
    steps: int,
) -> tuple[str, str, bool]:
    """``(line, note, runs_compiled)``: the report's line (``"compiled the whole model
    (inductor); 5 graphs, 4 graph breaks"``: never "the whole model" alone when it broke), the
    note on the graph breaks (``""``: none) and whether anything runs compiled."""
    names = compiled.value or []
    if fell_back:
        return f"compile failed, fell back to eager ({fell_back})", "", False
    if no_graphs:
        return f"0 graphs compiled: {len(names)} modules run eagerly", "", False
    if watch is None or not steps:
        return compiled.what, "", bool(names)
    n, breaks = watch.compiles, watch.breaks()
    line = f"{compiled.what}; {n} graph{'' if n == 1 else 's'}"
    total = sum(breaks.values())
    if total:
        line += f", {total} graph break{'' if total == 1 else 's'} (not one graph)"
    return line, describe_breaks(breaks, watch.break_sites()), bool(names)
