"""The memory estimate (fake tensors) against the same steps tracked on real CPU tensors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.workloads import tiny_model
from lightning_efficient.core.change import Change
from lightning_efficient.core.validate import parse_bytes
from lightning_efficient.measure import (
    CATEGORIES,
    EstimatePlan,
    MemoryEstimate,
    estimate_memory,
    measure_step,
)
from lightning_efficient.measure.memory.estimate import EstimateError, cuda_round
from lightning_efficient.measure.memory.types import resolve_optimizer


def _batch(b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (b, t), generator=g)
    return x, torch.roll(x, -1, 1)


def _close(est: MemoryEstimate, real: MemoryEstimate, rel: float = 0.05) -> None:
    assert abs(est.peak_bytes - real.peak_bytes) <= rel * real.peak_bytes, (str(est), str(real))


class CheckpointBlocks:
    """A tiny technique written against the ``configure_estimate`` protocol: it wraps every
    block of ``attr`` in non-reentrant ``torch.utils.checkpoint`` and undoes it on exit."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def configure_estimate(self, plan: EstimatePlan) -> None:
        blocks = plan.model
        for name in self.attr.split("."):
            blocks = getattr(blocks, name)
        for block in blocks:
            forward = block.forward

            def checkpointed(*args, _forward=forward, **kwargs):
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            block.forward = checkpointed
            plan.record(Change("checkpointed", lambda block=block: vars(block).pop("forward")))
        plan.note(f"checkpointed {len(blocks)} blocks")


# -- accuracy: TinyGPT ------------------------------------------------------------------------
def test_tinygpt_fp32_adamw_matches_real_steps() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = estimate_memory(model, _batch())
    # the model is restored untouched (real tensors, same values, tied weights still tied)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.head.weight is model.tok_emb.weight
    assert set(est.by_category) == set(CATEGORIES)
    assert sum(est.by_category.values()) == est.peak_bytes
    assert set(est.phase_peaks) == {"forward", "backward", "optimizer"}
    assert max(est.phase_peaks.values()) == est.peak_bytes
    n_params = sum(p.numel() for p in model.parameters()) * 4  # tied weight counted once
    assert est.by_category["parameters"] >= n_params
    assert est.by_category["optimizer_state"] == pytest.approx(2 * n_params, rel=0.01)
    real = measure_step(copy.deepcopy(model), _batch())
    _close(est, real)
    assert est.peak_phase == real.peak_phase


def test_checkpointing_technique_via_protocol_tinygpt() -> None:
    model = tiny_model()
    plain = estimate_memory(model, _batch())
    ckpt = estimate_memory(model, _batch(), callbacks=[CheckpointBlocks("blocks")])
    assert "forward" not in vars(model.blocks[0])  # undone
    assert ckpt.notes[0].startswith("optimizer as configured: AdamW")
    assert ckpt.notes[1:] == ["checkpointed 2 blocks"]
    assert ckpt.by_category["activations"] < 0.5 * plain.by_category["activations"]
    assert ckpt.peak_bytes < plain.peak_bytes
    real = measure_step(copy.deepcopy(model), _batch(), callbacks=[CheckpointBlocks("blocks")])
    _close(ckpt, real)


# -- accuracy: a GPT-2-shaped transformers model ---------------------------------------------------
def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg), torch.randint(0, 512, (4, 64))


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_gpt2_estimate_matches_real_steps(checkpointed: bool) -> None:
    model, ids = _gpt2()
    cbs = [CheckpointBlocks("transformer.h")] if checkpointed else []
    est = estimate_memory(model, ids, loss_fn=_lm_loss, callbacks=cbs)
    real = measure_step(copy.deepcopy(model), ids, loss_fn=_lm_loss, callbacks=cbs)
    _close(est, real)
    for cat in CATEGORIES:  # the split agrees too, not only the total
        assert abs(est.by_category[cat] - real.by_category[cat]) <= 0.05 * real.peak_bytes


# -- precision, optimizer-in-backward, offload, rounding ------------------------------------------
def test_precisions() -> None:
    model = tiny_model(seq_len=64)
    batch = _batch(8, 64)
    fp32 = estimate_memory(model, batch, steps=1)
    mixed = estimate_memory(model, batch, precision="bf16-mixed", steps=1)
    true16 = estimate_memory(model, batch, precision="bf16-true", steps=1)
    # mixed: fp32 master weights and AdamW state, lower-precision activations
    assert mixed.by_category["parameters"] == fp32.by_category["parameters"]
    assert mixed.by_category["optimizer_state"] == fp32.by_category["optimizer_state"]
    assert mixed.by_category["activations"] < 0.8 * fp32.by_category["activations"]
    # true: everything in bf16
    assert true16.by_category["parameters"] == pytest.approx(
        fp32.by_category["parameters"] / 2, rel=0.01
    )
    assert true16.peak_bytes < 0.6 * fp32.peak_bytes
    fp16 = estimate_memory(model, batch, precision="16-mixed", steps=1)
    assert fp16.peak_bytes < fp32.peak_bytes
    real = measure_step(copy.deepcopy(model), batch, precision="bf16-mixed", steps=1)
    _close(mixed, real)


def test_bf16_mixed_with_checkpointing_matches_a_lightning_fit() -> None:
    """Lightning autocasts without the weight cache; with checkpointing nothing else keeps the
    bf16 copies of the weights alive, so an estimate that cached them counted ~5% too much."""
    import lightning.pytorch as pl
    from helpers import tiny_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_efficient.measure import StorageTracker
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    pl.seed_everything(0, verbose=False)
    model = tiny_model(n_embd=64, dropout=0.1)
    x, y = _batch(4, 32)
    est = estimate_memory(
        model, (x, y), precision="bf16-mixed", callbacks=[ActivationCheckpointing()]
    )
    loader = DataLoader(TensorDataset(x.repeat(2, 1), y.repeat(2, 1)), batch_size=4)
    trainer = tiny_trainer(
        None, [ActivationCheckpointing()], max_steps=2, precision="bf16-mixed", limit_val_batches=0
    )
    tracker = StorageTracker(fake=False)
    with tracker:
        tracker.label(list(model.parameters()), "parameters")
        trainer.fit(model, train_dataloaders=loader)
    real = tracker.summary().peak_bytes
    assert est.peak_bytes == pytest.approx(real, rel=0.01)


class OptimizerInBackward:
    def configure_estimate(self, plan: EstimatePlan) -> None:
        plan.optimizer_in_backward = True


class OffloadOptimizerState:
    def configure_estimate(self, plan: EstimatePlan) -> None:
        plan.offload["optimizer_state"] = True


def _wide() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), torch.randn(2, 256)


def _mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def test_optimizer_in_backward_and_offload() -> None:
    model, x = _wide()
    plain = estimate_memory(model, x, loss_fn=_mse)
    in_bwd = estimate_memory(model, x, loss_fn=_mse, callbacks=[OptimizerInBackward()])
    state = plain.by_category["optimizer_state"]
    assert state == pytest.approx(2 * 4 * sum(p.numel() for p in model.parameters()), rel=0.01)
    # a gradient lives only until its parameter is stepped: never all gradients at once
    assert (
        in_bwd.by_category["gradients"] < 0.6 * plain.by_category["gradients"]
        or in_bwd.by_category["gradients"] == 0
    )
    assert in_bwd.peak_bytes < plain.peak_bytes
    real = measure_step(copy.deepcopy(model), x, loss_fn=_mse, callbacks=[OptimizerInBackward()])
    _close(in_bwd, real)
    off = estimate_memory(model, x, loss_fn=_mse, callbacks=[OffloadOptimizerState()])
    assert off.host_bytes == state
    assert off.by_category["optimizer_state"] == 0
    assert off.peak_bytes <= plain.peak_bytes - state


def test_cuda_rounding() -> None:
    mib = 2**20
    sizes = (0, 1, 512, 513, mib, mib + 1, 5 * mib, 2.25 * mib, 10 * mib, 11 * mib + 512)
    assert [cuda_round(int(n)) for n in sizes] == [
        0,
        512,
        512,
        1024,
        mib,
        mib + 512,  # cut from a 20 MiB segment, which is split: no 2 MiB rounding
        5 * mib,
        int(2.25 * mib),  # GPT-2's 768 x 768 fp32 weights: 2.25 MiB, not 4
        10 * mib,  # a segment of its own, exactly 2 MiB-aligned
        12 * mib,  # 1 MiB - 512 left in its 12 MiB segment: too little to split off
    ]
    assert cuda_round(10 * mib + 512) == 10 * mib + 512  # 2 MiB - 512 left: split off
    model, x = _wide()
    plain = estimate_memory(model, x, loss_fn=_mse)
    rounded = estimate_memory(model, x, loss_fn=_mse, cuda_rounding=True)
    assert rounded.peak_bytes > plain.peak_bytes
    # every parameter (256 KiB weights, 1 KiB biases) is a 512-byte multiple; the tiny
    # per-parameter AdamW `step` tensors (4 bytes) take 512 each
    assert all(v % 512 == 0 for v in rounded.by_category.values())


def test_accumulation_keeps_gradients_across_micro_batches() -> None:
    model, x = _wide()
    one = estimate_memory(model, x, loss_fn=_mse)
    four = estimate_memory(model, x, loss_fn=_mse, accumulate_grad_batches=4)
    assert four.peak_bytes == pytest.approx(one.peak_bytes, rel=0.05)


# -- LightningModule with a trainer attached: self.log is silenced --------------------------------
def test_lightning_module_attached_to_trainer(tmp_path) -> None:
    trainer, model, _ = fit(tmp_path, max_steps=1, limit_val_batches=0)
    est = estimate_memory(model, _batch())
    assert est.peak_bytes > 0 and "log" not in vars(model)
    assert trainer.callback_metrics  # Lightning's own logging store is intact


# -- scale: a 7B model on the meta device ------------------------------------------------------------
# The child's peak resident memory is its own address space's (VmHWM, begun afresh at exec):
# getrusage's ru_maxrss keeps the parent's, the spawning worker's (a worker of 1 GiB failed CI).
SEVEN_B = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from lightning_efficient.measure import estimate_memory
cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
ids = torch.empty(1, 16, dtype=torch.long, device="meta")
est = estimate_memory(model, ids, loss_fn=lambda m, b: m(input_ids=b, labels=b).loss, steps=1)
n = sum(p.numel() for p in model.parameters())
with open("/proc/self/status") as f:
    hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
json.dump({"params": n, "est": est.to_dict(), "rss": hwm_kib * 1024}, sys.stdout)
"""


@pytest.mark.slow
def test_seven_billion_on_meta_stays_small_in_rss() -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-c", SEVEN_B], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] > 6.5e9
    cats = out["est"]["by_category"]
    assert cats["parameters"] == pytest.approx(4 * out["params"], rel=0.01)
    assert cats["optimizer_state"] == pytest.approx(8 * out["params"], rel=0.01)
    assert out["est"]["peak_bytes"] > 16 * out["params"]  # params + grads + AdamW state
    assert out["rss"] < 2**30, f"RSS {out['rss'] / 2**20:.0f} MiB"


# -- bad input ---------------------------------------------------------------------------------------
class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.mean() > 0:  # data-dependent Python control flow
            y = y * 2
        return y


class CallsItem(ReadsValues):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.lin.weight.abs().max().item()


class Nonzero(ReadsValues):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[x > 0]


@pytest.mark.parametrize("cls", [ReadsValues, CallsItem, Nonzero])
def test_model_needing_values_gets_a_clear_error(cls) -> None:
    model = cls()
    weight = model.lin.weight
    with pytest.raises(EstimateError) as info:
        estimate_memory(model, torch.randn(2, 4), loss_fn=lambda m, x: m(x).sum())
    msg = str(info.value)
    assert "aten." in msg and "real device with a small batch" in msg and "measure_step" in msg
    assert "test_estimate.py" in msg  # points at the user's line
    assert model.lin.weight is weight  # restored
    assert measure_step(model, torch.randn(2, 4), loss_fn=lambda m, x: m(x).sum()).peak_bytes > 0


def test_bad_arguments() -> None:
    model, x = _wide()
    with pytest.raises(ValueError, match="precision"):
        estimate_memory(model, x, loss_fn=_mse, precision="fp8")
    with pytest.raises(ValueError, match="optimizer"):
        estimate_memory(model, x, loss_fn=_mse, optimizer="lion")
    with pytest.raises(ValueError, match="optimizer"):
        estimate_memory(model, x, loss_fn=_mse, optimizer="torch.optim.Nope")
    with pytest.raises(ValueError, match="loss_fn"):
        estimate_memory(model, x)
    with pytest.raises(ValueError, match="steps"):
        estimate_memory(model, x, loss_fn=_mse, steps=0)
    with pytest.raises(ValueError, match="budget"):
        parse_bytes("budget", "24 gigs")
    assert parse_bytes("budget", "24GiB") == 24 * 2**30


def test_optimizer_choices() -> None:
    model, x = _wide()
    n = 4 * sum(p.numel() for p in model.parameters())
    sgd = estimate_memory(model, x, loss_fn=_mse, optimizer="sgd")
    assert sgd.by_category["optimizer_state"] == pytest.approx(n, rel=0.01)  # momentum
    by_path = estimate_memory(model, x, loss_fn=_mse, optimizer="torch.optim.Adagrad")
    assert by_path.by_category["optimizer_state"] >= n
    factory = estimate_memory(
        model, x, loss_fn=_mse, optimizer=lambda g: torch.optim.SGD(g, lr=0.1)
    )
    assert factory.by_category["optimizer_state"] == 0


def test_estimate_renders() -> None:
    est = estimate_memory(tiny_model(), _batch())
    d = est.to_dict()
    assert d["peak_bytes"] == est.peak_bytes and set(d["by_category"]) == set(CATEGORIES)
    assert "peak" in str(est) and "activations" in est.to_markdown()
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(est.table())
    assert "optimizer state" in console.export_text()


def test_training_step_without_batch_idx() -> None:
    from benchmarks.workloads import TINY_MODEL
    from lightning_efficient.demos import TinyGPT

    class NoIdx(TinyGPT):
        def training_step(self, batch):  # Lightning allows leaving out batch_idx
            return self._loss(batch)[0]

    est = estimate_memory(NoIdx(**TINY_MODEL), _batch())
    assert est.peak_bytes == estimate_memory(tiny_model(), _batch()).peak_bytes


# -- the optimizer the module configures -------------------------------------------------------
class SingleTensorAdamW(type(tiny_model())):
    """TinyGPT whose configure_optimizers returns a single-tensor AdamW in two groups."""

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-3, foreach=False)


def test_estimate_uses_the_configured_optimizer() -> None:
    """Without ``optimizer=``, the estimate builds what configure_optimizers returns (issue:
    a single-tensor AdamW was estimated with foreach's parameter-sized temporaries)."""
    from benchmarks.workloads import TINY_MODEL

    model = SingleTensorAdamW(**TINY_MODEL)
    est = estimate_memory(model, _batch())
    assert est.notes == ["optimizer as configured: AdamW"]
    real = measure_step(
        copy.deepcopy(model), _batch(), lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=False)
    )
    assert est.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01), (str(est), str(real))
    assert est.phase_peaks["optimizer"] == pytest.approx(real.phase_peaks["optimizer"], rel=0.01)
    # the old default (foreach AdamW) holds a parameter-sized temporary in the optimizer phase
    foreach = estimate_memory(model, _batch(), optimizer="adamw")
    assert foreach.phase_peaks["optimizer"] > est.phase_peaks["optimizer"]


def test_estimate_configured_optimizer_keeps_the_groups() -> None:
    from benchmarks.workloads import TINY_MODEL
    from lightning_efficient.measure.memory.settings import configured_optimizer

    model = SingleTensorAdamW(**TINY_MODEL)
    factory, note = configured_optimizer(model)
    built = factory([{"params": list(model.parameters())}])
    assert [g["weight_decay"] for g in built.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in built.param_groups) == len(list(model.parameters()))
    assert built.defaults["foreach"] is False and "AdamW" in note


class NeedsTrainer(type(tiny_model())):
    def configure_optimizers(self):
        total = self.trainer.estimated_stepping_batches  # raises without a trainer
        return torch.optim.SGD(self.parameters(), lr=0.1 / total)


def test_estimate_falls_back_when_configure_needs_a_trainer() -> None:
    from benchmarks.workloads import TINY_MODEL

    model = NeedsTrainer(**TINY_MODEL)
    est = estimate_memory(model, _batch())
    assert len(est.notes) == 1 and est.notes[0].startswith("optimizer 'adamw' (configure_optim")
    assert est.peak_bytes == estimate_memory(model, _batch(), optimizer="adamw").peak_bytes


class _TwoLinear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 256, bias=False)
        self.b = torch.nn.Linear(256, 256, bias=False)

    def training_step(self, batch, batch_idx):
        return self.b(self.a(batch[0])).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)  # in place: allocates nothing


def test_optimizer_phase_counts_every_gradient_of_an_in_place_sgd_step() -> None:
    """issue 37: the phase's figure is what is live when it starts (weights and every
    gradient), not what was left after the first free (it read one gradient short)."""
    model = _TwoLinear()
    weights = sum(p.numel() * 4 for p in model.parameters())
    est = estimate_memory(model, (torch.randn(8, 256),), device="cpu")
    assert est.phase_by_category["optimizer"]["gradients"] == weights  # both, not one
    assert est.phase_peaks["optimizer"] >= 2 * weights


def test_estimate_plan_keeps_its_changes_on_the_one_log() -> None:
    """issue 38: the plan records ``Change``s (core/change.py), undone last first; an undo that
    raises does not stop the others."""
    from lightning_efficient.measure.memory.types import EstimatePlan

    plan = EstimatePlan(model=torch.nn.Linear(2, 2), batch=None, optimizer=lambda g: None)
    order: list[str] = []

    def fails() -> None:
        order.append("b")
        raise RuntimeError("b failed")

    first = plan.record(Change("a", lambda: order.append("a")))
    plan.record(Change("b", fails))
    plan.record(Change("c", lambda: order.append("c")))
    assert [c.what for c in plan.changes] == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="b failed"):
        plan.undo()
    assert order == ["c", "b", "a"] and first.undone and not len(plan.changes)


def test_an_optimizer_path_must_name_an_optimizer_class() -> None:
    with pytest.raises(TypeError, match="Optimizer subclass"):
        resolve_optimizer("os.system")
    assert resolve_optimizer("torch.optim.SGD") is not None
