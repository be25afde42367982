"""benchmarks/gpu_suite.py: its dry run works end to end (so the GPU run is known to start), and
its parsers, lookups and output are right. The dry run is the same script on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
KEYS = ["pytest", "estimate", "batch", "ladder", "speed", "compile"]


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def suite():
    return _load("gpu_suite")


# -- the dry run -------------------------------------------------------------------------------
@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path) -> None:
    before = sorted(p.name for p in (BENCH / "results").glob("gpu_*"))
    # the caps scale with the budget: 4x the default leaves room for a machine whose cores are
    # shared (idle, the dry run takes about 2 minutes)
    cmd = [sys.executable, str(BENCH / "gpu_suite.py"), "--dry-run", "--out", str(tmp_path)]
    cmd += ["--budget-s", "1920"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md, js, log = (tmp_path / f"gpu_dry_run_cpu.{ext}" for ext in ("md", "json", "log"))
    assert md.exists() and js.exists() and log.exists()
    assert sorted(p.name for p in (BENCH / "results").glob("gpu_*")) == before

    data = json.loads(js.read_text())
    assert data["dry_run"] is True and data["format_version"] == 1
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    for dist in ("torch", "lightning", "deepspeed", "bitsandbytes", "transformers"):
        assert data["environment"][dist]
    assert data["total_s"] > 0 and data["budget_s"] == 1920
    assert [p["key"] for p in data["parts"]] == KEYS
    for part in data["parts"]:
        name = f"part {part['number']} ({part['key']})"
        assert part["status"] in ("ok", "partial", "skipped", "timeout"), (name, part)
        assert part["status"] == "ok" or part["reason"], name  # not ok: it says why
        assert part["seconds"] >= 0 and part["cap_s"] > 0
        for row in part["rows"]:
            assert not str(row.get("status", "")).startswith("error"), (name, row)
        assert f"## {part['number']}. {part['title']}" in md.read_text()
    by = {p["key"]: p for p in data["parts"]}
    # the parts whose code would otherwise meet the GPU untested must have run
    assert by["pytest"]["reason"] == "collected only (dry run)" and by["pytest"]["rows"]
    assert all(r["outcome"] == "collected" for r in by["pytest"]["rows"])
    for key in ("estimate", "batch", "speed", "compile"):
        assert by[key]["status"] in ("ok", "partial") and by[key]["headline"], by[key]
    estimate = [r for r in by["estimate"]["rows"] if "ratio" in r]
    assert estimate, by["estimate"]
    for r in estimate:  # on the CPU the estimate is exact (same storages, tracked both ways)
        assert r["estimate_bytes"] > 0 and abs(r["ratio"] - 1) < 0.05, r
    batch = by["batch"]["rows"]
    assert batch[0]["status"] == "ok" and batch[0]["largest_micro_batch"] >= 1
    assert batch[-1]["largest_micro_batch"] > batch[0]["largest_micro_batch"]  # the planner's stack
    ladder = {r["setting"].split(",")[0]: r for r in by["ladder"]["rows"]}
    assert ladder["plain Lightning"]["largest_trained"]
    speed = by["speed"]["rows"]
    assert len(speed) == 2 and all(r["tokens_per_s"] > 0 for r in speed)
    assert {r["variant"] for r in by["compile"]["rows"]} == {"regional", "whole", "eager"}
    assert "**Dry run**" in md.read_text()


# -- the pieces, without running anything --------------------------------------------------------
def test_results_name_and_sizes(suite) -> None:
    assert suite.slug("NVIDIA H200") == "nvidia_h200"
    assert suite.slug("NVIDIA A100-SXM4-80GB") == "nvidia_a100_sxm4_80gb"
    assert suite.parse_size("24GiB") == 24 * 2**30 and suite.parse_size("80GB") == 80 * 10**9
    with pytest.raises(Exception, match="24GiB"):
        suite.parse_size("lots")


def test_caps_fit_the_budget(suite) -> None:
    assert sum(p.cap_s for p in suite.PARTS) <= suite.TOTAL_S
    assert [p.key for p in suite.PARTS] == KEYS
    assert all(0 < p.min_s < p.cap_s for p in suite.PARTS)


def test_parse_junit_and_collect_only(suite, tmp_path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="needs fp8"/>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="test_ok2"/>'
        "</testsuite></testsuites>"
    )
    got = suite.parse_junit(xml)
    assert got["counts"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2}
    outcomes = {c["test"]: (c["outcome"], c["message"]) for c in got["cases"]}
    assert outcomes["tests.test_a::test_bad"] == ("failed", "assert 1 == 2")
    assert outcomes["tests.test_b::test_skip"] == ("skipped", "needs fp8")
    text = (
        "tests/test_memory.py::test_cuda_allocator_breakdown\n"
        "tests/test_precision.py::test_matmul_precision_on_ampere_gpu\n\n"
        "2/407 tests collected (405 deselected) in 9.65s\n"
    )
    got = suite.parse_collect_only(text)
    assert got["collected"] == 2 and got["total"] == 407 and len(got["cases"]) == 2


def test_markdown_renders_every_part_shape(suite) -> None:
    """Each part's table renders from rows as the parts write them, and from skipped parts."""
    parts = []
    for p in suite.PARTS:
        parts.append(
            {
                "number": p.number,
                "key": p.key,
                "title": p.title,
                "cap_s": p.cap_s,
                "status": "skipped",
                "reason": "not selected (--parts)",
                "seconds": 0.0,
                "rows": [],
                "figures": {},
                "notes": [],
            }
        )
    rows = {
        "pytest": [{"test": "t::a", "outcome": "passed", "message": ""}],
        "estimate": [
            {
                "model": "HF GPT-2",
                "stack": "fp32",
                "batch": 8,
                "seq": 1024,
                "status": "ok",
                "estimate_bytes": 30 * 2**30,
                "estimate_rounded_bytes": 31 * 2**30,
                "measured_bytes": 29 * 2**30,
                "ratio": 1.03,
                "ratio_rounded": 1.07,
                "within_10pct": True,
            },
            {
                "model": "TinyGPT",
                "stack": "fp32",
                "batch": 8,
                "seq": 1024,
                "status": "skipped: bitsandbytes not installed",
            },
        ],
        "batch": [
            {
                "stack": "plain",
                "precision": "32-true",
                "largest_micro_batch": 6,
                "estimate_bytes": 1,
                "status": "out of memory",
            }
        ],
        "ladder": [
            {"setting": "plain Lightning", "status": "skipped: no size fits the cap"},
            {
                "setting": "ZeRO-2, optimizer offloaded to CPU",
                "estimate_choice": "2.7B",
                "largest_trained": "2.7B",
                "largest_trained_parameters": 2_651_000_000,
                "estimate_tried": [
                    {
                        "model": "2.7B",
                        "device_bytes": 1,
                        "fits_cap": True,
                        "fits_host": False,
                        "host_need_bytes": 5,
                    }
                ],
                "real": [{"model": "2.7B", "status": "ok", "measured_bytes": 3}],
                "status": "ok",
            },
        ],
        "speed": [
            {"variant": "plain", "status": "ok", "tokens_per_s": 1e5, "step_s": 0.08, "mfu": 0.31}
        ],
        "compile": [{"variant": "eager", "status": "skipped: 3 s left in the part's cap"}],
    }
    for part in parts:
        part["rows"] = rows[part["key"]]
    parts[2]["figures"] = {"planner_batch": 32, "planner_tried": [["bf16-mixed", 7, "fits"]]}
    data = {
        "dry_run": False,
        "device": {
            "name": "NVIDIA H200",
            "driver": "580",
            "cuda": "13.0",
            "capability": "9.0",
            "total_memory_bytes": 141 * 10**9,
        },
        "command": "python benchmarks/gpu_suite.py",
        "started": "now",
        "total_s": 400.0,
        "budget_s": 480.0,
        "commit": "abc",
        "environment": {"torch": "2.11"},
        "parts": parts,
    }
    text = suite.markdown(data)
    assert text.startswith("# GPU suite: NVIDIA H200")
    assert (
        "| HF GPT-2 | fp32 | 8 x 1024 | 30.00 GiB | 31.00 GiB | 29.00 GiB | 1.03 | 1.07 | yes | ok |"
        in text
    )
    assert "2.65B" in text and "31.0%" in text and "Planner at batch 32" in text


def test_mfu_peaks_and_flops() -> None:
    parts = _load("_gpu_parts")
    assert parts.peak_bf16("NVIDIA H200") == 989.4e12
    assert parts.peak_bf16("NVIDIA H100 PCIe") == 756.0e12
    assert parts.peak_bf16("NVIDIA H100 80GB HBM3") == 989.4e12
    assert parts.peak_bf16("NVIDIA A100-SXM4-80GB") == 312.0e12
    assert parts.peak_bf16("Tesla T4") is None
    # GPT-2 124M as TinyGPT: 124,439,808 parameters, 786,432 of them the position embedding
    dims = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024}
    model = parts.build_model("tinygpt", dims, "meta")
    n, pos = parts.unique_params(model), parts.pos_params(model)
    assert (n, pos) == (124_439_808, 786_432)
    assert parts.flops_per_token(n, pos, 12, 768, 1024) == 6 * (n - pos) + 12 * 12 * 768 * 1024
