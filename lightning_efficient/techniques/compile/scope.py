"""What ``TorchCompile`` compiles: the repeated blocks (regional) or the whole model, chosen by
measurement on the device (``scope="auto"``).

Regional compile takes a fraction of the whole model's compile time (identical blocks share one
graph) but leaves the parts between the blocks eager and pays a fixed cost per compiled call. How
much speed that costs depends on the device: on an NVIDIA H200 (issue 29's record, TinyGPT at
GPT-2 124M shape, batch 8 x 1024, bf16 autocast, inductor) regional compiled in 8.2 s and ran at
1.05x eager, the whole model compiled in 16.6 s and ran at 1.54x eager: regional at 0.69 of the
whole model's speed. On this project's 2-core CPU regional ran at 0.95-0.99 of the whole model
at about 0.3 of its compile time (``benchmarks/compile.py``). So:

- ``choose_scope`` (pure): the whole model when its steady step is more than ``WHOLE_FASTER``
  (3%) faster than regional's, else regional (the smaller compile time);
- ``default_scope``: ``"auto"`` on a CUDA device (measure both there), ``"regional"`` elsewhere
  (measured on the CPU);
- ``choose_by_trial``: the instrument's compile trial
  (:func:`~lightning_efficient.measure.trials.compile_trial.trial_scopes`: both scopes compiled and
  timed on real steps, the module put back after) on the strategy's device, then ``choose_scope``;
- ``auto_scope``: what ``TorchCompile(scope="auto")`` does at its first batch: the trial, the
  chosen scope's compiled calls installed (no second compile), and what to tell the user.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change
from lightning_efficient.measure.trials.compile_trial import trial_scopes

__all__ = [
    "SCOPES",
    "WHOLE_FASTER",
    "AutoScope",
    "ScopeChoice",
    "auto_scope",
    "choose_by_trial",
    "choose_scope",
    "default_scope",
]

#: What ``TorchCompile(scope=...)`` accepts.
SCOPES = ("auto", "regional", "whole")
#: ``scope="auto"`` keeps the whole model when regional's steady step is more than this many
#: times the whole model's (3% slower); else regional, whose compile time is smaller.
WHOLE_FASTER = 1.03


@dataclass
class ScopeChoice:
    """The scope chosen and the figures it was chosen by (seconds; ``None``: not measured, with
    ``errors`` saying why)."""

    scope: str
    reason: str
    regional_step_s: float | None = None
    whole_step_s: float | None = None
    regional_compile_s: float | None = None
    whole_compile_s: float | None = None
    errors: dict[str, str] | None = None

    def figures(self) -> dict[str, Any]:
        """The report figures (``scope`` and the four measurements)."""
        return {
            "scope": self.scope,
            "regional_step_s": self.regional_step_s,
            "whole_step_s": self.whole_step_s,
            "regional_compile_s": self.regional_compile_s,
            "whole_compile_s": self.whole_compile_s,
        }

    def describe(self) -> str:
        """One line: the choice and both figures."""

        def both(kind: str, unit: float, fmt: str) -> str:
            out = []
            for scope in ("regional", "whole"):
                value = getattr(self, f"{scope}_{kind}")
                out.append(f"{scope} " + ("-" if value is None else fmt.format(value * unit)))
            return ", ".join(out)

        return (
            f"scope auto chose {self.scope} ({self.reason}): steady step "
            f"{both('step_s', 1e3, '{:.1f} ms')}; compile {both('compile_s', 1, '{:.1f} s')}"
        )


def choose_scope(
    regional_step_s: float | None,
    whole_step_s: float | None,
    *,
    regional_compile_s: float | None = None,
    whole_compile_s: float | None = None,
    threshold: float = WHOLE_FASTER,
    fallback: str = "regional",
    errors: dict[str, str] | None = None,
) -> ScopeChoice:
    """The whole model when its steady step is more than ``threshold`` times faster than
    regional's; else regional. A scope that was not measured (``None``: it failed to compile or
    to run) is not chosen; when neither was, ``fallback``."""
    figures = dict(
        regional_step_s=regional_step_s,
        whole_step_s=whole_step_s,
        regional_compile_s=regional_compile_s,
        whole_compile_s=whole_compile_s,
        errors=errors or None,
    )
    if regional_step_s is None and whole_step_s is None:
        return ScopeChoice(fallback, "neither scope could be measured", **figures)
    if whole_step_s is None:
        return ScopeChoice("regional", "the whole model could not be measured", **figures)
    if regional_step_s is None:
        return ScopeChoice("whole", "regional could not be measured", **figures)
    ratio = regional_step_s / whole_step_s
    if ratio > threshold:
        reason = f"the whole model's step is {ratio:.2f}x faster, more than {threshold:.2f}x"
        return ScopeChoice("whole", reason, **figures)
    reason = (
        f"regional's step is within {threshold:.2f}x of the whole model's ({ratio:.3f}x) "
        "and compiles less"
    )
    return ScopeChoice("regional", reason, **figures)


def default_scope(device: torch.device | str) -> str:
    """``"auto"`` on a CUDA device (where regional ran at 0.69 of the whole model on an H200),
    ``"regional"`` elsewhere (0.95-0.99 of it on a CPU, at about a third of the compile time)."""
    return "auto" if torch.device(device).type == "cuda" else "regional"


def choose_by_trial(
    compile_as: Callable[[str, Callable[[BaseException], None]], Any],
    module: nn.Module,
    batch: Any,
    strategy: Any,
    compile_seconds: Callable[[], float],
    *,
    strict: bool = False,
) -> tuple[ScopeChoice, dict[str, dict[str, Any]], dict[str, str]]:
    """``trial_scopes`` on the strategy's device under its precision, then ``choose_scope``
    (falling back to the whole model on CUDA, regional elsewhere, when neither could be
    measured), rank zero's choice broadcast to every rank. Returns the choice, the compiled
    calls per scope and why a scope failed on this rank."""
    device = strategy.root_device
    timings, calls, errors = trial_scopes(
        compile_as,
        module,
        batch,
        device,
        strategy.precision_plugin.forward_context,
        compile_seconds,
        strict=strict,
    )
    regional, whole = timings.get("regional", {}), timings.get("whole", {})
    choice = choose_scope(
        regional.get("steady_step_s"),
        whole.get("steady_step_s"),
        regional_compile_s=regional.get("compile_s"),
        whole_compile_s=whole.get("compile_s"),
        fallback="whole" if device.type == "cuda" else "regional",
        errors=errors,
    )
    return strategy.broadcast(choice, src=0), calls, errors


@dataclass
class AutoScope:
    """What ``auto_scope`` did: the ``choice``, the ``change`` that installed its compiled calls
    (``None``: nothing installed here), and a ``warning`` for the user (``""``: none)."""

    choice: ScopeChoice
    change: Change | None
    warning: str = ""


def auto_scope(
    compile_as: Callable[[str, Callable[[BaseException], None]], Change],
    module: nn.Module,
    batch: Any,
    strategy: Any,
    compile_seconds: Callable[[], float],
    on_error: Callable[[BaseException], None],
    *,
    strict: bool = False,
) -> AutoScope:
    """``scope="auto"``: ``choose_by_trial``, then the chosen scope in place with the compiled
    calls the trial made (Dynamo's cache serves them: no second compile), failing over to
    ``on_error``; a scope chosen on another rank is compiled here (``compile_as``)."""
    from lightning_efficient.techniques.compile.functions import reinstall

    choice, calls, errors = choose_by_trial(
        compile_as, module, batch, strategy, compile_seconds, strict=strict
    )
    change = None
    if choice.scope in calls:
        change = reinstall(module, calls[choice.scope], on_error, whole=choice.scope == "whole")
    elif not errors.get(choice.scope):  # measured elsewhere (another rank): compile here
        change = compile_as(choice.scope, on_error)
    warning = ""
    if errors:
        failed = "; ".join(f"{s} failed ({e})" for s, e in errors.items())
        using = f"using {choice.scope}" if change is not None else "running eagerly"
        warning = f"scope auto: {failed}; {using}."
    return AutoScope(choice, change, warning)
