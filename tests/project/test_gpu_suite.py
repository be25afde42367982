"""benchmarks/gpu/suite.py: its dry run works end to end (so the GPU run is known to start), and
its parsers, lookups and output are right. The dry run is the same script on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
KEYS = ["pytest", "estimate", "batch", "ladder", "speed", "compile", "finetune"]


def _load(name: str):
    """The suite's module ``benchmarks/gpu/<name>.py``."""
    return importlib.import_module(f"benchmarks.gpu.{name}")


@pytest.fixture(scope="module")
def suite():
    return _load("suite")


@pytest.fixture(scope="module")
def part1(suite):
    """``pytest_part.py``, part 1 (``pytest -m gpu``), as the suite imported it."""
    return sys.modules["benchmarks.gpu.pytest_part"]


# -- the dry run -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.deepspeed  # the session's build first: the dry run's build step finds them cached
def test_dry_run_writes_every_part(suite, tmp_path) -> None:
    before = sorted(p.name for p in (BENCH / "results").glob("gpu_*"))
    # the caps scale with the budget: 4x the default leaves room for a machine whose cores are
    # shared (idle, the dry run takes about 2 minutes)
    cmd = [sys.executable, "-m", "benchmarks.gpu.suite", "--dry-run", "--out", str(tmp_path)]
    cmd += ["--budget-s", "2160"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md, js, log = (tmp_path / f"gpu_dry_run_cpu.{ext}" for ext in ("md", "json", "log"))
    assert md.exists() and js.exists() and log.exists()
    assert sorted(p.name for p in (BENCH / "results").glob("gpu_*")) == before

    data = json.loads(js.read_text())
    assert data["dry_run"] is True and data["format_version"] == 2
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    for dist in ("torch", "lightning", "deepspeed", "bitsandbytes", "transformers"):
        assert data["environment"][dist]
    assert data["total_s"] > 0 and data["budget_s"] == 2160
    # DeepSpeed's extensions were built (or found) first, outside every part's cap
    assert data["build"]["status"] == "ok" and data["build"]["seconds"] >= 0, data["build"]
    assert "DeepSpeed's CPU extensions: ok" in md.read_text()
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
    for key in ("estimate", "batch", "speed", "compile", "finetune"):
        assert by[key]["status"] in ("ok", "partial") and by[key]["headline"], by[key]
    estimate = [r for r in by["estimate"]["rows"] if "ratio" in r]
    # the dry run's stacks (the first and the last, which holds every technique), both models
    stacks = suite.PROFILES["dry"]["estimate_stacks"]
    assert estimate and [r["stack"] for r in estimate] == stacks * 2, by["estimate"]
    for r in estimate:  # on the CPU the estimate is exact (same storages, tracked both ways)
        assert r["estimate_bytes"] > 0 and abs(r["ratio"] - 1) < 0.05, r
    batch = by["batch"]["rows"]
    # plain, the planner's stack (its chunked loss: the dry run's vocabulary is 8x its width),
    # and the same stack without the chunked loss (issue 28)
    assert len(batch) == 3 and all(r["status"] == "ok" and r["resolved"] for r in batch), batch
    assert "chunked loss" in batch[1]["stack"] and "without the chunked loss" in batch[2]["stack"]
    for r in batch:  # settled by real runs: n trained, n + 1 ran out of the (emulated) cap
        probes = {x["batch"]: x["status"] for x in r["probes"]}
        n = r["largest_real"]
        assert n >= 1 and probes[n] == "ok" and probes[n + 1] == "oom", r
        assert r["pick_status"] in ("ok", "oom") and r["estimate_pick"] in probes
        assert r["largest_measured_bytes"] <= by["batch"]["cap_bytes"]
    assert batch[1]["largest_real"] > batch[0]["largest_real"]  # the planner's stack
    auto = by["batch"]["figures"]["auto_efficient"]  # issue 31: AutoEfficient under the cap
    assert auto["status"] == "ok" and not auto["out_of_memory"], auto
    assert auto["micro_batch"] * auto["accumulation"] == auto["batch"], auto
    assert auto["steps_run"] == auto["steps"] and "AutoEfficient (issue 31)" in md.read_text()
    assert "Every real run" in md.read_text()
    ladder = {r["setting"].split(",")[0]: r for r in by["ladder"]["rows"]}
    assert ladder["plain Lightning"]["largest_trained"]
    # part 5: the ablation, one lever per row (issue 29); CUDA graphs need CUDA
    ablation = [r for r in by["speed"]["rows"] if r.get("table") != "packing"]
    speed = {r["variant"]: r for r in ablation}
    ran = [r for r in ablation if r["status"] == "ok"]
    assert len(ran) == 8 and all(r["tokens_per_s"] > 0 and r["vs_plain"] > 0 for r in ran)
    assert speed["+ CUDA graphs"]["status"].startswith("skipped: CUDA graphs")
    compiled = speed["+ compile (scope auto)"]["compile"]
    assert compiled["scope"] in ("regional", "whole"), compiled
    assert compiled["regional_step_s"] > 0 and compiled["whole_step_s"] > 0
    assert "verdict" in speed["plain Lightning, fp32"]  # the profiler's next lever (or None)
    assert all("levers" in r for r in ran if "without_profiler_of" not in r)
    # the named figures first (the profiler's cost after the ablation), optional rows last
    assert ablation[-1]["variant"] == "+ CUDA graphs" and ablation[-2]["without_profiler_of"]
    assert by["speed"]["figures"]["profiler_overhead"] > 0
    assert "StepProfiler's cost" in md.read_text()
    # issue 52: packing's pair after the ablation, its figure beside the goal (not a GPU one)
    pair = [r for r in by["speed"]["rows"] if r.get("table") == "packing"]
    assert [(r["loader"], r["status"]) for r in pair] == [("padded", "ok"), ("packed", "ok")]
    assert pair[1]["packing"]["path"] == "hf-position-ids" and pair[1]["fill"] > pair[0]["fill"]
    assert by["speed"]["figures"]["packing_speedup"] > 0
    assert "| >= 2x | not measured yet (dry run: " in md.read_text()
    assert {r["variant"] for r in by["compile"]["rows"]} == {"regional", "whole", "eager"}
    assert by["compile"]["figures"]["auto_choice"] in ("regional", "whole")
    # part 7 (issue 39): PEFT LoRA alone and with the QLoRA stack, real runs against estimates
    tune = by["finetune"]["rows"]
    assert [r["status"] for r in tune] == ["ok", "ok", "ok", "ok"], tune
    # issue 52: the QLoRA stack again, in a process of its own with expandable segments
    assert tune[3]["stack"] == tune[1]["stack"], tune[3]
    assert tune[3]["allocator"] == tune[3]["allocator_conf"] == "expandable_segments:True"
    assert tune[1]["allocator_conf"] is None and "allocator" not in tune[1]
    tune = tune[:3]
    assert all(r["tokens_per_s"] > 0 and r["timed_steps"] > 0 for r in tune), tune
    assert abs(tune[0]["ratio"] - 1) < 0.05, tune[0]  # on the CPU the estimate is exact
    # the stack's estimate leaves out the original weights FrozenWeights4bit keeps for its undo
    # (off the device on CUDA; on a CPU the same memory, which the fit's tracker counts)
    assert 0.75 < tune[1]["ratio"] <= 1.05, tune[1]
    assert "FrozenWeights4bit" in " ".join(tune[1]["report"]), tune[1]["report"]
    assert tune[1]["measured_bytes"] < tune[0]["measured_bytes"]  # the stack saves memory
    assert tune[1]["peak_vs_lora"] < 1 and tune[1]["vs_lora"] > 0
    assert "| LoRA | 32-true |" in md.read_text()
    # issue 53: the long-sequence row (boundaries in host memory, tiled layers) at 4x the tokens
    assert tune[2]["seq"] == 4 * tune[1]["seq"] and 0.75 < tune[2]["ratio"] <= 1.05, tune[2]
    assert "**Dry run**" in md.read_text()


# -- the pieces, without running anything --------------------------------------------------------
def test_results_name_and_sizes(suite) -> None:
    assert suite.slug("NVIDIA H200") == "nvidia_h200"
    assert suite.slug("NVIDIA A100-SXM4-80GB") == "nvidia_a100_sxm4_80gb"
    assert suite.parse_size("24GiB") == 24 * 2**30 and suite.parse_size("80GB") == 80 * 10**9
    with pytest.raises(Exception, match="24GiB"):
        suite.parse_size("lots")


def test_caps_fit_the_budget(suite) -> None:
    """Nine minutes: the longest lane of the parts side by side, then the timed parts alone.
    DeepSpeed's build runs alongside; part 4 waits for it within its cap. A part that overruns
    is taken from the last timed part, which the suite gives what is left (or skips)."""
    assert suite.TOTAL_S == 540
    registry = sys.modules["benchmarks.gpu.registry"]  # what the suite imported
    assert suite.PARTS is registry.PARTS  # the suite starts the registry's parts
    assert registry.critical_path_s() <= suite.TOTAL_S, registry.critical_path_s()
    assert [p.key for p in suite.PARTS] == KEYS
    assert [p.number for p in suite.PARTS] == list(range(1, len(KEYS) + 1))
    assert all(0 < p.min_s < p.cap_s and p.basis for p in suite.PARTS)
    assert {p.lane for p in suite.PARTS} == {*suite.PHASE_A, suite.PHASE_B}
    timed = [p.key for p in suite.PARTS if p.lane == suite.PHASE_B]
    assert timed == ["speed", "compile", "finetune"]
    # every part runs unless --parts says otherwise
    args = suite._parser().parse_args([])
    assert {int(x) for x in args.parts.split(",")} == {p.number for p in suite.PARTS}


def test_part1_collects_the_files_with_the_gpu_mark(part1) -> None:
    """Part 1 hands pytest the repository's test files that carry the mark (in any folder of
    tests/), not the whole folder: from benchmarks/gpu/ the repository is two folders up (one up,
    the suite found no tests/ there and collected every file, a minute's imports)."""
    files = part1.gpu_test_files()
    assert files != ["tests"] and all(f.startswith("tests/") for f in files), files
    assert "tests/techniques/test_precision.py" in files
    assert all("mark.gpu" in (ROOT / f).read_text() for f in files)


def test_parse_junit_and_collect_only(part1, tmp_path) -> None:
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
    got = part1.parse_junit(xml)
    assert got["counts"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2}
    outcomes = {c["test"]: (c["outcome"], c["message"]) for c in got["cases"]}
    assert outcomes["tests.test_a::test_bad"] == ("failed", "assert 1 == 2")
    assert outcomes["tests.test_b::test_skip"] == ("skipped", "needs fp8")
    text = (
        "tests/measure/memory/test_memory.py::test_cuda_allocator_breakdown\n"
        "tests/techniques/test_precision.py::test_matmul_precision_on_ampere_gpu\n\n"
        "2/407 tests collected (405 deselected) in 9.65s\n"
    )
    got = part1.parse_collect_only(text)
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
                "estimate_reserved_bytes": 32 * 2**30,
                "reserved_bytes": 30 * 2**30,
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
                "estimate_pick": 6,
                "estimate_bytes": 23 * 2**30,
                "pick_status": "ok",
                "pick_measured_bytes": int(10.96 * 2**30),
                "pick_reserved_bytes": 11 * 2**30,
                "largest_real": 13,
                "smallest_oom": 14,
                "resolved": True,
                "largest_measured_bytes": 22 * 2**30,
                "largest_reserved_bytes": 23 * 2**30,
                "probes": [
                    {"batch": 6, "status": "ok", "peak_bytes": 1, "reserved_bytes": 2},
                    {"batch": 14, "status": "oom", "peak_bytes": None, "wall_s": 7.0},
                ],
                "status": "ok",
            },
            {
                "stack": "planner: bf16-mixed",
                "precision": "bf16-mixed",
                "estimate_pick": 30,
                "estimate_bytes": 1,
                "largest_real": 41,
                "smallest_oom": 48,
                "resolved": False,
                "probes": [],
                "needs_s": 20.0,
                "status": "partial: 41 trained, 48 out of memory; not settled",
            },
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
            {"variant": "plain", "status": "ok", "tokens_per_s": 1e5, "step_s": 0.08, "mfu": 0.31},
            {
                "table": "packing",
                "variant": "padded batches of 8 documents",
                "loader": "padded",
                "precision": "bf16-mixed",
                "batch": 8,
                "status": "ok",
                "tokens_per_s": 120_000.0,
                "step_s": 0.03,
                "fill": 0.31,
            },
            {
                "table": "packing",
                "variant": "SequencePacking: 8 rows of 512 tokens",
                "loader": "packed",
                "precision": "bf16-mixed",
                "batch": 8,
                "status": "ok",
                "tokens_per_s": 300_000.0,
                "step_s": 0.04,
                "fill": 0.996,
                "vs_padded": 2.5,
                "packing": {"fill": 0.997, "padded_fill": 0.301, "path": "hf-position-ids"},
            },
        ],
        "compile": [{"variant": "eager", "status": "skipped: 3 s left in the part's cap"}],
        "finetune": [
            {
                "stack": "LoRA",
                "precision": "bf16-mixed",
                "status": "ok",
                "estimate_bytes": 6 * 2**30,
                "measured_bytes": 5 * 2**30,
                "reserved_bytes": 6 * 2**30,
                "reserved_over_allocated": 1.2,
                "setup_peak_bytes": 2 * 2**30,
                "ratio": 1.2,
                "peak_vs_lora": 1.0,
                "tokens_per_s": 40_000.0,
                "vs_lora": 1.0,
                "step_s": 0.0512,
            },
            {"stack": "LoRA + 4-bit", "status": "skipped: bitsandbytes not installed"},
            {
                "stack": "LoRA + 4-bit",
                "allocator": "expandable_segments:True",
                "status": "skipped: 9 s left in the part's cap, the row needs about 18 s",
            },
        ],
    }
    for part in parts:
        part["rows"] = rows[part["key"]]
        part["spare_s"] = {p.key: p.spare_s for p in suite.PARTS}[part["key"]]
    parts[2]["figures"] = {"planner_batch": 32, "planner_tried": [["bf16-mixed", 7, "fits"]]}
    parts[4]["figures"] = {"packing_speedup": 2.5}
    data = {
        "dry_run": False,
        "device": {
            "name": "NVIDIA H200",
            "driver": "580",
            "cuda": "13.0",
            "capability": "9.0",
            "total_memory_bytes": 141 * 10**9,
        },
        "command": "python -m benchmarks.gpu.suite",
        "started": "now",
        "total_s": 400.0,
        "budget_s": 480.0,
        "commit": "abc",
        "environment": {"torch": "2.11"},
        "parts": parts,
        "build": {"status": "ok", "seconds": 97.4, "part_4_waited_s": 12.0},
    }
    text = suite.markdown(data)
    assert "DeepSpeed's CPU extensions: ok in 97 s" in text and "part 4 waited 12 s" in text
    assert text.startswith("# GPU suite: NVIDIA H200")
    assert (
        "| HF GPT-2 | fp32 | 8 x 1024 | 30.00 GiB | 31.00 GiB | 29.00 GiB | 1.03 | 1.07 | yes "
        "| 32.00 GiB / 30.00 GiB | ok |" in text
    )
    assert "2.65B" in text and "31.0%" in text and "Planner at batch 32" in text
    assert "| plain | 32-true | 6 (23.00 GiB) | ok, 10.96 GiB / 11.00 GiB | **13** |" in text
    assert "| 41 (not settled) |" in text and "- plain: 6 ok 1 B / 2 B; 14 oom (7 s)" in text
    assert (
        "| LoRA | bf16-mixed | 6.00 GiB | 5.00 GiB | 2.00 GiB | 6.00 GiB (1.20x) | 1.20 | 1.00x "
        "| 40,000 | 1.00x | 51.2 ms | ok |" in text
    )
    assert "| LoRA + 4-bit | - | - | - | - | - | - | - | - | - | - | skipped: bitsandbytes" in text
    # issue 52: the allocator row where time was left, and the packing pair beside the ablation
    assert "| LoRA + 4-bit, expandable_segments:True | - |" in text and "skipped: 9 s left" in text
    assert "| SequencePacking: 8 rows of 512 tokens | bf16-mixed | 8 | 300,000 | 40.0 ms " in text
    assert "| 99.6% (rows 99.7%; padded 30.1%) | 2.50x | ok |" in text
    assert "| plain | - | - | 100,000 |" in text and "| padded batches" not in text.split("Pack")[0]
    # each new figure beside its goal: measured here (a GPU run), or not yet
    assert "| Packing: SequencePacking's tokens/s over padded batches, long-tail documents " in text
    assert "| >= 2x | 2.50x | met |" in text
    assert "| Allocator: reserved bytes with expandable_segments over the default's" in text
    assert "| not measured yet | - |" in text
    assert "| 60 (+30 if left) |" in text
    # a dry run's figures are not GPU figures
    dry = suite.markdown({**data, "dry_run": True})
    assert "| not measured yet (dry run: 2.50x) | - |" in dry and "| met |" not in dry


def test_mfu_uses_the_package_peaks_and_flops() -> None:
    """The suite's MFU divides by the package's peak table (no copy of it) and its FLOPs per
    token agree with the package's FLOP counter on the dry run's model."""
    import torch

    from lightning_efficient.measure.speed.flops import GPU_PEAKS, count_flops, gpu_peak

    common = _load("common")
    for key, peaks in GPU_PEAKS.items():
        name = f"NVIDIA {key}"
        got, source = common.bf16_peak(name)
        assert (got, source) == (gpu_peak(name, "bf16") or (None, source)), name
        assert (got is None) == ("bf16" not in peaks), name
    assert common.bf16_peak("a made-up accelerator")[0] is None
    dims = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 512, "seq": 64}
    model = common.build_model("tinygpt", dims, "cpu")
    n, pos = common.unique_params(model), common.pos_params(model)
    assert 0 < pos < n
    per_token = common.flops_per_token(n, pos, dims["n_layer"], dims["n_embd"], dims["seq"])
    ids = torch.zeros(2, dims["seq"], dtype=torch.long)
    counted = count_flops(model, (ids, ids)).step / ids.numel()
    assert abs(per_token / counted - 1) < 0.02, (per_token, counted)


def test_every_part_runs_a_script_of_its_own() -> None:
    """One registry: each part but pytest names the script its process runs, and that script
    hands a part function of its own module to ``child_main`` (no other table of parts)."""
    import ast
    import inspect

    registry = _load("registry")
    scripts = [p for p in registry.PARTS if p.script]
    assert [p.key for p in registry.PARTS if not p.script] == ["pytest"]
    assert len({p.script for p in scripts}) == len(scripts)
    for part in scripts:
        tree = ast.parse(part.path.read_text())
        mains = [
            n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
        ]
        called = [
            c.args[0].id
            for m in mains
            for c in ast.walk(m)
            if isinstance(c, ast.Call)
            and getattr(c.func, "id", None) == "child_main"
            and isinstance(c.args[0], ast.Name)
        ]
        assert len(called) == 1, part.script
        module = _load(part.path.stem)
        run = getattr(module, called[0])
        assert inspect.isfunction(run) and run.__module__ == module.__name__, part.script
        assert list(inspect.signature(run).parameters) == ["ctx", "rec"], part.script


def test_finetune_part_says_peft_is_missing(suite, tmp_path, monkeypatch) -> None:
    """The GPU machine's image may lack peft: part 7 then writes its rows as skipped with the
    package's name, instead of failing."""
    import time

    common = _load("common")
    finetune = _load("finetune")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    ctx = common.Ctx(
        dry_run=True,
        device="cpu",
        device_name="cpu",
        profile=suite.PROFILES["dry"],
        deadline=time.time() + 60,
        result_file=str(tmp_path / "part.json"),
        work_dir=str(tmp_path),
        cap_bytes=0,
        host_ram_bytes=0,
    )
    rec = common.Recorder(ctx.result_file)
    finetune.part_finetune(ctx, rec)
    written = json.loads(Path(ctx.result_file).read_text())
    statuses = [r["status"] for r in written["rows"]]
    assert statuses == ["skipped: peft not installed"] * len(finetune.STACKS), statuses
    assert written["status"] == "partial" and "peft not installed" in written["reason"]


def test_gpu_tests_skip_without_torchao_and_nbformat(part1, tmp_path, monkeypatch, capsys) -> None:
    """The GPU machine's image has no torchao and no nbformat: there the FP8 test failed and the
    tutorials' file was a collection error. Both skip now, with the reason (run here as if CUDA
    were present, so that the GPU marker does not skip the FP8 test first). In this process, as
    a fresh one would run them: the packages hidden and both test files imported anew (a fresh
    interpreter for this cost ~12 CPU-s of imports)."""
    import torch

    for name in ("torchao", "nbformat", "nbclient"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    for name in [
        m for m in sys.modules if m.rsplit(".", 1)[-1] in ("test_precision", "test_notebooks")
    ]:
        monkeypatch.delitem(sys.modules, name)  # imported anew, put back after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.chdir(ROOT)
    junit = tmp_path / "r.xml"
    args = [
        "tests/techniques/test_precision.py::test_float8_training_on_fp8_gpu",
        "tests/project/test_notebooks.py",
    ]
    args += ["-q", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={junit}"]
    code = pytest.main(args)
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    got = part1.parse_junit(junit)
    assert got["counts"]["failures"] == got["counts"]["errors"] == 0, got
    assert [c["outcome"] for c in got["cases"]] == ["skipped", "skipped"], got["cases"]
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert any("test_precision.py" in ln and "needs torchao" in ln for ln in skips), skips
    assert any("test_notebooks.py" in ln and "notebooks extra" in ln for ln in skips), skips


# -- part 3: the real largest micro-batch --------------------------------------------------------
def _device(largest: int, fixed: int = 1000, per_sample: int = 100, lumpy: bool = False):
    """A made-up device on which micro-batch ``n`` peaks at ``fixed + per_sample * n`` bytes
    (``lumpy``: plus a block every 7 samples, as an allocator's rounding adds), under a cap that
    lets exactly ``largest`` through."""

    def peak(n: int) -> int:
        return fixed + per_sample * n + (per_sample * 3 * (n // 7) if lumpy else 0)

    cap = peak(largest)
    assert peak(largest + 1) > cap
    return peak, cap


def _search(suite_search, pick: int, largest: int, k: int, top: int = 256, **device):
    search_mod = suite_search
    peak, cap = _device(largest, **device)
    # the estimate's own points: off by the same factor everywhere (here: pick / largest)
    factor = largest / max(pick, 1)
    estimate = {1: peak(1) * factor, top: peak(top) * factor}
    s = search_mod.LargestSearch("t", pick, top, cap, estimate=estimate)
    rounds = 0
    while not s.done:
        sizes = s.next_sizes(k)
        assert sizes and len(sizes) <= k and all(1 <= n <= top for n in sizes)
        assert not any(s.tried(n) for n in sizes)
        for n in sizes:
            ok = peak(n) <= cap
            s.record(search_mod.Probe(n, "ok" if ok else "oom", peak(n) if ok else None))
        rounds += 1
        assert rounds < 20
    return s, rounds


@pytest.fixture(scope="module")
def search_mod():
    return _load("search")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "pick,largest",
    [(6, 13), (13, 6), (6, 6), (40, 58), (1, 1), (100, 256), (3, 200)],
    ids=["estimate-2x-high", "estimate-2x-low", "exact", "stack", "one", "top", "far"],
)
def test_search_finds_the_real_largest(search_mod, pick, largest, k) -> None:
    s, rounds = _search(search_mod, pick, largest, k)
    got = s.result()
    assert got["largest_real"] == largest and got["resolved"], got
    assert got["smallest_oom"] == (None if largest == 256 else largest + 1)
    assert got["pick_status"] == ("ok" if pick <= largest else "oom")  # the pick is always run
    # a straight line settles it in a few rounds, whichever side the estimate is on
    assert rounds <= (4 if k > 1 else 6), (rounds, [p.batch for p in s.probes])


@pytest.mark.parametrize("k", [1, 3])
def test_search_settles_when_memory_is_not_a_straight_line(search_mod, k) -> None:
    for largest in (9, 20, 33, 47):
        s, _ = _search(search_mod, largest // 2, largest, k, lumpy=True)
        assert s.result()["largest_real"] == largest and s.result()["resolved"]


def test_search_stops_at_an_error_and_when_nothing_fits(search_mod) -> None:
    s = search_mod.LargestSearch("t", 8, 64, 10_000)
    s.record(search_mod.Probe(8, "error: RuntimeError: boom"))
    assert s.done and s.next_sizes(4) == [] and s.result()["error"].startswith("batch 8")
    assert not s.result()["resolved"]
    s = search_mod.LargestSearch("t", 4, 64, 10_000)
    for n in (4, 8, 2, 1):
        s.record(search_mod.Probe(n, "oom"))
    got = s.result()
    assert s.done and got["largest_real"] == 0 and got["smallest_oom"] == 1 and got["resolved"]


def test_suite_runs_where_the_package_is_not_installed(tmp_path) -> None:
    """On the GPU machine the project is not installed and the documented command
    (``python -m benchmarks.gpu.suite`` at the repository root) has no PYTHONPATH: run here with
    every installed copy of the package hidden, it finds the repository's own (``-m`` puts the
    working folder on the path), and so do its parts' processes."""
    shim = (
        "import importlib.machinery, os, runpy, sys\n"
        f"ROOT = {str(ROOT)!r}\n"
        "class NotInstalled:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'lightning_efficient':\n"
        "            return None\n"
        "        here = [p for p in sys.path if os.path.abspath(p or '.') == ROOT]\n"
        "        spec = importlib.machinery.PathFinder.find_spec(name, here) if here else None\n"
        "        if spec is None:\n"
        "            raise ModuleNotFoundError(\"No module named 'lightning_efficient'\")\n"
        "        return spec\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
        "runpy.run_module('benchmarks.gpu.suite', run_name='__main__', alter_sys=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", shim, "--dry-run", "--parts", "0", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_dry_run_cpu.json").read_text())
    assert [p["status"] for p in data["parts"]] == ["skipped"] * len(KEYS)
    assert data["environment"]["host RAM"]  # written by the package's format_bytes


# -- issue 52: packing's pair in part 5, the allocator row of part 7 ---------------------------
def _ctx(suite, tmp_path, seconds: float):
    """A dry run's context for a part run here, with ``seconds`` before its deadline."""
    import time

    common = _load("common")
    return common, common.Ctx(
        dry_run=True,
        device="cpu",
        device_name="cpu",
        profile=suite.PROFILES["dry"],
        deadline=time.time() + seconds,
        result_file=str(tmp_path / "part.json"),
        work_dir=str(tmp_path),
        cap_bytes=0,
        host_ram_bytes=0,
    )


@pytest.mark.slow
def test_packing_pair_dry_run(suite, tmp_path) -> None:
    """Part 5's packing pair as the part runs it (on the CPU, in this process): padded batches
    of the long-tail documents, then SequencePacking's rows; tokens/s counts the documents' own
    tokens, so the ratio is the packer's gain (the fill of the timed steps shows why)."""
    common, ctx = _ctx(suite, tmp_path, 120)
    speed = _load("speed")
    run = sys.modules["benchmarks.gpu.run"]
    rec = common.Recorder(ctx.result_file)
    pool = run.RunPool(ctx)
    for name, spec in speed._packing_specs(ctx):
        speed._packing_row(ctx, rec, pool, name, spec)
    speed._finish_speed(rec)
    padded, packed = rec.data["rows"]
    assert [r["status"] for r in (padded, packed)] == ["ok", "ok"], rec.data["rows"]
    assert padded["loader"] == "padded" and packed["loader"] == "packed"
    assert padded["table"] == packed["table"] == "packing"
    assert padded["tokens_per_s"] > 0 and packed["timed_steps"] > 0
    packer = packed["packing"]  # the callback's own report: rows it built, the path it chose
    assert packer["path"] == "hf-position-ids" and packer["check_error"] < 1e-5, packer
    # the timed steps' fill (padded: 1 to 4 seeded batches, 0.29-0.66 each) and the packer's
    # own figures over every document
    assert packed["fill"] > 0.9 > 0.7 > padded["fill"] > 0, (packed["fill"], padded["fill"])
    assert packer["fill"] > 0.9 > 0.6 > packer["padded_fill"], packer
    assert padded["packing"] is None
    ratio = rec.data["figures"]["packing_speedup"]
    assert ratio == packed["vs_padded"] == packed["tokens_per_s"] / padded["tokens_per_s"]
    assert f"packing {ratio:.2f}x" in rec.data["headline"]
    # not rows of the ablation: no plain run, no speed-up, no profiler overhead read from them
    assert "speedup" not in rec.data["figures"] and "profiler_overhead" not in rec.data["figures"]


def test_ablation_keeps_the_packing_pairs_time(suite, tmp_path) -> None:
    """A row of the ablation that would eat into the packing pair's time is skipped, saying so;
    the pair itself is skipped only when less than half of its time is left for a run."""
    common, ctx = _ctx(suite, tmp_path, 25)
    speed = _load("speed")
    rec = common.Recorder(ctx.result_file)
    keep = ctx.profile["packing"]["need_s"]
    assert 0 < keep < 25 < 20 + keep
    name, spec = speed._rows_specs(ctx, common.gpt2_dims(ctx))[0]
    res, _ = speed._timed_row(ctx, rec, None, name, spec, None, 1, None, keep)
    assert res is None and "kept for the packing rows" in rec.data["rows"][0]["status"]
    ctx.deadline -= 25 - keep / 2 + 1  # less than half the pair's time left
    name, spec = speed._packing_specs(ctx)[0]
    speed._packing_row(ctx, rec, None, name, spec)
    assert rec.data["rows"][1]["status"].startswith("skipped: ") and rec.data["rows"][1]["needs_s"]


def test_spare_time_only_where_the_budget_has_it(suite) -> None:
    """Part 7's allocator row runs where time is left: the part may take its ``spare_s`` past
    its cap, from what the budget holds once later parts' caps are kept (never their time)."""
    part = next(p for p in suite.PARTS if p.key == "finetune")
    assert part.spare_s > 0 and part.lane == suite.PHASE_B
    cap, spare = part.cap_s, part.spare_s
    assert suite.time_for(part, [], 540 - 200, 540, 1.0) == (200, cap + spare)
    assert suite.time_for(part, [], 540 - 70, 540, 1.0) == (70, 70)  # what is left
    assert suite.time_for(part, [], 540 - 40, 540, 1.0) == (40, 40)  # under its cap too
    later = suite.Part(9, "later", "a later timed part", 40, 20, suite.PHASE_B, "-", "x.py")
    assert suite.time_for(part, [later], 540 - 200, 540, 1.0) == (180, cap + spare)
    assert suite.time_for(part, [later], 540 - 100, 540, 1.0) == (80, cap)  # later's cap kept
    # part 5 (the ablation, then the packing pair) too, before part 7: it keeps part 7's
    # minimum, and takes spare time only where part 7's whole cap is left
    speed = next(p for p in suite.PARTS if p.key == "speed")
    assert suite.time_for(speed, [part], 200, 540, 1.0) == (315, speed.cap_s + speed.spare_s)
    left, timeout = suite.time_for(speed, [part], 540 - 200, 540, 1.0)
    assert left == 200 - part.min_s and timeout == speed.cap_s
    # every other part: as before, at most its cap
    compiled = next(p for p in suite.PARTS if p.key == "compile")
    assert compiled.spare_s == 0
    assert suite.time_for(compiled, [part], 0, 540, 1.0) == (540 - part.min_s, compiled.cap_s)


@pytest.mark.slow
def test_allocator_row_dry_run(suite, tmp_path) -> None:
    """Part 7's allocator row trains in a process of its own whose environment holds the
    setting before torch starts (on the CPU too, where it changes nothing): the run says it saw
    it. Its reserved bytes against the default's: the ratio of the same stack's two rows."""
    common, ctx = _ctx(suite, tmp_path, 240)
    finetune = _load("finetune")
    run = sys.modules["benchmarks.gpu.run"]
    f = ctx.profile["finetune"]
    dims = {k: f[k] for k in ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate")}
    dims.update(vocab=f["vocab"], seq=f["seq"], dtype=f["dtype"], lora_r=f["lora_r"])
    rec = common.Recorder(ctx.result_file)
    spare = run.RunPool(ctx, env=finetune.ALLOCATOR)
    name, techniques = finetune.STACKS[finetune.QLORA]
    try:
        finetune._run_row(ctx, rec, spare, name, techniques, dims, None, allocator=True)
    finally:
        spare.close()
    row = rec.data["rows"][0]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0, row
    assert row["allocator"] == row["allocator_conf"] == "expandable_segments:True", row
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") is None  # this process: as it was
    # beside the same stack's default row (CUDA figures made up: the CPU reserves nothing)
    default = {"stack": name, "status": "ok", "measured_bytes": 100, "reserved_bytes": 150}
    rec.data["rows"] = [default, {**row, "measured_bytes": 100, "reserved_bytes": 99}]
    assert finetune._finish_allocator(rec) == "; expandable segments: reserved 0.66x the default's"
    assert rec.data["figures"]["expandable_reserved_ratio"] == 99 / 150
    assert default["reserved_over_allocated"] == 1.5


def test_packing_script_takes_out(tmp_path) -> None:
    """``benchmarks/packing.py`` (part 5's packing workload on the CPU) writes ``STEM.md`` and
    ``STEM.json`` where ``--out STEM`` says, as every script does, not its committed results."""
    import torch

    results = BENCH / "results" / "packing_quick.json"
    before = results.stat().st_mtime_ns if results.exists() else None
    threads = torch.get_num_threads()
    try:
        assert (
            importlib.import_module("benchmarks.packing").main(
                ["--quick", "--docs", "16", "--out", str(tmp_path / "p")]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)  # the script takes one thread
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["documents"] == 16 and data["ratio_tokens_per_s"] > 0, data
    assert "packed rows against padded batches (16 documents)" in (tmp_path / "p.md").read_text()
    assert (results.stat().st_mtime_ns if results.exists() else None) == before


def _kill_processes_of(folder: Path) -> None:
    """Kill, by id, the processes whose command line names ``folder`` (a stopped suite's parts:
    each in a session of its own, they outlive it)."""
    import signal

    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(folder) in (proc / "cmdline").read_text():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.slow
def test_a_stopped_suite_leaves_every_part_that_ended(suite, tmp_path) -> None:
    """The results are written after every part (atomically), not only at the suite's end: a
    suite killed from outside (a device command at its time limit) still leaves the parts that
    ended, and the Markdown names the parts that did not. Part 1 (pytest, phase A), then part 6
    (phase B); the suite is killed once part 6 has started."""
    import signal
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.gpu.suite", "--dry-run", "--parts", "1,6"]
    cmd += ["--budget-s", "2160", "--out", str(out)]  # 4x caps: cores shared (as above)
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the suite's work folder: its parts' files
    printed = open(tmp_path / "printed.txt", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=printed, stderr=subprocess.STDOUT, start_new_session=True
    )
    js, md = out / "gpu_dry_run_cpu.json", out / "gpu_dry_run_cpu.md"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            # once part 6 has started: written after part 1 ended, and the last write until
            # part 6 ends (the .md is written before the .json: both are whole)
            if js.exists() and json.loads(js.read_text())["parts"][5]["status"] == "running":
                break
            time.sleep(0.1)
        said = (tmp_path / "printed.txt").read_text()[-3000:]
        assert proc.poll() is None, "the suite ended before it could be stopped:\n" + said
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        _kill_processes_of(tmp_path)
        printed.close()
    data = json.loads(js.read_text())
    by = {p["key"]: p for p in data["parts"]}
    assert by["pytest"]["status"] == "ok" and by["pytest"]["rows"], by["pytest"]
    assert by["compile"]["status"] == "running", by["compile"]
    assert by["estimate"]["status"] == "skipped"  # not selected: written with part 1
    text = md.read_text()
    assert "## 1. pytest -m gpu" in text and "| collected |" in text
    assert "parts that did not finish: 6 (running)" in text
    assert not [p.name for p in out.iterdir() if p.suffix == ".tmp" and "log" not in p.name]
    assert (out / "gpu_suite.log.tmp").exists()  # the parts' output so far, beside it


def test_speed_part_runs_the_named_figures_before_optional_rows(
    suite, tmp_path, monkeypatch
) -> None:
    """Part 5 at its cap (142 s to its deadline) with rows of the ~14.4 s estimated for a GPU
    (130 s for 9) and packing runs of 10 s: the ablation, the profiler's cost and the packing
    pair all run, and the optional CUDA graphs row, last, is the one skipped, saying why. Runs
    stand in for the run processes here: each returns at once and moves the part's deadline by
    its time. Before, CUDA graphs came before the profiler's cost, which was the row skipped;
    the profiler's cost needs its stack's time (it runs the same stack), not 1.2x as a new lever."""
    common, ctx = _ctx(suite, tmp_path, 142)
    speed = _load("speed")
    ctx.device, ctx.device_name, ctx.profile = (
        "cuda",
        "NVIDIA H100 80GB HBM3",
        suite.PROFILES["gpu"],
    )
    submitted: list[dict] = []

    class Runs:  # RunPool's interface: submit, then wait for the results
        def __init__(self, ctx, **_) -> None:
            pass

        def submit(self, spec, timeout, isolate=False):
            submitted.append(spec)
            return spec

        def wait(self, runs):
            spec = runs[0]
            packing = spec["model"] == "llama_docs"
            wall = 10.0 if packing else 14.4
            ctx.deadline -= wall
            step = 0.1 if packing or spec["callbacks"][-1:] == [speed.PROFILER] else 0.0995
            return [{"ok": True, "tokens_per_s": 1000 / step, "step_s": step, "wall_s": wall}]

        def close(self) -> None:
            pass

    monkeypatch.setattr(speed, "RunPool", Runs)
    rec = common.Recorder(ctx.result_file)
    speed.part_speed(ctx, rec)
    rows = rec.data["rows"]
    names = [r["variant"] for r in rows]
    last = speed.ABLATION[-1][0]
    assert names[: len(speed.ABLATION)] == [n.format(effective=16) for n, _ in speed.ABLATION]
    assert names[len(speed.ABLATION)] == f"{last} without StepProfiler"
    assert [r.get("loader") for r in rows[-3:-1]] == ["padded", "packed"]
    assert names[-1] == "+ CUDA graphs" and len(rows) == len(speed.ABLATION) + 4
    assert all(r["status"] == "ok" for r in rows[:-1]), [(r["variant"], r["status"]) for r in rows]
    assert rows[-1]["status"].startswith("skipped: 7 s left") and "optional" in rows[-1]["status"]
    figures = rec.data["figures"]
    assert figures["profiler_overhead"] == pytest.approx(0.1 / 0.0995)
    assert figures["profiler_overhead_row"] == last and figures["packing_speedup"] == 1.0
    assert rows[0]["mfu"] > 0  # P3: MFU on a device of the package's table
    assert rec.data["status"] == "partial" and "optional" in rec.data["reason"]
    text = sys.modules["benchmarks.gpu.markdown"].RENDER["speed"]({"key": "speed", **rec.data})
    assert f"on {last}: **1.005x**" in text and "optional, run last" in text


@pytest.mark.slow
def test_ladder_waits_for_the_build_within_its_cap(suite, tmp_path) -> None:
    """Part 4's ZeRO rows wait for DeepSpeed's build only while the part's cap leaves a ZeRO
    run its time; then they are skipped, saying why, and the part ends within its deadline (the
    wait was extra time past the cap, up to 300 s, that later parts lost)."""
    import time

    common, ctx = _ctx(suite, tmp_path, 45)
    ctx.profile = {**ctx.profile, "zero_need_s": 30.0}
    ctx.cap_bytes = suite.DRY_CAPS["ladder"]
    ctx.host_ram_bytes = 16 * 2**30
    ctx.prebuild_done = str(tmp_path / "prebuild.json")  # a build that never ends
    ladder = _load("ladder")
    rec = common.Recorder(ctx.result_file)
    ladder.part_ladder(ctx, rec)
    assert time.time() < ctx.deadline  # within the cap, no time added to it
    rows = {r["setting"].split(",")[0]: r for r in rec.data["rows"]}
    assert rows["plain Lightning"]["status"] == "ok", rows["plain Lightning"]
    for name in ("ZeRO-2", "ZeRO-3"):
        status = rows[name]["status"]
        assert status.startswith("skipped: DeepSpeed's cpu_adam extension still building with ")
        assert "a ZeRO run needs about 30 s" in status, status
    assert 0 <= rec.data["figures"]["build_wait_s"] < 45
    assert rec.data["status"] == "partial" and "still building" in rec.data["reason"]
    # a finished build: no wait
    Path(ctx.prebuild_done).write_text(json.dumps({"status": "ok"}))
    assert ladder.wait_prebuild(ctx, 1.0)[0] == "ok"
