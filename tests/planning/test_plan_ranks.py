"""The planner and the fit's own estimates on several ranks: every rung is one rank's peak, the
ladder shards the state across ranks before it offloads, and a trainer's strategy tells the
estimate how it divides the state (``measure.memory.settings.estimate_settings``)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from benchmarks.workloads import tiny_model
from lightning_efficient.commands import main
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure import estimate_memory
from lightning_efficient.measure.memory.settings import estimate_settings, strategy_sharding
from lightning_efficient.planning import default_ladder, plan_stack
from lightning_efficient.techniques.fsdp import FullyShardedStrategy
from lightning_efficient.techniques.zero_offload import ZeROOffload

DEMO = Path(__file__).parents[2] / "configs" / "demo_plain.yaml"
QUIET = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

#: The one-device ladder as it was before ranks were known (names, in order).
ONE_DEVICE = [
    "as configured",
    "bf16-mixed",
    "bf16-mixed + adamw8bit",
    "bf16-mixed + checkpoint fewest blocks",
    "bf16-mixed + adamw8bit + checkpoint fewest blocks",
    "bf16-mixed + checkpoint all blocks",
    "bf16-mixed + adamw8bit + checkpoint all blocks",
    "bf16-mixed + adamw8bit in backward + checkpoint all blocks",
    "bf16-mixed + checkpoint all blocks + ZeRO-2 optimizer offload",
    "bf16-mixed + checkpoint all blocks + ZeRO-3 parameter offload",
]


@pytest.fixture(scope="module")
def workload():
    model = TinyGPT(n_layer=4, n_embd=32, n_head=2, seq_len=32, dropout=0.0)
    x = torch.zeros(4, 32, dtype=torch.long)
    return model, (x, x)


@pytest.fixture(scope="module")
def full_sharded(workload):
    """One rank's estimate of 8 under full sharding in bf16-mixed (the planner's rounding)."""
    model, batch = workload
    return estimate_memory(
        model, batch, precision="bf16-mixed", cuda_rounding=True, world_size=8, sharding="full"
    )


def test_one_device_ladder_unchanged() -> None:
    assert [r.name for r in default_ladder()] == ONE_DEVICE
    assert [r.name for r in default_ladder(world_size=1)] == ONE_DEVICE


def test_multi_rank_ladder_shards_before_offload() -> None:
    names = [r.name for r in default_ladder(world_size=8)]
    assert names == [
        "as configured",
        "bf16-mixed",
        "bf16-mixed + FSDP grad_op",
        "bf16-mixed + FSDP full",
        "bf16-mixed + FSDP full + checkpoint all blocks",
        "bf16-mixed + checkpoint fewest blocks",
        "bf16-mixed + checkpoint all blocks",
        "bf16-mixed + adamw8bit + checkpoint all blocks",
        "bf16-mixed + checkpoint all blocks + ZeRO-2 optimizer offload",
        "bf16-mixed + checkpoint all blocks + ZeRO-3 parameter offload",
    ]
    # a config that already shards fully gets no sharding rung that divides less or the same
    fully = [r.name for r in default_ladder(world_size=8, configured_sharding="full")]
    assert not any(n.endswith(("FSDP grad_op", "FSDP full")) for n in fully)
    assert "bf16-mixed + FSDP full + checkpoint all blocks" in fully
    # no budget-searched checkpointing under FSDP2: the module it would estimate is sharded
    # (ActivationCheckpointing(budget=) is refused there); DDP keeps it
    assert not any("fewest" in n for n in fully)
    assert "bf16-mixed + checkpoint fewest blocks" in [
        r.name for r in default_ladder(world_size=8, configured_sharding="ddp")
    ]


def test_sharding_rung_meets_a_budget_ddp_cannot(workload, full_sharded, tmp_path) -> None:
    model, batch = workload
    world, full = 8, full_sharded
    # the CPU's kernels with CUDA's rounding: the sharding logic, without CUDA's fixed workspaces;
    # the ladder without the chunked-loss rung (TinyGPT's logits are wide enough for it), so that
    # the sharding rungs alone meet the budget of bf16-mixed + FSDP full
    result = plan_stack(
        model,
        batch,
        full.peak_bytes,
        world_size=world,
        device="cpu",
        cuda_rounding=True,
        ladder=default_ladder(world_size=world),
    )
    chosen = result.chosen
    assert chosen is not None and chosen.name == "bf16-mixed + FSDP full", result.to_markdown()
    # the chosen rung's per-rank peak is the per-rank estimate of that sharding, to the byte
    assert result.estimate_of(chosen).peak_bytes == full.peak_bytes
    assert result.shardings[id(chosen)] == "full"
    # every rung before it (DDP in fp32 and bf16, SHARD_GRAD_OP) is over the budget per rank
    for rung, est, _ in result.tried[:-1]:
        assert est is not None and est.peak_bytes > full.peak_bytes, rung.name
    assert [result.shardings[id(r)] for r, _, _ in result.tried] == [
        "ddp",
        "ddp",
        "grad_op",
        "full",
    ]
    table = result.to_markdown()
    assert "| full x 8 |" in table and "| ddp x 8 |" in table and "per rank, 8 ranks" in table
    # the yaml is a config the user can add: the strategy and the ranks build as planned
    text = result.to_yaml(devices=2, num_nodes=1)
    trainer_cfg = yaml.safe_load(text)["trainer"]
    assert trainer_cfg["strategy"] == {"class_path": "FullyShardedStrategy"}
    assert trainer_cfg["devices"] == 2 and trainer_cfg["num_nodes"] == 1
    cfg = tmp_path / "plan.yaml"
    cfg.write_text(text)
    from lightning_efficient.commands.cli import EfficientCLI

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = EfficientCLI(
            args=["--config", str(DEMO), "--config", str(cfg), "--trainer.accelerator=cpu"],
            run=False,
        )
    settings = estimate_settings(cli.trainer)
    assert isinstance(cli.trainer.strategy, FullyShardedStrategy)
    assert (settings["world_size"], settings["sharding"]) == (2, "full")


def test_checkpointing_budget_in_an_estimate_is_one_ranks(workload, full_sharded) -> None:
    """The budget search that checkpointing runs inside an estimate bounds one rank's peak: a
    budget under the sharded plain peak is met with some but not all blocks checkpointed."""
    from lightning_efficient.techniques import ActivationCheckpointing

    model, batch = workload
    budget = full_sharded.peak_bytes - 1
    ac = ActivationCheckpointing(policy="Block", budget=budget)
    est = estimate_memory(
        model,
        batch,
        precision="bf16-mixed",
        cuda_rounding=True,
        world_size=8,
        sharding="full",
        callbacks=[ac],
    )
    assert est.peak_bytes <= budget
    blocks = re.search(r"(\d+)/4 blocks", " ".join(est.notes))
    assert blocks and 1 <= int(blocks.group(1)) < 4, est.notes


@pytest.mark.parametrize(
    ("strategy", "devices", "expected"),
    [
        (lambda: FullyShardedStrategy(sharding="grad_op"), 2, (2, "grad_op")),
        (lambda: FullyShardedStrategy(), 1, (1, "full")),
        (lambda: ZeROOffload(stage=3), 1, (1, "zero3")),
        (lambda: ZeROOffload(stage=2), 2, (2, "zero2")),
        (lambda: "ddp", 2, (2, "ddp")),
        (lambda: "auto", 1, (1, None)),
    ],
    ids=["fsdp-grad_op", "fsdp-full", "zero3", "zero2", "ddp", "one-device"],
)
def test_estimate_settings_know_the_strategy(strategy, devices, expected) -> None:
    """Built without fitting: no process is launched."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(strategy=strategy(), devices=devices, **QUIET)
    settings = estimate_settings(trainer)
    assert (settings["world_size"], settings["sharding"]) == expected


def test_lightning_strategies_sharding() -> None:
    """Lightning's own sharding strategies, read without importing this package's techniques."""
    assert strategy_sharding(FSDPStrategy()) == "full"
    assert strategy_sharding(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")) == "grad_op"
    assert strategy_sharding(FSDPStrategy(sharding_strategy="NO_SHARD")) == "ddp"
    assert strategy_sharding(DeepSpeedStrategy(stage=1)) == "zero1"
    assert strategy_sharding(DeepSpeedStrategy(stage=3)) == "zero3"
    assert strategy_sharding(None) is None


def test_plan_command_ranks(capsys) -> None:
    base = ["plan", "--config", str(DEMO), "--trainer.accelerator=cpu", "--budget", "1GiB"]
    assert main([*base, "--devices", "0"]) == 2
    err = capsys.readouterr().err
    assert "--devices" in err and "0" in err
    assert main([*base, "--num-nodes", "-1"]) == 2
    assert "--num-nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*base, "--num-nodes", "two"])
    assert info.value.code == 2 and "--num-nodes" in capsys.readouterr().err
    # 2 processes on each of 2 nodes: one rank of 4 planned, the ranks written to the yaml
    assert main([*base, "--batch-size", "2", "--devices", "2", "--num-nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "one rank of 4" in out and "ddp x 4" in out
    plan = yaml.safe_load(out.split("Add to your config")[1].split(":\n", 1)[1])
    assert plan["trainer"]["devices"] == 2 and plan["trainer"]["num_nodes"] == 2


def test_estimate_command_reads_the_configured_strategy(capsys) -> None:
    """Without --devices/--sharding the estimate is one rank of the config's own strategy."""
    args = ["estimate", "--config", str(DEMO), "--batch-size", "2", "--markdown"]
    args += ["--trainer.accelerator=cpu", "--trainer.devices=2"]
    args += ["--trainer.strategy=FullyShardedStrategy", "--trainer.strategy.sharding=grad_op"]
    assert main(args) == 0
    assert "one rank of 2 (grad_op)" in capsys.readouterr().out


def test_estimate_settings_of_an_already_sharded_module() -> None:
    """During an FSDP2 fit the module holds DTensors and the tracker counts this rank's shards:
    the settings do not divide the state a second time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    created = not dist.is_initialized()  # a 1-process FSDP fit earlier keeps its group
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert all(callable(getattr(p, "to_local", None)) for p in model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(strategy=FullyShardedStrategy(), devices=1, **QUIET)
        trainer.strategy.connect(model)
        settings = estimate_settings(trainer)
        assert (settings["world_size"], settings["sharding"]) == (1, None)
    finally:
        if created:
            dist.destroy_process_group()
