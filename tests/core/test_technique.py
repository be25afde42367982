"""The technique base (``core/technique.py``): what every technique shares in the fit."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from helpers import tiny_trainer

from benchmarks.workloads import TinyHFGPT2
from lightning_efficient.core import kv_cache
from lightning_efficient.measure.memory.kv_cache import training_caches
from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy


def test_a_fit_switches_the_cache_off_once_for_every_flagged_technique(tmp_path) -> None:
    """``trains_without_cache`` is read once in the fit (``Technique.on_train_start``): with two
    flagged techniques the cache is switched off once, training forwards build none, validation
    and the fit's end puts the model back as given (two switches before, one per technique)."""

    seen: dict[str, list] = {"marks": [], "built": []}

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            seen["marks"].append(kv_cache._OFF.get(module.model))

    module = TinyHFGPT2(True)

    def built(mod, args, kwargs, out) -> None:
        seen["built"].append(out.past_key_values is not None)

    hook = module.model.register_forward_hook(built, with_kwargs=True)
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(list(ids), batch_size=4)
    trainer = tiny_trainer(
        tmp_path, [ActivationCheckpointing(), ChunkedCrossEntropy(), Watch()], max_steps=2
    )
    trainer.fit(module, train_dataloaders=loader)
    hook.remove()
    assert seen["marks"] == [1, 1]  # switched once, for both techniques
    assert seen["built"] and not any(seen["built"])  # no training forward built a cache
    assert training_caches(module.model) == ["GPT2LMHeadModel"]  # put back
    assert module.model.config.use_cache is True
