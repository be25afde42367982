"""The command line: help lists our classes, bad configuration ends with a short error."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_efficient.cli import main
from lightning_efficient.techniques import TECHNIQUES

ROOT = Path(__file__).parents[1]


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_efficient", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


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
def test_bad_configuration_short_error(args, needle) -> None:
    proc = run_cli("fit", "--trainer.accelerator=cpu", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = proc.stderr[proc.stderr.index("error:") :]
    assert needle in error and len(error.splitlines()) < 20, error


def test_demo_config_fits_and_perplexity_falls(tmp_path) -> None:
    proc = run_cli(
        "fit",
        "--config",
        "configs/demo.yaml",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=60",
        "--trainer.val_check_interval=30",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = map(
        float, re.search(r"validation perplexity: ([\d.]+) -> ([\d.]+)", proc.stdout).groups()
    )
    assert first > 200 and last < 0.5 * first, (first, last)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_builds(config) -> None:
    """Each shipped config builds its trainer, model and data through the CLI parser."""
    from lightning_efficient.cli import EfficientCLI

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
