"""ExactAccumulation: the update error of gradient accumulation, the held-out loss, the step time.

The documents: the paragraphs of the text that ships with Python (``pydoc_data.topics``), bytes
as tokens, as ``benchmarks/packing.py`` builds them (a long-tail mix: most paragraphs short, a
few long), padded per micro-batch (labels -100 on the padding). The model: a Hugging Face Llama
from a small config (``self.model(**batch).loss``: the token mean after the causal shift), fp32,
trained by a Lightning Trainer.

1. Update error: one optimizer step of micro-batch 4 x accumulation 4 (SGD, lr 1: the weight
   change is the gradient) against one step on the window's 16 documents together, for Lightning's
   own accumulation and with ``ExactAccumulation``, over ``--windows`` windows, in two orders:
   random, and length-bucketed (documents sorted by length into micro-batches, the micro-batches
   shuffled, as ``LengthBucketSampler`` serves them).
2. Held-out loss: ``--steps`` AdamW steps on length-bucketed micro-batches, 4 x 4 plain, 4 x 4
   exact, and batch 16 (no accumulation), from the same weights; the token-mean loss on 64
   held-out documents after them.
3. Step time: the plain and exact runs of part 2, run alternately ``--repeats`` times; each
   step's least time over the repeats, summed over the steps. And where the exact run's extra
   time goes, measured inside it: the time in ``ExactAccumulation``'s hooks per step (the count
   per micro-batch, the rescale and the logged window loss at the step), and the one-off probe
   (a few forward passes on the first batch, before the first step's timer starts).

Run:  python -m benchmarks.accumulation          (a few minutes on 2 busy cores)
      python -m benchmarks.accumulation --quick  (fewer windows and steps)
Writes benchmarks/results/accumulation{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import docs_llama, pad_batch, paragraphs
from lightning_efficient.techniques.accumulation import ExactAccumulation

ROOT = Path(__file__).resolve().parents[1]

MICRO, ACCUMULATION, SEED, LONGEST = 4, 4, 0, 256


class TimedExact(ExactAccumulation):
    """ExactAccumulation that sums the time spent in its per-batch hooks (the probe apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_seconds = self.probe_seconds = 0.0
        measure = self.weights.measure

        def timed_measure(*args: Any) -> None:
            start = time.perf_counter()
            measure(*args)
            self.probe_seconds += time.perf_counter() - start

        self.weights.measure = timed_measure  # type: ignore[method-assign]

    def _timed(self, hook: Any, *args: Any) -> None:
        start, probe = time.perf_counter(), self.probe_seconds
        hook(*args)
        self.hook_seconds += time.perf_counter() - start - (self.probe_seconds - probe)

    def on_train_batch_start(self, *args: Any) -> None:
        self._timed(super().on_train_batch_start, *args)

    def on_before_backward(self, *args: Any) -> None:
        self._timed(super().on_before_backward, *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._timed(super().on_before_optimizer_step, *args)


class LM(pl.LightningModule):
    def __init__(self, net: torch.nn.Module, batches: list[list[dict]], lr: float, sgd: bool):
        super().__init__()
        self.model, self.batches, self.lr, self.sgd = net, batches, lr, sgd
        self.step_times: list[float] = []
        self._t = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx % ACCUMULATION == 0:
            self._t = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % ACCUMULATION == 0:  # the window's micro-batches and its step
            self.step_times.append(time.perf_counter() - self._t)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, collate_fn=pad_batch)


def fit(net: torch.nn.Module, batches: list, callbacks: list, steps: int, **kw: Any) -> LM:
    module = LM(net, batches, kw.pop("lr", 1.0), kw.pop("sgd", True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw,
    )  # fmt: skip
    trainer.fit(module)
    return module


def micro_batches(docs: list[torch.Tensor], bucketed: bool, seed: int) -> list[list[dict]]:
    items = [{"input_ids": d} for d in docs]
    if bucketed:
        items.sort(key=lambda x: len(x["input_ids"]))
    batches = [items[i : i + MICRO] for i in range(0, len(items) - MICRO + 1, MICRO)]
    if bucketed:
        random.Random(seed).shuffle(batches)
    return batches


def update_error(net: torch.nn.Module, window: list[list[dict]], exact: bool) -> float:
    whole = copy.deepcopy(net)
    whole(**pad_batch([x for b in window for x in b])).loss.backward()
    expected = {n: -p.grad for n, p in whole.named_parameters()}
    trained = fit(copy.deepcopy(net), window, [ExactAccumulation()] if exact else [], 1,
                  accumulate_grad_batches=ACCUMULATION)  # fmt: skip
    before = dict(net.named_parameters())
    num = den = 0.0
    for n, p in trained.model.named_parameters():
        num += float((p.detach() - before[n].detach() - expected[n]).pow(2).sum())
        den += float(expected[n].pow(2).sum())
    return (num / den) ** 0.5


@torch.no_grad()
def held_out_loss(net: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    batch = pad_batch([{"input_ids": d} for d in docs])
    return float(net(**batch).loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="results STEM (default benchmarks/results/)")
    args = parser.parse_args(argv)
    windows = args.windows or (2 if args.quick else 4)
    steps = args.steps or (6 if args.quick else 12)
    warnings.filterwarnings("ignore")
    pl.seed_everything(SEED, verbose=False)
    window_docs = MICRO * ACCUMULATION
    train, held = paragraphs(max(windows, steps) * window_docs)
    train = [d[:LONGEST] for d in train]
    held = [d[:LONGEST] for d in held]
    lengths = sorted(len(d) for d in train)
    net = docs_llama(quick=True)

    rows, errors = [], {}
    for order in ("random", "length-bucketed"):
        batches = micro_batches(train[: windows * window_docs], order != "random", SEED)
        for exact in (False, True):
            found = [
                update_error(net, batches[w * ACCUMULATION : (w + 1) * ACCUMULATION], exact)
                for w in range(windows)
            ]
            name = "ExactAccumulation" if exact else "Lightning (plain)"
            errors[f"{order}/{name}"] = found
            rows.append([order, name, f"{sum(found) / len(found):.2e}", f"{max(found):.2e}"])

    bucketed = micro_batches(train[: steps * window_docs], True, SEED)
    whole_batches = [
        [x for b in bucketed[s * ACCUMULATION : (s + 1) * ACCUMULATION] for x in b]
        for s in range(steps)
    ]
    adamw = dict(lr=3e-3, sgd=False)
    times: dict[str, list[float]] = {"plain": [], "exact": []}
    losses: dict[str, float] = {}
    hooks, probes = [], []
    for _ in range(args.repeats):
        for name in ("plain", "exact"):
            cbs = [TimedExact()] if name == "exact" else []
            run = fit(copy.deepcopy(net), bucketed, cbs, steps, accumulate_grad_batches=4, **adamw)
            times[name].append(run.step_times)
            losses[name] = held_out_loss(run.model, held)
            if cbs:
                hooks.append(cbs[0].hook_seconds / steps)
                probes.append(cbs[0].probe_seconds)
    whole = fit(copy.deepcopy(net), whole_batches, [], steps, **adamw)
    losses["whole"] = held_out_loss(whole.model, held)
    # the same steps (same micro-batches) in both runs: each step's least over the repeats
    least = {k: [min(step) for step in zip(*runs)] for k, runs in times.items()}
    cost = sum(least["exact"]) / sum(least["plain"])
    plain_step = sum(least["plain"]) / steps
    hook_share = min(hooks) / plain_step  # the callback's own work per step, against a step

    env = environment()
    command = "python -m benchmarks.accumulation" + (" --quick" if args.quick else "")
    text = "\n".join(
        [
            f"# ExactAccumulation: {len(train)} pydoc paragraphs of {lengths[0]}..{lengths[-1]} "
            f"byte tokens (median {lengths[len(lengths) // 2]}), micro-batch {MICRO} x "
            f"accumulation {ACCUMULATION}\n",
            "Relative error of the update against one step on the window's 16 documents "
            f"together (SGD lr 1, fp32; mean and worst of {windows} windows):\n",
            table(["order", "accumulation", "mean error", "worst"], rows, align="llrr"),
            f"\nHeld-out token-mean loss after {steps} AdamW steps (length-bucketed micro-batches; "
            "64 held-out paragraphs):\n",
            table(
                ["run", "held-out loss"],
                [
                    ["batch 16, no accumulation", f"{losses['whole']:.4f}"],
                    ["4 x 4, Lightning (plain)", f"{losses['plain']:.4f}"],
                    ["4 x 4, ExactAccumulation", f"{losses['exact']:.4f}"],
                ],
                align="lr",
            ),
            f"\nStep time ({steps} steps, each step's least over {args.repeats} alternating runs, "
            f"summed): plain {sum(least['plain']):.2f} s, exact {sum(least['exact']):.2f} s: "
            f"{cost:.3f}x (2 CPU cores shared with other work: noisy). Measured inside the exact "
            f"run: its hooks take {min(hooks) * 1e3:.2f} ms per step, {hook_share:.1%} of a plain "
            f"step ({plain_step * 1e3:.1f} ms): the cost of the method itself is "
            f"{1 + hook_share:.3f}x; the one-off probe (before the first step) "
            f"{min(probes) * 1e3:.0f} ms.\n",
            provenance(env, command),
        ]
    )
    data = {
        "errors": errors, "held_out": losses, "step_seconds": times, "cost": cost,
        "hook_seconds_per_step": hooks, "probe_seconds": probes, "hook_cost": 1 + hook_share,
        "windows": windows, "steps": steps, "environment": env, "command": command,
    }  # fmt: skip
    default = (
        ROOT / "benchmarks" / "results" / ("accumulation_quick" if args.quick else "accumulation")
    )
    stem = Path(args.out) if args.out else default
    save_results(stem, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
