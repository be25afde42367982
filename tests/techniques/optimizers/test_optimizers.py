"""OptimizerSwap and the optimizer functions: carried hyperparameters, schedulers, every name on
CPU (real bitsandbytes), 8-bit state bytes via the instrument, optimizer-in-backward, resume."""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import SaveAt, fit, params_of
from torch import nn

from benchmarks.workloads import tiny_model
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.optimizers import (
    BF16_NAMES,
    EIGHT_BIT_NAMES,
    NAMES,
    InBackwardOptimizer,
    OptimizerSwap,
    attach_optimizer_in_backward,
    build_optimizer,
    embedding_parameters,
    rebind_schedulers,
    repoint_scheduler,
    swap_optimizer,
)


def _module_optimizer(model=None):
    model = model or tiny_model()
    config = model.configure_optimizers()
    return model, config["optimizer"], config["lr_scheduler"]["scheduler"]


def _step(model, optimizer, n=1):
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        loss = (
            model.training_step((x, x), 0)
            if False
            else nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


class LrRecorder(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lrs.append([g["lr"] for opt in trainer.optimizers for g in opt.param_groups])


# -- hyperparameters carried --------------------------------------------------------------
def test_param_groups_and_hyperparameters_carried() -> None:
    model, old, _ = _module_optimizer()
    new = swap_optimizer(old, "adamw8bit")
    assert type(new).__name__ == "AdamW8bit"
    assert len(new.param_groups) == 2
    for g_old, g_new in zip(old.param_groups, new.param_groups):
        assert [id(p) for p in g_old["params"]] == [id(p) for p in g_new["params"]]
        for key in ("lr", "initial_lr", "betas", "eps", "weight_decay"):
            assert g_new[key] == g_old[key], key
        assert "foreach" not in g_new and "fused" not in g_new  # torch-only options dropped
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert new.param_groups[0]["betas"] == (0.9, 0.95)


def test_adafactor_carries_lr_and_weight_decay_not_betas_or_eps() -> None:
    model, old, _ = _module_optimizer()
    new = swap_optimizer(old, "adafactor")
    assert isinstance(new, torch.optim.Adafactor)
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in new.param_groups] == [g["lr"] for g in old.param_groups]
    assert all(g["eps"] == (None, 1e-3) and "betas" not in g for g in new.param_groups)


def test_lr_override_keeps_the_schedule_factor() -> None:
    model, old, sched = _module_optimizer()
    factor = old.param_groups[0]["lr"] / old.param_groups[0]["initial_lr"]
    assert factor < 1  # warmup: the test can fail
    new = swap_optimizer(old, "adafactor", lr=1e-2)
    repoint_scheduler(sched, new)
    assert new.param_groups[0]["initial_lr"] == 1e-2
    assert new.param_groups[0]["lr"] == pytest.approx(1e-2 * factor)
    _step(model, new)
    sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(1e-2 * sched.lr_lambdas[0](1))


def test_lr_schedule_values_equal_the_plain_run(tmp_path) -> None:
    plain, swapped = LrRecorder(), LrRecorder()
    fit(tmp_path / "plain", [plain], max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", UserWarning
        )  # no "lr_scheduler.step() before optimizer.step()"
        warnings.filterwarnings(
            "ignore", message=".*(does not have many workers|Paged|weights_only|litlogger).*"
        )
        trainer, _, _ = fit(tmp_path / "swap", [OptimizerSwap("adamw8bit"), swapped], max_steps=6)
    assert len(set(map(tuple, plain.lrs))) > 2  # the schedule moves
    assert swapped.lrs == plain.lrs
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0]


class PlateauGPT(type(tiny_model())):
    """A module whose scheduler is a Lightning config with interval, frequency and monitor."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.5, patience=0, threshold=10.0
        )
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": sched,
                "interval": "step",
                "frequency": 2,
                "monitor": "train_loss",
            },
        }


def test_lightning_scheduler_config_kept(tmp_path) -> None:
    from benchmarks.workloads import TINY_MODEL

    plain, swapped = LrRecorder(), LrRecorder()
    fit(tmp_path / "p", [plain], model=PlateauGPT(**TINY_MODEL), max_steps=8)
    trainer, _, _ = fit(
        tmp_path / "s",
        [OptimizerSwap("lion8bit"), swapped],
        model=PlateauGPT(**TINY_MODEL),
        max_steps=8,
    )
    config = trainer.lr_scheduler_configs[0]
    assert (config.interval, config.frequency, config.monitor) == ("step", 2, "train_loss")
    assert config.scheduler.optimizer is trainer.optimizers[0]
    assert type(trainer.optimizers[0]).__name__ == "Lion8bit"
    assert (
        swapped.lrs[-1][0] < swapped.lrs[0][0]
    )  # the plateau scheduler did reduce the new optimizer's lr
    assert len(swapped.lrs) == len(plain.lrs)


class TwoOptimizerGPT(type(tiny_model())):
    """Manual optimization with two optimizers (blocks vs the rest), each with a StepLR."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        opts, scheds = self.optimizers(), self.lr_schedulers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt, sched in zip(opts, scheds):
            opt.step()
            sched.step()
        return loss

    def configure_optimizers(self):
        blocks = list(self.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        a = torch.optim.AdamW(blocks, lr=1e-3, weight_decay=0.05)
        b = torch.optim.SGD(rest, lr=1e-2, momentum=0.9)
        return [a, b], [
            torch.optim.lr_scheduler.StepLR(a, 2, 0.5),
            torch.optim.lr_scheduler.StepLR(b, 3, 0.1),
        ]


def test_multiple_optimizers_swapped(tmp_path) -> None:
    from benchmarks.workloads import TINY_MODEL

    plain, swapped = LrRecorder(), LrRecorder()
    fit(tmp_path / "p", [plain], model=TwoOptimizerGPT(**TINY_MODEL), max_steps=6)
    trainer, model, rec = fit(
        tmp_path / "s",
        [OptimizerSwap("adam8bit"), swapped],
        model=TwoOptimizerGPT(**TINY_MODEL),
        max_steps=6,
    )
    assert [type(o).__name__ for o in trainer.optimizers] == ["Adam8bit", "Adam8bit"]
    assert [type(o.optimizer).__name__ for o in model.optimizers()] == ["Adam8bit", "Adam8bit"]
    assert trainer.optimizers[0].param_groups[0]["weight_decay"] == 0.05
    assert [c.scheduler.optimizer for c in trainer.lr_scheduler_configs] == trainer.optimizers
    assert swapped.lrs == plain.lrs and len(set(map(tuple, plain.lrs))) > 2
    assert all(o.state for o in trainer.optimizers)  # both stepped


# -- every name on CPU --------------------------------------------------------------------
@pytest.mark.parametrize("name", [*(n for n in NAMES if n not in BF16_NAMES), "torch.optim.SGD"])
def test_every_name_builds_and_steps(name: str) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    before = params_of(model)
    opt = build_optimizer(name, model.parameters(), keep_32bit=embedding_parameters(model))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        _step(model, opt, 2)
    moved = [k for k, v in params_of(model).items() if not torch.equal(v, before[k])]
    assert len(moved) == len(before) - 0  # every parameter (incl. the tied head) was updated
    if name in EIGHT_BIT_NAMES:
        # 8-bit exactly for the large non-embedding matrices; 32-bit for small tensors and embeddings
        emb = {id(p) for p in embedding_parameters(model)}
        pairs = {
            (p.numel() >= 4096 and id(p) not in emb, opt.state[p]["state1"].dtype)
            for p in model.parameters()
        }
        assert pairs == {(True, torch.uint8), (False, torch.float32)}


def test_small_tensors_and_embeddings_keep_32bit_states() -> None:
    from bitsandbytes.optim import GlobalOptimManager

    global_configs = dict(GlobalOptimManager.get_instance().pid2config)
    model = tiny_model()
    for embeddings_32bit in (True, False):
        opt = build_optimizer(
            "adamw8bit",
            model.parameters(),
            keep_32bit=embedding_parameters(model) if embeddings_32bit else (),
        )
        _step(model, opt)
        emb = opt.state[model.tok_emb.weight]["state1"].dtype
        assert emb == (torch.float32 if embeddings_32bit else torch.uint8)
        assert (
            opt.state[model.blocks[0].mlp[0].weight]["state1"].dtype == torch.uint8
        )  # 4096 elements
        assert opt.state[model.blocks[0].ln1.weight]["state1"].dtype == torch.float32  # 32 < 4096
    assert (
        GlobalOptimManager.get_instance().pid2config == global_configs
    )  # the override stays scoped


def test_adamw_fused_uses_foreach_on_cpu_with_a_note(tmp_path, caplog) -> None:
    with caplog.at_level("INFO"):
        trainer, _, _ = fit(tmp_path, [OptimizerSwap("adamw_fused")], max_steps=2)
    groups = trainer.optimizers[0].param_groups
    assert all(g["foreach"] is True and not g["fused"] for g in groups)
    assert sum("foreach=True" in r.getMessage() for r in caplog.records) == 1


# -- measured by the instrument ------------------------------------------------------------
def _demo_batch():
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    return (x, x)


def test_adamw8bit_state_bytes_at_most_30_percent_of_adamw() -> None:
    from lightning_efficient.demos import TinyGPT

    torch.manual_seed(0)
    plain = measure_step(TinyGPT(), _demo_batch())
    pure = measure_step(
        TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap("adamw8bit", embeddings_32bit=False)]
    )
    default = measure_step(TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap("adamw8bit")])
    fp32 = plain.by_category["optimizer_state"]
    assert fp32 >= 8 * sum(p.numel() for p in TinyGPT().parameters())  # two fp32 moments
    assert pure.by_category["optimizer_state"] <= 0.30 * fp32
    # 32-bit embedding states cost 6 more bytes per element (2 x 4 instead of 2 x 1), no more
    emb = sum(p.numel() for p in embedding_parameters(TinyGPT()))
    extra = default.by_category["optimizer_state"] - pure.by_category["optimizer_state"]
    assert (
        extra == 6 * emb - 2 * 4 * emb // 256
    )  # (minus the 8-bit blocks' absmax, 2 x 4 B per 256)
    assert default.by_category["optimizer_state"] <= 0.31 * fp32
    assert default.peak_bytes < plain.peak_bytes


def test_optimizer_in_backward_removes_gradients_from_the_peak() -> None:
    from lightning_efficient.demos import TinyGPT

    torch.manual_seed(0)
    plain = measure_step(TinyGPT(), _demo_batch(), "torch.optim.AdamW")
    inb = measure_step(
        TinyGPT(),
        _demo_batch(),
        "torch.optim.AdamW",
        callbacks=[OptimizerSwap("torch.optim.AdamW", optimizer_in_backward=True)],
    )
    largest = max(p.numel() * p.element_size() for p in TinyGPT().parameters())
    assert plain.by_category["gradients"] == 4 * sum(
        p.numel() for p in TinyGPT().parameters()
    )  # all of them
    # at most the one gradient being stepped is alive at the peak
    assert inb.by_category["gradients"] <= largest < plain.by_category["gradients"] / 10
    assert inb.peak_bytes <= plain.peak_bytes - 0.5 * plain.by_category["gradients"]


@pytest.mark.parametrize("name", ["adamw8bit", "lion8bit", "paged_adamw8bit", "adafactor"])
def test_8bit_estimate_matches_real_bitsandbytes(name: str) -> None:
    """bitsandbytes reads values (``.tolist()`` building its quantisation maps), so on fake tensors
    the estimate models its state layout (EightBitStateModel); ``measure_step`` runs the REAL
    bitsandbytes optimizer on real CPU tensors, and the two agree. Adafactor (``.item()`` in its
    step) likewise, through AdafactorStateModel."""
    from lightning_efficient.demos import TinyGPT
    from lightning_efficient.measure.memory.estimate import estimate_memory

    torch.manual_seed(0)
    est = estimate_memory(TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap(name)])
    real = measure_step(TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap(name)])
    state_est, state_real = est.by_category["optimizer_state"], real.by_category["optimizer_state"]
    assert abs(state_est - state_real) <= 0.02 * state_real
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes
    # and the 8-bit states are what the estimate sees: far below AdamW's two fp32 moments
    n = sum(p.numel() for p in TinyGPT().parameters())
    assert state_est <= {"lion8bit": 0.16, "adafactor": 0.02}.get(name, 0.31) * 8 * n


def test_eight_bit_state_model_layout() -> None:
    """The stand-in allocates bitsandbytes' layout: uint8 states + fp32 absmax per 256 elements
    for large tensors, fp32 states for small ones and for ``keep_32bit``; it reads no values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_efficient.measure.memory.optimizer_models import EightBitStateModel

    mode = FakeTensorMode()
    with mode:
        big, small, emb = (nn.Parameter(torch.empty(s)) for s in ((64, 100), (10,), (300, 20)))
        opt = EightBitStateModel([big, small, emb], "adamw8bit", keep_32bit=[emb])
        for p in (big, small, emb):
            p.grad = torch.empty_like(p)
        opt.step()
        opt.step()
    s = opt.state[big]
    assert (
        s["step"] == 2
        and s["state1"].dtype == s["state2"].dtype == torch.uint8
        and s["state1"].shape == big.shape
    )
    assert s["absmax1"].shape == s["absmax2"].shape == (25,) and s["qmap1"].shape == (256,)
    assert s["qmap1"] is not s["qmap2"]
    for p in (small, emb):
        assert opt.state[p]["state1"].dtype == torch.float32 and set(opt.state[p]) == {
            "step",
            "state1",
            "state2",
        }
    with mode:
        lion = EightBitStateModel([big], "lion8bit")
        lion.step()
    assert set(lion.state[big]) == {"step", "state1", "qmap1", "absmax1"}


def test_estimate_in_backward() -> None:
    from lightning_efficient.demos import TinyGPT
    from lightning_efficient.measure.memory.estimate import estimate_memory

    est = estimate_memory(
        TinyGPT(),
        _demo_batch(),
        callbacks=[OptimizerSwap("adamw_fused", optimizer_in_backward=True)],
    )
    largest = max(p.numel() * p.element_size() for p in TinyGPT().parameters())
    assert (
        est.by_category["gradients"] <= largest
        and "OptimizerSwap: optimizer 'adamw_fused', stepped in backward" in est.notes
    )
    eight = estimate_memory(
        TinyGPT(),
        _demo_batch(),
        callbacks=[OptimizerSwap("paged_adamw8bit", optimizer_in_backward=True)],
    )
    assert eight.by_category["gradients"] <= largest
    assert eight.by_category["optimizer_state"] <= 0.31 * est.by_category["optimizer_state"]
    # Adafactor in backward: the estimate follows the real step (factored states, temporaries)
    factor = estimate_memory(
        TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap("adafactor", optimizer_in_backward=True)]
    )
    real = measure_step(
        TinyGPT(), _demo_batch(), callbacks=[OptimizerSwap("adafactor", optimizer_in_backward=True)]
    )
    assert factor.by_category["optimizer_state"] == real.by_category["optimizer_state"]
    assert abs(factor.peak_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes


def test_optimizer_in_backward_same_maths_with_scheduler(tmp_path) -> None:
    plain, inb = LrRecorder(), LrRecorder()
    _, pm, prec = fit(tmp_path / "p", [plain], max_steps=5)
    trainer, im, irec = fit(
        tmp_path / "i",
        [OptimizerSwap("torch.optim.AdamW", optimizer_in_backward=True), inb],
        max_steps=5,
    )
    assert isinstance(trainer.optimizers[0], InBackwardOptimizer)
    assert inb.lrs == plain.lrs and len(set(map(tuple, plain.lrs))) > 2
    torch.testing.assert_close(
        torch.tensor(irec.losses), torch.tensor(prec.losses), rtol=1e-5, atol=1e-6
    )
    for (name, a), b in zip(params_of(pm).items(), params_of(im).values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert all(p.grad is None for p in im.parameters())


def test_attach_optimizer_in_backward_without_lightning() -> None:
    model = tiny_model()
    opt = attach_optimizer_in_backward(model, lambda groups: torch.optim.SGD(groups, lr=0.1))
    before = params_of(model)
    x = torch.randint(0, 256, (2, 32))
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(v, before[k]) for k, v in params_of(model).items())
    opt.detach()
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
        ({"gradient_clip_val": 1.0}, "gradient_clip_val=1.0"),
    ],
)
def test_optimizer_in_backward_refuses_accumulation_and_clipping(tmp_path, kwargs, needle) -> None:
    with pytest.raises(ValueError, match="optimizer_in_backward=True") as info:
        fit(
            tmp_path,
            [OptimizerSwap("adamw8bit", optimizer_in_backward=True)],
            max_steps=2,
            **kwargs,
        )
    assert needle in str(info.value) and "optimizer_in_backward=False" in str(info.value)


# -- resume ---------------------------------------------------------------------------------
def _resume_pair(tmp_path, make, k=3):
    ckpt = tmp_path / "k.ckpt"
    epoch = dict(limit_train_batches=k, max_steps=2 * k)
    _, full, _ = fit(tmp_path / "full", [make(), SaveAt(k, ckpt)], **epoch)
    _, resumed, _ = fit(tmp_path / "resumed", [make()], ckpt_path=str(ckpt), **epoch)
    return full, resumed, ckpt


@pytest.mark.parametrize(
    "kwargs",
    [{"name": "adamw8bit"}, {"name": "paged_adamw8bit", "optimizer_in_backward": True}],
    ids=["adamw8bit", "paged_adamw8bit-in-backward"],
)
def test_resume_with_swapped_optimizer_is_exact(tmp_path, kwargs) -> None:
    full, resumed, ckpt = _resume_pair(tmp_path, lambda: OptimizerSwap(**kwargs))
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), name
    state = torch.load(ckpt, weights_only=False)
    assert state["callbacks"]["OptimizerSwap"]["optimizer_states"]  # the 8-bit state is kept
    assert state["optimizer_states"][0]["state"] == {}  # portable: the module's AdamW can load it


def test_keyerror_state1_root_cause_and_fix(tmp_path) -> None:
    """bitsandbytes initialises a parameter's state only when it is empty; a torch AdamW state
    (exp_avg, exp_avg_sq, step) loaded into it is not empty and has no 'state1'."""
    import bitsandbytes as bnb

    model, adamw, _ = _module_optimizer()
    _step(model, adamw)
    eight = bnb.optim.AdamW8bit(adamw.param_groups)
    eight.load_state_dict(adamw.state_dict())
    with pytest.raises(KeyError, match="state1"):
        _step(model, eight)
    # through Lightning: a plain checkpoint resumed with the swap stops with the choices instead
    trainer, _, _ = fit(tmp_path / "plain", [], max_steps=2)
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError) as info:
        fit(
            tmp_path / "r",
            [OptimizerSwap("adamw8bit")],
            max_steps=4,
            ckpt_path=str(tmp_path / "plain.ckpt"),
        )
    msg = str(info.value)
    assert "module's own optimizer (torch.optim.adamw.AdamW)" in msg
    assert "on_mismatch='reset'" in msg and "swap to the matching optimizer" in msg


def test_resume_with_another_optimizer_names_the_choices(tmp_path) -> None:
    trainer, _, _ = fit(tmp_path / "a", [OptimizerSwap("adamw8bit")], max_steps=2)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError) as info:
        fit(
            tmp_path / "b",
            [OptimizerSwap("lion8bit")],
            max_steps=4,
            ckpt_path=str(tmp_path / "a.ckpt"),
        )
    msg = str(info.value)
    assert "OptimizerSwap('adamw8bit')" in msg and "OptimizerSwap('lion8bit')" in msg
    assert "reset the optimizer state" in msg and "resume with OptimizerSwap('adamw8bit')" in msg
    # the first choice works: model and schedule resume, the optimizer starts afresh
    trainer, _, _ = fit(
        tmp_path / "c",
        [OptimizerSwap("lion8bit", on_mismatch="reset")],
        max_steps=4,
        ckpt_path=str(tmp_path / "a.ckpt"),
    )
    assert trainer.global_step == 4 and type(trainer.optimizers[0]).__name__ == "Lion8bit"


def test_adamw8bit_losses_close_to_adamw(tmp_path) -> None:
    _, _, plain = fit(tmp_path / "p", [], max_steps=8)
    _, _, eight = fit(tmp_path / "e", [OptimizerSwap("adamw8bit")], max_steps=8)
    assert plain.losses[0] == eight.losses[0] and plain.losses[-1] < plain.losses[0] - 0.1
    torch.testing.assert_close(
        torch.tensor(eight.losses), torch.tensor(plain.losses), rtol=0.01, atol=0.0
    )


# -- bad input and yaml --------------------------------------------------------------------
def test_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        OptimizerSwap("adamw4bit")
    assert all(repr(n) in str(info.value) for n in NAMES) and "`name`" in str(info.value)
    with pytest.raises(TypeError, match="`name`"):
        OptimizerSwap("torch.nn.Linear")
    with pytest.raises(ValueError, match="`name`"):
        OptimizerSwap("torch.optim.NoSuchOptimizer")


def test_bad_overrides_are_named() -> None:
    with pytest.raises(ValueError) as info:
        OptimizerSwap("adafactor", betas=(0.9, 0.99), momentum=0.9)
    assert "'betas', 'momentum'" in str(info.value) and "beta2_decay" in str(info.value)
    with pytest.raises(ValueError, match="'amsgrad'"):
        OptimizerSwap("lion8bit", overrides={"amsgrad": True})
    with pytest.raises(TypeError, match="`overrides`"):
        OptimizerSwap("adamw8bit", overrides=[("lr", 1.0)])
    assert OptimizerSwap("adamw8bit", lr=1e-3, overrides={"min_8bit_size": 16}).overrides == {
        "min_8bit_size": 16,
        "lr": 1e-3,
    }


@pytest.mark.parametrize(
    "name,overrides,key",
    [
        ("adamw8bit", {"lr": -0.01}, "lr"),
        ("adamw8bit", {"lr": float("nan")}, "lr"),
        ("torch.optim.AdamW", {"lr": float("inf")}, "lr"),
        ("adamw8bit", {"betas": (2.0, 0.9)}, "betas"),
        ("lion8bit", {"betas": (0.9, 1.0)}, "betas"),
        ("adamw8bit", {"weight_decay": -5}, "weight_decay"),
        ("adafactor", {"weight_decay": float("nan")}, "weight_decay"),
        ("adamw8bit", {"eps": 0.0}, "eps"),
        ("torch.optim.Adam", {"eps": -1e-8}, "eps"),
        ("adafactor", {"eps": (None, -1e-3)}, "eps"),
        ("adafactor", {"eps": 1e-3}, "eps"),
        ("torch.optim.SGD", {"momentum": -0.9}, "momentum"),
        ("adamw8bit", {"lr": "fast"}, "lr"),
    ],
)
def test_overrides_refused_as_the_optimizer_would(name, overrides, key) -> None:
    """The overrides replace group values, which no optimizer constructor checks: before this
    check, ``lr=-0.01`` trained to perplexity 153,389 and ``lr=nan`` to NaN with exit 0."""
    with pytest.raises((ValueError, TypeError)) as info:
        OptimizerSwap(name, overrides=overrides)
    assert f"`overrides['{key}']`" in str(info.value)
    with pytest.raises((ValueError, TypeError), match=f"overrides\\['{key}'\\]"):
        OptimizerSwap(name, **overrides)  # the same as keyword arguments


def test_overrides_checked_by_the_optimizer_constructor_too() -> None:
    # a value only the optimizer's own constructor knows to refuse (Adafactor: beta2_decay <= 0)
    with pytest.raises(ValueError, match="`overrides`.*beta2_decay.*adafactor"):
        OptimizerSwap("adafactor", beta2_decay=0.5)
    with pytest.raises(ValueError, match="`overrides`.*amsgrad"):
        OptimizerSwap("adamw8bit", amsgrad=True)  # AdamW8bit refuses amsgrad=True
    ok = OptimizerSwap("adamw8bit", lr=0.0, betas=[0.0, 0.99], eps=1e-6, weight_decay=0.0)
    assert ok.overrides["betas"] == [0.0, 0.99]
    assert OptimizerSwap("adafactor", eps=(None, 1e-3), lr=1e-2).overrides["lr"] == 1e-2


# -- next to the activation-checkpointing budget search ------------------------------------------
@pytest.fixture(scope="module")
def plain_budget_choice():
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    checkpointing = ActivationCheckpointing(budget="1MiB")
    _, _, rec = fit(None, [checkpointing], max_steps=2)
    assert len(rec.losses) == 2
    return checkpointing.choice


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "adamw8bit"},
        {"name": "adafactor"},
        {"name": "adamw8bit", "optimizer_in_backward": True},
        {"name": "torch.optim.AdamW", "optimizer_in_backward": True},
    ],
    ids=["adamw8bit", "adafactor", "adamw8bit-in-backward", "adamw-in-backward"],
)
def test_budget_search_estimates_the_swapped_optimizer(kwargs, plain_budget_choice) -> None:
    """Issue 21: ``ActivationCheckpointing(budget=...)`` next to ``OptimizerSwap`` crashed at the
    first batch (bitsandbytes and Adafactor read values on fake tensors; ``InBackwardOptimizer``
    has no plain constructor). The search now asks the swap how the fit runs its optimizer, so it
    fits, and it sees the swap's savings: a lower plain peak than with the module's AdamW."""
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    checkpointing = ActivationCheckpointing(budget="1MiB")
    trainer, _, rec = fit(None, [OptimizerSwap(**kwargs), checkpointing], max_steps=2)
    assert len(rec.losses) == 2 and all(loss == loss for loss in rec.losses)
    choice, plain = checkpointing.choice, plain_budget_choice
    assert choice is not None and choice.peak_bytes <= choice.budget_bytes
    assert choice.plain_peak_bytes < plain.plain_peak_bytes
    assert choice.num_blocks <= plain.num_blocks
    if not kwargs.get("optimizer_in_backward"):  # 8-bit / factored states: one block is enough
        assert choice.num_blocks < plain.num_blocks


def test_estimate_of_a_running_or_named_memory_lean_optimizer() -> None:
    """The one resolver: a bitsandbytes optimizer the module itself configured (no swap), or an
    optimizer name given to the estimate, runs as its state model on fake tensors."""
    import bitsandbytes as bnb

    from lightning_efficient.demos import TinyGPT
    from lightning_efficient.measure.memory.estimate import estimate_memory
    from lightning_efficient.measure.memory.optimizer_models import running_estimate_factory

    model = TinyGPT()
    running = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    adamw = estimate_memory(model, _demo_batch())
    by_instance = estimate_memory(model, _demo_batch(), optimizer=running_estimate_factory(running))
    by_name = estimate_memory(model, _demo_batch(), optimizer="adamw8bit")
    by_swap = estimate_memory(model, _demo_batch(), callbacks=[OptimizerSwap("adamw8bit")])
    state = by_instance.by_category["optimizer_state"]
    assert state == by_name.by_category["optimizer_state"]
    assert state <= 0.31 * adamw.by_category["optimizer_state"]
    # the swap keeps embeddings in 32 bits; the module's own optimizer here does not
    assert by_swap.by_category["optimizer_state"] > state
    with pytest.raises(TypeError, match="`optimizer`: 'os.system' is not a torch.optim.Optimizer"):
        estimate_memory(model, _demo_batch(), optimizer="os.system")


def test_rebind_schedulers_is_repoint_scheduler_for_each_match() -> None:
    model, old, sched = _module_optimizer()
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    new = swap_optimizer(old, "adafactor", lr=1e-2)
    assert rebind_schedulers([sched, other], old, new) == 1
    assert sched.optimizer is new and other.optimizer is not new
    assert sched.base_lrs == [1e-2, 1e-2]  # re-read from the override, as repoint_scheduler does
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        _step(model, new)
        sched.step()
    seq_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = [
        torch.optim.lr_scheduler.ConstantLR(seq_opt),
        torch.optim.lr_scheduler.StepLR(seq_opt, 1),
    ]
    seq = torch.optim.lr_scheduler.SequentialLR(seq_opt, parts, milestones=[2])
    target = torch.optim.SGD(model.parameters(), lr=0.1)
    assert rebind_schedulers([seq], seq_opt, target) == 1
    assert all(s.optimizer is target for s in [seq, *parts])


def test_missing_bitsandbytes_names_the_requirement(monkeypatch) -> None:
    for mod in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ImportError, match=r"install requirement.*pip install 'bitsandbytes"):
        OptimizerSwap("adamw8bit")
    assert OptimizerSwap("adafactor").optimizer_name == "adafactor"


def test_yaml_with_overrides(tmp_path) -> None:
    import yaml

    from lightning_efficient.commands.cli import EfficientCLI

    spec = {
        "class_path": "OptimizerSwap",
        "init_args": {
            "name": "adafactor",
            "overrides": {"lr": 0.01, "beta2_decay": -0.7},
            "optimizer_in_backward": True,
        },
    }
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump({"trainer": {"accelerator": "cpu", "logger": False, "callbacks": [spec]}})
    )
    cli = EfficientCLI(args=["--config", str(cfg)], run=False)
    swap = next(cb for cb in cli.trainer.callbacks if isinstance(cb, OptimizerSwap))
    assert (
        swap.overrides == {"lr": 0.01, "beta2_decay": -0.7} and swap.optimizer_in_backward is True
    )
