"""Every contract case under FullyShardedStrategy, one fit after the other in the same 2 CPU
processes (gloo): one launch instead of one per case. Rank zero writes OUT.json with one entry
per case id: world size, steps, losses and the report's rows.

Left out: strategy cases (they bring their own strategy) and techniques that refuse sharded
parameters (``sharding_conflict``: the refusal raises, and Lightning then stops every rank;
tests/techniques/test_fsdp.py checks that refusal on its own).

Usage: python tests/multiprocess/fsdp_contract.py OUT.json
(Lightning re-launches this script for rank 1)
"""

import json
import sys

import torch
from test_contract import ALL

from lightning_efficient.core.report import report_for
from lightning_efficient.techniques.fsdp import FullyShardedStrategy


def runs_under_fsdp(case) -> bool:
    return case.kind != "strategy" and not getattr(case.make(), "sharding_conflict", None)


def main(out: str) -> None:
    results = {}
    for case in filter(runs_under_fsdp, ALL):
        kwargs = {"accelerator": "cpu", "devices": 2, "max_steps": 3, **case.trainer_kwargs}
        kwargs["strategy"] = FullyShardedStrategy()
        trainer, _, rec = case.fit(None, **kwargs)
        results[case.id] = {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "losses": rec.losses,
            "report": sorted(report_for(trainer).to_dict()),
        }
        if trainer.is_global_zero:
            with open(out, "w") as f:  # after every case: a failure still shows what ran
                json.dump(results, f, default=str)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
