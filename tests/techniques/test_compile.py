"""TorchCompile: in place, regional by default, equal losses, fallback, recompile guard.

Most tests use the ``aot_eager`` backend (Dynamo + AOTAutograd, the same graphs inductor gets,
without code generation, which takes minutes on 2 shared cores); one test runs real inductor.
Tolerances: aot_eager runs the same kernels in the same order, so losses are equal to 1e-6;
inductor fuses and reorders float32 reductions: rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from helpers import fit
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.workloads import tiny_model
from lightning_efficient.core._internals import compiled_call
from lightning_efficient.core.report import report_for
from lightning_efficient.core.technique import NoEffectWarning
from lightning_efficient.techniques._blocks import find_repeated_blocks
from lightning_efficient.techniques.activation_checkpointing import (
    ActivationCheckpointing,
    checkpointed_blocks,
)
from lightning_efficient.techniques.compile import (
    CompileWatch,
    TorchCompile,
    apply_compile,
    compiled_modules,
    uncompile_modules,
    valid_backends,
)

EXACT = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(a: list[float], b: list[float], **tol) -> None:
    assert len(a) == len(b) > 0
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **(tol or EXACT))


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    _, _, rec = fit(tmp_path_factory.mktemp("eager"), max_steps=4)
    return rec.losses


# -- the pure functions ------------------------------------------------------------------------
def test_regional_compiles_the_repeated_blocks_in_place() -> None:
    model = tiny_model(n_layer=3)
    keys = list(model.state_dict())
    x = torch.randint(0, 256, (2, 16))
    expected = model(x)
    names = apply_compile(model, backend="aot_eager").value
    assert (
        names == [n for n, _ in find_repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    )
    assert compiled_modules(model) == names
    assert list(model.state_dict()) == keys  # no _orig_mod.
    with CompileWatch() as watch:
        torch.testing.assert_close(model(x), expected, **EXACT)
    # identical blocks share one graph: one compilation for three blocks
    assert watch.compiles == 1 and watch.seconds > 0
    assert uncompile_modules(model) == names and compiled_modules(model) == []


def test_whole_model_when_not_regional_or_no_blocks() -> None:
    assert apply_compile(tiny_model(), regional=False, backend="aot_eager").value == [""]
    flat = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert apply_compile(flat, backend="aot_eager").value == [""]


class _Probe(pl.Callback):
    """Records which blocks are checkpointed and compiled while training runs."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.seen = (set(checkpointed_blocks(pl_module)), compiled_modules(pl_module))


# -- equivalence -------------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["regional", "whole"])
def test_compiled_losses_equal_eager(scope, tmp_path, eager_losses) -> None:
    regional = scope == "regional"
    tc, probe = TorchCompile(backend="aot_eager", scope=scope), _Probe()
    trainer, model, rec = fit(tmp_path, [tc, probe], max_steps=4)
    _close(rec.losses, eager_losses)
    assert probe.seen[1] == (["blocks.0", "blocks.1"] if regional else [""])
    assert compiled_modules(model) == []  # restored after fit
    figures = report_for(trainer)["TorchCompile"].figures
    assert figures["compiled_modules"] == (2 if regional else 1)
    # the report says how many graphs were captured (identical blocks share one)
    change = report_for(trainer)["TorchCompile"].change
    assert f"; {figures['compiles']} graph" in change
    assert ("blocks in place" in change) == regional
    # compile time is reported apart from the steady state
    assert figures["compile_s"] > 0 and figures["compiles"] >= 1
    assert figures["first_step_s"] > figures["steady_step_s"] > 0


@pytest.mark.slow
def test_real_inductor_matches_eager(tmp_path, eager_losses) -> None:
    tc = TorchCompile(backend="inductor", scope="regional")
    trainer, _, rec = fit(tmp_path, [tc], max_steps=4, limit_val_batches=0)
    _close(rec.losses, eager_losses, rtol=1e-4, atol=1e-5)
    assert report_for(trainer)["TorchCompile"].figures["compile_s"] > 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_every_precision(precision, tmp_path) -> None:
    _, _, eager = fit(tmp_path / "eager", max_steps=3, precision=precision)
    _, _, comp = fit(
        tmp_path / "comp", [TorchCompile(backend="aot_eager")], max_steps=3, precision=precision
    )
    # bf16: autocast/bf16 kernels are the same under aot_eager; allow bf16 rounding of the graph
    _close(comp.losses, eager.losses, rtol=1e-2, atol=1e-2)


def test_self_log_in_training_step_keeps_working(tmp_path) -> None:
    trainer, _, rec = fit(tmp_path, [TorchCompile(backend="aot_eager", scope="whole")], max_steps=3)
    assert "train_loss" in trainer.callback_metrics
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(rec.losses[-1], rel=1e-6)


@pytest.mark.parametrize("order", ["checkpointing-first", "compile-first"])
def test_with_activation_checkpointing_both_orders(order, tmp_path, eager_losses) -> None:
    ac, tc, probe = ActivationCheckpointing(), TorchCompile(backend="aot_eager"), _Probe()
    callbacks = [ac, tc] if order == "checkpointing-first" else [tc, ac]
    plain_keys = set(tiny_model().state_dict())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.compile failed.*")  # no silent fallback
        trainer, model, rec = fit(tmp_path, [*callbacks, probe], max_steps=4)
    _close(rec.losses, eager_losses)
    assert probe.seen == ({"blocks.0", "blocks.1"}, ["blocks.0", "blocks.1"])
    assert set(model.state_dict()) == plain_keys


def test_restore_after_fit_and_a_second_fit_with_a_new_trainer(tmp_path) -> None:
    torch.manual_seed(0)
    plain = tiny_model()
    torch.manual_seed(0)
    model = tiny_model()
    model.head.compile(backend="eager")  # the user's own compile stays as it was
    users = compiled_call(model.head)
    forwards = {n: m.forward for n, m in model.named_modules()}
    for run in range(2):  # each fit with a new Trainer and a new callback
        _, _, eager = fit(tmp_path / f"plain{run}", model=plain, max_steps=2)
        tc, probe = TorchCompile(backend="aot_eager"), _Probe()
        _, _, rec = fit(tmp_path / f"compiled{run}", [tc, probe], model=model, max_steps=2)
        # compiled while training, with the same losses as eager ...
        assert probe.seen[1] == ["blocks.0", "blocks.1", "head"]
        _close(rec.losses, eager.losses)
        # ... and after fit every block runs as before: eagerly, the forwards untouched
        assert compiled_modules(model) == ["head"] and compiled_call(model.head) is users
        assert {n: m.forward for n, m in model.named_modules()} == forwards
        tc.restore(None, model)  # safe twice
        assert compiled_modules(model) == ["head"]


# -- failure and recompiles --------------------------------------------------------------------
def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_compile_failure_falls_back_to_eager_once(tmp_path, eager_losses) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model, rec = fit(tmp_path, [TorchCompile(backend=_failing_backend)], max_steps=4)
    fell_back = [
        w for w in caught if "fell back" in str(w.message) or "eager mode" in str(w.message)
    ]
    assert len(fell_back) == 1, [str(w.message) for w in caught]
    assert "cannot compile anything" in str(fell_back[0].message) and "strict=True" in str(
        fell_back[0].message
    )
    assert compiled_modules(model) == []
    _close(rec.losses, eager_losses)
    assert "fell back to eager" in report_for(trainer)["TorchCompile"].change


def test_compile_failure_raises_when_strict(tmp_path) -> None:
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="cannot compile anything"):
        fit(tmp_path, [TorchCompile(backend=_failing_backend, strict=True)], max_steps=2)


class _VariableLengths(pl.LightningDataModule):
    """Batches whose sequence length changes every step (8, 12, 16, ...)."""

    def __init__(self, lengths: list[int]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, 256, (2, n + 1), generator=g) for n in lengths]

    def train_dataloader(self):
        return DataLoader([(b[:, :-1], b[:, 1:]) for b in self.batches], batch_size=None)


def test_recompile_guard_warns_once_naming_cause_and_fix(tmp_path) -> None:
    lengths = [8, 12, 16, 20, 24, 28]
    tc = TorchCompile(backend="eager", dynamic=False, recompile_warning=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = fit(
            tmp_path,
            [tc],
            data=_VariableLengths(lengths),
            max_steps=len(lengths),
            limit_val_batches=0,
        )
    guard = [str(w.message) for w in caught if "recompilations" in str(w.message)]
    assert len(guard) == 1, guard
    assert "dynamic shapes" in guard[0] and "pad or bucket" in guard[0]
    assert report_for(trainer)["TorchCompile"].figures["recompiles"] >= len(lengths) - 1


def test_no_recompile_warning_for_fixed_shapes(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            tmp_path,
            [TorchCompile(backend="eager", recompile_warning=2)],
            max_steps=4,
            val_check_interval=2,
        )
    assert not [w for w in caught if "recompilations" in str(w.message)]


# -- bad input ---------------------------------------------------------------------------------
def test_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(ValueError, match="`mode`.*max-autotune"):
        TorchCompile(mode="fastest")


def test_unknown_backend_lists_backends() -> None:
    with pytest.raises(ValueError, match="`backend`.*aot_eager.*inductor"):
        TorchCompile(backend="tensorrtx")
    assert "inductor" in valid_backends()


def test_mode_needs_inductor() -> None:
    with pytest.raises(ValueError, match="`mode`.*inductor"):
        TorchCompile(mode="max-autotune", backend="aot_eager")


def test_zero_graphs_compiled_warns_and_reports_no_success(tmp_path) -> None:
    # torch.nn's own layers as the blocks: Dynamo skips their frames, nothing is compiled
    cb = TorchCompile(backend="aot_eager", blocks="Linear")
    with pytest.warns(NoEffectWarning, match="0 graphs compiled"):
        trainer, _, _ = fit(tmp_path, [cb], max_steps=2)
    entry = report_for(trainer)["TorchCompile"]
    assert entry.change.startswith("0 graphs compiled")
    assert entry.figures["compiles"] == 0 and entry.figures["compiled_modules"] == 0


def test_auto_never_compiles_leaf_layers(tmp_path) -> None:
    # blocks whose only repeated siblings are bare layers: auto falls back to the whole model,
    # which Dynamo does trace
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    model = MLP()  # before: fc1 and fc2 were the auto blocks, and 0 graphs were compiled
    with CompileWatch() as watch:
        assert apply_compile(model, backend="aot_eager").value == [""]
        model(torch.randn(2, 8)).sum().backward()
    assert watch.compiles >= 1


# -- scope: regional, whole, or chosen by measurement (issue 29) ---------------------------------
def test_choose_scope_rule_on_given_timings() -> None:
    from lightning_efficient.techniques.compile.scope import WHOLE_FASTER, choose_scope

    # issue 29's H200 record: regional 39.6 ms (8.2 s compile), whole 27.1 ms (16.6 s)
    h200 = choose_scope(39.6e-3, 27.1e-3, regional_compile_s=8.2, whole_compile_s=16.6)
    assert h200.scope == "whole" and "1.46x" in h200.reason
    line = h200.describe()
    for text in ("whole", "regional 39.6 ms", "whole 27.1 ms", "regional 8.2 s", "whole 16.6 s"):
        assert text in line
    assert h200.figures() == {
        "scope": "whole",
        "regional_step_s": 39.6e-3,
        "whole_step_s": 27.1e-3,
        "regional_compile_s": 8.2,
        "whole_compile_s": 16.6,
    }
    # within 3%: regional (the smaller compile); just past it: whole
    assert choose_scope(0.102, 0.100).scope == "regional"
    assert choose_scope(0.100 * WHOLE_FASTER, 0.100).scope == "regional"
    assert choose_scope(0.100 * WHOLE_FASTER * 1.001, 0.100).scope == "whole"
    assert choose_scope(0.095, 0.100).scope == "regional"  # regional faster
    # a scope that could not be measured is not chosen
    assert choose_scope(None, 0.1).scope == "whole"
    assert choose_scope(0.1, None).scope == "regional"
    assert choose_scope(None, None, fallback="whole").scope == "whole"
    assert "neither" in choose_scope(None, None).reason


def test_scope_argument_default_and_no_older_regional() -> None:
    from lightning_efficient.techniques.compile.scope import default_scope

    assert default_scope("cuda") == "auto" and default_scope("cpu") == "regional"
    assert TorchCompile().scope is None  # the device's default, at fit start
    assert TorchCompile(scope="whole").scope == "whole"
    assert TorchCompile(scope="auto").scope == "auto"
    with pytest.raises(ValueError, match="scope"):
        TorchCompile(scope="fastest")
    with pytest.raises(ValueError, match="scope"):
        TorchCompile(scope=True)
    with pytest.raises(TypeError, match="regional"):  # its older form, gone (issue 50)
        TorchCompile(regional=False)


def test_scope_auto_measures_both_reports_them_and_keeps_the_losses(tmp_path, eager_losses) -> None:
    tc, probe = TorchCompile(backend="aot_eager", scope="auto"), _Probe()
    trainer, model, rec = fit(tmp_path, [tc, probe], max_steps=4)
    _close(rec.losses, eager_losses)  # the trial steps change nothing of the fit
    choice = tc.choice
    assert choice is not None and choice.scope in ("regional", "whole")
    assert probe.seen[1] == (["blocks.0", "blocks.1"] if choice.scope == "regional" else [""])
    assert compiled_modules(model) == []  # restored after fit
    entry = report_for(trainer)["TorchCompile"]
    for key in ("regional_step_s", "whole_step_s", "regional_compile_s", "whole_compile_s"):
        assert entry.figures[key] > 0, key
    assert entry.figures["scope"] == choice.scope
    assert any(m.startswith("scope auto chose") for m in tc._said)  # said once, with both


def test_scope_from_yaml(tmp_path) -> None:
    import yaml

    from lightning_efficient.commands.cli import EfficientCLI

    spec = {"class_path": "TorchCompile", "init_args": {"scope": "auto", "backend": "aot_eager"}}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "callbacks": [spec]}}))
    cli = EfficientCLI(args=["--config", str(cfg)], run=False)
    built = next(cb for cb in cli.trainer.callbacks if isinstance(cb, TorchCompile))
    assert built.scope == "auto" and built.backend == "aot_eager"


def test_trial_puts_the_module_back_and_survives_a_failing_scope() -> None:
    """The auto trial: each scope compiled, warmed and timed (interleaved), every trial compile
    undone, the weights, gradients and RNG as before; a scope whose backend fails is reported,
    not chosen."""
    import contextlib

    from lightning_efficient.measure.trials.compile_trial import trial_scopes
    from lightning_efficient.techniques.compile.scope import choose_scope

    model = tiny_model()
    ids = torch.randint(0, 64, (2, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    def broken(gm, inputs):
        raise RuntimeError("backend broke")

    def compile_as(scope, on_error):
        backend = "aot_eager" if scope == "regional" else broken
        return apply_compile(
            model, regional=scope == "regional", backend=backend, on_error=on_error
        )

    timings, calls, errors = trial_scopes(
        compile_as, model, (ids, ids), torch.device("cpu"), contextlib.nullcontext, lambda: 0.0
    )
    assert set(timings) == set(calls) == {"regional"} and "broke" in errors["whole"]
    assert timings["regional"]["steady_step_s"] > 0
    assert list(calls["regional"]) == ["blocks.0", "blocks.1"]
    assert compiled_modules(model) == []  # every trial compile undone
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    choice = choose_scope(None, timings["regional"]["steady_step_s"], errors=errors)
    assert choice.scope == "whole" and choice.errors == errors  # (figures as given)


# -- issue 37: the undo is exact, the user's error surfaces, breaks are reported ------------------
def test_undo_puts_back_exactly_what_each_module_had() -> None:
    model = tiny_model()
    model.blocks[1].compile(backend="aot_eager")  # the user's own compile of one block
    users = compiled_call(model.blocks[1])
    change = apply_compile(model, backend="aot_eager")
    assert all(compiled_call(b) is not None for b in model.blocks)
    change.undo()
    assert "_compiled_call_impl" not in vars(model.blocks[0])  # absent, as before
    assert compiled_call(model.blocks[1]) is users
    assert all(
        "_compiled_call_impl" not in vars(m) for m in model.modules() if m is not model.blocks[1]
    )


class _Raises(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).view(3, -1).sum()  # the user's shape error: 2x4 -> 3 rows


def test_scope_auto_raises_the_users_own_error() -> None:
    import contextlib

    from lightning_efficient.measure.trials.compile_trial import trial_scopes

    model = _Raises()

    def compile_as(scope, on_error):
        return apply_compile(model, regional=False, backend="aot_eager", on_error=on_error)

    with pytest.raises(RuntimeError, match="shape"):
        trial_scopes(
            compile_as,
            model,
            (torch.randn(2, 4),),
            torch.device("cpu"),
            contextlib.nullcontext,
            lambda: 0.0,
        )
    assert compiled_modules(model) == []


def test_compile_trial_changes_no_state_outside_the_state_dict() -> None:
    """issue 37 row 8: the trial's steps leave the counter, the non-persistent buffer, the
    metric and the RNG as they were."""
    import contextlib

    from test_scratch import Stateful, _stateful_batch

    from lightning_efficient.measure.trials.compile_trial import trial_scopes

    torch.manual_seed(0)
    model = Stateful()
    model.training_step(_stateful_batch(), 0)
    seen, sums, count = model.seen, model.sums.clone(), model.acc._update_count
    rng = torch.get_rng_state()

    def compile_as(scope, on_error):
        return apply_compile(model, regional=False, backend="aot_eager", on_error=on_error)

    timings, _, errors = trial_scopes(
        compile_as,
        model,
        _stateful_batch(),
        torch.device("cpu"),
        contextlib.nullcontext,
        lambda: 0.0,
        scopes=("whole",),
    )
    assert not errors and timings["whole"]["steady_step_s"] > 0
    assert model.seen == seen == 16 and torch.equal(model.sums, sums)
    assert model.acc._update_count == count == 1 and torch.equal(torch.get_rng_state(), rng)


class _Breaks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        import os

        y = self.a(x)
        os.getpid()  # Dynamo cannot trace this builtin: a graph break, and its raw warning
        return self.b(y)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_whole_scope_with_graph_breaks_says_where_and_why(tmp_path) -> None:
    tc = TorchCompile(scope="whole", backend="aot_eager")
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[tc],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Breaks(), data)
    entry = report_for(trainer)["TorchCompile"]
    assert "graph break" in entry.change and entry.figures["graph_breaks"] >= 1
    note = next(m for m in tc._said if "graph break" in m)
    assert "forward at line" in note and "skipped" in note
    raw = [w for w in caught if "torch/_dynamo" in w.filename.replace("\\", "/")]
    assert not raw, [str(w.message)[:80] for w in raw]


# -- whole: the model the step calls (issue 49) ---------------------------------------------------
def _lora_fit(tmp_path, callbacks, module_class=None) -> tuple[pl.Trainer, list[float]]:
    """The fine-tuning card's module shape: ``training_step`` returns ``self.model(**batch).loss``
    (PEFT LoRA on a tiny Llama) and the module defines no forward of its own."""
    from helpers import LossRecorder, tiny_trainer
    from own_loader import OwnLoaderLoRA

    pl.seed_everything(0, verbose=False)
    module, rec = (module_class or OwnLoaderLoRA)(), LossRecorder()
    trainer = tiny_trainer(tmp_path, [*callbacks, rec], max_steps=2, limit_val_batches=0)
    trainer.fit(module)
    return trainer, rec.losses


def test_whole_compiles_the_model_the_step_calls(tmp_path) -> None:
    """``scope="whole"`` compiled the LightningModule's own call, which such a step never makes:
    0 graphs, no warning, and a report that read "compiled the whole model". It compiles the
    child the step calls; the losses equal eager."""
    pytest.importorskip("peft")
    probe = _Probe()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoEffectWarning)
        trainer, losses = _lora_fit(
            tmp_path, [TorchCompile(backend="aot_eager", scope="whole"), probe]
        )
    _, eager = _lora_fit(tmp_path, [])
    assert probe.seen[1] == ["model"]
    entry = report_for(trainer)["TorchCompile"]
    assert entry.figures["compiles"] >= 1 and entry.figures["compiled_modules"] == 1
    assert entry.change.startswith("compiled `model` whole (aot_eager)"), entry.change
    _close(losses, eager, rtol=1e-4, atol=1e-5)


def test_a_compiled_module_the_step_never_calls_warns(tmp_path) -> None:
    """A module with a forward of its own whose step calls ``self.model(...)`` instead: what was
    compiled never runs; the callback says so (NoEffectWarning, "0 graphs compiled")."""
    pytest.importorskip("peft")
    from own_loader import OwnLoaderLoRA

    class Bypassed(OwnLoaderLoRA):
        def forward(self, **batch):  # the step does not call it
            return self.model(**batch)

    with pytest.warns(NoEffectWarning, match="never calls the module's own forward"):
        trainer, _ = _lora_fit(
            tmp_path, [TorchCompile(backend="aot_eager", scope="whole")], Bypassed
        )
    entry = report_for(trainer)["TorchCompile"]
    assert entry.change.startswith("0 graphs compiled") and entry.figures["compiled_modules"] == 0
