"""lightning_efficient.functional: what a user composes, in one verb style; every ``apply_*``
returns a ``Change`` that says what it did and undoes it."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils.data import DataLoader

import lightning_efficient.functional as F
from benchmarks.workloads import tiny_model
from lightning_efficient.core.change import Change


def test_a_short_list_in_one_verb_style() -> None:
    names = F.__all__
    assert 20 <= len(names) <= 35 and len(set(names)) == len(names)
    applies = [n for n in names if n.startswith("apply_")]
    # the loaders' functions change nothing: no apply_* (issue 38); 4-bit frozen weights and
    # training without the cache do (issue 39)
    assert len(applies) == 10
    assert {"apply_frozen_weights_4bit", "apply_training_without_cache"} <= set(applies)
    for name in applies:  # a change comes back, whatever the object changed
        assert inspect.signature(getattr(F, name)).return_annotation in ("Change", Change), name
    # general helpers live in their modules only
    for helper in ("format_bytes", "set_lr", "host_copy", "ema_alpha", "format_duration"):
        assert not hasattr(F, helper), helper


def test_module_changes_undo_to_what_was_given() -> None:
    model = tiny_model()
    forwards = {n: vars(m).get("forward") for n, m in model.named_modules()}
    with (
        F.apply_activation_checkpointing(model) as ac,
        F.apply_compile(model, backend="eager"),
        F.apply_chunked_cross_entropy(model) as chunks,
    ):
        assert ac.value == ["blocks.0", "blocks.1"]
        assert F.checkpointed_blocks(model) and F.compiled_modules(model) == ac.value
        assert chunks.figures["head"] == "head" and "forward" in vars(model.head)
    assert F.checkpointed_blocks(model) == {} and F.compiled_modules(model) == []
    assert {n: vars(m).get("forward") for n, m in model.named_modules()} == forwards


def test_optimizer_changes_undo() -> None:
    model = tiny_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.StepLR(adamw, step_size=1)
    swap = F.apply_optimizer_swap(adamw, "sgd", schedulers=[schedule])
    assert isinstance(swap.value, torch.optim.SGD) and schedule.optimizer is swap.value
    assert swap.what == "AdamW -> sgd" and swap.figures["schedulers"] == 1
    swap.undo()
    assert schedule.optimizer is adamw

    weight = model.head.weight
    in_backward = F.apply_optimizer_in_backward(
        model, lambda groups: torch.optim.SGD(groups, lr=0.1)
    )
    assert in_backward.value.attached and weight._post_accumulate_grad_hooks
    in_backward.undo()
    assert not in_backward.value.attached and not weight._post_accumulate_grad_hooks


def test_loader_changes_keep_the_given_loader() -> None:
    data = [torch.full((4,), float(i)) for i in range(8)]
    loader = DataLoader(data, batch_size=2)
    tuned = F.tuned_loader(loader, num_workers=0, pin_memory=False)
    preloaded = F.preloaded_loader(loader, "cpu", "1MiB")
    assert preloaded.value is not loader and tuned.value is not loader
    assert not hasattr(F, "apply_device_preload") and not hasattr(F, "apply_dataloader_tuning")
    lengths = F.apply_sampler(loader, F.LengthBucketSampler([4] * 8, bucket_size=4, shuffle=False))
    assert (
        tuned.what == "kept num_workers 0, pin_memory False"
        and preloaded.figures["preloaded_bytes"] > 0
    )
    assert lengths.what == "sampler SequentialSampler -> LengthBucketSampler"
    for change in (tuned, preloaded):
        assert change.undone  # nothing to undo: the given loader was not changed
        assert [b.tolist() for b in change.value] == [b.tolist() for b in loader]
    assert loader.num_workers == 0 and type(loader.sampler).__name__ == "SequentialSampler"


@pytest.mark.parametrize(
    ("name", "argument"),
    [
        ("apply_activation_checkpointing", "module"),
        ("apply_chunked_cross_entropy", "model"),
        ("apply_float8", "model"),
        ("apply_frozen_weights_4bit", "model"),
        ("apply_training_without_cache", "model"),
    ],
)
def test_apply_on_a_non_module_names_the_argument(name: str, argument: str) -> None:
    """Issue 49: a raw AttributeError before; a TypeError naming the argument now."""
    with pytest.raises(TypeError, match=rf"`{argument}` must be a torch.nn.Module; got 3 \(int\)"):
        getattr(F, name)(3)
