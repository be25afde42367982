"""Every 2-process check of tests/techniques/test_fsdp.py in ONE launch of 2 CPU processes (gloo):
the imports and the process group are paid once instead of once per script. Parts, in order:

- ``fit``: ``fsdp_fit.main(OPTIONS, OUT/fit)`` (checkpointing, MemoryBreakdown, a checkpoint);
- ``checks``: ``fsdp_checks.main(OUT/checks)`` (mixed precision, offload, curriculum, early
  stopping, batch size);
- ``cases``: ``fsdp_contract.main(OUT/cases.json)`` (every contract case under FSDP).

Rank zero appends the name of each part to OUT/started.txt when it starts and to OUT/ended.txt
when it has ended on rank zero (a failure names the part it stopped in), and prints ``== started PART`` and
``== ended PART`` around it (run unbuffered: the lines between are that part's output).

Usage: python tests/multiprocess/fsdp_launch.py PART[,PART...] OPTIONS_JSON OUT
(Lightning re-launches it for rank 1, which runs the same parts.)
"""

import json
import os
import sys
from pathlib import Path

import torch

PARTS = ("fit", "checks", "cases")


def _mark(out: Path, which: str, part: str) -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"== {which} {part}", flush=True)
        with open(out / f"{which}.txt", "a") as f:
            f.write(part + "\n")


def main(parts: list[str], options: dict, out: Path) -> None:
    import fsdp_checks
    import fsdp_contract
    import fsdp_fit

    for part in parts:
        _mark(out, "started", part)
        if part == "fit":
            (out / "fit").mkdir(exist_ok=True)
            fsdp_fit.main(options, out / "fit")
        elif part == "checks":
            (out / "checks").mkdir(exist_ok=True)
            fsdp_checks.main(out / "checks")
        else:
            fsdp_contract.main(str(out / "cases.json"))
        _mark(out, "ended", part)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1].split(","), json.loads(sys.argv[2]), Path(sys.argv[3]))
