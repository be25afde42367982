"""ExactAccumulation and every technique that accumulates: the accumulated update equals one SGD
step (lr 1: the weight change is the gradient) on the window's samples taken together, in fp32,
for token-mean losses over variable-length samples (issue 48). Each test also measures Lightning's
own accumulation on the same data, whose error (0.2-0.9) is what today's main gives."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from _accumulation_cases import (
    Batches,
    HFModule,
    PlainModule,
    concat,
    fit_once,
    padded_samples,
    snapshot,
    update_error,
    whole_batch_update,
    whole_window_update,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from lightning_efficient.core.validate import SettingsError
from lightning_efficient.techniques.accumulation import (
    WINDOW_LOSS,
    ExactAccumulation,
    measured_share,
    window_factor,
)
from lightning_efficient.techniques.accumulation.weighting import per_sample_counts, weighting_of
from lightning_efficient.techniques.batch_size import EfficientBatchSize

EXACT = 1e-5


def _errors(make, callbacks, clip=None, **trainer_kwargs):
    """(error of Lightning's accumulation, error with ``callbacks``) of one step of 4 x 4."""
    errors = []
    for cbs in ([], callbacks):
        module = make()
        expected = whole_window_update(module, module.samples, clip)
        before = snapshot(module)
        fit_once(module, list(cbs), gradient_clip_val=clip, **trainer_kwargs)
        errors.append(update_error(before, module, expected))
    return errors


# -- the pure maths --------------------------------------------------------------------------
def test_window_factor_and_share():
    assert float(window_factor(torch.tensor(200.0), 4, 2)) == pytest.approx(8 / 200)
    # a token mean over [10 targets with mean 1.0] + [30 targets with mean 2.0]
    assert measured_share(1.75, 1.0, 2.0) == pytest.approx(0.25)
    assert measured_share(1.0, 1.0, 1.0) is None
    assert weighting_of(0.25, {"samples": 0.5, "tokens": 0.25}) == ["tokens"]
    assert weighting_of(0.37, {"samples": 0.5, "tokens": 0.25}) == []
    # short documents: the shift changes the share (4, 5 | 16, 23 tokens; pydoc paragraphs)
    shares = {"samples": 0.5, "tokens": 0.1875, "shifted tokens": 0.1591}
    assert weighting_of(0.1591, shares) == ["shifted tokens"]


def test_counts_per_sample():
    batch = {"labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    counts = per_sample_counts(batch)
    assert counts["tokens"].tolist() == [2.0, 1.0]
    assert counts["shifted tokens"].tolist() == [1.0, 0.0]


# -- the "done when" tests ---------------------------------------------------------------------
@pytest.mark.parametrize("sort", [False, True], ids=["random", "length-sorted"])
def test_efficient_batch_size_target_is_one_step_on_the_batch(sort):
    """A padded HF causal LM (loss after the shift) under EfficientBatchSize(target) with its
    defaults: micro-batch 4 x accumulation 4 gives the update of the batch of 16."""
    samples = padded_samples(sort=sort)
    make = lambda: HFModule(samples=samples, batch_size=16)  # noqa: E731
    sizer = EfficientBatchSize(target_batch_size=16, max_batch_size=4, optimizer="sgd")
    plain_module = make()
    expected = whole_window_update(plain_module, samples)
    before = snapshot(plain_module)
    plain_module.batch_size = 4
    fit_once(plain_module, [], accumulate_grad_batches=4)
    plain = update_error(before, plain_module, expected)
    module = make()
    before = snapshot(module)
    trainer = fit_once(module, [sizer])
    assert sizer.accumulate_grad_batches == 4 and sizer.micro_batch_size == 4
    assert update_error(before, module, expected) <= EXACT
    assert plain > 0.1  # Lightning's accumulation (what EfficientBatchSize gave before)
    assert [type(c).__name__ for c in trainer.callbacks] == ["EfficientBatchSize"]  # put back
    assert module.batch_size == 16


def test_own_shift_cross_entropy_with_clipping():
    """A module with its own shift and F.cross_entropy(ignore_index=-100): the clip sees the
    exact window gradient (the clip is active: the update's norm is the clip value)."""
    exact = ExactAccumulation()
    plain, err = _errors(lambda: PlainModule(), [exact], clip=0.05, accumulate_grad_batches=4)
    assert err <= EXACT < 0.1 < plain
    assert exact.weights.weighting == "shifted tokens"


def test_label_smoothing_and_dict_schedule():
    exact = ExactAccumulation()
    schedule = GradientAccumulationScheduler({0: 4})
    plain, err = _errors(lambda: PlainModule(smoothing=0.1), [exact, schedule])
    assert err <= EXACT < 0.1 < plain


def test_mean_over_samples_of_token_means_stays_exact():
    """The weighting follows the loss: a mean over samples is weighted by samples, not tokens."""
    exact = ExactAccumulation()
    _, err = _errors(lambda: PlainModule(per_sample=True), [exact], accumulate_grad_batches=4)
    assert exact.weights.weighting == "samples"
    assert err <= EXACT
    # and weighting it by tokens (what an assumed token mean would do) is wrong
    forced = ExactAccumulation(token_counter=lambda b: (b["labels"][:, 1:] != -100).sum())
    _, wrong = _errors(lambda: PlainModule(per_sample=True), [forced], accumulate_grad_batches=4)
    assert wrong > 0.05


def test_short_last_window():
    """24 samples, micro-batch 4, accumulation 4: the epoch ends with a window of 2 batches,
    which Lightning divides by 4 (PL #19987); both steps equal whole-window steps."""
    samples = padded_samples(n=24, seed=1)
    for callbacks, check in (
        ([], lambda e: e > 0.1),
        ([ExactAccumulation()], lambda e: e <= EXACT),
    ):
        module = HFModule(samples=samples)
        ref = copy.deepcopy(module)
        for window in (samples[:16], samples[16:]):
            update = whole_window_update(ref, window)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p += update[n]
        before = snapshot(module)
        fit_once(module, callbacks, max_steps=-1, max_epochs=1, accumulate_grad_batches=4)
        expected = {n: p.detach() - before[n] for n, p in ref.named_parameters()}
        assert check(update_error(before, module, expected))


def test_window_loss_logged_is_the_whole_batch_loss():
    module = PlainModule()
    whole = float(module.training_step(concat([s | {} for s in [_stack(module.samples)]]), 0))
    trainer = fit_once(module, [ExactAccumulation()], accumulate_grad_batches=4)
    assert float(trainer.callback_metrics[WINDOW_LOSS]) == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("order", ["guard first", "guard last"])
def test_divergence_guard_judges_the_true_window_loss(order):
    """DivergenceGuard's baseline after one step is the window's token-mean loss (the whole
    batch's), and the gradient norm it may read is the exact one, whatever the callbacks' order."""
    from lightning_efficient.techniques.early_stopping import DivergenceGuard

    module = PlainModule()
    whole = float(module.training_step(_stack(module.samples), 0))
    guard, exact = DivergenceGuard(), ExactAccumulation()
    callbacks = [guard, exact] if order == "guard first" else [exact, guard]
    plain_guard = DivergenceGuard()
    fit_once(PlainModule(), [plain_guard], accumulate_grad_batches=4)
    fit_once(module, callbacks, accumulate_grad_batches=4)
    # an untrained model's losses are all near log(vocabulary): the gap is small but 20x ours
    assert guard.detector.baseline == pytest.approx(whole, rel=2e-6)
    assert abs(plain_guard.detector.baseline / whole - 1) > 4e-5  # Lightning's mean of means


def _stack(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def test_resume_is_bit_identical(tmp_path):
    """Saved after the first epoch's 2 windows and resumed: equal to the run of 4 steps."""
    from helpers import SaveAt

    samples = padded_samples(n=16, seed=2)
    kw = dict(accumulate_grad_batches=2, max_steps=4, default_root_dir=str(tmp_path))
    whole = HFModule(samples=samples)
    fit_once(whole, [ExactAccumulation(), SaveAt(2, tmp_path / "half.ckpt")], **kw)
    resumed = HFModule(samples=samples)
    exact, seen = ExactAccumulation(), _Added()
    pl.Trainer(
        callbacks=[exact, seen], accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **kw,
    ).fit(resumed, ckpt_path=str(tmp_path / "half.ckpt"))  # fmt: skip
    assert seen.at_start == ["shifted tokens"]  # restored before the first batch: no new probe
    assert exact.weights.probes == 1 and exact.weights.windows == 2
    for (n, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_chunked_cross_entropy_in_the_stack():
    from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy

    exact = ExactAccumulation()
    plain, err = _errors(
        lambda: HFModule(), [ChunkedCrossEntropy(), exact], accumulate_grad_batches=4
    )
    assert err <= EXACT < 0.1 < plain
    assert exact.weights.weighting == "shifted tokens"


class _NoCache(HFModule):
    """Documents of a packed row kept apart by their restarting position_ids (transformers does so
    without a cache: what SequencePacking's wrapper passes, and the reference needs)."""

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss


def test_sequence_packing_rows_of_unequal_tokens():
    """Packed rows of unequal token counts (documents of 4..20 and 60..95 tokens in rows of 100,
    -100 at boundaries and padding): the update equals one step on the window's rows together."""
    from lightning_efficient.techniques.packing import SequencePacking

    docs = [
        {"input_ids": s["input_ids"][: int(s["attention_mask"].sum())]}
        for s in padded_samples(24, 60) + padded_samples(8, 4, 20)
    ]
    for s in docs:
        s["labels"] = s["input_ids"].clone()
    errors = []
    for extra in ([], [ExactAccumulation()]):
        module = _NoCache(samples=docs, batch_size=2)
        seen = Batches()
        before = snapshot(module)
        start = copy.deepcopy(module)
        fit_once(module, [SequencePacking(row_length=100, rows_per_batch=2), *extra, seen],
                 accumulate_grad_batches=3)  # fmt: skip
        rows = concat(seen.seen)
        rows.pop("attention_mask")  # as SequencePacking's wrapper calls the model
        assert len({int((r["labels"] != -100).sum()) for r in seen.seen}) > 1
        errors.append(update_error(before, module, whole_batch_update(start, rows)))
    assert errors[1] <= EXACT < 0.01 < errors[0]


@pytest.mark.ddp_case("accumulation")
def test_ddp_two_ranks_of_unequal_tokens(ddp_case):
    """2 processes, micro-batch 4 x accumulation 2 each (rank r: samples r, r+2, ...): the update
    equals one process's step on all 16 samples; the logged window loss is their token mean."""
    import json

    module = HFModule(samples=padded_samples())
    expected = whole_window_update(module, module.samples)
    before = snapshot(module)
    errors = {}
    for name in ("plain", "exact"):
        after = torch.load(ddp_case / f"{name}.pt")
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(after[n])
        errors[name] = update_error(before, module, expected)
    assert errors["exact"] <= EXACT < 0.1 < errors["plain"]
    record = json.loads((ddp_case / "exact.json").read_text())
    whole = float(HFModule(samples=padded_samples()).training_step(_stack(module.samples), 0))
    assert record["loss"] == pytest.approx(whole, rel=1e-5)
    assert record["weighting"] == "shifted tokens"


# -- refusals and the warning ---------------------------------------------------------------------
class _Manual(PlainModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.optimizers().step()


def test_manual_optimization_is_refused_before_training():
    module = _Manual()
    before = snapshot(module)
    with pytest.raises(SettingsError, match="manual optimization"):
        fit_once(module, [ExactAccumulation()])
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_optimizer_in_backward_is_refused_before_training():
    from lightning_efficient.techniques.optimizers import OptimizerSwap

    module = PlainModule()
    before = snapshot(module)
    swap = OptimizerSwap("adamw", optimizer_in_backward=True)
    with pytest.raises(SettingsError, match="optimizer steps inside backward"):
        fit_once(module, [swap, ExactAccumulation()])
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


class _Summed(PlainModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * batch["labels"].shape[0] ** 2


def test_undetermined_weighting_warns_once_with_the_spread():
    exact = ExactAccumulation()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_once(_Summed(), [exact], accumulate_grad_batches=4)
    said = [str(w.message) for w in caught if "could not be measured" in str(w.message)]
    assert len(said) == 1 and "targets per micro-batch" in said[0] and "token_counter" in said[0]
    assert exact.weights.weighting is None


# -- AutoEfficient: its plan's micro-batch x accumulation ------------------------------------------
@pytest.mark.parametrize("sort", [False, True], ids=["random", "length-sorted"])
def test_auto_efficient_plan_with_accumulation_is_one_step_on_the_batch(sort):
    """AutoEfficient on a padded HF causal LM whose plain step at micro-batch 4 just fits the
    budget (goal "memory": the cheapest stack, at its largest micro-batch): its plan is 4 x 4 and
    the update equals one step on the 16 samples (Lightning's accumulation: 0.2 / 0.9)."""
    from lightning_efficient import AutoEfficient
    from lightning_efficient.planning import Rung
    from lightning_efficient.planning import fit as auto_fit
    from lightning_efficient.techniques.batch_size.choice import worst_case_sampler

    samples = padded_samples(sort=sort)
    probe = HFModule(samples=samples, batch_size=16)
    make, _ = worst_case_sampler(probe.train_dataloader(), 100)
    measure = auto_fit.estimate_measure(probe, make, 10**12, 16, {"precision": "32-true"})
    budget = int(measure(Rung("as configured", "32-true"), 4)[1] * 1.01)
    module = HFModule(samples=samples, batch_size=16)
    expected = whole_window_update(module, samples)
    before = snapshot(module)
    auto = AutoEfficient(budget=budget, goal="memory", trial=False)
    fit_once(module, [auto])
    d = auto.decision
    assert (d.rung.name, d.micro, d.accumulation) == ("as configured", 4, 4)
    assert update_error(before, module, expected) <= EXACT


class _Added(pl.Callback):
    """The ExactAccumulation a technique added, and its weighting before the first batch."""

    def __init__(self) -> None:
        self.exact: list[ExactAccumulation] = []
        self.at_start: list[str | None] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.exact += [c for c in trainer.callbacks if isinstance(c, ExactAccumulation)]
        self.at_start += [c.weights.weighting for c in self.exact]


def _adder(name):
    from lightning_efficient import AutoEfficient
    from lightning_efficient.planning import Rung
    from lightning_efficient.planning.decision import Decision

    if name == "EfficientBatchSize":
        return EfficientBatchSize(target_batch_size=4, max_batch_size=2, optimizer="sgd")
    return AutoEfficient(budget="1GiB", trial=False).preset(
        Decision(Rung("as configured", "32-true"), 2, 2)
    )


@pytest.mark.parametrize("name", ["EfficientBatchSize", "AutoEfficient"])
def test_added_exact_accumulation_resumes_bit_identical(tmp_path, name):
    """The ExactAccumulation a technique adds keeps its measurement in the checkpoint: resumed
    after 2 of 4 steps (micro-batch 2 x 2), no new probe, and the weights equal the uninterrupted
    run's bit for bit."""
    from helpers import SaveAt

    samples = padded_samples(n=8, seed=2)  # an epoch: 2 steps (the checkpoint at its end)
    kw = dict(max_steps=4, default_root_dir=str(tmp_path))
    whole = HFModule(samples=samples, batch_size=4)
    first = _Added()
    fit_once(whole, [_adder(name), first, SaveAt(2, tmp_path / "half.ckpt")], **kw)
    resumed = HFModule(samples=samples, batch_size=4)
    again = _Added()
    pl.Trainer(
        callbacks=[_adder(name), again], accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw,
    ).fit(resumed, ckpt_path=str(tmp_path / "half.ckpt"))  # fmt: skip
    (exact,) = again.exact
    assert first.at_start == [None] and again.at_start == ["shifted tokens"]  # restored
    assert first.exact[0].weights.probes == 1
    assert exact.weights.probes == 1 and exact.weights.weighting == "shifted tokens"
    assert exact.weights.windows == 2  # the two steps after the checkpoint
    for (n, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_deepspeed_own_accumulation_is_refused_before_training():
    """DeepSpeed accumulates itself (its gradient_accumulation_steps, equal weights): refused in
    setup with the reason, a real ZeRO strategy on a CPU, before any step; the module as given."""
    pytest.importorskip("deepspeed")
    from lightning_efficient.techniques.zero_offload import ZeROOffload

    module = PlainModule()
    before = snapshot(module)
    with pytest.raises(SettingsError, match="accumulates gradients itself"):
        fit_once(module, [ExactAccumulation()], strategy=ZeROOffload(), accumulate_grad_batches=4)
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("order", ["profiler first", "profiler last"])
def test_rescale_lands_in_the_profilers_optimizer_phase(monkeypatch, order):
    """StepProfiler puts the window's rescale in its ``optimizer`` phase, whatever the callbacks'
    order: the rescale made 60 ms slower (a sleep in our own function) gives that phase at least
    60 ms per step (the SGD step itself takes about a millisecond)."""
    import time

    from lightning_efficient import StepProfiler
    from lightning_efficient.techniques.accumulation import window

    rescale = window.scale_gradients

    def slow(*args):
        time.sleep(0.06)
        rescale(*args)

    monkeypatch.setattr(window, "scale_gradients", slow)
    profiler = StepProfiler(skip_steps=1, print_table=False)
    exact = ExactAccumulation()
    callbacks = [profiler, exact] if order == "profiler first" else [exact, profiler]
    fit_once(PlainModule(), callbacks, max_steps=3, accumulate_grad_batches=2)
    phases = profiler.summary["phases"]
    assert phases["optimizer"] >= 0.06, phases


def test_estimate_says_the_scalars_held():
    """The estimate with ExactAccumulation: the same peak, and a note of the bytes it holds."""
    from lightning_efficient.measure.memory import estimate_memory
    from lightning_efficient.techniques.accumulation.window import held_bytes

    module, batch = PlainModule(), _stack(padded_samples(n=4))
    kw = dict(optimizer="sgd", accumulate_grad_batches=2, cuda_rounding=True)
    plain = estimate_memory(module, batch, **kw)
    exact = estimate_memory(module, batch, callbacks=[ExactAccumulation()], **kw)
    assert exact.peak_bytes == plain.peak_bytes
    assert held_bytes(True) == 3072 and held_bytes() == 48  # 6 tensors: 512 B each on CUDA
    assert any("3,072 bytes of scalars per step" in n for n in exact.notes), exact.notes


def test_functional_own_loop_is_one_step_on_the_window():
    """A loop of one's own with lightning_efficient.functional: backward on each micro-batch's
    loss x its count, the gradients x window_factor(N, 1) before the step: one step on the 16."""
    import lightning_efficient.functional as LF

    module = HFModule(samples=padded_samples(sort=True))
    expected = whole_window_update(module, module.samples)
    before = snapshot(module)
    total = torch.tensor(0.0)
    for i in range(0, 16, 4):
        batch = _stack(module.samples[i : i + 4])
        n = LF.count(batch, "shifted tokens")
        (module.training_step(batch, 0) * n).backward()
        total += n
    factor = LF.window_factor(total, 1)
    with torch.no_grad():
        for p in module.parameters():
            p -= p.grad * factor  # SGD, lr 1
    assert update_error(before, module, expected) <= EXACT
    with pytest.raises(ValueError, match="weighting"):
        LF.count(batch, "token")


def test_fit_auto_command_plan_with_accumulation_is_one_step_on_the_batch(
    tmp_path, monkeypatch, capsys
):
    """``lightning-efficient fit --auto --goal memory`` with the budget of the test above: the
    command's plan is 4 x 4 and the saved weights are one step on the 16 samples."""
    import yaml

    from lightning_efficient.commands import main
    from lightning_efficient.planning import Rung
    from lightning_efficient.planning import fit as auto_fit
    from lightning_efficient.techniques.batch_size.choice import worst_case_sampler

    monkeypatch.chdir(tmp_path)
    probe = HFModule(batch_size=16)  # the default samples: padded_samples()
    make, _ = worst_case_sampler(probe.train_dataloader(), 100)
    measure = auto_fit.estimate_measure(probe, make, 10**12, 16, {"precision": "32-true"})
    budget = int(measure(Rung("as configured", "32-true"), 4)[1] * 1.01)
    expected = whole_window_update(probe, probe.samples)
    config = {
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False,
            "enable_progress_bar": False, "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
        },
        "model": {"class_path": "_accumulation_cases.HFModule", "init_args": {"batch_size": 16}},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    args = ["fit", "--auto", "--budget", str(budget), "--goal", "memory", "--no-trial"]
    assert main([*args, "--config", str(tmp_path / "c.yaml")]) == 0
    assert "as configured: micro-batch 4 x accumulation 4" in capsys.readouterr().out
    (ckpt,) = tmp_path.rglob("*.ckpt")
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    module = HFModule(batch_size=16)
    before = snapshot(module)
    module.load_state_dict(state)
    assert update_error(before, module, expected) <= EXACT
