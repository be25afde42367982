"""``lightning-efficient estimate``: the breakdown table of a config's model and datamodule."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from command_runner import run_command

from lightning_efficient.commands import EXTRA_COMMANDS, main
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure import estimate_memory

DEMO = Path(__file__).parents[2] / "configs" / "demo_plain.yaml"


def test_estimate_command_on_demo_config(capsys) -> None:
    assert "estimate" in EXTRA_COMMANDS
    # one block (a config override, as a user gives one): the command's estimate is the subject
    one_block = "--model.init_args.n_layer=1"
    assert (
        main(["estimate", "--config", str(DEMO), "--batch-size", "2", "--markdown", one_block]) == 0
    )
    out = capsys.readouterr().out
    assert "TinyGPT, batch 2x128, 32-true, configured optimizer" in out
    peak = re.search(r"\*\*peak \((\w+)\)\*\* \| \*\*([0-9.]+ \w+)\*\*", out)
    assert peak, out
    # the same estimate made directly from the config's model arguments
    cfg = yaml.safe_load(DEMO.read_text())
    model = TinyGPT(**{**cfg["model"]["init_args"], "n_layer": 1})
    x = torch.zeros(2, 128, dtype=torch.long)
    est = estimate_memory(model, (x, x))
    assert peak.group(2) == format_bytes(est.peak_bytes) and peak.group(1) == est.peak_phase
    for cat in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"):
        assert f"| {cat} | {format_bytes(est.by_category[cat])} |" in out


def test_estimate_command_precision_and_rich_table(capsys) -> None:
    assert (
        main(
            [
                "estimate",
                "--config",
                str(DEMO),
                "--batch-size",
                "2",
                "--precision",
                "bf16-true",
                "--steps",
                "1",
                "--model.init_args.n_layer=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bf16-true" in out and "optimizer state" in out and "peak" in out


def test_estimate_command_bad_input(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--config", str(DEMO), "--precision", "fp8"])
    assert info.value.code == 2 and "fp8" in capsys.readouterr().err
    assert main(["estimate", "--config", str(DEMO), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err


# -- profile --json: never a file the run reads or the profiler writes (issue 37) ---------------
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


def _profile(config: Path, *extra: str) -> int:
    return main(["profile", "--config", str(config), "--steps", "3", *TINY_ARGS, *extra])


def test_profile_json_never_replaces_a_hard_link_or_a_sub_config(tmp_path, capsys) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(DEMO.read_text())
    before = config.read_text()
    linked = tmp_path / "linked.json"
    os.link(config, linked)  # the same file under another name
    assert _profile(config, "--json", str(linked), "--force") == 2
    err = capsys.readouterr().err
    assert "`--json`" in err and "input of this run" in err and "Traceback" not in err
    assert config.read_text() == before
    # a sub-config given as `--trainer FILE` is read by the run too
    sub = tmp_path / "trainer.yaml"
    sub.write_text("max_epochs: 1\n")
    for given in (["--trainer", str(sub)], [f"--trainer={sub}"]):
        assert _profile(config, *given, "--json", str(sub), "--force") == 2
        assert "input of this run" in capsys.readouterr().err
    assert sub.read_text() == "max_epochs: 1\n"


def test_profile_json_dangling_link_needs_force(tmp_path, capsys) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(DEMO.read_text())
    target = tmp_path / "elsewhere.json"
    link = tmp_path / "profile.json"
    link.symlink_to(target)  # a link to a file that does not exist (yet)
    assert _profile(config, "--json", str(link)) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and "--force" in err and "Traceback" not in err
    assert not target.exists()  # nothing was created through the link


def test_profile_json_is_not_the_config_profilers_trace(tmp_path, capsys) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(DEMO.read_text())
    trace = tmp_path / "trace.json"
    traced = tmp_path / "traced.yaml"
    profiler = {"class_path": "StepProfiler", "init_args": {"skip_steps": 1, "trace": str(trace)}}
    traced.write_text(yaml.safe_dump({"trainer": {"callbacks": [profiler]}}))
    for extra in ([], ["--force"]):
        assert _profile(config, "--config", str(traced), "--json", str(trace), *extra) == 2
        err = capsys.readouterr().err
        assert "StepProfiler writes as `trace`" in err and "Traceback" not in err
        assert not trace.exists()  # refused before the run


def test_fit_without_a_logger_writes_no_config_in_the_working_folder(tmp_path, capsys) -> None:
    """The command in the test's process (``main``), from ``tmp_path`` as its working folder."""
    mine = tmp_path / "config.yaml"
    mine.write_text("# my own notes\ntrainer: {max_steps: 1}\n")
    proc = run_command(
        capsys,
        "fit",
        "--config",
        str(mine),
        "--trainer.accelerator=cpu",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.limit_val_batches=0",
        "--data.max_train_samples=16",
        "--data.batch_size=4",
        "--model.n_layer=1",
        "--model.n_embd=16",
        "--model.n_head=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert mine.read_text().startswith("# my own notes")  # not replaced by the saved config
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".yaml") == ["config.yaml"]


def test_fit_with_a_budget_that_cannot_be_met_ends_with_a_short_error(tmp_path, capsys) -> None:
    proc = run_command(
        capsys,
        "fit",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks+=ActivationCheckpointing",
        "--trainer.callbacks.budget=1KiB",
        "--data.max_train_samples=16",
        "--data.batch_size=4",
        "--model.n_layer=2",
        "--model.n_embd=16",
        "--model.n_head=2",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error:") or "\nerror: `budget`" in proc.stderr
    assert "smallest achievable peak" in proc.stderr
