"""Every private name the package relies on, called against the installed libraries: a release
that moves one fails here, by name, instead of deep inside a fit."""

from __future__ import annotations

import platform
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_efficient.core import _internals as I


def test_tested_ranges_cover_the_installed_versions() -> None:
    for package, (low, high) in I.TESTED.items():
        version = I.installed_version(package)
        if version == "not installed":
            continue
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
        as_tuple = lambda s: tuple(int(x) for x in s.split("."))  # noqa: E731
        assert as_tuple(low) <= major_minor <= as_tuple(high), (package, version, low, high)


def test_fake_tensors_and_their_errors() -> None:
    with I.FakeTensorMode() as mode:
        x = torch.empty(4, 8)
        assert isinstance(x, I.FakeTensor) and x.shape == (4, 8)
    assert mode is not None
    errors = I.fake_tensor_errors()
    assert errors and all(issubclass(e, BaseException) for e in errors)


def test_dispatch_mode_sees_operations() -> None:
    seen = []

    class Spy(I.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2) + 1
    assert any("add" in s for s in seen)


def test_pytree() -> None:
    leaves, spec = I.tree_flatten({"a": [1, 2], "b": (3,)})
    assert sorted(leaves) == [1, 2, 3]
    assert I.tree_unflatten(leaves, spec) == {"a": [1, 2], "b": (3,)}
    assert I.tree_map(lambda v: v * 2, [1, (2,)]) == [2, (4,)]


def test_module_tensor_slots() -> None:
    bn = nn.BatchNorm1d(3)
    slots = dict((is_param, store) for store, is_param in I.module_tensor_slots(bn))
    assert set(slots[True]) == {"weight", "bias"}
    assert {"running_mean", "running_var", "num_batches_tracked"} <= set(slots[False])


def test_dynamo_names() -> None:
    assert "inductor" in I.dynamo_backends() and "eager" in I.dynamo_backends()
    assert "default" in I.inductor_modes()
    import torch._dynamo.exc as exc

    assert I.is_dynamo_error(
        exc.Unsupported("x") if hasattr(exc, "Unsupported") else exc.TorchDynamoException("x")
    )
    assert not I.is_dynamo_error(RuntimeError("x"))
    assert I.guard_failure_reasons() == [] or isinstance(I.guard_failure_reasons()[0], str)
    handler = I.compile_callbacks()
    assert hasattr(handler, "register_start_callback") and hasattr(handler, "remove_end_callback")


def test_compiled_call_in_place() -> None:
    lin = nn.Linear(2, 2)
    assert I.compiled_call(lin) is None
    lin.compile(backend="eager")
    assert I.compiled_call(lin) is not None
    I.set_compiled_call(lin, None)
    assert I.compiled_call(lin) is None


def test_cpu_bf16_probe_answers_from_onednn_and_the_cpu(monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_efficient.techniques.precision import best_precision

    answer = I.cpu_supports_bf16()
    # what the CPU says: oneDNN's bf16 kernels need AVX512 (BW/VL/DQ); AVX512-BF16 has them fast
    x86_linux = sys.platform == "linux" and platform.machine() == "x86_64"
    flags = set(Path("/proc/cpuinfo").read_text().split()) if x86_linux else set()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert answer is True
    elif x86_linux and "avx512bw" not in flags:
        assert answer is False
    assert best_precision("cpu") == ("bf16-mixed" if answer else "32-true")
    # it is oneDNN's answer, and False on a build without oneDNN's probe
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace(_is_mkldnn_bf16_supported=lambda: 1))
    assert I.cpu_supports_bf16() is True
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())
    assert I.cpu_supports_bf16() is False


def test_option_type_of_a_lightning_parser() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser()
    parser.add_lightning_class_args(Trainer, "trainer")
    assert I.set_option_type(parser, "--trainer.precision", int | str | None, help="h")
    assert not I.set_option_type(parser, "--no.such.option", int)
    cfg = parser.parse_args(["--trainer.precision", "auto"])
    assert cfg.trainer.precision == "auto"


def test_scheduler_step_tracking() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    new = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    I.track_step_calls(new)
    assert not I.step_was_called(new)
    sched.optimizer = new
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        new.step()
        sched.step()
    assert I.step_was_called(new)
    other = torch.optim.SGD([p], lr=0.1)
    I.mark_step_called(other)
    assert I.step_was_called(other)


@pytest.mark.parametrize("package", sorted(I.TESTED))
def test_moved_names_fail_with_the_version(package: str) -> None:
    err = I._moved(package, "some._name")
    assert package in str(err) and "some._name" in str(err) and "tested with" in str(err)


def test_kept_iterator_of_a_dataloader() -> None:
    from torch.utils.data import DataLoader

    plain = DataLoader(range(4), batch_size=2)
    list(plain)
    assert I.kept_iterator(plain) is None  # nothing kept without persistent workers
    persistent = DataLoader(range(4), batch_size=2, num_workers=1, persistent_workers=True)
    assert I.kept_iterator(persistent) is None
    first = iter(persistent)
    assert [b.tolist() for b in first] == [[0, 1], [2, 3]]
    kept = I.kept_iterator(persistent)
    assert kept is first and iter(persistent) is kept  # reused: the workers live on
    del first, kept, persistent


# --- Lightning / DeepSpeed: the ZeRO-Offload strategy -------------------------------------------
def test_deepspeed_strategy_hooks_exist() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    I.check_deepspeed_strategy_hooks()
    for name in I.DEEPSPEED_STRATEGY_HOOKS:
        assert callable(getattr(DeepSpeedStrategy, name)), name
    import inspect

    params = inspect.signature(DeepSpeedStrategy._restore_zero_state).parameters
    assert list(params)[1:] == ["ckpt", "strict"]


def test_deepspeed_strategy_hooks_route_to_public_methods() -> None:
    pytest.importorskip("deepspeed")
    from lightning.pytorch import LightningModule, Trainer

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters())
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    calls = []

    class Recording(I.DeepSpeedStrategyHooks):
        def convert_optimizer(self, optimizer, scheduler_config):
            calls.append(type(optimizer).__name__)
            return "converted", scheduler_config

    trainer = Trainer(strategy=Recording(), accelerator="cpu", devices=1, logger=False)
    model = Module()
    model.trainer = trainer
    trainer.strategy.connect(model)
    optimizer, scheduler_config = trainer.strategy._init_optimizers()
    assert calls == ["AdamW"] and optimizer == "converted"
    assert type(scheduler_config.scheduler).__name__ == "StepLR"  # passed through


def test_zero_optimizer_state_linking() -> None:
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert callable(DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state)
    import inspect

    assert "self._hp_optimizer_states_linked = False" in inspect.getsource(
        DeepSpeedZeroOptimizer.__init__
    )
    # a plain optimizer needs no linking (ZeRO-2 fits link for real:
    # tests/techniques/test_zero_offload.py)
    assert not I.link_zero_optimizer_states(torch.optim.SGD([nn.Parameter(torch.zeros(1))], 0.1))
    assert deepspeed.__version__


def test_torch_extension_dir(tmp_path, monkeypatch) -> None:
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert I.torch_extension_dir("cpu_adam") == str(tmp_path / "cpu_adam")
    assert (tmp_path / "cpu_adam").is_dir()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    default = I.torch_extension_dir("cpu_adam")
    assert default.startswith(get_default_build_root()) and default.endswith("cpu_adam")


def test_adafactor_init_group_and_composite_schedulers() -> None:
    w, b = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))
    w.grad, b.grad = torch.ones(4, 3), torch.ones(3)
    opt = torch.optim.Adafactor([w, b])
    params, grads, rows, cols, variances, steps = I.adafactor_init_group(opt, opt.param_groups[0])
    assert params == [w, b] and len(grads) == len(steps) == 2
    assert rows[0].shape == (4, 1) and cols[0].shape == (1, 3) and variances[1].shape == (3,)
    sgd = torch.optim.SGD([w], lr=0.1)
    parts = [torch.optim.lr_scheduler.ConstantLR(sgd), torch.optim.lr_scheduler.StepLR(sgd, 1)]
    seq = torch.optim.lr_scheduler.SequentialLR(sgd, parts, milestones=[2])
    chained = torch.optim.lr_scheduler.ChainedScheduler(parts)
    assert I.inner_schedulers(seq) == parts and I.inner_schedulers(chained) == parts
    assert I.inner_schedulers(parts[0]) == []


def test_lightning_precision_values() -> None:
    values = I.lightning_precision_values()
    assert {"bf16-mixed", "32-true", "16-mixed"} <= set(values) and 32 in values


def test_hf_mask_functions_are_found_where_transformers_holds_them() -> None:
    pytest.importorskip("transformers")
    mu = pytest.importorskip("transformers.masking_utils")
    functions = I.hf_mask_functions()
    present = [n for n in I.HF_MASK_SKIP_CHECKS if n in functions]
    assert present and I.HF_MASK_ARGUMENTS in functions, "transformers moved its mask checks"
    assert all(functions[n] is getattr(mu, n) for n in functions)
    sites = I.hf_mask_function_sites(functions)
    assert {(mu, n) for n in functions} <= set(sites)
    assert all(vars(m)[n] is functions[n] for m, n in sites)


def test_set_model_parallel_sizes() -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    strategy = ModelParallelStrategy()
    I.set_model_parallel_sizes(strategy, data_parallel=4, tensor_parallel=1)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    with pytest.raises(I.InternalsError, match="_data_parallel_size"):
        I.set_model_parallel_sizes(DDPStrategy(), data_parallel=2, tensor_parallel=1)


def test_fsdp_policies_refuses_a_plain_module() -> None:
    # the policies of a sharded module are read in the 2-process FSDP run
    # (tests/multiprocess/fsdp_checks.py)
    with pytest.raises(I.InternalsError, match="_get_fsdp_state"):
        I.fsdp_policies(torch.nn.Linear(2, 2))


def test_dispatcher_accessors_override_and_put_back_kernels() -> None:
    from lightning_efficient.core._internals import (
        kernel_overrides,
        ops_with_kernel,
        without_cpu_autocast,
    )

    cuda_autocast = ops_with_kernel("AutocastCUDA")
    assert "aten::linear" in cuda_autocast and "aten::pow.Tensor_Scalar" in cuda_autocast
    assert "aten::cross_entropy_loss" in ops_with_kernel("AutocastCPU")
    x = torch.randn(3, 4)
    with kernel_overrides() as lib:
        lib.impl("relu", lambda t: t * 0 + 7, "CPU")
        assert torch.relu(x).eq(7).all()
    assert torch.equal(torch.relu(x), x.clamp(min=0))  # the original kernel serves again
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(x, x.T).dtype == torch.bfloat16
        with without_cpu_autocast():
            assert torch.mm(x, x.T).dtype == torch.float32


def test_make_wrapper_tensor_has_metadata_and_no_data() -> None:
    from lightning_efficient.core._internals import make_wrapper_tensor

    class Shell(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise LookupError(f"no data for {func}")

    t = make_wrapper_tensor(Shell, (2, 3, 5), torch.bfloat16, "cpu", requires_grad=True)
    assert isinstance(t, Shell) and t.shape == (2, 3, 5) and t.dtype == torch.bfloat16
    assert t.device == torch.device("cpu") and t.requires_grad and t.dim() == 3
    with pytest.raises(LookupError, match="no data"):  # an operator reaches the dispatcher
        t + 1


def test_fit_loader_source() -> None:
    """The fit loop's source of the loaders given to ``trainer.fit``: the loader itself from its
    ``dataloader()``; ``None`` for a module's hooks."""
    import lightning.pytorch as pl
    from helpers import tiny_trainer

    from benchmarks.workloads import tiny_data, tiny_model

    seen: dict[str, object] = {}

    class Look(pl.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            seen["train"] = I.fit_loader_source(trainer, "train_dataloader")
            seen["val"] = I.fit_loader_source(trainer, "val_dataloader")

    data = tiny_data()
    data.setup("fit")
    loader = data.train_dataloader()
    tiny_trainer(None, [Look()], max_steps=1, limit_val_batches=0).fit(
        tiny_model(), train_dataloaders=loader
    )
    assert seen["train"].dataloader() is loader and seen["val"] is None
    tiny_trainer(None, [Look()], max_steps=1, limit_val_batches=0).fit(tiny_model(), data)
    assert seen["train"] is None and seen["val"] is None


def test_foreach_mul_scales_each_tensor_in_place() -> None:
    from lightning_efficient.core._internals import foreach_mul_

    a, b = torch.ones(3), torch.full((2, 2), 2.0)
    foreach_mul_([a, b], torch.tensor(0.5))
    assert a.tolist() == [0.5] * 3 and b.tolist() == [[1.0, 1.0], [1.0, 1.0]]
