"""A measurement changes nothing (measure/scratch.py): the fake-tensor estimate and the real trial
steps leave the module as they found it, beyond its state_dict (issues 37 row 8, 39)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_efficient.measure.memory.estimate import estimate_memory
from lightning_efficient.measure.memory.track import measure_step
from lightning_efficient.measure.memory.types import EstimateError
from lightning_efficient.measure.scratch import keep_module_state, scratch
from lightning_efficient.measure.speed.flops import count_flops
from lightning_efficient.measure.speed.step_rate import estimated_step_rate
from lightning_efficient.measure.trials.trial import throughput, trial_step, trial_within


def _square_loss(mod: nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return mod(batch[0]).square().mean()


class CachedBuffer(nn.Module):
    """Registers an index buffer at its first forward (as LitGPT's LoRAQKVLinear does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_idx"):
            self.register_buffer("_idx", torch.arange(8), persistent=False)
        return self.lin(x)[..., self._idx]


class CachedAttribute(nn.Module):
    """Caches a plain tensor attribute at its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = torch.full((8,), 0.5)
        return self.lin(x) * self.scale


@pytest.mark.parametrize("fake_run", ["estimate", "count_flops"])
@pytest.mark.parametrize("cls", [CachedBuffer, CachedAttribute])
def test_estimate_leaves_no_fake_tensor_on_the_module(cls: type[nn.Module], fake_run: str) -> None:
    torch.manual_seed(0)
    model, x = cls(), torch.randn(4, 8)
    reference = cls()
    reference.load_state_dict(model.state_dict())
    hooks = len(model._forward_hooks)
    if fake_run == "estimate":
        estimate_memory(model, (x,), loss_fn=_square_loss)
    else:  # the FLOP count runs the same fake forward
        assert count_flops(model, (x,), loss_fn=_square_loss).forward > 0
    # what the forward cached under the fake mode is gone: the real run caches real tensors
    assert getattr(model, "_idx", None) is None and getattr(model, "scale", None) is None
    assert len(model._forward_hooks) == hooks
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            _square_loss(m, (x,)).backward()
            opt.step()
            opt.zero_grad()
    assert all(type(p.grad) is not torch.Tensor for p in model.parameters())  # grads dropped
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert type(a) is torch.Tensor, name
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _litgpt_lora() -> pl.LightningModule:
    pytest.importorskip("litgpt")
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    class LoRAModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = Config.from_name(
                "pythia-14m", lora_r=4, lora_alpha=8, lora_query=True, lora_value=True
            )
            config.n_layer, config.block_size = 2, 32
            self.model = GPT(config)
            mark_only_lora_as_trainable(self.model)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.model(batch[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    torch.manual_seed(0)
    return LoRAModule()


def _lora_after_steps(module: pl.LightningModule, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    opt = module.configure_optimizers()
    for _ in range(3):
        module.training_step(batch, 0).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}


def test_litgpt_lora_learns_after_the_estimate() -> None:
    plain, estimated = _litgpt_lora(), _litgpt_lora()
    estimated.load_state_dict(plain.state_dict())
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    estimate_memory(estimated, batch)
    ref = _lora_after_steps(plain, batch)
    got = _lora_after_steps(estimated, batch)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in got.items())  # B moved from 0
    for name, value in ref.items():
        assert type(got[name]) is torch.Tensor
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=0)


# -- real trial steps ----------------------------------------------------------------------------
class Stateful(pl.LightningModule):
    """Everything a trial step must put back: a sample counter, a non-persistent buffer, a
    torchmetrics metric, dropout (the RNG)."""

    def __init__(self) -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
        self.seen = 0
        self.register_buffer("sums", torch.zeros(4), persistent=False)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        self.seen += len(x)
        self.sums += logits.detach().sum(0)
        self.acc(logits.detach(), y)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _stateful_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _run(module: Stateful, steps: int = 3) -> dict[str, object]:
    opt = module.configure_optimizers()
    losses = []
    for _ in range(steps):
        loss = module.training_step(_stateful_batch(), 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "seen": module.seen,
        "sums": module.sums.clone(),
        "acc": float(module.acc.compute()),
        "weights": {k: v.clone() for k, v in module.state_dict().items()},
    }


@pytest.mark.parametrize(
    "trial",
    [
        "trial_step",
        "throughput",
        "trial_within",
        "estimate",
        "measure_step",
        "step_rate",
        "count_flops",
    ],
)
def test_a_trial_changes_nothing_the_run_sees(trial: str) -> None:
    torch.manual_seed(0)
    plain, tried = Stateful(), Stateful()
    tried.load_state_dict(plain.state_dict())
    for m in (plain, tried):  # state accumulated before the trial
        torch.manual_seed(2)
        m.training_step(_stateful_batch(), 0)
    batch = _stateful_batch()
    torch.manual_seed(1)
    expected = _run(plain)
    torch.manual_seed(1)
    if trial == "trial_step":
        trial_step(tried, batch, "sgd")
    elif trial == "throughput":
        throughput(tried, batch, "sgd", samples=16)
    elif trial == "trial_within":
        assert trial_within(tried, batch, steps=2).ok
    elif trial == "measure_step":  # real steps on the CPU's tracker: the module put back too
        assert measure_step(tried, batch, "sgd", steps=2).peak_bytes > 0
    elif trial == "step_rate":  # the step's counters and metric as they were
        assert estimated_step_rate(tried, batch, repeats=2) > 0
    elif trial == "count_flops":  # the fake forward reaches torchmetrics' bincount and stops
        with pytest.raises(Exception, match="bincount"):
            count_flops(tried, batch)
    else:  # torchmetrics' bincount needs real values: the estimate says so, and changes nothing
        with pytest.raises(EstimateError, match="bincount"):
            estimate_memory(tried, batch)
    got = _run(tried)
    assert got["losses"] == expected["losses"]
    assert got["seen"] == expected["seen"] == 64
    assert torch.equal(got["sums"], expected["sums"]) and got["acc"] == expected["acc"]
    for k, v in expected["weights"].items():
        assert torch.equal(got["weights"][k], v), k


def test_keep_module_state_puts_back_everything_in_place() -> None:
    torch.manual_seed(0)
    module = Stateful()
    module.net[0].weight.grad = torch.ones_like(module.net[0].weight)
    weight, grad, sums = module.net[0].weight, module.net[0].weight.grad, module.sums
    state = torch.get_rng_state()
    with keep_module_state(module):
        module.training_step(_stateful_batch(), 0).backward()
        module.extra = nn.Linear(2, 2)
        module.register_forward_hook(lambda *a: None)
        module.net[0].weight.requires_grad_(False)
        module.sums = module.sums + 1  # rebound (as .to(device) rebinds buffers)
        torch.rand(3)
    assert module.seen == 0 and not hasattr(module, "extra") and not module._forward_hooks
    assert module.net[0].weight is weight and module.net[0].weight.grad is grad
    assert torch.equal(grad, torch.ones_like(grad)) and weight.requires_grad
    assert module.sums is sums and not sums.any() and module.acc._update_count == 0
    assert torch.equal(torch.get_rng_state(), state)


def test_scratch_reraises_and_still_puts_back() -> None:
    module = Stateful()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ZeroDivisionError), scratch(module, "cpu"):
        module.training_step(_stateful_batch(), 0).backward()
        raise ZeroDivisionError
    assert module.seen == 0 and all(p.grad is None for p in module.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_estimate_of_an_uninitialised_lazy_module_says_what_to_do() -> None:
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 1))
    batch = (torch.randn(4, 5),)
    with pytest.raises(ValueError, match=r"LazyLinear at '0'.*forward on a real example batch"):
        estimate_memory(model, batch, loss_fn=lambda mod, b: mod(b[0]).mean())
    with torch.no_grad():
        model(batch[0])  # initialised: the estimate runs
    assert estimate_memory(model, batch, loss_fn=lambda mod, b: mod(b[0]).mean()).peak_bytes > 0


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, batch: torch.Tensor) -> None:
        self.rows = batch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


@pytest.mark.parametrize("technique", ["ActivationCheckpointing", "AutoEfficient"])
def test_litgpt_lora_learns_under_the_techniques_that_estimate(technique: str, tmp_path) -> None:
    """The fake-tensor paths of a fit (checkpointing's budget mode, AutoEfficient's plan): the
    LoRA weights after 3 steps are the plain run's, and lora_B moved from 0 (issue 39)."""
    from lightning_efficient import ActivationCheckpointing, AutoEfficient

    rows = torch.randint(0, 100, (6, 17), generator=torch.Generator().manual_seed(1))
    made = {
        "ActivationCheckpointing": lambda: ActivationCheckpointing(budget="4GiB"),
        "AutoEfficient": lambda: AutoEfficient(budget="4GiB", trial=False),
    }

    def lora_after_fit(callbacks: list) -> dict[str, torch.Tensor]:
        module = _litgpt_lora()
        module.batch_size = 2
        module.train_dataloader = lambda: torch.utils.data.DataLoader(
            _Tokens(rows), batch_size=module.batch_size
        )
        trainer = pl.Trainer(
            max_steps=3,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            accelerator="cpu",
        )
        trainer.fit(module)
        return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}

    ref = lora_after_fit([])
    got = lora_after_fit([made[technique]()])
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in got.items())
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=0)
