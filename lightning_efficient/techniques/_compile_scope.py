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
- ``trial_scopes``: compile time (Dynamo compile events) and steady step time of forward +
  backward of the module's training step on one batch for each scope, the steps of the two
  scopes interleaved, the module put back exactly afterwards (weights, gradients, RNG: the
  fit's losses are the plain run's); ``choose_by_trial`` chooses from them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import compiled_call, set_compiled_call
from lightning_efficient.core.validate import check_choice
from lightning_efficient.measure.step import loss_of

__all__ = [
    "SCOPES",
    "WHOLE_FASTER",
    "ScopeChoice",
    "choose_by_trial",
    "choose_scope",
    "default_scope",
    "describe_error",
    "resolve_scope",
    "installed",
    "put_back",
    "trial_scopes",
]

#: What ``TorchCompile(scope=...)`` accepts.
SCOPES = ("auto", "regional", "whole")
#: ``scope="auto"`` keeps the whole model when regional's steady step is more than this many
#: times the whole model's (3% slower); else regional, whose compile time is smaller.
WHOLE_FASTER = 1.03
#: Trial steps per scope: untimed (the compile happens in the first) and timed (the median).
AUTO_WARMUP, AUTO_STEPS = 2, 5


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


def resolve_scope(scope: str | None, regional: bool | None) -> str | None:
    """The scope of ``TorchCompile(scope=, regional=)``: ``regional`` (the older argument) maps
    to ``"regional"``/``"whole"``; both given must agree; ``None``: the device's default."""
    if scope is not None:
        check_choice("scope", scope, SCOPES)
    if regional is None:
        return scope
    implied = "regional" if regional else "whole"
    if scope is not None and scope != implied:
        raise ValueError(
            f"`regional`={regional!r} means scope={implied!r}, but `scope`={scope!r} was given; "
            "pass one of them (`scope` is the newer argument)."
        )
    return implied


@contextlib.contextmanager
def put_back(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Run trial steps on ``module`` and put it back exactly: weights and buffers (a copy on
    their device), gradients, the RNG state (dropout draws the same numbers in the fit), and
    ``self.log`` muted meanwhile."""
    from lightning_efficient.measure.step import silenced_logging

    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    grads = {n: p.grad for n, p in module.named_parameters()}
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), silenced_logging(module):
            yield
    finally:
        with torch.no_grad():
            module.load_state_dict(saved)
        for n, p in module.named_parameters():
            p.grad = grads[n]


@contextlib.contextmanager
def installed(module: nn.Module, calls: dict[str, Any]) -> Iterator[None]:
    """``calls`` (submodule name -> compiled call) in place while inside, then what was there."""
    targets = [(n, module.get_submodule(n) if n else module) for n in calls]
    previous = [compiled_call(m) for _, m in targets]
    for name, m in targets:
        set_compiled_call(m, calls[name])
    try:
        yield
    finally:
        for (_, m), call in zip(targets, previous):
            set_compiled_call(m, call)


def _timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def trial_scopes(
    compile_as: Callable[[str, Callable[[BaseException], None]], Any],
    module: nn.Module,
    batch: Any,
    device: torch.device,
    forward_context: Callable[[], Any],
    compile_seconds: Callable[[], float],
    *,
    strict: bool = False,
    warmup: int = AUTO_WARMUP,
    steps: int = AUTO_STEPS,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]], dict[str, str]]:
    """Compile ``module`` each way (``compile_as(scope, on_error)``: an ``apply_compile`` change)
    and run ``warmup`` forward + backward steps of its training step on ``batch`` (the first
    compiles: ``compile_s`` is Dynamo's compile time meanwhile, ``first_step_s`` that step's
    time), undoing each compile after it; then time ``steps`` rounds, each one step of every
    scope that compiled, the order alternating (load that comes and goes hits both alike), with
    the compiled calls put back in turn (no new compile). The module is put back exactly
    (``put_back``). Returns the timings per scope (``steady_step_s``: the median), the compiled
    calls per scope (to install the chosen one without compiling again) and why a scope failed
    (with ``strict``, it raises)."""
    timings: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}

    def step() -> None:
        with forward_context():
            loss = loss_of(module.training_step(batch, 0))
        loss.backward()
        for p in module.parameters():
            p.grad = None

    def failed(scope: str, err: BaseException) -> None:
        errors[scope] = describe_error(err)
        timings.pop(scope, None)
        calls.pop(scope, None)
        if strict:
            raise err

    with put_back(module, device):
        for scope in ("regional", "whole"):
            caught: list[BaseException] = []
            change = compile_as(scope, caught.append)
            try:
                before = compile_seconds()
                first = _timed(step, device)
                for _ in range(max(0, warmup - 1)):
                    step()
                if not caught:
                    timings[scope] = {
                        "compile_s": compile_seconds() - before,
                        "first_step_s": first,
                    }
                    calls[scope] = {
                        n: compiled_call(module.get_submodule(n) if n else module)
                        for n in change.value
                    }
            except Exception as err:  # e.g. out of memory in one scope: the other may fit
                caught.append(err)
            finally:
                change.undo()
            if caught:
                failed(scope, caught[0])
        measured: dict[str, list[float]] = {scope: [] for scope in calls}
        for r in range(steps):
            for scope in list(measured)[:: 1 if r % 2 == 0 else -1]:
                if scope not in calls:
                    continue
                try:
                    with installed(module, calls[scope]):
                        measured[scope].append(_timed(step, device))
                except Exception as err:
                    failed(scope, err)
        for scope, times in measured.items():
            if scope in timings and times:
                timings[scope]["steady_step_s"] = statistics.median(times)
    return timings, calls, errors


def describe_error(err: BaseException) -> str:
    """``Type: first line`` of a compile error, followed by its root cause's."""

    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__

    out = line(err)
    cause = getattr(err, "inner_exception", None) or err.__cause__
    if cause is not None and cause is not err and line(cause) not in out:
        out += f" {line(cause)}"
    return out


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
