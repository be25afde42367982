"""bf16 weights with compensated updates (``OptimizerSwap('adamw_kahan' | 'adamw_sr' |
'adamw8bit_sr')`` under ``precision='bf16-true'``): the quality gate on a tiny model (plain bf16
AdamW leaves the norm weights at 1.0, the compensated forms move them as fp32 masters do), the
LR schedule and clipping kept, bit-identical resume, undo, refusal on 32-bit weights, and the
estimate against the measured peak and bytes per parameter.

torchao's stochastic-rounding step is a ``torch.compile`` per parameter shape: on 2 CPU cores
its first fit takes about a minute, so those cases are marked slow."""

from __future__ import annotations

import pytest
import torch
from helpers import SaveAt, fit, params_of
from lightning.pytorch import Callback

from benchmarks.workloads import tiny_model
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.optimizers import OptimizerSwap
from lightning_efficient.techniques.optimizers.build import apply_optimizer_swap

SR = pytest.param("adamw_sr", marks=pytest.mark.slow)
SR8 = pytest.param("adamw8bit_sr", marks=pytest.mark.slow)
FORMS = ["adamw_kahan", SR, SR8]
#: The gate's tolerance: the compensated forms' mean drift of the norm weights from 1.0 within
#: 15% of the fp32-master run's (measured: Kahan +1.6%, SR +7.5%, SR 8-bit +7.1%; stochastic
#: rounding adds up to half a bf16 step of noise per weight, which raises a mean |drift|).
TOLERANCE = 0.15
GATE = dict(max_steps=30, gradient_clip_val=1.0)


class LrRecorder(Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lrs.append([float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups])


def _norm_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            p.detach().float().flatten()
            for n, p in model.named_parameters()
            if n.endswith("weight") and p.dim() == 1
        ]
    )


def _gate_fit(callbacks, precision: str):
    lrs = LrRecorder()
    _, model, rec = fit(
        None, [*callbacks, lrs], model=tiny_model(lr=1e-3), precision=precision, **GATE
    )
    return model, rec, lrs


@pytest.fixture(scope="module")
def reference():
    """fp32 masters (bf16-mixed + AdamW) and plain bf16-true AdamW (nearest rounding)."""
    masters, _, lrs = _gate_fit([], "bf16-mixed")
    plain, _, _ = _gate_fit([], "bf16-true")
    return _norm_weights(masters) - 1.0, _norm_weights(plain) - 1.0, lrs.lrs


def test_plain_bf16_adamw_leaves_the_norm_weights_at_one(reference) -> None:
    masters, plain, _ = reference
    # AdamW's update (<= lr = 1e-3) is under half a bf16 step at 1.0 (2**-9 = 1.95e-3): rounded away
    assert masters.abs().mean() > 5e-3 and torch.count_nonzero(plain) == 0


@pytest.mark.parametrize("name", FORMS)
def test_compensated_forms_move_the_norm_weights_as_fp32_masters(reference, name) -> None:
    masters, _, lrs_masters = reference
    model, rec, lrs = _gate_fit([OptimizerSwap(name)], "bf16-true")
    drift = _norm_weights(model) - 1.0
    assert next(model.parameters()).dtype == torch.bfloat16
    ratio = float(drift.abs().mean() / masters.abs().mean())
    assert abs(ratio - 1.0) <= TOLERANCE, ratio
    # the module's warmup + cosine schedule drives the new optimizer unchanged (torchao keeps its
    # lr as a tensor), and the loss went down
    torch.testing.assert_close(
        torch.tensor(lrs.lrs, dtype=torch.float64),
        torch.tensor(lrs_masters, dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert rec.losses[-1] < rec.losses[0] - 0.3


@pytest.mark.parametrize("name", FORMS)
def test_resume_is_bit_identical(tmp_path, name) -> None:
    """The Kahan buffer and the rounding's own RNG state are optimizer state: a run stopped at
    step 3 and resumed equals the uninterrupted one bit for bit."""
    ckpt = tmp_path / "k.ckpt"
    run = dict(limit_train_batches=3, max_steps=6, precision="bf16-true")
    _, full, _ = fit(tmp_path / "full", [OptimizerSwap(name), SaveAt(3, ckpt)], **run)
    _, resumed, _ = fit(tmp_path / "resumed", [OptimizerSwap(name)], ckpt_path=str(ckpt), **run)
    _, short, _ = fit(tmp_path / "short", [OptimizerSwap(name)], **{**run, "max_steps": 3})
    for (key, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), key
    assert any(
        not torch.equal(a, c) for a, c in zip(params_of(full).values(), params_of(short).values())
    )
    state = torch.load(ckpt, weights_only=False)["callbacks"]["OptimizerSwap"]
    saved = state["optimizer_states"][0]
    if name == "adamw_kahan":
        assert any("kahan_comp" in s for s in saved["state"].values())
    else:
        assert "cpu" in saved["rounding_rng"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_refused_on_32bit_weights(precision) -> None:
    model = tiny_model()
    before = params_of(model)
    with pytest.raises(ValueError, match=r"adamw_kahan.*float32.*precision='bf16-true'"):
        fit(None, [OptimizerSwap("adamw_kahan")], model=model, precision=precision, max_steps=2)
    assert all(torch.equal(v, before[k]) for k, v in params_of(model).items())


def test_swap_undo_points_the_scheduler_back() -> None:
    model = tiny_model().to(torch.bfloat16)
    config = model.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    change = apply_optimizer_swap(opt, "adamw_kahan", schedulers=[sched])
    assert sched.optimizer is change.value and type(change.value).__module__.startswith("optimi")
    assert all(g["kahan_sum"] for g in change.value.param_groups)
    change.undo()
    assert sched.optimizer is opt and not opt.state


def _demo_batch():
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    return (x, x)


#: bytes per parameter of weights + gradients + optimizer states, at most (goal of issue 51)
BYTES_PER_PARAMETER = {"adamw": 8.0, "adamw_kahan": 10.0, "adamw_sr": 8.0, "adamw8bit_sr": 6.5}


@pytest.mark.parametrize("name", ["adamw", "adamw_kahan", SR, SR8])
def test_estimate_within_2_percent_and_bytes_per_parameter(name) -> None:
    """On the CPU the estimate (fake tensors; torchao as its state model) and the tracker's
    measurement of real steps (torchao stepped with the dispatch mode off) agree within 2%."""
    callbacks = [] if name == "adamw" else [OptimizerSwap(name)]
    kw = dict(n_embd=256, n_layer=2, n_head=4, seq_len=64)
    torch.manual_seed(0)
    est = estimate_memory(TinyGPT(**kw), _demo_batch(), precision="bf16-true", callbacks=callbacks)
    real = measure_step(TinyGPT(**kw), _demo_batch(), precision="bf16-true", callbacks=callbacks)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    n = sum(p.numel() for p in TinyGPT(**kw).parameters())
    held = sum(real.by_category[c] for c in ("parameters", "gradients", "optimizer_state"))
    assert held / n <= BYTES_PER_PARAMETER[name] + 0.01  # + the step counters


def test_gate_figures_are_the_benchmarks() -> None:
    """The figures the planner's bf16-weights rungs name are benchmarks/bf16_weights.py's: the
    worst held-out loss against fp32 masters over its learning rates, per form."""
    import json
    from pathlib import Path

    from lightning_efficient.techniques.optimizers.bf16 import GATE, gate_summary

    data = json.loads(
        (Path(__file__).parents[3] / "benchmarks/results/bf16_weights.json").read_text()
    )
    forms = {"adamw": "nearest rounding", **{k: k for k in GATE if k != "adamw"}}
    for name, label in forms.items():
        worst = max(r["loss_vs_reference"] for r in data["quality"] if label in r["form"])
        assert GATE[name] == round(worst, 4), name
    # the gate can fail: plain bf16 AdamW is measurably worse, the compensated forms within 1%
    assert GATE["adamw"] > 0.003 and all(abs(GATE[k]) < 0.01 for k in GATE if k != "adamw")
    assert "+0.02%" in gate_summary("adamw8bit_sr") and "+0.48%" in gate_summary("adamw8bit_sr")


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_auto_efficient_says_bf16_weights_need_the_trainers_precision(caplog, precision) -> None:
    """A callback cannot change a built Trainer's precision: on full-weight training by a trainer
    not built with bf16-true, AutoEfficient says the bf16-weights stacks need it."""
    import logging

    from lightning_efficient.planning import AutoEfficient
    from lightning_efficient.planning.fit import BF16_WEIGHTS_NEED_YAML

    with caplog.at_level(logging.INFO):
        fit(None, [AutoEfficient(budget="1TiB", trial=False)], precision=precision, max_steps=1)
    said = BF16_WEIGHTS_NEED_YAML in caplog.text
    assert said == (precision == "32-true")
