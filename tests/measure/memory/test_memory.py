"""MemoryBreakdown: real steps measured during fit, on sampled steps only."""

from __future__ import annotations

import csv

import pytest
import torch
from helpers import fit
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import _get_current_dispatch_mode

from benchmarks.workloads import tiny_model
from lightning_efficient import MemoryBreakdown, estimate_memory
from lightning_efficient.core.report import report_for
from lightning_efficient.measure import CATEGORIES, StorageTracker


class ModeSpy(Callback):
    """Records, per step, whether a storage tracker was active during the training step."""

    def __init__(self) -> None:
        self.active: dict[int, bool] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.active[trainer.global_step] = isinstance(_get_current_dispatch_mode(), StorageTracker)


def test_measures_sampled_step_logs_and_prints(tmp_path, capsys) -> None:
    spy = ModeSpy()
    breakdown = MemoryBreakdown()
    logger = CSVLogger(tmp_path, name="mem")
    trainer, model, _ = fit(
        tmp_path, [breakdown, spy], max_steps=3, logger=logger, limit_val_batches=0
    )
    # only step 1 ran under the tracker
    assert spy.active == {0: False, 1: True, 2: False}
    assert list(breakdown.measurements) == [1]
    got = breakdown.measurement
    assert sum(got.by_category.values()) == got.peak_bytes
    n_params = sum(p.numel() for p in model.parameters()) * 4
    assert got.by_category["parameters"] >= n_params
    assert got.by_category["optimizer_state"] == pytest.approx(2 * n_params, rel=0.01)
    # the estimate of the same step (same batch shape, the module's optimizer type) agrees
    x = torch.zeros(4, 32, dtype=torch.long)
    est = estimate_memory(tiny_model(), (x, x), optimizer=lambda g: torch.optim.AdamW(g))
    assert abs(est.peak_bytes - got.peak_bytes) <= 0.05 * got.peak_bytes, (str(est), str(got))
    # logger metrics, the table at the end of fit, the report row
    logger.save()
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    logged = [r for r in rows if r.get("memory/peak_bytes")]
    assert len(logged) == 1 and float(logged[0]["memory/peak_bytes"]) == got.peak_bytes
    assert all(f"memory/{c}_bytes" in rows[0] for c in CATEGORIES)
    out = capsys.readouterr().out
    assert out.count("MemoryBreakdown: step 1") == 1 and "activations" in out
    row = report_for(trainer)["MemoryBreakdown"]
    assert row.figures["peak_bytes"] == got.peak_bytes and "step 1" in row.change


def test_several_steps_and_accumulation(tmp_path) -> None:
    breakdown = MemoryBreakdown(sample_steps=[0, 2], print_table=False)
    fit(tmp_path, [breakdown], max_steps=3, accumulate_grad_batches=2, limit_val_batches=0)
    first, third = breakdown.measurements[0], breakdown.measurements[2]
    # step 0 has no optimizer state before its optimizer step; both micro-batches were measured
    assert first.phase_peaks["forward"] < third.phase_peaks["forward"]
    assert third.by_category["optimizer_state"] > 0 and third.by_category["gradients"] > 0


def test_no_sampled_step_says_so(tmp_path) -> None:
    with pytest.warns(UserWarning, match="no sampled step ran"):
        fit(tmp_path, [MemoryBreakdown(sample_steps=[10])], max_steps=2, limit_val_batches=0)


@pytest.mark.parametrize(
    "bad,arg", [({"sample_steps": [1.5]}, "sample_steps"), ({"log_metrics": 1}, "log_metrics")]
)
def test_bad_arguments(bad, arg) -> None:
    with pytest.raises((TypeError, ValueError), match=arg):
        MemoryBreakdown(**bad)


@pytest.mark.gpu
def test_cuda_allocator_breakdown(tmp_path) -> None:
    breakdown = MemoryBreakdown(print_table=False)
    _, model, _ = fit(tmp_path, [breakdown], max_steps=2, accelerator="gpu", limit_val_batches=0)
    got = breakdown.measurement
    n_params = sum(p.numel() for p in model.parameters()) * 4
    assert 0 < got.peak_bytes <= torch.cuda.max_memory_allocated()
    assert sum(got.by_category.values()) == got.peak_bytes
    assert got.by_category["parameters"] >= n_params
    assert got.by_category["optimizer_state"] == pytest.approx(2 * n_params, rel=0.05)
    assert got.by_category["activations"] > 0 and got.by_category["gradients"] >= n_params


class EstimateDuringStep(Callback):
    """Makes an estimate inside the measured step (as a budget search at batch start would)."""

    def __init__(self) -> None:
        self.estimate = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            self.estimate = estimate_memory(pl_module, batch, steps=1)


def test_estimate_inside_a_measured_step_is_not_counted(tmp_path) -> None:
    plain = MemoryBreakdown(print_table=False)
    fit(tmp_path / "a", [plain], max_steps=2, limit_val_batches=0)
    spy = EstimateDuringStep()
    nested = MemoryBreakdown(print_table=False)
    fit(tmp_path / "b", [nested, spy], max_steps=2, limit_val_batches=0)
    assert spy.estimate is not None and spy.estimate.peak_bytes > 0.5 * plain.measurement.peak_bytes
    assert nested.measurement.peak_bytes == plain.measurement.peak_bytes


def test_memory_figure_bars_are_the_measured_categories(tmp_path) -> None:
    """`MemoryBreakdown(plot=...)`'s picture: one bar per category, its height the bytes in MiB,
    the size written on it (issue 42)."""
    from lightning_efficient.core.validate import format_bytes
    from lightning_efficient.measure.memory.breakdown import plot_measurement
    from lightning_efficient.measure.memory.types import MemoryEstimate
    from lightning_efficient.measure.plots import memory_figure

    cats = {"parameters": 2**20, "gradients": 2**20, "optimizer_state": 2 * 2**20}
    cats |= {"activations": 5 * 2**20 + 2**19, "temporaries": 0}
    fig = memory_figure(cats)
    assert [p.get_height() for p in fig.axes[0].patches] == pytest.approx([1, 1, 2, 5.5, 0])
    measured = MemoryEstimate(
        peak_bytes=sum(cats.values()), by_category=cats, peak_phase="backward", phase_peaks={}
    )
    path = tmp_path / "memory.svg"
    plot_measurement(measured, 1, str(path))
    text = path.read_text()
    assert "peak 9.50 MiB (backward, measured)" in text
    assert all(format_bytes(v) in text for v in cats.values())
    plot_measurement(measured, 1, str(tmp_path / "again.svg"))
    assert (tmp_path / "again.svg").read_text() == text  # deterministic SVG
