"""How close the memory estimate is, per model family, to two real measurements on the CPU.

For each model (random init, built from small configs, no download) two real training steps'
worth of work is measured: one AdamW step on a fresh model, run for real on the CPU
(``measure.memory.allocator.allocator_step_peak``). Columns:

- estimate: ``estimate_memory`` (fake tensors) of the same step;
- tracked: the storage tracker on the real step (what ``measure_step`` reports; it sees the
  tensors operators return, as the estimate does);
- allocator: the CPU allocator's own peak, from ``torch.profiler`` memory events (it also sees
  what kernels allocate and free inside one operator);
- "without value checks": the estimate with transformers' SDPA mask checks left to answer as they
  do on fake tensors ("tracing": the batch x 1 x seq x seq mask is built), i.e. before this
  package answered them from the batch's values.

Run:  python -m benchmarks.estimate_accuracy          (~2 minutes on 2 cores)
      python -m benchmarks.estimate_accuracy --quick  (sequence 128)
Writes benchmarks/results/estimate_accuracy{,_quick}.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._results import environment, provenance, save_results, table
from lightning_efficient.measure import estimate_memory
from lightning_efficient.measure.memory import estimate as estimate_module
from lightning_efficient.measure.memory.allocator import allocator_step_peak

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20


class ConvBN(nn.Module):
    """A ResNet-like CNN: conv + BatchNorm + ReLU stages with a residual block."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()

        def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
            )

        self.stem = stage(3, width, 1)
        self.block = nn.Sequential(stage(width, width, 1), stage(width, width, 1))
        self.down = stage(width, 2 * width, 2)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.block(x)
        return self.head(self.down(x).mean((2, 3)))


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _lm(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, labels=batch["input_ids"]).loss


def _t5(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def _vit(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


def cases(seq: int) -> list[tuple[str, str, Callable[[], nn.Module], Any, Callable]]:
    import transformers as tf

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, seq), generator=g)
    ones = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    padded_mask = torch.ones_like(ids)
    padded_mask[0, -seq // 4 :] = 0
    padded = {"input_ids": ids, "attention_mask": padded_mask}
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}

    def mistral() -> nn.Module:
        cfg = tf.MistralConfig(
            **small,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=seq,
            sliding_window=None,
        )
        return tf.MistralForCausalLM(cfg)

    def bert(dropout: float) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            cfg = tf.BertConfig(
                **small,
                num_attention_heads=4,
                vocab_size=256,
                max_position_embeddings=seq,
                attention_probs_dropout_prob=dropout,
            )
            return tf.BertForMaskedLM(cfg)

        return build

    def t5() -> nn.Module:
        cfg = tf.T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        return tf.T5ForConditionalGeneration(cfg)

    def vit() -> nn.Module:
        cfg = tf.ViTConfig(
            **small, num_attention_heads=4, image_size=64, patch_size=8, num_labels=10
        )
        return tf.ViTForImageClassification(cfg)

    images = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))
    return [
        ("CNN (conv + BatchNorm)", "ResNet-like, 8 x 3 x 64 x 64", ConvBN, images, _ce),
        (
            "decoder LM, SDPA",
            f"Mistral, 2 x {seq}, input ids only",
            mistral,
            {"input_ids": ids},
            _lm,
        ),
        ("decoder LM, SDPA", f"Mistral, 2 x {seq}, mask of ones", mistral, ones, _lm),
        ("decoder LM, SDPA", f"Mistral, 2 x {seq}, padded", mistral, padded, _lm),
        ("BERT, SDPA", f"BERT, 2 x {seq}, mask of ones, dropout 0", bert(0.0), ones, _lm),
        ("BERT, SDPA", f"BERT, 2 x {seq}, mask of ones, dropout 0.1", bert(0.1), ones, _lm),
        ("encoder-decoder", f"T5, 2 x {seq}", t5, {"input_ids": ids}, _t5),
        ("vision transformer, SDPA", "ViT, 8 x 3 x 64 x 64, patch 8", vit, images, _vit),
    ]


@contextlib.contextmanager
def without_value_checks() -> Iterator[None]:
    """The estimate as it was before: transformers' mask checks see only fake tensors."""
    saved = estimate_module.hf_mask_checks_on_values

    @contextlib.contextmanager
    def untouched(pairs: Any) -> Iterator[list[str]]:
        yield []

    estimate_module.hf_mask_checks_on_values = untouched
    try:
        yield
    finally:
        estimate_module.hf_mask_checks_on_values = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequence 128")
    parser.add_argument(
        "--out",
        default=None,
        help="result stem (default benchmarks/results/estimate_accuracy{,_quick})",
    )
    args = parser.parse_args()
    seq = 128 if args.quick else 512
    torch.set_num_threads(2)
    rows = []
    for family, what, build, batch, loss_fn in cases(seq):
        torch.manual_seed(0)
        model = build()
        est = estimate_memory(model, batch, loss_fn=loss_fn, steps=1)
        with without_value_checks():
            before = estimate_memory(model, batch, loss_fn=loss_fn, steps=1)
        tracked, allocator = allocator_step_peak(
            copy.deepcopy(model), batch, loss_fn=loss_fn, steps=1
        )
        row = {
            "family": family,
            "model": what,
            "estimate_bytes": est.peak_bytes,
            "tracked_bytes": tracked.peak_bytes,
            "allocator_bytes": allocator,
            "estimate_over_tracked": est.peak_bytes / tracked.peak_bytes,
            "estimate_over_allocator": est.peak_bytes / allocator,
            "before_over_tracked": before.peak_bytes / tracked.peak_bytes,
            "notes": est.notes,
        }
        rows.append(row)
        print(
            f"{what}: estimate {est.peak_bytes} tracked {tracked.peak_bytes} allocator "
            f"{allocator} ({row['estimate_over_allocator']:.3f}, before {row['before_over_tracked']:.3f})",
            flush=True,
        )
    env = environment()
    env["torch threads"] = str(torch.get_num_threads())
    env["load average"] = f"{os.getloadavg()[0]:.1f}"
    text = "\n".join(
        [
            f"### Estimate vs real CPU steps, per model family (one AdamW step, sequence {seq})",
            "",
            table(
                [
                    "Family",
                    "Model",
                    "Estimate (MiB)",
                    "Tracked (MiB)",
                    "Allocator (MiB)",
                    "Estimate / tracked",
                    "Estimate / allocator",
                    "Without value checks / tracked",
                ],
                [
                    [
                        r["family"],
                        r["model"],
                        f"{r['estimate_bytes'] / MIB:.2f}",
                        f"{r['tracked_bytes'] / MIB:.2f}",
                        f"{r['allocator_bytes'] / MIB:.2f}",
                        f"{r['estimate_over_tracked']:.3f}",
                        f"{r['estimate_over_allocator']:.3f}",
                        f"{r['before_over_tracked']:.3f}",
                    ]
                    for r in rows
                ],
                align="llrrrrrr",
            ),
            "",
            provenance(env),
            "Command: `python -m benchmarks.estimate_accuracy"
            + (" --quick`." if args.quick else "`."),
        ]
    )
    stem = args.out or (
        ROOT
        / "benchmarks"
        / "results"
        / ("estimate_accuracy_quick" if args.quick else "estimate_accuracy")
    )
    save_results(stem, text, {"environment": env, "sequence": seq, "rows": rows})


if __name__ == "__main__":
    main()
