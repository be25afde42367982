"""The efficiency report: rich table, Markdown, dict, logger metrics, PNG."""

from __future__ import annotations

from rich.console import Console

from lightning_efficient.core.report import EfficiencyReport, format_figure, report_for


def _report() -> EfficiencyReport:
    report = EfficiencyReport()
    report.add("ActivationCheckpointing", "wrapped 4 blocks", saved_bytes=3 * 2**30, step_s=0.25)
    report.add("OptimizerSwap", "AdamW -> AdamW8bit", state_ratio=0.25, groups=2)
    return report


def test_dict_markdown_and_units() -> None:
    report = _report()
    assert report.to_dict() == {
        "ActivationCheckpointing": {
            "change": "wrapped 4 blocks",
            "saved_bytes": 3 * 2**30,
            "step_s": 0.25,
        },
        "OptimizerSwap": {"change": "AdamW -> AdamW8bit", "state_ratio": 0.25, "groups": 2},
    }
    md = report.to_markdown().splitlines()
    assert md[0] == "| Technique | What changed | Figures |"
    assert (
        md[2]
        == "| ActivationCheckpointing | wrapped 4 blocks | saved_bytes=3.00 GiB, step_s=0.25 s |"
    )
    assert md[3] == "| OptimizerSwap | AdamW -> AdamW8bit | state_ratio=0.250x, groups=2 |"
    assert format_figure("flag", True) == "True" and format_figure("x", 1.23456) == "1.235"
    # adding the same technique again replaces its row; update adds figures
    report.add("OptimizerSwap", "AdamW -> SGD")
    report.update("OptimizerSwap", state_bytes=0)
    assert len(report) == 2 and report["OptimizerSwap"].figures == {"state_bytes": 0}
    assert report.metrics() == {
        "efficiency/ActivationCheckpointing/saved_bytes": float(3 * 2**30),
        "efficiency/ActivationCheckpointing/step_s": 0.25,
        "efficiency/OptimizerSwap/state_bytes": 0.0,
    }


def test_rich_table_and_show_once(capsys) -> None:
    report = _report()
    console = Console(record=True, width=120)
    console.print(report.to_rich())
    text = console.export_text()
    assert "ActivationCheckpointing" in text and "3.00 GiB" in text
    capsys.readouterr()
    assert report.show() is True
    assert report.show() is False  # once per change
    assert capsys.readouterr().out.count("OptimizerSwap") == 1
    report.update("OptimizerSwap", extra=1)
    assert report.show() is True


def test_png_written(tmp_path) -> None:
    path = _report().to_png(tmp_path / "report.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    only_bytes = _report().to_png(tmp_path / "bytes.png", figure="bytes")
    assert only_bytes.stat().st_size > 2000


def test_report_per_trainer() -> None:
    class T:
        pass

    a, b = T(), T()
    report_for(a).add("X", "changed")
    assert "X" in report_for(a) and "X" not in report_for(b)
    assert report_for(a) is report_for(a)
