"""The efficiency report: rich table, Markdown, dict, logger metrics, PNG."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from lightning_efficient.core.report import (
    EfficiencyReport,
    format_figure,
    print_table,
    report_for,
)


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


def test_printed_to_a_pipe_no_figure_is_split(capsys) -> None:
    """Issue 37: standard output that is not a terminal (a pipe, a log file) has no width, and rich
    assumed 80 columns and folded figures ("1 .95 MiB"): every row now stays whole there."""
    report = EfficiencyReport()
    change = "checkpointed 4 of 4 blocks (TransformerBlock) with the policy the budget chose"
    figures = {
        "activation_bytes_saved": 2045000,
        "peak_before_bytes": 12345678,
        "peak_after_bytes": 2045000,
        "step_s": 0.0123,
    }
    report.add("ActivationCheckpointing", change, **figures)
    report.print()
    out = capsys.readouterr().out
    wanted = [change, "peak_after_bytes=1.95 MiB", "peak_before_bytes=11.77 MiB"]
    wanted += ["activation_bytes_saved=2045000", "step_s=0.0123 s"]
    assert all(text in out for text in wanted), out
    assert max(map(len, out.splitlines())) > 80  # wider than rich's default, as it must be
    # any rich table, e.g. the planner's and the estimate's, prints the same way
    from rich.table import Table

    table = Table()
    table.add_column("Stack", overflow="fold")
    table.add_column("Device peak", overflow="fold")
    table.add_row("bf16-mixed + ActivationCheckpointing(blocks=12) + OptimizerSwap" * 2, "1.95 MiB")
    print_table(table)
    out = capsys.readouterr().out
    assert "1.95 MiB" in out and len(out.splitlines()) == 5  # header 3 lines, 1 row, bottom
    # on a terminal the table keeps to the terminal's width (wrapped there)
    console = Console(record=True, width=80, force_terminal=True)
    console.print(report.to_rich())
    assert max(map(len, console.export_text().splitlines())) <= 80


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


# -- several ranks -------------------------------------------------------------------------------
def _gathered() -> EfficiencyReport:
    """A report as rank zero holds it after a gather over 2 ranks (figures set by hand)."""
    report = EfficiencyReport()
    mem = report.add("MemoryBreakdown", "measured step 1", peak_bytes=790 * 2**10, groups=2)
    mem.per_rank = [{"peak_bytes": 790 * 2**10, "groups": 2}, {"peak_bytes": 803 * 2**10}]
    stop = report.add("EarlyStopper", "stopped at step 13", stopped_step=13, step_s=0.5)
    stop.decisions = ("stopped_step",)
    stop.per_rank = [{"stopped_step": 13, "step_s": 0.5}, {"stopped_step": 13, "step_s": 0.5}]
    report.ranks = 2
    return report


def test_gathered_rows_show_the_spread(tmp_path) -> None:
    report = _gathered()
    md = report.to_markdown().splitlines()
    assert md[2] == (
        "| MemoryBreakdown | measured step 1 | peak_bytes=803.00 KiB (worst rank 1; ranks "
        "790.00-803.00 KiB), groups=2 |"
    )
    assert (
        md[3]
        == "| EarlyStopper | stopped at step 13 | stopped_step=13 (same on 2 ranks), step_s=0.5 s |"
    )
    row = report.to_dict()["MemoryBreakdown"]
    assert row["peak_bytes"] == 790 * 2**10  # this rank's own value stays
    assert row["spread"] == {
        "peak_bytes": {"min": 790 * 2**10, "max": 803 * 2**10, "worst_rank": 1}
    }
    assert row["per_rank"][1] == {"peak_bytes": 803 * 2**10}
    assert report.to_dict()["EarlyStopper"]["spread"]["stopped_step"] == {
        "same": True,
        "values": [13, 13],
    }
    metrics = report.metrics()
    assert metrics["efficiency/MemoryBreakdown/peak_bytes/max"] == 803 * 2**10
    assert metrics["efficiency/MemoryBreakdown/peak_bytes/min"] == 790 * 2**10
    assert "efficiency/MemoryBreakdown/groups/max" not in metrics
    console = Console(record=True, width=200)
    console.print(report.to_rich())
    text = console.export_text()
    assert "lightning-efficient report (2 ranks)" in text and "worst rank 1" in text
    assert report.disagreements() == []
    report["EarlyStopper"].per_rank[1]["stopped_step"] = 14
    assert report.disagreements() == [
        "EarlyStopper: the ranks took different decisions, stopped_step: rank 0 13, rank 1 14."
    ]
    assert "stopped_step=13 (ranks differ: 13, 14)" in report.to_markdown()
    png = report.to_png(tmp_path / "ranks.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_process_fit_gathers_nothing_and_renders_as_before(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist
    from helpers import fit

    from lightning_efficient.measure import MemoryBreakdown
    from lightning_efficient.techniques import EarlyStopper

    def no_collective(*args, **kwargs):
        raise AssertionError("a 1-process fit ran a collective")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    stopper = EarlyStopper("train_loss", check_every_n_steps=1, patience=2, min_delta=10.0)
    trainer, _, _ = fit(
        tmp_path, [MemoryBreakdown(print_table=False), stopper], max_steps=4, limit_val_batches=0
    )
    report = report_for(trainer)
    assert report.gather(trainer) is False and report.ranks == 1
    assert all(e.per_rank is None for e in report.entries)
    assert report["EarlyStopper"].decisions == ("stopped_step", "best_step")
    assert "stopped_step" in report["EarlyStopper"].figures and "MemoryBreakdown" in report
    # the rendering of one process: every figure as format_figure writes it, nothing added
    lines = report.to_markdown().splitlines()[2:]
    for line, e in zip(lines, report.entries, strict=True):
        figures = ", ".join(f"{k}={format_figure(k, v)}" for k, v in e.figures.items())
        assert line == f"| {e.technique} | {e.change} | {figures} |"
    assert "rank" not in report.to_markdown() and "per_rank" not in str(report.to_dict())
    assert not any(k.endswith(("/max", "/min")) for k in report.metrics())


# -- 2 processes: gathered once, printed once by rank zero ---------------------------------------
@pytest.mark.slow
@pytest.mark.ddp_case("reports")  # tests/multiprocess/ddp_reports.py
def test_two_ranks_print_one_report_with_the_worst_rank(ddp_case) -> None:
    """Two fits in the session's 2-process launch: DDP, then FullyShardedStrategy."""
    tmp_path = ddp_case
    stdout, stderr = ("".join((tmp_path / f"rank{r}.{ext}").read_text() for r in (0, 1))
                      for ext in ("out", "err"))  # fmt: skip
    # both ranks' output is kept: one table a fit, printed by rank zero
    assert stdout.count("lightning-efficient report (2 ranks)") == 2, stdout[-4000:]
    assert stdout.count("lightning-efficient report") == 2
    assert "took different decisions" not in stderr
    for strategy in ("ddp", "fsdp"):
        r0, r1 = (json.loads((tmp_path / f"{strategy}-rank{r}.json").read_text()) for r in (0, 1))
        _check_gathered(r0, r1)
        # issue 33 item 6: each rank wrote its own trace, none wrote the shared name
        traces = sorted(p.name for p in tmp_path.glob(f"{strategy}-trace*"))
        assert traces == [f"{strategy}-trace.rank0.json", f"{strategy}-trace.rank1.json"]
        for name in traces:
            assert json.loads((tmp_path / name).read_text())["traceEvents"]
    assert "one file per rank, 2 ranks" in stderr + stdout
    assert "FullyShardedStrategy" in r0["report"]  # the second fit was sharded


def _check_gathered(r0: dict, r1: dict) -> None:
    assert r0["shown_again"] is False  # and it returned at once, without a collective
    # rank 1 held 2 MiB more through the measured backward: the report names it the worst
    assert r1["own_peak_bytes"] > r0["own_peak_bytes"] + 2**20
    memory = r0["report"]["MemoryBreakdown"]
    assert memory["peak_bytes"] == r0["own_peak_bytes"]  # rank zero's own figure stays
    assert memory["spread"]["peak_bytes"] == {
        "min": r0["own_peak_bytes"],
        "max": r1["own_peak_bytes"],
        "worst_rank": 1,
    }
    rows = {line.split(" | ")[0].strip("| "): line for line in r0["markdown"].splitlines()}
    assert "(worst rank 1; ranks " in rows["MemoryBreakdown"]
    assert r0["metrics"]["efficiency/MemoryBreakdown/peak_bytes/max"] == r1["own_peak_bytes"]
    # the profiler's step time of the slowest rank, with both ranks' range
    profiler = r0["report"]["StepProfiler"]
    step = profiler["spread"]["step_s"]
    times = [f["step_s"] for f in profiler["per_rank"]]
    assert step == {"min": min(times), "max": max(times), "slowest_rank": times.index(max(times))}
    # early stopping: the same decision on both ranks, said so in the row
    stopper = r0["report"]["EarlyStopper"]
    stopped = stopper["stopped_step"]
    assert stopped == r0["global_step"] == r1["global_step"] == 5
    assert stopper["spread"]["stopped_step"] == {"same": True, "values": [stopped, stopped]}
    assert f"stopped_step={stopped} (same on 2 ranks)" in rows["EarlyStopper"]
    assert "trips=0 (same on 2 ranks)" in rows["DivergenceGuard"]
    # every rank gathered the same figures (all_gather); only rank zero printed them
    assert r1["report"]["MemoryBreakdown"]["per_rank"] == memory["per_rank"]
