"""torch.compile, in place and per block, with compile time measured apart from step time.

- ``functions.py``: ``apply_compile`` (in place, per block or the whole model; the ``Change``
  puts back exactly what each module had), ``compiled_modules``, ``uncompile_modules``, the
  backend and mode names.
- ``scope.py``: what is compiled (``scope``): the rule ``choose_scope`` (a pure function) and
  ``auto_scope``, which chooses from the instrument's compile trial
  (:mod:`lightning_efficient.measure.trials.compile_trial`: both scopes timed on real steps, the
  module put back).
- ``watch.py``: ``CompileWatch`` (compilations, recompilations, graph breaks and where),
  ``recompile_reasons``.
- ``report.py``: the report's line and notes (graph breaks in words, no raw Dynamo text).
- ``callback.py``: ``TorchCompile``, which decides when to call these and reports compile time,
  first-step time and steady-state step time apart.
"""

from lightning_efficient.techniques.compile.callback import TorchCompile
from lightning_efficient.techniques.compile.functions import (
    apply_compile,
    compiled_modules,
    uncompile_modules,
    valid_backends,
    valid_modes,
)
from lightning_efficient.techniques.compile.watch import CompileWatch, recompile_reasons

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
