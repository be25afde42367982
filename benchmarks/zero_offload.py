"""ZeRO-Offload: the device-side memory peak with and without offload, and the largest model
that trains inside a 24 GiB cap.

CPU mode (default, no GPU needed; figures from the memory estimate, fake tensors):
  1. TinyGPT (the demo, batch 16 x 128, fp32 AdamW): device peak and host bytes for plain
     Lightning, ZeROOffload without offload, stage 2 with CPU offload, stage 3 with parameter
     offload. Offloaded state counts as host memory (``ZeROOffload.configure_estimate``).
  2. GPT-2-shaped models (TinyGPT with vocabulary 50257, context 1024, head size 64) at batch
     1 x 1024, fp32: the largest of a ladder of sizes whose estimated device peak (CUDA
     allocator rounding) fits the cap, for each setting. --quick tries GPT-2 124M only.
  3. Host memory: what DeepSpeed really allocates on the host for a model of 8 Linear(1024, 1024)
     layers (8.4M parameters, fp32 AdamW), from a real ZeRO run on the CPU (gloo, one process,
     2 steps): the growth of live tensor bytes and of resident memory (RSS) over
     ``deepspeed.initialize`` and the steps, next to the memory estimate's host bytes and
     DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs`` / ``..._zero3_...``,
     with and without their 1.5x buffer factor). Each setting runs in a fresh process.
GPU mode (--gpu; needs CUDA): the same ladder trained for real, 2 steps each, with plain
  Lightning and with ZeROOffload stage 2 and stage 3 under
  ``torch.cuda.set_per_process_memory_fraction(cap / total)``; each size runs in a fresh
  subprocess and the largest that trains (no OOM) is reported. Host RAM bounds the largest
  offloaded model (about 20-24 bytes per parameter on the host at fp32, table 3).

Run:  python -m benchmarks.zero_offload           (CPU estimates, a few minutes on 2 cores)
      python -m benchmarks.zero_offload --quick   (TinyGPT table, GPT-2 124M only, host table)
      python -m benchmarks.zero_offload --gpu     (real training on a CUDA device)
Writes benchmarks/results/zero_offload{,_quick,_gpu}.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import QUIET_TRAINER, save_results
from benchmarks._results import environment as base_environment
from lightning_efficient.core.validate import parse_bytes

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
#: GPT-2 / GPT-3 shapes: (name, n_layer, n_embd); head size 64
LADDER = [
    ("124M", 12, 768),
    ("350M", 24, 1024),
    ("774M", 36, 1280),
    ("1.5B", 48, 1600),
    ("2.7B", 32, 2560),
    ("6.7B", 32, 4096),
    ("13B", 40, 5120),
]
SETTINGS: dict[str, dict[str, Any] | None] = {
    "plain Lightning": None,
    "ZeROOffload stage 2 (optimizer on CPU)": {"stage": 2},
    "ZeROOffload stage 3 (optimizer + parameters on CPU)": {"stage": 3, "offload_parameters": True},
}


def gpt(n_layer: int, n_embd: int, device: str = "meta"):
    from lightning_efficient.demos import TinyGPT

    with torch.device(device):
        return TinyGPT(
            vocab_size=50257,
            seq_len=1024,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_embd // 64,
            dropout=0.0,
        )


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def environment() -> dict[str, str]:
    env = base_environment(("torch", "lightning", "deepspeed"))
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


# -- CPU mode: the estimate ------------------------------------------------------------------------
def estimate(
    model: torch.nn.Module, batch: Any, setting: dict[str, Any] | None, rounding: bool
) -> Any:
    from lightning_efficient.measure.memory.estimate import estimate_memory
    from lightning_efficient.techniques.zero_offload import ZeROOffload

    callbacks: list[Any] = [] if setting is None else [ZeROOffload(**setting)]
    return estimate_memory(model, batch, callbacks=callbacks, cuda_rounding=rounding)


def tinygpt_table() -> list[dict[str, Any]]:
    from lightning_efficient.demos import TinyGPT

    model = TinyGPT(dropout=0.0)
    batch = (torch.zeros(16, 128, dtype=torch.long),) * 2
    settings = {
        "plain Lightning": None,
        "ZeROOffload, no offload": {"offload_optimizer": None},
        **{k: v for k, v in SETTINGS.items() if v},
    }
    rows, base = [], None
    for name, setting in settings.items():
        est = estimate(model, batch, setting, rounding=False)
        base = base or est.peak_bytes
        rows.append(
            {
                "setting": name,
                "device_peak_bytes": est.peak_bytes,
                "host_bytes": est.host_bytes,
                "parameters_bytes": est.by_category["parameters"],
                "gradients_bytes": est.by_category["gradients"],
                "optimizer_state_bytes": est.by_category["optimizer_state"],
                "activations_bytes": est.by_category["activations"]
                + est.by_category["temporaries"],
                "device_peak_ratio": est.peak_bytes / base,
            }
        )
    return rows


def ladder_estimates(cap: int, quick: bool) -> list[dict[str, Any]]:
    ladder = LADDER[:1] if quick else LADDER
    batch = (torch.zeros(1, 1024, dtype=torch.long, device="meta"),) * 2
    rows = []
    best: int | None = None
    for name, setting in SETTINGS.items():
        tried = []
        # each setting keeps at least as little on the device as the one before: a size the
        # previous one fit fits here too, so start one size above it
        for i in range(0 if quick or best is None else best + 1, len(ladder)):
            label, n_layer, n_embd = ladder[i]
            model = gpt(n_layer, n_embd)
            t = time.perf_counter()
            est = estimate(model, batch, setting, rounding=True)
            tried.append(
                {
                    "model": label,
                    "parameters": n_params(model),
                    "device_peak_bytes": est.peak_bytes,
                    "host_bytes": est.host_bytes,
                    "fits": est.peak_bytes <= cap,
                    "estimate_s": time.perf_counter() - t,
                }
            )
            if est.peak_bytes > cap:
                break
            best = i
        largest = None if best is None else ladder[best]
        rows.append(
            {
                "setting": name,
                "largest": largest[0] if largest else None,
                "largest_parameters": n_params(gpt(largest[1], largest[2])) if largest else 0,
                "tried": tried,
            }
        )
    base = rows[0]["largest_parameters"] or 1
    for r in rows:
        r["parameters_ratio"] = r["largest_parameters"] / base
    return rows


# -- CPU mode: host memory of a real DeepSpeed run -------------------------------------------------
HOST_SETTINGS = {
    "stage 2, optimizer offload": {"stage": 2},
    "stage 3, optimizer + parameter offload": {"stage": 3, "offload_parameters": True},
}


def _host_once(setting_name: str, width: int = 1024, layers: int = 8) -> dict[str, Any]:
    """Child process: one ZeRO setting trained for 2 steps on the CPU; host bytes it allocated.

    Measured over ``deepspeed.initialize`` + 2 steps, after the model, the process group and
    DeepSpeed's CPU Adam exist: the growth of live CPU tensor bytes (unique storages reachable
    from Python) and of the resident set (after ``malloc_trim``). On a CPU, DeepSpeed's
    "device" buffers are host memory too: the measured growth also holds one gradient bucket
    and, at stage 2, one parameter-sized device buffer; with parameter offload the parameters'
    host partition replaces the module's own storage (counted before), so the estimate is
    compared without its parameter bytes.
    """
    import ctypes
    import gc
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import deepspeed
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from torch import nn

    from lightning_efficient.measure.memory.estimate import estimate_memory
    from lightning_efficient.techniques.zero_offload import (
        ZeROOffload,
        ensure_extensions,
        scale_buckets,
        to_deepspeed_optimizer,
        zero_offload_config,
    )

    libc = ctypes.CDLL("libc.so.6")

    def rss() -> int:
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def live() -> int:
        storages = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance on lazily imported modules may warn
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def train(model: nn.Module, config: dict[str, Any], x: torch.Tensor) -> Any:
        optimizer = to_deepspeed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for _ in range(2):
            loss = engine(x).sum()
            engine.backward(loss)
            engine.step()
        return engine

    setting = HOST_SETTINGS[setting_name]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width)
    est = estimate_memory(
        model, x, callbacks=[ZeROOffload(**setting)], loss_fn=lambda m, b: m(b).sum()
    )
    ensure_extensions()
    deepspeed.init_distributed(dist_backend="gloo")
    config = scale_buckets(zero_offload_config(**setting), n)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    # once per process, DeepSpeed's first engine maps buffers and thread pools whose size does
    # not depend on the model: pay them on a tiny model first, and report them apart
    tiny = nn.Sequential(nn.Linear(8, 8))
    t0 = rss()
    warm = train(tiny, config, torch.randn(4, 8))
    t1 = rss()
    model(x).sum().backward()  # autograd's own first-use allocations, outside the measurement
    model.zero_grad(set_to_none=True)
    r0, l0 = rss(), live()
    engine = train(model, config, x)
    r1, l1 = rss(), live()
    del warm, engine
    stage3 = setting["stage"] == 3
    offp = setting.get("offload_parameters", False)
    if stage3:
        largest = width * width + width
        ds = estimate_zero3_model_states_mem_needs(
            n, largest, 1, 1, cpu_offload=True, cpu_offload_params=offp, zero_init=False
        )
        ds_base = estimate_zero3_model_states_mem_needs(
            n, largest, 1, 1, True, offp, False, additional_buffer_factor=1.0
        )
    else:
        ds = estimate_zero2_model_states_mem_needs(n, 1, 1, cpu_offload=True)
        ds_base = estimate_zero2_model_states_mem_needs(n, 1, 1, True, additional_buffer_factor=1.0)
    compared = est.host_bytes - (4 * n if offp else 0)
    return {
        "setting": setting_name,
        "parameters": n,
        "estimate_host_bytes": est.host_bytes,
        "estimate_compared_bytes": compared,
        "deepspeed_estimator_bytes": ds[0],
        "deepspeed_estimator_base_bytes": ds_base[0],
        "live_growth_bytes": l1 - l0,
        "rss_growth_bytes": r1 - r0,
        "rss_once_per_process_bytes": t1 - t0,
    }


def host_table() -> list[dict[str, Any]]:
    rows = []
    for name in HOST_SETTINGS:
        proc = subprocess.run(
            [sys.executable, __file__, "--child-host", name],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"host measurement of {name!r} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][7:]))
        print(f"  host: {name} measured", flush=True)
    return rows


# -- GPU mode: real training ---------------------------------------------------------------------
def _train_once(args: argparse.Namespace) -> None:
    """Child process: train one (size, setting) for 2 steps under the cap; print a JSON line."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_efficient.techniques.zero_offload import ZeROOffload

    cap = parse_bytes("cap", args.cap)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    label, n_layer, n_embd = next(x for x in LADDER if x[0] == args.child_size)
    setting = SETTINGS[args.child_setting]
    model = gpt(n_layer, n_embd, device="cpu")
    ids = torch.randint(0, 50257, (4, 1024))
    data = DataLoader(TensorDataset(ids, ids), batch_size=1)
    strategy = "auto" if setting is None else ZeROOffload(**setting)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=2,
        **QUIET_TRAINER,
    )
    result = {"model": label, "parameters": n_params(model), "setting": args.child_setting}
    try:
        t = time.perf_counter()
        trainer.fit(model, train_dataloaders=data)
        result.update(ok=trainer.global_step == 2, step_s=(time.perf_counter() - t) / 2)
    except Exception as err:  # OOM (torch.OutOfMemoryError, or DeepSpeed's RuntimeError) or other
        result.update(
            ok=False,
            error=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}",
        )
    result["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    print("RESULT " + json.dumps(result), flush=True)


def ladder_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    start = 0
    for name in SETTINGS:
        best, tried = None, []
        for i in range(start, len(LADDER)):
            cmd = [
                sys.executable,
                __file__,
                "--child-size",
                LADDER[i][0],
                "--child-setting",
                name,
                "--cap",
                args.cap,
                "--precision",
                args.precision,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = (
                json.loads(lines[-1][7:])
                if lines
                else {
                    "model": LADDER[i][0],
                    "ok": False,
                    "error": (proc.stderr or "no result")[-300:],
                }
            )
            tried.append(res)
            print(
                f"  {name}: {LADDER[i][0]} -> {'trains' if res.get('ok') else 'fails'}", flush=True
            )
            if not res.get("ok"):
                break
            best = i
        if best is not None:
            start = best
        rows.append(
            {
                "setting": name,
                "largest": LADDER[best][0] if best is not None else None,
                "largest_parameters": tried[best - start]["parameters"] if best is not None else 0,
                "tried": tried,
            }
        )
    base = rows[0]["largest_parameters"] or 1
    for r in rows:
        r["parameters_ratio"] = r["largest_parameters"] / base
    return rows


# -- output ----------------------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / GIB:.3f}" if n < GIB else f"{n / GIB:.2f}"


def markdown(result: dict[str, Any]) -> str:
    out = [
        f"# ZeRO-Offload ({result['mode']})",
        "",
        f"Command: `{result['command']}`",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in result["environment"].items()),
        "",
    ]
    if "tinygpt" in result:
        out += [
            "## TinyGPT (demo), batch 16 x 128, fp32 AdamW: memory estimate",
            "",
            "| Setting | Device peak (MiB) | Host (MiB) | Params | Grads | Optimizer state | Activations + temps | Device peak vs plain |",
            "|---|---|---|---|---|---|---|---|",
        ]
        mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
        for r in result["tinygpt"]:
            out.append(
                f"| {r['setting']} | {mib(r['device_peak_bytes'])} | {mib(r['host_bytes'])} | {mib(r['parameters_bytes'])} | "
                f"{mib(r['gradients_bytes'])} | {mib(r['optimizer_state_bytes'])} | {mib(r['activations_bytes'])} | {r['device_peak_ratio']:.3f}x |"
            )
        out.append("")
    if result.get("host"):
        per = lambda r, k: r[k] / r["parameters"]  # noqa: E731
        out += [
            "## Host memory of a real DeepSpeed run on the CPU (8 x Linear(1024, 1024), "
            f"{result['host'][0]['parameters'] / 1e6:.1f}M parameters, fp32 AdamW, 2 steps), "
            "bytes per parameter",
            "",
            "| Setting | Estimate: host | Estimate: compared | Measured: live tensors | "
            "Measured: RSS | DeepSpeed estimator (x1.5 buffers) | DeepSpeed estimator, base |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["host"]:
            out.append(
                f"| {r['setting']} | {per(r, 'estimate_host_bytes'):.1f} | "
                f"{per(r, 'estimate_compared_bytes'):.1f} | {per(r, 'live_growth_bytes'):.1f} | "
                f"{per(r, 'rss_growth_bytes'):.1f} | {per(r, 'deepspeed_estimator_bytes'):.1f} | "
                f"{per(r, 'deepspeed_estimator_base_bytes'):.1f} |"
            )
        out += [
            "",
            "DeepSpeed's first engine in a process also maps about "
            f"{result['host'][0]['rss_once_per_process_bytes'] / 2**20:.0f} MiB that do not depend "
            "on the model (measured on a tiny model first, not in the table). "
            "Compared: the estimate's host bytes without the parameters when they are offloaded "
            "(their host partition replaces the module's own storage, which existed before the "
            "measurement). Measured: growth over `deepspeed.initialize` + 2 steps; on a CPU it "
            "also holds DeepSpeed's device-side buffers (one gradient bucket, one parameter-sized "
            "buffer at stage 2).",
            "",
        ]
    if result.get("ladder"):
        src = (
            "trained for real"
            if result["mode"] == "gpu"
            else "memory estimate, CUDA allocator rounding"
        )
        out += [
            f"## Largest GPT-2-shaped model at batch 1 x 1024 inside {result['cap']} ({src}, {result['precision']})",
            "",
            "| Setting | Largest that fits | Parameters | vs plain | Sizes tried above the previous row's (device peak GiB / fits) |",
            "|---|---|---|---|---|",
        ]
        for r in result["ladder"]:
            key = "device_peak_bytes" if result["mode"] != "gpu" else "max_allocated_bytes"
            tried = (
                "; ".join(
                    f"{t['model']} {gib(t.get(key, 0))} {'yes' if t.get('fits', t.get('ok')) else 'no'}"
                    for t in r["tried"]
                )
                or "(nothing larger on the ladder)"
            )
            top = " (ladder top)" if r["largest"] == LADDER[-1][0] else ""
            out.append(
                f"| {r['setting']} | {(r['largest'] or 'none') + top} | {r['largest_parameters'] / 1e6:,.0f}M | {r['parameters_ratio']:.1f}x | {tried} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="TinyGPT table and GPT-2 124M only")
    parser.add_argument(
        "--gpu", action="store_true", help="train the ladder for real on a CUDA device"
    )
    parser.add_argument("--cap", default="24GiB", help="device memory cap (default 24GiB)")
    parser.add_argument("--precision", default="32-true", help="GPU mode: Trainer precision")
    parser.add_argument("--timeout", type=int, default=1800, help="GPU mode: seconds per size")
    parser.add_argument("--child-size", help=argparse.SUPPRESS)
    parser.add_argument("--child-setting", help=argparse.SUPPRESS)
    parser.add_argument("--child-host", help=argparse.SUPPRESS)
    parser.add_argument("--host-width", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=None,
        help="result stem (default benchmarks/results/zero_offload{,_quick,_gpu})",
    )
    args = parser.parse_args()
    if args.child_size:
        return _train_once(args)
    if args.child_host:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        print("RESULT " + json.dumps(_host_once(args.child_host, args.host_width)), flush=True)
        return None
    cap = parse_bytes("--cap", args.cap)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    command = (
        "python -m benchmarks.zero_offload"
        + (" --quick" if args.quick else "")
        + (" --gpu" if args.gpu else "")
    )
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit(
                "error: --gpu needs a CUDA device; run without --gpu for the CPU estimates"
            )
        result = {
            "mode": "gpu",
            "cap": args.cap,
            "precision": args.precision,
            "command": command,
            "environment": environment(),
            "ladder": ladder_gpu(args),
        }
        suffix = "_gpu"
    else:
        t = time.perf_counter()
        result = {
            "mode": "cpu estimate",
            "cap": args.cap,
            "precision": "32-true",
            "command": command,
            "environment": environment(),
            "tinygpt": tinygpt_table(),
            "ladder": ladder_estimates(cap, args.quick),
            "host": host_table(),
        }
        result["seconds"] = time.perf_counter() - t
        suffix = "_quick" if args.quick else ""
    stem = args.out or ROOT / "benchmarks" / "results" / f"zero_offload{suffix}"
    md, js = save_results(stem, markdown(result), result)
    print(f"saved {md} and {js}")


if __name__ == "__main__":
    main()
