"""The planner: the first stack of the ladder whose estimated peak fits the budget."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from command_runner import run_command
from helpers import fit, tiny_data, tiny_model

from lightning_efficient import (
    ActivationCheckpointing,
    OptimizerSwap,
)
from lightning_efficient.demos import TinyGPT
from lightning_efficient.planning import Part, Rung, default_ladder, plan_stack

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def workload():
    model = TinyGPT(n_layer=4, n_embd=64, n_head=2, seq_len=64, dropout=0.0)
    x = torch.zeros(8, 64, dtype=torch.long)
    return model, (x, x)


# each search below is run once and shared by the tests asserting different things about it
@pytest.fixture(scope="module")
def plain_cuda(workload):
    """The default ladder at 1 TiB, estimated for a CUDA device: the first rung fits."""
    return plan_stack(*workload, "1TiB")


@pytest.fixture(scope="module")
def plain_cpu(workload):
    return plan_stack(*workload, "1TiB", device="cpu")


@pytest.fixture(scope="module")
def nothing_fits(workload):
    """1 KiB: no rung fits, so every rung of the ladder is estimated (as ``try_all`` would)."""
    return plan_stack(*workload, 1024)


def test_picks_first_rung_that_fits(workload, plain_cuda, nothing_fits) -> None:
    model, batch = workload
    plain = plain_cuda
    assert plain.chosen is plain.tried[0][0] and len(plain.tried) == 1  # stops at the first fit
    peaks = [est.peak_bytes for _, est, _ in nothing_fits.tried if est is not None]
    assert len(nothing_fits.tried) >= 4 and len(peaks) >= 3
    # a budget just under the plain peak: the plan is a later rung, and it really fits
    budget = plain.tried[0][1].peak_bytes - 1
    result = plan_stack(model, batch, budget)
    assert result.chosen is not None and result.chosen is not result.tried[0][0]
    chosen_est = next(est for rung, est, _ in result.tried if rung is result.chosen)
    assert chosen_est.peak_bytes <= budget
    for rung, est, _problem in result.tried[:-1]:  # every rung before the plan did not fit
        assert est is None or est.peak_bytes > budget, rung.name


def test_nothing_fits_says_so(nothing_fits) -> None:
    result = nothing_fits
    assert result.chosen is None and result.to_yaml() == ""
    assert all(est is None or est.peak_bytes > 1024 for _, est, _ in result.tried)


def test_custom_ladder_and_yaml_round_trip(workload, tmp_path) -> None:
    from lightning_efficient.commands.cli import EfficientCLI
    from lightning_efficient.techniques import ActivationCheckpointing

    model, batch = workload

    half = Part("ActivationCheckpointing", {"every_n": 2})
    ladder = [Rung("fp32", "32-true"), Rung("fp32 + half the blocks", "32-true", (half,))]
    plain_peak = (
        plan_stack(model, batch, "1TiB", ladder=ladder[:1], cuda_rounding=False)
        .tried[0][1]
        .peak_bytes
    )
    result = plan_stack(model, batch, plain_peak - 1, ladder=ladder, cuda_rounding=False)
    assert result.chosen is ladder[1]
    cfg = tmp_path / "plan.yaml"
    cfg.write_text(result.to_yaml())
    trainer_cfg = yaml.safe_load(cfg.read_text())["trainer"]
    assert trainer_cfg["precision"] == "32-true"
    cli = EfficientCLI(
        args=["--config", str(cfg), "--trainer.accelerator=cpu", "--trainer.logger=false"],
        run=False,
    )
    built = [cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationCheckpointing)]
    assert len(built) == 1 and built[0].every_n == 2


def test_bad_budget_named(workload) -> None:
    model, batch = workload
    with pytest.raises(ValueError, match="budget"):
        plan_stack(model, batch, "lots")
    with pytest.raises(ValueError, match="precision"):
        plan_stack(model, batch, "1GiB", precision="fp33")


def test_plan_command(capsys) -> None:

    args = ["plan", "--config", "configs/demo_plain.yaml", "--trainer.accelerator=cpu"]
    ok = run_command(capsys, *args, "--budget", "1GiB", cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "<- plan" in ok.stdout and "precision:" in ok.stdout
    bad = run_command(capsys, *args, "--budget", "lots", cwd=ROOT)
    assert bad.returncode == 2 and "error:" in bad.stderr and "--budget" in bad.stderr
    host = run_command(capsys, *args, "--budget", "1GiB", "--host-budget", "64GiB", cwd=ROOT)
    assert host.returncode == 0 and "host memory 64.00 GiB" in host.stdout, host.stderr[-2000:]
    bad = run_command(capsys, *args, "--budget", "1GiB", "--host-budget", "lots", cwd=ROOT)
    assert bad.returncode == 2 and "--host-budget" in bad.stderr


def test_confirmed_by_real_steps_and_stepping_down_on_out_of_memory(workload, plain_cpu) -> None:
    from lightning_efficient.measure.trials.trial import TrialResult

    model, batch = workload
    estimated = plain_cpu
    # real steps on this CPU, within the budget: the estimate's pick is confirmed
    real = plan_stack(model, batch, "1TiB", device="cpu", confirm=True)
    assert real.chosen is real.tried[0][0] and real.chosen.name == estimated.chosen.name
    ((rung, trial),) = real.trials
    assert rung is real.chosen and trial.ok and trial.reserved_bytes > 0
    assert trial.reserved_bytes == pytest.approx(real.tried[0][1].peak_bytes, rel=0.02)
    # a rung whose real steps run out of memory is passed over: the next rung that fits is tried
    refused = []

    def oom_first_two(r: Rung) -> TrialResult:
        ok = len(refused) >= 2
        if not ok:
            refused.append(r.name)
        return TrialResult(ok, 100, 200, 2**40, "" if ok else "OutOfMemoryError: simulated")

    result = plan_stack(model, batch, "1TiB", device="cpu", confirm=oom_first_two)
    names = [r.name for r, _, _ in result.tried]
    assert refused == names[:2] and result.chosen is result.tried[2][0]
    assert [t.ok for _, t in result.trials] == [False, False, True]
    table = result.to_markdown()
    assert (
        "Real steps" in table and "out of memory" in table and "real steps: out of memory" in table
    )


def test_fragmentation_advice_names_expandable_segments(plain_cuda, plain_cpu) -> None:
    cuda = plain_cuda  # device="cuda", plan_stack's default
    est = cuda.estimate_of(cuda.chosen)
    gap = est.reserved_bytes / est.peak_bytes - 1
    assert gap > 0  # the allocator's segments round up and cache
    advice = cuda.fragmentation_advice(threshold=gap / 2)
    assert "expandable_segments:True" in advice and "not measured" in advice
    assert cuda.fragmentation_advice(threshold=gap * 2) == ""
    assert plain_cpu.fragmentation_advice(0.0) == ""


@pytest.mark.parametrize("world_size", [1, 8])
def test_every_rung_writes_back_what_it_builds(world_size) -> None:
    """A rung's techniques are data (``Part``: a class and its arguments, stated once): what it
    builds and what its yaml says are made from the same arguments."""
    from lightning_efficient import techniques

    ladder = [r.within(2**30) for r in default_ladder(world_size=world_size)]
    assert {r.name for r in ladder} >= {"as configured"} and len(ladder) > 4
    for rung in ladder:
        callbacks, strategy = rung.build()
        specs, strategy_spec = rung.specs()
        built = [*callbacks, *([strategy] if strategy is not None else [])]
        written = [*specs, *([strategy_spec] if strategy_spec is not None else [])]
        assert [type(obj).__name__ for obj in built] == [s["class_path"] for s in written]
        for obj, spec in zip(built, written):
            again = getattr(techniques, spec["class_path"])(**spec.get("init_args", {}))
            assert _state(again) == _state(obj), rung.name


def _state(obj) -> dict:
    simple = (int, float, str, bool, type(None))
    return {k: v for k, v in vars(obj).items() if isinstance(v, simple) and not k.startswith("_")}


def test_wide_logits_get_the_chunked_loss_rung_before_anything_lossy() -> None:
    """A model whose logits are wide (vocabulary 8192, width 64): the chunked loss comes right
    after bf16 and stays in every later rung but ZeRO-3's; on a budget between the two it is the
    plan (exact, where the old ladder went on to 8-bit states). A narrow one has no such rung."""
    with torch.device("meta"):
        wide = TinyGPT(vocab_size=8192, n_layer=2, n_embd=64, n_head=2, seq_len=256, dropout=0.0)
    x = torch.zeros(8, 256, dtype=torch.long, device="meta")
    full = plan_stack(wide, (x, x), "1TiB", try_all=True, device="cpu")
    names = [r.name for r, _, _ in full.tried]
    assert names[1:4] == [
        "bf16-mixed",
        "bf16-mixed + chunked loss",
        "bf16-mixed + chunked loss + adamw8bit",
    ]
    for rung, _, _ in full.tried[2:]:
        has = any(p.class_path == "ChunkedCrossEntropy" for p in rung.callbacks)
        assert has == ("ZeRO-3" not in rung.name), rung.name
    bf16, chunked = (full.estimate_of(r).peak_bytes for r, _, _ in full.tried[1:3])
    assert chunked < bf16
    plan = plan_stack(wide, (x, x), (bf16 + chunked) // 2, device="cpu")
    assert plan.chosen.name == "bf16-mixed + chunked loss"
    assert "class_path: ChunkedCrossEntropy" in plan.to_yaml()
    narrow = default_ladder()
    assert not any("chunked" in r.name for r in narrow)


def test_one_yaml_writer_and_the_ladder_classes() -> None:
    """The plan, AutoEfficient's decision and the profiler's advice write their yaml with one
    ``Stack.to_yaml()``; the ladder names its technique classes from a table of imported classes
    (never a module path)."""
    from lightning_efficient import ActivationCheckpointing
    from lightning_efficient.measure.profiling.advice import Findings, advise
    from lightning_efficient.planning import Decision, PlanResult
    from lightning_efficient.planning.ladder import LADDER_CLASSES, technique_class

    assert technique_class("ActivationCheckpointing") is ActivationCheckpointing
    assert OptimizerSwap in LADDER_CLASSES.values()
    with pytest.raises(ValueError, match="not a technique of the ladder"):
        technique_class("os.system")
    rung = next(r.within(2**30) for r in default_ladder() if len(r.callbacks) == 2)
    plan = PlanResult(2**30, chosen=rung)
    trainer = yaml.safe_load(plan.to_yaml(devices=2))["trainer"]
    assert trainer == {**yaml.safe_load(rung.stack().to_yaml())["trainer"], "devices": 2}
    assert [c["class_path"] for c in trainer["callbacks"]] == [p.class_path for p in rung.callbacks]
    decision = yaml.safe_load(Decision(rung, 4, 2).to_yaml("model"))
    same = {k: v for k, v in trainer.items() if k != "devices"}
    # micro-batch x accumulation: ExactAccumulation keeps one step's update (issue 48)
    exact = [*same["callbacks"], {"class_path": "ExactAccumulation"}]
    assert decision == {
        "trainer": {**same, "accumulate_grad_batches": 2, "callbacks": exact},
        "model": {"init_args": {"batch_size": 4}},
    }
    # the advice's yaml parses to the same shape
    findings = Findings(peak_bytes=95, capacity_bytes=100)
    pressure = next(a for a in advise(findings) if a.technique == "ActivationCheckpointing")
    spec = yaml.safe_load(pressure.yaml)["trainer"]["callbacks"][0]
    assert spec == {"class_path": "ActivationCheckpointing", "init_args": {"policy": "auto"}}


# -- fine-tuning: the 4-bit rung, and no rung that saves nothing (issue 39) --------------------
def _llama(lora: bool) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if not lora:
        return model
    adapters = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, adapters)


def _hf_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def test_4bit_rung_where_frozen_weights_dominate_and_no_8bit_rung_on_small_adapters() -> None:
    """LoRA on a tiny Llama: frozen linear weights are most of the parameter bytes, so the ladder
    offers 4-bit frozen weights (after exact checkpointing, before ZeRO offload) and, every
    adapter being under bitsandbytes' 4,096-element minimum, no 8-bit rung. Full-weight training
    of the same model gets no 4-bit rung (nothing is frozen)."""
    from lightning_efficient.planning.ladder import FROZEN_4BIT, ladder_options
    from lightning_efficient.techniques.quantize import frozen_linear_share, select_frozen_linears

    full, lora = _llama(lora=False), _llama(lora=True)
    assert frozen_linear_share(full) == 0.0 and 0.5 < frozen_linear_share(lora) < 1.0
    assert ladder_options(full) == {
        "chunked_loss": False,
        "frozen_4bit": False,
        "eight_bit": True,
        "bf16_weights": True,
        "long_context": True,
    }
    assert ladder_options(lora) == {
        "chunked_loss": False,
        "frozen_4bit": True,
        "eight_bit": False,
        "bf16_weights": False,
        "long_context": True,
    }
    plain = default_ladder(**ladder_options(full))
    assert not any(FROZEN_4BIT in r.callbacks for r in plain)
    assert any(p.class_path == "OptimizerSwap" for r in plain for p in r.callbacks)
    names = [r.name for r in default_ladder(**ladder_options(lora))]
    assert not any("8bit" in n for n in names)  # 8-bit states would stay 32-bit on the adapters
    four = [i for i, n in enumerate(names) if "4-bit frozen weights" in n]
    assert [names[i] for i in four] == [
        "bf16-mixed + 4-bit frozen weights",
        "bf16-mixed + 4-bit frozen weights + checkpoint fewest blocks",
        "bf16-mixed + 4-bit frozen weights + checkpoint all blocks",
        "bf16-mixed + 4-bit frozen weights + checkpoint all blocks, boundaries on host + tiled",
    ]
    assert names.index("bf16-mixed + checkpoint all blocks") < four[0]
    assert four[-1] < min(i for i, n in enumerate(names) if "ZeRO" in n)
    # the technique picks frozen weights only: never a trainable one (the adapters)
    layers = dict(lora.named_modules())
    chosen = select_frozen_linears(lora).chosen
    assert chosen and not any(layers[n].weight.requires_grad for n in chosen)
    # the same on several ranks: one 4-bit rung under DDP, none where FSDP is configured
    ddp = default_ladder(world_size=2, **ladder_options(lora))
    assert sum(FROZEN_4BIT in r.callbacks for r in ddp) == 1
    assert not any(FROZEN_4BIT in r.callbacks and r.strategy is not None for r in ddp)
    fsdp = default_ladder(world_size=2, configured_sharding="full", **ladder_options(lora))
    assert not any(FROZEN_4BIT in r.callbacks for r in fsdp)


def test_plan_takes_the_4bit_rung_and_passes_over_one_that_saves_nothing() -> None:
    """Estimated through its ``configure_estimate``: the 4-bit rung's weights are a fraction of
    bf16's, and a budget just under bf16's peak picks it; a rung whose estimate is not lower than
    the rung it extends (8-bit states on adapters that stay 32-bit) is said to save nothing."""
    from lightning_efficient.planning.ladder import ADAMW8BIT, FROZEN_4BIT

    lora = _llama(lora=True)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ladder = [
        Rung("bf16-mixed", "bf16-mixed"),
        Rung("bf16-mixed + adamw8bit", "bf16-mixed", (ADAMW8BIT,)),
        Rung("bf16-mixed + 4-bit frozen weights", "bf16-mixed", (FROZEN_4BIT,)),
    ]
    kw = dict(loss_fn=_hf_loss, optimizer="adamw", device="cpu")
    bf16 = plan_stack(lora, (ids,), "1TiB", ladder=ladder[:1], **kw).tried[0][1]
    # just under bf16's peak: the 8-bit rung does not fit either, the 4-bit one does
    plan = plan_stack(lora, (ids,), bf16.peak_bytes - 1, ladder=ladder, try_all=True, **kw)
    _, eight, four = (est for _, est, _ in plan.tried)
    assert eight.peak_bytes >= bf16.peak_bytes  # tensors under 4,096 elements keep 32-bit state
    assert [p for _, _, p in plan.tried] == ["over budget", "saves nothing over bf16-mixed", ""]
    assert "saves nothing over bf16-mixed" in plan.to_markdown()
    weights = (four.by_category["parameters"], bf16.by_category["parameters"])
    assert weights[0] < 0.5 * weights[1] and four.peak_bytes < bf16.peak_bytes
    assert plan.chosen is ladder[2] and "class_path: FrozenWeights4bit" in plan.to_yaml()
    after = lora.state_dict()  # the estimates left the model as given
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fewer_recomputed_blocks_is_not_saves_nothing() -> None:
    """Issue 49: a rung that extends "checkpoint the fewest blocks" and reaches the budget with
    fewer recomputed blocks (8-bit states: one block instead of two) saves time even where its
    peak is higher: never labelled "saves nothing"."""
    from lightning_efficient.planning.ladder import ADAMW8BIT, checkpoint_fewest

    torch.manual_seed(0)
    model = TinyGPT(n_layer=4, n_embd=64, n_head=2, seq_len=64, dropout=0.0, vocab_size=2048)
    x = torch.randint(0, 2048, (8, 64), generator=torch.Generator().manual_seed(0))
    first = Part("ActivationCheckpointing", {"policy": "blocks.0"})

    def need(*parts: Part) -> int:
        result = plan_stack(
            model, (x, x), "1TiB", device="cpu", ladder=[Rung("r", "32-true", parts)]
        )
        return result.tried[0][1].required_bytes

    one_plain, one_8bit = need(first), need(ADAMW8BIT, first)
    budget = (one_plain + one_8bit) // 2  # one block is enough with 8-bit states only
    fewest = checkpoint_fewest(budget)
    plain = Rung("fewest", "32-true", (fewest,))
    eight = Rung("8-bit + fewest", "32-true", (ADAMW8BIT, fewest))
    result = plan_stack(model, (x, x), budget, device="cpu", ladder=[plain, eight], try_all=True)
    (_, est_plain, _), (_, est_8bit, problem) = result.tried
    assert (
        est_plain.figures["checkpointed_blocks"] == 2
        and est_8bit.figures["checkpointed_blocks"] == 1
    )
    assert est_8bit.required_bytes >= est_plain.required_bytes  # the case: a higher peak
    assert problem == "", problem


def test_bf16_weights_rung_on_full_weight_training_only() -> None:
    """Full-weight training of a tiny Llama: the bf16-true rungs (stochastic rounding, then with
    8-bit states) come after the 8-bit rungs and before the optimizer in backward and ZeRO
    offload, and name the quality gate's figure; a budget under the 8-bit + checkpointing rung's
    estimate picks one of them. A LoRA model never gets them (its frozen weights are not
    updated), nor a trainer fixed at 32-true (a callback cannot change the precision)."""
    from lightning_efficient.planning.ladder import ladder_options

    full, lora = _llama(lora=False), _llama(lora=True)
    names = [r.name for r in default_ladder(**ladder_options(full))]
    sr = names.index("bf16-true + adamw_sr + checkpoint all blocks")
    assert names[sr + 1] == "bf16-true + adamw8bit_sr + checkpoint all blocks"
    assert names.index("bf16-mixed + adamw8bit + checkpoint all blocks") < sr
    assert sr < min(i for i, n in enumerate(names) if "in backward" in n or "ZeRO" in n)
    rung = default_ladder(**ladder_options(full))[sr]
    assert rung.precision == "bf16-true" and "quality gate" in rung.cost
    assert not any("bf16-true" in r.name for r in default_ladder(**ladder_options(lora)))
    fixed = default_ladder(bf16=False, **ladder_options(full))
    assert not any(r.precision == "bf16-true" for r in fixed)
    # the planner takes it at a budget just under the 8-bit + checkpointing rung's estimate
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(loss_fn=_hf_loss, optimizer="adamw", device="cpu")
    ladder = default_ladder(**ladder_options(full))
    eight = ladder[names.index("bf16-mixed + adamw8bit + checkpoint all blocks")]
    peak = plan_stack(full, (ids,), "1TiB", ladder=[eight], **kw).tried[0][1].peak_bytes
    plan = plan_stack(full, (ids,), peak - 1, ladder=[eight, *ladder[sr : sr + 2]], **kw)
    assert plan.chosen is not None and plan.chosen.name.startswith("bf16-true + adamw")


def test_confirmed_with_the_estimates_loss_fn() -> None:
    """``confirm=True`` tries the chosen rung with the ``loss_fn`` it was estimated with: a plain
    module (no ``training_step``) is confirmed, its trial's peak the estimate's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    batch = (torch.randn(32, 64),)

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor]) -> torch.Tensor:
        return m(b[0]).square().mean()

    result = plan_stack(
        model, batch, "1TiB", device="cpu", confirm=True, loss_fn=loss_fn, optimizer="adamw"
    )
    ((rung, trial),) = result.trials
    assert rung is result.chosen and trial.ok
    assert trial.reserved_bytes == pytest.approx(result.tried[0][1].peak_bytes, rel=0.02)


class NeedsReal(type(tiny_model())):
    def training_step(self, batch, batch_idx):
        if float(batch[0].float().sum()) < 0:  # reads a value: fake tensors cannot
            raise RuntimeError("unreachable")
        return super().training_step(batch, batch_idx)


def test_plan_says_when_the_model_cannot_be_estimated() -> None:
    import torch

    from benchmarks.workloads import TINY_MODEL

    x = torch.zeros(2, 32, dtype=torch.long)
    result = plan_stack(NeedsReal(**TINY_MODEL), (x, x), "1GiB", try_all=True)
    assert result.chosen is None and result.not_estimable is not None
    assert "item" in str(result.not_estimable) or "value" in str(result.not_estimable)


def test_plan_as_configured_counts_the_configured_techniques() -> None:
    import torch

    model = tiny_model(n_layer=4)
    x = torch.zeros(4, 32, dtype=torch.long)
    bare = plan_stack(model, (x, x), "1TiB")
    configured = plan_stack(model, (x, x), "1TiB", configured=[ActivationCheckpointing()])
    assert bare.tried[0][0].name == configured.tried[0][0].name == "as configured"
    assert configured.tried[0][1].peak_bytes < bare.tried[0][1].peak_bytes


@pytest.mark.slow
def test_every_stack_the_planner_can_emit_fits(tmp_path) -> None:
    """Each rung of the default ladder, built as the planner would write it, trains 2 steps of
    the demo (issue 21: the checkpointing budget next to an 8-bit optimizer crashed)."""
    from lightning_efficient.planning import default_ladder
    from lightning_efficient.techniques.zero_offload import ZeROOffload

    for rung in default_ladder(bf16=True):
        callbacks, strategy = rung.within(2**40).build()
        if isinstance(strategy, ZeROOffload):
            continue  # DeepSpeed rungs: fitted in tests/techniques/test_zero_offload.py
        for cb in callbacks:
            if isinstance(cb, ActivationCheckpointing) and cb.budget is not None:
                cb.budget = 2**20  # a budget the tiny model must work for
        precision = "bf16-mixed" if rung.precision != "32-true" else "32-true"
        kwargs = {"strategy": strategy} if strategy is not None else {}
        trainer, _, rec = fit(
            tmp_path, callbacks, max_steps=2, precision=precision, data=tiny_data(), **kwargs
        )
        assert trainer.global_step == 2 and len(rec.losses) == 2, rung.name
        assert all(math.isfinite(v) for v in rec.losses), rung.name
