"""The GPU suite's one registry of parts: what each part is, its caps, and the file its process
runs.

Standard library only: ``suite.py`` (the parent) reads it without importing torch before it
starts its children. A part with a ``script`` runs as ``python -m benchmarks.gpu.<script> --ctx
FILE`` (the script's ``__main__`` hands its part function to ``common.child_main``); part 1 runs
pytest instead. The modules of ``benchmarks/gpu/`` import downward only:

    registry, search, ../_results               (standard library / no package)
    common        context, recorder, models, the suite's MFU peak, a part's process
    run           a real training run and the pool of processes that run them
    estimate, batch, ladder                     parts 2-4 (memory)
    speed, compile, finetune                    parts 5-7 (timed)
    suite                                       the parent: starts, caps, writes the results
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BY_KEY",
    "HERE",
    "PARTS",
    "PHASE_A",
    "PHASE_B",
    "UNFINISHED",
    "Part",
    "critical_path_s",
]

HERE = Path(__file__).resolve().parent

#: A part's status until it ends: not started, then running. The suite writes its results after
#: every part, so the files of a suite stopped from outside still name these.
UNFINISHED = ("not started", "running")


@dataclass(frozen=True)
class Part:
    number: int
    key: str
    title: str
    cap_s: float  # at the default 540 s budget; scaled with --budget-s
    min_s: float  # a part is skipped when less than this is left
    lane: str  # parts in one lane run one after the other; lanes of phase A side by side
    basis: str  # what the cap is sized from (measured on an H200, issue 30)
    script: str | None = None  # the file in benchmarks/gpu/ a part's process runs (None: pytest)
    # more seconds the part may take where the suite's budget has them left once the later
    # parts' caps are kept (its rows that run only then); not in the critical path
    spare_s: float = 0.0

    @property
    def path(self) -> Path | None:
        """The script's path, or ``None`` for the pytest part."""
        return HERE / self.script if self.script else None

    @property
    def module(self) -> str | None:
        """The script as a module, what ``python -m`` runs, or ``None`` for the pytest part."""
        return f"{__package__}.{self.script.removesuffix('.py')}" if self.script else None


#: Phase A: lanes side by side (memory and correctness: no part times anything); phase B: the
#: timed parts, alone, once phase A has ended.
PHASE_A = ("pytest", "memory", "ladder")
PHASE_B = "timed"
PARTS = [
    Part(1, "pytest", "pytest -m gpu", 60, 15, "pytest", "finished within 45 s"),
    Part(
        2,
        "estimate",
        "Estimate vs reality",
        110,
        25,
        "memory",
        "8 rows of 2 estimates and 2 real steps; rows skipped at 70 s",
        "estimate.py",
    ),
    Part(
        3,
        "batch",
        "Largest micro-batch within the cap",
        140,
        40,
        "memory",
        "estimates finished within 140 s (doubled cap); probes side by side, while estimating",
        "batch.py",
    ),
    Part(
        4,
        "ladder",
        "Largest model at batch 1 within the cap",
        240,
        60,
        "ladder",
        "estimates and the plain run about 60 s, a ZeRO run more than 83 s (stopped there)",
        "ladder.py",
    ),
    Part(
        5,
        "speed",
        "Speed: one lever at a time",
        150,
        40,
        "timed",
        "2 rows finished within 140 s with a 12 s window; 9 rows with 3 s windows estimated "
        "at about 130 s (not yet run on a GPU)",
        "speed.py",
        spare_s=30,  # issue 52: with the packing pair (24 s), where time is left
    ),
    Part(
        6,
        "compile",
        "Compile: regional vs whole model",
        75,
        30,
        "timed",
        "finished within 75 s",
        "compile.py",
    ),
    Part(
        7,
        "finetune",
        "Fine-tuning: LoRA vs the QLoRA stack on a Llama shape",
        60,
        25,
        "timed",
        "not yet run on a GPU: 2 real runs of a few seconds of steps each, the estimates "
        "computed while they train",
        "finetune.py",
        spare_s=30,  # issue 52: the QLoRA stack again with expandable segments
    ),
]
BY_KEY = {p.key: p for p in PARTS}


def critical_path_s(parts: list[Part] = PARTS) -> float:
    """The suite's longest time with every part at its cap: the longest lane of phase A, then
    phase B (DeepSpeed's build runs alongside phase A; part 4's wait for it is within its cap)."""
    lane = {name: sum(p.cap_s for p in parts if p.lane == name) for name in PHASE_A}
    return max(lane.values(), default=0.0) + sum(p.cap_s for p in parts if p.lane == PHASE_B)
