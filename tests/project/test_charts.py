"""The pictures of the README and the method cards (issue 42): each is drawn by
``benchmarks/site/charts.py`` from the committed ``benchmarks/results/*.json`` (``python
benchmarks/site/make_index.py`` writes them all), so a chart a page links exists, is what its JSON draws
now (byte for byte: a stale or missing chart fails), says whether it is measured or estimated and
on what, and stays small. Every card with a result table links at least one chart; the README's
picture comes before the install command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.site import charts

pytest.importorskip(
    "matplotlib", reason="the charts need matplotlib: pip install 'lightning-efficient[plot]'"
)

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
IMG = DOCS / "img"
MAX_CHART_BYTES, MAX_ALL_BYTES = 300_000, 5_000_000


CHARTS = {c.name: c for c in charts.CHARTS}


def _linked(page: Path) -> list[str]:
    """The chart files a page links (``img/x.svg`` or ``docs/img/x.svg``), as names."""
    return re.findall(r"\]\((?:docs/)?img/([\w-]+)\.svg\)", page.read_text())


@pytest.mark.parametrize("name", sorted(CHARTS))
def test_chart_is_regenerated_from_its_json(name: str) -> None:
    chart = CHARTS[name]
    assert chart.path.exists(), f"{chart.path} missing: run python -m benchmarks.site.make_index"
    drawn = charts.render_chart(chart)
    assert chart.path.read_bytes() == drawn, (
        f"{chart.path.name} is stale (its JSON changed): run python -m benchmarks.site.make_index"
    )
    text = drawn.decode()
    assert re.search(r"measured|estimated", text), "says neither measured nor estimated"
    assert re.search(r"CPU|CUDA|H200|GPU", text), "names no hardware"
    assert "benchmarks/results/" in text or ".json" in text, "names no results file"
    assert len(drawn) < MAX_CHART_BYTES
    assert re.search(r"<dc:date>|\d{4}-\d\d-\d\dT", text) is None, "a date in the SVG"


def test_a_chart_is_the_same_bytes_twice_and_changes_with_its_json(monkeypatch, tmp_path) -> None:
    """The check can fail: the same JSON draws the same bytes, a changed figure other bytes."""
    import json

    chart = CHARTS["batch_size_largest"]
    first = charts.render_chart(chart)
    assert charts.render_chart(chart) == first
    data = json.loads((charts.RESULTS / "batch_size.json").read_text())
    data["gpt2"]["rows"][0]["largest_micro_batch"] += 1
    (tmp_path / "batch_size.json").write_text(json.dumps(data))
    monkeypatch.setattr(charts, "RESULTS", tmp_path)
    assert charts.render_chart(chart) != first


def test_every_linked_chart_is_made_by_the_script_and_linked_where_it_says() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    linked = {p.relative_to(ROOT).as_posix(): _linked(p) for p in pages}
    for page, names in linked.items():
        unknown = [n for n in names if n not in CHARTS]
        assert not unknown, f"{page} links pictures no script draws: {unknown}"
    for chart in CHARTS.values():
        for page in chart.pages:
            if (ROOT / page).exists():  # a card another branch adds may not be here yet
                assert chart.name in linked[page], f"{page} does not link {chart.name}"
    stray = sorted(p.name for p in IMG.iterdir() if p.stem not in CHARTS)
    assert not stray, f"files in docs/img no script writes: {stray}"
    total = sum(p.stat().st_size for p in IMG.iterdir())
    assert total < MAX_ALL_BYTES, total


def test_every_card_with_a_result_table_links_a_chart() -> None:
    cards = [c for c in sorted(DOCS.glob("*.md")) if c.name != "index.md"]
    with_tables = [c for c in cards if re.search(r"^\|.*\|\s*$", c.read_text(), flags=re.M)]
    assert len(with_tables) >= 10
    missing = [c.name for c in with_tables if not _linked(c)]
    assert not missing, f"cards with a result table and no chart: {missing}"


def test_readme_opens_with_the_picture_then_the_demo_table() -> None:
    text = (ROOT / "README.md").read_text()
    picture = text.index("](docs/img/readme_gpt2_24gib.svg)")
    assert picture < text.index("pip install"), "the picture must come before the install command"
    after = text[picture:]
    assert "StepProfiler: TinyGPT on" in after.split("pip install")[0], "no demo table below it"
    captured = (ROOT / "benchmarks" / "results" / "demo_table.md").read_text()
    table = captured.split("```text\n", 1)[1].split("```", 1)[0]
    assert table in after, "the README's demo table is not the captured run's"
    svg = (IMG / "readme_gpt2_24gib.svg").read_text()
    assert "estimated for a CUDA target, not measured on a GPU" in svg
