"""Which layer of a model is its output head (the projection to the vocabulary): one rule, used by
the profiler (the share of the logits in a step's FLOPs), the chunked loss (which layer's output
is the logits) and the planner (whether the chunked loss is worth offering).

``find_output_head(model)`` is pure: it reads the module tree and changes nothing. In order:

1. a Hugging Face model's ``get_output_embeddings()`` when it is an ``nn.Linear`` (the
   outermost model that has a ``config``);
2. an ``nn.Linear`` whose weight *is* an ``nn.Embedding``'s (tied weights; the last one);
3. an ``nn.Linear`` with as many outputs as the largest ``nn.Embedding`` has rows (the token
   embedding); of several, the shallowest in the module tree (a block's MLP can be as wide as a
   small vocabulary; the head is not inside the blocks), the last registered of those. This is
   what finds LitGPT's ``lm_head``, which is registered before the blocks, and the ``linear``
   inside ``litgpt.lora.GPT``'s ``LoRALinear``.

A model without an embedding, or whose linear layers are none as wide as its largest embedding
(a classifier over a text encoder: its two outputs are no vocabulary), has no output head here.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

__all__ = ["OutputHead", "find_output_head", "hf_output_head"]


class OutputHead(NamedTuple):
    """The output head: its name in the model, the layer, and how it was found."""

    name: str
    linear: nn.Linear
    how: str


def hf_output_head(model: nn.Module) -> tuple[str, nn.Module, nn.Linear] | None:
    """``(name, owner, linear)``: the output embeddings of the outermost Hugging Face model in
    ``model`` (a module with a ``config`` and ``get_output_embeddings()``), when an
    ``nn.Linear``; ``None`` otherwise."""
    for name, module in model.named_modules():
        get = getattr(module, "get_output_embeddings", None)
        if not callable(get) or not hasattr(module, "config"):
            continue
        try:
            out = get()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(out, nn.Linear):
            for sub, candidate in module.named_modules():
                if candidate is out:
                    return ".".join(p for p in (name, sub) if p), module, out
    return None


def find_output_head(model: nn.Module) -> OutputHead | None:
    """The ``nn.Linear`` whose outputs are ``model``'s vocabulary (see the module docstring), or
    ``None`` when the model has none."""
    found = hf_output_head(model)
    if found is not None:
        return OutputHead(found[0], found[2], "the Hugging Face model's output embeddings")
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tied_weights = {id(m.weight) for m in embeddings}
    tied = [(n, m) for n, m in linears if id(m.weight) in tied_weights]
    if tied:
        return OutputHead(tied[-1][0], tied[-1][1], "tied to the input embedding")
    vocab = max(m.num_embeddings for m in embeddings)
    wide = [(n, m) for n, m in linears if m.out_features == vocab]
    if wide:  # the shallowest (a block's MLP can be as wide), the last of those
        depth = min(n.count(".") for n, _ in wide)
        name, linear = [(n, m) for n, m in wide if n.count(".") == depth][-1]
        return OutputHead(name, linear, "as wide as the largest embedding")
    return None
