"""StepProfiler: phases, FLOPs, MFU, memory and the verdict, on real (tiny) CPU fits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from helpers import fit, no_collector, tiny_trainer
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.workloads import TinyHFGPT2, tiny_data, tiny_model
from lightning_efficient.commands import EXTRA_COMMANDS, main
from lightning_efficient.core.report import report_for
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure import MemoryBreakdown, StepProfiler, estimate_memory
from lightning_efficient.measure.profiling.advice import Findings, advise
from lightning_efficient.measure.profiling.profiler import PHASES, phase_summary
from lightning_efficient.measure.speed.flops import compute_dtype, count_flops, gpu_peak

ROOT = Path(__file__).parents[3]
PLAIN = ROOT / "configs" / "demo_plain.yaml"


# -- phases ----------------------------------------------------------------------------------
class StepClock(Callback):
    """Wall clock at each train batch start and at the end of the last batch (an independent
    timer; the end of training would also count the profiler's one-off FLOP count)."""

    def __init__(self) -> None:
        self.starts: dict[int, float] = {}
        self.end = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.setdefault(trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def test_phases_sum_to_the_step_time(tmp_path) -> None:
    profiler, clock = StepProfiler(skip_steps=2, print_table=False), StepClock()
    with no_collector():  # a collection in the first measured fetch would be the clock's miss
        trainer, _, _ = fit(tmp_path, [profiler, clock], max_steps=10, limit_val_batches=0)
    s = profiler.summary
    assert s is not None and s["steps"] == 8 and s["fetch_seen"]
    assert set(s["phases"]) == set(PHASES)
    assert all(s["phases"][p] > 0 for p in PHASES), s["phases"]
    assert s["step_s"] == pytest.approx(sum(s["phases"].values()))
    # an independent clock over the same steps (it misses only the first measured fetch)
    wall = (clock.end - clock.starts[2]) / 8
    assert s["step_s"] == pytest.approx(wall, rel=0.05), (s["step_s"], wall)
    assert s["samples_per_s"] == pytest.approx(4 / s["step_s"], rel=1e-6)  # batch 4
    assert s["tokens_per_s"] == pytest.approx(4 * 32 / s["step_s"], rel=1e-6)  # 4 x 32 tokens
    assert 0 < s["data_wait_fraction"] < 1 and s["mfu"] is not None and 0 < s["mfu"] < 1


def test_phase_summary_is_per_step() -> None:
    totals = {"data": 2.0, "forward": 4.0, "backward": 8.0, "optimizer": 2.0, "validation": 9.0}
    assert phase_summary(totals, 4) == {
        "data": 0.5,
        "forward": 1.0,
        "backward": 2.0,
        "optimizer": 0.5,
        "rest": 0.0,
    }
    with pytest.raises(ValueError, match="steps"):
        phase_summary(totals, 0)


# -- FLOPs -----------------------------------------------------------------------------------
def test_mlp_flops_within_one_percent_of_6_params_samples() -> None:
    mlp = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    count = count_flops(
        mlp, (x, y), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    params = sum(p.numel() for p in mlp.parameters())
    assert count.step == 3 * count.forward
    assert count.step == pytest.approx(6 * params * 32, rel=0.01)
    assert count.ops > 0 and all(not p.is_meta for p in mlp.parameters())  # restored, real


class TinyMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4)
        )

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Blobs(Dataset):
    def __init__(self, n: int = 64, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)  # slow decoding or storage: wall time, no CPU
        return self.x[i], self.y[i]


def test_fit_flops_per_step_of_an_mlp(tmp_path) -> None:
    profiler = StepProfiler(skip_steps=1, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[profiler],
        default_root_dir=tmp_path,
    )
    model = TinyMLP()
    trainer.fit(model, DataLoader(Blobs(), batch_size=16))
    params = sum(p.numel() for p in model.parameters())
    assert profiler.summary["flops_per_step"] == pytest.approx(6 * params * 16, rel=0.01)
    assert profiler.summary["tokens_per_s"] is None  # float features, no token tensor


def test_transformer_flops_within_five_percent_of_analytic() -> None:
    batch, seq, d, layers, vocab = 8, 64, 64, 2, 256
    model = TinyGPT(seq_len=seq, n_layer=layers, n_embd=d, n_head=4, dropout=0.0)
    x = torch.zeros(batch, seq, dtype=torch.long)
    count = count_flops(model, (x, x))
    # 6 x (parameters of the matrix products: 12 d^2 per block, the tied head) x tokens, plus
    # attention: QK^T and AV, 2 x 2 x seq^2 x d per layer and sequence forward, x 3
    matmul_params = layers * 12 * d * d + vocab * d
    tokens = batch * seq
    analytic = 6 * matmul_params * tokens + 3 * layers * 4 * seq * seq * d * batch
    assert count.step == pytest.approx(analytic, rel=0.05)
    assert "aten.bmm" in count.by_op or any("attention" in k for k in count.by_op)


def test_gpu_peak_table_and_dtype() -> None:
    peak, source = gpu_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989.4e12 and "H100 SXM" in source and "datasheet" in source
    assert gpu_peak("NVIDIA H100 PCIe", "bf16")[0] == 756.5e12
    assert gpu_peak("NVIDIA H200", "fp8")[0] == 1978.9e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156e12
    assert gpu_peak("NVIDIA GeForce RTX 4090", "bf16")[0] == 165.2e12
    assert gpu_peak("NVIDIA L40S", "bf16")[0] == 362.05e12
    assert gpu_peak("NVIDIA L4", "bf16")[0] == 121e12
    assert gpu_peak("Tesla T4", "bf16") is None  # no bf16 tensor cores
    assert gpu_peak("Some Future GPU", "bf16") is None
    assert compute_dtype("bf16-mixed") == "bf16" and compute_dtype("16-mixed") == "fp16"
    assert compute_dtype("32-true", "cpu") == "fp32"


# -- the verdict -----------------------------------------------------------------------------
class SlowData(pl.LightningDataModule):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Blobs(delay_s=self.delay_s), batch_size=8)


def test_input_bound_run_gets_data_loading_advice_first(tmp_path) -> None:
    profiler = StepProfiler(skip_steps=1, print_table=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[profiler],
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyMLP(), datamodule=SlowData(delay_s=0.05))  # 400 ms of loading per batch
    s = profiler.summary
    assert s["data_wait_fraction"] > 0.5, s["phases"]
    first = s["advice"][0]
    assert (
        first["technique"] == "DataLoaderTuning" and "waits for the next batch" in first["reason"]
    )
    spec = yaml.safe_load(first["yaml"])
    assert spec["trainer"]["callbacks"][0]["class_path"] == "DataLoaderTuning"


class FetchesItsBatch(TinyMLP):
    """A ``training_step(self, dataloader_iter)`` that fetches its batch, then computes for
    ``step_s`` more (a sleep: wall time, as a device's work would be)."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        time.sleep(self.step_s)
        return super().training_step(batch, 0)


def test_the_fetch_a_step_makes_itself_is_the_data_phase(tmp_path) -> None:
    """With ``training_step(self, dataloader_iter)`` the loader's ``next`` runs inside the step:
    it opened the data phase, which then held the rest of the forward too (80 ms of loading and
    100 ms of forward read about 180 ms of data and 0 of forward). The fetch is the data phase
    until it returns, as InputStallMonitor times its wait (``StepFetch``)."""
    profiler = StepProfiler(skip_steps=1, print_table=False)
    trainer = tiny_trainer(tmp_path, [profiler], max_steps=5)
    with no_collector():
        trainer.fit(FetchesItsBatch(step_s=0.1), datamodule=SlowData(delay_s=0.01))  # 80 ms
    s = profiler.summary
    assert s["fetch_seen"] and s["steps"] == 4
    phases = s["phases"]
    assert phases["data"] >= 0.08 and phases["forward"] >= 0.1, phases  # each holds its sleep
    assert phases["data"] < phases["forward"], phases  # and not the other's


def test_balanced_run_gets_no_false_alarm(tmp_path) -> None:
    profiler = StepProfiler(skip_steps=2, print_table=False)
    model = tiny_model(seq_len=128, n_embd=128, n_head=4)
    fit(tmp_path, [profiler], model=model, data=tiny_data(seq_len=128, batch_size=8), max_steps=6)
    s = profiler.summary
    assert s["data_wait_fraction"] < 0.10
    assert s["memory"]["capacity_bytes"] is None  # a CPU has no device memory to advise on
    bottlenecks = {"DataLoaderTuning", "DevicePreload", "TorchCompile", "EfficientBatchSize"}
    bottlenecks |= {"ActivationCheckpointing", "OptimizerSwap", "ZeROOffload"}
    assert not bottlenecks & {a["technique"] for a in s["advice"]}, s["advice"]


def test_model_state_dominated_run_gets_memory_advice(tmp_path) -> None:
    model, data = tiny_model(seq_len=8, n_embd=128, n_head=4), tiny_data(seq_len=8, batch_size=2)
    x = torch.zeros(2, 8, dtype=torch.long)
    # the module's own AdamW (for-loop on a CPU): the estimate equals the measured peak
    est = estimate_memory(
        tiny_model(seq_len=8, n_embd=128, n_head=4), (x, x), optimizer=torch.optim.AdamW
    )
    budget = int(est.peak_bytes * 1.05)
    profiler = StepProfiler(skip_steps=1, memory_budget=budget, print_table=False)
    fit(
        tmp_path,
        [MemoryBreakdown(print_table=False), profiler],
        model=model,
        data=data,
        max_steps=3,
    )
    s = profiler.summary
    cats = s["memory"]["by_category"]
    model_state = cats["parameters"] + cats["gradients"] + cats["optimizer_state"]
    assert model_state > 0.5 * s["memory"]["peak_bytes"]
    assert s["memory"]["peak_bytes"] / budget > 0.85
    assert s["advice"][0]["technique"] == "OptimizerSwap", s["advice"]
    assert "adamw8bit" in s["advice"][0]["yaml"]
    assert "EfficientBatchSize" not in {a["technique"] for a in s["advice"]}  # no headroom


def test_advice_rules_order_and_filter() -> None:
    input_bound = Findings(data_wait_fraction=0.4, precision="32-true", bf16_speedup=2.0)
    assert [a.technique for a in advise(input_bound)] == [
        "DataLoaderTuning",
        "DevicePreload",
        "precision",
    ]
    # advice never names what is already on
    on = Findings(data_wait_fraction=0.4, active=frozenset({"DataLoaderTuning"}))
    assert [a.technique for a in advise(on)] == ["DevicePreload"]
    lowp = Findings(precision="bf16-mixed", bf16_speedup=None, active=frozenset({"precision"}))
    assert advise(lowp) == []
    cats = {"parameters": 10, "gradients": 10, "optimizer_state": 20, "activations": 200}
    tight = Findings(peak_bytes=95, capacity_bytes=100, by_category=cats)
    assert advise(tight)[0].technique == "ActivationCheckpointing"
    roomy = Findings(peak_bytes=40, capacity_bytes=100, by_category=cats)
    assert [a.technique for a in advise(roomy)] == ["EfficientBatchSize"]
    launch = Findings(mfu=0.05, seconds_per_op=5e-6)
    assert [a.technique for a in advise(launch)] == ["TorchCompile"]
    assert advise(Findings(mfu=0.05, seconds_per_op=5e-4)) == []
    shapes = Findings(recompiles=20, active=frozenset({"TorchCompile"}))
    assert [a.technique for a in advise(shapes)] == ["LengthBucketSampler"]
    assert advise(Findings()) == []


#: Findings that, together, make every rule give its advice (the test below checks they do).
EVERY_ADVICE = [
    Findings(data_wait_fraction=0.4, bf16_speedup=2.0, peak_bytes=95, capacity_bytes=100),
    Findings(
        device_type="cuda",
        data_wait_fraction=0.4,
        tf32=False,
        bf16_speedup=2.0,
        optimizer="AdamW",
        fused_optimizer=False,
        optimizer_fraction=0.2,
        mfu=0.05,
        seconds_per_op=5e-6,
        peak_bytes=40,
        capacity_bytes=100,
        micro_batch=4,
        accumulate=2,
        vocab_size=50257,
        logits_flops_fraction=0.3,
    ),
    Findings(device_type="cuda", compile_scope="regional", mfu=0.05, seconds_per_op=5e-6),
    Findings(
        peak_bytes=95,
        capacity_bytes=100,
        by_category={"parameters": 5, "gradients": 5, "optimizer_state": 80, "activations": 10},
    ),
    Findings(checkpointed_share=1.0, forward_fraction=0.4, peak_bytes=30, capacity_bytes=100),
]


def test_every_advice_yaml_builds_its_class_through_the_cli(tmp_path, monkeypatch) -> None:
    """The yaml each rule writes (techniques' init args as strings) parses and builds through
    the CLI: a misspelt class or argument fails here, not in the user's run. Every place
    ``advice.py`` writes yaml must be reached by ``EVERY_ADVICE``."""
    import ast
    import sys

    from lightning_efficient.commands.options import build_cli
    from lightning_efficient.measure.profiling import advice

    writer, reached = advice._yaml, set()

    def recording(stack: Any) -> str:
        frame = sys._getframe(1)
        frame = frame.f_back if frame.f_code.co_name == "_callback_yaml" else frame
        reached.add(frame.f_lineno)
        return writer(stack)

    monkeypatch.setattr(advice, "_yaml", recording)
    written = {a.yaml for f in EVERY_ADVICE for rule in advice.RULES for a in rule(f)}
    tree = ast.parse(Path(advice.__file__).read_text())
    sites = [
        (node.lineno, node.end_lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("_yaml", "_callback_yaml")
        and node.lineno > 180  # not the writers themselves
    ]
    missed = [a for a, b in sites if not any(a <= line <= b for line in reached)]
    assert len(sites) >= 14 and not missed, f"advice.py lines no finding reaches: {missed}"
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "logger": False}}))
    built = 0
    for i, text in enumerate(sorted(written)):
        config = yaml.safe_load(text)
        if config is None:  # only comments (a model setting, a sampler)
            continue
        path = tmp_path / f"advice{i}.yaml"
        path.write_text(text)
        trainer = build_cli([str(base), str(path)]).trainer
        names = {type(c).__name__ for c in trainer.callbacks}
        for entry in config["trainer"].get("callbacks", []):  # built, its init args accepted
            assert entry["class_path"].rpartition(".")[2] in names, entry
        if "strategy" in config["trainer"]:
            assert type(trainer.strategy).__name__ == "ZeROOffload"
        built += 1
    assert built >= 12


# -- the GPU speed levers, on recorded H200 profiles (issue 29) ---------------------------------
RECORDED_SPEED = json.loads(
    (ROOT / "benchmarks" / "recorded" / "h200_speed_2026-12-04.json").read_text()
)


def _levers(profile: str) -> list[dict[str, str]]:
    findings = Findings.from_dict(RECORDED_SPEED["profiles"][profile]["findings"])
    return [a.to_dict() for a in advise(findings)]


def test_recorded_h200_figures_follow_from_the_package() -> None:
    """The recorded profiles' derived figures are what this package computes (not the file
    against itself): the H200 bf16 peak and the fp32/bf16 ratio come from ``gpu_peak``'s table,
    the MFU from ``mfu`` on the measured tokens/s, the FLOPs per token from the demo TinyGPT built
    at the stated shape (nanoGPT's formula on its own parameter count), and every finding the
    issue does not state is named as derived."""
    from lightning_efficient.measure.speed.flops import mfu

    work = RECORDED_SPEED["workload"]
    bf16, _ = gpu_peak("NVIDIA H200", "bf16")
    fp32, _ = gpu_peak("NVIDIA H200", "fp32")
    assert bf16 == pytest.approx(work["peak_bf16_flops"])
    with torch.device("meta"):
        model = TinyGPT(seq_len=1024, n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    params = sum(p.numel() for p in model.parameters())
    assert f"{params:,} parameters" in work["model"]
    per_token = 6 * (params - 1024 * 768) + 12 * 12 * 768 * 1024
    assert per_token == work["flops_per_token"]
    for name, profile in RECORDED_SPEED["profiles"].items():
        measured, findings = profile["measured"], profile["findings"]
        got = mfu(measured["tokens_per_s"] * per_token, bf16)
        assert got == pytest.approx(measured["mfu"], abs=0.0005), name
        assert findings["mfu"] == measured["mfu"]
        if "bf16_speedup" in profile["derived"] and name == "plain":
            assert findings["bf16_speedup"] == pytest.approx(bf16 / fp32), name
        logits = 6 * findings["hidden_size"] * findings["vocab_size"] / per_token
        assert findings["logits_flops_fraction"] == pytest.approx(logits), name
        tokens = work["batch"] * work["seq"]
        assert tokens / measured["tokens_per_s"] == pytest.approx(measured["step_s"], rel=0.01)
        stated = {"mfu", "precision", "device_type", "micro_batch", "accumulate", "active"}
        stated |= {"vocab_size", "hidden_size", "optimizer", "compile_scope"}
        stated |= {"tf32"} if name == "speed_stack" else set()
        stated |= {"fused_optimizer"} if name == "speed_stack" else set()
        assert set(findings) - stated <= set(profile["derived"]), name


def test_verdict_on_the_recorded_plain_run_names_the_next_lever() -> None:
    levers = _levers("plain")
    assert levers, "the plain fp32 run at 4.3% MFU must get a verdict"
    for a in levers:  # every lever: its yaml and the gain to expect
        assert a["yaml"] and a["gain"] and a["reason"], a
    first = levers[0]
    assert first["technique"] == "precision" and "14.8x" in first["gain"]
    assert yaml.safe_load(first["yaml"]) == {"trainer": {"precision": "auto"}}
    names = [a["lever"] for a in levers]
    for lever in (
        "MatmulPrecision",
        "TorchCompile (scope: whole)",
        "OptimizerSwap (name: adamw_fused)",
        "EfficientBatchSize",
        "ChunkedCrossEntropy",
        "multiple of 64",
    ):
        assert lever in names, (lever, names)
    fused = next(a for a in levers if a["technique"] == "OptimizerSwap")
    spec = yaml.safe_load(fused["yaml"])["trainer"]["callbacks"][0]
    assert spec == {"class_path": "OptimizerSwap", "init_args": {"name": "adamw_fused"}}
    padded = next(a for a in levers if a["technique"] == "multiple of 64")
    assert "50304" in padded["yaml"] and "768" not in padded["reason"]


def test_verdict_on_the_recorded_speed_stack_names_whole_model_compile() -> None:
    levers = _levers("speed_stack")
    first = levers[0]
    assert first["lever"] == "TorchCompile (scope: whole)"
    assert first["gain"].startswith("1.46x")  # 39.6 ms regional / 27.1 ms whole
    spec = yaml.safe_load(first["yaml"])["trainer"]["callbacks"][0]
    assert spec == {"class_path": "TorchCompile", "init_args": {"scope": "auto"}}
    on = {"precision", "MatmulPrecision", "OptimizerSwap", "DataLoaderTuning"}
    assert not on & {a["technique"] for a in levers}  # nothing that is on already
    batch = next(a for a in levers if a["technique"] == "EfficientBatchSize")
    assert yaml.safe_load(batch["yaml"])["trainer"]["callbacks"][0]["init_args"] == {
        "target_batch_size": 8
    }
    assert "ChunkedCrossEntropy" in {a["technique"] for a in levers}
    # whole-model compile on: the compile lever is gone, the others stay
    whole = dict(RECORDED_SPEED["profiles"]["speed_stack"]["findings"], compile_scope="whole")
    rest = [a.lever for a in advise(Findings.from_dict(whole))]
    assert "TorchCompile (scope: whole)" not in rest and rest[0] == "EfficientBatchSize"


def test_gpu_lever_rules_one_by_one() -> None:
    gpu = dict(device_type="cuda", mfu=0.2)
    # measured compile figures decide: within 3% no whole-model advice
    close = Findings(
        **gpu,
        compile_scope="regional",
        compile_steps={"regional_step_s": 0.101, "whole_step_s": 0.100},
    )
    assert "TorchCompile" not in {a.technique for a in advise(close)}
    # a CPU run compiled regionally gets whole-model advice only when measured faster
    cpu = Findings(
        compile_scope="regional", compile_steps={"regional_step_s": 0.139, "whole_step_s": 0.130}
    )
    assert [a.lever for a in advise(cpu)] == ["TorchCompile (scope: whole)"]
    assert advise(Findings(compile_scope="regional")) == []
    # CUDA graphs: compiled, yet launch-bound
    launch = Findings(
        **gpu,
        compile_scope="whole",
        seconds_per_op=5e-6,
        micro_batch=4,
        peak_bytes=75,
        capacity_bytes=100,
    )
    assert [a.lever for a in advise(launch)] == ["TorchCompile (mode: reduce-overhead)"]
    # data wait on a GPU: pinned memory for non-blocking copies
    wait = advise(Findings(device_type="cuda", data_wait_fraction=0.3))[0]
    assert "pin_memory: auto" in wait.yaml and "non-blocking" in wait.reason
    assert wait.gain.startswith("up to 1.43x")
    # fused only for Adam-family steps that are not fused; a narrow vocabulary: no chunked loss
    sgd = Findings(device_type="cuda", optimizer="SGD", fused_optimizer=False)
    assert "OptimizerSwap" not in {a.technique for a in advise(sgd)}
    narrow = Findings(vocab_size=512, hidden_size=64, logits_flops_fraction=0.5)
    assert advise(narrow) == []
    padded = Findings(device_type="cuda", vocab_size=50304, hidden_size=768)
    assert "multiple of 64" not in {a.technique for a in advise(padded)}


def test_output_head_is_a_language_models_vocabulary_only() -> None:
    from lightning_efficient.measure.profiling.profile_summary import output_head

    lm = TinyGPT(vocab_size=300, n_layer=1, n_embd=32, n_head=2, seq_len=8)
    assert output_head(lm) == (300, 32)
    # a classifier over a text encoder: 2 outputs are no vocabulary (token types have 2 rows)
    classifier = nn.ModuleDict(
        {"tok": nn.Embedding(1000, 16), "types": nn.Embedding(2, 16), "cls": nn.Linear(16, 2)}
    )
    assert output_head(classifier) == (None, None)
    assert output_head(nn.Linear(4, 4)) == (None, None)


def test_the_demo_on_the_cpu_names_a_lever_when_one_applies(tmp_path, capsys) -> None:
    """A TinyGPT whose vocabulary is wide (8192 x 64): the head is most of the step's FLOPs, so
    the chunked loss applies on any device; the table shows the lever, its gain and yaml, and
    never says that no rule fired."""
    profiler = StepProfiler(skip_steps=1)
    model = TinyGPT(vocab_size=8192, n_layer=1, n_embd=64, n_head=2, seq_len=32)
    fit(tmp_path, [profiler], model=model, data=tiny_data(seq_len=32, batch_size=4), max_steps=3)
    out = capsys.readouterr().out
    advice = profiler.summary["advice"]
    chunked = next(a for a in advice if a["technique"] == "ChunkedCrossEntropy")
    assert chunked["gain"] and "ChunkedCrossEntropy" in chunked["yaml"]
    assert "no rule fired" not in out and "no lever applies" not in out
    assert "expected:" in out and "ChunkedCrossEntropy" in out


def test_needless_recompute_rule_on_given_figures() -> None:
    """Every block checkpointed, the peak far below the capacity: the verdict names the budget
    mode, with the recompute (the blocks' forward, run again) as the gain; not near capacity,
    nor without checkpointing."""
    mib, gib = 2**20, 2**30
    given = dict(peak_bytes=38 * mib, capacity_bytes=24 * gib, forward_fraction=0.33)
    advice = advise(
        Findings(checkpointed_share=1.0, active=frozenset({"ActivationCheckpointing"}), **given)
    )
    budget = next(a for a in advice if a.technique == "ActivationCheckpointing")
    assert budget.setting == "budget: 24.00GiB" and "budget: 24.00GiB" in budget.yaml
    assert "1.49x" in budget.gain and "33% of the step" in budget.gain  # 1 / (1 - 0.33)
    half = advise(Findings(checkpointed_share=0.5, **given))
    assert "1.20x" in next(a for a in half if a.technique == "ActivationCheckpointing").gain
    for figures in (
        {**given, "peak_bytes": 13 * gib},  # 54% of the capacity: the memory is needed
        {**given, "capacity_bytes": None},  # no capacity known (a CPU without a budget)
    ):
        assert not any(
            a.technique == "ActivationCheckpointing"
            for a in advise(Findings(checkpointed_share=1.0, **figures))
        )
    assert not any(a.technique == "ActivationCheckpointing" for a in advise(Findings(**given)))


def test_checkpointing_without_memory_pressure_names_the_budget_mode(tmp_path) -> None:
    """A real fit with every block checkpointed and a budget far above its peak: the profiler
    reads the checkpointed share from the callback and the verdict names the budget mode."""
    from lightning_efficient import ActivationCheckpointing

    checkpointing = ActivationCheckpointing(policy="blocks.*")
    profiler = StepProfiler(skip_steps=1, memory_budget="1GiB", print_table=False)
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, seq_len=32)
    fit(
        tmp_path,
        [checkpointing, MemoryBreakdown(print_table=False), profiler],
        model=model,
        data=tiny_data(seq_len=32, batch_size=4),
        max_steps=4,
    )
    assert checkpointing.checkpoint_state() == {"blocks": 2, "of": 2}
    advice = profiler.summary["advice"]
    budget = next(a for a in advice if a["technique"] == "ActivationCheckpointing")
    assert budget["setting"] == "budget: 1.00GiB" and "x (the checkpointed blocks" in budget["gain"]


# -- outputs: table, report, logger, trace, PNG ----------------------------------------------
class MetricsLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_outputs_table_report_metrics_trace_plot(tmp_path, capsys) -> None:
    trace, png = tmp_path / "trace.json", tmp_path / "profile.png"
    svg = tmp_path / "memory.svg"
    profiler = StepProfiler(skip_steps=1, trace=str(trace), trace_steps=1, plot=str(png))
    logger = MetricsLogger()
    breakdown = MemoryBreakdown(print_table=False, plot=str(svg))
    trainer, _, _ = fit(tmp_path, [breakdown, profiler], max_steps=5, logger=logger)
    s = profiler.summary
    assert s["steps"] == 3  # 1 warm-up step, 1 traced step, 3 measured
    out = capsys.readouterr().out
    assert "StepProfiler: TinyGPT on cpu" in out and "backward" in out and "MFU" in out
    assert out.count("StepProfiler: TinyGPT on cpu") == 1  # printed once
    entry = report_for(trainer)["StepProfiler"]
    assert entry.figures["samples_per_sec"] == pytest.approx(s["samples_per_s"], rel=0.01)
    assert "step" in entry.change and "samples/s" in entry.change
    assert logger.metrics["profiler/step_s"] == pytest.approx(s["step_s"])
    assert logger.metrics["profiler/mfu"] == pytest.approx(s["mfu"])
    assert "traceEvents" in json.loads(trace.read_text())
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 1000
    assert s["memory"]["by_category"] is not None  # MemoryBreakdown's numbers
    text = svg.read_text()  # the measured step's figures, written on the bars
    step = max(breakdown.measurements)
    measured = breakdown.measurements[step]
    assert f"MemoryBreakdown, step {step}: peak {format_bytes(measured.peak_bytes)}" in text
    for category, size in measured.by_category.items():
        assert format_bytes(size) in text and category.split("_")[0] in text
    json.dumps(s)  # a plain dict


def test_compare_plain_estimate_and_technique_filter(tmp_path) -> None:
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    profiler = StepProfiler(skip_steps=1, compare_plain=True, print_table=False)
    fit(
        tmp_path,
        [ActivationCheckpointing(policy="auto"), MemoryBreakdown(print_table=False), profiler],
        max_steps=3,
    )
    s = profiler.summary
    assert s["plain_peak_bytes"] > s["memory"]["peak_bytes"] > 0  # checkpointing saved memory
    assert "ActivationCheckpointing" not in {a["technique"] for a in s["advice"]}


def test_no_measured_step_says_so(tmp_path) -> None:
    from lightning_efficient.core.technique import NoEffectWarning

    profiler = StepProfiler(skip_steps=5, print_table=False)
    with pytest.warns(NoEffectWarning, match="no step was measured"):
        fit(tmp_path, [profiler], max_steps=2)
    assert profiler.summary is None


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"skip_steps": -1}, "skip_steps"),
        ({"flops_per_step": 0}, "flops_per_step"),
        ({"peak_flops": float("inf")}, "peak_flops"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"trace": 3}, "trace"),
        ({"trace_steps": 0}, "trace_steps"),
        ({"compare_plain": "yes"}, "compare_plain"),
    ],
)
def test_bad_arguments(kwargs, name) -> None:
    with pytest.raises((ValueError, TypeError), match=name):
        StepProfiler(**kwargs)


def test_output_paths_are_checked_at_construction(tmp_path) -> None:
    """Issue 33 items 6-7: a bad trace or png path is refused before the fit, not after it."""
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    for name in ("trace", "plot"):
        for folder in (empty, full):  # a folder is never written over
            with pytest.raises(ValueError, match=f"`{name}` .* is a folder"):
                StepProfiler(**{name: str(folder)})
        with pytest.raises(ValueError, match=f"`{name}` .*folder .* does not exist"):
            StepProfiler(**{name: str(tmp_path / "missing" / "out.json")})
    assert empty.is_dir() and (full / "keep.txt").read_text() == "mine"
    StepProfiler(trace=str(tmp_path / "trace.json"), plot=str(tmp_path / "p.png"))  # fine
    for callback in (StepProfiler, MemoryBreakdown):  # the suffix names the format
        with pytest.raises(ValueError, match=r"`plot` must end in .png or .svg.*p\.pdf"):
            callback(plot=str(tmp_path / "p.pdf"))


def test_plot_without_matplotlib_names_the_install_line(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    for callback in (StepProfiler, MemoryBreakdown):
        with pytest.raises(ImportError, match=r"pip install 'lightning-efficient\[plot\]'"):
            callback(plot=str(tmp_path / "p.svg"))
    StepProfiler(plot=None)  # no picture asked: no matplotlib needed


def test_phases_figure_stacks_each_phase_and_draws_memory_bars(tmp_path) -> None:
    """The bars are the numbers: phase widths in ms, stacked in order; category heights in MiB."""
    from lightning_efficient.measure.plots import phases_figure, save_figure
    from lightning_efficient.measure.profiling.profile_report import profile_png

    phases = {"data": 0.002, "forward": 0.010, "backward": 0.020, "optimizer": 0.005, "rest": 0.001}
    cats = {"parameters": 3 * 2**20, "activations": 12 * 2**20}
    fig = phases_figure(phases, cats)
    time_ax, memory_ax = fig.axes
    widths = [p.get_width() for p in time_ax.patches]
    lefts = [p.get_x() for p in time_ax.patches]
    assert widths == pytest.approx([v * 1e3 for v in phases.values()])
    assert lefts == pytest.approx([0, 2, 12, 32, 37])
    assert [p.get_height() for p in memory_ax.patches] == pytest.approx([3, 12])
    path = save_figure(fig, tmp_path / "phases.svg")
    assert "backward" in path.read_text() and "12.00 MiB" in path.read_text()
    summary = {"phases": phases, "memory": {"by_category": cats}}
    assert profile_png(summary, tmp_path / "p.svg").read_text() == path.read_text()


def test_trace_path_per_rank_and_never_a_false_written_note(tmp_path) -> None:
    from lightning_efficient.measure.profiling.trace_window import rank_trace_path

    assert rank_trace_path("out/trace.json", 0, 1) == Path("out/trace.json")
    assert rank_trace_path("out/trace.json", 1, 2) == Path("out/trace.rank1.json")
    assert rank_trace_path("t.json.gz", 0, 2) == Path("t.rank0.json.gz")
    assert rank_trace_path("trace", 1, 2) == Path("trace.rank1")
    # the path became a folder after construction: said, not replaced, no "written" note
    trace = tmp_path / "trace.json"
    profiler = StepProfiler(skip_steps=1, trace=str(trace), trace_steps=1, print_table=False)
    trace.mkdir()
    (trace / "keep.txt").write_text("mine")
    with pytest.warns(UserWarning, match="trace was not written to .*trace.json: it is a folder"):
        fit(tmp_path, [profiler], max_steps=3, limit_val_batches=0)
    assert (trace / "keep.txt").read_text() == "mine" and not any(
        "written to" in said for said in profiler._said
    )
    assert not list(tmp_path.glob(".trace.json*"))  # no partial file left behind


# -- the command ------------------------------------------------------------------------------
TINY_ARGS = [
    "--trainer.accelerator=cpu",
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.n_head=2",
    "--model.init_args.seq_len=32",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=4",
    "--trainer.enable_progress_bar=false",
]


def test_profile_command_prints_the_table(tmp_path, capsys) -> None:
    assert "profile" in EXTRA_COMMANDS
    out_json = tmp_path / "profile.json"
    code = main(
        ["profile", "--config", str(PLAIN), "--steps", "4", "--json", str(out_json), *TINY_ARGS]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "StepProfiler: TinyGPT on cpu" in out and "2 steps measured" in out  # 2 warm-up
    assert "vs plain" in out  # the plain estimate (compare_plain) is on in the command
    summary = json.loads(out_json.read_text())
    assert summary["steps"] == 2 and summary["flops_per_step"] > 0


def test_profile_command_bad_input(capsys) -> None:
    assert main(["profile", "--config", str(PLAIN), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--steps" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["profile", "--config", "no/such/config.yaml"])
    assert info.value.code == 2


def test_profile_json_is_checked_before_the_run_and_never_a_config(tmp_path, capsys) -> None:
    """Issue 33 items 5 and 7: --json naming the config (or a bad path) is refused at once."""
    config = tmp_path / "tiny.yaml"
    config.write_text(PLAIN.read_text())
    before = config.read_text()
    args = ["profile", "--config", str(config), "--steps", "3", *TINY_ARGS]
    assert main([*args, "--json", str(config)]) == 2
    err = capsys.readouterr().err
    assert "`--json`" in err and "input of this run" in err and "Traceback" not in err
    assert config.read_text() == before  # the config is intact
    assert main([*args, "--json", str(config), "--force"]) == 2  # not even with --force
    assert main([*args, "--json", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*args, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    other = tmp_path / "notes.json"
    other.write_text("mine")
    assert main([*args, "--json", str(other)]) == 2
    assert "--force" in capsys.readouterr().err and other.read_text() == "mine"
    # the config's own StepProfiler may not write over a config either
    traced = tmp_path / "traced.yaml"
    traced.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "callbacks": [
                        {"class_path": "StepProfiler", "init_args": {"trace": str(config)}}
                    ]
                }
            }
        )
    )
    assert main([*args, "--config", str(traced)]) == 2
    assert "StepProfiler: `trace`" in capsys.readouterr().err and config.read_text() == before


@pytest.mark.gpu
def test_cuda_phases_mfu_and_memory(tmp_path) -> None:
    """On CUDA: phases from events, MFU against the table, memory from the allocator."""
    profiler = StepProfiler(skip_steps=2, print_table=False)
    model = tiny_model(seq_len=128, n_layer=4, n_embd=256, n_head=4)
    data = tiny_data(seq_len=128, batch_size=16, max_train_samples=512)
    fit(tmp_path, [profiler], model=model, data=data, accelerator="gpu", max_steps=12)
    s = profiler.summary
    assert all(s["phases"][p] >= 0 for p in PHASES) and s["phases"]["backward"] > 0
    assert (
        s["memory"]["peak_bytes"] > 0 and s["memory"]["capacity_bytes"] > s["memory"]["peak_bytes"]
    )
    if s["peak_flops"] is not None:  # a GPU of the table
        assert 0 < s["mfu"] < 1
    # a small model on a large GPU: headroom advice, never a data-loading false alarm
    assert "DataLoaderTuning" not in {a["technique"] for a in s["advice"]}


def test_png_the_former_name_of_plot_is_gone(tmp_path) -> None:
    """No alias before the first release (issue 50): ``plot=`` only."""
    assert StepProfiler(plot=str(tmp_path / "steps.png")).plot == str(tmp_path / "steps.png")
    with pytest.raises(TypeError, match="png"):
        StepProfiler(png=str(tmp_path / "steps.png"))
    assert not hasattr(StepProfiler, "png")


# -- the key/value cache (issue 39) ------------------------------------------------------------
def _token_loader() -> DataLoader:
    ids = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(0))
    return DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def test_verdict_names_a_key_value_cache_built_while_training(tmp_path) -> None:
    """A model that builds a key/value cache in every training forward: the verdict names it,
    with its bytes (as a forward really caches them) and the fix; none when a technique (or the
    config) switches it off."""
    from lightning_efficient.measure.memory.kv_cache import cache_bytes
    from lightning_efficient.techniques.activation_checkpointing import ActivationCheckpointing

    module = TinyHFGPT2(n_embd=32)
    cache = module.model(torch.zeros(4, 32, dtype=torch.long)).past_key_values
    real = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert cache_bytes(module, 4 * 32, 4) == real  # fp32, 4 x 32 tokens

    def verdict(model: Any, *callbacks: Any) -> list[dict[str, str]]:
        profiler = StepProfiler(skip_steps=1, print_table=False, log_metrics=False)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[profiler, *callbacks],
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=_token_loader())
        return [a for a in profiler.summary["advice"] if a["technique"] == "use_cache=False"]

    (said,) = verdict(module)
    assert said["reason"].startswith("model builds a key/value cache")  # the module's name
    assert format_bytes(real) in said["reason"]
    assert "model.config.use_cache = False" in said["yaml"]
    assert "ActivationCheckpointing" in said["yaml"]
    assert (
        verdict(TinyHFGPT2(n_embd=32), ActivationCheckpointing()) == []
    )  # switched off for training
    assert verdict(TinyHFGPT2(use_cache=False, n_embd=32)) == []
