"""measure/trials/trial.py: real trial steps measured by the instrument's peak meter (the storage
tracker on a CPU, the CUDA allocator on a GPU), leaving the module as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import params_of

from benchmarks.workloads import tiny_model
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.trials.trial import is_out_of_memory, throughput, trial_step


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(n))
    return x, x


def test_trial_step_peak_on_cpu_is_the_trackers_and_leaves_the_module_unchanged() -> None:
    torch.manual_seed(0)
    model = tiny_model().train(False)
    before = params_of(model)
    peaks = {n: trial_step(model, _batch(n), "adamw") for n in (2, 8)}
    # the module is put back: weights, no gradients, eval mode
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    # the same step as the instrument's real measurement and its fake-tensor estimate
    for n, peak in peaks.items():
        measured = measure_step(tiny_model(), _batch(n), "adamw", steps=1).peak_bytes
        estimated = estimate_memory(tiny_model(), _batch(n), optimizer="adamw", steps=1).peak_bytes
        assert peak == pytest.approx(measured, rel=0.01) and peak == pytest.approx(
            estimated, rel=0.01
        )
    assert peaks[8] > peaks[2] > sum(p.numel() * 4 for p in model.parameters())


class Greedy(torch.nn.Module):
    """A model whose step asks the allocator for 2**60 bytes: a real CPU allocation failure."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        torch.empty(2**60, dtype=torch.uint8)


def test_throughput_samples_per_second_and_none_on_oom() -> None:
    model = tiny_model()
    rate = throughput(model, _batch(4), "adamw", samples=4, accumulation=2)
    assert rate is not None and rate > 0
    assert throughput(Greedy(), (torch.randn(2, 4),), "sgd", samples=2) is None
    with pytest.raises(RuntimeError) as err:  # trial_step raises what the step raised
        trial_step(Greedy(), (torch.randn(2, 4),), "sgd")
    assert is_out_of_memory(err.value)


@pytest.mark.gpu
def test_trial_step_on_cuda_reads_the_allocator() -> None:
    model = tiny_model()
    peak = trial_step(model, _batch(8), "adamw", device="cuda", precision="bf16-mixed")
    estimated = estimate_memory(
        tiny_model(),
        _batch(8),
        optimizer="adamw",
        precision="bf16-mixed",
        steps=1,
        device="cuda",  # this GPU: its kernels and cuBLAS workspaces (most of a tiny step)
    )
    assert estimated.by_category["workspaces"] > 0.9 * estimated.peak_bytes
    assert peak > 0 and peak == pytest.approx(estimated.peak_bytes, rel=0.25)
    assert next(model.parameters()).device.type == "cpu"  # put back where it was


def test_trial_within_a_budget_on_cpu() -> None:
    from lightning_efficient.measure.trials.trial import trial_within
    from lightning_efficient.techniques import ActivationCheckpointing

    model = tiny_model()
    before = params_of(model)
    plain = trial_within(model, _batch(8), None, optimizer="adamw")
    assert plain.ok and plain.reserved_bytes == plain.allocated_bytes > 0
    assert not trial_within(model, _batch(8), plain.reserved_bytes - 1).ok  # over the budget
    # techniques apply as they do to an estimate: checkpointing keeps fewer activations
    ac = trial_within(model, _batch(8), None, callbacks=[ActivationCheckpointing()])
    assert ac.ok and ac.allocated_bytes < plain.allocated_bytes
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    # an out-of-memory error is a result, not an exception
    oom = trial_within(Greedy(), (torch.randn(2, 4),), 2**30, optimizer="sgd")
    assert not oom.ok and "can't allocate memory" in oom.error


@pytest.mark.gpu
def test_trial_within_on_cuda_reads_the_peak_meter() -> None:
    from lightning_efficient.measure.trials.trial import trial_within

    model = tiny_model()
    plain = trial_within(model, _batch(8), None, optimizer="adamw", device="cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the allocator's figures, the module's own parameters on the device counted
    assert plain.ok and plain.reserved_bytes >= plain.allocated_bytes > params
    assert not trial_within(model, _batch(8), plain.allocated_bytes // 2, device="cuda").ok
    assert next(model.parameters()).device.type == "cpu"  # put back where it was


def _cross_entropy(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _wide(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The same loss plus a product 8x the logits wide that backward keeps (``sin`` saves it)."""
    return _cross_entropy(model, batch) + model(batch[0]).repeat(1, 1, 8).sin().mean()


def test_trials_run_the_estimates_loss_fn() -> None:
    """A ``loss_fn`` that keeps more for backward raises the estimate's peak, and the trials'
    by as much: they run the estimate's ``loss_fn``, not the module's ``training_step``."""
    from lightning_efficient.measure.trials.trial import trial_within

    model, batch = tiny_model(), _batch(8)
    before = params_of(model)
    settings = {"optimizer": "adamw", "device": "cpu", "steps": 1}
    est = {
        f: estimate_memory(model, batch, loss_fn=f, **settings).peak_bytes
        for f in (_cross_entropy, _wide)
    }
    tried = {f: trial_within(model, batch, loss_fn=f, steps=1).allocated_bytes for f in est}
    stepped = {f: trial_step(model, batch, "adamw", loss_fn=f) for f in est}
    grown = est[_wide] - est[_cross_entropy]
    assert grown > 8 * 32 * 256 * 8 * 4  # at least the wide product (batch x seq x vocab x 8)
    assert tried[_wide] - tried[_cross_entropy] == pytest.approx(grown, rel=0.05)
    assert stepped[_wide] - stepped[_cross_entropy] > 0.9 * grown  # one step, the same loss
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())
    # a plain module (no training_step) is tried with its loss_fn, as it is estimated
    plain = torch.nn.Linear(4, 2)
    square = lambda m, b: m(b[0]).square().mean()  # noqa: E731
    assert trial_step(plain, (torch.randn(3, 4),), "sgd", loss_fn=square) > 0
    assert throughput(plain, (torch.randn(3, 4),), "sgd", samples=3, loss_fn=square) > 0
