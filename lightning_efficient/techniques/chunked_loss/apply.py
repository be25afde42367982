"""Make an unmodified model's cross-entropy come from its output projection in chunks.

- ``find_output_projection(model, head=None)``: the ``nn.Linear`` whose output is the logits:
  ``head`` when named; else the output head by the package's one rule
  (``measure.memory.heads.find_output_head``: a Hugging Face model's output embeddings, a linear
  layer tied to an embedding, a linear layer as wide as the largest embedding); else, in a model
  without embeddings, the last linear layer.
- ``loss_refusal(model)``: why the model's loss cannot be reproduced from chunks (a Hugging Face
  config that caps, scales or adds a z-loss to the logits), or ``None``.
- ``apply_chunked_cross_entropy(model, ...)``: while training (grad enabled), the projection
  returns :class:`~.lazy.LazyLogits` instead of computing the logits; ``F.cross_entropy`` on them
  (Hugging Face's ``loss_function`` calls it after ``logits.float().view(-1, V)``; a plain module
  after ``logits.view(-1, V)``) computes the loss in chunks (:mod:`.backends`). Anything else
  that reads the logits gets the full logits, computed as before, and the session says so once.
  Without grad (validation, generation) the projection is as it was. Returns a ``Change``
  (``core/change.py``) whose ``value`` is the :class:`LossSession` and whose ``undo()`` puts the
  projection's ``forward`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_efficient.core.change import Change, patch_attribute
from lightning_efficient.core.validate import SettingsError, check_module
from lightning_efficient.measure.memory.heads import find_output_head, hf_output_head
from lightning_efficient.techniques.chunked_loss import backends
from lightning_efficient.techniques.chunked_loss.kernel import (
    DEFAULT_CHUNK_BYTES,
    REDUCTIONS,
    chunk_rows,
)
from lightning_efficient.techniques.chunked_loss.lazy import LOSS_DTYPES, LazyLogits, LogitsSource

__all__ = [
    "LossSession",
    "apply_chunked_cross_entropy",
    "find_output_projection",
    "loss_refusal",
    "worth_chunking",
]

#: Hugging Face config fields that change the logits between the projection and the loss:
#: field -> (the value that changes nothing, what the model does with it).
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None, "caps its logits with tanh (soft-capping)"),
    "logit_scale": (None, "multiplies its logits by a scale"),
    "logits_scaling": (1.0, "divides its logits by a scale"),
    "z_loss_coefficient": (0.0, "adds a z-loss (the squared log-sum-exp of the logits)"),
}


def find_output_projection(model: nn.Module, head: str | None = None) -> tuple[str, nn.Linear, str]:
    """``(name, linear, how it was found)`` of the layer whose output is the logits: ``head``
    when named; else the output head by the package's one rule
    (:func:`~lightning_efficient.measure.memory.heads.find_output_head`); else, for a model without
    any ``nn.Embedding`` (one fed hidden states), its last linear layer.

    Raises a ``ValueError`` when ``head`` names no ``nn.Linear`` of ``model`` (or a
    ``TypeError`` when it is not a string), or when nothing is found."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if head is not None:
        if not isinstance(head, str) or not head:
            raise TypeError(
                "`head` must be the name of the output projection (a non-empty string, e.g. "
                f"'model.lm_head') or None; got {head!r} ({type(head).__name__})."
            )
        try:
            module = model.get_submodule(head)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear):
            inner = [n for n in linears if n.startswith(f"{head}.")]
            hint = f" (did you mean {inner[0]!r}, the nn.Linear inside it?)" if inner else ""
            raise ValueError(
                f"`head` must name an nn.Linear of the model (the output projection); got "
                f"{head!r} ({type(module).__name__ if module is not None else 'no such module'})"
                f"{hint}. Its linear layers: {', '.join(linears[-5:]) or 'none'}"
                + (" (the last 5)" if len(linears) > 5 else "")
                + "."
            )
        return head, module, "named by `head`"
    found = find_output_head(model)
    if found is not None:
        return found.name, found.linear, found.how
    has_embedding = any(isinstance(m, nn.Embedding) for m in model.modules())
    if linears and not has_embedding:
        name = linears[-1]
        return name, model.get_submodule(name), "the last linear layer (the model has no embedding)"
    raise ValueError(
        "found no output projection: "
        + (
            "no nn.Linear is as wide as the model's largest nn.Embedding (its vocabulary) nor "
            "tied to it"
            if has_embedding
            else "the model has no nn.Linear layer"
        )
        + ". ChunkedCrossEntropy needs the logits to come from an nn.Linear: pass its name as "
        f"`head=` (its linear layers: {', '.join(linears[-5:]) or 'none'}"
        + (", the last 5" if len(linears) > 5 else "")
        + ")."
    )


def loss_refusal(model: nn.Module) -> str | None:
    """Why chunks cannot reproduce ``model``'s loss exactly (``None``: they can, as far as its
    configuration tells; what the code does to the logits is checked at every call)."""
    found = hf_output_head(model)
    if found is None:
        return None
    name, owner, _ = found
    config = owner.config
    for key, (neutral, what) in _LOGIT_TRANSFORMS.items():
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            return (
                f"{type(owner).__name__} {what} ({key}={value!r} in its config) between "
                f"`{name}` and the loss: the loss from chunks of the plain projection would "
                "differ. Remove ChunkedCrossEntropy for this model."
            )
    return None


#: Logits this many times wider than the hidden states are what chunking is for (a language
#: model's vocabulary: GPT-2's is 65 times its width); a narrower output layer is not.
WIDE_LOGITS = 4


def worth_chunking(model: nn.Module, head: str | None = None) -> bool:
    """Whether ``ChunkedCrossEntropy`` applies to ``model`` and can save much: an output
    projection is found, the model's loss is not refused, and its logits are at least
    ``WIDE_LOGITS`` times as wide as the hidden states (the planner offers it then)."""
    try:
        _, linear, _ = find_output_projection(model, head)
    except ValueError:
        return False
    return loss_refusal(model) is None and linear.out_features >= WIDE_LOGITS * linear.in_features


@dataclass
class LossSession:
    """Computes the losses of lazy logits and counts what happened.

    Attributes:
        backend: The backend asked for (``backends.BACKENDS``).
        chunk_bytes: One chunk's float32 logits at most (the chunked backend).
        say: Called with a message the first time something is worth saying (once each).
        by_backend: Loss calls computed by each backend.
        fallbacks: Calls that needed the full logits, by what needed them.
        rows: Rows per chunk of the last chunked call; ``why``: why the last backend was chosen.
    """

    backend: str = "auto"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    say: Callable[[str], None] = lambda message: None
    available: dict[str, bool] = field(default_factory=backends.available_libraries)
    by_backend: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    why: str = ""
    head: str = ""

    def why_not(self, logits: LazyLogits, args: dict[str, Any]) -> str | None:
        """Why ``F.cross_entropy(**args)`` on ``logits`` cannot be computed from chunks."""
        target = args["target"]
        if logits.dim() != 2:
            return f"logits of {logits.dim()} dimensions (chunks take (N, vocabulary))"
        if not isinstance(target, torch.Tensor) or isinstance(target, LazyLogits):
            return "targets that are not a tensor of class indices"
        if target.dtype != torch.int64 or tuple(target.shape) != tuple(logits.shape[:1]):
            return "targets that are not (N,) class indices (int64)"
        if args["weight"] is not None:
            return "class weights (weight=)"
        if args["size_average"] is not None or args["reduce"] is not None:
            return "the deprecated size_average/reduce arguments"
        smoothing = args["label_smoothing"]
        if not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
            return f"label_smoothing={smoothing!r}"
        if args["reduction"] not in REDUCTIONS:
            return f"reduction={args['reduction']!r} (chunks compute 'mean' and 'sum')"
        dtypes = (logits.dtype, logits.source.compute_dtype, logits.source.weight.dtype)
        if any(d not in LOSS_DTYPES for d in dtypes):
            return "float64 logits or weights"
        return None

    def loss(self, logits: LazyLogits, args: dict[str, Any]) -> torch.Tensor:
        """The loss of ``F.cross_entropy(**args)`` (``why_not`` said it can), from chunks."""
        source = logits.source
        call = backends.Call(
            device_type=source.device_type,
            has_bias=source.bias is not None,
            label_smoothing=float(args["label_smoothing"]),
            reduction=args["reduction"],
        )
        backend, self.why = backends.choose_backend(self.backend, call, self.available)
        autocast = torch.is_autocast_enabled(source.device_type)
        hidden = logits.hidden
        loss = backends.run(
            backend,
            hidden,
            source.weight,
            source.bias,
            args["target"],
            ignore_index=int(args["ignore_index"]),
            label_smoothing=call.label_smoothing,
            reduction=call.reduction,
            compute_dtype=source.compute_dtype,
            logit_casts=logits.casts,
            # what F.cross_entropy returns: float32 under autocast (CUDA's and the CPU's policy)
            out_dtype=torch.float32 if autocast else logits.dtype,
            chunk_bytes=self.chunk_bytes,
        )
        self.by_backend[backend] = self.by_backend.get(backend, 0) + 1
        if backend == "chunked":
            self.rows = chunk_rows(source.weight.shape[0], hidden.shape[0], self.chunk_bytes)
        return source.attach_hooks(loss)

    def fell_back(self, source: LogitsSource, what: str) -> None:
        """``what`` needed the full logits of ``source``: counted, and said once."""
        first = what not in self.fallbacks
        self.fallbacks[what] = self.fallbacks.get(what, 0) + 1
        if first:
            self.say(
                f"the logits of `{self.head}` were used by {what} during a training step: the "
                "full logits were computed for that step, exactly as without ChunkedCrossEntropy "
                "(no memory saved in it). Compute metrics from the logits outside the training "
                "step (e.g. in validation: a forward without grad returns plain logits)."
            )

    @property
    def chunked_calls(self) -> int:
        return sum(self.by_backend.values())

    @property
    def fallback_calls(self) -> int:
        return sum(self.fallbacks.values())


def _goes_lazy(linear: nn.Linear, hidden: Any) -> bool:
    """Whether this call of ``linear`` can return lazy logits (a training call whose logits
    the chunks can reproduce)."""
    if not torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
        return False
    if isinstance(hidden, LazyLogits) or hidden.dim() < 1:
        return False
    if hidden.shape[-1] != linear.in_features or linear.weight.dtype not in LOSS_DTYPES:
        return False
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type) in LOSS_DTYPES and hidden.is_floating_point()
    return hidden.dtype == linear.weight.dtype  # else F.linear raises: let it, as before


def apply_chunked_cross_entropy(
    model: nn.Module,
    *,
    head: str | None = None,
    backend: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    say: Callable[[str], None] = lambda message: None,
) -> Change:
    """Make ``model``'s output projection return lazy logits while training, so that
    ``F.cross_entropy`` on them is computed in chunks (see the module's docstring).

    Raises a ``SettingsError`` when the model's loss cannot be reproduced from chunks
    (:func:`loss_refusal`) and a ``ValueError`` when no output projection is found."""
    check_module("model", model)
    if backend not in backends.BACKENDS:
        raise ValueError(f"`backend` must be one of {backends.BACKENDS}; got {backend!r}.")
    refusal = loss_refusal(model)
    if refusal is not None:
        raise SettingsError(f"ChunkedCrossEntropy cannot apply: {refusal}")
    name, linear, how = find_output_projection(model, head)
    session = LossSession(backend=backend, chunk_bytes=chunk_bytes, say=say, head=name)
    original = linear.forward

    def lazy(hidden: torch.Tensor) -> LazyLogits:
        return LazyLogits.of(LogitsSource(original, hidden, linear.weight, linear.bias, session))

    # Under a compiled model, the lazy logits are made outside the graph (Dynamo cannot trace
    # a tensor subclass being made): the graph ends at the hidden states, once, silently.
    lazy_outside_graph = torch.compiler.disable(lazy, recursive=True)

    def forward(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not _goes_lazy(linear, hidden):
            return original(hidden, *args, **kwargs)
        return lazy_outside_graph(hidden)

    vocab, width = linear.out_features, linear.in_features
    what = f"cross-entropy from `{name}` ({how}, {width} -> {vocab}) in chunks"
    # an instance attribute: undo puts back what the instance had (the class's forward shows)
    patched = patch_attribute(linear, "forward", forward, what)
    return Change(
        what,
        patched.undo,
        figures={"head": name, "vocabulary": vocab, "hidden_size": width},
        value=session,
    )
