"""The command line: help lists our classes, bad configuration ends with a short error."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from command_runner import run_command

from lightning_efficient import TECHNIQUES
from lightning_efficient.commands import main
from lightning_efficient.commands.cli import reason_first

ROOT = Path(__file__).parents[2]


def test_fit_help_lists_package_classes(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "lightning-efficient callbacks" in out
    for cls in TECHNIQUES:
        assert cls.__name__ in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--trainer.callbacks=NoSuchCallback"], "NoSuchCallback"),
        (["--trainer.max_steps=-5"], "max_steps"),
        (["--trainer.max_steps=abc"], "max_steps"),
    ],
    ids=["unknown-callback", "negative-max-steps", "wrong-type"],
)
def test_bad_configuration_short_error(args, needle, capsys) -> None:
    """In the test's process (``main``, as the console script calls it)."""
    proc = run_command(capsys, "fit", "--trainer.accelerator=cpu", *args, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = proc.stderr[proc.stderr.index("error:") :]
    assert needle in error and len(error.splitlines()) < 20, error


#: What the demo printed before it was quietened (issue 30): none of it may come back.
DEMO_NOISE = [
    "kernels-community",  # bitsandbytes' optional 4-bit kernel
    "Tip: For seamless cloud logging",  # Lightning's advertisement
    "is not supported by the model summary",  # the summary's precision warning
    "LeafSpec",  # a torch deprecation inside Lightning
]


@pytest.mark.slow
def test_demo_config_fits_quietly_and_leaves_no_file(tmp_path) -> None:
    """The README's demo through the command line, shortened (its techniques and report on a
    smaller TinyGPT, 20 steps; CI runs the whole demo in a fresh clone), from an empty working
    folder: the perplexity falls; the output is the fit's progress, the techniques' notes and the
    report, without other libraries' noise or a loader "changed" to what it was; no file is left."""
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_efficient",
            "fit",
            "--config",
            str(ROOT / "configs" / "demo.yaml"),
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=20",
            "--trainer.val_check_interval=10",
            "--trainer.limit_val_batches=2",
            "--model.init_args.n_layer=2",
            "--model.init_args.n_embd=64",
            "--model.init_args.seq_len=64",
            "--model.init_args.warmup_steps=5",
            "--data.init_args.seq_len=64",
            "--data.init_args.batch_size=8",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = map(
        float, re.search(r"validation perplexity: ([\d.]+) -> ([\d.]+)", proc.stdout).groups()
    )
    assert first > 200 and last < 0.5 * first, (first, last)
    output = proc.stdout + proc.stderr
    assert "lightning-efficient report" in proc.stdout and "DataLoaderTuning" in proc.stdout
    assert [n for n in DEMO_NOISE if n in output] == [], output[-4000:]
    assert not re.search(r"num_workers (\d+)->\1\b", output), output[-4000:]
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == []


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_builds(config) -> None:
    """Each shipped config builds its trainer, model and data through the CLI parser."""
    from lightning_efficient.commands.cli import EfficientCLI

    cli = EfficientCLI(
        args=[
            "--config",
            str(ROOT / "configs" / "demo_plain.yaml"),
            "--config",
            str(config),
            "--trainer.accelerator=cpu",
        ],
        run=False,
    )
    assert cli.model is not None and cli.datamodule is not None
    import yaml

    wanted = [
        c["class_path"]
        for c in (yaml.safe_load(config.read_text()).get("trainer") or {}).get("callbacks") or []
    ]
    built = [type(cb).__name__ for cb in cli.trainer.callbacks]
    assert all(name.rsplit(".", 1)[-1] in built for name in wanted), (wanted, built)


def test_progress_bar_of_a_run_bounded_by_steps_reads_its_epoch() -> None:
    """Issue 37: with ``max_steps`` and no ``max_epochs`` (the demo's configs) Lightning sets
    ``max_epochs=-1`` and its rich bar read "Epoch 0/-2"; the CLI's bar reads "Epoch 0". A bar the
    config gives is kept as given."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import RichProgressBar

    from lightning_efficient.commands.cli import EfficientCLI, EpochBar

    seen: list[str] = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            seen.extend(t.description for t in trainer.progress_bar_callback.progress.tasks)

    tiny = [
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=true",
        "--model.init_args.n_layer=1",
    ]
    cli = EfficientCLI(args=tiny, run=False)
    assert type(cli.trainer.progress_bar_callback) is EpochBar
    cli.trainer.callbacks.append(Probe())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.max_epochs == -1  # what Lightning makes of max_steps alone
    assert cli.trainer.global_step == 2 and seen and {s.strip() for s in seen} == {"Epoch 0"}
    # a configured bar stays as given; none where the config turns the bar off
    bar = "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"
    given = EfficientCLI(args=[*tiny, bar], run=False).trainer.progress_bar_callback
    assert type(given) is RichProgressBar
    off = EfficientCLI(args=[*tiny, "--trainer.enable_progress_bar=false"], run=False)
    assert off.trainer.progress_bar_callback is None


# -- a model that owns its data (issue 49) -----------------------------------------------------
QLORA = """\
model:
  class_path: own_loader.OwnLoaderLoRA
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: FrozenWeights4bit
    - class_path: ActivationCheckpointing
    - class_path: ChunkedCrossEntropy
"""


@pytest.mark.parametrize("data", ["absent", "null"])
def test_a_model_with_its_own_loader_runs_from_a_yaml(data, tmp_path, capsys) -> None:
    """Issue 49: a yaml whose model builds its own loader and names no `data` (or `data: null`)
    trains on that loader, as with Lightning's CLI; the command substituted the demo's
    TextDataModule (then a RuntimeError) or asked for `fit.data`."""
    pytest.importorskip("peft")
    from own_loader import OwnLoaderLoRA

    config = tmp_path / "qlora.yaml"
    config.write_text(QLORA + ("data: null\n" if data == "null" else ""))
    OwnLoaderLoRA.trained_on.clear()
    proc = run_command(capsys, "fit", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert OwnLoaderLoRA.trained_on == [(("attention_mask", "input_ids", "labels"), 32)] * 2
    assert "frozen linear weights in 4 bits" in proc.stdout and "2 of 2 training" in proc.stdout


def test_estimate_takes_its_batch_from_the_models_own_loader(tmp_path, capsys) -> None:
    """The commands that build a config without fitting (estimate, plan) take their batch from
    the model's own loader when the config names no data."""
    pytest.importorskip("peft")
    config = tmp_path / "lora.yaml"
    config.write_text("model:\n  class_path: own_loader.OwnLoaderLoRA\n")
    proc = run_command(capsys, "estimate", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak" in proc.stdout and "parameters" in proc.stdout


def test_the_demo_data_serves_only_the_demo_model_or_when_asked(tmp_path, capsys) -> None:
    """The demo model without `data` gets the demo's data; another model gets it when the config
    or the command line names it; a class the config names takes its own defaults, not the
    demo's; a model with no loader and no data ends with a short error
    before training (naming the class, never printing the model)."""
    pytest.importorskip("peft")
    from lightning_efficient.commands.cli import EfficientCLI
    from lightning_efficient.demos import TextDataModule

    def cli(*args: str) -> EfficientCLI:
        return EfficientCLI(args=["--trainer.accelerator=cpu", *args], run=False)

    def data_of(*args: str) -> object:
        return cli(*args).datamodule

    assert isinstance(data_of(), TextDataModule)
    assert data_of("--data.max_train_samples=16").hparams.max_train_samples == 16
    own = "--model=own_loader.OwnLoaderLoRA"
    assert data_of(own) is None
    # the demo's init_args never reach a class the config names (jsonargparse keeps those a new
    # class_path shares with the one before it: TinyGPT's seq_len 128, TextDataModule's batch 16)
    assert cli(own).model.seq_len == 32
    assert data_of("--data=own_loader.DocumentsData").batch_size == 2
    asked = tmp_path / "asked.yaml"
    asked.write_text("data:\n  class_path: lightning_efficient.demos.TextDataModule\n")
    assert isinstance(data_of(own, "--config", str(asked)), TextDataModule)
    assert isinstance(data_of(own, "--data=TextDataModule"), TextDataModule)
    proc = run_command(
        capsys, "fit", "--model=own_loader.LoRAWithoutData", "--trainer.accelerator=cpu",
        "--trainer.logger=false", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr[proc.stderr.index("error:") :]
    assert "LoRAWithoutData" in error and "train_dataloader()" in error and "`data:`" in error
    assert "Llama" not in error and len(error.splitlines()) < 3, error
    assert "Epoch" not in proc.stdout + proc.stderr  # before training


def test_an_error_note_never_prints_a_whole_model(capsys) -> None:
    """Python's "X(...) argument after ** must be a mapping" repeats the callable's repr: with a
    PEFT model, hundreds of lines in a one-line note (issue 49); the notes show ``Name(...)``."""
    from lightning_efficient.core.validate import error_text

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(TypeError) as info:
        model(**(1, 2))
    assert len(str(info.value).splitlines()) == 4
    text = error_text(info.value)
    assert text == "TypeError: Sequential(...) argument after ** must be a mapping, not tuple"
    assert len(error_text(ValueError("x" * 1000))) == len("ValueError: ") + 300
    # and the commands' own error lines
    from lightning_efficient.commands.options import error_status

    assert error_status(str(info.value)) == 2
    assert capsys.readouterr().err == (
        "error: Sequential(...) argument after ** must be a mapping, not tuple\n"
    )


def test_a_stateful_technique_twice_in_a_config_is_said_before_the_trainer(capsys) -> None:
    from lightning_efficient.commands.cli import EfficientCLI

    swap = "--trainer.callbacks+=OptimizerSwap"
    with pytest.raises(SystemExit) as info:
        EfficientCLI(
            args=["--trainer.accelerator=cpu", swap, "--trainer.callbacks.name=adamw8bit", swap,
                  "--trainer.callbacks.name=adamw_fused"],
            run=False,
        )  # fmt: skip
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert "OptimizerSwap is given more than once" in error and "Keep one instance" in error
    assert "Found more than one stateful callback" not in error  # not Lightning's generic one


def test_the_reason_of_a_bad_callback_argument_comes_first() -> None:
    message = (
        "Does not validate against any of the Union subtypes\nErrors:\n"
        "  - `every_n` must be >= 1; got -3.\n  - Not a valid subclass of Callback\n"
    )
    assert reason_first(message).splitlines()[0] == "`every_n` must be >= 1; got -3."
    assert reason_first("plain message") == "plain message"
