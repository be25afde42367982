"""Run one contract case under FullyShardedStrategy with 2 CPU processes (gloo); rank zero writes
a JSON result (the FSDP twin of ``_ddp_fit.py``).

Usage: python tests/_fsdp_case.py CASE_ID OUT.json  (Lightning re-launches this script for rank 1)
"""

import json
import sys

from test_contract import ALL

from lightning_efficient.core.report import report_for
from lightning_efficient.techniques.fsdp import FullyShardedStrategy


def main(case_id: str, out: str) -> None:
    case = next(c for c in ALL if c.id == case_id)
    kwargs = {"accelerator": "cpu", "devices": 2, "max_steps": 3, **case.trainer_kwargs}
    if case.kind != "strategy":
        kwargs["strategy"] = FullyShardedStrategy()
    trainer, _, rec = case.fit(None, **kwargs)
    if trainer.is_global_zero:
        result = {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "losses": rec.losses,
            "report": report_for(trainer).to_dict(),
        }
        with open(out, "w") as f:
            json.dump(result, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
