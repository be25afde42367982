"""SequencePacking: tokens/s of packed rows against padded batches, and the loss of both.

The documents (``workloads.py``, the workload the GPU suite's packing rows train on too): the
paragraphs of the text that ships with Python (``pydoc_data.topics``), bytes as tokens
(vocabulary 256), cut to at most ``ROW`` tokens (a longer paragraph becomes pieces), shuffled with
a fixed seed; ``--docs`` of them train, 64 others are held out. A long-tail distribution: most
paragraphs are short, a few are long.

The model: a Hugging Face Llama (GQA, RoPE) built from a small config, fp32, AdamW, one epoch
over the same documents from the same initial weights, in a plain loop (forward, backward,
optimizer step), the same token budget per step (``ROWS x ROW`` slots at most):

- padded: batches of ``ROWS`` documents in a shuffled order, padded to the longest of the
  batch (``attention_mask`` on the padding, labels -100 there);
- packed: ``pack_dataloader`` (best-fit decreasing) rows of ``ROW`` tokens, ``ROWS`` a batch,
  attention kept inside each document (``apply_document_attention``: restarting
  ``position_ids``).

A third run, padded with as many documents a batch as a packed step holds on average (so as many
optimizer steps as packed, over the same tokens), is the loss curve's comparison.

Measured: real tokens (the documents' own) per second of wall time and per CPU-second of this
process (the cores are shared, CPU time is steadier), the share of slots that hold tokens, and
the loss: the training loss against the tokens seen (in tenths of the epoch) and the token-mean
loss on the held-out documents after the epoch (each document alone).

Run:  python -m benchmarks.packing          (a few minutes on 2 busy cores)
      python -m benchmarks.packing --quick  (fewer documents, a smaller model)
Writes benchmarks/results/packing{,_quick}.{md,json} (``--out STEM``: STEM.{md,json}).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks._results import environment, provenance, save_results, table
from benchmarks.workloads import ROW, ROWS, SEED, Items, docs_llama, pad_batch, paragraphs
from lightning_efficient.techniques.packing import (
    apply_document_attention,
    pack_dataloader,
)

ROOT = Path(__file__).resolve().parents[1]


def targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the loss averages over (labels after the model's shift that are not -100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def train(net: torch.nn.Module, loader: DataLoader, packed: bool) -> dict[str, Any]:
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    change = apply_document_attention(net) if packed else None
    losses, seen, slots, real = [], [], 0, 0
    wall, cpu = 0.0, 0.0
    try:
        for batch in loader:
            tokens = int(batch["attention_mask"].sum())  # packed rows mark their padding too
            if packed:
                change.value.current(batch["position_ids"])
            t0, c0 = time.perf_counter(), time.process_time()
            kwargs = {} if packed else {"attention_mask": batch["attention_mask"]}
            loss = net(input_ids=batch["input_ids"], labels=batch["labels"], **kwargs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            real += tokens
            slots += batch["input_ids"].numel()
            losses.append(float(loss.detach()))
            seen.append(real)
    finally:
        if change is not None:
            change.undo()
    return dict(
        steps=len(losses), tokens=real, slots=slots, fill=real / slots, wall_s=wall, cpu_s=cpu,
        tokens_per_s=real / wall, tokens_per_cpu_s=real / cpu, losses=losses, tokens_seen=seen,
    )  # fmt: skip


@torch.no_grad()
def held_out_loss(net: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for d in docs:
        n = len(d) - 1
        total += float(net(input_ids=d[None], labels=d[None]).loss) * n
        count += n
    return total / count


def by_tenths(run: dict[str, Any]) -> list[float]:
    """The mean training loss in each tenth of the epoch's tokens."""
    out, total = [], run["tokens"]
    for k in range(10):
        lo, hi = total * k / 10, total * (k + 1) / 10
        xs = [loss for loss, t in zip(run["losses"], run["tokens_seen"]) if lo < t <= hi]
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument(
        "--out", default=None, help="result stem (default benchmarks/results/packing{,_quick})"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    count = args.docs or (120 if args.quick else 400)
    train_docs, held = paragraphs(count)
    data = Items(train_docs)
    lengths = [len(d) for d in train_docs]
    runs: dict[str, dict[str, Any]] = {}
    packed_loader = pack_dataloader(DataLoader(data, batch_size=ROWS), ROW, seed=SEED, shuffle=True)
    same_steps = round(count / len(packed_loader))  # documents a packed step holds, on average
    for name, size in (("padded", ROWS), ("packed", ROWS), ("padded, same steps", same_steps)):
        net = docs_llama(args.quick)
        g = torch.Generator().manual_seed(SEED)
        loader = DataLoader(data, batch_size=size, shuffle=True, generator=g, collate_fn=pad_batch)
        if name == "packed":
            loader = packed_loader
        net.train()
        runs[name] = train(net, loader, packed=name == "packed")
        net.eval()
        runs[name]["held_out_loss"] = held_out_loss(net, held)
        runs[name]["loss_by_tenth"] = by_tenths(runs[name])
    padded, packed, matched = runs["padded"], runs["packed"], runs["padded, same steps"]
    ratio_cpu = packed["tokens_per_cpu_s"] / padded["tokens_per_cpu_s"]
    ratio_wall = packed["tokens_per_s"] / padded["tokens_per_s"]
    rows = [
        (
            name,
            r["steps"],
            f"{r['tokens']:,}",
            f"{r['fill']:.1%}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_cpu_s']:,.0f}",
            f"{r['held_out_loss']:.3f}",
        )  # fmt: skip
        for name, r in runs.items()
    ]
    curve = [
        (f"{(k + 1) * 10}%", *(f"{x:.3f}" if x == x else "-" for x in (a, b, c)))
        for k, (a, b, c) in enumerate(
            zip(matched["loss_by_tenth"], packed["loss_by_tenth"], padded["loss_by_tenth"])
        )
    ]
    env = environment(("torch", "lightning", "transformers"))
    command = "python -m benchmarks.packing" + (" --quick" if args.quick else "")
    median = sorted(lengths)[len(lengths) // 2]
    text = "\n".join(
        [
            f"# Sequence packing: packed rows against padded batches ({count} documents)\n",
            f"{count} paragraphs of pydoc_data.topics as bytes (median {median} tokens, longest "
            f"{max(lengths)}), one epoch, the same budget per step ({ROWS} x {ROW} slots at most); "
            f"Llama (GQA, RoPE) of {sum(p.numel() for p in net.parameters()):,} parameters, fp32 "
            "AdamW, 1 thread.\n",
            table(
                [
                    "loader",
                    "steps",
                    "real tokens",
                    "fill",
                    "tokens/s",
                    "tokens/CPU-s",
                    "held-out loss",
                ],
                rows,
                align="lrrrrrr",
            ),  # fmt: skip
            f"\nPacked / padded: {ratio_wall:.2f}x tokens/s (wall), {ratio_cpu:.2f}x tokens per "
            f"CPU-second. Best-fit decreasing fill of the packed rows: "
            f"{packed['fill']:.1%}.\n",
            f"The same documents in as many steps (padded batches of {same_steps} documents, "
            f"{matched['steps']} steps; packed {packed['steps']} steps) reach a held-out loss of "
            f"{matched['held_out_loss']:.3f} padded and {packed['held_out_loss']:.3f} packed. "
            f"Padded batches of {ROWS} take {padded['steps']} smaller steps over the same "
            "tokens (another optimisation: more updates).\n",
            "Training loss by tenth of the epoch's tokens:\n",
            table(
                [
                    "tokens seen",
                    f"padded, {same_steps} a batch",
                    "packed",
                    f"padded, {ROWS} a batch",
                ],
                curve,
                align="lrrr",
            ),  # fmt: skip
            "\n" + provenance(env, command),
        ]
    )
    data_out = {
        "documents": count, "row_length": ROW, "rows_per_batch": ROWS, "median_length": median,
        "longest": max(lengths), "ratio_tokens_per_s": ratio_wall,
        "ratio_tokens_per_cpu_s": ratio_cpu, "same_steps_batch": same_steps, "runs": runs, "environment": env, "command": command,
    }  # fmt: skip
    default = ROOT / "benchmarks" / "results" / ("packing_quick" if args.quick else "packing")
    save_results(args.out or default, text, data_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
