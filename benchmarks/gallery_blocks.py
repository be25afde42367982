"""Which blocks "auto" checkpoints, and what they free, on the gallery of model families.

The gallery (``workloads.GALLERY``): ResNet-, ConvNeXt-, U-Net- and DenseNet-like CNNs with
BatchNorm/LayerNorm written for the tests, and ViT, T5, Llama (SDPA) and BERT built from tiny
``transformers`` configs, at the test shapes. For each, the instrument's fake-tensor estimate
(nothing runs, nothing is allocated: the figures do not depend on this machine) of one training
step's forward/backward peak:

- plain: no checkpointing (its activations are the 100%);
- structural: the blocks ``find_repeated_blocks`` picks without an input (the parameter-count
  choice, what "auto" did before it measured, and what regional compile still uses);
- auto: the group ``rank_blocks`` measures to free the most (what ``ActivationCheckpointing()``
  checkpoints);
- best class: the single block class whose checkpointing frees the most, every non-container
  block class of the model tried.

    python -m benchmarks.gallery_blocks

Prints a table and saves benchmarks/results/gallery_blocks.{md,json}.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import environment, fmt_bytes, save_results, table
from benchmarks.workloads import GALLERY
from lightning_efficient.functional import find_repeated_blocks
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.techniques.activation_checkpointing import (
    apply_activation_checkpointing,
    rank_blocks,
    remove_activation_checkpointing,
)

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"


def _sgd(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.0)


def fb_peak(model: nn.Module, batch: Any, loss_fn: Any, policy: Any = None) -> int:
    if policy is not None:
        apply_activation_checkpointing(model, policy)
    try:
        est = estimate_memory(model, batch, loss_fn=loss_fn, optimizer=_sgd, steps=1)
    finally:
        remove_activation_checkpointing(model)
    return max(est.phase_peaks["forward"], est.phase_peaks["backward"])


def block_classes(model: nn.Module) -> list[str]:
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    names = [
        type(m).__name__
        for n, m in model.named_modules()
        if n
        and not isinstance(m, containers)
        and any(True for _ in m.children())
        and any(True for _ in m.parameters())
    ]
    return list(dict.fromkeys(names))


def span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def main() -> None:
    torch.set_num_threads(1)
    rows, data = [], []
    for name, (build, make_batch, loss_fn, _) in GALLERY.items():
        torch.manual_seed(0)
        model, batch = build().train(), make_batch()
        t0 = time.perf_counter()
        ranking = rank_blocks(model, batch, loss_fn=loss_fn)
        rank_s = time.perf_counter() - t0
        plain, acts = ranking.plain_peak_bytes, ranking.plain_activation_bytes
        chosen = ranking.best
        structural = [n for n, _ in find_repeated_blocks(model)]
        s_saved = plain - fb_peak(model, batch, loss_fn, "re:" + "|".join(structural))
        by_class = {c: plain - fb_peak(model, batch, loss_fn, c) for c in block_classes(model)}
        best_cls = max(by_class, key=by_class.get)
        item = {
            "model": name,
            "plain_activation_bytes": acts,
            "plain_peak_bytes": plain,
            "structural": {"blocks": structural, "saved_bytes": s_saved},
            "auto": {
                "blocks": chosen.group.names,
                "block_class": chosen.group.block_class,
                "saved_bytes": chosen.saved_bytes,
                "groups_measured": len(ranking.savings),
                "rank_seconds": round(rank_s, 2),
            },
            "best_class": {"block_class": best_cls, "saved_bytes": by_class[best_cls]},
            "by_class": by_class,
        }
        data.append(item)
        pct = lambda b: f"-{b / acts:.0%}" if acts else "-"  # noqa: E731
        rows.append(
            [
                name,
                fmt_bytes(acts),
                f"{span(structural)} ({len(structural)})",
                pct(s_saved),
                f"{chosen.group.block_class} x{len(chosen.group.names)}",
                pct(chosen.saved_bytes),
                best_cls,
                pct(by_class[best_cls]),
                f"{chosen.saved_bytes / by_class[best_cls]:.2f}" if by_class[best_cls] else "-",
                len(ranking.savings),
                f"{rank_s:.1f} s",
            ]
        )
        print(rows[-1], flush=True)
    env = environment()
    text = (
        table(
            [
                "model",
                "activations (plain)",
                "structural choice",
                "frees",
                "auto (measured)",
                "frees",
                "best class",
                "frees",
                "auto / best class",
                "groups measured",
                "ranking time",
            ],
            rows,
            "lrlrlrlrrrr",
        )
        + "\n\nFrees: bytes off the estimated forward/backward peak of one step (fake tensors,"
        " one step, stateless SGD), as a share of the plain run's activations. Ranking time:"
        " `rank_blocks` (the plain estimate and one per group, 1 torch thread; load average"
        f" {os.getloadavg()[0]:.1f} when it ended).\n\n"
        "Command: `python -m benchmarks.gallery_blocks`\n\nEnvironment: "
        + ", ".join(f"{k} {v}" for k, v in env.items())
        + "\n"
    )
    save_results(RESULTS / "gallery_blocks", text, {"environment": env, "models": data})


if __name__ == "__main__":
    main()
