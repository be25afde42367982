"""Several checks under FullyShardedStrategy in the same 2 CPU processes (gloo), one fit after the
other; each rank writes ``OUT/rank<r>.json`` with one section per check.

- ``mixed``: ``param_dtype="bf16"``: the dtype of a block's weight inside its forward (gathered),
  the sharded parameters' dtype after the fit, the losses, the policies fully_shard stored.
- ``offload``: ``cpu_offload=True``: the policy fully_shard stored, where the shards live, the
  losses (a CPU machine has nothing to offload to: the maths must be unchanged).
- ``curriculum``: the ids each rank trained on per step (tests/multiprocess/ddp_curriculum.py's
  module).
- ``early_stopping``: EarlyStopper and DivergenceGuard on a rank-dependent metric and a NaN on
  rank 1 only (tests/multiprocess/ddp_early_stopping.py's setup).
- ``batch_size``: EfficientBatchSize(target_batch_size=16): micro-batch, accumulation, samples.
- ``explicit_policy``: ActivationCheckpointing with a class name and with a regex policy, and the
  same fit without it: losses, blocks wrapped, calls of block 0's attention (forward + recompute).

Usage: python tests/multiprocess/fsdp_checks.py OUT  (Lightning re-launches this script for rank 1)
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from _batch_size_helpers import OOMGPT
from ddp_early_stopping import run
from helpers import fit

from benchmarks.workloads import TINY_MODEL, interleaved_data, tiny_model
from lightning_efficient.core import _internals
from lightning_efficient.core.report import report_for
from lightning_efficient.techniques import ActivationCheckpointing
from lightning_efficient.techniques.batch_size import EfficientBatchSize
from lightning_efficient.techniques.fsdp import FullyShardedStrategy, sharded_modules

STEPS, EPOCH = 4, 2  # as tests/techniques/test_fsdp.py's plain run: 4 steps, epochs of 2


def _two_ranks(strategy: FullyShardedStrategy, **kwargs) -> dict:
    return {"accelerator": "cpu", "devices": 2, "strategy": strategy, **kwargs}


def mixed_precision() -> dict:
    model = tiny_model()
    inside: list[str] = []
    qkv = model.blocks[0].attn.qkv
    qkv.register_forward_pre_hook(lambda m, args: inside.append(str(m.weight.dtype)))
    trainer, model, rec = fit(
        None,
        model=model,
        data=interleaved_data(4),
        use_distributed_sampler=False,
        max_steps=STEPS,
        limit_train_batches=EPOCH,
        **_two_ranks(FullyShardedStrategy(param_dtype="bf16")),
    )
    mp, offload = _internals.fsdp_policies(model.blocks[0])
    params = list(model.parameters())
    return {
        "dtype_in_forward": sorted(set(inside)),
        "sharded_dtypes": sorted({str(p.dtype) for p in params}),
        "local_dtypes": sorted({str(p.to_local().dtype) for p in params}),
        "param_dtype": str(mp.param_dtype),
        "reduce_dtype": str(mp.reduce_dtype),
        "losses": rec.losses,
    }


def cpu_offload() -> dict:
    trainer, model, rec = fit(
        None,
        data=interleaved_data(4),
        use_distributed_sampler=False,
        max_steps=STEPS,
        limit_train_batches=EPOCH,
        **_two_ranks(FullyShardedStrategy(cpu_offload=True)),
    )
    _, offload = _internals.fsdp_policies(model.blocks[0])
    _, root_offload = _internals.fsdp_policies(model)
    params = list(model.parameters())
    return {
        "policy": type(offload).__name__,
        "root_policy": type(root_offload).__name__,
        "pin_memory": bool(getattr(offload, "pin_memory", False)),
        "local_devices": sorted({p.to_local().device.type for p in params}),
        "losses": rec.losses,
    }


def curriculum(out: Path) -> dict:
    from ddp_curriculum import Module, trainer_args

    where = out / "curriculum"
    where.mkdir(exist_ok=True)
    trainer = pl.Trainer(**trainer_args(), **_two_ranks(FullyShardedStrategy()))
    module = Module(str(where))
    trainer.fit(module)
    sampler = trainer.train_dataloader.sampler
    return {"seen": module.seen, "sampler": type(sampler).__name__, "world": sampler.num_replicas}


def early_stopping() -> dict:
    _, result = run(
        FullyShardedStrategy(),
        # the full parameters (gathered), the same on every rank when the decisions were
        lambda model: float(
            sum(p.detach().full_tensor().double().sum() for p in model.parameters())
        ),
        accelerator="cpu",
        devices=2,
    )
    return result


def batch_size() -> dict:
    pl.seed_everything(0, verbose=False)
    model = OOMGPT(**TINY_MODEL)
    cb = EfficientBatchSize(target_batch_size=16, budget="1GiB", max_batch_size=4)
    trainer, model, rec = fit(
        None, [cb], model=model, max_steps=3, **_two_ranks(FullyShardedStrategy())
    )
    return {
        "world_size": trainer.world_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "micro": trainer.train_dataloader.batch_size,
        "global_step": trainer.global_step,
        "samples_seen": model.samples_seen,
        "losses": rec.losses,
    }


def explicit_policy() -> dict:
    result = {}
    for name, policy in (("none", None), ("class", "Block"), ("regex", r"re:blocks\.\d+$")):
        pl.seed_everything(0, verbose=False)
        model, calls = tiny_model(), []
        model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
        trainer, model, rec = fit(
            None,
            [ActivationCheckpointing(policy)] if policy else [],
            model=model,
            data=interleaved_data(4),
            use_distributed_sampler=False,
            max_steps=STEPS,
            limit_train_batches=EPOCH,
            limit_val_batches=0,  # block 0's attention runs in training steps only
            **_two_ranks(FullyShardedStrategy()),
        )
        row = report_for(trainer).to_dict().get("ActivationCheckpointing", {})
        result[name] = {
            "losses": rec.losses,
            "wrapped": row.get("blocks_wrapped", 0),
            "attention_calls": len(calls),
            "sharded": sharded_modules(model),
        }
    return result


def main(out: Path) -> None:
    result = {}
    for name, check in (
        ("mixed", mixed_precision),
        ("offload", cpu_offload),
        ("curriculum", lambda: curriculum(out)),
        ("early_stopping", early_stopping),
        ("batch_size", batch_size),
        ("explicit_policy", explicit_policy),
    ):
        result[name] = check()
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    torch.distributed.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
