"""AutoEfficient (issue 31): the decision (pure), the callback on five model families, resume,
out-of-memory in the trial steps, bad arguments, the yaml it prints, and ``fit --auto``."""

from __future__ import annotations

import functools
import logging
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from _auto_families import FAMILIES, FamilyData, family
from _batch_size_helpers import OOMGPT
from helpers import SaveAt, fit, params_of

from benchmarks.workloads import TINY_MODEL, TinyHFGPT2, tiny_data
from lightning_efficient import AutoEfficient, MemoryBreakdown
from lightning_efficient.core.report import report_for
from lightning_efficient.core.validate import SettingsError
from lightning_efficient.planning import (
    CHECKPOINT_ALL,
    CHECKPOINT_FEWEST,
    Part,
    Rung,
    checkpoint_fewest,
    decide,
    divisors,
)
from lightning_efficient.planning import fit as auto_fit
from lightning_efficient.planning.decision import Decision
from lightning_efficient.planning.search import measured_as
from lightning_efficient.techniques.batch_size.choice import worst_case_sampler

E = 16  # the effective batch of the family tests: divisors 1, 2, 4, 8, 16


# -- the decision, pure -----------------------------------------------------------------------------
def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(12, cap=5) == [1, 2, 3, 4]
    assert divisors(1) == [1] and divisors(64) == [1, 2, 4, 8, 16, 32, 64]


def _rungs() -> list[Rung]:
    return [
        Rung("plain", "32-true"),
        Rung("chunked", "32-true", (Part("ChunkedCrossEntropy"),)),
        Rung("fewest", "32-true", (checkpoint_fewest(1000),)),
        Rung("all", "32-true", (CHECKPOINT_ALL,)),
    ]


def _per_sample(rung: Rung) -> int:
    """Bytes per sample (the fixed part is 100): checkpointing every block is cheapest."""
    classes = [p.class_path for p in rung.callbacks]
    if "ActivationCheckpointing" in classes:
        assert rung.callbacks == (CHECKPOINT_ALL,), "fewest blocks is estimated as all blocks"
        return 10
    return 30 if "ChunkedCrossEntropy" in classes else 40


def _measure(rung: Rung, n: int) -> tuple[bool, float, Any]:
    used = 100.0 + _per_sample(rung) * n
    return used <= 1000, used, None


def test_goals_pick_as_documented() -> None:
    # speed: the largest exact divisor of 64; "fewest blocks" is estimated as "all blocks" (it
    # fits wherever they do) and wins the tie as the cheaper rung; the search stops at the cap
    speed = decide(_rungs(), _measure, 1000, 64)
    assert (speed.rung.name, speed.micro, speed.accumulation) == ("fewest", 64, 1)
    assert [name for name, _ in speed.tried][:3] == ["plain", "chunked", "fewest"]
    assert speed.estimates <= 6  # plain and chunked at 64 and 1 (a line each), fewest at 64
    assert measured_as(_rungs()[2]).callbacks == (CHECKPOINT_ALL,)
    # memory: the cheapest rung that fits at all, at its largest exact divisor (100 + 40 x 16)
    memory = decide(_rungs(), _measure, 1000, 64, goal="memory")
    assert (memory.rung.name, memory.micro, memory.accumulation) == ("plain", 16, 4)
    assert {name for name, _ in memory.tried} == {"plain"}
    # unusable rungs are skipped with their reason; nothing fitting is a clear error
    skip = decide(
        _rungs(), _measure, 1000, 64, unusable=lambda r: "needs yaml" * (r.name == "plain")
    )
    assert skip.tried[0] == ("plain", "needs yaml")
    with pytest.raises(ValueError, match="no usable stack fits"):
        decide(_rungs()[:2], lambda r, n: (False, 200.0, None), 50, 64)


def test_trial_out_of_memory_steps_down_a_size_then_a_stack() -> None:
    def trial_oom_above(limit: dict[str, int]):
        def trial(rung: Rung, n: int) -> Any:
            ok = n <= limit.get(rung.name, 10**9)
            return SimpleNamespace(ok=ok, reserved_bytes=100 + _per_sample(rung) * n)

        return trial

    plain = [_rungs()[0], _rungs()[1]]
    down = decide(plain, _measure, 1000, 64, goal="memory", trial=trial_oom_above({"plain": 8}))
    assert (down.rung.name, down.micro) == ("plain", 8)  # 16 ran out of memory: one size down
    assert "one size down" in down.notes[0] and down.trial_bytes == 100 + 40 * 8
    nxt = decide(plain, _measure, 1000, 64, goal="memory", trial=trial_oom_above({"plain": 4}))
    assert (nxt.rung.name, nxt.micro) == ("chunked", 16)  # 30 x 16 + 100 <= 1000 < 30 x 32
    assert "next stack" in nxt.notes[-1]
    with pytest.raises(ValueError, match="in real steps"):
        decide(
            plain,
            _measure,
            1000,
            64,
            trial=lambda r, n: SimpleNamespace(ok=False, reserved_bytes=0),
        )


def test_decide_stack_needs_no_trainer_and_hands_the_budget_down() -> None:
    """The public entry: AutoEfficient's decision for a model and its batches, no trainer; the
    same decision as the ladder, the estimate and the search wired by hand, and the budget in
    the decision's "fewest blocks" part (handed by the search: the ladder takes none)."""
    from helpers import tiny_model

    from lightning_efficient.planning import decide_stack

    model = tiny_model()
    batch = lambda n: (torch.zeros(n, 32, dtype=torch.long),) * 2  # noqa: E731
    plain = auto_fit.estimate_measure(model, batch, 10**12, 8, {"device": "cpu"})
    budget = int(plain(Rung("as configured", "32-true"), 2)[1])  # the plain step holds 2 of 8
    d = decide_stack(model, batch, budget, 8, goal="memory", device="cpu", bf16=False)
    assert (d.rung.name, d.micro, d.accumulation) == ("as configured", 2, 4)
    by_hand = decide(
        auto_fit.ladder_for(model, precision="32-true", bf16=False),
        auto_fit.estimate_measure(model, batch, budget, 8, {"device": "cpu"}),
        budget, 8, goal="memory", unusable=auto_fit.own_accumulation,
    )  # fmt: skip
    assert (by_hand.rung, by_hand.micro, by_hand.estimates) == (d.rung, d.micro, d.estimates)
    # the ladder's "fewest blocks" takes the budget the search hands it, and only then builds
    fewest = Rung("fewest", "32-true", (CHECKPOINT_FEWEST,))
    with pytest.raises(ValueError, match="Rung.within"):
        fewest.build()
    seen: list[Any] = []
    picked = decide([fewest], lambda r, n: seen.append(r) or _measure(r, n), 1000, 64).rung
    assert picked.callbacks == (checkpoint_fewest(1000),) and picked.build()[0][0].budget == 1000
    assert all(r.callbacks == (CHECKPOINT_ALL,) for r in seen)  # estimated as every block


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"budget": "lots"}, "budget"),
        ({"budget": -1}, "budget"),
        ({"goal": "fastest"}, "goal"),
        ({"target_batch": 0}, "target_batch"),
        ({"target_batch": 2.5}, "target_batch"),
        ({"trial": "yes"}, "trial"),
        ({"batch_arg_name": "1x"}, "batch_arg_name"),
    ],
)
def test_bad_arguments_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        AutoEfficient(**kwargs)
    assert name in str(info.value)


def test_budget_required_on_cpu(tmp_path) -> None:
    with pytest.raises(SettingsError, match="budget="):
        fit(tmp_path, [AutoEfficient()], max_steps=1)


# -- five families: within the budget, not wasteful, the same losses as the stack by hand --------
@functools.cache  # deterministic (a seeded model): the decoder's budget, once for four tests
def _plain_estimate(name: str, micro: int) -> float:
    model, data = family(name, batch_size=E)
    make, _ = worst_case_sampler(data.train_dataloader(), 100)
    measure = auto_fit.estimate_measure(model, make, 10**12, E, {"precision": "32-true"})
    return measure(Rung("as configured", "32-true"), micro)[1]


def _by_hand(name: str, decision: Any, tmp_path: Any) -> list[float]:
    model, data = family(name, batch_size=decision.micro)
    callbacks, _ = decision.rung.build()
    _, _, rec = fit(
        tmp_path, callbacks, model=model, data=data, max_steps=2, limit_val_batches=0,
        precision=decision.rung.precision, accumulate_grad_batches=decision.accumulation,
    )  # fmt: skip
    return rec.losses


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def decoder_fit(tmp_path_factory) -> SimpleNamespace:
    """One AutoEfficient fit of the decoder (its decision: ~10 fake-tensor estimates and trial
    steps), shared by the tests asserting different things about it: within the budget and not
    wasteful, the yaml and report it prints, and the checkpoint a resume starts from (saved after
    step 1, once the measured step is over)."""
    tmp = tmp_path_factory.mktemp("decoder")
    budget = int(_plain_estimate("decoder", E // 2) * 1.01)
    model, data = family("decoder", batch_size=E)
    auto = AutoEfficient(budget=budget)
    memory = MemoryBreakdown(sample_steps=[1], print_table=False)
    ckpt = tmp / "k.ckpt"
    records, root = _Records(), logging.getLogger()
    level = root.level
    root.addHandler(records)
    root.setLevel(logging.INFO)
    try:
        trainer, _, rec = fit(tmp / "auto", [auto, memory, SaveAt(1, ckpt)], model=model,
                              data=data, max_steps=2, limit_val_batches=0)  # fmt: skip
    finally:
        root.removeHandler(records)
        root.setLevel(level)
    return SimpleNamespace(
        budget=budget, auto=auto, memory=memory, trainer=trainer, rec=rec, ckpt=ckpt,
        messages=records.messages,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "decoder" else [pytest.mark.slow]) for n in FAMILIES]
)
def test_family_within_budget_and_not_wasteful(name: str, tmp_path, request) -> None:
    # the budget: what the plain stack needs at half the effective batch (with accumulation), so
    # it fits 8 x 2 and not 16; goal "speed" takes a stack that reaches 16 where one does
    if name == "decoder":  # the decoder's fit is shared with the yaml and resume tests
        shared = request.getfixturevalue("decoder_fit")
        budget, auto, memory, rec = shared.budget, shared.auto, shared.memory, shared.rec
    else:
        budget = int(_plain_estimate(name, E // 2) * 1.01)
        model, data = family(name, batch_size=E)
        auto = AutoEfficient(budget=budget)
        memory = MemoryBreakdown(sample_steps=[1], print_table=False)
        _, _, rec = fit(tmp_path / "auto", [auto, memory], model=model, data=data, max_steps=2,
                        limit_val_batches=0)  # fmt: skip
    d = auto.decision
    assert d.micro * d.accumulation == E and E % d.micro == 0
    assert d.micro >= E // 2, d.tried  # at least what the plain stack reaches
    peak = memory.measurement.peak_bytes
    # the real fit's step (after the optimizer state exists) within the budget, and >= 85% of it
    assert peak <= budget, (d.describe(), peak / budget)
    if d.micro < E:
        assert peak >= 0.85 * budget, (d.describe(), peak / budget)
    else:
        # the whole effective batch in one step (T5: checkpointing reaches it at ~75% of the
        # budget): no larger micro-batch exists to use the rest for. Not wasteful then means no
        # more techniques than needed: every cheaper stack was estimated short of the batch
        # (and the fit's measured peak is the trial steps', within 2%)
        # (the stacks this trainer cannot take say why, without a micro-batch; a stack that
        # saves nothing over one it extends is passed over and says so)
        verdicts = [w for n, w in d.tried if n != d.rung.name and "micro-batch" in w]
        short = ("does not fit", "saves nothing over")
        assert verdicts and all(w.startswith(short) for w in verdicts), d.tried
        assert abs(peak - d.trial_bytes) <= 0.02 * peak, (peak, d.trial_bytes)
    assert d.trial_bytes is not None and d.trial_bytes <= budget
    # the same stack configured by hand: the same losses
    torch.testing.assert_close(
        torch.tensor(rec.losses), torch.tensor(_by_hand(name, d, tmp_path / "hand")),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


# -- the yaml reproduces the decision; the report; resume --------------------------------------
def _decoder_fit(
    tmp_path: Any, auto: AutoEfficient, batch_size: int = E, **kw: Any
) -> tuple[Any, Any, Any]:
    model, data = family("decoder", batch_size=batch_size)
    return fit(tmp_path, [auto], model=model, data=data, limit_val_batches=0, **kw)


def _simple(obj: Any) -> dict[str, Any]:
    plain = (int, float, str, bool, type(None))
    return {k: v for k, v in vars(obj).items() if isinstance(v, plain)}


def test_yaml_reproduces_the_decision(tmp_path, decoder_fit) -> None:
    from lightning_efficient.commands.cli import EfficientCLI

    budget, trainer, d = decoder_fit.budget, decoder_fit.trainer, decoder_fit.auto.decision
    printed = [m for m in decoder_fit.messages if "reproduces this" in m]
    assert len(printed) == 1
    text = printed[0].split("(add to your config):\n", 1)[1]
    assert yaml.safe_load(text) == yaml.safe_load(d.to_yaml("data"))
    # the report: the choice, the estimate, the trial's peak against the budget, the time
    entry = report_for(trainer)["AutoEfficient"]
    assert d.rung.name in entry.change and "trial peak" in entry.change
    assert entry.figures["micro_batch"] == d.micro and entry.figures["decision_s"] >= 0
    assert entry.figures["trial_peak_bytes"] <= budget
    # a Trainer built from that yaml (on top of a config with the model and data) is the stack
    config = tmp_path / "frozen.yaml"
    config.write_text(text)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "logger": False},
        "model": {"class_path": "lightning_efficient.demos.TinyGPT", "init_args": TINY_MODEL},
        "data": {"class_path": "lightning_efficient.demos.TextDataModule",
                 "init_args": {"batch_size": E, "seq_len": 32}},
    }))  # fmt: skip
    cli = EfficientCLI(args=["--config", str(base), "--config", str(config)], run=False)
    assert str(cli.trainer.precision) == d.rung.precision
    assert cli.trainer.accumulate_grad_batches == d.accumulation
    assert cli.datamodule.batch_size == d.micro
    built = [(type(cb).__name__, cb) for cb in cli.trainer.callbacks]
    for part in d.rung.callbacks:
        match = [cb for n, cb in built if n == part.class_path]
        assert match, f"{part.class_path} missing from {built}"
        assert _simple(match[0]) == _simple(part.build())


def test_resume_makes_the_same_choice(tmp_path, monkeypatch, decoder_fit) -> None:
    budget, ckpt, chosen = decoder_fit.budget, decoder_fit.ckpt, decoder_fit.auto.decision
    assert ckpt.exists()

    # a resume does not decide again (it would choose differently: a much larger budget)
    def no_decision(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decided again on resume")

    monkeypatch.setattr(auto_fit, "decide_for", no_decision)
    again = AutoEfficient(budget=budget * 100)
    model, data = family("decoder", batch_size=E)
    trainer, _, _ = fit(tmp_path / "b", [again], model=model, data=data, max_steps=3,
                        limit_val_batches=0, ckpt_path=str(ckpt))  # fmt: skip
    d = again.decision
    assert d.restored and (d.rung.name, d.micro, d.accumulation) == (
        chosen.rung.name, chosen.micro, chosen.accumulation,
    )  # fmt: skip
    assert trainer.accumulate_grad_batches == chosen.accumulation
    assert [type(cb).__name__ for cb in trainer.callbacks[1 : 1 + len(chosen.rung.callbacks)]] == [
        p.class_path for p in chosen.rung.callbacks
    ]
    assert report_for(trainer)["AutoEfficient"].figures["restored"] is True


# -- out of memory in the trial steps, on a CPU ------------------------------------------------------
class RealOOMGPT(OOMGPT):
    """Runs out of memory in real steps only (the estimate's fake steps see a plain TinyGPT)."""

    def _hit(self, n: int) -> bool:
        return not self._fake and super()._hit(n)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        self._fake = isinstance(idx, FakeTensor)
        return super().forward(idx)


def test_trial_oom_steps_one_size_down(tmp_path) -> None:
    # the estimate says 16 fits; a real step at more than 8 samples fails to allocate
    model = RealOOMGPT(oom_above=8, from_step=0, **TINY_MODEL)
    data = FamilyData(FAMILIES["decoder"][1], 64, E)
    auto = AutoEfficient(budget="1GiB", goal="memory")
    trainer, _, rec = fit(tmp_path, [auto], model=model, data=data, max_steps=2,
                          limit_val_batches=0)  # fmt: skip
    d = auto.decision
    assert (d.rung.name, d.micro, d.accumulation) == ("as configured", 8, 2)
    assert any("ran out of memory" in n and "one size down" in n for n in d.notes)
    # the trial's out-of-memory was the injected one (the note), and the trial put the module's
    # counter back as it put back everything else it changed (a measurement changes nothing)
    assert model.injected == 0 and trainer.global_step == 2


def test_strategy_rungs_are_said_why_not(tmp_path) -> None:
    # a budget under what any stack needs: the error lists each stack and why; the ZeRO rungs
    # cannot be taken (DeepSpeed sets the accumulation itself), a precision or a strategy a built
    # Trainer cannot take is "needs yaml" with the line (a batch of 1: one size to estimate)
    with pytest.raises(ValueError, match="no usable stack fits") as info:
        _decoder_fit(tmp_path, AutoEfficient(budget=1000), batch_size=1, max_steps=1)
    # the ZeRO rungs, which set the accumulation themselves, are never AutoEfficient's: not listed
    assert "ZeRO" not in str(info.value) and str(info.value).count("does not fit") >= 2
    rung = Rung("bf16", "bf16-mixed", (), Part("FullyShardedStrategy"))
    why = auto_fit.fixed_by_trainer(rung, "32-true")
    assert why.startswith("needs yaml (trainer.precision: bf16-mixed; trainer.strategy:")


def test_undone_when_fit_raises(tmp_path) -> None:
    model, data = family("decoder", batch_size=E)

    patched: list[str] = []

    class Boom(MemoryBreakdown):
        def on_train_batch_start(self, *args: Any) -> None:  # after the stack's own
            patched.extend(n for n, m in model.named_modules() if "forward" in vars(m))
            raise RuntimeError("boom")

    kinds = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    # the ladder's largest stack a 32-true trainer takes (chunked loss, 8-bit states, every
    # block checkpointed), given as the decision (AutoEfficient applies it as one it made: the
    # decision's own estimates are test_family_within_budget_and_not_wasteful's; the trial
    # steps undo their own changes, test_trial_oom_steps_one_size_down)
    rungs = auto_fit.ladder_for(model, precision="32-true", bf16=False)
    usable = [r for r in rungs if not auto_fit.fixed_by_trainer(r, "32-true")]
    rung = max(usable, key=lambda r: len(r.callbacks)).within(2**30)
    assert {p.class_path for p in rung.callbacks} == {
        "ChunkedCrossEntropy", "OptimizerSwap", "ActivationCheckpointing"
    }  # fmt: skip
    auto = AutoEfficient(budget="1GiB").preset(Decision(rung, E // 2, 2))
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, [auto, Boom()], model=model, data=data, max_steps=2)
    assert auto.decision is not None and patched  # a stack applied (blocks wrapped) before
    assert data.batch_size == E  # the micro-batch is put back
    # the module as given: the same layers (no checkpoint wrapper left), the same state keys,
    # and its forward is the module's own (no technique's patch left on any submodule)
    assert [type(m) for m in model.modules()] == kinds and list(model.state_dict()) == keys
    assert all("forward" not in vars(m) for m in model.modules())


# -- the command ------------------------------------------------------------------------------------
def test_fit_auto_command_builds_the_trainer_from_the_plan(tmp_path, capsys, monkeypatch) -> None:
    from pathlib import Path

    from lightning_efficient.commands import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    common = ["--config", str(config), "--trainer.max_steps", "2", "--trainer.logger", "false"]
    assert main(["fit", "--auto", "--budget", "1.1MiB", *common]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("AutoEfficient (fit --auto):"))
    assert "trial peak" in line and "of 1.10 MiB" in line
    # the plain stack fits 4 x 2 in 1.1 MiB, not 8: a technique (and, on a machine with bf16,
    # the bf16-mixed precision the callback alone could not set) reaches the whole batch
    assert "as configured" not in line and "micro-batch 8 x accumulation 1" in line
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "lots", *common])
    assert "--budget" in capsys.readouterr().err


def test_data_unchanged_for_a_plain_fit(tmp_path) -> None:
    # a budget that holds the whole effective batch: the configured stack and batch, unchanged
    auto = AutoEfficient(budget="1GiB")
    trainer, _, _ = fit(tmp_path, [auto], data=tiny_data(batch_size=4), max_steps=1)
    assert (auto.decision.rung.name, auto.decision.micro) == ("as configured", 4)
    assert auto.decision.estimates == 1 and trainer.accumulate_grad_batches == 1


def test_refused_next_to_another_sizer(tmp_path) -> None:
    from lightning_efficient import EfficientBatchSize

    with pytest.raises(ValueError, match="Keep one of them"):
        fit(tmp_path, [AutoEfficient(budget="1GiB"), EfficientBatchSize(target_batch_size=8)])


# -- issue 39: a rung that saves nothing; the key/value cache -------------------------------------
def test_a_rung_that_saves_nothing_is_passed_over() -> None:
    """A rung whose estimate is not lower than the rung it extends (8-bit states on adapters that
    stay 32-bit) is never the pick: where the rung it extends ran out of memory in real steps,
    the search goes on to a rung that saves memory, and says why."""
    eight = Rung("plain + 8bit", "32-true", (Part("OptimizerSwap", {"name": "adamw8bit"}),))
    rungs = [_rungs()[0], eight, _rungs()[3]]

    def measure(rung: Rung, n: int) -> tuple[bool, float, Any]:
        used = 100.0 + (10 if rung.name == "all" else 40) * n  # the 8-bit rung: as plain
        return used <= 1000, used, None

    def trial(rung: Rung, n: int) -> Any:
        return SimpleNamespace(ok=rung.name != "plain", reserved_bytes=1)

    for effective in (16, 128):  # the whole batch at once; a line through two estimates
        d = decide(rungs, measure, 1000, effective, trial=trial)
        assert d.rung.name == "all"
        said = dict(d.tried)["plain + 8bit"]
        assert said.startswith("saves nothing over plain") and "passed over" in said
        memory = decide(rungs, measure, 1000, effective, goal="memory", trial=trial)
        assert memory.rung.name == "all" and "next stack" in memory.notes[-1]
        assert dict(memory.tried)["plain + 8bit"].startswith("saves nothing over plain")


def _gpt2_data() -> FamilyData:
    def sample(i: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i)),)

    return FamilyData(sample, 32, 8)


def test_every_rung_estimated_as_autoefficient_trains_it() -> None:
    """A rung that adds techniques is estimated without the key/value cache, as AutoEfficient
    trains it (an 8-bit swap alone switches nothing off itself); "as configured" keeps the
    cache, and its estimate costs it and names it."""
    from lightning_efficient.planning.ladder import ADAMW8BIT

    def bytes_of(use_cache: bool, rung: Rung) -> tuple[float, Any]:
        model = TinyHFGPT2(use_cache, momentum=0.9)
        ids = torch.zeros(8, 32, dtype=torch.long)
        settings = {"precision": "32-true", "device": "cpu", "optimizer": "adamw"}
        measure = auto_fit.estimate_measure(model, lambda n: (ids[:n],), 2**40, 8, settings)
        _, used, est = measure(rung, 8)
        assert model.model.config.use_cache is use_cache  # the estimate changed nothing
        return used, est

    swap = Rung("32-true + adamw8bit", "32-true", (ADAMW8BIT,))
    assert bytes_of(True, swap)[0] == bytes_of(False, swap)[0]
    plain = Rung("as configured", "32-true")
    (cache_on, est_on), (cache_off, est_off) = bytes_of(True, plain), bytes_of(False, plain)
    assert cache_on > cache_off
    assert any("key/value cache built while training" in n for n in est_on.notes)
    assert not any("key/value cache" in n for n in est_off.notes)


def test_default_gpt2_config_gets_the_same_micro_batch_and_losses(tmp_path) -> None:
    """GPT-2 from its default config (``use_cache=True``) under AutoEfficient: at a budget the
    cache matters for (the cache-off model's own step at the whole batch), the same micro-batch
    as with ``use_cache=False``, and the same losses."""
    off = AutoEfficient(budget="1TiB", trial=False)
    _, _, rec_off = fit(tmp_path / "off", [off], model=TinyHFGPT2(False, momentum=0.9), data=_gpt2_data(),
                        max_steps=3, limit_val_batches=0)  # fmt: skip
    assert (off.decision.rung.name, off.decision.micro) == ("as configured", 8)
    budget = int(off.decision.estimate_bytes)  # the cache-off step at the whole batch fits it
    on = AutoEfficient(budget=budget, trial=False)
    _, module, rec_on = fit(tmp_path / "on", [on], model=TinyHFGPT2(True, momentum=0.9), data=_gpt2_data(),
                            max_steps=3, limit_val_batches=0)  # fmt: skip
    assert dict(on.decision.tried)["as configured"].startswith("does not fit")  # the cache's cost
    assert on.decision.micro == off.decision.micro == 8
    assert on.decision.rung.name != "as configured"
    torch.testing.assert_close(rec_on.losses, rec_off.losses, rtol=1e-6, atol=0)
    assert module.model.config.use_cache is True  # the user's config as given


# AutoEfficient, the planner and the batch sizing under a hostile but fair user (issue 37):
# resume with every rung, the data's size, the optimizer family, the user's own errors, epoch
# ends, crafted checkpoints, techniques given twice, unbounded targets.


def _usable_rungs() -> list[Any]:
    """Every rung the callback's ladder can pick for the decoder on a 32-true CPU trainer."""
    model, _ = family("decoder", batch_size=E)
    rungs = auto_fit.ladder_for(model, precision="32-true", bf16=False)
    return [r.within(2**30) for r in rungs if not auto_fit.fixed_by_trainer(r, "32-true")]


# -- 2: a resumed run is bit-identical to an uninterrupted one, with every rung -------------------
def _rung_params() -> list[Any]:
    # "fewest blocks" estimates at fit start (about 15 s a test here): slow
    return [
        pytest.param(i, id=r.name, marks=[pytest.mark.slow] if "fewest" in r.name else [])
        for i, r in enumerate(_usable_rungs())
    ]


@pytest.mark.parametrize("index", _rung_params())
def test_resume_bit_identical_with_every_rung(index: int, tmp_path) -> None:
    rung = _usable_rungs()[index]
    epoch = dict(limit_train_batches=4, limit_val_batches=0)  # 2 steps of 8 x 2: an epoch end

    def run(where: str, steps: int, callbacks: Any = (), ckpt: str | None = None) -> Any:
        model, data = family("decoder", batch_size=E)
        auto = AutoEfficient(budget="1GiB").preset(Decision(rung, 8, 2))
        trainer, model, _ = fit(tmp_path / where, [auto, *callbacks], model=model, data=data,
                                max_steps=steps, ckpt_path=ckpt, **epoch)  # fmt: skip
        return trainer, model, auto

    ckpt = tmp_path / "k.ckpt"
    _, full, _ = run("full", 4)
    run("first", 2, [SaveAt(2, ckpt)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, resumed, auto = run("resumed", 4, ckpt=str(ckpt))
    # the stack is put in place by AutoEfficient: no "add OptimizerSwap" to the user
    assert not [w for w in caught if "Please add the following callbacks" in str(w.message)]
    assert auto.decision.restored and auto.decision.rung.name == rung.name
    assert trainer.global_step == 4
    for (name, a), b in zip(params_of(full).items(), params_of(resumed).values()):
        assert torch.equal(a, b), (rung.name, name, (a - b).abs().max().item())


# -- 3: never more than the data per step; a target the data cannot hold is refused ---------------
def test_target_the_data_cannot_hold_is_refused_before_training(tmp_path, monkeypatch) -> None:
    from lightning_efficient.core.validate import SettingsError

    # 16 x accumulation 8 = 128 on 64 samples: no step can take it (the old pick: micro-batch
    # 128, which with drop_last trains 0 steps and returns normally)
    model, data = family("decoder", batch_size=16)
    with pytest.raises(SettingsError, match=r"training set has 64 \(64 per rank\)"):
        fit(tmp_path, [AutoEfficient(budget="1GiB")], model=model, data=data,
            accumulate_grad_batches=8, max_steps=1)  # fmt: skip
    # a target that fits the data: the micro-batch never exceeds it
    model, data = family("decoder", batch_size=16)
    auto = AutoEfficient(budget="1GiB", target_batch=64)
    trainer, _, _ = fit(tmp_path / "ok", [auto], model=model, data=data, max_steps=1,
                        limit_val_batches=0)  # fmt: skip
    assert auto.decision.micro * auto.decision.accumulation == 64 and trainer.global_step == 1


def test_fit_auto_refuses_a_target_the_data_cannot_hold(tmp_path, capsys, monkeypatch) -> None:
    from pathlib import Path

    from lightning_efficient.commands import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    common = ["--config", str(config), "--trainer.max_steps", "1", "--trainer.logger", "false"]
    with pytest.raises(SystemExit) as info:
        main(["fit", "--auto", "--budget", "1GiB", "--target-batch", "1000000", *common])
    assert info.value.code != 0
    assert "Lower target_batch" in capsys.readouterr().err
    # an unbounded target is refused at once (the divisor search would not end)
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--target-batch", str(10**20), *common])
    assert "--target-batch" in capsys.readouterr().err
    # a checkpoint that is not there: said before deciding, no traceback
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--ckpt_path", "nowhere.ckpt", *common])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", "--auto", "--budget", "1GiB", "--ckpt_path", str(tmp_path), *common])
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make",
    [
        lambda: AutoEfficient(target_batch=10**20),
        lambda: __import__("lightning_efficient").EfficientBatchSize(target_batch_size=10**20),
    ],
)
def test_unbounded_target_refused_at_construction(make) -> None:
    with pytest.raises(ValueError, match="target_batch"):
        make()


# -- 5: the user's optimizer family is kept ----------------------------------------------------------
class SGDGPT(__import__("lightning_efficient.demos", fromlist=["TinyGPT"]).TinyGPT):
    momentum = 0.9

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=self.momentum)


class AdamGPT(SGDGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _swaps(rungs: Any) -> set[str]:
    return {
        p.init_args["name"] for r in rungs for p in r.callbacks if p.class_path == "OptimizerSwap"
    }


def test_optimizer_family_kept_and_rungs_without_the_swap() -> None:
    from lightning_efficient.planning import default_ladder

    sgd, adam = SGDGPT(**TINY_MODEL), AdamGPT(**TINY_MODEL)
    # AutoEfficient's ladder: no 8-bit swap for SGD (with momentum or without), Adam's own form
    assert _swaps(auto_fit.ladder_for(sgd, precision="32-true", bf16=False)) == set()
    assert _swaps(auto_fit.ladder_for(adam, precision="32-true", bf16=False)) == {"adam8bit"}
    # checkpointing alone is a rung, before the same with 8-bit states
    names = [r.name for r in default_ladder()]
    assert names.index("bf16-mixed + checkpoint fewest blocks") < names.index(
        "bf16-mixed + adamw8bit + checkpoint fewest blocks"
    )
    assert _swaps(default_ladder(optimizer="sgd")) == set()
    assert not any(r.strategy for r in default_ladder(optimizer="sgd"))


@pytest.mark.slow
def test_planner_keeps_sgd() -> None:
    from lightning_efficient.planning import plan_stack

    sgd = SGDGPT(**TINY_MODEL)
    # no 8-bit swap, no ZeRO offload (DeepSpeed's CPU Adam would replace SGD)
    x = torch.zeros(1, 8, dtype=torch.long)
    tried = [r for r, _, _ in plan_stack(sgd, (x, x), "1TiB", try_all=True, device="cpu").tried]
    assert _swaps(tried) == set() and not any(r.strategy for r in tried)
    assert any("checkpoint fewest blocks" in r.name for r in tried)


# -- 6: the user's own error, or "the estimate cannot run this step because ..." -------------------
class BadShapeGPT(SGDGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), y.reshape(-1)[:-1]
        )


class MetricGPT(SGDGPT):
    def __init__(self, **kw: Any) -> None:
        import torchmetrics

        super().__init__(**kw)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.mean_loss.update(loss.detach())
        return loss


class ManualGPT(SGDGPT):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


@pytest.mark.parametrize(
    "cls,error,match",
    [
        (BadShapeGPT, ValueError, "Expected input batch_size"),
        (MetricGPT, RuntimeError, "the estimate cannot run this step because .*needs real values"),
        (
            ManualGPT,
            RuntimeError,
            "the estimate cannot run this step because .*manual optimization",
        ),
    ],
)
def test_the_real_error_is_said(cls: type, error: type, match: str, tmp_path) -> None:
    from helpers import tiny_data

    with pytest.raises(error, match=match) as info:
        fit(tmp_path, [AutoEfficient(budget="1GiB")], model=cls(**TINY_MODEL),
            data=tiny_data(batch_size=4), max_steps=1)  # fmt: skip
    assert "no usable stack fits" not in str(info.value)


# -- 7: an accumulation window cut by the epoch's end is said -----------------------------------------
def test_epoch_end_cutting_the_window_is_warned(tmp_path) -> None:
    from lightning_efficient import EfficientBatchSize
    from lightning_efficient.techniques.batch_size.sizing import epoch_end_step

    assert epoch_end_step(64, 16, 3, drop_last=False) == 16  # steps of 48, 16, 48, 16, ...
    assert epoch_end_step(64, 16, 2, drop_last=False) is None
    assert epoch_end_step(70, 16, 2, drop_last=True) is None  # 4 full micro-batches: 2 steps
    assert epoch_end_step(70, 16, 2, drop_last=False) == 6  # steps of 32, 32, 6
    model, data = family("decoder", batch_size=16)
    with pytest.warns(UserWarning, match="not kept at epoch ends.*last step of 16"):
        fit(tmp_path / "auto", [AutoEfficient(budget="1GiB", target_batch=48)], model=model,
            data=data, max_steps=1, limit_val_batches=0)  # fmt: skip
    model, data = family("decoder", batch_size=16)
    sizer = EfficientBatchSize(target_batch_size=48, budget="1GiB", max_batch_size=16)
    with pytest.warns(UserWarning, match="not kept at epoch ends.*last step of 16"):
        fit(tmp_path / "ebs", [sizer], model=model, data=data, max_steps=1, limit_val_batches=0)


# -- 9: a crafted checkpoint imports nothing ----------------------------------------------------------
def _state(**changes: Any) -> dict[str, Any]:
    state = {
        "rung": "as configured",
        "precision": "32-true",
        "callbacks": [],
        "strategy": None,
        "micro_batch": 8,
        "accumulation": 2,
        "world_size": 1,
        "goal": "speed",
        "budget_bytes": 2**30,
    }
    return {**state, **changes}


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"callbacks": [{"class_path": "OptimizerSwap", "init_args": {"name": "evilmod.Opt"}}]},
         "OptimizerSwap `name`"),
        ({"callbacks": [{"class_path": "os.system"}]}, "not a technique of the ladder"),
        ({"micro_batch": 3.7}, "micro_batch"),
        ({"accumulation": 0}, "accumulation"),
        ({"micro_batch": None}, "micro_batch"),
        ({"rung": "\x1b[31mred"}, "printable"),
        ({"precision": "8-bit"}, "precision"),
        ({"callbacks": "OptimizerSwap"}, "callbacks"),
        ({"trial_bytes": "many"}, "trial_bytes"),
    ],
)  # fmt: skip
def test_checkpoint_decision_validated(changes: dict[str, Any], match: str) -> None:
    from lightning_efficient.planning.decision import Decision, DecisionStateError

    with pytest.raises(DecisionStateError, match=match):
        Decision.from_state(_state(**changes), 1)
    with pytest.raises(DecisionStateError, match="not a multiple"):
        Decision.from_state(_state(micro_batch=3, accumulation=1), 2)
    assert Decision.from_state(_state(), 1).micro == 8


def test_crafted_checkpoint_imports_nothing(tmp_path, monkeypatch) -> None:
    import sys

    (tmp_path / "evilmod_37.py").write_text("import sys\nsys.evil_ran = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = tmp_path / "k.ckpt"
    model, data = family("decoder", batch_size=E)
    fit(tmp_path / "a", [AutoEfficient(budget="1GiB"), SaveAt(1, ckpt)], model=model, data=data,
        max_steps=1, limit_val_batches=0)  # fmt: skip
    checkpoint = torch.load(ckpt, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("AutoEfficient")]
    checkpoint["callbacks"][key]["decision"]["callbacks"] = [
        {"class_path": "OptimizerSwap", "init_args": {"name": "evilmod_37.Opt"}}
    ]
    torch.save(checkpoint, ckpt)
    model, data = family("decoder", batch_size=E)
    with pytest.raises(ValueError, match="OptimizerSwap `name` must be one of"):
        fit(tmp_path / "b", [AutoEfficient(budget="1GiB")], model=model, data=data, max_steps=2,
            limit_val_batches=0, ckpt_path=str(ckpt))  # fmt: skip
    assert "evilmod_37" not in sys.modules and not getattr(sys, "evil_ran", False)


# -- 10: a technique given twice is used as given; two sizers refused before deciding -----------
def test_configured_technique_used_as_given(tmp_path, monkeypatch) -> None:
    from lightning_efficient import EfficientBatchSize, OptimizerSwap
    from lightning_efficient.core.validate import SettingsError

    model, _ = family("decoder", batch_size=E)
    ladder = auto_fit.ladder_for(model, precision="32-true", bf16=False,
                                 configured=[OptimizerSwap("adamw8bit")])  # fmt: skip
    assert _swaps(ladder) == set() and len({repr(r.callbacks) for r in ladder}) == len(ladder)
    # a decision whose stack has the user's technique: the user's instance, once
    rung = next(r for r in _usable_rungs() if "adamw8bit" in r.name)
    mine = OptimizerSwap("adamw8bit")
    auto = AutoEfficient(budget="1GiB").preset(Decision(rung, 8, 2))
    model, data = family("decoder", batch_size=E)
    trainer, _, _ = fit(tmp_path / "a", [auto, mine], model=model, data=data, max_steps=1,
                        limit_val_batches=0)  # fmt: skip
    assert [cb for cb in trainer.callbacks if isinstance(cb, OptimizerSwap)] == [mine]
    assert trainer.global_step == 1

    def no_decision(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decided before refusing")

    monkeypatch.setattr(auto_fit, "decide_for", no_decision)
    model, data = family("decoder", batch_size=E)
    with pytest.raises(SettingsError, match="EfficientBatchSize would set the batch size too"):
        fit(tmp_path / "b", [AutoEfficient(budget="1GiB"), EfficientBatchSize()], model=model,
            data=data, max_steps=1)  # fmt: skip


# -- the smaller items ------------------------------------------------------------------------------
def test_live_batch_size_read_and_put_back(tmp_path) -> None:
    """A datamodule whose batch_size changed after construction: the live value is read (not the
    stale hparams), and each place gets its own value back after the fit."""

    class Data(FamilyData):
        def __init__(self, batch_size: int = 16) -> None:
            super().__init__(FAMILIES["decoder"][1], 64, batch_size)
            self.save_hyperparameters()

    model, _ = family("decoder", batch_size=E)
    data = Data(16)
    data.batch_size = 8  # hparams still say 16
    auto = AutoEfficient(budget="1GiB")
    fit(tmp_path, [auto], model=model, data=data, max_steps=1, limit_val_batches=0)
    assert auto.decision.effective == 8  # not 16 (the stale hparams)
    assert (data.batch_size, data.hparams.batch_size) == (8, 16)


def test_ddp_ladder_offers_checkpointing_and_8bit_without_fsdp() -> None:
    from lightning_efficient.planning import default_ladder

    ddp = default_ladder(world_size=2, configured_sharding="ddp")
    plain = [r for r in ddp if r.strategy is None]
    classes = {p.class_path for r in plain for p in r.callbacks}
    assert {"ActivationCheckpointing", "OptimizerSwap"} <= classes
    # under FSDP (sharded parameters) no 8-bit rung: bitsandbytes steps whole tensors
    fsdp = default_ladder(world_size=2, configured_sharding="full")
    assert _swaps(fsdp) == set()


def test_nothing_fits_says_when_the_weights_alone_exceed_the_budget() -> None:
    from types import SimpleNamespace

    from lightning_efficient.planning import Rung, decide

    def measure(rung: Rung, n: int) -> tuple[bool, float, Any]:
        return False, 3000.0 + n, SimpleNamespace(by_category={"parameters": 2000})

    with pytest.raises(ValueError, match="weights alone need 1.95 KiB"):
        decide([Rung("plain", "32-true")], measure, 1000, 4)
    with pytest.raises(ValueError) as info:
        decide([Rung("plain", "32-true")], measure, 2500, 4)
    assert "weights alone" not in str(info.value)
