"""transformers' SDPA mask checks, answered from the real batch during the estimate.

Under fake tensors transformers cannot read a padding mask's values, so it builds the
batch x 1 x seq x seq attention mask that a real run skips (an estimate 1.05-2.1x too high at
seq 512, DESIGN.md). ``hf_mask_checks_on_values(batch)`` makes those checks answer as the real
values would: the mask is skipped unless the batch's attention mask really has padding (or its
position ids really pack several sequences per row). Where the values are not known (a batch
given by shape, a mask made inside the model) it takes the path of an unpadded batch and says
so. The functions it answers for are found by ``core._internals.hf_mask_functions`` (their names
are private to transformers); each is replaced where transformers holds it, as a recorded
``Change``, and put back on leaving.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_efficient.core._internals import (
    HF_MASK_ARGUMENTS,
    HF_MASK_SKIP_CHECKS,
    HF_PACKED_CHECK,
    FakeTensor,
    hf_mask_function_sites,
    hf_mask_functions,
)
from lightning_efficient.core.change import Change, patch_attribute

__all__ = ["hf_mask_checks_on_values", "NO_PADDING_NOTE", "UNPACKED_NOTE"]

NO_PADDING_NOTE = (
    "transformers' SDPA mask: the attention mask's values are not known (a meta tensor, a shape, "
    "or a mask made inside the model), so the estimate takes the path of a batch without padding "
    "(no batch x 1 x seq x seq mask); a padded batch builds that mask"
)
UNPACKED_NOTE = (
    "transformers' SDPA mask: the position ids' values are not known (a meta tensor or a shape), "
    "so the estimate takes the path of one sequence per row (no packed-sequence mask)"
)


def _batch_facts(real: torch.Tensor | None, packed_check: Any) -> tuple[bool | None, bool | None]:
    """(padded, packed) of a real batch tensor as transformers would find them; ``None``: not
    known (no values, or not an integer/bool tensor)."""
    if real is None or isinstance(real, FakeTensor) or real.is_meta:
        return None, None  # no values to read (a batch given fake, on meta, or by shape)
    if real.is_floating_point() or real.is_complex():
        return None, None
    if real.numel() == 0 or real.dim() > 2:
        return None, None
    padded = not bool(real.bool().all())
    packed = None
    if packed_check is not None:
        with contextlib.suppress(Exception):  # not position ids after all
            packed = packed_check(real.reshape(1, -1) if real.dim() == 1 else real) is not None
    return padded, packed


class _Answered:
    """Stands in for one of transformers' mask functions while the estimate runs."""

    def __init__(self, fn: Callable[..., Any], answer: Callable[..., Any]) -> None:
        self.fn, self.answer = fn, answer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.answer(self.fn, *args, **kwargs)


class _RealBatch:
    """What the real batch says about the fake tensors that stand for it, and what the model
    last passed to transformers' mask preparation (its attention mask padded, its position ids
    packed). ``assumed``: the notes for values that were not known."""

    def __init__(self, batch: list[tuple[torch.Tensor, Any]], packed_check: Any) -> None:
        self.facts = {id(f): (f, *_batch_facts(r, packed_check)) for f, r in batch}
        self.padded: bool | None = None
        self.packed: bool | None = None
        self.assumed: list[str] = []

    def _known(self, t: Any, i: int, note: str) -> bool | None:
        if not isinstance(t, FakeTensor):
            return None
        entry = self.facts.get(id(t))
        known = entry[i] if entry is not None and entry[0] is t else None
        if known is None and (entry is not None or note == NO_PADDING_NOTE):
            if note not in self.assumed:  # a batch tensor without values, or a model's own mask
                self.assumed.append(note)
        return known

    # -- the answers, one per kind of function ---------------------------------------------
    def read_arguments(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The mask preparation: note whether this call's mask is padded, its ids packed."""
        ba = _bound(fn, args, kwargs)
        if ba is not None:
            mask = ba.arguments.get("attention_mask")
            self.padded = self._known(mask, 1, NO_PADDING_NOTE) if mask is not None else False
            self.packed = self._known(ba.arguments.get("position_ids"), 2, UNPACKED_NOTE)
        return fn(*args, **kwargs)

    def skip_unless_padded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A skip check: every token attends (no padding), so the real run skips the mask."""
        ba = _bound(fn, args, kwargs)
        if ba is None or not isinstance(ba.arguments.get("padding_mask"), FakeTensor):
            return fn(*args, **kwargs)
        if self.padded:  # really padded: the real run builds the mask too
            return fn(*args, **kwargs)
        ba.arguments["padding_mask"] = None
        return fn(*ba.args, **ba.kwargs)

    def packed_only_if_known(
        self, fn: Callable[..., Any], position_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """The packed-sequence check: one sequence per row unless the real ids pack several."""
        if isinstance(position_ids, FakeTensor) and not self.packed:
            return None
        return fn(position_ids, *args, **kwargs)


def _bound(fn: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def hf_mask_checks_on_values(
    batch: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> Iterator[list[str]]:
    """While inside, transformers' SDPA mask checks take on fake tensors the path a real run
    takes: the mask is skipped unless the batch's attention mask really has padding (or its
    position ids really pack several sequences per row).

    ``batch`` pairs each fake batch tensor with the real tensor it stands for (``None``: only
    the shape is known); enter it outside the fake mode (the real values are read on entry).
    Yields the list of assumptions made where values were not known (notes for the estimate).
    Does nothing when ``transformers.masking_utils`` is not imported or lacks these functions
    (then the mask is built, as before: an over-estimate, never an error), and nothing inside
    another such block (the outer one answers).
    """
    originals = hf_mask_functions()
    nested = isinstance(originals.get(HF_MASK_ARGUMENTS), _Answered)
    if nested or not any(n in originals for n in HF_MASK_SKIP_CHECKS):
        yield []
        return
    real = _RealBatch(batch, originals.get(HF_PACKED_CHECK))
    answers = {HF_MASK_ARGUMENTS: real.read_arguments, HF_PACKED_CHECK: real.packed_only_if_known}
    stand_ins = {
        n: _Answered(fn, answers.get(n, real.skip_unless_padded)) for n, fn in originals.items()
    }
    # the module itself, and any transformers module that imported one of them by name
    with Change.of(
        "transformers' mask checks answered from the real batch",
        [
            patch_attribute(module, name, stand_ins[name])
            for module, name in hf_mask_function_sites(originals)
        ],
    ):
        yield real.assumed
