"""What a new user installs and runs: the base install has every package the suite is built on
(so every technique and the README's first command work after ``pip install -e .``), the extras
hold what a technique merely supports, and ``.ci/run`` runs the README's commands as written."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_efficient.core import _internals as I
from lightning_efficient.core import validate

ROOT = Path(__file__).parents[2]
#: The design card's packages, and what the base needs besides (the CLI's yaml, the report).
BASE = {"torch", "lightning", "deepspeed", "bitsandbytes", "torchmetrics", "jsonargparse", "rich"}
#: What a technique merely supports.
EXTRAS = {
    "hf": {"transformers"},
    "fp8": {"torchao"},
    "bf16": {"torch-optimi", "torchao"},
    "plot": {"matplotlib"},
    "notebooks": {"nbformat", "nbclient", "ipykernel", "matplotlib"},
}


def _requirements(text: str) -> dict[str, str]:
    """``name -> requirement`` of a setup.cfg list (comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out[re.split(r"[\[<>=!~ ]", line, maxsplit=1)[0]] = line
    return out


@pytest.fixture(scope="module")
def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def test_the_base_install_has_every_package_the_suite_is_built_on(setup_cfg) -> None:
    base = _requirements(setup_cfg["options"]["install_requires"])
    assert set(base) == BASE
    assert base["jsonargparse"].startswith("jsonargparse[signatures]")


def test_extras_hold_only_what_a_technique_merely_supports(setup_cfg) -> None:
    extras = {k: set(_requirements(v)) for k, v in setup_cfg["options.extras_require"].items()}
    assert set(extras) == {*EXTRAS, "dev"}
    for name, packages in EXTRAS.items():
        assert extras[name] == packages, name
    assert not any(packages & BASE for packages in extras.values())
    assert set().union(*EXTRAS.values()) <= extras["dev"]  # the tests use every extra


def test_tested_ranges_are_the_install_ranges(setup_cfg) -> None:
    base = _requirements(setup_cfg["options"]["install_requires"])
    for package, (low, high) in I.TESTED.items():
        major, minor = high.split(".")
        assert f">={low}" in base[package] and f"<{major}.{int(minor) + 1}" in base[package], (
            package,
            base[package],
            (low, high),
        )


def test_a_missing_requirement_names_its_range(monkeypatch) -> None:
    from importlib import metadata

    requires = ["deepspeed<0.20,>=0.14", 'transformers>=4.40; extra == "hf"']
    monkeypatch.setattr(metadata, "requires", lambda dist: requires)
    err = validate.missing_requirement("deepspeed", "ZeROOffload")
    assert isinstance(err, ImportError)
    assert "ZeROOffload needs `deepspeed`, an install requirement" in str(err)
    assert str(err).endswith("pip install 'deepspeed<0.20,>=0.14'")
    # an extra's package is no requirement: the bare name
    assert str(validate.missing_requirement("transformers", "x")).endswith("'transformers'")


# -- .ci/run ----------------------------------------------------------------------------------------
def test_ci_parses_the_readme_commands() -> None:
    out = subprocess.run(
        ["bash", ".ci/run", "--print-commands"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    demo, tests = out.stdout.splitlines()
    readme = (ROOT / "README.md").read_text()
    # the demo command is the README's first command, and it installs the base only
    assert demo == re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    installs = [part.strip() for part in demo.split("&&") if part.strip().startswith("pip")]
    assert installs == ["pip install torch==2.13.0", "pip install -e ."]
    assert demo.endswith("lightning-efficient fit --config configs/demo.yaml")
    assert tests.startswith("pip install torch==2.13.0 && pip install -e '.[dev]'")
    assert "python -m pytest" in tests


def _fake_repo(tmp_path: Path, demo: str) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (repo / "README.md").write_text(
        f"<!-- demo-command: x -->\n```bash\n{demo}\n```\n"
        "<!-- test-command: x -->\n```bash\ntrue\n```\n"
    )
    return repo


#: What pip (``pip install -e .``) and Python write into the checkout: allowed to appear.
_ALLOWED = "mkdir -p x.egg-info a/__pycache__ && touch x.egg-info/PKG-INFO a/__pycache__/m.pyc"


@pytest.mark.parametrize(
    "demo,error",
    [
        (
            f"{_ALLOWED} && echo run > lightning_logs.txt",
            "left files in the working folder:\n  ./lightning_logs.txt\n",
        ),
        ("exit 2", "the README's first command failed (exit code 2)"),
    ],
    ids=["leaves-a-file", "fails"],
)
def test_ci_fails_when_the_demo_fails_or_leaves_a_file(tmp_path, demo, error) -> None:
    """The demo's check, on a repository whose first command is a stand-in (nothing installed):
    it runs in a copy of the checkout; pip's and Python's files are allowed, nothing else."""
    repo = _fake_repo(tmp_path, demo)
    out = subprocess.run(
        ["bash", ".ci/run", "--demo-only"], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.endswith(error) or error in out.stderr, out.stderr
    assert "the README's first command took" in out.stdout
    assert sorted(p.name for p in repo.iterdir()) == [".ci", "README.md"]  # ran in a copy
