"""ZeROOffload: config building, optimizer conversion, and real DeepSpeed fits on a CPU (gloo).

DeepSpeed fits are slow (engine set-up, CPU Adam), so the fits are few, tiny and shared between
assertions through module-scoped fixtures.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import SaveAt, fit, params_of, tiny_model

from lightning_efficient import functional as F
from lightning_efficient.techniques.zero_offload import (
    SUPPORTED_OPTIMIZERS,
    ZeROOffload,
    offloaded_categories,
    scale_buckets,
    to_deepspeed_optimizer,
    zero_offload_config,
)

pytest.importorskip("deepspeed")


# -- config building --------------------------------------------------------------------------
def test_default_config_is_stage2_cpu_offload_single_gpu_defaults() -> None:
    cfg = zero_offload_config()
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert "offload_param" not in zero


def test_stage3_parameter_offload_config() -> None:
    zero = zero_offload_config(stage=3, offload_parameters=True, pin_memory=False)[
        "zero_optimization"
    ]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_optimizer"]["pin_memory"] is False


def test_no_offload_has_no_offload_sections() -> None:
    zero = zero_offload_config(offload_optimizer=None)["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert offloaded_categories(zero_offload_config(offload_optimizer=None)) == {
        "optimizer_state": False,
        "gradients": False,
        "parameters": False,
    }


def test_nvme_config_uses_the_writable_path(tmp_path) -> None:
    zero = zero_offload_config(offload_optimizer="nvme", nvme_path=str(tmp_path))[
        "zero_optimization"
    ]
    assert zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_optimizer"]["nvme_path"] == str(tmp_path)


def test_user_config_merges_and_wins_over_defaults() -> None:
    cfg = zero_offload_config(
        config={
            "zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 123},
            "steps_per_print": 7,
        }
    )
    zero = cfg["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["reduce_bucket_size"] == 123
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"  # rest kept
    assert cfg["steps_per_print"] == 7
    # equal values of named settings are no conflict
    same = zero_offload_config(
        stage=3, config={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    )
    assert same["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(
    "kwargs, config, names",
    [
        ({}, {"zero_optimization": {"stage": 3}}, ("['stage']=3", "`stage`=2")),
        (
            {},
            {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
            ("['device']='nvme'", "`offload_optimizer`='cpu'"),
        ),
        (
            {"offload_optimizer": None},
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            ("'cpu'", "`offload_optimizer`='none'"),
        ),
        (
            {"stage": 3},
            {"zero_optimization": {"offload_param": {"device": "cpu"}}},
            ("offload_param", "`offload_parameters`='none'"),
        ),
        (
            {},
            {"zero_optimization": {"offload_optimizer": {"pin_memory": False}}},
            ("['pin_memory']=False", "`pin_memory`=True"),
        ),
    ],
)
def test_config_conflicting_with_named_argument_is_an_error_naming_both(
    kwargs, config, names
) -> None:
    with pytest.raises(ValueError, match="conflicts") as info:
        zero_offload_config(**kwargs, config=config)
    for name in names:
        assert name in str(info.value)


def test_strategy_config_conflict_raises_at_construction() -> None:
    with pytest.raises(ValueError, match="`stage`=3"):
        ZeROOffload(stage=3, config={"zero_optimization": {"stage": 2}})


def test_bucket_sizes_scale_with_the_model() -> None:
    base = zero_offload_config()
    small = scale_buckets(base, 10_000)["zero_optimization"]
    big = scale_buckets(base, 6_400_000_000)["zero_optimization"]
    mid = scale_buckets(base, 160_000_000)["zero_optimization"]
    assert small["reduce_bucket_size"] == 1_000_000  # floor
    assert (
        mid["reduce_bucket_size"] == 10_000_000 == mid["allgather_bucket_size"]
    )  # 1/16 of the model
    assert big["reduce_bucket_size"] == 200_000_000  # cap
    # a size the user set is kept
    user = zero_offload_config(config={"zero_optimization": {"reduce_bucket_size": 5}})
    assert scale_buckets(user, 160_000_000)["zero_optimization"]["reduce_bucket_size"] == 5
    s3 = scale_buckets(zero_offload_config(stage=3), 160_000_000)["zero_optimization"]
    assert (
        s3["stage3_prefetch_bucket_size"] == 10_000_000
        and s3["stage3_param_persistence_threshold"] == 16_000
    )


# -- bad input --------------------------------------------------------------------------------
def test_stage1_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="`stage` must be 2 or 3; got 1") as info:
        ZeROOffload(stage=1)
    assert "stage=2" in str(info.value)


def test_nvme_without_path_is_refused() -> None:
    with pytest.raises(ValueError, match="`nvme_path` is required"):
        ZeROOffload(offload_optimizer="nvme")


def test_nvme_with_missing_or_readonly_path_is_refused(tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="existing directory"):
        ZeROOffload(offload_optimizer="nvme", nvme_path=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="existing directory"):
        (tmp_path / "file").write_text("x")
        ZeROOffload(offload_optimizer="nvme", nvme_path=str(tmp_path / "file"))
    # permission bits do not bind root (these tests may run as root): the check asks os.access
    ro = str(tmp_path)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if os.fspath(p) == ro else real_access(p, mode)
    )
    with pytest.raises(ValueError, match="must be writable"):
        ZeROOffload(offload_optimizer="nvme", nvme_path=ro)


def test_nvme_path_without_nvme_offload_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="only used with offload_optimizer='nvme'"):
        ZeROOffload(nvme_path=str(tmp_path))


def test_parameter_offload_needs_stage3() -> None:
    with pytest.raises(ValueError, match="`offload_parameters`=True needs stage=3"):
        ZeROOffload(stage=2, offload_parameters=True)


def test_optimizer_without_cpu_counterpart_lists_the_supported_ones() -> None:
    model = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError) as info:
        to_deepspeed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    for name in SUPPORTED_OPTIMIZERS:
        assert name in str(info.value)
    assert "torch.optim.sgd.SGD" in str(info.value)
    # without offload, DeepSpeed runs the torch optimizer itself: nothing to convert
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert to_deepspeed_optimizer(sgd, None) is sgd
    with pytest.raises(ValueError, match="amsgrad"):
        to_deepspeed_optimizer(torch.optim.Adam(model.parameters(), amsgrad=True), "cpu")


def test_unsupported_optimizer_fails_when_fit_starts(tmp_path) -> None:
    class SGDModel(type(tiny_model())):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(TypeError, match="Supported: torch.optim.Adam"):
        fit(tmp_path, strategy=ZeROOffload(), model=SGDModel(**tiny_model().hparams), max_steps=1)


# -- optimizer conversion ----------------------------------------------------------------------
def test_conversion_keeps_groups_hyperparameters_and_schedule() -> None:
    model = tiny_model()
    opt_cfg = model.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    new = to_deepspeed_optimizer(opt, "cpu")
    assert type(new).__name__ == "DeepSpeedCPUAdam" and new.adam_w_mode
    assert len(new.param_groups) == 2
    for a, b in zip(opt.param_groups, new.param_groups):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        for key in ("lr", "initial_lr", "eps", "weight_decay"):
            assert b[key] == a[key], key
        assert tuple(b["betas"]) == tuple(a["betas"])
    assert new.param_groups[0]["weight_decay"] == 0.1 and new.param_groups[1]["weight_decay"] == 0.0
    assert F.rebind_schedulers([sched], opt, new) == 1
    before = [g["lr"] for g in new.param_groups]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    new.step()
    sched.step()  # the schedule now drives the DeepSpeed optimizer's groups
    assert [g["lr"] for g in new.param_groups] != before
    assert [g["lr"] for g in opt.param_groups] == before


# -- real DeepSpeed fits on a CPU ----------------------------------------------------------------
K = 4  # steps before the checkpoint; the runs go to 2K


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-2 and plain runs of 2K steps, each saving a checkpoint at step K, and resumptions:
    ZeRO from ZeRO, ZeRO from plain, plain from ZeRO."""
    root = tmp_path_factory.mktemp("zero2")
    # use_distributed_sampler=False: on one process keep the loader's own sampler (Lightning would
    # wrap it in a reshuffling DistributedSampler, as for any distributed strategy)
    epoch = dict(limit_train_batches=K, max_steps=2 * K, use_distributed_sampler=False)
    out = {}
    save = SaveAt(K, root / "zero_k.ckpt", snapshot=lambda t: params_of(t.lightning_module))
    out["zero"] = fit(root / "z", [save], strategy=ZeROOffload(), **epoch)
    out["zero_k"] = save.snapshot
    save_p = SaveAt(K, root / "plain_k.ckpt")
    out["plain"] = fit(root / "p", [save_p], **epoch)
    out["zero_from_zero"] = fit(
        root / "zz", strategy=ZeROOffload(), ckpt_path=str(root / "zero_k.ckpt"), **epoch
    )
    out["zero_from_plain"] = fit(
        root / "zp", strategy=ZeROOffload(), ckpt_path=str(root / "plain_k.ckpt"), **epoch
    )
    out["plain_from_zero"] = fit(root / "pz", ckpt_path=str(root / "zero_k.ckpt"), **epoch)
    out["root"] = root
    return out


def _close(a, b, rtol=1e-4, atol=1e-5):
    for (name, x), y in zip(params_of(a).items(), params_of(b).values()):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=f"{name} differs")


def test_stage2_trains_like_plain_adamw(runs) -> None:
    zero_trainer, zero_model, zero_rec = runs["zero"]
    _, plain_model, plain_rec = runs["plain"]
    assert zero_trainer.global_step == 2 * K
    assert type(zero_trainer.strategy.optimizers[0].optimizer).__name__ == "DeepSpeedCPUAdam"
    # same per-group weight decay, betas, eps and LR schedule: same trajectory as torch AdamW
    torch.testing.assert_close(
        torch.tensor(zero_rec.losses), torch.tensor(plain_rec.losses), rtol=1e-4, atol=1e-5
    )
    _close(zero_model, plain_model)
    assert zero_rec.losses[-1] < zero_rec.losses[0]


def test_stage2_lr_schedule_drives_the_deepspeed_optimizer(runs) -> None:
    trainer, _, _ = runs["zero"]
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    inner = trainer.strategy.optimizers[0].optimizer
    assert scheduler.optimizer is inner
    assert [g["lr"] for g in inner.param_groups] == scheduler.get_last_lr()
    assert scheduler.last_epoch == 2 * K


def test_checkpoint_is_plain_with_torch_adamw_state(runs) -> None:
    ckpt = torch.load(runs["root"] / "zero_k.ckpt", weights_only=False)
    assert set(ckpt["state_dict"]) == set(tiny_model().state_dict())
    opt = ckpt["optimizer_states"][0]
    assert len(opt["param_groups"]) == 2 and opt["param_groups"][0]["weight_decay"] == 0.1
    n_params = len(list(tiny_model().parameters()))
    assert len(opt["state"]) == n_params
    assert all(float(s["step"]) == K for s in opt["state"].values())
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in opt["state"].values())
    # the weights saved are the ones of step K
    for name, value in runs["zero_k"].items():
        torch.testing.assert_close(ckpt["state_dict"][name], value)


def test_resume_from_zero_checkpoint_matches_uninterrupted(runs) -> None:
    full_trainer, full_model, full_rec = runs["zero"]
    trainer, model, rec = runs["zero_from_zero"]
    assert trainer.global_step == 2 * K
    # the test can fail: the model moved after step K
    assert any(
        not torch.equal(a, b)
        for a, b in zip(runs["zero_k"].values(), params_of(full_model).values())
    )
    _close(model, full_model, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        torch.tensor(rec.losses), torch.tensor(full_rec.losses[K:]), rtol=1e-6, atol=1e-7
    )


def test_checkpoints_cross_between_zero_and_plain(runs) -> None:
    # a plain run's checkpoint resumes under ZeRO, and a ZeRO checkpoint resumes without it,
    # with the optimizer moments carried over (a fresh optimizer would diverge)
    _close(runs["zero_from_plain"][1], runs["plain"][1])
    _close(runs["plain_from_zero"][1], runs["zero"][1])


def test_stage3_resumes_from_a_plain_checkpoint(runs, tmp_path) -> None:
    # ZeRO-3 partitions parameters and optimizer state: loading a plain AdamW checkpoint must
    # fill both (master weights and moments), or the run diverges from the plain one
    epoch = dict(limit_train_batches=K, max_steps=2 * K, use_distributed_sampler=False)
    strategy = ZeROOffload(
        stage=3,
        offload_parameters=True,
        config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    trainer, model, _ = fit(
        tmp_path, strategy=strategy, ckpt_path=str(runs["root"] / "plain_k.ckpt"), **epoch
    )
    assert trainer.global_step == 2 * K
    from lightning_efficient.techniques.zero_offload import full_state_dict

    resumed = full_state_dict(model)
    for name, value in params_of(runs["plain"][1]).items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def stage3(tmp_path_factory):
    """ZeRO-3 with optimizer and parameter offload, saving DeepSpeed's sharded directory."""
    root = tmp_path_factory.mktemp("zero3")
    # threshold 0: partition every parameter of the tiny model (a config entry no argument owns)
    no_persist = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    strategy = ZeROOffload(stage=3, offload_parameters=True, save_format="zero", config=no_persist)
    trainer, model, rec = fit(
        root / "run", strategy=strategy, max_steps=4, use_distributed_sampler=False
    )
    ckpt_dir = root / "zero3_ckpt"
    trainer.save_checkpoint(ckpt_dir)
    from lightning_efficient.techniques.zero_offload import full_state_dict

    trained = full_state_dict(model)
    _, plain_model, plain_rec = fit(root / "plain", max_steps=4)
    return dict(
        trainer=trainer,
        rec=rec,
        ckpt_dir=ckpt_dir,
        trained=trained,
        plain_model=plain_model,
        plain_rec=plain_rec,
        root=root,
    )


def test_stage3_with_parameter_offload_trains(stage3) -> None:
    trainer = stage3["trainer"]
    assert trainer.global_step == 4
    assert trainer.strategy.zero_stage_3
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["stage3_param_persistence_threshold"] == 0  # the user's entry won over the default
    # parameters are partitioned: the module holds placeholders, DeepSpeed the data
    params = list(trainer.lightning_module.parameters())
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)
    torch.testing.assert_close(
        torch.tensor(stage3["rec"].losses),
        torch.tensor(stage3["plain_rec"].losses),
        rtol=1e-4,
        atol=1e-5,
    )
    for name, value in params_of(stage3["plain_model"]).items():
        torch.testing.assert_close(stage3["trained"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_export_fp32_loads_into_the_unmodified_module(stage3) -> None:
    assert stage3["ckpt_dir"].is_dir()
    out = F.export_fp32(stage3["ckpt_dir"], stage3["root"] / "exported.pt")
    state = torch.load(out, weights_only=True)
    fresh = tiny_model()
    fresh.load_state_dict(state, strict=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, stage3["trained"][name], msg=name)
    assert fresh.head.weight is fresh.tok_emb.weight  # the tie survives
    x = torch.randint(0, 256, (2, 16))
    reference = tiny_model()
    reference.load_state_dict(stage3["trained"])
    fresh.eval(), reference.eval()
    torch.testing.assert_close(fresh(x), reference(x))
    assert not torch.equal(fresh(x), tiny_model().eval()(x))  # trained, not the initial weights


def test_export_zero_command(stage3, capsys) -> None:
    from lightning_efficient.cli import EXTRA_COMMANDS, main

    assert "export-zero" in EXTRA_COMMANDS
    out = stage3["root"] / "cli.pt"
    assert main(["export-zero", str(stage3["ckpt_dir"]), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    tiny_model().load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert main(["export-zero", str(stage3["root"] / "nothing"), str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_short_name_and_registry() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    assert "zero_offload" in StrategyRegistry
    trainer = Trainer(strategy="zero_offload", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ZeROOffload) and trainer.strategy.stage == 2
    assert trainer.strategy.root_device == torch.device("cpu", 0)


# -- the memory estimate ---------------------------------------------------------------------
def test_estimate_device_peak_falls_with_offload() -> None:
    from lightning_efficient.measure.estimate import estimate_memory

    model = tiny_model()
    batch = (torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))
    plain = estimate_memory(model, batch)
    stage2 = estimate_memory(model, batch, callbacks=[ZeROOffload()])
    stage3 = estimate_memory(
        model, batch, callbacks=[ZeROOffload(stage=3, offload_parameters=True)]
    )
    no_offload = estimate_memory(model, batch, callbacks=[ZeROOffload(offload_optimizer=None)])
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    steps = 8 * len(list(model.parameters()))  # AdamW's per-parameter step counters
    assert plain.host_bytes == 0 and no_offload.host_bytes == 0
    assert no_offload.peak_bytes == plain.peak_bytes
    # AdamW's two moments and the gradients leave the device: host holds 3 x the fp32 weights
    assert 3 * n_bytes <= stage2.host_bytes <= 3 * n_bytes + steps
    assert stage2.by_category["optimizer_state"] == 0 and stage2.by_category["gradients"] == 0
    assert stage2.peak_bytes < plain.peak_bytes - 2 * n_bytes
    assert 4 * n_bytes <= stage3.host_bytes <= 4 * n_bytes + steps
    assert stage3.by_category["parameters"] == 0
    assert stage3.peak_bytes < stage2.peak_bytes
    assert any("ZeROOffload" in n for n in stage2.notes)


def test_yaml_short_name_through_the_cli(tmp_path) -> None:
    import yaml

    from lightning_efficient.cli import EfficientCLI

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"trainer": {"accelerator": "cpu", "logger": False, "strategy": "zero_offload"}}
        )
    )
    cli = EfficientCLI(args=["--config", str(cfg)], run=False)
    assert isinstance(cli.trainer.strategy, ZeROOffload)
    assert cli.trainer.strategy.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_single_process_fit_leaves_no_process_group_address_in_the_environment(runs) -> None:
    # the fits above ran in this process; a DDP launch from here must not inherit their port
    for key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        assert key not in os.environ, key
