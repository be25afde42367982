"""Run contract cases under DDP with 2 CPU processes (gloo), one after another in the same two
processes (the launch, the imports and the process group paid once); rank zero appends one JSON
line per case to OUT: ``{"case": id}`` when it starts, then its result when its fit has ended.

Usage: python tests/multiprocess/ddp_contract.py CASE_ID[,CASE_ID...] OUT.jsonl
(Lightning re-launches this script for rank 1, which runs the same cases in the same order; the
first fit leaves the launcher variables set, so every later Trainer joins the same two ranks.)
"""

import json
import os
import sys

from test_contract import ALL

from lightning_efficient.core.report import report_for


def _write(out: str, record: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def main(case_ids: str, out: str) -> None:
    by_id = {c.id: c for c in ALL}
    for case_id in case_ids.split(","):
        case = by_id[case_id]
        kwargs = {"accelerator": "cpu", "devices": 2, "max_steps": 3, **case.trainer_kwargs}
        if case.kind != "strategy":
            kwargs.setdefault("strategy", "ddp")
        rank_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
        if rank_zero:
            _write(out, {"case": case_id})
        trainer, _, _ = case.fit(None, **kwargs)
        if trainer.is_global_zero:
            _write(
                out,
                {
                    "case": case_id,
                    "world_size": trainer.world_size,
                    "global_step": trainer.global_step,
                    "report": report_for(trainer).to_dict(),
                },
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
