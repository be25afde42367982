"""The quality gate of bf16 weights: is a compensated optimizer as good as fp32 masters here?

A small language model (TinyGPT) is pretrained briefly on the pydoc corpus with fp32 AdamW, then
fine-tuned from that start at a fine-tuning learning rate (1e-4 and 2e-5, constant) by:

- ``bf16-mixed`` + AdamW: fp32 weights (masters), bf16 autocast: the reference;
- ``bf16-true`` + plain AdamW: bf16 weights, each update rounded to nearest;
- ``bf16-true`` + ``adamw_kahan`` / ``adamw_sr`` / ``adamw8bit_sr`` (built by the same
  ``build_optimizer`` that ``OptimizerSwap`` uses).

It reports the held-out loss (the corpus' last 10%) against the reference's, and how far the
norm weights (the LayerNorm gains, near 1.0) moved during fine-tuning against the reference's
movement. Then the memory: weights + gradients + optimizer states per parameter measured on the
CPU (real steps under the storage tracker), the CPU estimate against that measurement, and the
CUDA-target estimate of a 1B-parameter Llama shape (full fine-tuning, seq 2048, checkpointing,
chunked loss) for each form.

torchao's stochastic rounding compiles its step per parameter shape (``torch.compile`` on the
CPU); the compile time is measured and reported apart from the steady step time.

    python -m benchmarks.bf16_weights            # ~5 minutes on 2 CPU cores
    python -m benchmarks.bf16_weights --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import environment, save_results, table, version_of
from lightning_efficient.demos import TextDataModule, TinyGPT
from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.targets import DeviceTarget
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.techniques.optimizers import OptimizerSwap, build_optimizer

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
#: label -> (weights dtype, optimizer name); the first is the reference
FORMS: dict[str, tuple[torch.dtype, str]] = {
    "bf16-mixed + AdamW (fp32 masters)": (torch.float32, "adamw"),
    "bf16-true + AdamW (nearest rounding)": (torch.bfloat16, "adamw"),
    "bf16-true + adamw_kahan": (torch.bfloat16, "adamw_kahan"),
    "bf16-true + adamw_sr": (torch.bfloat16, "adamw_sr"),
    "bf16-true + adamw8bit_sr": (torch.bfloat16, "adamw8bit_sr"),
}
MODEL = dict(n_layer=2, n_embd=64, n_head=4, seq_len=32, dropout=0.0)
TARGET = DeviceTarget("cuda", (9, 0), (2, 11), name="H100")
LLAMA_1B = dict(  # the Llama-3.2-1B shape
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def _batches(split: str, n: int, batch: int, seed: int) -> list[torch.Tensor]:
    data = TextDataModule(batch_size=batch, seq_len=MODEL["seq_len"], seed=seed)
    data.setup("fit")
    loader = data.train_dataloader() if split == "train" else data.val_dataloader()
    out = []
    for x, _ in loader:
        out.append(x)
        if len(out) == n:
            break
    return out


def _loss(model: TinyGPT, x: torch.Tensor, mixed: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        logits = model(x[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())


def _norm_weights(model: TinyGPT) -> torch.Tensor:
    return torch.cat(
        [
            p.detach().float().flatten()
            for n, p in model.named_parameters()
            if p.dim() == 1 and n.endswith("weight")
        ]
    )


def pretrain(steps: int, train: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(steps):
        loss = _loss(model, train[i % len(train)], False)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def finetune(
    start: dict[str, torch.Tensor], dtype: torch.dtype, name: str, lr: float, steps: int, train, val
) -> dict[str, Any]:
    model = TinyGPT(**MODEL)
    model.load_state_dict(start)
    model.to(dtype)
    mixed = dtype == torch.float32
    before = _norm_weights(model)
    opt = build_optimizer(name, model.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.perf_counter()
    first = None
    for i in range(steps):
        loss = _loss(model, train[i % len(train)], mixed)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 0:
            first = time.perf_counter() - t0
    rest = (time.perf_counter() - t0 - first) / max(steps - 1, 1)
    with torch.no_grad():
        held_out = sum(float(_loss(model, x, mixed)) for x in val) / len(val)
    after = _norm_weights(model)
    return {
        "held_out_loss": held_out,
        "norm_movement": float((after - before).abs().mean()),
        "norm_frozen_share": float((after == before).float().mean()),
        "norm_drift_from_one": float((after - 1).abs().mean()),
        "first_step_s": round(first, 2),
        "step_ms": round(1e3 * rest, 1),
    }


def quality(pre_steps: int, steps: int, lrs: tuple[float, ...]) -> list[dict[str, Any]]:
    train = _batches("train", 64, 8, seed=0)
    val = _batches("val", 8, 32, seed=0)
    start = pretrain(pre_steps, train)
    rows = []
    for lr in lrs:
        ref = None
        for label, (dtype, name) in FORMS.items():
            r = finetune(start, dtype, name, lr, steps, train[32:] + train[:32], val)
            ref = ref or r
            r.update(
                form=label,
                lr=lr,
                loss_vs_reference=r["held_out_loss"] / ref["held_out_loss"] - 1,
                movement_vs_reference=r["norm_movement"] / ref["norm_movement"],
            )
            rows.append(r)
            print(
                f"  lr {lr:g} {label}: held-out {r['held_out_loss']:.4f} "
                f"({r['loss_vs_reference']:+.2%}), norm movement x{r['movement_vs_reference']:.2f}, "
                f"first step {r['first_step_s']} s, step {r['step_ms']} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def memory() -> list[dict[str, Any]]:
    x = torch.randint(0, 256, (2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(0))
    n = sum(p.numel() for p in TinyGPT(**MODEL).parameters())
    rows = []
    for label, (dtype, name) in FORMS.items():
        precision = "bf16-mixed" if dtype == torch.float32 else "bf16-true"
        cbs = lambda: [] if name == "adamw" else [OptimizerSwap(name)]  # noqa: E731
        torch.manual_seed(0)
        est = estimate_memory(TinyGPT(**MODEL), (x, x), precision=precision, callbacks=cbs())
        real = measure_step(TinyGPT(**MODEL), (x, x), precision=precision, callbacks=cbs())
        held = sum(real.by_category[c] for c in ("parameters", "gradients", "optimizer_state"))
        rows.append(
            {
                "form": label,
                "bytes_per_parameter": held / n,
                "measured_peak": real.peak_bytes,
                "estimated_peak": est.peak_bytes,
                "estimate_error": est.peak_bytes / real.peak_bytes - 1,
                "llama_1b_cuda": llama_1b(precision, name),
            }
        )
        print(f"  {label}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def llama_1b(precision: str, name: str) -> dict[str, Any]:
    import transformers

    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing
    from lightning_efficient.techniques.chunked_loss import ChunkedCrossEntropy

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B, use_cache=False))
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    ids = torch.zeros((1, 2048), dtype=torch.long, device="meta")
    callbacks = [ActivationCheckpointing(), ChunkedCrossEntropy()]
    callbacks += [] if name == "adamw" else [OptimizerSwap(name)]
    est = estimate_memory(
        model,
        (ids,),
        loss_fn=lambda m, b: m(input_ids=b[0], labels=b[0]).loss,
        optimizer="adamw",
        precision=precision,
        callbacks=callbacks,
        device=TARGET,
    )
    return {"peak_bytes": est.peak_bytes, "by_category": dict(est.by_category)}


def to_markdown(env, quality_rows, memory_rows, command: str) -> str:
    q = table(
        [
            "lr",
            "form",
            "held-out loss",
            "vs reference",
            "norm weights moved (x reference)",
            "norm weights unmoved",
            "first step (s)",
            "step (ms)",
        ],
        [
            [
                f"{r['lr']:g}",
                r["form"],
                f"{r['held_out_loss']:.4f}",
                f"{r['loss_vs_reference']:+.2%}",
                f"{r['movement_vs_reference']:.2f}",
                f"{r['norm_frozen_share']:.0%}",
                r["first_step_s"],
                r["step_ms"],
            ]
            for r in quality_rows
        ],
        "llrrrrrr",
    )
    m = table(
        [
            "form",
            "weights+grads+states (B/param)",
            "CPU peak, measured",
            "CPU estimate error",
            "1B Llama, CUDA estimate (GiB)",
        ],
        [
            [
                r["form"],
                f"{r['bytes_per_parameter']:.2f}",
                f"{r['measured_peak'] / 2**20:.1f} MiB",
                f"{r['estimate_error']:+.2%}",
                f"{r['llama_1b_cuda']['peak_bytes'] / GIB:.2f}",
            ]
            for r in memory_rows
        ],
        "lrrrr",
    )
    return "\n".join(
        [
            "# bf16 weights: the quality gate and the memory",
            "",
            f"`{command}`; {env.get('host')}, torch {version_of('torch')}, torchao "
            f"{version_of('torchao')}, torch-optimi {version_of('torch-optimi')}.",
            f"Model: TinyGPT {MODEL}; pretrained with fp32 AdamW (lr 3e-3), then fine-tuned at a "
            "constant lr, weight decay 0. Held-out loss: the corpus' last 10%.",
            "",
            q,
            "",
            "Memory (weights + gradients + optimizer states measured on the CPU; the estimate "
            "against the measured peak; the CUDA-target estimate (H100) of a 1B Llama shape, "
            "full fine-tuning, seq 2048, checkpointing, chunked loss):",
            "",
            m,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--out", default=None, help="result stem")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # 2 threads on 2 shared, loaded cores ran 50x slower
    pre, steps = (60, 30) if args.quick else (200, 200)
    print("quality ...", file=sys.stderr)
    quality_rows = quality(pre, steps, (1e-4, 2e-5))
    print("memory ...", file=sys.stderr)
    memory_rows = memory()
    env = environment((*__import__("_results").PACKAGES, "torchao", "torch-optimi"))
    command = "python -m benchmarks.bf16_weights" + (" --quick" if args.quick else "")
    md = to_markdown(env, quality_rows, memory_rows, command)
    stem = args.out or RESULTS / ("bf16_weights_quick" if args.quick else "bf16_weights")
    save_results(
        stem,
        md,
        {
            "environment": env,
            "model": MODEL,
            "pretrain_steps": pre,
            "steps": steps,
            "quality": quality_rows,
            "memory": memory_rows,
            "command": command,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
