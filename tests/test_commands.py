"""``lightning-efficient estimate``: the breakdown table of a config's model and datamodule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_efficient.cli import EXTRA_COMMANDS, main
from lightning_efficient.core.validate import format_bytes
from lightning_efficient.demos import TinyGPT
from lightning_efficient.measure import estimate_memory

DEMO = Path(__file__).parents[1] / "configs" / "demo_plain.yaml"


def test_estimate_command_on_demo_config(capsys) -> None:
    assert "estimate" in EXTRA_COMMANDS
    assert main(["estimate", "--config", str(DEMO), "--batch-size", "2", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "TinyGPT, batch 2x128, 32-true, configured optimizer" in out
    peak = re.search(r"\*\*peak \((\w+)\)\*\* \| \*\*([0-9.]+ \w+)\*\*", out)
    assert peak, out
    # the same estimate made directly from the config's model arguments
    cfg = yaml.safe_load(DEMO.read_text())
    model = TinyGPT(**cfg["model"]["init_args"])
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
