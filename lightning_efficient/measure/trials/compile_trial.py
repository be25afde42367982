"""The compile trial (``TorchCompile(scope="auto")``): each scope compiled and timed on real steps
of the module, on the instrument for real steps, the module put back after.

- :func:`trial_scopes`: compile time (Dynamo's compile events) and steady step time of forward +
  backward (:func:`~lightning_efficient.measure.step.forward_backward`, timed with
  :func:`~lightning_efficient.measure.speed.timing.time_once`) for each scope, the steps of the
  scopes interleaved, inside :func:`~lightning_efficient.measure.scratch.scratch`: the module's
  weights, buffers, attributes, metric states, gradients and the RNG are put back, so the fit's
  losses are the plain run's. A scope that fails to compile or runs out of memory is a result (the
  other may run); an error of the user's own step (the step raises eagerly too) is raised.
- :func:`installed`: compiled calls put in place for a while.
- :func:`describe_error`: ``Type: first line`` of a compile error and of its root cause.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_efficient.core._internals import (
    compiled_call,
    install_compiled_call,
    is_dynamo_error,
)
from lightning_efficient.core.change import Change
from lightning_efficient.measure.scratch import scratch
from lightning_efficient.measure.speed.timing import time_once
from lightning_efficient.measure.step import forward_backward
from lightning_efficient.measure.trials.trial import is_out_of_memory

__all__ = ["AUTO_STEPS", "AUTO_WARMUP", "describe_error", "installed", "trial_scopes"]

#: Trial steps per scope: untimed (the compile happens in the first) and timed (the median).
AUTO_WARMUP, AUTO_STEPS = 2, 5


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


@contextlib.contextmanager
def installed(module: nn.Module, calls: dict[str, Any]) -> Iterator[None]:
    """``calls`` (submodule name -> compiled call) in place while inside, then what was there."""
    changes = [
        install_compiled_call(module.get_submodule(n) if n else module, c) for n, c in calls.items()
    ]
    with Change.of("compiled calls installed", changes):
        yield


def _users_error(err: BaseException, eager_step: Callable[[], Any]) -> BaseException | None:
    """The error of the user's own step, when ``err`` (raised while a scope ran) is one: the
    step raises without compiling too. ``None`` for a compile failure or an out-of-memory."""
    if is_out_of_memory(err) or is_dynamo_error(err):
        return None
    try:
        eager_step()
    except Exception as eager:  # noqa: BLE001 - returned, the caller raises it
        return eager
    return None


def trial_scopes(
    compile_as: Callable[[str, Callable[[BaseException], None]], Change],
    module: nn.Module,
    batch: Any,
    device: torch.device,
    forward_context: Callable[[], Any],
    compile_seconds: Callable[[], float],
    *,
    strict: bool = False,
    warmup: int = AUTO_WARMUP,
    steps: int = AUTO_STEPS,
    scopes: tuple[str, ...] = ("regional", "whole"),
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]], dict[str, str]]:
    """Compile ``module`` each way (``compile_as(scope, on_error)``: an ``apply_compile``
    change) and run ``warmup`` forward + backward steps of its training step on ``batch`` (the
    first compiles: ``compile_s`` is Dynamo's compile time meanwhile, ``first_step_s`` that
    step's time), undoing each compile after it; then time ``steps`` rounds, each one step of
    every scope that compiled, the order alternating (load that comes and goes hits both alike),
    with the compiled calls put back in turn (no new compile). The module is put back exactly
    (:func:`~lightning_efficient.measure.scratch.scratch`). Returns the timings per scope
    (``steady_step_s``: the median), the compiled calls per scope (to install the chosen one
    without compiling again) and why a scope failed (with ``strict``, it raises). An error the
    user's step raises eagerly too is raised, whatever ``strict``."""
    timings: dict[str, dict[str, float]] = {}
    calls: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    step = forward_backward(module, batch, context=forward_context, keep_grads=False)

    def failed(scope: str, err: BaseException) -> None:
        users = _users_error(err, step)
        if users is not None:
            raise users
        errors[scope] = describe_error(err)
        timings.pop(scope, None)
        calls.pop(scope, None)
        if strict:
            raise err

    with scratch(module):
        for scope in scopes:
            caught: list[BaseException] = []
            change = compile_as(scope, caught.append)
            try:
                before = compile_seconds()
                first = time_once(step, device)
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
            except Exception as err:  # out of memory in one scope (the other may fit), ...
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
                        measured[scope].append(time_once(step, device))
                except Exception as err:
                    failed(scope, err)
        for scope, times in measured.items():
            if scope in timings and times:
                timings[scope]["steady_step_s"] = statistics.median(times)
    return timings, calls, errors
