"""Auto block choice on models this project did not write: CNNs with BatchNorm (ResNet-, ConvNeXt-,
U-Net- and DenseNet-like, written in benchmarks/workloads.py) and transformers models built from tiny
configs (ViT, T5, Llama with SDPA, BERT).

For each: the blocks "auto" chooses by measured saving cut the estimated activation memory by a
clear margin and within 10% of the best block class's saving; a training step with them
checkpointed leaves every parameter and buffer (BatchNorm running statistics,
``num_batches_tracked``) as the plain step does. Regional compile makes at least one graph.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, tiny_trainer
from torch import nn

from benchmarks.workloads import GALLERY, tiny_model
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.techniques._blocks import find_repeated_blocks
from lightning_efficient.techniques.activation_checkpointing import (
    ActivationCheckpointing,
    BlockRanking,
    apply_activation_checkpointing,
    rank_blocks,
    remove_activation_checkpointing,
)

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.0)


def _fb_peak(model, batch, loss_fn) -> int:
    """The estimated forward/backward peak, measured here apart from the ranking's code."""
    est = estimate_memory(model, batch, loss_fn=loss_fn, optimizer=_sgd, steps=1)
    return max(est.phase_peaks["forward"], est.phase_peaks["backward"])


_RANKINGS: dict[str, BlockRanking] = {}


def _ranked(name: str, model, batch, loss_fn) -> BlockRanking:
    if name not in _RANKINGS:
        _RANKINGS[name] = rank_blocks(model, batch, loss_fn=loss_fn)
    return _RANKINGS[name]


@pytest.mark.parametrize("name", list(GALLERY))
def test_auto_frees_as_much_as_the_best_block_class(name: str) -> None:
    build, make_batch, loss_fn, best_class = GALLERY[name]
    torch.manual_seed(0)
    model, batch = build().train(), make_batch()
    ranking = _ranked(name, model, batch, loss_fn)
    chosen = ranking.best
    assert chosen is not None
    # a clear cut of the activation memory
    assert ranking.share(chosen) >= 0.3, ranking.to_dict()
    # as much as checkpointing every block of the best class (T5Block, BasicBlock, ...)
    apply_activation_checkpointing(model, best_class)
    try:
        by_class = ranking.plain_peak_bytes - _fb_peak(model, batch, loss_fn)
    finally:
        remove_activation_checkpointing(model)
    assert by_class > 0
    assert chosen.saved_bytes >= 0.9 * by_class, (chosen.group, chosen.saved_bytes, by_class)


def _train_step(model, batch, loss_fn) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    loss_fn(model, batch).backward()
    opt.step()


@pytest.mark.parametrize("name", list(GALLERY))
def test_auto_checkpointing_keeps_weights_and_buffers(name: str) -> None:
    build, make_batch, loss_fn, _ = GALLERY[name]
    torch.manual_seed(0)
    plain, batch = build().train(), make_batch()
    ckpt = copy.deepcopy(plain)
    ranking = _ranked(name, copy.deepcopy(plain), batch, loss_fn)
    names = apply_activation_checkpointing(ckpt, ranking.best.group.policy).value
    assert names == ranking.best.group.names
    _train_step(plain, batch, loss_fn)
    _train_step(ckpt, batch, loss_fn)
    expected, got = plain.state_dict(), ckpt.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        # buffers bit-equal (BatchNorm running statistics updated once); weights equal
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    tracked = [k for k in expected if k.endswith("num_batches_tracked")]
    assert all(int(got[k]) == 1 for k in tracked)
    assert bool(tracked) == (name in ("resnet", "unet", "densenet"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "llama"])
def test_regional_compile_makes_graphs(name: str) -> None:
    from lightning_efficient.techniques.compile import (
        CompileWatch,
        apply_compile,
        uncompile_modules,
    )

    build, make_batch, loss_fn, _ = GALLERY[name]
    torch.manual_seed(0)
    model, batch = build().train(), make_batch()
    torch._dynamo.reset()
    with CompileWatch() as watch:
        names = apply_compile(model, backend="eager").value
        try:
            loss_fn(model, batch).backward()
        finally:
            uncompile_modules(model)
    assert names and "" not in names  # regional: blocks, not the whole model
    assert watch.compiles >= 1, names


# -- the callback: the measured choice in a fit, the saves-little note, models without blocks -----
class Lit(pl.LightningModule):
    """A gallery model trained by a LightningModule (SGD), on one fixed batch."""

    def __init__(self, name: str) -> None:
        super().__init__()
        build, make_batch, self.loss_fn, _ = GALLERY[name]
        torch.manual_seed(0)
        self.net, self.batch = build(), make_batch()

    def training_step(self, batch, batch_idx):
        return self.loss_fn(self.net, self.batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2)))


def _fit(tmp_path, module: pl.LightningModule, cb: ActivationCheckpointing) -> pl.Trainer:
    trainer = tiny_trainer(tmp_path, [cb], max_steps=1, limit_val_batches=0)
    trainer.fit(module)
    return trainer


def test_callback_auto_takes_the_measured_choice_and_reports_it(tmp_path) -> None:
    plain, lit, cb = Lit("resnet"), Lit("resnet"), ActivationCheckpointing()
    trainer = _fit(tmp_path, lit, cb)
    # every BasicBlock, not the last stage's identical pair that holds the most parameters
    assert [n for n, _ in find_repeated_blocks(lit.net)] == ["layer3.0", "layer3.1", "layer3.2"]
    assert cb.wrapped == [f"net.layer{i}.{j}" for i in (1, 2, 3) for j in (0, 1)] + ["net.layer3.2"]
    entry = report_for(trainer)["ActivationCheckpointing"]
    assert "frees" in entry.change and entry.figures["activations_saved_bytes"] > 0
    assert (
        entry.figures["activations_saved_bytes"] > 0.3 * entry.figures["activations_before_bytes"]
    )
    _train_step(plain.net, plain.batch, plain.loss_fn)  # the plain run: same step, same buffers
    for key, value in plain.net.state_dict().items():
        torch.testing.assert_close(lit.net.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_callback_says_when_the_chosen_blocks_save_little(tmp_path) -> None:
    cb = ActivationCheckpointing(policy=r"re:net\.layer3\.1")  # one low-resolution block
    with pytest.warns(
        NoEffectWarning,
        match=r"save little: .*frees .* \(-\d%.*Better: checkpointing the 7 "
        r"BasicBlock blocks \(net.layer1.0 .. net.layer3.2, policy='BasicBlock'\)",
    ):
        trainer = _fit(tmp_path, Lit("resnet"), cb)
    assert "saves little" in report_for(trainer)["ActivationCheckpointing"].change


class Leaves(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return self.b(torch.tanh(self.a(batch[0]))).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)), 2)


def test_auto_on_a_model_without_blocks_has_no_effect_not_an_error(tmp_path) -> None:
    cb = ActivationCheckpointing()
    with pytest.warns(NoEffectWarning, match="no block to checkpoint"):
        _fit(tmp_path, Leaves(), cb)
    assert cb.wrapped == []
    with pytest.raises(ValueError, match="matches no module"):
        _fit(tmp_path, Leaves(), ActivationCheckpointing(policy="Block"))


def test_a_one_block_model_checkpoints_its_block(tmp_path) -> None:
    model = tiny_model(n_layer=1)
    assert [n for n, _ in find_repeated_blocks(model)] == ["blocks.0"]
    cb = ActivationCheckpointing()
    fit(tmp_path, [cb], model=model, max_steps=1, limit_val_batches=0)
    assert cb.wrapped == ["blocks.0"]


class ValueReading(pl.LightningModule):
    """Two candidate groups, and a forward that reads a tensor's value (fake tensors cannot)."""

    def __init__(self) -> None:
        super().__init__()
        self.front = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.back = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2)
        )

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in [*self.front, *self.back]:
            x = layer(x)
        return x.square().mean() if float(x.sum()) > -1e9 else x.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)), 2)


def test_auto_falls_back_to_the_structural_choice_when_the_estimate_cannot_run(
    tmp_path, caplog
) -> None:
    module, cb = ValueReading(), ActivationCheckpointing()
    with caplog.at_level("INFO"):
        _fit(tmp_path, module, cb)
    assert cb.ranking is None
    assert cb.wrapped == [n for n, _ in find_repeated_blocks(module)] == ["back.0", "back.1"]
    assert "could not measure what the blocks save" in caplog.text
